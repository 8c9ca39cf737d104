"""Shared helpers for tests that launch real multi-process training jobs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import psutil

from resiliency.storage.checksum import describe_files
from resiliency.storage.manifest import Manifest, manifest_checksum, read_manifest

REPO = Path(__file__).resolve().parents[1]
# A recipe of the user's own, outside the package (the shape of recipes/conf/recipe/*.yaml),
# for --config-dir: gpt_tiny on synthetic tokens, 7 steps.
USER_RECIPE = """\
# @package _global_
# gpt_tiny on synthetic tokens, 7 steps
defaults:
  - override /model: gpt_tiny
  - override /data: mock
parallel:
  tp: 2
train:
  train_steps: 7
launch:
  nproc_per_node: 2
"""
TORCHRUN = str(Path(sys.executable).parent / "torchrun")


def pretrain_cmd(nproc: int, overrides: Sequence[str]) -> list[str]:
    return [TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", "-m", "pretrain", *overrides]


def run_pretrain(
    nproc: int,
    overrides: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    check: bool = True,
) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(
        pretrain_cmd(nproc, overrides),
        cwd=REPO,
        env=full_env,
        text=True,
        capture_output=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"pretrain failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return proc


def worker_report(name: str, out: Path, timeout: float = 300) -> dict:
    """Run tests/workers/<name>.py (one process) and return the JSON report it wrote to
    ``out``."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "workers" / f"{name}.py"), str(out)],
        cwd=REPO,
        text=True,
        capture_output=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def read_steps(run_dir: Path) -> dict[int, dict]:
    """Per-step metrics; a step logged twice (re-done after a restart) keeps its last record."""
    steps: dict[int, dict] = {}
    path = run_dir / "metrics" / "steps.jsonl"
    for line in path.read_text().splitlines():
        record = json.loads(line)
        steps[record["step"]] = record
    return steps


def losses(run_dir: Path) -> list[float]:
    steps = read_steps(run_dir)
    return [steps[s]["loss"] for s in sorted(steps)]


def raw_commit(step_dir: Path, manifest: Manifest) -> None:
    """Write manifest + matching COMMITTED without the publish-side checks (a forged dir)."""
    raw = manifest.to_json().encode()
    (step_dir / "manifest.json").write_bytes(raw)
    (step_dir / "COMMITTED").write_text(manifest_checksum(raw) + "\n")


def recommit_file(step_dir: Path, rel: str) -> None:
    """After editing ``rel``, rewrite its manifest entry and COMMITTED as a careful forger
    would: only the file's content can then tell that something is wrong."""
    manifest = read_manifest(step_dir)
    entries = {e.path: e for e in manifest.files}
    entries[rel] = describe_files(step_dir, [rel])[0]
    manifest.files = sorted(entries.values(), key=lambda e: e.path)
    raw_commit(step_dir, manifest)


def follow_uploaders(run_dir: Path) -> list[psutil.Process]:
    """The live `resiliency upload --follow` processes serving ``run_dir`` (by command line)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "upload" in cmd and "--follow" in cmd and str(run_dir) in cmd:
            found.append(proc)
    return found
