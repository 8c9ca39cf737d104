"""``python -m resiliency`` --help / ls / verify / gc / validate, run as real subprocesses
(``capacity``: test_capacity_cli.py). Exit codes: 0 ok, 1 bad checkpoint, 2 usage."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recipes import load_config, to_yaml
from resiliency.storage.attempts import write_attempt_record
from resiliency.storage.layout import RunLayout
from resiliency.storage.lease import RunLease
from resiliency.storage.publish import (
    begin_step,
    publish,
    update_latest,
    write_manifest_and_commit,
)
from resiliency.storage.synthetic import synthetic_manifest, write_payload, write_synthetic_step

REPO = Path(__file__).resolve().parents[3]
RUN = "run-cli-001"
SHARD = "model/__0_0.distcp"


def cli(*args: str | Path, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "resiliency", *map(str, args)],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def layout(tmp_path: Path) -> RunLayout:
    lo = RunLayout(tmp_path / "ckpt", RUN)
    for step in (100, 200, 300, 400):
        write_synthetic_step(lo, step, attempt=1)
    return lo


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[50] ^= 0x01
    path.write_bytes(bytes(data))


def test_help_lists_subcommands() -> None:
    """One unwrapped line per subcommand, where overrides are taken, the exit codes."""
    out = cli("--help")
    assert out.returncode == 0 and out.stderr == "", out.stderr  # no torch warnings either
    lines = out.stdout.splitlines()
    for name in ("ls", "verify", "gc", "validate", "capacity"):
        assert any(re.fullmatch(rf"  {name} +\S.{{20,}}", ln) for ln in lines), (name, lines)
    assert (
        "Hydra overrides (recipe=<name> key=value ...) are accepted by: validate, capacity."
        in lines
    )
    assert any(re.fullmatch(r"  plan +the old name of capacity", ln) for ln in lines), lines
    assert any(
        ln.startswith("exit codes: 0 ok; 1 a checkpoint failed verification; 2 usage")
        for ln in lines
    )
    assert "takes Hydra overrides" in cli("plan", "--help").stdout
    assert "takes Hydra overrides" in cli("validate", "--help").stdout
    assert "takes Hydra overrides" not in cli("gc", "--help").stdout


def rows(stdout: str) -> dict[str, str]:
    """Step table rows by dir name (rows whose first column is a step number)."""
    return {
        ln.split()[1]: ln
        for ln in stdout.splitlines()
        if ln.split()[:1] != [] and ln.split()[0].isdigit()
    }


def test_ls(layout: RunLayout) -> None:
    (layout.step_dir(400) / "COMMITTED").unlink()
    update_latest(layout, 300)
    begin_step(layout, 500, 2)
    out = cli("ls", layout.run_dir)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any("latest.json: step 300" in ln for ln in lines)
    row = rows(out.stdout)
    assert set(row) == {
        "step-000000100",
        "step-000000200",
        "step-000000300",
        "step-000000400",
        "step-000000500.tmp-attempt-02",
    }
    assert "yes" in row["step-000000300"] and row["step-000000300"].endswith("latest")
    assert " no " in row["step-000000400"] and "no COMMITTED" in row["step-000000400"]
    assert "tmp of attempt 02" in row["step-000000500.tmp-attempt-02"]
    assert "(no attempt records: the trainer never started on this run dir)" in lines


def test_ls_says_what_it_checked_and_verify_rehashes(layout: RunLayout) -> None:
    """A flipped byte keeps every size: plain ls must not call the step verified; --verify
    re-hashes, marks it BAD with the reason and exits 1."""
    flip_byte(layout.step_dir(300) / SHARD)
    quick = cli("ls", layout.run_dir)
    assert quick.returncode == 0 and "sizes and markers only" in quick.stdout
    assert "VERIFIED" not in quick.stdout
    row = next(ln for ln in quick.stdout.splitlines() if "step-000000300" in ln)
    assert "sizes ok" in row
    full = cli("ls", layout.run_dir, "--verify")
    assert full.returncode == 1, full.stdout
    table = rows(full.stdout)
    assert "BAD" in table["step-000000300"] and "crc32c mismatch" in table["step-000000300"]
    assert "crc ok" in table["step-000000400"]
    assert "verifying step-000000300 (2/4)" in full.stderr


def test_ls_missing_dir(tmp_path: Path) -> None:
    out = cli("ls", tmp_path / "nope")
    assert out.returncode == 2 and out.stdout == f"error: {tmp_path / 'nope'} does not exist\n"
    a_file = tmp_path / "file"
    a_file.write_text("")
    out = cli("ls", a_file)
    assert out.returncode == 2 and "not a directory" in out.stdout


def test_a_run_id_names_the_run_under_the_default_output_dir(tmp_path: Path) -> None:
    """`ls tiny` is `ls runs/tiny` where tiny is not a path (output_dir's default: runs);
    verify, gc, goodput and validate alike; an unknown id names both places tried, exit 2."""
    layout = RunLayout(tmp_path / "runs", RUN)
    for step in (100, 200):
        write_synthetic_step(layout, step, attempt=1)
    listed = cli("ls", RUN, cwd=tmp_path)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    assert f"run:         {layout.run_dir} (run_id {RUN})" in listed.stdout
    verified = cli("verify", RUN, cwd=tmp_path)
    assert verified.returncode == 0 and "all 2 step(s) verify" in verified.stdout, verified.stdout
    step = cli("verify", f"{RUN}/steps/step-000000100", cwd=tmp_path)
    assert step.returncode == 0 and step.stdout.startswith("OK"), step.stdout
    gc = cli("gc", RUN, "--dry-run", cwd=tmp_path)
    assert gc.returncode == 0 and "dry run: 0 dir(s)" in gc.stdout, gc.stdout
    goodput = cli("goodput", RUN, cwd=tmp_path)  # resolved: a run without attempts/ yet
    assert goodput.returncode == 2
    assert goodput.stdout == f"error: runs/{RUN} is not a run dir (no attempts/ in it)\n"
    for command in ("ls", "verify", "gc", "goodput", "validate"):
        unknown = cli(command, "no-such-run", cwd=tmp_path)
        assert unknown.returncode == 2, (command, unknown.stdout + unknown.stderr)
        assert unknown.stdout == (
            "error: no-such-run is neither a path nor a run id under output_dir runs/ (tried "
            f"{tmp_path / 'no-such-run'} and {tmp_path / 'runs' / 'no-such-run'})\n"
        ), command


def test_verify_ok_and_bad(layout: RunLayout) -> None:
    good = cli("verify", layout.step_dir(400))
    assert good.returncode == 0 and good.stdout.startswith("OK") and "full" in good.stdout
    flip_byte(layout.step_dir(400) / SHARD)
    quick = cli("verify", layout.step_dir(400), "--quick")
    assert quick.returncode == 0 and "quick" in quick.stdout
    bad = cli("verify", layout.step_dir(400))
    assert bad.returncode == 1 and bad.stdout.startswith("BAD") and "mismatch" in bad.stdout
    other = cli("verify", layout.step_dir(300), "--run-id", "another-run")
    assert other.returncode == 1 and "another run" in other.stdout
    missing = cli("verify", layout.step_dir(999))  # a wrong path is a usage error, not BAD
    assert missing.returncode == 2, missing.stdout
    assert missing.stdout == f"error: {layout.step_dir(999)} does not exist\n"


def test_gc_dry_run_then_apply(layout: RunLayout) -> None:
    dead_tmp = begin_step(layout, 500, 2)
    dry = cli("gc", layout.run_dir, "--dry-run", "--keep-last", "2")
    assert dry.returncode == 0, dry.stderr
    assert "would delete  step-000000100" in dry.stdout and "dry run: 3 dir(s)" in dry.stdout
    assert layout.published_steps() == [100, 200, 300, 400] and dead_tmp.exists()
    real = cli("gc", layout.run_dir, "--keep-last", "2", "--milestone-interval", "200")
    assert real.returncode == 0, real.stderr
    assert "deleted 2 dir(s)" in real.stdout
    assert layout.published_steps() == [200, 300, 400] and not dead_tmp.exists()


def test_gc_rejects_bad_keep_last(layout: RunLayout) -> None:
    out = cli("gc", layout.run_dir, "--keep-last", "1")
    assert out.returncode == 2 and "keep_last must be >= 2" in out.stdout
    assert layout.published_steps() == [100, 200, 300, 400]


def test_gc_refuses_live_run(layout: RunLayout) -> None:
    live_tmp = begin_step(layout, 500, 7)
    with RunLease(layout, attempt=7, timeout_s=60):
        out = cli("gc", layout.run_dir, "--keep-last", "2")
        assert out.returncode == 2 and "run is live" in out.stdout
        dry = cli("gc", layout.run_dir, "--keep-last", "2", "--dry-run")
        assert dry.returncode == 0 and "[live]" in dry.stdout
        assert "tmp dir of live attempt 7" in dry.stdout
    assert layout.published_steps() == [100, 200, 300, 400] and live_tmp.exists()


# --- ls: attempts ---------------------------------------------------------------------------

T0 = 1_700_000_000.0


def record_attempts(layout: RunLayout) -> None:
    """Records with the fields and values the checkpoint hook writes (hook.py)."""
    base = {"host": "node-a", "world_size": 2, "start_time": T0}
    write_attempt_record(
        layout,
        1,
        {
            **base,
            "status": "failed",
            "restored_step": None,
            "restored_tier": None,
            "step": 250,
            "end_time": T0 + 95,
            "exit_code": 1,
            "failure_class": "infrastructure",
            "error": "TimeoutError: all-reduce timed out after 600 s\nTraceback ...",
        },
    )
    # SIGKILLed mid-run: the record was never closed.
    write_attempt_record(
        layout, 2, {**base, "status": "running", "restored_step": 200, "host": "node-b"}
    )
    write_attempt_record(
        layout,
        3,
        {
            **base,
            "status": "finished",
            "world_size": 4,
            "restored_step": 300,
            "restored_tier": "local",
            "topology_changed": True,
            "step": 400,
            "end_time": T0 + 600,
            "exit_code": 0,
        },
    )
    write_attempt_record(layout, 4, {**base, "status": "starting", "start_time": time.time()})


def attempt_table(stdout: str) -> dict[str, list[str]]:
    """Attempt rows split into columns (columns are separated by two or more spaces)."""
    return {
        ln.split()[0]: re.split(r"\s{2,}", ln.strip())
        for ln in stdout.splitlines()
        if ln.startswith("attempt-")
    }


def test_ls_shows_attempts_with_status_failure_exit_and_restored_step(layout: RunLayout) -> None:
    record_attempts(layout)
    with RunLease(layout, attempt=4, timeout_s=60):
        out = cli("ls", layout.run_dir)
    assert out.returncode == 0, out.stderr
    assert f"attempts:    {layout.attempts_dir}/attempt-NN.json, oldest first" in out.stdout
    table = attempt_table(out.stdout)
    assert list(table) == ["attempt-01", "attempt-02", "attempt-03", "attempt-04"]
    # ATTEMPT STATUS EXIT FAILURE RESTORED LAST-STEP WORLD STARTED TOOK NOTE
    failed, died, finished, live = (table[f"attempt-0{i}"] for i in range(1, 5))
    assert failed[:7] == ["attempt-01", "failed", "1", "infrastructure", "fresh", "250", "2"]
    assert failed[8] == "95s"
    assert failed[9] == "TimeoutError: all-reduce timed out after 600 s; on node-a"
    assert died[:7] == ["attempt-02", "died", "-", "infrastructure?", "200", "-", "2"]
    assert "record still says 'running' and no live lease" in died[9] and "on node-b" in died[9]
    assert finished[:7] == ["attempt-03", "finished", "0", "-", "300 local", "400", "4"]
    assert finished[8:] == ["10m", "restored into a new layout"]
    assert live[:7] == ["attempt-04", "starting", "-", "-", "-", "-", "2"]
    assert live[-1] == "live: holds the lease"
    # The step table is unchanged by the attempts section.
    assert set(rows(out.stdout)) == {f"step-{s:09d}" for s in (100, 200, 300, 400)}


def test_ls_unreadable_attempt_record(layout: RunLayout) -> None:
    layout.attempts_dir.mkdir(parents=True)
    layout.attempt_path(1).write_text("{torn")
    out = cli("ls", layout.run_dir)
    assert out.returncode == 0, out.stderr
    assert attempt_table(out.stdout)["attempt-01"][1] == "unreadable"


# --- verify: step dir vs run dir vs wrong path ----------------------------------------------


def test_verify_run_dir_checks_every_published_step(layout: RunLayout) -> None:
    """The issue's `verify runs/<run>`: every published step, one line each, exit 1 if any
    is bad, never "not a step dir name"."""
    flip_byte(layout.step_dir(300) / SHARD)
    begin_step(layout, 500, 2)  # a tmp dir is never restored from: not verified
    out = cli("verify", layout.run_dir)
    assert out.returncode == 1, out.stdout
    lines = out.stdout.splitlines()
    assert lines[0] == (
        f"run {layout.run_dir}: verifying all 4 published step(s), newest first "
        "(full: every byte re-hashed)"
    )
    assert [ln[:18] for ln in lines[1:5]] == [
        "OK  step-000000400",
        "BAD step-000000300",
        "OK  step-000000200",
        "OK  step-000000100",
    ]
    assert "crc32c mismatch" in lines[2]
    assert lines[5] == (
        "BAD: 1 of 4 step(s) fail (step 300); newest verified: step 400 (a restore picks it)"
    )
    assert len(lines) == 6 and "not a step dir name" not in out.stdout
    same = cli("verify", layout.steps_dir)  # steps/ means its run
    assert same.returncode == 1 and same.stdout == out.stdout


def test_verify_run_dir_all_good_and_newest(layout: RunLayout) -> None:
    good = cli("verify", layout.run_dir, "--quick")
    assert good.returncode == 0, good.stdout
    assert good.stdout.splitlines()[-1] == (
        "OK: all 4 step(s) verify; newest verified: step 400 (a restore picks it)"
    )
    flip_byte(layout.step_dir(400) / SHARD)
    newest = cli("verify", layout.run_dir, "--newest")
    assert newest.returncode == 0, newest.stdout  # a step to restore from exists
    lines = newest.stdout.splitlines()
    assert [ln[:18] for ln in lines[1:3]] == ["BAD step-000000400", "OK  step-000000300"]
    assert lines[3:] == ["newest verified: step 300 (a restore picks it), 1 newer step(s) BAD"]


def test_a_copied_run_verifies_as_the_run_its_steps_record(layout: RunLayout) -> None:
    copy = layout.run_dir.parent / "copied"
    shutil.copytree(layout.run_dir, copy)
    whole = cli("verify", copy, "--quick")
    assert whole.returncode == 0, whole.stdout
    assert f"records run '{RUN}', its run dir is named 'copied'" in whole.stdout
    step = cli("verify", copy / "steps" / layout.step_dir(400).name, "--quick")
    assert step.returncode == 0 and step.stdout.splitlines()[-1].startswith("OK "), step.stdout
    demanded = cli("verify", copy / "steps" / layout.step_dir(400).name, "--run-id", "copied")
    assert demanded.returncode == 1 and "run" in demanded.stdout, demanded.stdout


def test_verify_run_dir_without_a_good_step(layout: RunLayout, tmp_path: Path) -> None:
    for step in layout.published_steps():
        (layout.step_dir(step) / "COMMITTED").unlink()
    out = cli("verify", layout.run_dir, "--newest")
    assert out.returncode == 1
    assert out.stdout.splitlines()[-1] == (
        "BAD: none of 4 published step(s) verifies; nothing to resume from"
    )
    empty = RunLayout(tmp_path / "ckpt", "empty-run")
    empty.attempts_dir.mkdir(parents=True)
    none = cli("verify", empty.run_dir)
    assert none.returncode == 1
    assert (
        none.stdout == f"BAD {empty.run_dir}: no published step to verify (nothing under steps/)\n"
    )


def test_verify_usage_errors_exit_2(layout: RunLayout) -> None:
    root = cli("verify", layout.root)  # output_dir instead of the run dir
    assert root.returncode == 2, root.stdout
    assert root.stdout == (
        f"error: {layout.root} is neither a step dir (step-NNNNNNNNN) nor a run dir "
        f"(no steps/, attempts/ or run.json inside); it holds run dir(s): {RUN}\n"
    )
    a_file = cli("verify", layout.step_dir(100) / "manifest.json")
    assert (
        a_file.returncode == 2
        and a_file.stdout.startswith("error: ")
        and "is a file" in a_file.stdout
    )
    flag = cli("verify", layout.run_dir, "--no-such-flag")
    assert flag.returncode == 2 and "unrecognized arguments" in flag.stderr


# --- gc: the run's recorded keep_last -------------------------------------------------------


def gc_dry(layout: RunLayout, *flags: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    out = cli("gc", layout.run_dir, "--dry-run", *flags)
    assert out.returncode == 0, out.stdout + out.stderr
    deleted = [
        ln.split()[2].rstrip(":") for ln in out.stdout.splitlines() if ln.startswith("would")
    ]
    return out, deleted


def test_gc_defaults_to_the_runs_config_yaml(layout: RunLayout) -> None:
    """config.yaml as the trainer writes it (to_yaml of the resolved config)."""
    run = load_config(["recipe=gpt_tiny", "checkpoint.keep_last=3"])
    (layout.run_dir / "config.yaml").write_text(to_yaml(run))
    (layout.run_dir / "launch-config.yaml").write_text("checkpoint:\n  keep_last: 2\n")
    out, deleted = gc_dry(layout)
    assert f"keep_last:   3 (checkpoint.keep_last in {layout.run_dir}/config.yaml)" in out.stdout
    assert (
        f"milestones:  none (checkpoint.milestone_interval in {layout.run_dir}/config.yaml)"
        in out.stdout
    )
    assert deleted == ["step-000000100"]
    flag, deleted = gc_dry(layout, "--keep-last", "2")
    assert "keep_last:   2 (--keep-last)" in flag.stdout
    assert deleted == ["step-000000100", "step-000000200"]


def test_gc_falls_back_to_launch_config_then_manifest_then_schema(layout: RunLayout) -> None:
    launch = layout.run_dir / "launch-config.yaml"
    launch.write_text("checkpoint:\n  keep_last: 2\n  milestone_interval: 200\n")
    out, deleted = gc_dry(layout)
    assert f"keep_last:   2 (checkpoint.keep_last in {launch})" in out.stdout
    assert f"milestones:  every 200 steps (checkpoint.milestone_interval in {launch})" in out.stdout
    assert deleted == ["step-000000100"]  # 200 is a milestone
    _, deleted = gc_dry(layout, "--milestone-interval", "0")
    assert deleted == ["step-000000100", "step-000000200"]
    launch.unlink()
    # The newest step's manifest records the config it was saved with.
    write_step_with_config(layout, 500, {"checkpoint": {"keep_last": 4}})
    out, deleted = gc_dry(layout)
    manifest = layout.step_dir(500) / "manifest.json"
    assert f"keep_last:   4 (checkpoint.keep_last in {manifest})" in out.stdout
    assert deleted == ["step-000000100"]


def test_gc_schema_default_says_so(layout: RunLayout) -> None:
    (layout.run_dir / "config.yaml").write_text("checkpoint: [unclosed\n")
    out, deleted = gc_dry(layout)
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("keep_last:"))
    assert line.startswith(
        "keep_last:   2 (schema default: the run records no checkpoint.keep_last; "
        f"skipped {layout.run_dir}/config.yaml unreadable"
    )
    assert deleted == ["step-000000100", "step-000000200"]


def test_gc_refuses_a_bad_recorded_keep_last(layout: RunLayout) -> None:
    (layout.run_dir / "config.yaml").write_text("checkpoint:\n  keep_last: 1\n")
    out = cli("gc", layout.run_dir)
    assert out.returncode == 2 and "error: keep_last must be >= 2" in out.stdout
    assert layout.published_steps() == [100, 200, 300, 400]


def write_step_with_config(layout: RunLayout, step: int, config: dict) -> None:
    tmp = begin_step(layout, step, 1)
    write_payload(tmp, step)
    manifest = dataclasses.replace(synthetic_manifest(layout, step, 1, tmp), config=config)
    write_manifest_and_commit(tmp, manifest)
    publish(layout, tmp, step)


# --- validate: bad checkpoint vs usage --------------------------------------------------------


def test_validate_exit_codes(layout: RunLayout, tmp_path: Path) -> None:
    missing = cli("validate", tmp_path / "nope")
    assert missing.returncode == 2, missing.stdout
    assert missing.stdout == f"error: {tmp_path / 'nope'} does not exist\n"
    for step in layout.published_steps():
        (layout.step_dir(step) / "COMMITTED").unlink()
    bad = cli("validate", layout.run_dir)
    assert bad.returncode == 1, bad.stdout
    assert bad.stdout.splitlines()[-1] == (
        f"BAD {layout.run_dir}: no published step verifies (the skipped lines say why)"
    )
