"""Single-writer run lease, with real processes (no mocks)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from resiliency.storage.layout import RunLayout
from resiliency.storage.lease import LeaseHeldError, LeaseInfo, LeaseLostError, RunLease, read_lease

RUN = "run-lease"


@pytest.fixture
def layout(tmp_path: Path) -> RunLayout:
    return RunLayout(tmp_path, RUN)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _write_foreign_lease(layout: RunLayout, **overrides: object) -> None:
    mine = LeaseInfo.for_this_process(attempt=9, timeout_s=60).__dict__
    layout.run_dir.mkdir(parents=True, exist_ok=True)
    layout.lease_path.write_text(json.dumps({**mine, **overrides}))


def test_acquire_writes_owner_and_release_removes(layout: RunLayout) -> None:
    with RunLease(layout, attempt=1, timeout_s=30):
        info = read_lease(layout)
        assert info is not None
        assert (info.attempt, info.pid, info.host) == (1, os.getpid(), socket.gethostname())
    assert read_lease(layout) is None
    assert not layout.lease_path.with_name("LEASE.lock").exists()


def test_second_acquirer_refused_with_clear_message(layout: RunLayout) -> None:
    first = RunLease(layout, attempt=1, timeout_s=30)
    first.acquire()
    with pytest.raises(LeaseHeldError) as err:
        RunLease(layout, attempt=2, timeout_s=30).acquire()
    msg = str(err.value)
    for part in (
        "attempt 1",
        socket.gethostname(),
        f"pid {os.getpid()}",
        "heartbeat",
        "stop it",
        "taken over",
    ):
        assert part in msg, msg
    first.acquire()  # the same owner may re-acquire
    first.release()


def _foreign_beater(layout: RunLayout, skew_s: float, interval_s: float) -> subprocess.Popen:
    """A live owner "on another host" (its own host name and pid namespace) whose clock is
    ``skew_s`` off ours, beating every ``interval_s`` as a real heartbeat thread does."""
    code = f"""
import json, os, time
path, beats = {str(layout.lease_path)!r}, 0
while True:
    body = dict(attempt=9, host="other-host", pid=4242, heartbeat=time.time() + {skew_s},
                pid_ns="other-boot/pid:[1]", generation=7, beats=beats, timeout_s=2)
    with open(path + ".tmp", "w") as f:
        json.dump(body, f)
    os.replace(path + ".tmp", path)
    beats += 1
    time.sleep({interval_s})
"""
    layout.run_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 10
    while not layout.lease_path.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return proc


@pytest.mark.parametrize("skew_s", [-120.0, 120.0])
def test_a_live_owner_with_a_skewed_clock_is_never_taken_over(
    layout: RunLayout, skew_s: float
) -> None:
    """Staleness is the owner's counter timed by the observer's monotonic clock: a clock two
    minutes off either way changes nothing (wall-clock ages made a live owner look dead)."""
    owner = _foreign_beater(layout, skew_s, interval_s=0.25)
    try:
        for attempt in (2, 3):
            with pytest.raises(LeaseHeldError, match="other-host.*moved while this host watched"):
                RunLease(layout, attempt=attempt, timeout_s=2).acquire()
        assert read_lease(layout).attempt == 9
    finally:
        owner.kill()
        owner.wait()


@pytest.mark.parametrize("skew_s", [-120.0, 120.0])
def test_a_dead_owner_elsewhere_is_taken_over_within_the_timeout_and_a_beat(
    layout: RunLayout, skew_s: float
) -> None:
    owner = _foreign_beater(layout, skew_s, interval_s=0.25)
    time.sleep(0.6)
    owner.kill()  # the owner's host died: nothing here can prove it
    owner.wait()
    started = time.monotonic()
    lease = RunLease(layout, attempt=2, timeout_s=2)
    lease.acquire()
    took = time.monotonic() - started
    assert 2.0 <= took <= 2.0 + 0.25 + 1.0, took
    info = read_lease(layout)
    assert (info.attempt, info.generation) == (2, 8)  # the generation only grows


def test_the_same_job_needs_the_same_proof(
    layout: RunLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relaunch under the same job id (a requeue, a recreated pod) no longer assumes the old
    group is dead: an owner on another host is watched like any other."""
    for name in ("MCORE_RECIPES_JOB_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-42")
    _write_foreign_lease(layout, host="some-other-host", pid=12345, job_id="job-42", pid_ns="x")
    started = time.monotonic()
    RunLease(layout, attempt=2, timeout_s=1).acquire()
    assert time.monotonic() - started >= 1.0
    assert read_lease(layout).attempt == 2


def test_dead_pid_on_same_host_taken_over_immediately(layout: RunLayout) -> None:
    _write_foreign_lease(layout, pid=_dead_pid(), heartbeat=time.time())
    started = time.monotonic()
    RunLease(layout, attempt=2, timeout_s=3600).acquire()
    assert time.monotonic() - started < 1.0
    assert read_lease(layout).attempt == 2


def test_garbage_lease_replaced_only_after_staying_unchanged(layout: RunLayout) -> None:
    layout.run_dir.mkdir(parents=True)
    layout.lease_path.write_text("{torn")
    started = time.monotonic()
    RunLease(layout, attempt=1, timeout_s=1).acquire()
    assert time.monotonic() - started >= 1.0
    assert read_lease(layout).attempt == 1


def test_generation_grows_across_releases_and_fences_a_stale_owner(layout: RunLayout) -> None:
    first = RunLease(layout, attempt=1, timeout_s=30)
    first.acquire()
    first.release()
    first.acquire()
    assert first.generation == 2 and read_lease(layout).generation == 2
    with first.hold("publishing step 5"):
        (layout.run_dir / "written").write_text("ok")
    # Another host took the run over (as after a SIGSTOP past the timeout).
    _write_foreign_lease(layout, host="other-host", pid=1, generation=3, attempt=2)
    with pytest.raises(LeaseLostError, match=r"now held by attempt 2 on host other-host.*"
                       r"generation 2\) is fenced: publishing step 6 refused"):  # fmt: skip
        with first.hold("publishing step 6"):
            (layout.run_dir / "never").write_text("written by a fenced owner")
    assert not (layout.run_dir / "never").exists()
    assert LeaseLostError.exit_code == 6


def test_stale_mutex_of_dead_process_is_broken(layout: RunLayout) -> None:
    layout.run_dir.mkdir(parents=True)
    lock = layout.lease_path.with_name("LEASE.lock")
    owner = LeaseInfo.for_this_process(attempt=1, timeout_s=1)
    lock.write_text(json.dumps({"host": owner.host, "pid": _dead_pid(), "pid_ns": owner.pid_ns}))
    RunLease(layout, attempt=1, timeout_s=60, lock_wait_s=1).acquire()
    assert not lock.exists()


def _die_taking_the_mutex(root: str) -> None:
    # The write of the lock's identity is where the process dies: with an exclusive create
    # followed by a write, this left an empty lock that only its 30 s age could clear.
    from resiliency.storage import lease as lease_module

    def die(*_: object) -> None:
        os._exit(9)

    lease_module.os.write = die  # type: ignore[assignment]
    Path.write_text = die  # type: ignore[assignment,method-assign]
    lease_module.RunLease(RunLayout(Path(root), RUN), attempt=1, timeout_s=60).acquire()


def test_a_process_killed_taking_the_mutex_does_not_block_the_next(layout: RunLayout) -> None:
    layout.run_dir.mkdir(parents=True)
    proc = mp.get_context("fork").Process(target=_die_taking_the_mutex, args=(str(layout.root),))
    proc.start()
    proc.join(timeout=30)
    assert proc.exitcode == 9
    started = time.monotonic()
    RunLease(layout, attempt=2, timeout_s=60, lock_wait_s=2).acquire()
    assert time.monotonic() - started < 1.0
    assert read_lease(layout).attempt == 2
    assert sorted(p.name for p in layout.run_dir.iterdir()) == ["LEASE", "LEASE.generation"]


def test_heartbeat_and_loss_detection(layout: RunLayout) -> None:
    lease = RunLease(layout, attempt=1, timeout_s=30)
    lease.acquire()
    t0 = read_lease(layout).heartbeat
    time.sleep(0.01)
    lease.heartbeat()
    assert read_lease(layout).heartbeat > t0
    lost: list[LeaseLostError] = []
    lease.start_heartbeat(interval_s=0.02, on_lost=lost.append)
    _write_foreign_lease(layout, host="usurper", pid=1)  # someone took it over
    deadline = time.monotonic() + 5
    while lease.lost is None and time.monotonic() < deadline:
        time.sleep(0.01)
    lease.stop_heartbeat()
    assert isinstance(lease.lost, LeaseLostError) and lost == [lease.lost]
    assert "usurper" in str(lease.lost)
    with pytest.raises(LeaseLostError):
        lease.heartbeat()
    lease.release()  # not ours any more: left alone
    assert read_lease(layout).host == "usurper"


def _race(
    root: str,
    attempt: int,
    start: mp.synchronize.Barrier,
    done: mp.synchronize.Barrier,
    results: mp.Queue,
) -> None:
    lease = RunLease(RunLayout(Path(root), RUN), attempt=attempt, timeout_s=60)
    start.wait()
    try:
        lease.acquire()
        results.put((attempt, "won"))
    except LeaseHeldError:
        results.put((attempt, "refused"))
    done.wait()  # stay alive until every racer has tried, so the winner's pid stays live


def test_concurrent_acquirers_exactly_one_wins(layout: RunLayout) -> None:
    ctx = mp.get_context("fork")
    n = 6
    start, done, results = ctx.Barrier(n), ctx.Barrier(n), ctx.Queue()
    procs = [
        ctx.Process(target=_race, args=(str(layout.root), a, start, done, results))
        for a in range(1, n + 1)
    ]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert all(p.exitcode == 0 for p in procs)
    winners = [a for a, r in outcomes if r == "won"]
    assert len(winners) == 1, outcomes
    assert read_lease(layout).attempt == winners[0]
