"""The object-store tier through a flaky network: a real S3 server (SeaweedFS) behind a
fault-injecting TCP proxy (drill/fault_proxy.py) that refuses, resets, truncates, answers 503
or strips conditional headers, switched from the test while the code under test runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from bench.s3_server import S3Server
from drill.fault_proxy import FaultProxy
from pretrain.context import exit_codes
from recipes.config.checkpoint import RemoteCheckpointConfig
from resiliency.monitor.fault_tolerance import newest_rank_bytes
from resiliency.storage.layout import RunLayout
from resiliency.storage.object_store import ObjectStore
from resiliency.storage.remote import (
    committed_remote_steps,
    fetch_newest,
    read_latest,
    step_prefix,
    upload_run,
    verify_remote_step,
)
from resiliency.storage.synthetic import write_random_step, write_synthetic_step
from tests.helpers import REPO, follow_uploaders, losses, run_pretrain

MIB = 1 << 20


@pytest.fixture(autouse=True)
def credentials(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's own clients (the direct and the flaky store) use the server's keys."""
    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)


@pytest.fixture()
def prefix() -> str:
    return f"f-{uuid.uuid4().hex[:8]}"


def _env(s3: S3Server, endpoint: str) -> dict[str, str]:
    return {**s3.env, "AWS_ENDPOINT_URL": endpoint}


@pytest.mark.parametrize(
    "mode, params",
    [
        ("http_503", {"count": 3}),
        ("reset", {"after_bytes": 64 << 10, "count": 2}),
        ("truncate", {"after_bytes": 100 << 10, "count": 2, "min_body": MIB}),
    ],
)
def test_a_flaky_fetch_is_retried_not_rejected(
    s3: S3Server, proxy: FaultProxy, prefix: str, tmp_path: Path, mode: str, params: dict
) -> None:
    """503s, connections reset mid-body and bodies cut short: the newest step still comes."""
    direct = ObjectStore(s3.url(prefix), s3.endpoint_url, workers=2)
    layout = RunLayout(tmp_path / "shared", "run")
    for step in (2, 4):
        write_random_step(layout, step, files=2, size=2 * MIB)
    upload_run(direct, layout, workers=2, keep_last=3)
    flaky = ObjectStore(s3.url(prefix), proxy.endpoint_url, workers=2, retry_budget_s=30)
    proxy.set_mode(mode, **params)
    fresh = RunLayout(tmp_path / "new-cluster", "run")
    fetched = fetch_newest(flaky, fresh, attempt=1, workers=2)
    assert fetched == fresh.step_dir(4)
    assert proxy.faults_injected >= params["count"], proxy.faults_injected


def test_retention_racing_the_uploader_and_a_corrupt_step_do_not_block_newer_steps(
    s3: S3Server, proxy: FaultProxy, prefix: str, tmp_path: Path
) -> None:
    layout = RunLayout(tmp_path, "run")
    write_synthetic_step(layout, 2)
    write_random_step(layout, 4, files=24, size=64 << 10)
    for step in (6, 8):
        write_synthetic_step(layout, step)
    target = next(layout.step_dir(2).rglob("*.distcp"))  # bit rot, not re-sealed
    data = bytearray(target.read_bytes())
    data[0] ^= 0xFF
    target.write_bytes(bytes(data))
    direct = ObjectStore(s3.url(prefix), s3.endpoint_url)
    slow = ObjectStore(s3.url(prefix), proxy.endpoint_url, workers=2)
    proxy.set_mode("delay", seconds=0.2)  # step 4 takes seconds to go up

    def local_retention() -> None:  # deletes step 4 once its upload is under way
        deadline = time.monotonic() + 60
        while not list(direct.list(step_prefix("run", 4))) and time.monotonic() < deadline:
            time.sleep(0.05)
        shutil.rmtree(layout.step_dir(4))

    racer = threading.Thread(target=local_retention)
    racer.start()
    result = upload_run(slow, layout, workers=2, keep_last=2)
    racer.join()
    skipped = dict(result.skipped)
    assert sorted(skipped) == [2, 4], result.skipped
    assert "does not verify" in skipped[2]
    assert "deleted by local retention during its upload" in skipped[4]
    assert committed_remote_steps(direct, "run") == [6, 8]
    proxy.set_mode("pass")
    again = subprocess.run(
        [sys.executable, "-m", "resiliency", "upload", str(layout.run_dir), "--to", direct.url],
        cwd=REPO, env={**os.environ, **s3.env}, text=True, capture_output=True, timeout=120,
    )  # fmt: skip
    assert again.returncode == 0, again.stdout + again.stderr  # step 8, the newest, is there
    assert "skipped step 2" in again.stdout and "newest remote committed step: 8" in again.stdout


def _launch(overrides: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "launch", "local", "--nproc=2", *overrides]
    full = {**os.environ, **env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, cwd=REPO, env=full, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)  # fmt: skip


# The uploader's retry backoff cap (resiliency/storage/object_retry.py, max_delay_s): after an
# outage its next try comes at most this long after the store answers again.
BACKOFF_CAP_S = 15.0
SLACK_S = 3.0  # a scan, the objects' PUTs and HEADs, this loop's 0.1 s polling


@pytest.mark.slow
def test_launch_local_uploads_each_step_and_rides_out_an_outage(
    s3: S3Server, proxy: FaultProxy, prefix: str, tiny_overrides: list[str], tmp_path: Path
) -> None:
    """A fresh run uploading as it trains, read from the server directly while it runs: each
    step is up within a follow interval of its publish; a 6 s outage from step 15 on is
    ridden out (the steps published during and after it are up within the interval plus the
    retry backoff's cap of the store's return); the follower SIGKILLed from outside is
    restarted by launch local and the steps published after that go up within the interval
    plus its restart; the job ends with its newest step committed remotely."""
    interval, url = 1.0, s3.url(prefix)
    overrides = [*tiny_overrides, f"output_dir={tmp_path}", "run_id=run", "train.train_steps=150",
                 "checkpoint.save_interval=5", f"checkpoint.remote.url={url}",
                 f"checkpoint.remote.follow_interval_s={interval:g}",
                 "checkpoint.remote.retry_budget_s=60"]  # fmt: skip
    layout = RunLayout(tmp_path, "run")
    direct = ObjectStore(url, s3.endpoint_url)
    job = _launch(overrides, _env(s3, proxy.endpoint_url))
    lines: list[str] = []  # drained as it comes: a full pipe would stall the launcher
    reader = threading.Thread(target=lambda: lines.extend(job.stdout or []), daemon=True)
    reader.start()
    published: dict[int, float] = {}
    remote: dict[int, float] = {}
    samples: list[tuple[float, int]] = []  # (when, the newest step committed on the server)
    outage: list[float] = []  # its start and end
    killed: tuple[float, int] | None = None  # when, and the follower's pid
    restarted: int | None = None  # the new follower's pid, seen while the job ran
    while job.poll() is None:
        now = time.monotonic()
        for step in layout.published_steps() if layout.steps_dir.is_dir() else []:
            published.setdefault(step, now)
        committed = committed_remote_steps(direct, "run")
        for step in committed:
            remote.setdefault(step, now)
        samples.append((now, max(committed, default=0)))
        # From step 15 on, once the steps before it went up (or were given their chance).
        settled = 10 in remote or (10 in published and now - published[10] > interval + 3.0)
        if not outage and 15 in published and settled:
            proxy.set_mode("refuse")
            outage.append(now)
        if len(outage) == 1 and now - outage[0] > 6:
            proxy.set_mode("pass")
            outage.append(now)
        owed = [s for s, t in published.items() if t <= now - interval]
        caught_up = max(committed, default=0) >= max(owed, default=0)
        if len(outage) == 2 and killed is None and caught_up and now - outage[1] > 1:
            follower = next(iter(follow_uploaders(layout.run_dir)), None)
            if follower is not None:
                follower.kill()  # from outside, as an OOM killer or an operator would
                killed = (now, follower.pid)
        if killed is not None and restarted is None:
            follower = next(iter(follow_uploaders(layout.run_dir)), None)
            restarted = follower.pid if follower is not None and follower.pid != killed[1] else None
        time.sleep(0.1)
    proxy.set_mode("pass")
    reader.join(timeout=10)
    output = "".join(lines)
    assert job.returncode == 0, output[-4000:]
    assert len(outage) == 2 and killed is not None and restarted is not None, output[-2000:]
    for step in (5, 10):  # published before the outage: up within a follow interval
        assert step in remote and remote[step] - published[step] <= interval + SLACK_S, step

    # While the job runs, the server's newest step is never behind a step published more than
    # the interval (+ slack) before, but from an outage's start until the uploader caught up,
    # at most the backoff's cap after the store answered again, and from the follower's kill
    # until its successor caught up, at most its restart after (launch local: 1 s, its 1 s
    # watch, the new process's imports).
    def owed(now: float) -> int:
        return max((s for s, t in published.items() if t <= now - interval - SLACK_S), default=0)

    def caught_up(after: float) -> float:
        return next(now for now, newest in samples if now >= after and newest >= owed(now))

    back = caught_up(outage[1])
    assert back <= outage[1] + interval + BACKOFF_CAP_S + SLACK_S, (back, outage)
    restored = caught_up(killed[0] + interval + SLACK_S)
    assert restored <= killed[0] + 2.0 + 5.0 + interval + SLACK_S, (restored, killed)
    exempt = [(outage[0], back), (killed[0], restored)]
    checked = [now for now, _ in samples if not any(a <= now <= b for a, b in exempt)]
    for now, newest in samples:
        if now in checked:
            assert newest >= owed(now), (now, newest, owed(now), exempt)
    assert sum(now > restored for now in checked) > 10, (checked, exempt)
    assert "launch local: uploader exited -9; restarting it in 1 s" in output, output[-3000:]
    assert committed_remote_steps(direct, "run")[-1] == 150
    assert verify_remote_step(direct, "run", 150, full=True).ok  # every byte, downloaded
    assert "newest remote committed step: 150" in output
    assert "object store:" in output and "retry" in output  # the outage was seen and retried
    metrics = (layout.metrics_dir / "remote.prom").read_text()
    assert 'checkpoint_remote_last_committed_step{run_id="run"} 150.0' in metrics
    assert 'checkpoint_remote_lag_steps{run_id="run"} 0.0' in metrics


@pytest.mark.slow
def test_a_restore_through_503s_and_resets_resumes_exactly(
    s3: S3Server, proxy: FaultProxy, prefix: str, tiny_overrides: list[str], tmp_path: Path
) -> None:
    """The run dir is lost; the relaunch first meets a dead object store (exit 1, nothing
    older restored), then 503s and resets while it fetches: it restores the newest remote step
    and trains on bit-identically to an uninterrupted run."""
    url = s3.url(prefix)
    common = [*tiny_overrides, "checkpoint.save_interval=5", f"checkpoint.remote.url={url}"]
    reference = tmp_path / "reference"
    run_pretrain(2, [*common, f"output_dir={reference}", "run_id=ref"], env=s3.env)
    shared = tmp_path / "shared"
    run = [*common, f"output_dir={shared}", "run_id=run"]
    crashed = run_pretrain(2, [*run, "train.fault=kill@8"], env=s3.env, check=False)
    assert crashed.returncode != 0
    upload = subprocess.run([sys.executable, "-m", "resiliency", "upload", str(shared / "run")],
                            cwd=REPO, env={**os.environ, **s3.env}, text=True,
                            capture_output=True, timeout=120)  # fmt: skip
    assert upload.returncode == 0, upload.stdout + upload.stderr
    shutil.rmtree(shared / "run")  # the shared file system is gone

    flaky = _env(s3, proxy.endpoint_url)
    proxy.set_mode("refuse")
    out = run_pretrain(2, [*run, "checkpoint.remote.retry_budget_s=3"], env=flaky, check=False)
    assert out.returncode == exit_codes.INFRASTRUCTURE, out.stderr[-3000:]
    assert "ObjectStoreUnavailable" in out.stderr and "retry_budget_s" in out.stderr
    assert "training failed (infrastructure, exit 1, retryable)" in out.stderr
    assert not (shared / "run" / "steps").exists() or not RunLayout(shared, "run").published_steps()

    spent = proxy.faults_injected + 4  # the counter runs on across modes
    proxy.set_mode("http_503", count=4)

    def then_resets() -> None:  # once the 503s are spent, reset connections twice
        deadline = time.monotonic() + 120
        while proxy.faults_injected < spent and time.monotonic() < deadline:
            time.sleep(0.02)
        proxy.set_mode("reset", after_bytes=4096, count=2)

    switcher = threading.Thread(target=then_resets, daemon=True)
    switcher.start()
    resumed = run_pretrain(2, run, env=flaky)
    switcher.join(timeout=5)
    assert "fetched step 5 from s3://" in resumed.stderr
    retries = [line for line in resumed.stderr.splitlines() if "object store:" in line]
    assert retries and proxy.faults_injected >= spent + 2  # both kinds were met and retried
    # The refused launch stopped before taking the lease: it left no attempt record.
    record = json.loads((shared / "run" / "attempts" / "attempt-01.json").read_text())
    assert (record["restored_step"], record["restored_tier"]) == (5, "remote")
    assert losses(shared / "run") == losses(reference / "ref")[5:]


def test_the_preflight_refuses_before_any_rank(
    s3: S3Server, proxy: FaultProxy, prefix: str, tiny_overrides: list[str], tmp_path: Path
) -> None:
    """Wrong credentials, a missing bucket, a server that ignores conditional writes: one
    line, exit 2, and no rank ever started (no attempt record)."""
    base = [*tiny_overrides, f"output_dir={tmp_path}", "run_id=run"]
    cases = [
        ([f"checkpoint.remote.url={s3.url(prefix)}"],
         {**s3.env, "AWS_SECRET_ACCESS_KEY": "not-the-secret"}, "access refused"),
        ([f"checkpoint.remote.url=s3://no-such-bucket-{prefix}/x"], s3.env,
         "the bucket does not exist"),
        ([f"checkpoint.remote.url={s3.url(prefix)}"], _env(s3, proxy.endpoint_url),
         "ignores conditional writes"),
    ]  # fmt: skip
    proxy.set_mode("strip_conditional", secret_key=s3.env["AWS_SECRET_ACCESS_KEY"])  # re-signs
    for extra, env, line in cases:
        job = _launch([*base, *extra], env)
        output, _ = job.communicate(timeout=120)
        assert job.returncode == exit_codes.CONFIG_ERROR, output[-3000:]
        assert line in output and "Traceback" not in output, output[-3000:]
        assert not (tmp_path / "run" / "attempts").exists()


def test_the_setup_timeout_of_a_remote_restore_counts_its_download(
    s3: S3Server, prefix: str, tmp_path: Path
) -> None:
    """Under ft_launcher, with no local step, the setup section must allow for downloading
    the newest remote step (rank 0 fetches it whole), not only the shared tier's bytes."""
    layout = RunLayout(tmp_path / "shared", "run")
    write_random_step(layout, 3, files=2, size=MIB)
    direct = ObjectStore(s3.url(prefix), s3.endpoint_url)
    upload_run(direct, layout, workers=2, keep_last=2)
    fresh = tmp_path / "new-cluster" / "run"
    remote = RemoteCheckpointConfig(url=s3.url(prefix), endpoint_url=s3.endpoint_url)
    assert newest_rank_bytes(fresh, 4, remote) == (2 * MIB + 2 * MIB // 4, True)
    assert newest_rank_bytes(fresh, 4) == (0, False)  # without the tier: a fresh start


def test_retention_counts_only_steps_that_verify_remotely_and_ignores_a_garbage_latest(
    s3: S3Server, prefix: str, tmp_path: Path
) -> None:
    layout = RunLayout(tmp_path, "run")
    store = ObjectStore(s3.url(prefix), s3.endpoint_url)
    for step in (2, 4, 6):
        write_synthetic_step(layout, step)
    upload_run(store, layout, workers=2, keep_last=3)
    store.delete(step_prefix("run", 6) + "model/__0_0.distcp")  # committed, no longer whole
    store.client.put_object(Bucket=store.bucket, Key=store.key("run/latest.json"),
                            Body=b"{not json")  # fmt: skip
    write_synthetic_step(layout, 8)
    result = upload_run(store, layout, workers=2, keep_last=2)
    # Newest two that verify: 8 and 4; 6 is kept too (newer than 4), only 2 goes.
    assert result.deleted == [2] and result.committed == [4, 6, 8]
    assert read_latest(store, "run") == 8  # the garbage hint was replaced


@pytest.mark.slow
def test_a_final_upload_that_cannot_reach_the_store_is_exit_12(
    s3: S3Server, proxy: FaultProxy, prefix: str, tiny_overrides: list[str], tmp_path: Path
) -> None:
    """The store goes away for good once the first step is up: training ends well (step 100
    published on the shared tier) but the object store lacks it, and launch local says so
    with its process status, 12 (REMOTE_BEHIND), not 0."""
    url = s3.url(prefix)
    overrides = [*tiny_overrides, f"output_dir={tmp_path}", "run_id=run", "train.train_steps=100",
                 "checkpoint.save_interval=5", f"checkpoint.remote.url={url}",
                 "checkpoint.remote.follow_interval_s=0.5",
                 "checkpoint.remote.retry_budget_s=3"]  # fmt: skip
    direct = ObjectStore(url, s3.endpoint_url)
    job = _launch(overrides, _env(s3, proxy.endpoint_url))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(job.stdout or []), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 240
        while not committed_remote_steps(direct, "run"):
            assert job.poll() is None and time.monotonic() < deadline, "no step went up"
            time.sleep(0.1)
        proxy.set_mode("refuse")
        code = job.wait(timeout=240)
    finally:
        proxy.set_mode("pass")
        if job.poll() is None:
            job.kill()
    reader.join(timeout=10)
    output = "".join(lines)
    assert code == exit_codes.REMOTE_BEHIND, output[-4000:]
    assert RunLayout(tmp_path, "run").published_steps()[-1] == 100  # training ended well
    assert committed_remote_steps(direct, "run")[-1] < 100
    assert "the object store lacks the newest verified step" in output


def test_an_object_store_that_stays_out_is_exit_1(
    s3: S3Server, proxy: FaultProxy, prefix: str, tiny_overrides: list[str], tmp_path: Path
) -> None:
    """The store refuses every connection past checkpoint.remote.retry_budget_s when the run
    starts: infrastructure, exit 1 (INFRASTRUCTURE, which launchers retry), as the process
    status of python -m launch.torchrun."""
    proxy.set_mode("refuse")
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "launch.torchrun", "--standalone", "--nproc-per-node=1",
             "-m", "pretrain", *tiny_overrides, "parallel.tp=1", f"output_dir={tmp_path}",
             "run_id=out", f"checkpoint.remote.url={s3.url(prefix)}",
             "checkpoint.remote.retry_budget_s=2"],
            cwd=REPO, text=True, capture_output=True, timeout=180,
            env={**os.environ, **_env(s3, proxy.endpoint_url), "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
    finally:
        proxy.set_mode("pass")
    assert proc.returncode == exit_codes.INFRASTRUCTURE, proc.stderr[-4000:]
    assert "(infrastructure, exit 1, retryable)" in proc.stderr, proc.stderr[-4000:]
