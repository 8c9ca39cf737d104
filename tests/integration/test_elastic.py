"""Elastic data parallelism on one machine (parallel.elastic): two ft_launcher processes act
as the two nodes of one job; one "node" (its launcher and its worker) is SIGKILLed from
outside at a random step; the job goes on at DP 1 in the same launch, grows back to DP 2
when the node returns, and finishes.

Judged against two uninterrupted runs of the same job read straight from their
``steps.jsonl``: every step's sample hash equals the full-size run's (the same samples,
whoever drew them), the losses before the shrink are bit-identical, and every loss is within
a bound set by the same two layouts' own difference: an uninterrupted run at DP 1 against the
one at DP 2 (floating-point reduction order; dropout is off).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.ft_helpers import assert_elastic_losses_within_bound, env, kill_node, launch_cmd
from tests.helpers import REPO, read_steps, run_pretrain

STEPS, SAVE_EVERY = 100, 10
INTERVAL_S = 5.0


def _job(tiny: list[str], root: Path, run_id: str) -> list[str]:
    return [
        *tiny,
        "parallel.tp=1",
        f"output_dir={root}",
        f"run_id={run_id}",
        f"train.train_steps={STEPS}",
        f"checkpoint.save_interval={SAVE_EVERY}",
        "logging.log_interval=50",
    ]


def _second_node(launcher: subprocess.Popen) -> psutil.Process:
    for child in psutil.Process(launcher.pid).children():
        if any("is_host=0" in arg for arg in child.cmdline()):
            return child
    raise AssertionError("no second node's ft_launcher under launch local")


def _wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float) -> None:
    path, deadline = run_dir / "metrics" / "steps.jsonl", time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if path.exists() and any(
            json.loads(line)["step"] >= step for line in path.read_text().splitlines()[-5:]
        ):
            return
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached (launch local exit {proc.poll()})")


@pytest.mark.slow
def test_a_lost_node_shrinks_the_job_in_place_and_it_grows_back_on_the_same_samples(
    tiny_overrides: list[str], tmp_path: Path
) -> None:
    seed = int(os.environ.get("ELASTIC_SEED", random.SystemRandom().randrange(1 << 20)))
    kill_at = random.Random(seed).randrange(SAVE_EVERY + 2, STEPS // 3)
    elastic = tmp_path / "elastic" / "run"
    overrides = [
        *_job(tiny_overrides, elastic.parent, "run"),
        "launch.backend=ft_launcher",
        "launch.nodes=2",
        "launch.min_nodes=1",
        "parallel.elastic=true",
        f"parallel.elastic_min_interval_s={INTERVAL_S}",
    ]
    log = (tmp_path / "launch.log").open("w")
    proc = subprocess.Popen(
        launch_cmd(overrides, nproc=1), cwd=REPO, env=env(), stdout=log, stderr=log, text=True
    )
    try:
        _wait_for_step(elastic, kill_at, proc, timeout=180)
        kill_node(_second_node(proc))
        # The two uninterrupted references run while the job waits out its re-rendezvous
        # and the node's return (mostly idle time).
        full, half = tmp_path / "full" / "run", tmp_path / "half" / "run"
        run_pretrain(2, _job(tiny_overrides, full.parent, "run"))
        run_pretrain(1, _job(tiny_overrides, half.parent, "run"))
        code = proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    output = (tmp_path / "launch.log").read_text()
    assert code == 0, f"seed {seed}: launch local exited {code}\n{output[-6000:]}"

    ref, solo, got = read_steps(full), read_steps(half), read_steps(elastic)
    assert sorted(got) == list(range(1, STEPS + 1)), f"seed {seed}: steps missing"
    # The same samples at every step, at whatever size the step ran.
    assert [got[s]["sample_hash"] for s in ref] == [ref[s]["sample_hash"] for s in ref]
    assert [solo[s]["sample_hash"] for s in ref] == [ref[s]["sample_hash"] for s in ref]
    sizes = [got[s]["dp"] for s in sorted(got)]
    shrunk = sizes.index(1)  # it trained at DP 1 ...
    assert 2 in sizes[shrunk:], f"seed {seed}: never grew back: {sizes}"  # ... and grew back
    assert sizes[-1] == 2 and shrunk <= kill_at
    for s in range(1, shrunk + 1):  # steps 1..shrunk ran at full size from the start
        assert got[s]["loss"] == ref[s]["loss"], f"seed {seed}: step {s} before the shrink"

    assert_elastic_losses_within_bound(got, ref, solo, f"seed {seed}")

    # The attempt records and goodput name both resizes.
    goodput = subprocess.run(
        [sys.executable, "-m", "resiliency", "goodput", str(elastic)],
        cwd=REPO, env=env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "shrink DP 2 -> 1" in goodput.stdout and "grow DP 1 -> 2" in goodput.stdout, (
        goodput.stdout + goodput.stderr
    )
    assert "DP 1 (1 ranks)" in goodput.stdout
