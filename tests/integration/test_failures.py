"""Failure classes: each produces the right attempt record and retry decision; only
infrastructure failures are retried, within a budget; SIGTERM saves and asks for a requeue."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch.retry_policy import REQUEUE, STOP, decide
from pretrain.context import exit_codes
from pretrain.context.failures import NonFiniteError
from pretrain.train.fault_injection import InjectedFault
from resiliency.checkpoint.restore.topology import TopologyRefusedError
from resiliency.monitor.evidence import write_failure_file
from resiliency.monitor.metrics import METRICS_FILE
from resiliency.monitor.postmortem import LauncherEvents, failure_path, finalize_attempts
from resiliency.storage.layout import RunLayout, atomic_write_json
from tests.ft_helpers import (
    attempts,
    base_overrides,
    clean_run,
    env,
    launch_cmd,
    launch_local,
    wait_for_step,
)
from tests.helpers import REPO, losses
from tests.integration.test_metrics import parse, value

CASES = {  # exception raised by rank 1 -> (class, exit code, decision)
    "user_code": (InjectedFault("injected failure before step 3"), exit_codes.USER_CODE, STOP),
    "oom": (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), exit_codes.OOM, STOP),
    "data": (FileNotFoundError("corpus_text_document.bin"), exit_codes.DATA, STOP),
    "numeric": (NonFiniteError("step 3: loss nan"), exit_codes.NUMERIC, STOP),
    "topology": (
        TopologyRefusedError("tp 2 -> 3 cannot be resharded"),
        exit_codes.TOPOLOGY_REFUSED,
        STOP,
    ),
    "infrastructure": (
        # The rank's own network, not a peer's word that it left (that would make it a victim).
        RuntimeError("[gloo] connect to [10.0.0.2]:5110 failed: Network is unreachable (socket)"),
        exit_codes.INFRASTRUCTURE,
        REQUEUE,
    ),
}


def _raise(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:  # noqa: BLE001 - give it a traceback like a real failure
        return caught


def _failed_attempt(layout: RunLayout, start: float) -> None:
    # What rank 0 leaves behind when it fails as a victim: its own (wrong) root cause.
    layout.attempts_dir.mkdir(parents=True)
    atomic_write_json(
        layout.attempt_path(1),
        {
            "attempt": 1,
            "status": "failed",
            "exit_code": exit_codes.INFRASTRUCTURE,
            "failure_class": "infrastructure",
            "start_time": start,
            "world_size": 2,
            "ranks": [{"rank": 0, "host": "h", "pid": 100}, {"rank": 1, "host": "h", "pid": 101}],
        },
    )
    # Rank 0 gave up waiting in a collective *before* rank 1's own report hit the disk.
    failure_path(layout, 1, 0).parent.mkdir()
    atomic_write_json(
        failure_path(layout, 1, 0),
        {
            "rank": 0,
            "time": start + 4.5,
            "failure_class": "infrastructure",
            "exit_code": exit_codes.INFRASTRUCTURE,
            "cause": "lost peer",
            "in_collective": True,
            "message": "DistBackendError: [gloo] Connection closed by peer",
        },
    )


@pytest.mark.parametrize("kind", list(CASES))
def test_failure_class_record_and_decision(tmp_path: Path, kind: str) -> None:
    exc, code, action = CASES[kind]
    layout = RunLayout(tmp_path, "run")
    start = time.time() - 10
    _failed_attempt(layout, start)
    body = write_failure_file(failure_path(layout, 1, 1), 1, _raise(exc), step=3)
    body["time"] = start + 5.0
    atomic_write_json(failure_path(layout, 1, 1), body)

    finalize_attempts(layout, [1], LauncherEvents(), tokens_per_step=512)
    record = json.loads(layout.attempt_path(1).read_text())
    assert record["first_failing_rank"] == 1, record["evidence"]
    assert (record["failure_class"], record["exit_code"]) == (kind, code)
    assert record["exit_codes"] == {"0": exit_codes.INFRASTRUCTURE, "1": code}
    decision = decide(layout.run_dir, failures_used=0, max_requeues=2)
    assert decision.action == action
    assert decision.exit_code == (code if action == STOP else exit_codes.OK)


def test_killed_rank_is_first_although_its_peer_reported_earlier(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path, "run")
    start = time.time() - 10
    _failed_attempt(layout, start)
    events = LauncherEvents()
    events.feed(
        "[ERROR] failed (exitcode: -9) local_rank: 1 (pid: 101) of binary: python", start + 5.2
    )  # the launcher noticed after rank 0's collective already failed
    events.feed("[default] Worker group UNHEALTHY. 1/2 attempts left", start + 5.2)
    finalize_attempts(layout, [1], events, tokens_per_step=512)
    record = json.loads(layout.attempt_path(1).read_text())
    assert record["first_failing_rank"] == 1
    assert record["failure_cause"] == "killed by SIGKILL"
    assert record["exit_codes"] == {"0": exit_codes.INFRASTRUCTURE, "1": -9}
    assert (
        decide(layout.run_dir, failures_used=2, max_requeues=2).exit_code
        == exit_codes.RETRY_BUDGET_EXHAUSTED
    )


@pytest.mark.slow
def test_three_infrastructure_failures_exhaust_a_budget_of_two(
    tiny_overrides: list[str], tmp_path: Path
) -> None:
    overrides = [*base_overrides(tiny_overrides, tmp_path, "kills"), "train.fault=kill@1:1"]
    proc = launch_local([*overrides, "launch.standby=true"], max_restarts=2)  # fast restarts
    assert proc.returncode == exit_codes.RETRY_BUDGET_EXHAUSTED, proc.stderr[-6000:]
    records = attempts(tmp_path / "kills")
    assert len(records) == 3
    for record in records:
        assert record["failure_class"] == "infrastructure" and record["first_failing_rank"] == 1
        assert record["exit_codes"]["1"] == -9 and record["failure_cause"] == "killed by SIGKILL"
    assert records[0]["rto"]["spawn_s"] is not None
    assert "retry budget exhausted" in proc.stderr


@pytest.mark.slow
def test_user_code_failure_is_not_restarted(tiny_overrides: list[str], tmp_path: Path) -> None:
    proc = launch_local(
        [*base_overrides(tiny_overrides, tmp_path, "bug"), "train.fault=raise@3:1"], max_restarts=2
    )
    assert proc.returncode == exit_codes.USER_CODE, proc.stderr[-6000:]
    (record,) = attempts(tmp_path / "bug")  # ft_launcher was asked not to restart
    assert record["failure_class"] == "user_code" and record["first_failing_rank"] == 1
    assert record["exit_codes"]["1"] == exit_codes.USER_CODE
    assert record["last_step"] == 2


@pytest.mark.slow
def test_sigterm_saves_requeues_and_resumes_exactly(
    tiny_overrides: list[str], tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    clean = clean_run(tiny_overrides, tmp_path_factory.getbasetemp())
    overrides = base_overrides(tiny_overrides, tmp_path, "term")
    run_dir = tmp_path / "term"
    proc = subprocess.Popen(
        launch_cmd(overrides),
        cwd=REPO,
        env=env(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    wait_for_step(run_dir, 5, proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=180)
    assert proc.returncode == exit_codes.REQUEUE, stderr[-6000:]
    (first,) = attempts(run_dir)
    assert first["status"] == "preempted" and first["lost_steps"] == 0
    saved = first["step"]
    assert saved >= 5 and saved in RunLayout.from_run_dir(run_dir).published_steps()

    again = launch_local(overrides)
    assert again.returncode == 0, again.stderr[-6000:]
    second = attempts(run_dir)[1]
    assert second["restored_step"] == saved and second["recovered_from"]["lost_steps"] == 0
    assert losses(run_dir) == losses(clean)
    families = parse((run_dir / "metrics" / METRICS_FILE).read_text())
    assert value(families, "training_restarts", "training_restarts_total", run_id="term") == 1
    assert (
        value(
            families,
            "checkpoint_load_duration_seconds",
            "checkpoint_load_duration_seconds_count",
            run_id="term",
        )
        == 1
    )


@pytest.mark.parametrize("kind", ["NaN", "Inf"])
def test_megatron_nan_check_is_numeric(kind: str) -> None:
    """megatron DDP's own grad check raises before the loop's: the same class, exit 5."""
    from pretrain.context.failures import classify

    exc = RuntimeError(
        f"Rank 1: found {kind} in local grad norm for bucket #0 in backward pass before "
        "data-parallel communication collective"
    )
    failure = classify(exc)
    assert (failure.kind, failure.exit_code, failure.retryable) == (
        "numeric",
        exit_codes.NUMERIC,
        False,
    )


def test_a_real_out_of_memory_is_exit_8_in_one_line_and_not_retried(
    stdlib_corpus: str, tmp_path: Path
) -> None:
    """torch's CPU allocator refuses a 256 GiB embedding (ENOMEM, not "out of memory" as CUDA
    says): class oom, exit 8 as launch local's process status, one attempt, no traceback."""
    proc = subprocess.run(
        [sys.executable, "-m", "launch", "local", "recipe=gpt_tiny",
         f"data.paths=[{stdlib_corpus}]", f"output_dir={tmp_path}", "run_id=oom",
         "launch.nproc_per_node=1", "parallel.tp=1", "model.padded_vocab_size=1073741824"],
        cwd=REPO, text=True, capture_output=True, timeout=180,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == exit_codes.OOM, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert "can't allocate memory" in proc.stderr and "python -m pretrain --plan" in proc.stderr
    [record] = attempts(tmp_path / "oom")
    assert (record["failure_class"], record["exit_code"]) == ("oom", exit_codes.OOM)
