"""Benchmark worker, run under torchrun by ``python -m bench``: one mode per invocation.

* ``save``: P1 (sync save vs. raw fsync'd write) and P2 (async blocking vs. memcpy, step slowdown)
* ``overhead``: P5 (framework steps with every hook vs. a bare megatron-core loop, same process)

Baseline and subject repetitions are interleaved in the same process, so machine drift hits both.
Rank 0 writes the raw samples as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import warnings
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

# Project, torch and megatron-core imports stay inside the modes: the CPU shim must come first.

warnings.simplefilter("ignore")
MIB = 1 << 20


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def _next_step_dir(trainer: Any) -> None:
    """Saves after this go to a new step dir: the loop position moves on, nothing else."""
    trainer.load_state_dict({**trainer.state_dict(), "step": trainer.state.step + 1})


def _setup(overrides: list[str], with_hooks: bool) -> tuple[Any, Any, list[Any]]:
    from pretrain.platform.distributed import init_distributed, launch_env
    from pretrain.train.session import build_trainer
    from recipes import load_config
    from recipes.validate import validate_runtime

    run = load_config(overrides)
    dp = validate_runtime(run, launch_env()[1], "cpu")
    env = init_distributed("cpu")
    run_dir = Path(run.output_dir) / run.run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    hooks: list[Any] = []
    if with_hooks:
        from pretrain.train.reporting import reporting_hooks
        from resiliency.hooks import build_hooks

        # Every hook a run has by default, TensorBoard included (as pretrain/train/session.py).
        hooks = build_hooks(run, env, run_dir) + reporting_hooks(run, env.rank, run_dir)
        for hook in hooks:
            run = hook.configure(run, dp)
    trainer = build_trainer(run, env, dp, run_dir, hooks)
    return trainer, env, hooks


# ---------------------------------------------------------------- baselines
def raw_write(directory: Path, rank: int, source: memoryview, early: bool = False) -> float:
    """Every rank writes its share sequentially (8 MiB writes) and fsyncs; barrier to barrier.
    ``source`` holds as many bytes as the rank's share of the checkpoint, in memory of its own:
    a save has to read every byte it writes from RAM, so the baseline does too (8 MiB written
    over and over from one buffer would come from the CPU's cache). ``early``: start the
    kernel's writeback as the file grows, as the checkpoint's writers do (storage/writeback.py)."""
    from resiliency.storage.writeback import EarlyWriteback

    path = directory / f"raw-write-{rank}.bin"
    _barrier()
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    writeback = EarlyWriteback(fd if early else None)
    try:
        at = 0
        while at < len(source):
            wrote = os.write(fd, source[at : at + 8 * MIB])
            writeback.wrote(wrote)
            at += wrote
        os.fsync(fd)
    finally:
        os.close(fd)
    _barrier()
    elapsed = time.perf_counter() - start
    path.unlink()
    return elapsed


def memcpy(dst: Any, src: Any) -> float:
    """Every rank copies its share of the state once (what a snapshot must at least cost)."""
    _barrier()
    start = time.perf_counter()
    dst.copy_(src)
    _barrier()
    return time.perf_counter() - start


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _reread(step_dir: Path) -> float:
    from resiliency.storage.checksum import describe_files
    from resiliency.storage.layout import payload_files

    start = time.perf_counter()
    describe_files(step_dir, payload_files(step_dir), fsync=False)
    return time.perf_counter() - start


RAW_WRITER = """
import os, sys
path, left = sys.argv[1], int(sys.argv[2])
buf = memoryview(os.urandom(8 << 20))
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
while left > 0:
    left -= os.write(fd, buf[:min(left, len(buf))])
os.fsync(fd)
os.close(fd)
os.unlink(path)
"""


def _any_rank(flag: bool) -> bool:
    import torch
    import torch.distributed as dist

    box = torch.tensor([int(flag)])
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return bool(box.item())


def steps_during_raw_write(trainer: Any, directory: Path, nbytes: int, rank: int) -> list[float]:
    """P2's floor: step times while a separate nice-19 process writes the same bytes with
    fsync (what any background writer costs training on this machine's I/O path)."""
    import subprocess

    _barrier()
    proc = subprocess.Popen(
        [sys.executable, "-c", RAW_WRITER, str(directory / f"raw-bg-{rank}"), str(nbytes)],
        preexec_fn=lambda: os.nice(19),
    )
    steps = []
    while _any_rank(proc.poll() is None):  # steps are collective: all ranks agree to go on
        start = time.perf_counter()
        trainer.train_step()
        steps.append(time.perf_counter() - start)
    _barrier()
    return steps


# ---------------------------------------------------------------- save (P1, P2)
def _writer_running(ckpt: Any) -> bool:
    queue = ckpt.queue
    if queue is None or not queue.get_num_unfinalized_calls():
        return False
    call = queue.async_calls[-1]
    try:
        return not call.async_caller.is_current_async_call_done(blocking=False, no_dist=True)
    except TypeError:  # older signature
        return not call.async_caller.is_current_async_call_done(False)


def mode_save(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from resiliency.checkpoint.checkpointer import Checkpointer
    from resiliency.run_context import RunContext
    from resiliency.storage.layout import RunLayout

    trainer, env, _ = _setup(args.overrides, with_hooks=False)
    layout = RunLayout(trainer.run_dir.parent, trainer.run.run_id)
    layout.steps_dir.mkdir(parents=True, exist_ok=True)
    ckpt = Checkpointer(trainer, RunContext.unowned(layout, 1), faults=trainer.faults)
    trainer.train_step()  # optimizer state exists from here on
    rank, world = env.rank, env.world_size
    out: dict[str, Any] = {"sync": [], "async": []}

    def one_save() -> tuple[float, int]:
        _barrier()
        start = time.perf_counter()
        ckpt.save()
        _barrier()
        elapsed = time.perf_counter() - start
        # Retention deletes the oldest step on a thread after the publish: let it finish, or
        # it competes with whatever the bench measures next (the raw write, the next save).
        ckpt._join_gc()
        nbytes = _dir_bytes(layout.step_dir(trainer.state.step)) if rank == 0 else 0
        return elapsed, nbytes

    # Warm-up save: sizes the raw-write baseline, first-call imports and caches.
    _, total = one_save()
    box = [total]
    dist.broadcast_object_list(box, src=0)
    total = box[0]
    share = -(-total // world)
    # The raw write's source: the share's size in bytes of its own, random, faulted in.
    source = torch.empty(share, dtype=torch.uint8).random_(0, 255)
    buf = memoryview(source.numpy())
    out.update(bytes=total, bytes_per_rank=share)
    # Raw writes and saves alternate, each save between two raw writes: its baseline is their
    # mean, so the disk's drift over the run (a virtual disk's host cache, other tenants)
    # cancels within each pair instead of landing in the spread. A write right after a save
    # ran at half the speed of one after a raw write on this VM (the save's after-effects on
    # the disk), so every save is followed by an unmeasured raw write and both the measured
    # raw writes and the saves come after a raw write. The raw writes start the kernel's
    # writeback as they go, as the save's writers do: written plainly (all writes, then
    # fsync) the same bytes leave the disk idle while they are copied, which measures the
    # writer, not the disk. A repetition is the median of --pairs pairs (as P5's is of its
    # step pairs), so one fast or slow second of the disk does not decide it. The first raw
    # write is a warm-up: a run's first write into blocks the file system has not used lately
    # was 2-4x slower than every later one.
    raw_write(layout.steps_dir, rank, buf, early=True)
    raw_before = raw_write(layout.steps_dir, rank, buf, early=True)
    for _ in range(args.reps):
        pairs = []
        for _ in range(args.pairs):
            _next_step_dir(trainer)  # the model state is the same size
            pair: dict[str, Any] = {}
            pair["save_s"], pair["bytes"] = one_save()
            pair["phases"] = dict(getattr(ckpt, "phase_times", {}) or {})
            pair["raw_after_save_s"] = raw_write(layout.steps_dir, rank, buf, early=True)
            if rank == 0:  # what the commit cost when it read every file back
                pair["reread_checksum_s"] = _reread(layout.step_dir(trainer.state.step))
            raw_after = raw_write(layout.steps_dir, rank, buf, early=True)
            pair["raw_s"] = (raw_before + raw_after) / 2
            pair["raw_around_s"] = [raw_before, raw_after]
            raw_before = raw_after
            pairs.append(pair)
        out["sync"].append(pairs)

    # P2: async saves; the hook's per-step finalize(blocking=False) is what publishes them.
    # A new checkpointer set up as an attempt's is (its writer process spawned at start):
    # its first save is what every attempt pays once, reported apart from the steady state.
    ckpt.close()
    async_cfg = replace(trainer.run.checkpoint, async_save=True)
    ckpt = Checkpointer(trainer, RunContext.unowned(layout, 2), trainer.faults, cfg=async_cfg)
    src = torch.empty(share, dtype=torch.uint8).random_(0, 255)
    dst = torch.empty_like(src)
    memcpy(dst, src)  # fault the pages in
    for rep in range(args.reps + 1):
        record = _async_save_record(ckpt, trainer, args, (src, dst), layout, share, rank)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, record)
        slowest = max(gathered, key=lambda r: r["blocked_s"])  # any rank blocked blocks all
        mine = {k: record[k] for k in ("idle_steps", "busy_steps", "raw_busy_steps")}
        if rep == 0:
            out["async_first"] = slowest | mine
        else:
            out["async"].append(slowest | mine)
    ckpt.close()
    return out


def _async_save_record(
    ckpt: Any,
    trainer: Any,
    args: argparse.Namespace,
    bufs: tuple,
    layout: Any,
    share: int,
    rank: int,
) -> dict[str, Any]:
    """One async save as training sees it: idle steps, the save call, then steps until the
    commit (finalize) lands; blocked = the save call + the finalize that committed."""
    src, dst = bufs
    record: dict[str, Any] = {"memcpy_s": memcpy(dst, src), "idle_steps": [], "busy_steps": []}
    record["raw_busy_steps"] = steps_during_raw_write(trainer, layout.steps_dir, share, rank)
    for _ in range(args.idle_steps):
        start = time.perf_counter()
        ckpt.finalize(blocking=False)
        trainer.train_step()
        record["idle_steps"].append(time.perf_counter() - start)
        if ckpt.staging_to_reserve:  # as the checkpoint hook does after an attempt's first step
            start = time.perf_counter()
            ckpt.reserve_staging()
            record["reserve_s"] = time.perf_counter() - start
    _barrier()
    _next_step_dir(trainer)
    start = time.perf_counter()
    ckpt.save()
    record["save_call_s"] = time.perf_counter() - start
    record["commit_s"] = 0.0
    for _ in range(args.max_busy_steps):
        start = time.perf_counter()
        before = ckpt.queue.get_num_unfinalized_calls()
        busy = _writer_running(ckpt)
        ckpt.finalize(blocking=False)
        finalized = before and not ckpt.queue.get_num_unfinalized_calls()
        if finalized:
            record["commit_s"] = time.perf_counter() - start
        trainer.train_step()
        # A step counts as "during the write" if it started while the writer ran.
        if busy and not finalized:
            record["busy_steps"].append(time.perf_counter() - start)
        if finalized:
            break
    if ckpt.queue.get_num_unfinalized_calls():  # writer slower than max_busy_steps
        start = time.perf_counter()
        ckpt.finalize(blocking=True)
        record["commit_s"] = time.perf_counter() - start
        record["forced_finalize"] = True
    record["blocked_s"] = record["save_call_s"] + record["commit_s"]
    return record


# ---------------------------------------------------------------- overhead (P5)
def _bare_forward_step(batches: Any, model: Any) -> tuple[Any, Any]:
    """The forward step of Megatron-LM's pretrain_gpt.py: masked mean of the token losses."""
    import torch

    batch = next(batches)
    output = model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    )

    def loss_func(loss_mask: Any, out: Any) -> tuple[Any, dict]:
        losses = out.float().view(-1)
        mask = loss_mask.view(-1).float()
        loss = torch.sum(losses * mask) / mask.sum().clamp(min=1.0)
        return loss, {"lm loss": loss.detach()}

    return output, partial(loss_func, batch["loss_mask"])


class BareLoop:
    """megatron-core's pieces only: the same model/DDP/optimizer/scheduler/dataset objects,
    driven by get_forward_backward_func and optimizer.step, no hooks, no logging."""

    def __init__(self, parts: Any, seq_length: int) -> None:
        self.parts, self.seq_length = parts, seq_length
        self.consumed = len(parts.dataset) // 2  # other samples of the same dataset

    def _batches(self) -> list[dict]:
        import torch

        plan, data = self.parts.plan, self.parts.dataset
        out = []
        for k in range(plan.num_microbatches):
            samples = [data[i % len(data)] for i in plan.sample_indices(self.consumed, k)]
            out.append({key: torch.stack([s[key] for s in samples]) for key in samples[0]})
        self.consumed += plan.global_batch_size
        return out

    def step(self) -> None:
        import torch
        import torch.distributed as dist
        from megatron.core.pipeline_parallel import get_forward_backward_func

        parts = self.parts
        for chunk in parts.ddp:
            chunk.zero_grad_buffer()
        parts.optimizer.zero_grad()
        parts.scheduler.step(increment=1)
        batches = iter(self._batches())
        losses = get_forward_backward_func()(
            forward_step_func=_bare_forward_step,
            data_iterator=batches,
            model=parts.ddp[0],
            num_microbatches=parts.plan.num_microbatches,
            seq_length=self.seq_length,
            micro_batch_size=parts.plan.micro_batch_size,
            forward_only=False,
        )
        parts.optimizer.step()
        # Megatron-LM's train_step reduces the loss for logging every step, too.
        local = torch.zeros(1, dtype=torch.float64)
        if losses:
            local += torch.stack([x["lm loss"].double() for x in losses]).mean()
        dist.all_reduce(local)
        local.item()


def _shim_overhead(trainer: Any, steps: int) -> dict[str, Any]:
    """The CPU shim's per-op TorchFunctionMode: count calls in a step, time one call's cost."""
    import torch

    from pretrain.platform import cpu_shim

    mode_cls = type(cpu_shim._MODE)
    original = mode_cls.__torch_function__
    calls = [0]

    def counting(self: Any, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        calls[0] += 1
        return original(self, func, types, args, kwargs)

    mode_cls.__torch_function__ = counting
    try:
        for _ in range(steps):
            trainer.train_step()
    finally:
        mode_cls.__torch_function__ = original
    x = torch.ones(4)
    n = 20000
    start = time.perf_counter()
    for _ in range(n):
        x.add(1)
    with_mode = (time.perf_counter() - start) / n
    with torch.overrides._pop_mode_temporarily():
        start = time.perf_counter()
        for _ in range(n):
            x.add(1)
        without = (time.perf_counter() - start) / n
    per_call = max(with_mode - without, 0.0)
    per_step_calls = calls[0] / steps
    return {
        "calls_per_step": per_step_calls,
        "per_call_s": per_call,
        "per_step_s": per_step_calls * per_call,
    }


def _time_hooks(hooks: list[Any]) -> dict[str, float]:
    """Wrap each hook's per-step methods with a timer: where framework overhead goes."""
    totals: dict[str, float] = {}
    for hook in hooks:
        for name in ("before_step", "after_step"):
            key = f"{type(hook).__name__}.{name}"
            totals[key] = 0.0
            original = getattr(hook, name)

            def timed(*args: Any, _original: Any = original, _key: str = key) -> Any:
                start = time.perf_counter()
                try:
                    return _original(*args)
                finally:
                    totals[_key] += time.perf_counter() - start

            setattr(hook, name, timed)
    return totals


class _Stamp:
    """A no-op hook that notes when each framework step (hooks included) ended."""

    state_key = None  # no state to save (found before __getattr__'s catch-all)

    def __init__(self, stamps: list[float]) -> None:
        self.stamps = stamps

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: args[0] if name == "configure" else None

    def after_step(self, trainer: Any, result: Any) -> None:
        self.stamps.append(time.perf_counter())


def mode_overhead(args: argparse.Namespace) -> dict[str, Any]:
    trainer, env, hooks = _setup(args.overrides, with_hooks=True)
    from pretrain.train.reporting import ScalarHook  # after _setup, like every pretrain import here

    for hook in hooks:
        hook.on_start(trainer)
    bare = BareLoop(trainer.parts, trainer.run.model.seq_length)
    for _ in range(2):  # warm-up both paths
        bare.step()
    trainer.run_steps(2)
    out: dict[str, Any] = {"pairs": []}
    n = args.block_steps
    hook_s = _time_hooks(hooks)
    stamps: list[float] = []
    every_hook = [*hooks, _Stamp(stamps)]  # last hook: a step ends after every other hook ran
    # A third arm: the framework without TensorBoard (and W&B), so their share of a step is
    # measured in the same process, a fraction of a second from the other two.
    unreported = [h for h in every_hook if not isinstance(h, ScalarHook)]
    arms = ("framework", "unreported", "bare")
    for rep in range(args.reps):
        pair: dict[str, Any] = {}
        for which in arms[rep % 3 :] + arms[: rep % 3]:
            _barrier()
            start = time.perf_counter()
            if which == "bare":
                stamps[:] = [start]
                for _ in range(n):
                    bare.step()
                    stamps.append(time.perf_counter())
            else:
                # The product loop: before_step hooks, faults, train_step, step log, after_step.
                stamps[:] = [start]
                trainer.run_steps(n, every_hook if which == "framework" else unreported)
            steps = [b - a for a, b in zip(stamps, stamps[1:])]
            # The block's mean: what every step of it paid, periodic hook work included.
            pair[which + "_s"] = (stamps[-1] - stamps[0]) / len(steps)
            pair[which + "_steps"] = steps
        out["pairs"].append(pair)
    framework_steps = sum(len(p["framework_steps"]) for p in out["pairs"]) + 2
    out["hooks_s_per_step"] = {k: v / framework_steps for k, v in hook_s.items()}
    out["shim"] = _shim_overhead(trainer, 3)
    out["bare_step_s"] = sorted(p["bare_s"] for p in out["pairs"])[len(out["pairs"]) // 2]
    for hook in hooks:
        hook.close()
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("save", "overhead"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--pairs", type=int, default=3, help="save/raw pairs per P1 repetition")
    parser.add_argument("--idle-steps", type=int, default=3)
    parser.add_argument("--max-busy-steps", type=int, default=50)
    parser.add_argument("--block-steps", type=int, default=10)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger().setLevel(logging.WARNING)
    result = {"save": mode_save, "overhead": mode_overhead}[args.mode](args)
    import torch.distributed as dist

    if int(os.environ.get("RANK", "0")) == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main(sys.argv[1:]))
