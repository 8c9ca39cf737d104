"""One training session: process groups, hooks around the Trainer, exit code from failures."""

from __future__ import annotations

import logging
from pathlib import Path

from pretrain import exit_codes
from pretrain.distributed import init_distributed, shutdown
from pretrain.failures import classify
from pretrain.hooks import TrainHook, build_hooks
from pretrain.logs import setup_logging
from pretrain.loop import Trainer
from recipes import ConfigError, RunConfig, to_yaml

log = logging.getLogger(__name__)


def train(run: RunConfig, device: str, dp: int) -> int:
    setup_logging(run.logging.level)
    env = init_distributed(device)
    run_dir = Path(run.output_dir) / run.run_id
    if env.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = run_dir / "config.yaml.tmp"
        tmp.write_text(to_yaml(run))
        tmp.replace(run_dir / "config.yaml")  # one path for every rank and attempt
    try:
        hooks = build_hooks(run, env, run_dir)
    except ConfigError as exc:
        log.error("config error: %s", exc)
        return exit_codes.CONFIG_ERROR
    trainer = None
    try:
        for hook in hooks:
            run = hook.configure(run, dp)
        trainer = Trainer(run, env, dp, run_dir, hooks)
        trainer.fit()
        code = trainer.exit_code
    except Exception as exc:
        for hook in hooks:
            hook.on_exception(trainer, exc)
        failure = classify(exc)
        log.exception(
            "training failed (%s, exit %d, %s)",
            failure.kind,
            failure.exit_code,
            "retryable" if failure.retryable else "do not retry",
        )
        return failure.exit_code
    finally:
        _close_all(hooks)
    shutdown()
    return code


def _close_all(hooks: list[TrainHook]) -> None:
    """Close every hook; a failing close (e.g. disk full) must not mask the run's exit code."""
    for hook in hooks:
        try:
            hook.close()
        except Exception:  # noqa: BLE001
            log.exception("closing %s failed", type(hook).__name__)
