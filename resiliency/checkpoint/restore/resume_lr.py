"""The learning-rate schedule of a resumed run: kept from the checkpoint, replaced by this run's
(``checkpoint.schedule_on_resume=config``), or scaled for a changed global batch."""

from __future__ import annotations

import logging
from typing import Any

from recipes.config.optim import OptimizerConfig
from resiliency.checkpoint.restore.topology import scale_lr

log = logging.getLogger(__name__)


def set_group_lrs(optimizer: Any, max_lr: float, min_lr: float) -> None:
    """The per-group LR bounds megatron's scheduler reads (groups without them: none)."""
    for group in optimizer.param_groups:
        group.update({k: v for k, v in (("max_lr", max_lr), ("min_lr", min_lr)) if k in group})


def schedule_from_config(parts: Any, opt: OptimizerConfig) -> None:
    """checkpoint.schedule_on_resume=config (Megatron-LM's --override-opt_param-scheduler):
    the scheduler keeps this run's values and only takes the step count from the checkpoint;
    the optimizer's restored per-group hyperparameters are replaced by this run's."""
    scheduler = parts.scheduler
    scheduler.override_opt_param_scheduler = True
    scheduler.use_checkpoint_opt_param_scheduler = False
    set_group_lrs(parts.optimizer, opt.lr, opt.min_lr)
    for group in parts.optimizer.param_groups:
        values = {"eps": opt.adam_eps, "betas": (opt.adam_beta1, opt.adam_beta2)}
        group.update({k: v for k, v in values.items() if k in group})
    log.warning(
        "restore: checkpoint.schedule_on_resume=config: this run's optimizer "
        "schedule replaces the checkpoint's (lr %.3e)",
        opt.lr,
    )


def load_optimizer_keeping_schedule(optimizer: Any, state: Any, saved: dict[str, Any]) -> None:
    """A warm start's optimizer state (Adam's moments and step counts) loaded while every
    group's hyperparameters (lr, bounds, weight decay, betas, eps) stay this run's: its
    scheduler starts at step 0 from its own config. The saved bounds are set first because
    megatron 0.19 pairs saved and live groups by their max/min LR (``saved``: the step's
    scheduler state)."""
    mine = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    set_group_lrs(optimizer, saved["max_lr"], saved["min_lr"])
    optimizer.load_state_dict(state)
    for group, values in zip(optimizer.param_groups, mine, strict=True):
        group.update(values)


def scale_lr_for_batch_change(
    parts: Any, train_state: dict[str, Any], rule: str
) -> dict[str, Any] | None:
    """Scale the saved LR schedule (and ``train_state["lr"]``) by ``rule`` when the global batch
    changed; what was done, for the attempt record (None: same batch, nothing to do)."""
    saved, target = train_state["global_batch_size"], parts.plan.global_batch_size
    if saved == target:
        return None
    sched = train_state["scheduler"]
    # mcore's scheduler reads per-group max_lr/min_lr (restored with the optimizer) first.
    for values in [sched, *parts.optimizer.param_groups]:
        for key in ("max_lr", "min_lr"):
            if key in values:
                values[key] = scale_lr(values[key], saved, target, rule)
    train_state["lr"] = scale_lr(train_state["lr"], saved, target, rule)
    log.warning(
        "restore: global batch %d -> %d: lr scaled by rule %r (max_lr %.3e)",
        saved,
        target,
        rule,
        sched["max_lr"],
    )
    return {"rule": rule, "saved_global_batch": saved, "global_batch": target}
