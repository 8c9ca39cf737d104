"""Node health: checks run on every node before training and after every restart.

``python -m resiliency.monitor.health --config CONFIG --out DIR`` (the Slurm script runs it once per
node with ``srun`` before the training step) checks free space in the checkpoint and local-tier
dirs, the size of ``/dev/shm``, the GPUs (``nvidia-smi``, where CUDA exists), the CPUs this
task may use, and an optional site script; it writes ``DIR/<node>.json`` and exits 0 when the
node is healthy, 1 when not. The launcher reads the reports to exclude unhealthy nodes from the
requeued job; the trainer copies them, with one timed all-reduce over every rank, into the
attempt record.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from recipes import RunConfig
from recipes.config.resiliency import HealthConfig
from recipes.inputs import existing_ancestor
from recipes.load import load_config_file

log = logging.getLogger(__name__)

HEALTH_DIR_ENV = "MCORE_RECIPES_HEALTH_DIR"  # where this attempt's node reports are
NODE_ENV = "MCORE_RECIPES_NODE"  # the node's name, as the scheduler spells it
GIB = 1 << 30


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class NodeReport:
    node: str
    host: str
    time: float
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def failures(self) -> list[str]:
        return [f"{c.name}: {c.detail}" for c in self.checks if not c.ok]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def node_name() -> str:
    """The scheduler's name for this node (Slurm's may differ from the host name)."""
    return os.environ.get("SLURMD_NODENAME") or os.environ.get(NODE_ENV) or socket.gethostname()


def free_space(name: str, path: Path, min_gib: float) -> Check:
    probe = existing_ancestor(path)  # the dir may not exist yet
    free = shutil.disk_usage(probe).free / GIB
    return Check(name, free >= min_gib, f"{free:.1f} GiB free at {probe} (need {min_gib:g})")


def shm_size(min_gib: float, path: Path = Path("/dev/shm")) -> Check:
    if not path.exists():
        return Check("shm", min_gib == 0, f"{path} does not exist")
    total = shutil.disk_usage(path).total / GIB
    return Check("shm", total >= min_gib, f"{path} is {total:.2f} GiB (need {min_gib:g})")


def cpus(expected: int | None) -> Check:
    """The CPUs this task may run on, against what the job asked Slurm for."""
    usable = len(os.sched_getaffinity(0))
    asked = os.environ.get("SLURM_CPUS_PER_TASK")
    detail = f"{usable} usable (SLURM_CPUS_PER_TASK={asked or 'unset'})"
    return Check("cpus", expected is None or usable >= expected, detail)


def gpus(expected: int) -> Check:
    smi = shutil.which("nvidia-smi")
    if expected == 0 and smi is None:
        return Check("gpus", True, "no GPUs expected, nvidia-smi absent")
    if smi is None:
        return Check("gpus", False, f"{expected} GPUs expected, nvidia-smi not found")
    query = "--query-gpu=index,name,ecc.errors.uncorrected.volatile.total"
    try:
        proc = subprocess.run(
            [smi, query, "--format=csv,noheader"], capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        return Check("gpus", False, "nvidia-smi did not answer in 60 s")
    if proc.returncode != 0:
        return Check("gpus", False, f"nvidia-smi exit {proc.returncode}: {proc.stderr.strip()}")
    rows = [r.split(", ") for r in proc.stdout.strip().splitlines() if r.strip()]
    bad_ecc = [r[0] for r in rows if len(r) > 2 and r[2].strip() not in ("0", "[N/A]", "N/A")]
    ok = len(rows) >= expected and not bad_ecc
    detail = f"{len(rows)} visible (need {expected})"
    return Check("gpus", ok, detail + (f"; uncorrected ECC errors on {bad_ecc}" if bad_ecc else ""))


def site_script(command: str, timeout_s: float, node: str) -> Check:
    env = {**os.environ, NODE_ENV: node}
    try:
        proc = subprocess.run(
            shlex.split(command), capture_output=True, text=True, timeout=timeout_s, env=env
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Check("script", False, f"{command!r}: {exc}")
    out = (proc.stdout.strip() + " " + proc.stderr.strip()).strip()[-300:]
    return Check("script", proc.returncode == 0, f"{command!r} exit {proc.returncode}: {out}")


def check_node(run: RunConfig, cpus_expected: int | None = None) -> NodeReport:
    cfg: HealthConfig = run.resiliency.health
    node = node_name()
    report = NodeReport(node, socket.gethostname(), time.time())
    report.checks.append(free_space("checkpoint_dir", Path(run.output_dir), cfg.min_free_gib))
    if run.checkpoint.local.dir:
        report.checks.append(
            free_space("local_tier_dir", Path(run.checkpoint.local.dir), cfg.min_free_gib)
        )
    report.checks.append(shm_size(cfg.min_shm_gib))
    report.checks.append(gpus(run.launch.gpus_per_node))
    report.checks.append(cpus(cpus_expected))
    if cfg.script:
        report.checks.append(site_script(cfg.script, cfg.script_timeout_s, node))
    return report


def read_reports(directory: Path) -> list[dict[str, Any]]:
    """The node reports of one attempt (empty when the launcher ran no check)."""
    if not directory.is_dir():
        return []
    reports = []
    for path in sorted(directory.glob("*.json")):
        try:
            reports.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            reports.append({"node": path.stem, "ok": False, "unreadable": str(exc)})
    return reports


def unhealthy_nodes(directory: Path) -> list[str]:
    return sorted(r["node"] for r in read_reports(directory) if not r.get("ok"))


def write_report(report: NodeReport, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{report.node}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report.to_dict(), indent=1))
    tmp.replace(path)
    return path


def describe(report: NodeReport) -> str:
    """One line: the verdict first, then what passed."""
    verdict = "healthy" if report.ok else "UNHEALTHY: " + "; ".join(report.failures())
    summary = ", ".join(f"{c.name} {c.detail}" for c in report.checks if c.ok)
    return f"node {report.node}: {verdict} ({summary})"


def preflight(run: RunConfig, directory: Path) -> NodeReport | None:
    """Check this node and publish the report where the trainer finds it (the environment
    its ranks inherit); None when disabled."""
    if not run.resiliency.health.enabled:
        return None
    report = check_node(run)
    try:
        write_report(report, directory)
    except OSError as exc:  # a full disk: the verdict stands, the ranks just cannot read it
        log.warning("health: report not written to %s: %s", directory, exc)
        return report
    os.environ[HEALTH_DIR_ENV] = str(directory)
    return report


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m resiliency.monitor.health", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--config", required=True, type=Path, help="the run's pinned config")
    parser.add_argument("--out", required=True, type=Path, help="dir for <node>.json")
    parser.add_argument("--cpus", type=int, default=None, help="CPUs the task should have")
    args = parser.parse_args(argv)
    run = load_config_file(args.config)
    report = check_node(run, args.cpus)
    try:
        write_report(report, args.out)
    except OSError as exc:  # a full disk: the verdict still goes out, on stdout and the exit
        print(f"health: report not written to {args.out}: {exc}", file=sys.stderr, flush=True)
    print(describe(report), flush=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
