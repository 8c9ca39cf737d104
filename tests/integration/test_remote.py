"""The object-store tier against a real S3 server (SeaweedFS on 127.0.0.1, started here): the
upload protocol, killed and resumed uploads, corrupted objects, racing latest.json writers.
Real runs through the tier (launch local's uploader, a run that lost its run dir resuming
bit-exactly from the object store) go through a flaky network in test_remote_faults.py."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from bench.s3_server import S3Server
from drill.fault_proxy import FaultProxy
from resiliency.storage.layout import RunLayout
from resiliency.storage.object_store import ObjectStore
from resiliency.storage.remote import (
    advance_latest,
    fetch_newest,
    read_latest,
    step_prefix,
    upload_run,
    verify_remote_step,
)
from resiliency.storage.synthetic import write_random_step, write_synthetic_step
from tests.helpers import REPO


@pytest.fixture()
def store(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> ObjectStore:
    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    return ObjectStore(s3.url(f"t-{uuid.uuid4().hex[:8]}"), s3.endpoint_url, workers=4)


def cli(s3: S3Server, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, **s3.env}
    return subprocess.run([sys.executable, "-m", "resiliency", *args], cwd=REPO, env=env,
                          text=True, capture_output=True, timeout=timeout)  # fmt: skip


def test_upload_is_committed_last_resumable_and_listed(
    s3: S3Server, store: ObjectStore, tmp_path: Path
) -> None:
    layout = RunLayout(tmp_path, "run")
    for step in (2, 4):
        write_synthetic_step(layout, step)
    reports = upload_run(store, layout, workers=4, keep_last=3).reports
    assert [r.step for r in reports] == [2, 4] and all(r.skipped == 0 for r in reports)
    assert read_latest(store, "run") == 4
    assert verify_remote_step(store, "run", 4, full=True).ok
    again = upload_run(store, layout, workers=4, keep_last=3)
    assert again.reports == [] and again.committed == [2, 4]  # nothing left to send

    proc = cli(s3, "ls", f"{store.url}/run")
    assert proc.returncode == 0, proc.stderr
    assert "latest.json: step 4" in proc.stdout and "step-000000002" in proc.stdout
    proc = cli(s3, "verify", f"{store.url}/run/steps/step-000000004")
    assert proc.returncode == 0 and proc.stdout.startswith("OK  step-000000004: ok (full")


def test_a_killed_upload_never_verifies_incomplete_and_resumes(
    s3: S3Server, proxy: FaultProxy, store: ObjectStore, tmp_path: Path
) -> None:
    """SIGKILLed at a random moment while objects arrive, slowed (0.05 s a request, through
    the proxy) so that the moment is always before the end: nothing verifies or fetches,
    and the next upload sends only what is missing."""
    seed = random.randrange(2**31)
    print(f"UPLOAD_KILL_SEED={seed}")
    layout = RunLayout(tmp_path, "run")
    write_random_step(layout, 10, files=120, size=64 << 10)
    cmd = [sys.executable, "-m", "resiliency", "upload", str(layout.run_dir), "--to", store.url,
           "--workers", "2"]  # fmt: skip
    proxy.set_mode("delay", seconds=0.05)  # 122 objects on 2 workers: 3 s at the least
    env = {**os.environ, **s3.env, "AWS_ENDPOINT_URL": proxy.endpoint_url}
    upload = subprocess.Popen(cmd, cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        while not list(store.list(step_prefix("run", 10))) and upload.poll() is None:
            time.sleep(0.02)  # killed once objects are arriving, at a random point after that
        time.sleep(random.Random(seed).uniform(0.0, 0.8))
        upload.send_signal(signal.SIGKILL)
        upload.wait()
        time.sleep(1.0)  # a request the proxy was holding still lands: count it
    finally:
        proxy.set_mode("pass")
    landed = len(list(store.list(step_prefix("run", 10))))
    assert 0 < landed < 120, landed  # killed part way, as planned
    verdict = verify_remote_step(store, "run", 10, full=True)
    assert not verdict.ok, (landed, verdict)  # COMMITTED only on a complete step
    assert fetch_newest(store, RunLayout(tmp_path / "elsewhere", "run"), 1, 4) is None

    proc = cli(s3, "upload", str(layout.run_dir), "--to", store.url)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # What was there and verified was not sent again (an object cut by the kill is not there).
    assert f"{landed} already there" in proc.stdout, (landed, proc.stdout)
    assert verify_remote_step(store, "run", 10, full=True).ok


def test_a_corrupted_remote_object_is_rejected_and_the_previous_step_used(
    store: ObjectStore, tmp_path: Path
) -> None:
    layout = RunLayout(tmp_path / "shared", "run")
    for step in (2, 4):
        write_synthetic_step(layout, step)
    upload_run(store, layout, workers=4, keep_last=3)
    # Bit rot under an intact listing: same size, same recorded checksum, other bytes.
    rel = step_prefix("run", 4) + "model/__0_0.distcp"
    info = store.head(rel)
    assert info is not None
    store.client.put_object(Bucket=store.bucket, Key=store.key(rel),
                            Body=os.urandom(info.size), Metadata=info.metadata)  # fmt: skip
    assert not verify_remote_step(store, "run", 4, full=True).ok
    fresh = RunLayout(tmp_path / "new-cluster", "run")
    fetched = fetch_newest(store, fresh, attempt=1, workers=4)
    assert fetched == fresh.step_dir(2)
    assert fresh.published_steps() == [2] and fresh.tmp_dirs() == []


def test_racing_uploaders_never_move_latest_backwards(store: ObjectStore) -> None:
    seen: list[int] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            if (latest := read_latest(store, "run")) is not None:
                seen.append(latest)

    def uploader(seed: int) -> None:
        mine = ObjectStore(store.url, os.environ["AWS_ENDPOINT_URL"])  # its own connections
        steps = list(range(1, 41))
        random.Random(seed).shuffle(steps)
        for step in steps:
            advance_latest(mine, "run", step)

    watcher = threading.Thread(target=watch)
    watcher.start()
    racers = [threading.Thread(target=uploader, args=(seed,)) for seed in range(4)]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join()
    done.set()
    watcher.join()
    assert read_latest(store, "run") == 40
    assert seen == sorted(seen), "latest.json moved backwards"


def test_files_larger_than_a_part_go_up_in_parts(store: ObjectStore, tmp_path: Path) -> None:
    layout = RunLayout(tmp_path / "shared", "run")
    write_random_step(layout, 3, files=2, size=11 << 20)  # 3 parts of <= 5 MiB each
    parted = ObjectStore(store.url, os.environ["AWS_ENDPOINT_URL"], workers=2, part_mib=5)
    [report] = upload_run(parted, layout, workers=2, keep_last=3).reports
    assert report.bytes_sent == 2 * (11 << 20)
    assert verify_remote_step(parted, "run", 3, full=True).ok
    fetched = fetch_newest(parted, RunLayout(tmp_path / "new", "run"), attempt=1, workers=2)
    assert fetched is not None and fetched.name == "step-000000003"


def test_resiliency_upload_exits_as_documented(
    s3: S3Server, proxy: FaultProxy, store: ObjectStore, tmp_path: Path
) -> None:
    """Real `python -m resiliency upload` processes, each exit code its docstring promises,
    read as the process status: 0 caught up; 1 the store out past the retry budget (BEHIND);
    2 not a run dir, or credentials the server refuses; 6 the run's lease moved to another job
    while --follow served the old one (it stops; the new job's uploader takes over)."""
    layout = RunLayout(tmp_path, "run")
    for step in (2, 4):
        write_synthetic_step(layout, step)
    assert cli(s3, "upload", str(tmp_path / "nothing"), "--to", store.url).returncode == 2
    wrong = subprocess.run(
        [sys.executable, "-m", "resiliency", "upload", str(layout.run_dir), "--to", store.url],
        cwd=REPO, text=True, capture_output=True, timeout=120,
        env={**os.environ, **s3.env, "AWS_SECRET_ACCESS_KEY": "not-the-key"},
    )  # fmt: skip
    assert wrong.returncode == 2, wrong.stdout + wrong.stderr[-2000:]
    proxy.set_mode("refuse")
    try:
        out = cli(s3, "upload", str(layout.run_dir), "--to", store.url,
                  "--endpoint-url", proxy.endpoint_url, "--retry-budget-s", "1")  # fmt: skip
    finally:
        proxy.set_mode("pass")
    assert out.returncode == 1 and "BEHIND" in out.stdout, out.stdout + out.stderr[-2000:]
    ok = cli(s3, "upload", str(layout.run_dir), "--to", store.url)
    assert ok.returncode == 0 and "newest remote committed step: 4" in ok.stdout, ok.stdout

    # A job (a process that dies holding the lease: its generation 1), served by --follow.
    job = (
        "from resiliency.storage.layout import RunLayout\n"
        "from resiliency.storage.lease import RunLease\n"
        f"RunLease(RunLayout({str(tmp_path)!r}, 'run'), 1, 60.0).acquire()\n"
    )
    subprocess.run([sys.executable, "-c", job], cwd=REPO, check=True, timeout=60)
    follower = subprocess.Popen(
        [sys.executable, "-m", "resiliency", "upload", str(layout.run_dir), "--to", store.url,
         "--follow", "--interval", "0.5"],
        cwd=REPO, env={**os.environ, **s3.env}, text=True, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        write_synthetic_step(layout, 6)
        deadline = time.monotonic() + 60
        while read_latest(store, "run") != 6:  # the follower serves generation 1
            assert follower.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        # Another job takes the run over (the old owner is dead): generation 2.
        from resiliency.storage.lease import RunLease

        RunLease(layout, 2, 60.0).acquire()
        code = follower.wait(timeout=60)
    finally:
        if follower.poll() is None:
            follower.kill()
    output = follower.stdout.read() if follower.stdout else ""
    assert code == 6, output[-3000:]
    assert "lease moved from generation 1 to 2" in output, output[-3000:]
