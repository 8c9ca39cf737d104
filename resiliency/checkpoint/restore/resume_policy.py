"""What a resumed run may change from the config its checkpoint recorded, and under which rule.

Every key of the resolved config falls in one class (first matching rule below wins):

- ``free``: settings of this launch only (logging, intervals, launcher, resiliency, where files
  go); applied, and listed in the log and the attempt record.
- ``topology``: parallel layout, batch sizes and the optimizer's checkpoint format; judged by
  the topology validator
  (``checkpoint/topology.py``) before this policy runs, with its own rules (reshard, LR scaling
  for a global-batch change).
- ``grows``: ``train.train_steps`` may grow past the restored step; it may not fall to or below
  it (nothing would be trained).
- ``schedule``: optimizer hyperparameters and the LR/weight-decay schedule, compared as the
  scheduler sees them (an unset ``scheduler.decay_steps`` follows ``train.train_steps``).
  A difference is refused unless ``checkpoint.schedule_on_resume`` says which side wins:
  ``checkpoint`` (keep the saved values, as Megatron-LM's ``--use-checkpoint-opt_param-
  scheduler``) or ``config`` (apply this launch's, as ``--override-opt_param-scheduler``).
- ``must_match``: everything else (model shape, tokenizer, data paths/blend/split, seeds,
  precision, the optimizer's kind); a difference is refused before anything is loaded.
  A key nobody classified is ``must_match``: a new setting is safe until someone decides.

Refusals are :class:`recipes.ConfigError` (exit 2) naming each key with both values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from recipes import ConfigError, RunConfig

KeyClass = Literal["free", "topology", "grows", "schedule", "must_match"]
SCHEDULE_CHOICES = ("refuse", "checkpoint", "config")

# (key or dotted prefix, class): the first match wins, so specific keys come first.
RULES: tuple[tuple[str, KeyClass], ...] = (
    # Restored in the saved format, saved in the new one: the validator knows which reshard.
    ("checkpoint.optim_format", "topology"),
    ("train.train_steps", "grows"),
    ("train.global_batch_size", "topology"),
    ("train.micro_batch_size", "topology"),
    # Whether and how often DP may resize in the job: the sizes themselves are checked by the
    # topology validator at each restore.
    ("parallel.elastic", "free"),
    ("parallel.elastic_min_interval_s", "free"),
    ("parallel.", "topology"),
    ("optimizer.name", "must_match"),
    ("optimizer.use_distributed_optimizer", "topology"),  # how the state is sharded over DP
    ("optimizer.", "schedule"),
    ("scheduler.", "schedule"),
    # Set by the restore itself (the checkpoint's padded vocab, no init of restored weights).
    ("model.padded_vocab_size", "free"),
    ("model.perform_initialization", "free"),
    ("model.layout_invariant_init", "free"),  # how fresh weights are drawn; none are drawn
    ("model.init_method_std", "free"),
    ("model.make_vocab_size_divisible_by", "free"),  # the padded vocab is the checkpoint's
    ("data.cache_dir", "free"),
    # Whether a rebuilt corpus may be resumed on: its files were compared by content already
    # (restore_plan.check_corpus), this only says what to do about a difference.
    ("data.allow_changed_corpus", "free"),
    ("train.fault", "free"),
    # What an anomaly does from now on; data already skipped is in the saved cursor.
    ("train.guard.", "free"),
    ("train.device", "free"),
    # Validation and reporting move no training state (tests/integration/test_training.py).
    ("train.eval_interval", "free"),
    ("train.eval_iters", "free"),
    ("train.peak_tflops", "free"),
    ("train.step_time_s", "free"),  # what the planners assume, not what trains
    # Which kernels compute the same math (bitwise reproducibility), not what is trained.
    ("train.deterministic", "free"),
    # FP8 changes the numerics like train.precision does; the other knobs trade memory or
    # overlap for time and train the same losses (tests/integration/test_perf_knobs.py).
    ("perf.fp8", "must_match"),
    ("perf.fp8_recipe", "must_match"),
    ("perf.", "free"),
    ("run_id", "free"),
    ("output_dir", "free"),
    ("checkpoint.", "free"),  # checkpoint.signing_key_env too: which key, not what trained
    ("resiliency.", "free"),
    ("logging.", "free"),
    ("launch.", "free"),
)


class PolicyRefusal(ConfigError):
    """A resume the policy refuses (exit 2); ``changes``: the differences that refused it."""

    def __init__(self, message: str, changes: list["Change"]) -> None:
        super().__init__(message)
        self.changes = changes


@dataclass(frozen=True)
class Change:
    key: str
    saved: Any
    now: Any
    kind: KeyClass

    def describe(self) -> str:
        return f"{self.key}: {self.saved!r} -> {self.now!r}"


def classify_key(key: str) -> KeyClass:
    for prefix, kind in RULES:
        if key == prefix or (prefix.endswith(".") and key.startswith(prefix)):
            return kind
    return "must_match"


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def effective(config: dict[str, Any]) -> dict[str, Any]:
    """Flattened, with the scheduler's derived values spelled out (what it actually uses)."""
    flat = flatten(config)
    if flat.get("scheduler.decay_steps") is None:
        flat["scheduler.decay_steps"] = flat.get("train.train_steps")
    for side in ("start", "end"):
        if flat.get(f"scheduler.{side}_weight_decay") is None:
            flat[f"scheduler.{side}_weight_decay"] = flat.get("optimizer.weight_decay")
    return flat


def diff(saved: dict[str, Any], now: dict[str, Any]) -> list[Change]:
    old, new = effective(saved), effective(now)
    keys = sorted(set(old) | set(new))
    return [
        Change(k, old.get(k), new.get(k), classify_key(k)) for k in keys if old.get(k) != new.get(k)
    ]


@dataclass(frozen=True)
class ResumeDecision:
    run: RunConfig  # the config to train with (checkpoint's schedule kept if asked)
    applied: list[Change]  # differences that take effect (free, grows, schedule "config")
    kept: list[Change]  # differences where the checkpoint's value stays ("checkpoint")

    def record(self) -> dict[str, Any]:
        """For the attempt record: what changed against the checkpoint, by outcome."""
        return {
            "applied": {c.key: [c.saved, c.now] for c in self.applied},
            "kept_from_checkpoint": {c.key: [c.saved, c.now] for c in self.kept},
        }


def reconcile(
    run: RunConfig,
    saved_config: dict[str, Any],
    step: int,
    content_checked: frozenset[str] = frozenset(),
    weights_only: bool = False,
) -> ResumeDecision:
    """Judge every difference between ``run`` and the config saved with checkpoint ``step``.
    ``content_checked``: keys naming files whose content was compared with the checkpoint's
    already (``data.tokenizer_path``: the same tokenizer moved elsewhere is no change).
    ``weights_only``: the step holds weights and nothing trained with them (an import): only
    the model and the tokenizer must match, the run's own schedule and data are free."""
    changes = [
        dataclasses.replace(c, kind="free") if _free(c, content_checked, weights_only) else c
        for c in diff(saved_config, dataclasses.asdict(run))
        if c.kind != "topology"
    ]
    problems = [c for c in changes if c.kind == "must_match"]
    problems += [c for c in changes if c.kind == "grows" and not _grows_past(c, step)]
    schedule = [c for c in changes if c.kind == "schedule"]
    choice = run.checkpoint.schedule_on_resume
    if problems:
        raise PolicyRefusal(_refusal(problems, step), problems)
    if schedule and choice == "refuse":
        implicit = run.scheduler.decay_steps is None
        raise PolicyRefusal(_schedule_refusal(schedule, step, implicit), schedule)
    kept = schedule if choice == "checkpoint" else []
    applied = [c for c in changes if c not in kept]
    if kept:
        run = _with_saved_schedule(run, saved_config)
    return ResumeDecision(run, applied, kept)


def _free(change: Change, content_checked: frozenset[str], weights_only: bool) -> bool:
    if change.key in content_checked:
        return True
    bound = change.key.startswith(("model.", "data.tokenizer")) or change.kind == "grows"
    return weights_only and not bound


def _grows_past(change: Change, step: int) -> bool:
    return isinstance(change.now, int) and change.now > step


def _refusal(problems: list[Change], step: int) -> str:
    lines = "\n".join(f"  {c.describe()}" for c in problems)
    steps = any(c.kind == "grows" for c in problems)
    return (
        f"resuming from checkpoint step {step} would silently change what it trained:\n{lines}\n"
        + (f"train.train_steps must exceed the restored step {step}; " if steps else "")
        + "the other keys must match the checkpoint. Restore them, or start a new run under "
        "another run_id."
    )


def _schedule_refusal(changes: list[Change], step: int, implicit_decay: bool) -> str:
    lines = "\n".join(f"  {c.describe()}" for c in changes)
    implicit = implicit_decay and any(c.key == "scheduler.decay_steps" for c in changes)
    hint = (
        " (scheduler.decay_steps is unset, so it follows train.train_steps: set it to the "
        "saved value to keep the schedule)"
        if implicit
        else ""
    )
    return (
        f"the optimizer schedule differs from checkpoint step {step}'s:\n{lines}\n"
        "Say which wins: checkpoint.schedule_on_resume=checkpoint keeps the saved values, "
        f"checkpoint.schedule_on_resume=config applies these{hint}."
    )


def _with_saved_schedule(run: RunConfig, saved: dict[str, Any]) -> RunConfig:
    """``run`` with the checkpoint's optimizer and scheduler sections (its kind stays)."""
    optimizer = dataclasses.replace(run.optimizer, **_known(run.optimizer, saved["optimizer"]))
    scheduler = dataclasses.replace(run.scheduler, **_known(run.scheduler, saved["scheduler"]))
    if saved["scheduler"].get("decay_steps") is None:
        # The saved schedule decayed over the saved train_steps: pin that horizon (an unset
        # value would follow this launch's train_steps, whatever this launch set it to).
        scheduler = dataclasses.replace(scheduler, decay_steps=saved["train"]["train_steps"])
    return dataclasses.replace(run, optimizer=optimizer, scheduler=scheduler)


def _known(section: Any, saved: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(section)}
    return {k: v for k, v in saved.items() if k in names}
