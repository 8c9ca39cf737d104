"""Publish / verify / select / retention / attempts on real files (no mocks)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from resiliency.storage.attempts import (
    AttemptConflictError,
    claim_attempt,
    ensure_run_record,
    next_attempt_id,
    write_attempt_record,
)
from resiliency.storage.checksum import FileEntry, bytes_checksum, describe_files, file_checksum
from resiliency.storage.layout import RunLayout, atomic_write_json, parse_step, parse_tmp
from resiliency.storage.manifest import (
    Manifest,
    ManifestError,
    manifest_checksum,
    merge_file_entries,
    read_manifest,
)
from resiliency.storage.publish import (
    PublishError,
    begin_step,
    publish,
    update_latest,
    write_manifest_and_commit,
)
from resiliency.storage.retention import apply_gc, plan_gc
from resiliency.storage.select import select_restore_step
from resiliency.storage.synthetic import synthetic_manifest, write_payload, write_synthetic_step
from resiliency.storage.verify import verify_step_dir
from tests.helpers import raw_commit, recommit_file

RUN = "run-test-001"
SHARD = "model/__0_0.distcp"
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def layout(tmp_path: Path) -> RunLayout:
    return RunLayout(tmp_path / "ckpt", RUN)


def make_steps(layout: RunLayout, steps: list[int], attempt: int = 1) -> list[Path]:
    return [write_synthetic_step(layout, s, attempt) for s in steps]


def flip_byte(path: Path, offset: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


# ---------------------------------------------------------------- layout / checksum / manifest


def test_layout_names(layout: RunLayout) -> None:
    assert layout.step_dir(100).name == "step-000000100"
    assert layout.tmp_dir(100, 3).name == "step-000000100.tmp-attempt-03"
    assert parse_step("step-000000100") == 100
    assert parse_step("step-100") is None and parse_step("step-000000100.tmp-attempt-03") is None
    assert parse_tmp("step-000000100.tmp-attempt-03") == (100, 3)
    with pytest.raises(ValueError):
        RunLayout(layout.root, "../escape")


def test_checksums_stream_and_match_in_memory(tmp_path: Path) -> None:
    data = os.urandom((8 << 20) + 12345)  # crosses the read buffer boundary
    path = tmp_path / "blob"
    path.write_bytes(data)
    for algo in ("crc32c", "sha256"):
        assert file_checksum(path, algo) == bytes_checksum(data, algo)
    with pytest.raises(ValueError):
        file_checksum(path, "md5")


def test_manifest_roundtrip_and_errors(layout: RunLayout) -> None:
    step_dir = make_steps(layout, [100])[0]
    m = read_manifest(step_dir)
    assert m.run_id == RUN and m.step == 100 and m.schema_version == 1
    assert all(f.algorithm == "crc32c" for f in m.files)
    assert Manifest.from_json(m.to_json()) == m
    with pytest.raises(ManifestError, match="not valid JSON"):
        Manifest.from_json("{nope")
    with pytest.raises(ManifestError, match="schema_version"):
        Manifest.from_json(json.dumps({**m.to_dict(), "schema_version": 2}))
    with pytest.raises(ValueError, match="disagree"):
        merge_file_entries([[FileEntry("a", 1, "x")], [FileEntry("a", 2, "y")]])


def test_sha256_entries_are_verified(layout: RunLayout) -> None:
    tmp = begin_step(layout, 100, 1)
    rels = write_payload(tmp, 100)
    m = synthetic_manifest(layout, 100, 1, tmp)
    m.files = describe_files(tmp, rels, algorithm="sha256")
    write_manifest_and_commit(tmp, m)
    final = publish(layout, tmp, 100)
    assert verify_step_dir(final, RUN).ok
    flip_byte(final / SHARD)
    assert "sha256 mismatch" in verify_step_dir(final, RUN).reason


# ---------------------------------------------------------------- publish


def test_publish_happy_path(layout: RunLayout) -> None:
    final = make_steps(layout, [100])[0]
    assert final == layout.step_dir(100) and not layout.tmp_dirs()
    latest = json.loads(layout.latest_path.read_text())
    assert latest == {"step": 100, "dir": "steps/step-000000100"}
    raw = (final / "manifest.json").read_bytes()
    assert (final / "COMMITTED").read_text().strip() == manifest_checksum(raw)
    verdict = verify_step_dir(final, RUN, full=True)
    assert verdict.ok and verdict.step == 100 and verdict.manifest is not None


def test_published_steps_are_immutable(layout: RunLayout) -> None:
    final = make_steps(layout, [100])[0]
    before = (final / SHARD).read_bytes()
    with pytest.raises(PublishError, match="immutable"):
        begin_step(layout, 100, 2)
    tmp = layout.tmp_dir(100, 2)
    tmp.mkdir()
    write_payload(tmp, 100, seed=7)
    write_manifest_and_commit(tmp, synthetic_manifest(layout, 100, 2, tmp))
    with pytest.raises(PublishError, match="immutable"):
        publish(layout, tmp, 100)
    assert (final / SHARD).read_bytes() == before


def test_publish_can_set_aside_an_invalid_dir(layout: RunLayout) -> None:
    final = make_steps(layout, [100])[0]
    (final / "COMMITTED").unlink()
    tmp = layout.tmp_dir(100, 2)
    tmp.mkdir()
    write_payload(tmp, 100, seed=7)
    write_manifest_and_commit(tmp, synthetic_manifest(layout, 100, 2, tmp))
    with pytest.raises(PublishError):
        publish(layout, tmp, 100)
    publish(layout, tmp, 100, replace_invalid=True)
    assert verify_step_dir(final, RUN).ok
    assert [
        p.name.startswith(".rejected-step-000000100") for p in layout.steps_dir.iterdir()
    ].count(True) == 1


def test_commit_refuses_incomplete_payload(layout: RunLayout) -> None:
    tmp = begin_step(layout, 100, 1)
    write_payload(tmp, 100)
    manifest = synthetic_manifest(layout, 100, 1, tmp)
    (tmp / SHARD).unlink()
    with pytest.raises(PublishError, match="missing"):
        write_manifest_and_commit(tmp, manifest)
    assert not (tmp / "COMMITTED").exists()
    with pytest.raises(PublishError, match="no COMMITTED"):
        publish(layout, tmp, 100)


# ---------------------------------------------------------------- select + corruption


def test_select_picks_newest_verified(layout: RunLayout) -> None:
    make_steps(layout, [100, 200, 300])
    sel = select_restore_step(layout, RUN, full_verify=True)
    assert (sel.step, sel.source, sel.skipped) == (300, "latest", [])
    assert sel.step_dir == layout.step_dir(300)


def test_select_empty_run(layout: RunLayout) -> None:
    sel = select_restore_step(layout, RUN, full_verify=True)
    assert (sel.step_dir, sel.step, sel.source) == (None, None, "none")


def _copy_from_other_run(layout: RunLayout, d: Path) -> None:
    other = RunLayout(layout.root, "some-other-run")
    src = write_synthetic_step(other, 300)
    shutil.rmtree(d)
    shutil.copytree(src, d)


def _forge_paths(bad_path: str) -> Callable[[RunLayout, Path], None]:
    def corrupt(layout: RunLayout, d: Path) -> None:
        m = read_manifest(d)
        m.files = m.files + [FileEntry(bad_path, 10, "00000000")]
        raw_commit(d, m)

    return corrupt


def _symlink_outside(layout: RunLayout, d: Path) -> None:
    outside = layout.root / "outside.bin"
    shutil.copyfile(d / SHARD, outside)
    (d / SHARD).unlink()
    (d / SHARD).symlink_to(outside)


def _dir_symlink_outside(layout: RunLayout, d: Path) -> None:
    outside = layout.root / "elsewhere"
    outside.mkdir()
    (outside / "rank-00000.pt").write_bytes(b"x")
    (d / "rank-state" / "more").symlink_to(outside, target_is_directory=True)


def _train_state_of_another_step(layout: RunLayout, d: Path) -> None:
    """train_state.json edited to step 120, manifest and COMMITTED recomputed to match."""
    (d / "train_state.json").write_text(json.dumps({"step": 120, "tokens": 0}))
    recommit_file(d, "train_state.json")


def _foreign_commit(layout: RunLayout, d: Path) -> None:
    shutil.copyfile(layout.step_dir(200) / "COMMITTED", d / "COMMITTED")


def _wrong_step(layout: RunLayout, d: Path) -> None:
    m = read_manifest(d)
    m.step = 250
    raw_commit(d, m)


CORRUPTIONS: dict[str, tuple[Callable[[RunLayout, Path], None], str]] = {
    "missing_committed": (lambda lo, d: (d / "COMMITTED").unlink(), "no COMMITTED"),
    "truncated_shard": (lambda lo, d: os.truncate(d / SHARD, 10), "has 10 bytes"),
    "flipped_byte": (lambda lo, d: flip_byte(d / SHARD), "crc32c mismatch"),
    "missing_manifest": (lambda lo, d: (d / "manifest.json").unlink(), "manifest.json is missing"),
    "garbage_manifest": (
        lambda lo, d: (d / "manifest.json").write_text("{garbage"),
        "another manifest",
    ),
    "garbage_manifest_recommitted": (
        lambda lo, d: (
            (d / "manifest.json").write_text("{garbage"),
            (d / "COMMITTED").write_text(manifest_checksum(b"{garbage")),
        ),
        "not valid JSON",
    ),
    "committed_from_other_manifest": (_foreign_commit, "another manifest"),
    "other_run": (_copy_from_other_run, "checkpoint from another run"),
    "wrong_step": (_wrong_step, "manifest step 250"),
    "traversal": (_forge_paths("../../etc/passwd"), "escapes the step dir"),
    "absolute": (_forge_paths("/etc/passwd"), "is absolute"),
    "symlink_outside": (_symlink_outside, "is a symlink"),
    "dir_symlink_outside": (_dir_symlink_outside, "'rank-state/more' is a symlink"),
    "symlink_inside": (
        lambda lo, d: (d / "rank-state" / "alias.pt").symlink_to(d / "train_state.json"),
        "is a symlink",
    ),
    "unlisted_empty_dir": (lambda lo, d: (d / "model" / "extra").mkdir(), "unlisted directory"),
    "fifo": (lambda lo, d: os.mkfifo(d / "rank-state" / "pipe"), "not a regular file"),
    "train_state_other_step": (_train_state_of_another_step, "train_state.json says step 120"),
    "missing_shard": (lambda lo, d: (d / SHARD).unlink(), "is missing"),
    "extra_shard": (lambda lo, d: (d / "model/__9_0.distcp").write_bytes(b"x" * 64), "unlisted"),
    "extra_rank_state": (
        lambda lo, d: (d / "rank-state/rank-00009.pt").write_bytes(b"x"),
        "unlisted",
    ),
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_corruption_rejected_and_previous_selected(layout: RunLayout, name: str) -> None:
    make_steps(layout, [100, 200, 300])
    corrupt, expected = CORRUPTIONS[name]
    corrupt(layout, layout.step_dir(300))
    verdict = verify_step_dir(layout.step_dir(300), RUN, full=True)
    assert not verdict.ok and expected in verdict.reason, verdict.reason
    sel = select_restore_step(layout, RUN, full_verify=True)
    assert sel.step == 200 and sel.source == "scan"
    assert ("step-000000300", verdict.reason) in sel.skipped
    assert any(n == "latest.json" and "step 300" in r for n, r in sel.skipped)


def test_quick_verify_misses_size_preserving_flip(layout: RunLayout) -> None:
    make_steps(layout, [100, 200])
    flip_byte(layout.step_dir(200) / SHARD)
    assert verify_step_dir(layout.step_dir(200), RUN, full=False).ok
    assert select_restore_step(layout, RUN, full_verify=False).step == 200
    assert select_restore_step(layout, RUN, full_verify=True).step == 100


@pytest.mark.parametrize(
    "content, reason",
    [
        ("not json at all", "not valid JSON"),
        ('{"dir": "steps/step-000000300"}', "no valid 'step'"),
        ("[1, 2]", "no valid 'step'"),
        ('{"step": 300, "dir": "../../elsewhere/step-000000300"}', "is not steps/"),
        ('{"step": 999, "dir": "steps/step-000000999"}', "does not exist"),
    ],
)
def test_bad_latest_falls_back_to_scan(layout: RunLayout, content: str, reason: str) -> None:
    make_steps(layout, [100, 200, 300])
    layout.latest_path.write_text(content)
    sel = select_restore_step(layout, RUN, full_verify=True)
    assert (sel.step, sel.source) == (300, "scan")
    assert [n for n, _ in sel.skipped] == ["latest.json"] and reason in sel.skipped[0][1]


def test_latest_behind_newest_verified(layout: RunLayout) -> None:
    make_steps(layout, [100, 200, 300])
    update_latest(layout, 100)  # as if the crash hit between the rename and latest.json
    sel = select_restore_step(layout, RUN, full_verify=True)
    assert (sel.step, sel.source) == (300, "scan")


def test_latest_valid_but_newer_steps_invalid(layout: RunLayout) -> None:
    make_steps(layout, [100, 200, 300])
    update_latest(layout, 200)
    (layout.step_dir(300) / "COMMITTED").unlink()
    sel = select_restore_step(layout, RUN, full_verify=True)
    assert (sel.step, sel.source) == (200, "latest")


def test_tmp_dirs_never_selected(layout: RunLayout) -> None:
    make_steps(layout, [100])
    committed_tmp = write_synthetic_step(layout, 200, attempt=2, do_publish=False)
    assert verify_step_dir(committed_tmp, RUN).ok  # complete, but never published
    begin_step(layout, 300, 2)
    sel = select_restore_step(layout, RUN, full_verify=True)
    assert sel.step == 100 and sel.skipped == []


# ---------------------------------------------------------------- retention


def _names(pairs: list[tuple[Path, str]]) -> set[str]:
    return {p.name for p, _ in pairs}


def test_gc_keep_last(layout: RunLayout) -> None:
    make_steps(layout, [100, 200, 300, 400, 500])
    plan = plan_gc(
        layout, RUN, keep_last=2, milestone_interval=None, protected=set(), live_attempt=None
    )
    assert _names(plan.delete_steps) == {"step-000000100", "step-000000200", "step-000000300"}
    apply_gc(plan)
    assert layout.published_steps() == [400, 500]
    assert not layout.trash_dirs()
    assert select_restore_step(layout, RUN, full_verify=True).step == 500


def test_gc_milestones_and_protected(layout: RunLayout) -> None:
    make_steps(layout, [100, 200, 300, 400, 500, 600])
    plan = plan_gc(
        layout, RUN, keep_last=2, milestone_interval=200, protected={100}, live_attempt=None
    )
    assert _names(plan.delete_steps) == {"step-000000300"}
    apply_gc(plan)
    assert layout.published_steps() == [100, 200, 400, 500, 600]


def test_gc_keep_last_counts_verified_only(layout: RunLayout) -> None:
    make_steps(layout, [100, 200, 300, 400])
    (layout.step_dir(300) / "COMMITTED").unlink()
    plan = plan_gc(
        layout, RUN, keep_last=2, milestone_interval=None, protected=set(), live_attempt=None
    )
    # 300 is invalid and older than newest verified (400): deletable; 200 is kept as 2nd verified.
    assert _names(plan.delete_steps) == {"step-000000100", "step-000000300"}


def test_gc_keeps_invalid_newer_than_newest_verified(layout: RunLayout) -> None:
    make_steps(layout, [100, 200, 300, 400])
    (layout.step_dir(400) / "COMMITTED").unlink()
    plan = plan_gc(
        layout, RUN, keep_last=2, milestone_interval=None, protected=set(), live_attempt=None
    )
    assert _names(plan.delete_steps) == {"step-000000100"}
    assert "step-000000400" in _names(plan.keep)


def test_gc_deletes_nothing_without_a_verified_step(layout: RunLayout) -> None:
    for d in make_steps(layout, [100, 200, 300]):
        (d / "COMMITTED").unlink()
    begin_step(layout, 400, 1)
    plan = plan_gc(
        layout, RUN, keep_last=2, milestone_interval=None, protected=set(), live_attempt=None
    )
    assert plan.deletions == []
    assert apply_gc(plan) == [] and layout.published_steps() == [100, 200, 300]


def test_gc_tmp_dirs_of_dead_attempts(layout: RunLayout) -> None:
    make_steps(layout, [100, 200])
    dead = begin_step(layout, 300, 1)
    live = begin_step(layout, 300, 2)
    (layout.steps_dir / ".trash-step-000000050-deadbeef").mkdir()
    plan = plan_gc(
        layout, RUN, keep_last=2, milestone_interval=None, protected=set(), live_attempt=2
    )
    assert _names(plan.delete_tmp) == {dead.name}
    assert live.name in _names(plan.keep)
    apply_gc(plan)
    assert not dead.exists() and live.exists() and not layout.trash_dirs()


def test_gc_rejects_keep_last_below_two(layout: RunLayout) -> None:
    with pytest.raises(ValueError, match="keep_last"):
        plan_gc(
            layout, RUN, keep_last=1, milestone_interval=None, protected=set(), live_attempt=None
        )


# ---------------------------------------------------------------- attempts


def test_next_attempt_id(layout: RunLayout) -> None:
    assert next_attempt_id(layout) == 1
    write_attempt_record(layout, 1, {"status": "failed"})
    write_attempt_record(layout, 2, {"status": "running"})
    assert next_attempt_id(layout) == 3
    layout.tmp_dir(100, 7).mkdir(parents=True)
    assert next_attempt_id(layout) == 8


def test_attempt_env_override(layout: RunLayout) -> None:
    code = (
        "import sys; from pathlib import Path; from resiliency.storage import RunLayout, "
        "next_attempt_id; print(next_attempt_id(RunLayout(Path(sys.argv[1]), sys.argv[2])))"
    )
    env = {**os.environ, "MCORE_RECIPES_ATTEMPT": "42"}
    out = subprocess.run(
        [sys.executable, "-c", code, str(layout.root), RUN],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "42"


def _write_record_in_child(root: str, attempt: int) -> None:
    write_attempt_record(RunLayout(Path(root), RUN), attempt, {"status": "running"})


def test_attempt_records_not_overwritten(layout: RunLayout) -> None:
    child = mp.get_context("fork").Process(
        target=_write_record_in_child, args=(str(layout.root), 3)
    )
    child.start()
    child.join()
    assert child.exitcode == 0
    before = layout.attempt_path(3).read_text()
    with pytest.raises(AttemptConflictError, match="another process"):
        write_attempt_record(layout, 3, {"status": "hijack"})
    assert layout.attempt_path(3).read_text() == before
    # Our own record may be updated.
    write_attempt_record(layout, 4, {"status": "running"})
    write_attempt_record(layout, 4, {"status": "done"})
    assert json.loads(layout.attempt_path(4).read_text())["status"] == "done"
    assert claim_attempt(layout, {"status": "running"}) == 5


def test_run_record_created_once(layout: RunLayout) -> None:
    first = ensure_run_record(layout, 1)
    again = ensure_run_record(layout, 2)
    assert first == again and again["first_attempt"] == 1 and again["run_id"] == RUN


def test_atomic_write_json_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "x.json"
    atomic_write_json(target, {"a": 1})
    atomic_write_json(target, {"a": 2})
    assert json.loads(target.read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]
