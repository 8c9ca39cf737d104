"""Slurm adapter: retry policy, batch-script rendering, refusals, and real jobs on a local cluster.

The cluster tests start a 3-node Slurm cluster on this machine (tests/slurm/cluster_up.sh: needs
root and apt-get; node1-2 form the default partition, "all" adds node3) and submit through
``python -m launch slurm`` exactly as a user would.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from bench.s3_server import S3Server
from drill.jobs import SLURM_TERMINAL as TERMINAL  # states after which a job never runs again
from launch.__main__ import main as launch_main
from launch.retry_policy import REQUEUE, STOP, decide, newest_attempt_exits
from pretrain.context import exit_codes
from pretrain.context.run_dir import RunDir, read_jsonl
from resiliency.monitor.postmortem import LauncherEvents
from resiliency.storage.layout import RunLayout, atomic_write_json
from resiliency.storage.lease import RunLease
from resiliency.storage.synthetic import write_synthetic_step
from tests.ft_helpers import assert_elastic_losses_within_bound, kill_node
from tests.helpers import REPO, follow_uploaders, read_steps, run_pretrain

SLURM_DIR = REPO / "tests" / "slurm"
BIN = Path(sys.executable).parent
LAYOUT_2x1 = ["launch.nodes=2", "launch.nproc_per_node=1"]


# ------------------------------------------------------------------ retry policy


def _record(
    run_dir: Path, attempt: int, status: str, exit_code: int | None = None, **extra: object
) -> None:
    body: dict[str, object] = {"attempt": attempt, "status": status, **extra}
    if exit_code is not None:
        body["exit_code"] = exit_code
    (run_dir / "attempts").mkdir(parents=True, exist_ok=True)
    atomic_write_json(run_dir / "attempts" / f"attempt-{attempt:02d}.json", body)


@pytest.mark.parametrize(
    "status, code, restarts, action, exit_code",
    [
        ("finished", 0, 0, STOP, 0),
        ("finished", 0, 3, STOP, 0),
        ("preempted", 75, 0, REQUEUE, 0),
        ("preempted", 75, 2, REQUEUE, 0),
        ("preempted", 75, 3, REQUEUE, 0),  # planned (time limit, preemption): not budgeted
        ("failed", exit_codes.INFRASTRUCTURE, 0, REQUEUE, 0),
        ("failed", exit_codes.INFRASTRUCTURE, 3, STOP, exit_codes.RETRY_BUDGET_EXHAUSTED),
        ("running", None, 0, REQUEUE, 0),  # killed mid-run (node loss, OOM killer, time limit)
        ("starting", None, 1, REQUEUE, 0),
        ("running", None, 3, STOP, exit_codes.RETRY_BUDGET_EXHAUSTED),
        ("failed", 42, 0, STOP, 42),  # unknown code: never retried blindly
        ("interrupted", 130, 0, STOP, 130),  # the user's Ctrl-C: stopped, never requeued
        ("interrupted", 130, 3, STOP, 130),  # ... whatever the budget says
    ],
)
def test_decision_table(
    tmp_path: Path, status: str, code: int | None, restarts: int, action: str, exit_code: int
) -> None:
    _record(tmp_path, 1, status, code)
    decision = decide(tmp_path, failures_used=restarts, max_requeues=3)
    assert (decision.action, decision.exit_code) == (action, exit_code), decision


@pytest.mark.parametrize("code", sorted(exit_codes.DO_NOT_RETRY))
def test_do_not_retry_codes_always_stop(tmp_path: Path, code: int) -> None:
    _record(tmp_path, 1, "failed", code, failure_class="whatever")
    decision = decide(tmp_path, failures_used=0, max_requeues=10)
    assert (decision.action, decision.exit_code) == (STOP, code), decision
    assert "failure_class=whatever" in decision.reason


def test_no_record_is_infrastructure(tmp_path: Path) -> None:
    decision = decide(tmp_path / "never-started", failures_used=0, max_requeues=1)
    assert decision.action == REQUEUE and "no attempt record" in decision.reason
    exhausted = decide(tmp_path / "never-started", failures_used=1, max_requeues=1)
    assert (exhausted.action, exhausted.exit_code) == (STOP, exit_codes.RETRY_BUDGET_EXHAUSTED)


@pytest.mark.parametrize(
    "status, seen, action, exit_code",
    [
        # The ranks exited 10 on a full disk that also kept them from finishing their record.
        ("running", (exit_codes.CHECKPOINT_IO, -15), STOP, exit_codes.CHECKPOINT_IO),
        (None, (exit_codes.CHECKPOINT_IO,), STOP, exit_codes.CHECKPOINT_IO),
        ("running", (-9, exit_codes.INFRASTRUCTURE), REQUEUE, 0),  # killed: retried
        ("running", (-9, exit_codes.DATA), REQUEUE, 0),  # a peer's follow-on exit decides nothing
        ("running", (42,), REQUEUE, 0),  # a code nobody documented decides nothing here
    ],
)
def test_an_unfinished_record_yields_to_the_exits_the_launcher_saw(
    tmp_path: Path, status: str | None, seen: tuple[int, ...], action: str, exit_code: int
) -> None:
    if status is not None:
        _record(tmp_path, 1, status)
    decision = decide(tmp_path, 0, 3, seen_exits=seen)
    assert (decision.action, decision.exit_code) == (action, exit_code), decision


def test_only_the_newest_attempts_exits_decide_an_unfinished_record(tmp_path: Path) -> None:
    """ft_launcher restarts its workers within one launch: attempt 1 lost a rank to SIGKILL,
    attempt 2 then stopped on a full disk (exit 10) before rank 0 could finish its record. The
    launcher's log holds both; only attempt 2's exits may decide, and they say stop with 10."""
    start = time.time() - 100
    _record(tmp_path, 1, "failed", exit_codes.INFRASTRUCTURE, start_time=start)
    _record(tmp_path, 2, "running", start_time=start + 50)
    events = LauncherEvents()
    events.launches.append([start - 1, start + 90])
    for at, code in ((start + 20, -9), (start + 21, 1), (start + 80, 10), (start + 81, -15)):
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))
        events.feed(f"[{stamp},000] [ERROR] failed (exitcode: {code}) local_rank: 0 (pid: 7)", at)
    layout = RunLayout.from_run_dir(tmp_path)
    seen = newest_attempt_exits(layout, [1, 2], events)
    assert seen == (10, -15)
    decision = decide(tmp_path, 0, 3, seen_exits=seen)
    assert (decision.action, decision.exit_code) == (STOP, exit_codes.CHECKPOINT_IO), decision
    every = decide(tmp_path, 0, 3, seen_exits=tuple(e["exit_code"] for e in events.exits))
    assert every.action == REQUEUE  # what the whole launch's exits said: the bug this guards


def test_the_policy_reads_the_node_local_log_a_full_run_disk_cut_short(tmp_path: Path) -> None:
    """The batch script passes the node-local copy of its log first, then the run dir's. The
    run dir's copy stopped at attempt 1's SIGKILL when the disk filled; the local one also
    holds attempt 2's exit 10 (and the SIGTERM after it). Only attempt 2's exits decide."""
    start = time.time() - 100
    lines = []
    for at, code in ((start + 20, -9), (start + 21, 1), (start + 80, 10), (start + 81, -15)):
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))
        lines.append(f"0: [{stamp},000] [ERROR] failed (exitcode: {code}) local_rank: 0 (pid: 7)")
    local, cut = tmp_path / "local.log", tmp_path / "run-dir.log"
    local.write_text("\n".join(lines) + "\n")
    cut.write_text("\n".join(lines[:2]) + "\n")

    def policy(run_dir: Path, *logs: Path) -> subprocess.CompletedProcess[str]:
        _record(run_dir, 1, "failed", exit_codes.INFRASTRUCTURE, start_time=start)
        _record(run_dir, 2, "running", start_time=start + 50)
        job_logs = [arg for log in logs for arg in ("--job-log", log)]
        return _policy_cli(run_dir, "--restart-count", "0", "--max-requeues", "3", *job_logs)

    proc = policy(tmp_path / "a", local, cut)
    assert proc.returncode == exit_codes.CHECKPOINT_IO, proc
    assert proc.stdout.startswith(f"stop {exit_codes.CHECKPOINT_IO} "), proc
    gone = policy(tmp_path / "b", tmp_path / "gone.log", cut)
    assert gone.returncode == 0 and gone.stdout.startswith("requeue "), gone  # all it could see


def test_newest_record_decides(tmp_path: Path) -> None:
    _record(tmp_path, 1, "preempted", 75)
    _record(tmp_path, 2, "failed", exit_codes.NUMERIC)
    assert decide(tmp_path, 1, 3).exit_code == exit_codes.NUMERIC
    _record(tmp_path, 10, "preempted", 75)  # numeric order, not lexical
    assert decide(tmp_path, 1, 3).action == REQUEUE


def test_records_of_earlier_runs_are_ignored(tmp_path: Path) -> None:
    _record(tmp_path, 1, "finished", 0)
    decision = decide(tmp_path, failures_used=1, max_requeues=3, after_attempt=1)
    assert decision.action == REQUEUE and "no attempt record" in decision.reason


def test_unreadable_record_is_infrastructure(tmp_path: Path) -> None:
    (tmp_path / "attempts").mkdir()
    (tmp_path / "attempts" / "attempt-01.json").write_text("{not json")
    decision = decide(tmp_path, 0, 3)
    assert decision.action == REQUEUE and "unreadable" in decision.reason


def _policy_cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "launch.retry_policy", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_prints_action_and_exits_with_the_code(tmp_path: Path) -> None:
    _record(tmp_path, 1, "preempted", 75)
    proc = _policy_cli(tmp_path, "--restart-count", "0", "--max-requeues", "2")
    assert proc.returncode == 0 and proc.stdout.startswith("requeue 0 "), proc
    proc = _policy_cli(tmp_path, "--restart-count", "2", "--max-requeues", "2")
    assert proc.returncode == 0 and "planned requeue" in proc.stdout, proc
    _record(tmp_path, 2, "failed", exit_codes.INFRASTRUCTURE)
    proc = _policy_cli(tmp_path, "--restart-count", "2", "--max-requeues", "2")
    assert proc.returncode == exit_codes.RETRY_BUDGET_EXHAUSTED, proc
    assert proc.stdout.startswith(f"stop {exit_codes.RETRY_BUDGET_EXHAUSTED} "), proc
    _record(tmp_path, 3, "failed", exit_codes.USER_CODE)
    proc = _policy_cli(tmp_path, "--restart-count", "0", "--max-requeues", "2")
    assert proc.returncode == exit_codes.USER_CODE and proc.stdout.startswith("stop 4 "), proc
    proc = _policy_cli(tmp_path, "--newest-attempt")
    assert (proc.returncode, proc.stdout.strip()) == (0, "3"), proc


# ------------------------------------------------------------------ rendering and refusals


def _base(corpus: str, root: Path, run_id: str) -> list[str]:
    return ["recipe=gpt_tiny", f"data.paths=[{corpus}]", f"output_dir={root}", f"run_id={run_id}"]


# Where these dry runs render (--out): beside the run dirs, never in one.
DRY = "dry-run"


def _dry_run(overrides: list[str], *flags: str) -> int:
    """Rendered into <output_dir>/dry-run/<run_id>/ (the last output_dir= wins)."""
    root = [o.split("=", 1)[1] for o in overrides if o.startswith("output_dir=")][-1]
    out = Path(root) / DRY
    return launch_main(["slurm", "--dry-run", "--out", str(out), *flags, *overrides])


def _script(root: Path, run_id: str) -> str:
    return (root / DRY / run_id / "slurm" / f"{run_id}.sbatch").read_text()


def _sbatch_directives(script: str) -> list[str]:
    return [line.split(None, 1)[1] for line in script.splitlines() if line.startswith("#SBATCH")]


def test_dry_run_renders_a_valid_script(stdlib_corpus: str, tmp_path: Path) -> None:
    overrides = [
        *_base(stdlib_corpus, tmp_path, "render"),
        *LAYOUT_2x1,
        "launch.slurm.partition=batch",
        "launch.slurm.account=proj",
        "launch.slurm.signal_grace_s=90",
        "launch.slurm.time_limit=02:00:00",
        "launch.slurm.max_requeues=5",
        "launch.slurm.extra_sbatch=['--exclusive','--qos=high']",
        "launch.slurm.env_passthrough=[HF_TOKEN,WANDB_API_KEY]",
    ]
    assert _dry_run(overrides) == 0
    run_dir = tmp_path / "render"
    assert not run_dir.exists()  # a dry run writes nothing into the run dir
    assert (tmp_path / DRY / "render" / "launch-config.yaml").is_file()
    script = _script(tmp_path, "render")
    assert _sbatch_directives(script) == [
        "--job-name=render",
        "--nodes=2",
        "--ntasks-per-node=1",
        "--cpus-per-task=1",  # CPU nodes: one per rank unless launch.slurm.cpus_per_task
        "--time=02:00:00",
        "--partition=batch",
        "--account=proj",
        "--signal=B:USR1@90",
        "--requeue",
        "--open-mode=append",
        f"--output={run_dir}/slurm/%x-%j.out",
        f"--chdir={os.getcwd()}",
        "--export=ALL",
        "--exclusive",
        "--qos=high",
    ]
    launcher = (
        f'{BIN}/python -m launch.torchrun --nnodes="$SLURM_NNODES" --nproc-per-node=1 '
        '--rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" '
        '--rdzv-id="$SLURM_JOB_ID" -m pretrain --config "$CONFIG"'
    )
    assert launcher in " ".join(script.replace("\\\n", " ").split())
    for needle in (
        f"CONFIG={run_dir}/launch-config.yaml",
        f"{BIN}/python -m launch.retry_policy",
        "--cpus-per-task=1 --kill-on-bad-exit=1 --wait=60",
        "-m resiliency.monitor.health --config",
        "MAX_REQUEUES=5",
        "scontrol show hostnames",
        "NodeAddr=",
        'scancel --signal=TERM "$SLURM_JOB_ID"',
        "trap 'on_signal USR1' USR1",
        'scontrol requeue "$1"',  # then `scontrol update` with the nodes left out, if any
        '--job-id "$SLURM_JOB_ID"',
        "-m launch.retry_policy",
        "export MCORE_RECIPES_CODE_COMMIT=",
        "export MCORE_RECIPES_IMAGE_DIGEST=",
        "export OMP_NUM_THREADS=1",
        "export PYTHONUNBUFFERED=1",
        "export HF_TOKEN;",
        "export WANDB_API_KEY;",
        "restart-${RESTART}.log",
    ):
        assert needle in script, needle
    assert "--gpus-per-node" not in script and "--container-image" not in script
    syntax = subprocess.run(
        ["bash", "-n", str(tmp_path / DRY / "render" / "slurm" / "render.sbatch")],
        capture_output=True,
        text=True,
    )
    assert syntax.returncode == 0, syntax.stderr


def test_render_spare_nodes(stdlib_corpus: str, tmp_path: Path) -> None:
    """launch.slurm.spare_nodes=1: three nodes held, ft_launcher trains exactly two (the third
    waits as a spare), the ranks start through the worker entrypoint that reports how they
    ended, a leaving or killed launcher does not end the step nor a failed node the job, and a
    planned stop is marked."""
    overrides = [
        *_base(stdlib_corpus, tmp_path, "spares"),
        *LAYOUT_2x1,
        "launch.backend=ft_launcher",
        "launch.slurm.spare_nodes=1",
        "resiliency.max_restarts=3",
    ]
    assert _dry_run(overrides) == 0
    script = _script(tmp_path, "spares")
    assert "--nodes=3" in _sbatch_directives(script) and "--no-kill" in _sbatch_directives(script)
    flat = " ".join(script.replace("\\\n", " ").split())
    assert "--max-restarts=3 --nnodes=2:2 --nproc-per-node=1" in flat, flat
    assert "-m launch.standby.worker --config" in flat
    # a node lost whole (its launcher killed) leaves the step to the others
    assert "--kill-on-bad-exit=0 --wait=0" in flat and "--wait=60" not in flat
    assert 'export MCORE_RECIPES_SPARE_NODES=1 MCORE_RECIPES_RUN_DIR="$RUN_DIR"' in script
    assert 'touch "$RUN_DIR/attempts/spares/${SLURM_JOB_ID}-${RESTART}-stopping"; }' in script
    assert 'export MCORE_RECIPES_STORE_NODE="$MASTER_NODE"' in script
    assert "--launch-nodes 3 " in script  # a requeue keeps the spares
    syntax = subprocess.run(
        ["bash", "-n", str(tmp_path / DRY / "spares" / "slurm" / "spares.sbatch")],
        capture_output=True,
        text=True,
    )
    assert syntax.returncode == 0, syntax.stderr


@pytest.mark.parametrize("container", [False, True], ids=["host", "container"])
def test_remote_tier_runs_an_uploader_beside_the_job(
    container: bool, stdlib_corpus: str, tmp_path: Path
) -> None:
    image = ["launch.slurm.container_image=nvcr.io/nvidia/pytorch:25.01-py3"] if container else []
    overrides = [
        *_base(stdlib_corpus, tmp_path, "up"),
        *LAYOUT_2x1,
        *image,
        "checkpoint.remote.url=s3://bucket/runs",
        "checkpoint.remote.follow_interval_s=30",
    ]
    assert _dry_run(overrides) == 0
    script = _script(tmp_path, "up")
    runner = "srun --overlap --nodes=1 --ntasks=1 --cpus-per-task=1" if container else BIN
    start = script.index("UPLOAD=(")
    assert script[start:].startswith(f"UPLOAD=({runner}")
    assert '-m resiliency upload "$RUN_DIR" --to s3://bucket/runs' in script
    assert "FOLLOW_INTERVAL=30\nfollow_uploads &\nUPLOADER_PID=$!" in script
    # after srun: stopped, then one last pass for the steps it missed
    stop = script.index('kill -TERM "$UPLOADER_PID"')
    assert script.index("srun ended with") < stop < script.index('    if ! "${UPLOAD[@]}"; then')
    syntax = subprocess.run(["bash", "-n", str(tmp_path / DRY / "up" / "slurm" / "up.sbatch")],
                            capture_output=True, text=True)  # fmt: skip
    assert syntax.returncode == 0, syntax.stderr


def _follow_uploads(script: str) -> str:
    start = script.index("follow_uploads() {")
    return script[start : script.index("\n}\n", start) + 3]


def _wait_uploader(run_dir: Path, other_than: int | None = None) -> psutil.Process:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        live = [p for p in follow_uploaders(run_dir) if p.pid != other_than]
        if live:
            return live[0]
        time.sleep(0.05)
    raise AssertionError(f"no uploader for {run_dir}")


def test_the_batch_script_restarts_a_dead_uploader(
    stdlib_corpus: str, tmp_path: Path, s3: S3Server
) -> None:
    """The script's own loop, run by bash around the real uploader (`python -m resiliency
    upload --follow` against the real S3 server): SIGKILLed from outside, restarted after a
    backoff; TERM stops loop and uploader; when another job takes the run's lease, the
    uploader exits 6 and the loop does not restart it."""
    overrides = [*_base(stdlib_corpus, tmp_path, "sup"), *LAYOUT_2x1,
                 "checkpoint.remote.url=s3://bucket/runs"]  # fmt: skip
    assert _dry_run(overrides) == 0
    loop = _follow_uploads(_script(tmp_path, "sup"))
    layout = RunLayout(tmp_path / "served", "run")
    for step in (2, 4):
        write_synthetic_step(layout, step)
    job = (  # a job that held the lease (generation 1) and died
        "from resiliency.storage.layout import RunLayout\n"
        "from resiliency.storage.lease import RunLease\n"
        f"RunLease(RunLayout({str(layout.root)!r}, 'run'), 1, 60.0).acquire()\n"
    )
    subprocess.run([sys.executable, "-c", job], cwd=REPO, check=True, timeout=60)
    upload = [sys.executable, "-m", "resiliency", "upload", str(layout.run_dir), "--to",
              s3.url(f"sup-{os.getpid()}"), "--follow", "--interval", "0.5"]  # fmt: skip
    driver = f"{loop}\nUPLOAD=({' '.join(upload)})\nFOLLOW_INTERVAL=1\nfollow_uploads\n"
    env = {**os.environ, **s3.env, "AWS_ENDPOINT_URL": s3.endpoint_url}
    proc = subprocess.Popen(["bash", "-c", driver], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    first = _wait_uploader(layout.run_dir)
    first.kill()  # the uploader dies from outside
    second = _wait_uploader(layout.run_dir, other_than=first.pid)
    proc.send_signal(signal.SIGTERM)  # the script stops it after srun
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "uploader exited 137; restarting it in 1 s" in output, output
    second.wait(timeout=30)  # TERM reached it
    assert not follow_uploaders(layout.run_dir)

    again = subprocess.Popen(["bash", "-c", driver], cwd=REPO, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    _wait_uploader(layout.run_dir)
    time.sleep(2)  # a pass or more: the uploader has seen generation 1
    RunLease(layout, 2, 60.0).acquire()  # another job takes the run over
    output, _ = again.communicate(timeout=60)
    assert again.returncode == 0, output
    assert "uploader exited 6 (the run's lease moved): not restarted" in output, output
    assert not follow_uploaders(layout.run_dir)


def test_render_gpus_container_and_ft_launcher(stdlib_corpus: str, tmp_path: Path) -> None:
    overrides = [
        *_base(stdlib_corpus, tmp_path, "gpu"),
        "launch.nodes=1",
        "launch.nproc_per_node=2",
        "launch.gpus_per_node=2",
        "launch.backend=ft_launcher",
        "launch.slurm.container_image=nvcr.io/nvidia/pytorch:25.01-py3",
        "launch.slurm.container_mounts=[/data:/data,/ckpt:/ckpt]",
    ]
    assert _dry_run(overrides, "--skip-fit-check") == 0  # rendering, not memory, under test
    script = _script(tmp_path, "gpu")
    directives = _sbatch_directives(script)
    # GPU nodes are taken whole (all CPUs and memory), and srun passes the CPUs on
    assert {"--gpus-per-node=2", "--exclusive", "--mem=0"} <= set(directives), directives
    assert not any(d.startswith("--cpus-per-task") for d in directives), directives
    assert '--cpus-per-task="$SLURM_CPUS_ON_NODE" --kill-on-bad-exit=1' in script
    data_dir = Path(stdlib_corpus).parent
    data_mount = [f"{data_dir}:{data_dir}"] if not data_dir.is_relative_to(tmp_path) else []
    # The image's installed code runs, from the run dir: the checkout is neither mounted nor
    # the working directory (where it would shadow the package), and its commit is not claimed.
    mounts = ",".join(["/data:/data", "/ckpt:/ckpt", f"{tmp_path}:{tmp_path}", *data_mount])
    assert (
        # pyxis syntax: without "#" enroot would look nvcr.io/... up on Docker Hub
        "--container-image='nvcr.io#nvidia/pytorch:25.01-py3' --container-name=mcore-recipes-gpu "
        f"--container-mounts={mounts} --container-workdir={tmp_path / 'gpu'} "
        "--no-container-mount-home"
    ) in script, script
    assert "\nunset MCORE_RECIPES_CODE_COMMIT" in script
    # mount_code=true: the checkout is mounted and runs (development on a cluster).
    dev_overrides = [o for o in overrides if not o.startswith("run_id=")]
    dev_overrides += ["run_id=dev", "launch.slurm.mount_code=true"]
    assert _dry_run(dev_overrides, "--skip-fit-check") == 0
    dev = _script(tmp_path, "dev")
    cwd = os.getcwd()
    dev_mounts = ",".join(["/data:/data", "/ckpt:/ckpt", f"{tmp_path}:{tmp_path}",
                           f"{cwd}:{cwd}", *data_mount])  # fmt: skip
    assert f"--container-mounts={dev_mounts} --container-workdir={cwd} " in dev, dev
    assert "\nexport MCORE_RECIPES_CODE_COMMIT=" in dev
    # every step runs in the container: health check, training, and the retry policy
    assert "--no-container-mount-home python -m launch.retry_policy" in script
    assert "--no-container-mount-home python -m resiliency.monitor.health" in " ".join(
        script.replace("\\\n", " ").split()
    )
    assert "export MCORE_RECIPES_IMAGE_DIGEST=nvcr.io/nvidia/pytorch:25.01-py3" in script
    # inside the container the image's launcher runs, not the submitting venv's
    assert re.search(
        r"^\s+python -m launch.torchrun --ft-launcher --ft-cfg-path=\S+/ft_launcher.yaml "
        r"--workers-stop-timeout=10 "
        r"--nnodes=\"\$SLURM_NNODES\" --nproc-per-node=2 "
        r"\\\n\s+--rdzv-backend=c10d --rdzv-endpoint=",
        script,
        re.M,
    ), script
    assert (tmp_path / DRY / "gpu" / "ft_launcher.yaml").is_file(), "the launcher config"
    assert "torchrun --nnodes" not in script
    # gpt_tiny is TP=2: megatron-core wants one hardware queue per GPU for its TP overlap
    assert "\nexport CUDA_DEVICE_MAX_CONNECTIONS=1\n" in script
    assert _dry_run([*_base(stdlib_corpus, tmp_path, "tp1"), "parallel.tp=1"]) == 0
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in _script(tmp_path, "tp1")
    # launch.standby: each node's launcher task starts its standby server, the ranks are its
    # standby workers, and both find it by the name the script exports.
    assert "launch.standby.server" not in script and "-m pretrain --config" in script
    assert _dry_run([*_base(stdlib_corpus, tmp_path, "sb"), "launch.standby=true"]) == 0
    standby = _script(tmp_path, "sb")
    assert '"$MCORE_RECIPES_STANDBY_PYTHON" -m launch.standby.server "$RUN_DIR" & exec' in standby
    assert '-m launch.standby.worker --config "$CONFIG"' in standby
    assert "\nexport MCORE_RECIPES_STANDBY=@mcore-recipes-standby-" in standby


def test_render_pins_an_absolute_output_dir(
    stdlib_corpus: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert _dry_run([*_base(stdlib_corpus, Path("rel"), "abs"), *LAYOUT_2x1]) == 0
    pinned = (tmp_path / "rel" / DRY / "abs" / "launch-config.yaml").read_text()
    assert f"output_dir: {tmp_path}/rel" in pinned


@pytest.mark.parametrize(
    "bad, message",
    [
        (["train.no_such_key=1"], "no_such_key"),
        (["launch.nodes=3", "launch.nproc_per_node=1"], "launch.nodes=3"),  # 3 ranks, tp=2
        (["launch.slurm.env_passthrough=[NOT-A-NAME]"], "NOT-A-NAME"),
        (["output_dir='/tmp/with space'"], "contains whitespace"),
        (["launch.slurm.spare_nodes=1"], "needs launch.backend=ft_launcher"),
        (
            [
                "launch.backend=ft_launcher",
                "launch.slurm.spare_nodes=1",
                "launch.slurm.min_nodes=1",
            ],
            "exclude each other",
        ),
        (["launch.slurm.spare_nodes=-1"], "spare_nodes must be >= 0"),
    ],
)
def test_bad_input_is_refused(
    stdlib_corpus: str,
    tmp_path: Path,
    bad: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = launch_main(["slurm", *_base(stdlib_corpus, tmp_path, "bad"), *bad])
    assert code == exit_codes.CONFIG_ERROR
    assert message in capsys.readouterr().err
    assert not (tmp_path / "bad" / "slurm").exists()


def test_run_owned_by_a_live_job_is_refused(
    stdlib_corpus: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with RunLease(RunLayout(tmp_path, "owned"), attempt=1, timeout_s=60):
        code = launch_main(
            ["slurm", "--dry-run", *_base(stdlib_corpus, tmp_path, "owned"), *LAYOUT_2x1]
        )
    assert code == exit_codes.LEASE_HELD  # as the trainer's own acquire says it
    assert "owned by a live job" in capsys.readouterr().err
    assert not (tmp_path / "owned" / "launch-config.yaml").exists()


def test_missing_sbatch_is_a_clear_error(
    stdlib_corpus: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    code = launch_main(["slurm", *_base(stdlib_corpus, tmp_path, "nosbatch"), *LAYOUT_2x1])
    assert code == exit_codes.CONFIG_ERROR
    err = capsys.readouterr().err
    assert "sbatch not found on PATH" in err and "--dry-run" in err
    assert not (tmp_path / "nosbatch").exists()


# ------------------------------------------------------------------ the real cluster


@pytest.fixture(scope="session")
def slurm_env() -> Iterator[dict[str, str]]:
    """Start the local test cluster (or reuse a healthy one); stop it if this session started it."""
    if os.geteuid() != 0 or (shutil.which("sbatch") is None and shutil.which("apt-get") is None):
        pytest.skip(
            "!!! SLURM CLUSTER TESTS SKIPPED: tests/slurm/cluster_up.sh needs root and "
            "apt-get (Debian 12) to install and start a local Slurm cluster; these tests "
            "must run in CI !!!"
        )
    up = subprocess.run(
        ["bash", str(SLURM_DIR / "cluster_up.sh")], capture_output=True, text=True, timeout=900
    )
    if up.returncode != 0:
        pytest.fail(f"cluster_up.sh failed ({up.returncode}):\n{up.stdout}\n{up.stderr}")
    started = "already up" not in up.stdout
    root = os.environ.get("MCORE_RECIPES_SLURM_ROOT", "/tmp/mcore-recipes-slurm")
    yield {**os.environ, "SLURM_CONF": f"{root}/etc/slurm.conf"}
    if started:
        subprocess.run(
            ["bash", str(SLURM_DIR / "cluster_down.sh")], capture_output=True, timeout=120
        )


def _submit(overrides: list[str], env: dict[str, str]) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "launch", "slurm", *overrides],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"submit failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    job_id = proc.stdout.strip().splitlines()[-1]
    assert job_id.isdigit(), proc.stdout
    return job_id


def _job(job_id: str, env: dict[str, str]) -> dict[str, str]:
    out = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def _log_tail(run_dir: Path, lines: int = 60) -> str:
    noise = re.compile(r"frame #|pynvml|^\d: \s|Exception raised from|omitting python frames")
    text = []
    for path in sorted((run_dir / "slurm").glob("*.out")):
        kept = [ln for ln in path.read_text(errors="replace").splitlines() if not noise.search(ln)]
        text.append(
            f"--- {path.name} (last {lines} lines, noise filtered)\n" + "\n".join(kept[-lines:])
        )
    return "\n".join(text) or f"(no job output in {run_dir}/slurm)"


def _wait_done(job_id: str, run_dir: Path, env: dict[str, str], timeout: float = 420) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = _job(job_id, env)
        if info.get("JobState") in TERMINAL:
            return info
        time.sleep(1)
    subprocess.run(["scancel", job_id], env=env, timeout=60)
    raise AssertionError(
        f"job {job_id} not done after {timeout:.0f}s: {_job(job_id, env)}\n{_log_tail(run_dir)}"
    )


def _wait_steps(
    run_dir: Path, n: int, job_id: str, env: dict[str, str], timeout: float = 300
) -> None:
    deadline = time.monotonic() + timeout
    path = run_dir / "metrics" / "steps.jsonl"
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return
        if _job(job_id, env).get("JobState") in TERMINAL:
            break
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} did not log {n} steps:\n{_log_tail(run_dir)}")


def _attempts(run_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((run_dir / "attempts").glob("*.json"))]


def _cluster_overrides(base: list[str], root: Path, run_id: str) -> list[str]:
    return [
        *base,
        f"output_dir={root}",
        f"run_id={run_id}",
        *LAYOUT_2x1,
        "train.train_steps=40",
        "checkpoint.save_interval=10",
        "launch.slurm.time_limit=00:15:00",
        "launch.slurm.max_requeues=2",
    ]


@pytest.fixture(scope="module")
def background_jobs(
    slurm_env: dict[str, str], tiny_overrides: list[str], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[str, Path]]:
    """Jobs no test interacts with, submitted together so they share the cluster's waits.

    clean: one uninterrupted 2-node run (also the reference for the preemption test);
    raises: a deterministic user-code failure at step 3.
    """
    root = tmp_path_factory.mktemp("slurm")
    # The clean run's ranks are standby workers (launch.standby): they must train bit for bit
    # as the plain ones of the preemption test, which compares its losses with these.
    extra = {"clean": ["launch.standby=true"], "raises": ["train.fault=raise@3"]}
    return {
        name: (
            _submit([*_cluster_overrides(tiny_overrides, root, name), *more], slurm_env),
            root / name,
        )
        for name, more in extra.items()
    }


@pytest.fixture(scope="module")
def clean_run(
    slurm_env: dict[str, str], background_jobs: dict[str, tuple[str, Path]]
) -> tuple[Path, dict]:
    job_id, run_dir = background_jobs["clean"]
    return run_dir, _wait_done(job_id, run_dir, slurm_env)


@pytest.mark.slow
def test_job_runs_to_completion(clean_run: tuple[Path, dict]) -> None:
    run_dir, info = clean_run
    context = f"{info}\n{_log_tail(run_dir)}"
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), (
        context
    )
    [attempt] = _attempts(run_dir)
    assert (attempt["status"], attempt["exit_code"], attempt["step"]) == ("finished", 0, 40), (
        context
    )
    assert json.loads((run_dir / "latest.json").read_text())["step"] == 40
    # Every rank came from its node's standby (one per node, each forking its node's ranks).
    log = "\n".join(p.read_text(errors="replace") for p in (run_dir / "slurm").glob("*.out"))
    assert log.count("standby: ready for") == 2 and "starting plainly" not in log, context
    reaped = [e for p in (run_dir / "attempts" / "standby").glob("*.jsonl") for e in read_jsonl(p)]
    assert sorted(e.get("exit_code") for e in reaped) == [0, 0], reaped
    ls = subprocess.run(
        [sys.executable, "-m", "resiliency", "ls", str(run_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert re.search(r"^\s+40\s+step-000000040\s+yes\s+sizes ok", ls.stdout, re.M), ls.stdout
    steps = read_steps(run_dir)
    assert sorted(steps) == list(range(1, 41))
    assert steps[40]["loss"] < steps[1]["loss"] - 0.5, (steps[1], steps[40])
    assert (run_dir / "slurm" / f"{info['JobId']}-restart-0.log").is_file()
    # Followed as `launch k8s status|logs` follow a PyTorchJob: by job id or by run dir.
    by_id = _launch_slurm("status", info["JobId"])
    assert f"JobId={info['JobId']} JobName=clean JobState=COMPLETED" in by_id.stdout, by_id
    assert re.search(r"^clean\s+40\s+finished", by_id.stdout, re.M), by_id.stdout
    by_dir = _launch_slurm("status", str(run_dir))
    assert "JobState=COMPLETED" in by_dir.stdout, by_dir
    tail = _launch_slurm("logs", str(run_dir), "--tail", "3")
    out_file = run_dir / "slurm" / f"clean-{info['JobId']}.out"
    assert tail.stdout.splitlines() == out_file.read_text().splitlines()[-3:]


def _assert_losses_equal(clean: Path, run_dir: Path) -> None:
    """Every step of the 40 logged, each loss equal to the uninterrupted run's (as floats)."""
    reference, resumed = read_steps(clean), read_steps(run_dir)
    assert sorted(resumed) == sorted(reference) == list(range(1, 41))
    mismatches = [
        (s, reference[s]["loss"], resumed[s]["loss"])
        for s in reference
        if reference[s]["loss"] != resumed[s]["loss"]
    ]
    assert not mismatches, f"losses differ from the uninterrupted run: {mismatches[:5]}"


def _launch_slurm(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "launch", "slurm", *args],
        cwd=REPO, env=env or {**os.environ, "SLURM_CONF": _slurm_conf()},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _slurm_conf() -> str:
    root = os.environ.get("MCORE_RECIPES_SLURM_ROOT", "/tmp/mcore-recipes-slurm")
    return f"{root}/etc/slurm.conf"


@pytest.mark.slow
def test_a_held_job_is_cancelled_by_its_run_id(
    slurm_env: dict[str, str], tiny_overrides: list[str], tmp_path: Path
) -> None:
    run_id = f"held-{os.getpid()}"
    job_id = _submit(
        [*_cluster_overrides(tiny_overrides, tmp_path, run_id),
         "launch.slurm.extra_sbatch=[--hold]"],
        slurm_env,
    )  # fmt: skip
    assert _job(job_id, slurm_env)["JobState"] == "PENDING"
    listed = _launch_slurm("status", run_id, env=slurm_env)  # squeue --name: the run id
    assert f"JobId={job_id} JobName={run_id} JobState=PENDING" in listed.stdout, listed.stdout
    cancelled = _launch_slurm("cancel", run_id, env=slurm_env)
    assert cancelled.stdout.strip() == f"cancelled job {job_id}"
    deadline = time.monotonic() + 60
    while _job(job_id, slurm_env).get("JobState") != "CANCELLED":
        assert time.monotonic() < deadline, _job(job_id, slurm_env)
        time.sleep(0.5)


@pytest.mark.slow
def test_usr1_saves_requeues_and_resumes_bit_for_bit(
    slurm_env: dict[str, str],
    tiny_overrides: list[str],
    clean_run: tuple[Path, dict],
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "preempted"
    job_id = _submit(_cluster_overrides(tiny_overrides, tmp_path, "preempted"), slurm_env)
    _wait_steps(run_dir, 3, job_id, slurm_env)
    # What Slurm does at the time limit (--signal=B:USR1@grace), on demand: USR1 to the batch
    # shell only.
    subprocess.run(
        ["scancel", "--signal=USR1", "--batch", job_id], env=slurm_env, check=True, timeout=60
    )
    info = _wait_done(job_id, run_dir, slurm_env)
    context = f"{info}\n{_log_tail(run_dir)}"
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), (
        context
    )
    first, second = _attempts(run_dir)
    assert (first["status"], first["exit_code"]) == ("preempted", exit_codes.REQUEUE), context
    saved = first["step"]
    assert 3 <= saved < 40, context
    assert (second["status"], second["restored_step"], second["step"]) == ("finished", saved, 40), (
        context
    )
    restart_log = (run_dir / "slurm" / f"{job_id}-restart-1.log").read_text()
    assert f"resumed from step-{saved:09d} at step {saved}" in restart_log, context
    assert "retry policy: requeue" in (run_dir / "slurm" / f"{job_id}-restart-0.log").read_text()
    _assert_losses_equal(clean_run[0], run_dir)


@pytest.mark.slow
@pytest.mark.parametrize("to", ["batch", "steps"])
def test_sigint_saves_and_stops_the_job_without_a_requeue(
    slurm_env: dict[str, str], tiny_overrides: list[str], tmp_path: Path, to: str
) -> None:
    """A user's Ctrl-C for a batch job: SIGINT to the batch shell (`scancel --signal=INT
    --batch`, forwarded to the ranks once) or to every process of the job's steps. The ranks
    save at the step boundary; the job ends with 130, never requeued; the record says
    interrupted, with the step saved."""
    run_dir = tmp_path / "ctrl-c"
    job_id = _submit(_cluster_overrides(tiny_overrides, tmp_path, "ctrl-c"), slurm_env)
    _wait_steps(run_dir, 3, job_id, slurm_env)
    which = ["--batch"] if to == "batch" else []
    subprocess.run(
        ["scancel", "--signal=INT", *which, job_id], env=slurm_env, check=True, timeout=60
    )
    info = _wait_done(job_id, run_dir, slurm_env)
    context = f"{info}\n{_log_tail(run_dir)}"
    assert (info["ExitCode"], info["Restarts"]) == (f"{exit_codes.INTERRUPTED}:0", "0"), context
    [record] = _attempts(run_dir)
    assert (record["status"], record["exit_code"]) == ("interrupted", exit_codes.INTERRUPTED)
    saved = record["step"]
    assert 3 <= saved < 40 and RunLayout(tmp_path, "ctrl-c").published_steps()[-1] == saved
    log = (run_dir / "slurm" / f"{job_id}-restart-0.log").read_text()
    assert "retry policy: stop" in log and "requeue" not in log.split("retry policy:")[-1]
    assert "Traceback" not in log, log[-4000:]


@pytest.mark.slow
def test_user_code_failure_is_not_requeued(
    slurm_env: dict[str, str], background_jobs: dict[str, tuple[str, Path]]
) -> None:
    job_id, run_dir = background_jobs["raises"]
    info = _wait_done(job_id, run_dir, slurm_env)
    context = f"{info}\n{_log_tail(run_dir)}"
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == (
        "FAILED",
        f"{exit_codes.USER_CODE}:0",
        "0",
    ), context
    [attempt] = _attempts(run_dir)
    assert (attempt["status"], attempt["exit_code"], attempt["failure_class"]) == (
        "failed",
        exit_codes.USER_CODE,
        "user_code",
    ), context
    assert (
        "retry policy: stop 4 deterministic failure"
        in (run_dir / "slurm" / f"{job_id}-restart-0.log").read_text()
    ), context


@pytest.mark.slow
def test_unhealthy_node_is_excluded_and_the_job_shrinks(
    slurm_env: dict[str, str], tiny_overrides: list[str], tmp_path: Path
) -> None:
    """node2 breaks after the step-10 checkpoint (its site health check starts failing) and a
    rank on it dies at step 15: the check after the failure finds node2, the requeued job
    leaves it out and shrinks to node1 (data parallel 2 -> 1), restores step 10 resharded,
    and finishes. Every rank had the 2 CPUs per task the job asked for."""
    broken = tmp_path / "node2-is-broken"
    check = tmp_path / "site-check.sh"
    check.write_text(
        f'#!/bin/bash\nif [ "$MCORE_RECIPES_NODE" = node2 ] && [ -e {broken} ]; then\n'
        '    echo "simulated: GPU fell off the bus"; exit 1\nfi\n'
    )
    check.chmod(0o755)
    overrides = [
        *tiny_overrides,
        f"output_dir={tmp_path}",
        "run_id=shrink",
        "launch.nodes=2",
        "launch.nproc_per_node=2",  # TP=2 within a node; DP=2 across nodes
        "launch.slurm.cpus_per_task=2",
        "launch.slurm.min_nodes=1",
        "launch.slurm.time_limit=00:15:00",
        f"resiliency.health.script={check}",
        "train.train_steps=20",
        "checkpoint.save_interval=10",
        "train.fault=kill@15:2",  # rank 2: the first rank on node2
    ]
    job_id = _submit(overrides, slurm_env)
    run_dir = tmp_path / "shrink"
    _wait_steps(run_dir, 11, job_id, slurm_env)
    broken.touch()
    info = _wait_done(job_id, run_dir, slurm_env, timeout=480)
    context = f"{info}\n{_log_tail(run_dir)}"
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "1"), context
    assert (info["ExcNodeList"], info["NumNodes"], info["NodeList"]) == ("node2", "1", "node1")
    [requeue] = [
        json.loads(x) for x in (run_dir / "slurm" / "requeues.jsonl").read_text().splitlines()
    ]
    assert (requeue["kind"], requeue["exclude"], requeue["nodes"]) == ("failure", ["node2"], 1)
    assert requeue["unhealthy"] == ["node2"], requeue
    first, second = _attempts(run_dir)
    assert first["world_size"] == 4 and first["status"] in ("failed", "running"), context
    # each rank could run on the 2 CPUs its node's task asked for: task/affinity binds them
    # (cluster_up.sh leaves binding off where the cpuset is too narrow: then Slurm's count)
    conf = Path(slurm_env["SLURM_CONF"]).read_text()
    if "TaskPlugin=task/affinity" in conf:
        assert first["health"]["cpus_per_rank"] == [2, 2, 2, 2], first["health"]
    cpus = [c for n in first["health"]["nodes"] for c in n["checks"] if c["name"] == "cpus"]
    assert [c["detail"].endswith("(SLURM_CPUS_PER_TASK=2)") for c in cpus] == [True, True], cpus
    assert {n["node"]: n["ok"] for n in first["health"]["nodes"]} == {"node1": True, "node2": True}
    assert (second["status"], second["world_size"], second["restored_step"]) == (
        "finished",
        2,
        10,
    ), context
    assert second["topology_changed"] is True and second["step"] == 20, second
    assert [n["node"] for n in second["health"]["nodes"]] == ["node1"], second["health"]
    assert sorted(read_steps(run_dir)) == list(range(1, 21))
    after = json.loads((run_dir / "health" / f"{job_id}-0-after" / "node2.json").read_text())
    assert not after["ok"] and "GPU fell off the bus" in json.dumps(after), after


def _trainers(run_dir: Path) -> dict[str, tuple[int, int]]:
    """The run's trainer processes as the OS sees them: {Slurm node: (pid, rank)}."""
    config = str(run_dir / "launch-config.yaml")
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if b"pretrain" not in argv or config.encode() not in argv:
                continue
            env = dict(
                e.split(b"=", 1) for e in (proc / "environ").read_bytes().split(b"\0") if b"=" in e
            )
        except OSError:
            continue
        if argv[argv.index(b"pretrain") - 1] == b"-m":
            found[env[b"SLURMD_NODENAME"].decode()] = (int(proc.name), int(env[b"RANK"]))
    return found


def _store_host(job_id: str) -> str:
    """The node whose launcher listens on the job's rendezvous port (its --rdzv-endpoint)."""
    launchers = {}
    for proc in psutil.process_iter(["environ", "cmdline"]):
        env, argv = proc.info["environ"] or {}, proc.info["cmdline"] or []
        endpoint = [a for a in argv if a.startswith("--rdzv-endpoint=")]
        if env.get("SLURM_JOB_ID") == job_id and endpoint:
            launchers[proc.pid] = (env["SLURMD_NODENAME"], int(endpoint[0].rsplit(":", 1)[1]))
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in launchers:
            node, port = launchers[conn.pid]
            if conn.laddr.port == port:
                return node
    raise AssertionError(f"no launcher of job {job_id} listens on its rendezvous port")


def _node_launcher(job_id: str, node: str) -> psutil.Process:
    """The job's ft_launcher on ``node`` (its step's task), found as the OS sees it."""
    for proc in psutil.process_iter(["cmdline", "environ"]):
        env, argv = proc.info["environ"] or {}, proc.info["cmdline"] or []
        if (env.get("SLURM_JOB_ID"), env.get("SLURMD_NODENAME")) != (job_id, node):
            continue
        if "launch.torchrun" in argv[:3] and "--ft-launcher" in argv[:4]:
            return proc
    raise AssertionError(f"no ft_launcher of job {job_id} on {node}")


ELASTIC_STEPS = 100
ELASTIC_JOB = [f"train.train_steps={ELASTIC_STEPS}", "logging.log_interval=50", "parallel.tp=1"]


@pytest.mark.slow
def test_an_elastic_job_loses_a_node_trains_on_and_grows_back_in_the_same_job(
    slurm_env: dict[str, str], tiny_overrides: list[str], tmp_path: Path
) -> None:
    """parallel.elastic under Slurm: two nodes train at DP 2. At a random step the launcher of
    the job's second node and everything under it are SIGKILLed from outside: the job goes on
    at DP 1 in the same allocation, the node's step is started again and the job grows back to
    DP 2, and it finishes without a requeue. Judged against an uninterrupted DP 2 run of the
    same job (torchrun, outside Slurm): the same samples at every step (sample hashes), the
    same losses up to the shrink."""
    seed = int(os.environ.get("MCORE_RECIPES_TEST_SEED", time.time_ns() % 100_000))
    rng = random.Random(seed)
    print(f"test seed {seed} (MCORE_RECIPES_TEST_SEED={seed} repeats it)")
    job = [
        *_cluster_overrides(tiny_overrides, tmp_path, "elastic"),
        *ELASTIC_JOB,
    ]
    elastic = [
        "launch.backend=ft_launcher",
        "launch.min_nodes=1",
        "parallel.elastic=true",
        "parallel.elastic_min_interval_s=5",
    ]
    run_dir = tmp_path / "elastic"
    job_id = _submit([*job, *elastic], slurm_env)
    kill_at = rng.randrange(12, ELASTIC_STEPS // 3)
    _wait_steps(run_dir, kill_at, job_id, slurm_env)
    names = subprocess.run(
        ["scontrol", "show", "hostnames", _job(job_id, slurm_env)["NodeList"]],
        env=slurm_env, capture_output=True, text=True, timeout=60,
    ).stdout.split()  # fmt: skip
    victim = names[1]  # the first node hosts the rendezvous store: its exit is the job's
    kill_node(_node_launcher(job_id, victim))
    # The uninterrupted references, at both sizes, run while the job re-forms without the node.
    reference, half = tmp_path / "reference", tmp_path / "half"
    run_pretrain(2, [*_cluster_overrides(tiny_overrides, tmp_path, "reference"), *ELASTIC_JOB])
    run_pretrain(1, [*_cluster_overrides(tiny_overrides, tmp_path, "half"), *ELASTIC_JOB])
    info = _wait_done(job_id, run_dir, slurm_env)
    context = f"seed {seed}, killed at step {kill_at}: {info}\n{_log_tail(run_dir)}"
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), (
        context
    )
    ref, got = read_steps(reference), read_steps(run_dir)
    assert sorted(got) == sorted(ref) == list(range(1, ELASTIC_STEPS + 1)), context
    assert [got[s]["sample_hash"] for s in ref] == [ref[s]["sample_hash"] for s in ref], context
    sizes = [got[s]["dp"] for s in sorted(got)]
    shrunk = sizes.index(1)
    assert 2 in sizes[shrunk:] and sizes[-1] == 2, f"{sizes}\n{context}"
    assert all(got[s]["loss"] == ref[s]["loss"] for s in range(1, shrunk + 1)), context
    # After the resize too: every loss within the bound the two sizes set (a resize that lost
    # optimizer state strays far past it).
    assert_elastic_losses_within_bound(got, ref, read_steps(half), context)
    log = (run_dir / "slurm" / f"{job_id}-restart-0.log").read_text(errors="replace")
    assert "elastic: node 1 lost" in log and "elastic: node 1 returns" in log, context
    goodput = subprocess.run(
        [sys.executable, "-m", "resiliency", "goodput", str(run_dir)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "shrink DP 2 -> 1" in goodput.stdout and "grow DP 1 -> 2" in goodput.stdout, (
        goodput.stdout + goodput.stderr
    )


@pytest.mark.slow
@pytest.mark.parametrize("lost", ["trainer", "node"])
def test_a_spare_node_replaces_a_killed_one_inside_the_job(
    slurm_env: dict[str, str],
    tiny_overrides: list[str],
    clean_run: tuple[Path, dict],
    tmp_path: Path,
    lost: str,
) -> None:
    """Two nodes train and a third waits as a spare (launch.slurm.spare_nodes=1). After the
    step-10 save, on a random training node (not node1, which hosts the rendezvous store),
    from outside at a random step: the trainer is SIGKILLed (its launcher sees it die and asks
    to leave), or the node is lost whole (its launcher and everything under it SIGKILLed at
    once: nobody on it is left to ask). Either way the node leaves the job, a trainer starts
    on the spare (seen in /proc), and the job finishes without a requeue, its losses bit for
    bit those of the uninterrupted clean run."""
    seed = int(os.environ.get("MCORE_RECIPES_TEST_SEED", time.time_ns() % 100_000))
    rng = random.Random(seed)
    print(f"test seed {seed} (MCORE_RECIPES_TEST_SEED={seed} repeats it)")
    overrides = [
        *_cluster_overrides(tiny_overrides, tmp_path, "spare"),
        "launch.backend=ft_launcher",
        "launch.slurm.spare_nodes=1",
        "launch.slurm.partition=all",
    ]
    run_dir = tmp_path / "spare"
    job_id = _submit(overrides, slurm_env)
    _wait_steps(run_dir, 11 + rng.randrange(8), job_id, slurm_env)
    before = _trainers(run_dir)
    assert len(before) == 2, (before, _log_tail(run_dir))
    # The node whose launcher hosts the rendezvous store never leaves (with it would go the
    # store): on a real cluster the job's first; here every node is 127.0.0.1, so the first
    # launcher to bind the port, found by its listening socket.
    victim = rng.choice(sorted(set(before) - {_store_host(job_id)}))
    [spare] = {"node1", "node2", "node3"} - set(before)
    if lost == "trainer":
        os.kill(before[victim][0], signal.SIGKILL)
    else:
        kill_node(_node_launcher(job_id, victim))
    deadline, after = time.monotonic() + 240, {}
    while not (spare in after and len(after) == 2) and time.monotonic() < deadline:
        time.sleep(0.5)
        after = _trainers(run_dir)
    assert spare in after, f"no trainer on the spare {spare}:\n{_log_tail(run_dir)}"
    assert victim not in after and len(after) == 2, (before, after)  # ranks are re-dealt
    info = _wait_done(job_id, run_dir, slurm_env)
    context = f"{info}\n{_log_tail(run_dir)}"
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), (
        context
    )
    _assert_losses_equal(clean_run[0], run_dir)
    first, second = _attempts(run_dir)
    assert second["restored_step"] >= 10, second
    if lost == "node":
        # Nobody on the lost node was left to record its end: the survivors' own records
        # (a lost peer) make the attempt an infrastructure failure, retried in the job.
        assert (first["status"], first["failure_class"]) == ("failed", "infrastructure"), first
        return
    # The job's post-mortem (run by the batch script) names the killed rank and its signal
    # from the reaping parent's record, and measures the recovery phase by phase.
    killed = before[victim][1]
    assert (first["first_failing_rank"], first["failure_cause"]) == (
        killed,
        "killed by SIGKILL",
    ), first.get("evidence", first)
    assert first["exit_codes"][str(killed)] == -signal.SIGKILL, first["exit_codes"]
    assert second["restored_step"] >= 10 and first["rto"]["total_s"] > 0, first.get("rto")
    assert first["rto"]["fault_source"] == "the worker's parent reaped it", first["rto"]
    claim = json.loads(RunDir(run_dir).spare_claim(f"{job_id}-0", 0).read_text())
    assert (claim["node"], claim["worker_end"]) == (victim, "signal SIGKILL"), claim
    log = (run_dir / "slurm" / f"{job_id}-restart-0.log").read_text(errors="replace")
    # ft_launcher's own word: the victim's launcher left the rendezvous
    assert log.count("is excluded from the training due to an user request") == 1, context
