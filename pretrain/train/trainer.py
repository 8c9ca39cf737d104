"""The training loop: build components, run pipeline-scheduled steps, call hooks, log."""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import random
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pretrain.context import exit_codes, interrupts, startup_clock
from pretrain.context.failures import NonFiniteError
from pretrain.context.run_dir import RunDir, append_jsonl
from pretrain.data import dataset as data
from pretrain.data.tokenizer import run_tokenizer
from pretrain.model import flops
from pretrain.model import gpt as model_lib
from pretrain.model import optimizer as optim
from pretrain.platform.compat import fix_uninitialised_tp_attributes
from pretrain.platform.distributed import DistEnv, init_model_parallel
from pretrain.train.evaluate import eval_loss, params_synced
from pretrain.train.fault_injection import FaultInjector
from pretrain.train.guard import NumericGuard, nonfinite_grads
from pretrain.train.hooks import EvalResult, StepResult, TrainHook
from pretrain.train.progress import Progress
from pretrain.train.schedule import run_schedule
from pretrain.train.view import Components, TrainState
from recipes import ConfigError
from recipes.config.run import RunConfig
from recipes.validate import num_microbatches

# The sample hash travels in the step's float64 all-reduce: exact while the sum of a global
# batch's 32-bit digests stays below 2**53.
SAMPLE_HASH_MAX_SAMPLES = 1 << (53 - data.SAMPLE_DIGEST_BITS)

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    from megatron.core import parallel_state as ps

    # Megatron-LM's rule: distinct streams per pipeline stage, identical across TP/DP.
    stage_seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    init_model_parallel_seed(stage_seed)


def init_model_parallel_seed(seed: int) -> None:
    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def build_components(run: RunConfig, env: DistEnv, dp: int, run_dir: Path) -> Components:
    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    from megatron.core import parallel_state as ps

    bf16 = run.train.precision == "bf16" or (run.train.precision == "auto" and env.device == "cuda")
    tokenizer = run_tokenizer(run.data.tokenizer, run.data.tokenizer_path)
    if run.data.vocab_size not in (None, tokenizer.vocab_size):
        raise ConfigError(
            f"data.vocab_size={run.data.vocab_size}, but the tokenizer "
            f"({run.data.tokenizer_path or run.data.tokenizer}) has {tokenizer.vocab_size} ids: "
            "fix data.vocab_size (the recipe's planning figure) or the tokenizer"
        )
    padded = model_lib.padded_vocab_size(run.model, tokenizer.vocab_size, run.parallel.tp)
    tcfg = model_lib.transformer_config(
        run.model, run.parallel, env.device, bf16, run.perf, run.train.deterministic
    )
    chunks = model_lib.build_chunks(
        run.model, run.parallel, tcfg, padded, use_te=env.device == "cuda" and _have_te()
    )
    if run.model.layout_invariant_init and run.model.perform_initialization:
        model_lib.layout_invariant_init(chunks, run.model, run.train.seed)
    if not run.model.perform_initialization:
        fix_uninitialised_tp_attributes(chunks)
    for chunk in chunks:
        chunk.to(env.torch_device)
    # megatron's own NaN check raises inside the backward pass (a RuntimeError); a guard that
    # skips or rolls back must see the non-finite gradients itself (train.guard).
    ddp = model_lib.wrap_ddp(
        chunks,
        tcfg,
        run.optimizer.use_distributed_optimizer,
        bf16,
        run.perf,
        check_for_nan_in_grad=run.train.guard.policy == "stop",
    )
    optimizer = optim.build_optimizer(run.optimizer, ddp, tcfg, bf16, run.perf)
    scheduler = optim.build_scheduler(
        run.scheduler, run.optimizer, optimizer, run.train.train_steps
    )
    plan = data.BatchPlan(
        run.train.micro_batch_size, num_microbatches(run, dp), dp, ps.get_data_parallel_rank()
    )
    cache = Path(run.data.cache_dir) if run.data.cache_dir else RunDir(run_dir).data_cache_dir
    train, valid, test = data.build_datasets(
        run.data, tokenizer, run.model.seq_length, data.split_sizes(run, plan), cache
    )
    eval_data = {name: split for name, split in (("valid", valid), ("test", test)) if split}
    log.info(
        "model: %s, %d params on this rank (padded vocab %d), %s, %d microbatches x %d",
        run.model.name,
        model_lib.count_parameters(chunks),
        padded,
        "bf16" if bf16 else "fp32",
        plan.num_microbatches,
        plan.micro_batch_size,
    )
    return Components(
        tcfg, chunks, ddp, optimizer, scheduler, train, tokenizer, plan, padded, eval_data
    )


def _have_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class StopVotes:
    """What the ranks voted in a step's all-reduce: stop after it (any reason), and whether a
    Ctrl-C was among the reasons (every rank then exits INTERRUPTED, not REQUEUE)."""

    stop: bool
    interrupt: bool


class Trainer:
    def __init__(
        self,
        run: RunConfig,
        env: DistEnv,
        dp: int,
        run_dir: Path,
        hooks: list[TrainHook] | None = None,
    ) -> None:
        self.env, self.dp, self.run_dir = env, dp, run_dir
        self.hooks = hooks or []
        init_model_parallel(run.parallel)
        self.rebuild(run)
        self.state = TrainState()
        self.faults = FaultInjector.parse(run.train.fault, env.rank)
        self.guard = NumericGuard(run.train.guard)
        self.stop_requested = False
        self.exit_code = 0  # non-zero for planned exits (request_stop: preemption, straggler)
        self._checkpointing: str | None = None
        self.run_paths = RunDir(run_dir)
        self.metrics_path = self.run_paths.steps_metrics
        self.progress = self._progress()
        self.saves: dict[str, int] = {}  # checkpoint work done this attempt, by kind
        self.last_result: StepResult | None = None
        self.last_eval: dict[str, float] = {}  # split -> its latest loss

    def rebuild(self, run: RunConfig) -> None:
        """(Re)build model, optimizer and data for ``run`` from the seed, as a fresh start would
        (a restore whose chosen step failed its re-hash rebuilds for the next step)."""
        self.run = run
        if hasattr(self, "parts"):  # free the old model (frozen below) before building anew
            gc.unfreeze()
            del self.parts
            gc.collect()
        seed_everything(run.train.seed)
        self.parts = build_components(run, self.env, self.dp, self.run_dir)
        # The model, optimizer and imports live for the whole run: keep them out of every later
        # full collection (megatron collects after each optimizer state dict: 0.2 s -> 0.01 s
        # for a 1.5 GiB model).
        gc.freeze()

    @property
    def tokens_per_step(self) -> int:
        return self.parts.plan.global_batch_size * self.run.model.seq_length

    @property
    def lr(self) -> float:
        """The learning rate of the step that ran last (the scheduler's current value)."""
        return float(self.parts.optimizer.param_groups[0]["lr"])

    def request_stop(self, exit_code: int, reason: str) -> None:
        """A planned exit: the loop stops before the next step and the run exits with
        ``exit_code`` (a hook's decision, e.g. requeue after preemption)."""
        if self.env.rank == 0:
            log.info("stop requested at step %d (exit %d): %s", self.state.step, exit_code, reason)
        self.stop_requested, self.exit_code = True, exit_code

    def state_dict(self) -> dict[str, Any]:
        """The loop state a checkpoint carries beside the shards (train_state.json): the loop
        position, the schedule, the numeric guard's window and totals, and each stateful hook's
        state under its ``state_key`` (torchtitan's ``states``, Megatron-Bridge's user state)."""
        state = self.state
        return {
            "step": state.step,
            "consumed_samples": state.consumed_samples,
            "consumed_tokens": state.consumed_tokens,
            "microbatch_position": 0,  # saves happen at step boundaries only
            "global_batch_size": self.parts.plan.global_batch_size,
            "lr": self.lr,
            "scheduler": self.parts.scheduler.state_dict(),
            "grad_scaler": None,  # bf16/fp32 train without loss scaling
            "data_cursor": {
                "consumed_samples": state.consumed_samples,
                "shuffle_seed": self.run.data.seed,
            },
            "guard": self.guard.state_dict(),
            "hooks": {h.state_key: h.state_dict() for h in self.hooks if h.state_key},
        }

    def load_state_dict(self, record: dict[str, Any], load_s: float | None = None) -> None:
        """Continue from a checkpoint's ``state_dict``: the loop position, the guard, every
        stateful hook found in it. The scheduler's state is the checkpointer's to load (the
        resume policy decides whether the checkpoint's schedule is kept). ``load_s``: how long
        the restore took; hooks see it in ``on_resumed``."""
        self.guard.load_state_dict(record.get("guard"))
        saved = record.get("hooks") or {}
        for hook in self.hooks:
            if hook.state_key and hook.state_key in saved:
                hook.load_state_dict(saved[hook.state_key])
        self.state = TrainState(
            record["step"], record["consumed_samples"], record["consumed_tokens"]
        )
        if load_s is not None:
            for hook in self.hooks:
                hook.on_resumed(self, load_s)

    def guard_record(self) -> dict[str, Any]:
        return self.guard.record()

    def run_steps(self, n: int, hooks: list[TrainHook] | None = None) -> None:
        """``n`` more steps of the product loop (before_step hooks, faults, the step, its log,
        after_step hooks), with ``hooks`` in place of the run's for these steps if given."""
        own = self.hooks
        self.hooks = own if hooks is None else hooks
        try:
            self._loop(until=self.state.step + n)
        finally:
            self.hooks = own

    def _progress(self) -> Progress:
        plan, train = self.parts.plan, self.run.train
        precision = "bf16" if self.parts.tcfg.bf16 else "fp32"
        device_name = torch.cuda.get_device_name() if self.env.device == "cuda" else "cpu"
        peak = train.peak_tflops or flops.peak_tflops(
            device_name, "fp8" if self.run.perf.fp8 else precision
        )
        return Progress(
            flops.flops_per_step(self.run.model, plan.global_batch_size, self.parts.padded_vocab),
            self.env.world_size,
            self.tokens_per_step,
            train.train_steps,
            peak,
            self.env.device,
        )

    @contextlib.contextmanager
    def checkpointing(self, what: str) -> Iterator[None]:
        """Wrap checkpoint work: every hook sees ``on_checkpoint_begin``/``_end`` around it
        (hang detection gives it its own timeout). Nested calls announce only the outermost."""
        if self._checkpointing is not None:
            yield
            return
        self._checkpointing = what
        self.saves[what] = self.saves.get(what, 0) + 1
        for hook in self.hooks:
            hook.on_checkpoint_begin(self, what)
        try:
            with params_synced(self.parts.ddp, self.run.perf.overlap_param_gather):
                yield
        finally:
            self._checkpointing = None
            for hook in self.hooks:
                hook.on_checkpoint_end(self, what)

    def checkpoint_phase(self, phase: str) -> None:
        """Announce a new phase of the checkpoint work in progress (no-op outside one)."""
        if self._checkpointing is None:
            return
        for hook in self.hooks:
            hook.on_checkpoint_phase(self, phase)

    def fit(self) -> TrainState:
        for hook in self.hooks:
            hook.on_start(self)
        self._loop()
        if not self.stop_requested and self.run.train.eval_interval:
            self._final_evaluation()
        for hook in self.hooks:
            hook.on_end(self)
        self._summary()
        return self.state

    def evaluate(self, split: str = "valid") -> EvalResult:
        """A forward-only pass over ``split`` (collective); moves no training state."""
        for hook in self.hooks:
            hook.on_eval_begin(self, split)
        started = time.perf_counter()
        with params_synced(self.parts.ddp, self.run.perf.overlap_param_gather):
            self.faults.at_checkpoint("eval", self.state.step)
            loss = eval_loss(self, self.parts.eval_data[split])
        result = EvalResult(split, self.state.step, loss, time.perf_counter() - started)
        self.last_eval[split] = loss
        if self.env.rank == 0:
            log.info(
                "%s at step %d | loss %.6f | perplexity %.3f | %d batches in %.2f s",
                "validation" if split == "valid" else split,
                result.step,
                loss,
                math.exp(min(loss, 80.0)),
                self.run.train.eval_iters,
                result.seconds,
            )
            append_jsonl(self.run_paths.eval_metrics, {**asdict(result), "time": time.time()})
        for hook in self.hooks:
            hook.on_eval_end(self, result)
        return result

    def _final_evaluation(self) -> None:
        interval = self.run.train.eval_interval
        if interval and self.state.step % interval:  # not just validated by the loop
            self.evaluate("valid")
        if "test" in self.parts.eval_data:
            self.evaluate("test")

    def _summary(self) -> None:
        if self.env.rank != 0:
            return
        log.info("%s", self.progress.summary(self.last_result, self.last_eval.get("valid")))
        saves = ", ".join(f"{n} {what}" for what, n in sorted(self.saves.items())) or "none"
        restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"
        log.info("run summary: checkpoint work this attempt: %s; restarts %s", saves, restarts)

    def _loop(self, until: int | None = None) -> None:
        last = self.run.train.train_steps if until is None else until
        while self.state.step < last:
            for hook in self.hooks:
                hook.before_step(self)
            if self.stop_requested:
                return
            self.faults.before_step(self.state.step + 1)
            result = self.train_step()
            startup_clock.mark("first_step")
            self._log(result)
            if result.anomaly is not None and not self._answer_anomaly(result):
                continue  # rolled back: the loop goes on from the restored step
            for hook in self.hooks:
                hook.after_step(self, result)
            if result.interrupted and not self.stop_requested and self.state.step < last:
                # No hook saved on it (checkpoints off): the user's stop, without a save.
                self.request_stop(exit_codes.INTERRUPTED, "interrupted by the user (Ctrl-C)")
            interval = self.run.train.eval_interval
            if interval and result.step % interval == 0:
                self.evaluate("valid")

    def train_step(self) -> StepResult:
        parts, start = self.parts, time.perf_counter()
        for chunk in parts.ddp:
            chunk.zero_grad_buffer()
        parts.optimizer.zero_grad()
        # lr for step s is the scheduler's value at s: advance before the update, not after.
        parts.scheduler.step(increment=1)
        lr, gbs = self.lr, parts.plan.global_batch_size
        digests: list[int] = []
        batches = data.microbatches(parts.dataset, parts.plan, self.state.consumed_samples, digests)
        losses = run_schedule(
            parts,
            self.env.torch_device,
            self.run.model.seq_length,
            batches,
            forward_only=False,
            loss_scale=self.faults.loss_scale(self.state.consumed_samples // gbs + 1),
        )
        self.faults.after_backward(self.state.step + 1, parts.ddp)
        loss, votes, bad_grads, sample_hash = self._reduce_loss(losses, sum(digests))
        anomaly = self.guard.inspect(loss, bad_grads) if self.guard.active else None
        skipped = anomaly is not None
        if skipped:
            grad_norm = self._drop_update(anomaly)
        else:
            _, grad_norm, _ = parts.optimizer.step()
            grad_norm = float(grad_norm or 0.0)
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                anomaly = "non-finite loss or grad norm"  # the update is applied already
        self.state.step += 1
        self.state.consumed_samples += gbs
        self.state.consumed_tokens += self.tokens_per_step
        elapsed = time.perf_counter() - start
        return StepResult(
            self.state.step,
            loss,
            grad_norm,
            lr,
            elapsed,
            self.tokens_per_step / elapsed,
            votes.stop,
            interrupted=votes.interrupt,
            skipped=skipped,
            anomaly=anomaly,
            sample_hash=sample_hash,
        )

    def _drop_update(self, anomaly: str) -> float:
        """The guard refused this step's update: the optimizer does not step, and neither does
        the LR schedule (Megatron-LM advances it with successful updates only). Returns the
        grad norm for the record (NaN for non-finite gradients)."""
        self.parts.scheduler.step(increment=-1)
        if anomaly.startswith("non-finite"):
            return float("nan")
        # The norm megatron would have clipped with (collective; every rank skips alike).
        self.parts.optimizer.prepare_grads()
        return float(self.parts.optimizer.get_grad_norm())

    def _answer_anomaly(self, result: StepResult) -> bool:
        """Carry out train.guard's action for a step with an anomaly (every rank alike);
        False: the step was rolled back and never reaches ``after_step``."""
        guard = self.guard
        action = guard.action(result)
        if action in ("rollback", "replay"):
            self._roll_back(result, skip_data=action == "rollback")
            return False
        if action == "skip":
            guard.skipped(result, self.parts.plan.global_batch_size)
            if self.env.rank == 0:
                log.warning(
                    "guard: step %d: %s; update skipped (%d skipped in this run)",
                    result.step,
                    result.anomaly,
                    guard.skipped_steps,
                )
        else:
            guard.stopped(result)
        for hook in self.hooks:
            hook.on_anomaly(self, result, action)
        if action == "stop":
            raise guard.stop_error(result)
        return True

    def _roll_back(self, result: StepResult, skip_data: bool) -> None:
        """A hook restores the newest verified checkpoint in place, then (``skip_data``) the
        data cursor moves past every batch since it, the bad one included. The jump is in the
        next checkpoint's consumed_samples, so a later resume continues exactly. Without it the
        same batches are trained again: a replay, what a resume from that checkpoint does."""
        action = "rollback" if skip_data else "replay"
        bad_cursor = self.state.consumed_samples, self.state.consumed_tokens
        # megatron's scheduler.load_state_dict adds the saved step count to the live one.
        self.parts.scheduler.num_steps = 0
        restored = next(
            (s for hook in self.hooks if (s := hook.roll_back(self, result.step)) is not None),
            None,
        )
        if restored is None:
            raise self.guard.roll_back_error(result, action)
        state = self.state  # the restore replaced it
        window = (state.consumed_samples, state.consumed_samples)
        if skip_data:
            self._check_data_left(bad_cursor[0], restored)
            window = (state.consumed_samples, bad_cursor[0])
            state.consumed_samples, state.consumed_tokens = bad_cursor
        self.guard.rolled_back(result, restored, window, action)
        if self.env.rank == 0:
            log.warning(
                "guard: step %d: %s; %s to step %d, data cursor %d -> %d samples (%d/%d rollbacks)",
                result.step,
                result.anomaly,
                "rolled back" if skip_data else "replaying from",
                restored,
                window[0],
                window[1],
                self.guard.rollbacks,
                self.guard.cfg.max_rollbacks,
            )
        for hook in self.hooks:
            hook.on_anomaly(self, result, action)

    def _check_data_left(self, cursor: int, restored: int) -> None:
        """The training split holds train_steps x global batch samples (a single corpus: whole
        epochs); the samples skipped must leave enough for the steps still to train."""
        batch = self.parts.plan.global_batch_size
        needed = cursor + (self.run.train.train_steps - restored) * batch
        have = len(self.parts.dataset)
        if needed > have:
            raise NonFiniteError(
                f"train.guard.policy=rollback to step {restored} skips the training data to "
                f"sample {cursor}, and the remaining steps need samples up to {needed}; the "
                f"training split has {have}. Not retrying a numeric failure"
            )

    def _reduce_loss(
        self, losses: list[dict], digest_sum: int
    ) -> tuple[float, StopVotes, bool, int | None]:
        """Mean loss over microbatches and DP ranks, whether any rank's hook wants to stop or
        had a Ctrl-C, (train.guard) whether any rank has a non-finite gradient, and the step's
        sample hash (the sum of every DP rank's sample digests): known on every rank from one
        all-reduce, before the optimizer step."""
        # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
        from megatron.core import parallel_state as ps

        local = torch.zeros(5, dtype=torch.float64, device=self.env.torch_device)
        if losses and ps.is_pipeline_last_stage(ignore_virtual=True):
            local[0] += torch.stack([x["lm loss"].double() for x in losses]).mean()
        local[1] = float(any(hook.wants_stop(self) for hook in self.hooks))
        local[4] = float(interrupts.requested())
        if self.guard.checks_grads:
            local[2] = nonfinite_grads(self.parts.ddp)
        # One rank per DP replica adds its samples (its TP, PP and CP peers drew the same).
        counts_samples = (
            ps.get_tensor_model_parallel_rank() == 0
            and ps.get_pipeline_model_parallel_rank() == 0
            and ps.get_context_parallel_rank() == 0
        )
        hash_exact = self.parts.plan.global_batch_size < SAMPLE_HASH_MAX_SAMPLES
        if counts_samples and hash_exact:
            local[3] = float(digest_sum)
        dist.all_reduce(local)
        loss_sum, stop_votes, bad_grads, hash_sum, interrupt_votes = local.tolist()
        last_stage_ranks = self.env.world_size // self.run.parallel.pp
        sample_hash = int(hash_sum) if hash_exact else None
        votes = StopVotes(stop_votes + interrupt_votes > 0, interrupt_votes > 0)
        return loss_sum / last_stage_ranks, votes, bad_grads > 0, sample_hash

    def _log(self, result: StepResult) -> None:
        """Throughput on every rank's result (hooks read it); the line and steps.jsonl on 0."""
        extra = self.progress.add(result)
        result.tflops_per_device, result.mfu = extra["tflops_per_device"], extra["mfu"]
        self.last_result = result
        if self.env.rank != 0:
            return
        interval = self.run.logging.log_interval
        if result.step % interval == 0 or result.step == 1:
            line = self.progress.line(result)
            result.memory_gib = self.progress.last_memory
            log.info("%s", line)
        record = {
            **asdict(result),
            "consumed_tokens": extra["consumed_tokens"],
            # The size the step ran at (throughput per size, a resize visible per step).
            "world_size": self.env.world_size,
            "dp": self.parts.plan.dp_size,
        }
        append_jsonl(self.metrics_path, {**record, "time": time.time()})

    def report(self, scalars: dict[str, float], step: int) -> None:
        """Hand run-level scalars to every hook's ``on_report`` (the reporting hooks write them)."""
        for hook in self.hooks:
            hook.on_report(self, scalars, step)
