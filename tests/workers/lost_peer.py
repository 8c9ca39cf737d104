"""Worker (one of two gloo ranks): rank 1 blocks where megatron-core waits on an async
collective's handle (the tensor-parallel backward's ``handle.wait()``) while rank 0, which only
joins the group, is SIGKILLed by the test from outside.

Rank 1 arms a :class:`StackWatchdog` for the wait (its dump is what a hang leaves), writes
``<out>.waiting`` once the dump exists, and after the peer's death writes to ``<out>``: what
:func:`raised_in_collective` and :func:`failure_cause` make of the real exception, its message
and innermost frame, and the stack dump as the post-mortem reads it. Also the same verdicts for
a ConnectionError raised by plain code (no collective): the control.
argv: rank, store port, out path, stacks dir.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

warnings.simplefilter("ignore")


def main(rank: int, port: int, out: Path, stacks: Path) -> None:
    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    dist.all_reduce(torch.ones(4))  # the pair is connected before the test kills rank 0
    if rank == 0:
        time.sleep(600)  # killed from outside
        return
    from megatron.core.tensor_parallel.layers import (
        linear_with_grad_accumulation_and_async_allreduce,
    )

    from pretrain.context.failures import classify
    from resiliency.monitor.evidence import failure_cause, raised_in_collective
    from resiliency.monitor.stacks import StackWatchdog, read_stack_dump, stack_path

    weight = torch.randn(8, 4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    y = linear_with_grad_accumulation_and_async_allreduce(
        x, weight, None, False, True, False, tp_group=dist.group.WORLD
    )
    watchdog = StackWatchdog(stack_path(stacks, rank, os.getpid()), rank)
    watchdog.arm("step", 1.0)  # dumps at 0.9 s, while the main thread waits on rank 0

    def announce() -> None:
        while not (read_stack_dump(watchdog.path) or {}).get("dumped"):
            time.sleep(0.05)
        Path(f"{out}.waiting").write_text("dumped")

    threading.Thread(target=announce, daemon=True).start()
    try:
        y.sum().backward()  # rank 0 never enters the all-reduce: blocks until it dies
        raise SystemExit("the all-reduce finished without rank 0")
    except RuntimeError as exc:
        lost = exc
    dump = read_stack_dump(watchdog.path)
    try:
        raise ConnectionError("connection reset by peer while reading the corpus index")
    except ConnectionError as exc:
        plain = exc
    report = {
        "message": str(lost)[:300],
        "innermost": traceback.extract_tb(lost.__traceback__)[-1].filename,
        "lost": [
            raised_in_collective(lost),
            failure_cause(classify(lost), raised_in_collective(lost)),
        ],
        "plain": [
            raised_in_collective(plain),
            failure_cause(classify(plain), raised_in_collective(plain)),
        ],
        "dump": {k: dump[k] for k in ("dumped", "in_collective", "top_frames")},
    }
    out.write_text(json.dumps(report))
    os._exit(0)  # the group is broken: no orderly teardown


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
