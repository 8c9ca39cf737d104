"""The training loop: build components, run pipeline-scheduled steps, call hooks, log."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import random
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pretrain import data, optim
from pretrain import model as model_lib
from pretrain.compat import fix_uninitialised_tp_attributes
from pretrain.distributed import DistEnv, init_model_parallel
from pretrain.failures import NonFiniteError
from pretrain.faults import FaultInjector
from pretrain.hooks import StepResult, TrainHook
from pretrain.tokenizer import build_tokenizer
from recipes.schema import RunConfig
from recipes.validate import num_microbatches

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """Loop position saved with every checkpoint."""

    step: int = 0
    consumed_samples: int = 0
    consumed_tokens: int = 0


@dataclass
class Components:
    tcfg: Any
    chunks: list[Any]
    ddp: list[Any]
    optimizer: Any
    scheduler: Any
    dataset: Any
    tokenizer: Any
    plan: data.BatchPlan
    padded_vocab: int


def seed_everything(seed: int) -> None:
    # megatron-core: imported after the CPU shim is applied (pretrain/distributed.py)
    from megatron.core import parallel_state as ps

    # Megatron-LM's rule: distinct streams per pipeline stage, identical across TP/DP.
    stage_seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    init_model_parallel_seed(stage_seed)


def init_model_parallel_seed(seed: int) -> None:
    # megatron-core: imported after the CPU shim is applied (pretrain/distributed.py)
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def build_components(run: RunConfig, env: DistEnv, dp: int, run_dir: Path) -> Components:
    # megatron-core: imported after the CPU shim is applied (pretrain/distributed.py)
    from megatron.core import parallel_state as ps

    bf16 = run.train.precision == "bf16" or (run.train.precision == "auto" and env.device == "cuda")
    tokenizer = build_tokenizer(run.data.tokenizer, run.data.tokenizer_path)
    padded = model_lib.padded_vocab_size(run.model, tokenizer.vocab_size, run.parallel.tp)
    tcfg = model_lib.transformer_config(run.model, run.parallel, env.device, bf16)
    chunks = model_lib.build_chunks(
        run.model, run.parallel, tcfg, padded, use_te=env.device == "cuda" and _have_te()
    )
    if run.model.layout_invariant_init and run.model.perform_initialization:
        model_lib.layout_invariant_init(chunks, run.model, run.train.seed)
    if not run.model.perform_initialization:
        fix_uninitialised_tp_attributes(chunks)
    for chunk in chunks:
        chunk.to(env.torch_device)
    ddp = model_lib.wrap_ddp(chunks, tcfg, run.optimizer.use_distributed_optimizer, bf16)
    optimizer = optim.build_optimizer(run.optimizer, ddp, tcfg, bf16)
    scheduler = optim.build_scheduler(
        run.scheduler, run.optimizer, optimizer, run.train.train_steps
    )
    plan = data.BatchPlan(
        run.train.micro_batch_size, num_microbatches(run, dp), dp, ps.get_data_parallel_rank()
    )
    cache = Path(run.data.cache_dir) if run.data.cache_dir else run_dir / "data-cache"
    dataset = data.build_train_dataset(
        run.data,
        tokenizer,
        run.model.seq_length,
        run.train.train_steps * plan.global_batch_size,
        cache,
    )
    log.info(
        "model: %s, %d params on this rank (padded vocab %d), %s, %d microbatches x %d",
        run.model.name,
        model_lib.count_parameters(chunks),
        padded,
        "bf16" if bf16 else "fp32",
        plan.num_microbatches,
        plan.micro_batch_size,
    )
    return Components(tcfg, chunks, ddp, optimizer, scheduler, dataset, tokenizer, plan, padded)


def _have_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def _loss_func(loss_mask: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, dict]:
    losses = output.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask) / mask.sum().clamp(min=1.0)
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(device: torch.device, batches: Iterator[dict], model: Any) -> tuple:
    batch = data.to_device(next(batches), device)
    output = model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    )
    return output, partial(_loss_func, batch["loss_mask"])


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
        self.stop_requested = False
        self.exit_code = 0  # non-zero for planned exits (request_stop: preemption, straggler)
        self._checkpointing: str | None = None
        self.metrics_path = run_dir / "metrics" / "steps.jsonl"

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

    def resume_from(self, state: TrainState) -> None:
        """Continue from a restored loop position (a checkpoint's train state)."""
        self.state = state

    @contextlib.contextmanager
    def checkpointing(self, what: str) -> Iterator[None]:
        """Wrap checkpoint work: every hook sees ``on_checkpoint_begin``/``_end`` around it
        (hang detection gives it its own timeout). Nested calls announce only the outermost."""
        if self._checkpointing is not None:
            yield
            return
        self._checkpointing = what
        for hook in self.hooks:
            hook.on_checkpoint_begin(self, what)
        try:
            yield
        finally:
            self._checkpointing = None
            for hook in self.hooks:
                hook.on_checkpoint_end(self, what)

    def fit(self) -> TrainState:
        for hook in self.hooks:
            hook.on_start(self)
        self._loop()
        for hook in self.hooks:
            hook.on_end(self)
        return self.state

    def _loop(self) -> None:
        while self.state.step < self.run.train.train_steps:
            for hook in self.hooks:
                hook.before_step(self)
            if self.stop_requested:
                return
            self.faults.before_step(self.state.step + 1)
            result = self.train_step()
            self._log(result)
            if not (math.isfinite(result.loss) and math.isfinite(result.grad_norm)):
                raise NonFiniteError(
                    f"step {result.step}: loss {result.loss}, grad norm "
                    f"{result.grad_norm}; not retrying a numeric failure"
                )
            for hook in self.hooks:
                hook.after_step(self, result)

    def train_step(self) -> StepResult:
        # megatron-core: imported after the CPU shim is applied (pretrain/distributed.py)
        from megatron.core.pipeline_parallel import get_forward_backward_func

        parts, start = self.parts, time.perf_counter()
        for chunk in parts.ddp:
            chunk.zero_grad_buffer()
        parts.optimizer.zero_grad()
        # lr for step s is the scheduler's value at s: advance before the update, not after.
        parts.scheduler.step(increment=1)
        batches = data.microbatches(parts.dataset, parts.plan, self.state.consumed_samples)
        iterators = [iter(batches) for _ in parts.ddp]
        losses = get_forward_backward_func()(
            forward_step_func=partial(_forward_step, self.env.torch_device),
            data_iterator=iterators if len(iterators) > 1 else iterators[0],
            model=parts.ddp if len(parts.ddp) > 1 else parts.ddp[0],
            num_microbatches=parts.plan.num_microbatches,
            seq_length=self.run.model.seq_length,
            micro_batch_size=parts.plan.micro_batch_size,
            forward_only=False,
        )
        self.faults.after_backward(self.state.step + 1, parts.ddp)
        _, grad_norm, _ = parts.optimizer.step()
        self.state.step += 1
        self.state.consumed_samples += parts.plan.global_batch_size
        self.state.consumed_tokens += self.tokens_per_step
        loss, stop_asked = self._reduce_loss(losses)
        elapsed = time.perf_counter() - start
        return StepResult(
            self.state.step,
            loss,
            float(grad_norm or 0.0),
            self.lr,
            elapsed,
            self.tokens_per_step / elapsed,
            stop_asked,
        )

    def _reduce_loss(self, losses: list[dict]) -> tuple[float, bool]:
        """Mean loss over microbatches and DP ranks, and whether any rank's hook wants to
        stop, known on every rank (one all-reduce)."""
        # megatron-core: imported after the CPU shim is applied (pretrain/distributed.py)
        from megatron.core import parallel_state as ps

        local = torch.zeros(2, dtype=torch.float64, device=self.env.torch_device)
        if losses and ps.is_pipeline_last_stage(ignore_virtual=True):
            local[0] += torch.stack([x["lm loss"].double() for x in losses]).mean()
        local[1] = float(any(hook.wants_stop(self) for hook in self.hooks))
        dist.all_reduce(local)
        loss_sum, stop_votes = local.tolist()
        last_stage_ranks = self.env.world_size // self.run.parallel.pp
        return loss_sum / last_stage_ranks, stop_votes > 0

    def _log(self, result: StepResult) -> None:
        if self.env.rank != 0:
            return
        if result.step % self.run.logging.log_interval == 0 or result.step == 1:
            log.info(
                "step %6d/%d | loss %.6f | lr %.3e | grad norm %.4f | %.0f tokens/s | %.3f s",
                result.step,
                self.run.train.train_steps,
                result.loss,
                result.lr,
                result.grad_norm,
                result.tokens_per_s,
                result.step_time_s,
            )
        self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        with self.metrics_path.open("a") as stream:
            stream.write(json.dumps({**asdict(result), "time": time.time()}) + "\n")
