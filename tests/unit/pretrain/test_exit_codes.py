"""Every code docs/reference/exit-codes.md documents is a code of pretrain/context/exit_codes.py,
and each is asserted somewhere as the process status of a public command (a real run, not a
classification table): the tests named below, read here to hold the assertion."""

from __future__ import annotations

import ast
import re

from pretrain.context import exit_codes
from tests.helpers import REPO

DOC = REPO / "docs" / "reference" / "exit-codes.md"
ROW = re.compile(r"^\| (\d+) \| `([A-Z_]+)` \|", re.M)
# code -> (test file, function) whose process under test exits with it (a test, or the helper
# that runs the public command and asserts its status for several tests).
ASSERTED = {
    exit_codes.OK: (
        "test_warm_start.py",
        "test_a_source_that_cannot_be_used_is_refused_before_any_rank",
    ),
    exit_codes.INFRASTRUCTURE: (
        "test_remote_faults.py",
        "test_an_object_store_that_stays_out_is_exit_1",
    ),
    exit_codes.CONFIG_ERROR: (
        "test_corpus_check.py",
        "test_a_rebuilt_corpus_is_refused_unless_allowed",
    ),
    exit_codes.TOPOLOGY_REFUSED: ("test_cross_version.py", "test_019_checkpoint_is_refused_by_016"),
    exit_codes.USER_CODE: ("test_failures.py", "test_user_code_failure_is_not_restarted"),
    exit_codes.NUMERIC: ("test_guard.py", "_launch"),
    exit_codes.LEASE_HELD: (
        "test_fencing.py",
        "test_a_job_stopped_past_its_lease_writes_nothing_after_the_takeover",
    ),
    exit_codes.RETRY_BUDGET_EXHAUSTED: (
        "test_failures.py",
        "test_three_infrastructure_failures_exhaust_a_budget_of_two",
    ),
    exit_codes.OOM: (
        "test_failures.py",
        "test_a_real_out_of_memory_is_exit_8_in_one_line_and_not_retried",
    ),
    exit_codes.DATA: ("test_cli.py", "test_missing_data_prefix_names_the_nearest_dataset"),
    exit_codes.CHECKPOINT_IO: (
        "test_relaunch.py",
        "test_no_step_to_trust_stops_the_run_until_told_to_start_over",
    ),
    exit_codes.STRAGGLER: ("test_straggler.py", "test_slow_rank_is_named_within_two_intervals"),
    exit_codes.REMOTE_BEHIND: (
        "test_remote_faults.py",
        "test_a_final_upload_that_cannot_reach_the_store_is_exit_12",
    ),
    exit_codes.NODE_UNHEALTHY: (
        "test_faultfs.py",
        "test_a_hard_hung_mount_is_given_up_on_naming_the_stuck_ranks_and_recorded_later",
    ),
    exit_codes.REQUEUE: ("test_failures.py", "test_sigterm_saves_requeues_and_resumes_exactly"),
    exit_codes.INTERRUPTED: (
        "test_slurm.py",
        "test_sigint_saves_and_stops_the_job_without_a_requeue",
    ),
}


def test_the_documented_codes_are_the_codes() -> None:
    documented = {int(code): name for code, name in ROW.findall(DOC.read_text())}
    assert documented == {code: _name(code) for code in documented}
    assert set(documented) == set(ASSERTED), "each documented code needs a test below"


def test_each_code_is_asserted_as_a_process_status() -> None:
    for code, (module, function) in ASSERTED.items():
        tree = ast.parse((REPO / "tests" / "integration" / module).read_text())
        found = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function]
        assert found, f"{module}::{function} is gone (code {code})"
        body = ast.unparse(found[0])
        named = f"exit_codes.{_name(code)}" in body or re.search(rf"\b{code}\b", body)
        status = re.search(r"returncode|\.wait\(|ExitCode|_one_line_error|assert_refused", body)
        assert named and status, f"{module}::{function} does not assert exit {code}"


def _name(code: int) -> str:
    return next(k for k, v in vars(exit_codes).items() if k.isupper() and v == code)
