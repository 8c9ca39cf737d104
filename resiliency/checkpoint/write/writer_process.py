"""The body of a rank's checkpoint writer process (spawned by :mod:`async_writer`).

Kept apart from the rank-side code so that spawning it imports nothing heavy before
:func:`pretrain.platform.compat.lean_writer_imports` is in place: the writer needs megatron-core's
write function, not the model code that megatron-core's package import drags in.
"""

from __future__ import annotations

import ctypes
import os
import signal
from typing import Any

from pretrain.context.process_names import WRITER, name_this_process
from pretrain.platform.compat import lean_writer_imports

WRITER_NICE = 19
# Signals that are the rank's to answer: Slurm sends SIGTERM/SIGUSR1 to every process of a
# step, torchrun SIGINT to the rank's whole session on a Ctrl-C.
WRITER_IGNORES = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def die_with_parent(parent: int | None = None) -> None:
    """For helper processes of a rank (the checkpoint writer): SIGKILLed when the rank dies,
    deaf to the SIGTERM/SIGUSR1 that Slurm sends every process of a step, and to SIGINT (a
    Ctrl-C is the rank's to answer). ``parent``: the rank's pid; a rank that died before this
    ran (a spawned child needs seconds to get here) sent no signal, so the child leaves at
    once instead of living on as an orphan."""
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if parent is not None and os.getppid() != parent:
        os._exit(0)
    # Outlive the rank's emergency save (the rank stops the writer when it is done). The
    # spawning rank blocked these until now; once ignored, any that came while blocked are
    # discarded on unblocking.
    for sig in WRITER_IGNORES:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, WRITER_IGNORES)


def writer_main(requests: Any, done: Any, checksum_queue: Any, parent: int) -> None:
    """Writer process: run each save's write function; report (call_idx, error or None)."""
    die_with_parent(parent)
    name_this_process(WRITER)  # what an operator (or the soak) sees in ps
    # What the first save's write function needs, loaded now: the process starts with the
    # run, so this overlaps the model build, the restore and the first steps instead of
    # blocking a save. At the rank's priority: at nice 19 beside busy ranks, these seconds of
    # imports once took so long on a loaded 2-core host that the first saves blocked past the
    # checkpointing timeout, waiting for a writer that was still starting.
    with lean_writer_imports():
        import megatron.core.dist_checkpointing.strategies.filesystem_async  # noqa: F401
        import megatron.core.dist_checkpointing.strategies.torch  # noqa: F401

        from resiliency.checkpoint.write.shard_writer import install_writer_checksums
    install_writer_checksums(checksum_queue)
    os.nice(WRITER_NICE)
    while True:
        item = requests.get()
        if item is None:
            return
        call_idx, fn, args, kwargs = item
        try:
            fn(*args, **kwargs)
            done.put((call_idx, None))
        except Exception as exc:  # noqa: BLE001 - reported to the rank, which fails the save
            done.put((call_idx, f"{type(exc).__name__}: {exc}"))
        del item, fn, args, kwargs
