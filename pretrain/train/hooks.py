"""The train-loop hook API: what features see of the loop, and the events they react to.

Every method is a no-op, so a disabled feature costs nothing. A feature that needs to know about
something another component does gets an event here (e.g. ``on_checkpoint_begin``) instead of
patching that component. Hooks see the Trainer through :class:`pretrain.train.view.TrainerView`
and change the loop only through its methods (``request_stop``, ``checkpointing``, ...). A hook
with state of its own sets ``state_key``: its ``state_dict()`` rides in every checkpoint and
comes back through ``load_state_dict`` on restore (torchtitan's Stateful).

Hook providers are found through the ``mcore_recipes.train_hooks`` entry-point group
(pyproject.toml), so the core never imports the packages built on top of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from recipes import ConfigError

if TYPE_CHECKING:
    from pathlib import Path

    from pretrain.platform.distributed import DistEnv
    from pretrain.train.view import TrainerView
    from recipes.config.run import RunConfig

HOOK_PROVIDERS = "mcore_recipes.train_hooks"


@dataclass
class StepResult:
    step: int
    loss: float
    grad_norm: float
    lr: float
    step_time_s: float
    tokens_per_s: float
    stop_asked: bool = False  # some rank's hook asked to stop (TrainHook.wants_stop)
    # some rank had a Ctrl-C (pretrain/context/interrupts.py): stop_asked is set too
    interrupted: bool = False
    # Throughput (pretrain/train/progress.py): model TFLOP/s per device, MFU (None: no known peak)
    tflops_per_device: float = 0.0
    mfu: float | None = None
    memory_gib: dict[str, float] | None = None  # on logged steps only
    # train.guard: this step's update was not applied (policy skip, or rollback), and why
    skipped: bool = False
    anomaly: str | None = None  # non-finite loss or gradients, a loss spike; None: a normal step
    # The sum of the step's samples' digests over all DP ranks (pretrain/data/dataset.py):
    # equal for two runs that trained this step on the same samples, at any DP size.
    sample_hash: int | None = None


@dataclass
class EvalResult:
    split: str  # "valid" | "test"
    step: int  # the training step it evaluated
    loss: float  # mean over eval_iters global batches
    seconds: float


class TrainHook:
    """Base hook: every method is a no-op, so disabled features cost nothing."""

    # Set by a hook whose state must survive a restart: the name it is saved under.
    state_key: str | None = None

    def state_dict(self) -> Any:
        """This hook's state for the checkpoint (JSON-serialisable), when ``state_key`` is set.
        It must be the same on every rank and need no collective: rank 0's copy is saved
        (train_state.json) and every rank gets it back on restore."""
        return None

    def load_state_dict(self, state: Any) -> None:
        """The state this hook saved, from the checkpoint being restored (before
        ``on_resumed``); not called when the checkpoint holds none under ``state_key``."""

    def configure(self, run: RunConfig, dp: int) -> RunConfig:
        """Before the model is built (after process groups exist); may adjust the config."""
        return run

    def on_start(self, trainer: TrainerView) -> None:
        pass

    def before_step(self, trainer: TrainerView) -> None:
        pass

    def after_step(self, trainer: TrainerView, result: StepResult) -> None:
        pass

    def wants_stop(self, trainer: TrainerView) -> bool:
        """Asked on every rank in each step, after its backward pass and before its optimizer
        step: if any rank answers True, every rank's StepResult has ``stop_asked`` set. Ranks
        agree on it in the step's loss all-reduce, so asking costs no collective of its own."""
        return False

    def on_checkpoint_begin(self, trainer: TrainerView, what: str) -> None:
        """Checkpoint work starts (``what``: "save", "commit", "final save", "local save"...);
        it may block for much longer than a step. Not nested: one begin, then one end."""

    def on_checkpoint_phase(self, trainer: TrainerView, phase: str) -> None:
        """Inside announced checkpoint work, a new phase starts (``"commit"``: the shards are
        written, the collective commit begins), so a watchdog can time it on its own: the wait
        for a slow background writer before it must not eat the commit's budget."""

    def on_checkpoint_end(self, trainer: TrainerView, what: str) -> None:
        """The checkpoint work that ``on_checkpoint_begin`` announced is over (or failed)."""

    def on_eval_begin(self, trainer: TrainerView, split: str) -> None:
        """A validation (or test) pass starts; forward only, it may take several steps' time."""

    def on_eval_end(self, trainer: TrainerView, result: EvalResult) -> None:
        """The pass ``on_eval_begin`` announced is over; its mean loss is the same on every rank."""

    def on_resumed(self, trainer: TrainerView, load_s: float) -> None:
        """The loop continues from a restored checkpoint that took ``load_s`` to load."""

    def roll_back(self, trainer: TrainerView, bad_step: int) -> int | None:
        """``train.guard.policy=rollback``, on every rank at once: restore the newest verified
        checkpoint older than ``bad_step`` in place and return its step; None: this hook keeps
        no checkpoints (the next hook is asked; if none restores, the run stops)."""
        return None

    def on_anomaly(self, trainer: TrainerView, result: StepResult, action: str) -> None:
        """The numeric guard acted on ``result.step`` (``result.anomaly`` says why): "skip"
        (its update was dropped; ``after_step`` follows as usual), "rollback" or "replay"
        (done: the loop continues after ``trainer.state.step``, past the skipped data or on the
        same data, and ``after_step`` never sees this step) or "stop" (the run fails next)."""

    def on_report(self, trainer: TrainerView, scalars: dict[str, float], step: int) -> None:
        """Another hook has run-level scalars for the run's reports (TensorBoard, W&B), e.g.
        the goodput ledger at the end; sent with ``Trainer.report``."""

    def on_end(self, trainer: TrainerView) -> None:
        pass

    def on_exception(self, trainer: TrainerView | None, exc: BaseException) -> None:
        """The run failed (``trainer`` is None when it failed before the model was built)."""

    def close(self) -> None:
        pass


HookBuilder = Callable[["RunConfig", "DistEnv", "Path"], list[TrainHook]]


def hook_builders() -> dict[str, HookBuilder]:
    """The installed hook providers by entry-point name; each builds its hooks for one run."""
    return {ep.name: ep.load() for ep in entry_points(group=HOOK_PROVIDERS)}


def build_hooks(run: RunConfig, env: DistEnv, run_dir: Path) -> list[TrainHook]:
    """Every provider's hooks for this run, providers in name order (one provider today).
    Checkpointing is a hook: a run that asks for it never trains silently without it."""
    providers = hook_builders()
    if run.checkpoint.enabled and not providers:
        raise ConfigError(
            f"checkpoint.enabled=true but no train-hook provider is installed "
            f"(entry-point group {HOOK_PROVIDERS}); install the package "
            "(pip install -e .) or set checkpoint.enabled=false"
        )
    hooks: list[TrainHook] = []
    for _, builder in sorted(providers.items()):
        hooks.extend(builder(run, env, run_dir))
    return hooks
