"""A dry run writes nothing into an existing run dir, and a refused launch leaves it
byte-identical: the public commands as processes, on a run dir a real `launch local` made,
every entry of its output dir (names, modes, bytes) hashed before and after each.

Refusals are not attempts: `python -m resiliency ls` and `goodput` say the same after them.
"""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pretrain.context import exit_codes
from resiliency.storage.layout import RunLayout
from resiliency.storage.lease import RunLease
from tests.helpers import REPO

RUN_ID = "kept"
# A Kubernetes job of the same run: its image, claim and data on the claim.
K8S = [
    "launch.k8s.image=registry.example/mcore-recipes@sha256:0123456789abcdef",
    "launch.k8s.shared_pvc=ckpt",
    "data.paths=[/checkpoints/data/stdlib_text_document]",
]
# gpt_tiny measured at 100 s per step: two 10-step intervals and a start need 38 min.
SLOW_STEPS = "train.step_time_s=100"
Tree = dict[str, tuple[int, str]]


@pytest.fixture(scope="module")
def root(stdlib_corpus: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An output dir with one real run in it: 2 steps, a checkpoint, its attempt record."""
    out = tmp_path_factory.mktemp("runs")
    proc = launch("local", *run_args(out, stdlib_corpus), *OWN)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (out / RUN_ID / "steps").is_dir() and (out / RUN_ID / "launch-config.yaml").is_file()
    return out


def run_args(root: Path, corpus: str) -> list[str]:
    return ["recipe=gpt_tiny", f"data.paths=[{corpus}]", f"output_dir={root}", f"run_id={RUN_ID}"]


# The rest of the run's own config: with it, a relaunch would resume the run (and end at once).
OWN = ["train.train_steps=2", "checkpoint.save_interval=2"]


def launch(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "launch", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


def tree(root: Path) -> Tree:
    """Every entry under ``root``: its mode (type and permissions) and, for a file, the
    SHA-256 of its bytes (a link: its target)."""
    entries = {}
    for path in sorted(root.rglob("*")):
        mode = path.lstat().st_mode
        if stat.S_ISREG(mode):
            content = hashlib.sha256(path.read_bytes()).hexdigest()
        elif stat.S_ISLNK(mode):
            content = f"-> {os.readlink(path)}"
        else:
            content = ""
        entries[str(path.relative_to(root))] = (mode, content)
    return entries


def assert_refused(proc: subprocess.CompletedProcess[str], code: int, says: str) -> None:
    """The documented code, one ERROR line saying why, no traceback."""
    assert proc.returncode == code, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and says in errors[0], proc.stderr[-3000:]


def fake_sbatch(folder: Path) -> dict[str, str]:
    """A PATH whose sbatch refuses every job, as a cluster does for a wrong partition."""
    folder.mkdir()
    sbatch = folder / "sbatch"
    sbatch.write_text(
        "#!/bin/sh\necho 'sbatch: error: Batch job submission failed: Invalid partition name "
        "specified' >&2\nexit 1\n"
    )
    sbatch.chmod(0o755)
    return {"PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"}


CONFIG = exit_codes.CONFIG_ERROR  # 2: fix the command line
TOPOLOGY = exit_codes.TOPOLOGY_REFUSED  # 3: the checkpoint cannot be restored into it
# Refused by the resume rules on the newest step's manifest, before any rank starts.
RESUME_REFUSALS = {
    "local-shape-change": (["local", "model.hidden_size=128"], CONFIG,
                           "model.hidden_size: 64 -> 128"),
    "local-schedule-change": (["local", "optimizer.lr=1e-3"], CONFIG, "optimizer.lr"),
    "local-another-seed": (["local", "train.seed=7"], CONFIG, "train.seed:"),
    "local-topology": (["local", "model.padded_vocab_size=1024"], TOPOLOGY,
                       "cannot be restored into this layout"),
    "slurm-shape-change": (["slurm", "model.hidden_size=128"], CONFIG,
                           "model.hidden_size: 64 -> 128"),
    # the run's volume mounted on the submitting host too
    "k8s-shape-change": (["k8s", *K8S, "model.hidden_size=128"], CONFIG,
                         "model.hidden_size: 64 -> 128"),
}  # fmt: skip
# (argv after the run's own overrides, the exit code, what its one line says)
REFUSALS = {
    "local-config-error": (["local", "train.no_such_key=1"], CONFIG, "no_such_key"),
    "local-comma": (["local", "optimizer.lr=1e-3,3e-3"], CONFIG, "-m"),
    "slurm-progress": (
        ["slurm", SLOW_STEPS, "launch.slurm.time_limit=00:30:00"],
        CONFIG,
        "would not make progress",
    ),
    "slurm-dry-run-progress": (
        ["slurm", "--dry-run", SLOW_STEPS, "launch.slurm.time_limit=00:30:00"],
        CONFIG,
        "would not make progress",
    ),
    # --out DIR renders into DIR/<run_id>: the output dir itself would be the run dir
    "slurm-dry-run-out-in-the-run-dir": (
        ["slurm", "--dry-run", "--out", "{root}"],
        CONFIG,
        "a dry run never writes into the run dir",
    ),
    "slurm-without-sbatch": (["slurm", *OWN], CONFIG, "sbatch not found on PATH"),
    # written, then undone: the pinned config, ft_launcher's config, the script and its folder
    "slurm-refused-by-sbatch": (
        ["slurm", *OWN, "launch.backend=ft_launcher", "logging.log_interval=5"],
        CONFIG,
        "sbatch refused",
    ),
    "k8s-dry-run-progress": (
        # a grace that covers an emergency save's timeout, not a 200 s step in flight
        ["k8s", "--dry-run", *K8S, "train.step_time_s=200", "launch.k8s.termination_grace_s=140"],
        CONFIG,
        "would not make progress",
    ),
}


@pytest.mark.parametrize("case", sorted(RESUME_REFUSALS))
def test_a_resume_the_ranks_would_refuse_is_refused_before_any_rank_starts(
    case: str, root: Path, stdlib_corpus: str, tmp_path: Path
) -> None:
    """One line with the trainer's own code, in seconds; the rest in a file it names, outside
    the run dir."""
    backend, *rest = RESUME_REFUSALS[case][0]
    code, says = RESUME_REFUSALS[case][1:]
    before = tree(root)
    started = time.monotonic()
    env = {"TMPDIR": str(tmp_path)}
    proc = launch(backend, *run_args(root, stdlib_corpus), *OWN, *rest, env=env)
    took = time.monotonic() - started
    assert_refused(proc, code, says)
    assert tree(root) == before
    assert took < 6, f"{took:.1f} s: a rank was started?"  # ~1 s here; CI runs tests 2 at a time
    full = next(tmp_path.glob(f"mcore-recipes-refused-{RUN_ID}-*.txt"))
    verdict = full.read_text()  # the whole verdict (every key, the table) behind the line
    assert str(full) in proc.stderr and verdict.splitlines()[0].rstrip(":") in proc.stderr
    assert len(verdict.splitlines()) > 1


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_refused_launch_leaves_the_run_dir_byte_identical(
    case: str, root: Path, stdlib_corpus: str, tmp_path: Path
) -> None:
    args, code, says = REFUSALS[case]
    backend, *rest = (a.format(root=root) for a in args)
    env = {"TMPDIR": str(tmp_path)}  # a dry run's default folder
    if case == "slurm-refused-by-sbatch":
        env.update(fake_sbatch(tmp_path / "bin"))
    elif case == "slurm-without-sbatch":
        env["PATH"] = str(tmp_path / "no-bin")
    before = tree(root)
    proc = launch(backend, *rest, *run_args(root, stdlib_corpus), env=env)
    assert_refused(proc, code, says)
    assert tree(root) == before
    assert not any(tmp_path.glob("mcore-recipes-dry-run-*"))  # a refused dry run rendered nothing


def test_a_held_lease_refuses_with_its_code_and_changes_nothing(
    root: Path, stdlib_corpus: str
) -> None:
    """A live job holds the run (this process, on this host): exit 6 (LEASE_HELD)."""
    with RunLease(RunLayout(root, RUN_ID), attempt=99, timeout_s=60):
        before = tree(root)
        for backend in ("local", "slurm"):
            proc = launch(backend, *run_args(root, stdlib_corpus))
            assert_refused(proc, exit_codes.LEASE_HELD, "is owned by a live job")
            assert tree(root) == before, backend


@pytest.mark.parametrize("backend", ["slurm", "k8s"])
def test_a_dry_run_renders_the_change_elsewhere(
    backend: str, root: Path, stdlib_corpus: str, tmp_path: Path
) -> None:
    """The run's pinned config (lr 3e-3), which every requeue of its job trains from, stays;
    the dry run renders the changed one where it says (slurm: a new temporary folder, k8s:
    standard output)."""
    before = tree(root)
    extra = K8S if backend == "k8s" else []
    # the new lr applies on resume (the ranks would refuse an unasked schedule change)
    proc = launch(backend, "--dry-run", *run_args(root, stdlib_corpus), *OWN, *extra,
                  "optimizer.lr=1e-3", "checkpoint.schedule_on_resume=config",
                  env={"TMPDIR": str(tmp_path)})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert tree(root) == before
    if backend == "slurm":
        script = Path(proc.stdout.strip())
        assert script.is_relative_to(tmp_path) and script.name == f"{RUN_ID}.sbatch"
        rendered = yaml.safe_load((script.parent.parent / "launch-config.yaml").read_text())
    else:
        config_map = next(yaml.safe_load_all(proc.stdout))
        rendered = yaml.safe_load(config_map["data"]["launch-config.yaml"])
    pinned = yaml.safe_load((root / RUN_ID / "launch-config.yaml").read_text())
    assert (pinned["optimizer"]["lr"], rendered["optimizer"]["lr"]) == (3e-3, 1e-3)


def test_refusals_are_not_attempts(root: Path, stdlib_corpus: str, tmp_path: Path) -> None:
    """Neither `resiliency ls` (status, attempts) nor `goodput` changes after refusals."""

    def record() -> tuple[list[str], str]:
        ls = subprocess.run([sys.executable, "-m", "resiliency", "ls", str(root)], cwd=REPO,
                            capture_output=True, text=True, timeout=60)  # fmt: skip
        goodput = subprocess.run(
            [sys.executable, "-m", "resiliency", "goodput", str(root / RUN_ID)],
            cwd=REPO, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert ls.returncode == 0 and goodput.returncode == 0, ls.stderr + goodput.stderr
        rows = [line.rsplit(None, 1)[0] for line in ls.stdout.splitlines()[1:]]  # not AGE
        return rows, goodput.stdout

    before = record()
    assert any(f"{RUN_ID} " in row and "finished" in row for row in before[0]), before[0]
    for args, code, says in (REFUSALS["local-config-error"], REFUSALS["slurm-refused-by-sbatch"]):
        env = fake_sbatch(tmp_path / "bin") if args[0] == "slurm" else None
        assert_refused(launch(*args, *run_args(root, stdlib_corpus), env=env), code, says)
    assert record() == before
