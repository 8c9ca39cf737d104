"""The soak with faults from outside (``python -m drill.soak --outside``): its schedule, how it
confirms a fault from the launcher's log and the OS, and one real soak whose trajectory this
test reads itself (not through the soak's code) against the clean run's."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from bench.s3_server import S3Server
from drill.soak.disk import can_mount
from drill.soak.outside import (
    OUTSIDE_KINDS,
    Injection,
    OutsideRun,
    confirm,
    flip_byte,
    judge_outside,
    losses,
    plan_outside,
)
from drill.soak.plan import PLANNED_SHARE, fit_plan
from resiliency.storage.object_store import ObjectStore
from resiliency.storage.remote import committed_remote_steps
from tests.helpers import REPO


def test_the_plan_is_the_seeds() -> None:
    one = plan_outside(random.Random(5), 9, 10.0, 2, OUTSIDE_KINDS)
    assert one == plan_outside(random.Random(5), 9, 10.0, 2, OUTSIDE_KINDS)
    assert {f.kind for f in one[:6]} == set(OUTSIDE_KINDS)  # a deck: every kind comes up
    assert all(0 <= f.where < 1 for f in one) and any(f.where for f in one if f.kind == "flip")
    outages = [f.outage_s for f in one if f.kind == "s3_outage"]
    assert outages and all(5.0 <= o <= 20.0 for o in outages)  # the documented range
    assert not any(f.outage_s for f in one if f.kind != "s3_outage")
    assert {f.rank for f in one} <= {0, 1} and all(f.gap_s > 0 for f in one)


def test_the_planned_faults_fit_the_run_and_one_at_least() -> None:
    drawn = plan_outside(random.Random(2), 40, 5.0, 2, OUTSIDE_KINDS)
    plan = fit_plan(drawn, 36.0, 5.0)
    assert plan == drawn[: len(plan)] and 1 <= len(plan) < len(drawn)
    assert sum(f.gap_s + 5.0 for f in plan) <= PLANNED_SHARE * 36.0
    assert sum(f.gap_s + 5.0 for f in drawn[: len(plan) + 1]) > PLANNED_SHARE * 36.0
    assert fit_plan(drawn, 0.1, 5.0) == drawn[:1]


def test_a_planned_fault_that_was_not_injected_fails_the_soak(tmp_path: Path) -> None:
    for name in ("clean", "soak"):
        (tmp_path / name / "metrics").mkdir(parents=True)
        (tmp_path / name / "metrics" / "steps.jsonl").write_text('{"step": 1, "loss": 2.5}\n')
    plan = plan_outside(random.Random(1), 2, 5.0, 2, ("sigkill",))
    run = OutsideRun(1, plan, skipped=["sigkill on rank 0: the job had ended"], exit_code=0)
    problems = judge_outside(run, tmp_path / "clean", tmp_path / "soak", 1)
    assert problems == ["a planned fault was not injected: sigkill on rank 0: the job had ended"]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


LOG = (
    "[2026-12-05 04:11:30,000] [INFO] starting\n"
    "[2026-12-05 04:11:31,085] [ERROR] failed (exitcode: -9) local_rank: 1 (pid: 77) of binary\n"
    "[2026-12-05 04:11:40,000] [INFO] [RankMonServer0@vm:0] Section 'step' has been open for "
    "9.1 seconds. Timeout is 4.0\n"
)


@pytest.mark.parametrize(
    "kind, rank, offset, confirmed",
    [
        ("sigkill", 1, 0, True),  # the launcher saw rank 1 die of SIGKILL after the fault
        ("sigkill", 0, 0, False),  # ... but not rank 0
        ("sigkill", 1, LOG.index("[2026-12-05 04:11:40"), False),  # not after the fault
        ("kill_writer", 1, 0, False),  # no restart of the group logged
        ("kill_writer", 1, -1, True),  # (LOG + a group restart, below)
        ("sigstop", 0, 0, True),  # rank 0's monitor timed out
    ],
)
def test_a_fault_is_confirmed_by_the_launchers_log(
    kind: str, rank: int, offset: int, confirmed: bool
) -> None:
    text = LOG + "[INFO] [default] Worker group UNHEALTHY. 5/6 attempts left\n" * (offset < 0)
    injection = Injection(kind, rank, _dead_pid(), 0.0, max(offset, 0))
    confirm(injection, text.encode())
    assert injection.confirmed is confirmed, injection.evidence


def test_a_live_target_is_not_confirmed() -> None:
    injection = Injection("sigkill", 1, os.getpid(), 0.0, 0)
    confirm(injection, LOG.encode())
    assert not injection.confirmed and "STILL ALIVE" in injection.evidence


def _published_step(run_dir: Path, step: int, payload: bytes) -> Path:
    step_dir = run_dir / "steps" / f"step-{step:09d}"
    (step_dir / "model").mkdir(parents=True)
    (step_dir / "model" / "__0_0.distcp").write_bytes(payload)
    (step_dir / "manifest.json").write_text("{}")
    (step_dir / "COMMITTED").write_text("x")
    return step_dir / "model" / "__0_0.distcp"


def test_a_flip_inverts_one_byte_of_the_newest_published_step(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    older = _published_step(run_dir, 4, bytes(range(200)))
    assert flip_byte(run_dir, 0.5) is None  # the only published step: never rotted
    newest = _published_step(run_dir, 8, bytes(range(100)))
    (run_dir / "steps" / "step-000000012.tmp-attempt-02").mkdir()  # not published: ignored
    path, at, value = flip_byte(run_dir, 0.5)
    assert (path, at, value) == (str(newest), 50, 50 ^ 0xFF)
    data = newest.read_bytes()
    assert (
        data[50] == 50 ^ 0xFF
        and data[:50] + data[51:] == bytes(range(100))[:50] + bytes(range(100))[51:]
    )
    assert older.read_bytes() == bytes(range(200))
    # Confirmed only when the launcher saw the kill AND the flipped byte is no longer
    # published at that path.
    flip = Injection("flip", 1, _dead_pid(), 0.0, 0, flipped=path, flipped_at=at, flipped_to=value)
    confirm(flip, LOG.encode())
    assert not flip.confirmed and "STILL PUBLISHED" in flip.evidence
    newest.write_bytes(bytes(range(100)))  # the step saved anew
    confirm(flip, LOG.encode())
    assert flip.confirmed, flip.evidence
    assert flip_byte(tmp_path / "empty", 0.5) is None


@pytest.mark.parametrize(
    "refused, remote, local, confirmed",
    [
        (12, 18, 18, True),  # refused while it lasted, and caught up by the end
        (0, 18, 18, False),  # nobody met it: no evidence it happened to the job
        (12, 15, 18, False),  # the object store never got the last step
        (12, None, None, False),  # nothing published or committed at all
    ],
)
def test_an_outage_is_confirmed_by_the_proxy_and_the_object_store(
    refused: int, remote: int | None, local: int | None, confirmed: bool
) -> None:
    outage = Injection("s3_outage", 0, _dead_pid(), 0.0, 0, outage_s=9.0, refused=refused)
    outage.remote_newest, outage.local_newest = remote, local
    confirm(outage, LOG.encode())
    assert outage.confirmed is confirmed, outage.evidence


FULL_LOG = "[2026-12-05 04:11:31,085] [ERROR] failed (exitcode: 10) local_rank: 0 (pid: 77) of x\n"


@pytest.mark.parametrize(
    "free, exit_code, log, confirmed",
    [
        (0, 10, FULL_LOG, True),  # full, the launch stopped with 10, a worker's 10 logged
        (5 << 20, 10, FULL_LOG, False),  # the fill left room: not a full disk
        (0, 1, FULL_LOG, False),  # the launch ended otherwise
        (0, 10, LOG, False),  # no worker's exit 10 in the launcher's log
    ],
)
def test_a_full_disk_is_confirmed_by_the_file_system_and_the_launch(
    free: int, exit_code: int, log: str, confirmed: bool
) -> None:
    fill = Injection("full_disk", 0, _dead_pid(), 0.0, 0, free_bytes=free, exit_code=exit_code)
    confirm(fill, log.encode())
    assert fill.confirmed is confirmed, fill.evidence


def test_a_kind_this_machine_cannot_inject_is_refused_before_any_run(
    tmp_path: Path, tiny_overrides: list[str]
) -> None:
    """Asked for by --kinds, an outage without an object store to cut is one line and exit 2,
    before any run starts."""
    out = tmp_path / "soak"
    base = [sys.executable, "-m", "drill.soak", "--outside", f"--out={out}", "--steps=8"]
    env = {k: v for k, v in os.environ.items() if k != "AWS_ENDPOINT_URL"}
    asked = subprocess.run(
        [*base, "--kinds=sigkill,s3_outage", *tiny_overrides],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert asked.returncode == 2, asked.stderr[-2000:]
    lines = [line for line in asked.stderr.splitlines() if line.startswith("soak: ")]
    assert lines == [
        "soak: --kinds s3_outage needs checkpoint.remote.url and an http:// AWS_ENDPOINT_URL (a "
        "local S3 server the soak can put behind its proxy): provide it or leave the kind out "
        "of --kinds"
    ], asked.stderr[-2000:]
    assert not (out / "logs").exists()  # no run started


def _own_losses(run_dir: Path) -> dict[int, str]:
    """This test's own reading: the last line per step, the loss as written (repr)."""
    found = {}
    for line in (run_dir / "metrics" / "steps.jsonl").read_text().splitlines():
        if line.strip().endswith("}"):
            record = json.loads(line)
            found[record["step"]] = repr(record["loss"])
    return found


# ~90 s of real runs: a clean run and a soak whose faults (a SIGKILL, a SIGSTOP, a checkpoint
# writer's SIGKILL and a rotted step, dealt from a shuffled deck) come from this process's seed.
@pytest.mark.slow
def test_an_outside_soak_loses_nothing(tmp_path: Path, tiny_overrides: list[str]) -> None:
    out = tmp_path / "soak"
    cmd = [
        sys.executable, "-m", "drill.soak", "--outside", f"--out={out}", "--steps=36",
        "--mtbf-steps=5", "--seed=11", "--kinds=sigkill,sigstop,kill_writer,flip",
        *tiny_overrides, "checkpoint.save_interval=4",
        "checkpoint.async_save=true", "resiliency.ft.timeout_floor_s=4",
        "resiliency.ft.learn_after_steps=3", "resiliency.ft.check_interval_s=0.5",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "soak (outside, seed 11)" in proc.stdout, proc.stdout
    report = json.loads((out / "soak.json").read_text())["outside"]
    injected = report["injected"]
    assert injected and all(i["confirmed"] for i in injected), injected
    assert len(injected) == len(report["plan"]) and not report["skipped"], report
    assert {"sigkill", "sigstop"} <= {i["kind"] for i in injected}, injected
    # The launcher's own lines, read here: every SIGKILL shows as that rank's -9 exit before
    # the next fault.
    launcher_log = (out / "logs" / "soak.log").read_bytes()
    ends = [i["log_offset"] for i in injected[1:]] + [len(launcher_log)]
    for kill, end in zip(injected, ends):
        if kill["kind"] == "flip":  # read here: the flipped byte is no longer published
            path = Path(kill["flipped"])
            assert not path.exists() or path.read_bytes()[kill["flipped_at"]] != kill["flipped_to"]
        if kill["kind"] == "sigstop":  # the stopped rank's own monitor timed it out
            after = launcher_log[kill["log_offset"] : end].decode(errors="replace")
            monitor = (
                rf"(?:RankMonServer\d+@[^\]]*?:{kill['rank']}\]|workload:\?\({kill['rank']}\))"
            )
            assert re.search(monitor + r".*?(?:has been open|Was out of section)", after), kill
            continue
        if kill["kind"] not in ("sigkill", "flip"):
            continue
        after = launcher_log[kill["log_offset"] : end].decode(errors="replace")
        assert re.search(rf"failed \(exitcode: -9\) local_rank: {kill['rank']}\b", after), kill
    clean, soak = (
        _own_losses(out / "runs" / "clean" / "soak"),
        _own_losses(out / "runs" / "soak" / "soak"),
    )
    assert sorted(soak) == sorted(clean) == list(range(1, 37))
    assert soak == clean
    assert losses(out / "runs" / "soak" / "soak") == {s: float(v) for s, v in soak.items()}


# ~70 s: a clean run, then a soak whose disk is filled and whose object store goes away, from
# outside, at moments drawn from the seed.
@pytest.mark.slow
def test_a_full_disk_and_an_object_store_outage_from_outside_lose_nothing(
    tmp_path: Path, tiny_overrides: list[str], s3: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The soak mounts a tmpfs for its run and puts the run's S3 endpoint behind its proxy.
    A fill must stop the job with exit 10 (a full disk is not retried) without crashing the
    launcher on its own writes; the soak deletes the filler and relaunches the same command.
    An outage (every request answered 503) must be ridden out by the uploader: the launcher's
    log shows it retrying, and at the end the object store holds the run's last step. The
    losses, read here, equal the clean run's at every step."""
    if not can_mount():
        pytest.skip("the soak mounts a tmpfs for the full disk: needs root with CAP_SYS_ADMIN")
    out, prefix = tmp_path / "soak", f"soak-{uuid.uuid4().hex[:8]}"
    cmd = [
        sys.executable, "-m", "drill.soak", "--outside", "--kinds=full_disk,s3_outage",
        f"--out={out}", "--steps=18", "--mtbf-steps=3", "--seed=9", *tiny_overrides,
        "checkpoint.save_interval=3", "checkpoint.async_save=true",
        f"checkpoint.remote.url={s3.url(prefix)}", "checkpoint.remote.follow_interval_s=1",
    ]  # fmt: skip
    env = {**os.environ, **s3.env, "AWS_ENDPOINT_URL": s3.endpoint_url}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    faults = json.loads((out / "soak.json").read_text())["outside"]["injected"]
    assert {f["kind"] for f in faults} == {"full_disk", "s3_outage"}, faults
    text = (out / "logs" / "soak.log").read_bytes()
    ends = [f["log_offset"] for f in faults[1:]] + [len(text)]
    for fault, end in zip(faults, ends):
        after = text[fault["log_offset"] : end].decode(errors="replace")
        if fault["kind"] == "s3_outage":  # the uploader met it and retried
            assert "object store:" in after and "retry" in after, after[-3000:]
            continue
        assert re.search(r"failed \(exitcode: 10\) local_rank: \d", after), after[-3000:]
        assert "launch local: stop 10 deterministic failure, not retried" in after, after[-3000:]
        assert f'File "{REPO / "launch"}/' not in after, "the launcher crashed"
    log = text.decode(errors="replace")
    fills = sum(f["kind"] == "full_disk" for f in faults)
    assert log.count("launch local: stop 0 finished") == 1
    assert len(re.findall(r"launch local: node \S+: healthy", log)) == fills + 1
    run_dir = out / "runs" / "soak"
    assert not os.path.ismount(run_dir) and (run_dir / "soak" / "metrics").is_dir()
    # Past the proxy, straight from the server: the run's last step is committed there.
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"):
        monkeypatch.setenv(key, s3.env[key])
    direct = ObjectStore(s3.url(f"{prefix}/soak"), s3.endpoint_url)
    assert committed_remote_steps(direct, "soak")[-1] == 18
    clean, soak = _own_losses(out / "runs" / "clean" / "soak"), _own_losses(run_dir / "soak")
    assert sorted(soak) == sorted(clean) == list(range(1, 19))
    assert soak == clean
