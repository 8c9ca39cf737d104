"""One training session: process groups, hooks around the Trainer, exit code from failures."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from pretrain.context import exit_codes, startup_clock
from pretrain.context.failures import Failure, classify
from pretrain.context.run_dir import RunDir
from pretrain.platform.distributed import DistEnv, broadcast_object, init_distributed, shutdown
from pretrain.platform.logs import setup_logging
from pretrain.platform.rng import make_deterministic
from pretrain.train.hooks import TrainHook, build_hooks
from pretrain.train.reporting import reporting_hooks
from pretrain.train.trainer import Trainer
from pretrain.train.view import TrainerView
from recipes import ConfigError, RunConfig, to_yaml

log = logging.getLogger(__name__)
# Deterministic failures whose message says everything: one line, no traceback.
ONE_LINE_KINDS = ("config", "lease", "topology", "checkpoint", "data", "interrupted", "oom")
# Where the memory goes, and the knobs that lower it (the allocation's traceback says little).
OOM_ADVICE = (
    "python -m pretrain --plan with the same overrides shows the memory per device; lower "
    "train.micro_batch_size, raise parallel.tp or parallel.pp, or set perf.recompute=selective"
)


def train(run: RunConfig, device: str, dp: int) -> int:
    setup_logging(run.logging.level)
    if run.train.deterministic:
        log.info(
            "deterministic kernels on (train.deterministic); env set: %s", make_deterministic()
        )
    env = init_distributed(device)
    startup_clock.mark("process_group")
    run_dir = Path(run.output_dir) / run.run_id
    problem = broadcast_object(_make_run_dir(run_dir) if env.rank == 0 else None)
    if problem is not None:
        if env.rank == 0:
            log.error("config error: %s", problem)
        shutdown()  # every rank agreed: leave together (a live group aborts at interpreter exit)
        return exit_codes.CONFIG_ERROR
    try:
        # Resiliency first (restore happens in its on_start), then what reports the run.
        hooks = build_hooks(run, env, run_dir) + reporting_hooks(run, env.rank, run_dir)
    except ConfigError as exc:
        log.error("config error: %s", exc)
        shutdown()
        return exit_codes.CONFIG_ERROR
    trainer = None
    try:
        for hook in hooks:
            run = hook.configure(run, dp)
        if env.rank == 0:
            _write_config(run_dir, run)  # as trained: after restore planning adjusted it
        startup_clock.mark("setup")
        trainer = Trainer(run, env, dp, run_dir, hooks)
        startup_clock.mark("model_build")
        trainer.fit()
        code = trainer.exit_code
    except Exception as exc:  # noqa: BLE001 - every failure gets its class and exit code
        _tell_all(hooks, trainer, exc)
        failure = classify(exc)
        _log_failure(failure)
        return failure.exit_code
    finally:
        _close_all(hooks)
    shutdown()
    return code


def build_trainer(
    run: RunConfig, env: DistEnv, dp: int, run_dir: Path, hooks: list[TrainHook] | None = None
) -> TrainerView:
    """A Trainer for tools that drive it themselves (benchmarks, checkpoint import): they get
    the view, not the class (only pretrain.train imports the Trainer)."""
    return Trainer(run, env, dp, run_dir, hooks)


def _make_run_dir(run_dir: Path) -> str | None:
    """Rank 0 creates the run dir; a read-only or forbidden output_dir is the user's to fix."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".writable"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        return (
            f"cannot write the run directory {run_dir} ({exc.strerror or exc}); "
            "choose a writable output_dir"
        )
    return None


def _write_config(run_dir: Path, run: RunConfig) -> None:
    path = RunDir(run_dir).config_path  # one path for every rank and attempt
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(to_yaml(run))
    tmp.replace(path)


def _log_failure(failure: Failure) -> None:
    summary = "retryable" if failure.retryable else "do not retry"
    if failure.kind == "config" and os.environ.get("RANK", "0") != "0":
        # A config refusal (the resume policy's, say) is decided alike on every rank: the
        # failing rank's exit code still goes to the launcher, the message once, from rank 0.
        log.debug("training failed (config), as on rank 0: %s", failure.message)
    elif failure.kind == "interrupted":  # the user's stop, not a failure to investigate
        log.warning("stopped at once on a second Ctrl-C (exit %d): %s", failure.exit_code,
                    failure.message.splitlines()[0][:200])  # fmt: skip
    elif failure.kind in ONE_LINE_KINDS:
        log.error(
            "training failed (%s, exit %d, %s): %s",
            failure.kind,
            failure.exit_code,
            summary,
            failure.message + (f". {OOM_ADVICE}" if failure.kind == "oom" else ""),
        )
    else:
        log.exception("training failed (%s, exit %d, %s)", failure.kind, failure.exit_code, summary)


def _tell_all(hooks: list[TrainHook], trainer: Trainer | None, exc: Exception) -> None:
    """Every hook hears of the failure; one that fails while it records it (the disk that
    stopped the run is full) must not replace the run's failure and its exit code."""
    for hook in hooks:
        try:
            hook.on_exception(trainer, exc)
        except Exception:  # noqa: BLE001
            log.exception("%s could not record the failure", type(hook).__name__)


def _close_all(hooks: list[TrainHook]) -> None:
    """Close every hook; a failing close (e.g. disk full) must not mask the run's exit code."""
    for hook in hooks:
        try:
            hook.close()
        except Exception:  # noqa: BLE001
            log.exception("closing %s failed", type(hook).__name__)
