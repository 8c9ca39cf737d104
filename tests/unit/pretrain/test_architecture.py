"""The layers hold together: the trainer finds resiliency through its entry point, features react
to hook events instead of patching each other, and the Trainer's methods are how they steer it."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pretrain.platform.distributed import DistEnv
from pretrain.train import hooks as hook_api
from pretrain.train.hooks import TrainHook
from pretrain.train.trainer import Trainer
from recipes import ConfigError, load_config
from recipes.config.perf import PerfConfig
from recipes.config.resiliency import FtConfig
from resiliency.monitor.fault_tolerance import FaultToleranceHook

REPO = Path(__file__).resolve().parents[3]
ENV = DistEnv(rank=0, world_size=1, local_rank=0, device="cpu")


@pytest.mark.current_stack
def test_the_trainer_finds_resiliency_hooks_through_the_entry_point() -> None:
    from resiliency.hooks import build_hooks

    assert hook_api.hook_builders() == {"resiliency": build_hooks}


def test_checkpointing_without_a_hook_provider_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    run = load_config(["recipe=gpt_tiny", f"output_dir={tmp_path}"])
    monkeypatch.setattr(hook_api, "hook_builders", dict)
    with pytest.raises(ConfigError, match="no train-hook provider"):
        hook_api.build_hooks(run, ENV, tmp_path / "run")
    off = dataclasses.replace(run, checkpoint=dataclasses.replace(run.checkpoint, enabled=False))
    assert hook_api.build_hooks(off, ENV, tmp_path / "run") == []


@pytest.mark.current_stack
def test_the_core_loads_without_any_upper_layer() -> None:
    """Importing the training session loads no module of resiliency, launch, drill or bench."""
    code = (
        "import sys, pretrain.train.session, pretrain.train.hooks\n"
        "upper = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('resiliency', 'launch', 'drill', 'bench'))\n"
        "print(','.join(upper))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == ""


class _Recorder(TrainHook):
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def on_checkpoint_begin(self, trainer: Any, what: str) -> None:
        self.events.append(("begin", what))

    def on_checkpoint_end(self, trainer: Any, what: str) -> None:
        self.events.append(("end", what))


def _bare_trainer(hooks: list[TrainHook]) -> Trainer:
    """A Trainer with no model: enough for its hook-facing methods."""
    trainer = Trainer.__new__(Trainer)
    trainer.hooks, trainer.env, trainer._checkpointing = hooks, ENV, None
    trainer.state = SimpleNamespace(step=4)
    trainer.stop_requested, trainer.exit_code = False, 0
    trainer.saves, trainer.parts = {}, SimpleNamespace(ddp=[])
    trainer.run = SimpleNamespace(perf=PerfConfig())
    return trainer


def test_checkpoint_events_wrap_the_outermost_work_once_even_on_failure() -> None:
    recorder = _Recorder()
    trainer = _bare_trainer([recorder])
    with trainer.checkpointing("final save"), trainer.checkpointing("save"):
        pass
    with pytest.raises(OSError), trainer.checkpointing("commit"):
        raise OSError("disk full")
    assert recorder.events == [
        ("begin", "final save"),
        ("end", "final save"),
        ("begin", "commit"),
        ("end", "commit"),
    ]


def test_request_stop_is_how_a_hook_ends_the_run() -> None:
    trainer = _bare_trainer([])
    trainer.request_stop(75, "preempted")
    assert (trainer.stop_requested, trainer.exit_code) == (True, 75)


class _FakeRankMonitor:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.timeouts: list[dict] = []  # what the hook sent as it learned

    def load_state_dict(self, state: dict) -> None:
        self.timeouts.append(state["current_timeouts"]["section"]["section"])

    def start_section(self, name: str) -> None:
        self.calls.append(f"start {name}")

    def end_section(self, name: str) -> None:
        self.calls.append(f"end {name}")


def test_fault_tolerance_gives_checkpoint_work_its_own_section(tmp_path: Path) -> None:
    """A save inside a step's section pauses it, runs under "checkpointing" (its own, longer
    timeout) and resumes it; the checkpoint hook is never patched for this."""
    hook = FaultToleranceHook(FtConfig(), ENV, tmp_path, ctx=None)
    hook.client = monitor = _FakeRankMonitor()
    trainer = _bare_trainer([hook])
    hook.before_step(trainer)
    with trainer.checkpointing("commit"):
        pass
    assert monitor.calls == [
        "start step",
        "end step",
        "start checkpointing",
        "end checkpointing",
        "start step",
    ]
    assert monitor.timeouts[-1]["checkpointing"] == FtConfig().timeout_floor_s  # learned


def test_a_commit_phase_restarts_the_checkpointing_section(tmp_path: Path) -> None:
    """The wait on a slow background writer and the collective commit after it are timed
    apart: a rank that stops in the commit gets a full timeout, so it stalls long enough to be
    named. Outside checkpoint work the phase is ignored."""
    hook = FaultToleranceHook(FtConfig(), ENV, tmp_path, ctx=None)
    hook.client = monitor = _FakeRankMonitor()
    trainer = _bare_trainer([hook])
    trainer.checkpoint_phase("commit")
    assert monitor.calls == []
    hook.before_step(trainer)
    with trainer.checkpointing("final save"):
        trainer.checkpoint_phase("commit")
    assert monitor.calls == [
        "start step",
        "end step",
        "start checkpointing",
        "end checkpointing",
        "start checkpointing",
        "end checkpointing",
        "start step",
    ]
    assert hook.timeouts.samples["out_of_section"] == []  # the phase change is not idle time


def test_no_command_hops_layers_by_exec() -> None:
    """A command lives in the layer that owns its work; the moved ones only name the new one."""
    sources = [p for pkg in ("recipes", "pretrain", "resiliency", "launch", "drill", "bench")
               for p in (REPO / pkg).rglob("*.py")]  # fmt: skip
    # The one exec: a standby worker with no standby becomes the trainer it would have forked
    # (a layer below the launcher, as torchrun starts it), not a moved command's new name.
    fallback = REPO / "launch" / "standby" / "worker.py"
    hops = [str(p) for p in sources if "os.execv" in p.read_text() and p != fallback]
    assert hops == []
    for old, new in (
        (["-m", "pretrain.hf", "export", "x"], "python -m resiliency.hf export x"),
        (["-m", "resiliency", "soak", "--out", "y"], "python -m drill.soak --out y"),
        (["-m", "pretrain.prepare", "--stdlib"], "python -m pretrain.data.prepare --stdlib"),
        (["-m", "pretrain.run", "--standalone"], "python -m launch.torchrun --standalone"),
    ):
        proc = subprocess.run([sys.executable, *old], cwd=REPO, capture_output=True, text=True)
        assert proc.returncode == 2 and new in proc.stderr, proc.stderr


class _Counter(TrainHook):
    """A hook with state of its own: how many steps it saw, carried across restarts."""

    state_key = "counter"

    def __init__(self) -> None:
        self.seen = 0
        self.resumed_with: float | None = None

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.seen = state["seen"]

    def on_resumed(self, trainer: Any, load_s: float) -> None:
        self.resumed_with = load_s


def test_a_hook_keeps_its_own_state_in_the_checkpoint_record(tmp_path: Path) -> None:
    """What the checkpointer writes (train_state.json) is the Trainer's state_dict: a stateful
    hook's entry goes out with it and comes back into a new process's hook before on_resumed."""
    from pretrain.train.guard import NumericGuard
    from recipes.config.train import GuardConfig
    from resiliency.checkpoint.rank_state import read_train_state, write_train_state

    saver = _Counter()
    saver.seen = 7
    trainer = _bare_trainer([saver, _Recorder()])
    trainer.state = SimpleNamespace(step=4, consumed_samples=32, consumed_tokens=2048)
    trainer.guard = NumericGuard(GuardConfig())
    trainer.parts = SimpleNamespace(
        plan=SimpleNamespace(global_batch_size=8),
        scheduler=SimpleNamespace(state_dict=lambda: {"num_steps": 32}),
        optimizer=SimpleNamespace(param_groups=[{"lr": 1e-3}]),
    )
    trainer.run = SimpleNamespace(data=SimpleNamespace(seed=3))
    write_train_state(tmp_path, trainer.state_dict())

    restored = _Counter()
    fresh = _bare_trainer([restored])
    fresh.guard = NumericGuard(GuardConfig())
    fresh.load_state_dict(read_train_state(tmp_path), load_s=1.5)
    assert (restored.seen, restored.resumed_with) == (7, 1.5)
    assert (fresh.state.step, fresh.state.consumed_samples, fresh.state.consumed_tokens) == (
        4,
        32,
        2048,
    )
    untouched = _Counter()  # a checkpoint saved without this hook's state leaves it as built
    later = _bare_trainer([untouched])
    later.guard = NumericGuard(GuardConfig())
    later.load_state_dict({**read_train_state(tmp_path), "hooks": {}})
    assert untouched.seen == 0
