"""Shared runs for the fault-tolerance tests: ``python -m launch local`` jobs on 2 CPU ranks.

One clean ft_launcher run is shared by test_ft (loss baseline), test_straggler (no false
positive) and test_metrics (the metrics file): the first test that needs it runs it into the
session's base temp dir, later ones reuse it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from tests.helpers import REPO

STEPS, SAVE_EVERY = 12, 4
FLOOR_S, CHECK_S = 4.0, 0.5
# Small timeouts keep the hang test short; the floor still covers the first (slow) steps.
FT = [
    "launch.backend=ft_launcher",
    "resiliency.ft.learn_after_steps=3",
    f"resiliency.ft.timeout_floor_s={FLOOR_S}",
    f"resiliency.ft.check_interval_s={CHECK_S}",
]
STRAGGLER = [
    "resiliency.straggler.enabled=true",
    "resiliency.straggler.report_interval=4",
    "resiliency.straggler.warmup_steps=2",
]


def base_overrides(
    tiny: Sequence[str], root: Path, run_id: str, floor_s: float = FLOOR_S
) -> list[str]:
    return [
        *tiny,
        f"output_dir={root}",
        f"run_id={run_id}",
        f"train.train_steps={STEPS}",
        f"checkpoint.save_interval={SAVE_EVERY}",
        *(
            o if "timeout_floor_s" not in o else f"resiliency.ft.timeout_floor_s={floor_s}"
            for o in FT
        ),
        *STRAGGLER,
    ]


def launch_cmd(
    overrides: Sequence[str], nproc: int = 2, max_restarts: int | None = None
) -> list[str]:
    extra = [] if max_restarts is None else [f"--max-restarts={max_restarts}"]
    return [sys.executable, "-m", "launch", "local", f"--nproc={nproc}", *extra, *overrides]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def launch_local(
    overrides: Sequence[str], max_restarts: int | None = None, timeout: float = 240
) -> subprocess.CompletedProcess:
    return subprocess.run(
        launch_cmd(overrides, max_restarts=max_restarts),
        cwd=REPO,
        env=env(),
        text=True,
        capture_output=True,
        timeout=timeout,
    )


def clean_run(tiny: Sequence[str], base: Path) -> Path:
    """The shared clean run (ft_launcher, straggler reports, metrics); its run dir."""
    root = base / "ft-clean"
    run_dir = root / "clean"
    if not (run_dir / "attempts" / "attempt-01.json").exists():
        proc = launch_local(base_overrides(tiny, root, "clean"))
        assert proc.returncode == 0, proc.stderr[-6000:]
    return run_dir


def attempt(run_dir: Path, number: int) -> dict[str, Any]:
    return json.loads((run_dir / "attempts" / f"attempt-{number:02d}.json").read_text())


def attempts(run_dir: Path) -> list[dict[str, Any]]:
    paths = sorted((run_dir / "attempts").glob("attempt-[0-9][0-9].json"))
    return [json.loads(p.read_text()) for p in paths]


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    path = run_dir / "metrics" / "steps.jsonl"
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if path.exists() and len(path.read_text().splitlines()) >= step:
            return
        time.sleep(0.1)
    raise AssertionError(f"step {step} not reached (launcher exit {proc.poll()})")


def kill_node(launcher: psutil.Process) -> None:
    """A lost node: its launcher and everything under it (the workers run in sessions of
    their own, so not as a process group), SIGKILLed together."""
    family = [*launcher.children(recursive=True), launcher]
    for proc in family:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(family, timeout=30)


# An elastic run trains part of the way at each size, so it strays from the full-size run by
# no more than the sizes stray from each other, with room for where in the run that happens.
BOUND_FACTOR = 4.0


def assert_elastic_losses_within_bound(
    got: dict[int, dict], full: dict[int, dict], half: dict[int, dict], context: str
) -> None:
    """Every loss of an elastic run (``got``) against the uninterrupted full-size run, within
    the bound the two sizes' own uninterrupted runs (``full``, ``half``) set: a resize that
    lost or garbled optimizer state strays far past it."""

    def rel(a: dict, b: dict, s: int) -> float:
        return abs(a[s]["loss"] - b[s]["loss"]) / abs(b[s]["loss"])

    layouts_differ = max(rel(half, full, s) for s in full)
    bound = BOUND_FACTOR * max(layouts_differ, 1e-7)
    worst = max(rel(got, full, s) for s in full)
    assert worst <= bound, f"{context}: loss strays {worst:.2e} > {bound:.2e}"
