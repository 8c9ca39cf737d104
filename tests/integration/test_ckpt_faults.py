"""Broken checkpoints on disk are rejected with a logged reason; a full disk fails a save."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from pretrain.context import exit_codes
from resiliency.storage.checksum import FileEntry
from resiliency.storage.layout import RunLayout
from resiliency.storage.manifest import manifest_checksum, read_manifest
from resiliency.storage.verify import verify_step_dir
from tests.helpers import losses, read_steps, recommit_file, run_pretrain

pytestmark = pytest.mark.slow
STEPS = 10


def _rewrite_manifest(step_dir: Path, edit) -> None:  # noqa: ANN001 - Callable[[Manifest], None]
    """Edit a manifest and re-seal COMMITTED, so only the edited field is wrong."""
    manifest = read_manifest(step_dir)
    edit(manifest)
    raw = manifest.to_json().encode()
    (step_dir / "manifest.json").write_bytes(raw)
    (step_dir / "COMMITTED").write_text(manifest_checksum(raw) + "\n")


def _shards(step_dir: Path) -> list[Path]:
    return sorted((step_dir / "model").glob("*.distcp"))


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    10: ("missing COMMITTED", lambda d: (d / "COMMITTED").unlink(), "no COMMITTED marker"),
    9: (
        "truncated shard",
        lambda d: _shards(d)[0].write_bytes(_shards(d)[0].read_bytes()[:-100]),
        "bytes, manifest says",
    ),
    8: ("flipped byte", lambda d: _flip_byte(_shards(d)[0]), "crc32c mismatch"),
    7: ("missing manifest", lambda d: (d / "manifest.json").unlink(), "manifest"),
    6: (
        "manifest from another run",
        lambda d: _rewrite_manifest(d, lambda m: setattr(m, "run_id", "someone-else")),
        "checkpoint from another run",
    ),
    5: (
        "path traversal",
        lambda d: _rewrite_manifest(
            d, lambda m: m.files.append(FileEntry("../../../../etc/hostname", 1, "0", "crc32c"))
        ),
        "escapes the step dir",
    ),
    4: ("missing shard", lambda d: _shards(d)[-1].unlink(), "is missing"),
}


@pytest.fixture(scope="module")
def saved_every_step(
    tmp_path_factory: pytest.TempPathFactory, tiny_overrides: list[str]
) -> tuple[Path, list[str], list[float]]:
    root = tmp_path_factory.mktemp("corrupt")
    overrides = [
        *tiny_overrides,
        f"output_dir={root}",
        "run_id=run",
        f"train.train_steps={STEPS}",
        "checkpoint.save_interval=1",
        f"checkpoint.keep_last={STEPS}",
        "checkpoint.fingerprint=true",
    ]
    run_pretrain(2, overrides)
    return root, overrides, losses(root / "run")


def test_every_corruption_is_rejected_and_the_newest_good_step_used(
    saved_every_step: tuple[Path, list[str], list[float]],
) -> None:
    root, overrides, baseline = saved_every_step
    layout = RunLayout(root, "run")
    assert layout.published_steps() == list(range(1, STEPS + 1))
    for step, (_, corrupt, _) in CORRUPTIONS.items():
        corrupt(layout.step_dir(step))
    layout.latest_path.write_text("{not json")
    leftover = layout.steps_dir / "step-000000011.tmp-attempt-99"
    shutil.copytree(layout.step_dir(3), leftover)
    for step, (name, _, _) in CORRUPTIONS.items():
        assert not verify_step_dir(layout.step_dir(step), "run").ok, name

    proc = run_pretrain(2, overrides)

    for step, (name, _, reason) in CORRUPTIONS.items():
        lines = [line for line in proc.stderr.splitlines() if f"skipped step-{step:09d}" in line]
        assert lines and reason in lines[0], (name, lines)
    assert "latest.json" in proc.stderr and "restore: skipped latest.json" in proc.stderr
    assert "resumed from step-000000003 at step 3" in proc.stderr
    assert "restore: state fingerprint matches the save" in proc.stderr
    # Step 8 passes the quick pick; its re-hash (while the model is built) rejects it.
    assert "restore: step 8 failed its re-hash" in proc.stderr
    assert "step-000000011" not in proc.stderr.split("resumed from")[0]
    assert losses(root / "run") == baseline, "steps 4..10 re-done from step 3 must match"
    assert verify_step_dir(layout.step_dir(STEPS), "run").ok
    assert not leftover.exists(), "a dead attempt's tmp dir is collected after the next commit"


def _middle_of_largest_item(model_dir: Path, fqn_part: str) -> tuple[Path, int]:
    """The shard file and byte offset in the middle of the largest saved item whose name holds
    ``fqn_part`` (from the checkpoint's own DCP index: inside tensor data, not framing)."""
    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(str(model_dir)).read_metadata().storage_data
    index, info = max(
        ((k, v) for k, v in storage.items() if fqn_part in k.fqn), key=lambda kv: kv[1].length
    )
    return model_dir / info.relative_path, info.offset + info.length // 2


def test_a_resealed_shard_loads_but_its_state_is_refused(
    saved_every_step: tuple[Path, list[str], list[float]],
) -> None:
    """A shard edited from outside and re-sealed with correct checksums passes every file
    check; the fingerprint of the restored tensors still tells, and the run refuses (exit 10)."""
    root, overrides, _ = saved_every_step
    step_dir = RunLayout(root, "run").step_dir(STEPS)
    shard, offset = _middle_of_largest_item(step_dir / "model", "exp_avg_sq")
    data = bytearray(shard.read_bytes())
    data[offset] ^= 0x40  # one bit of one float in the middle of an Adam moment
    shard.write_bytes(bytes(data))
    recommit_file(step_dir, shard.relative_to(step_dir).as_posix())
    assert verify_step_dir(step_dir, "run").ok, "re-sealed: the files verify"

    proc = run_pretrain(2, overrides, check=False)

    assert proc.returncode != 0, proc.stderr[-3000:]  # torchrun's own code: 1
    assert f"exit {exit_codes.CHECKPOINT_IO}, do not retry" in proc.stderr
    assert "restored state differs from the saved one in 1 of" in proc.stderr
    assert "exp_avg_sq: " in proc.stderr  # the tensor is named


@pytest.fixture()
def small_disk(tmp_path: Path):  # noqa: ANN201 - yields a Path
    mount = tmp_path / "disk"
    mount.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=11m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here (needs root): {proc.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_full_disk_fails_the_save_cleanly(
    small_disk: Path, tiny_overrides: list[str], tmp_path: Path, mode: str
) -> None:
    # Each save is ~4.2 MiB: steps 3 and 6 fit in 11 MiB, step 9 does not. Async: the spawned
    # writer hits ENOSPC and the rank learns of it when it finalizes the save.
    overrides = [
        *tiny_overrides,
        f"output_dir={small_disk}",
        "run_id=run",
        f"data.cache_dir={tmp_path / 'cache'}",
        f"train.train_steps={STEPS}",
        "checkpoint.save_interval=3",
        f"checkpoint.async_save={mode == 'async'}",
    ]
    proc = run_pretrain(2, overrides, check=False)
    assert proc.returncode != 0
    assert "The disk is (nearly) full" in proc.stderr, proc.stderr[-3000:]
    assert f"(checkpoint, exit {exit_codes.CHECKPOINT_IO}, do not retry)" in proc.stderr
    layout = RunLayout(small_disk, "run")
    assert layout.published_steps() == [3, 6]
    assert layout.tmp_dirs() == [], "the failed save's tmp dir is removed"
    assert all(verify_step_dir(layout.step_dir(s), "run").ok for s in (3, 6))
    record = json.loads(sorted(layout.attempts_dir.glob("*.json"))[-1].read_text())
    assert record["status"] == "failed" and record["failure_class"] == "checkpoint"
    # Async: the failure surfaces at step 10, whose own metrics line may be the write the
    # full disk refuses (cut back off whole: no torn line in steps.jsonl).
    assert max(read_steps(small_disk / "run")) in ((9,) if mode == "sync" else (9, 10))


def test_killed_writer_process_fails_the_run_and_keeps_earlier_steps(
    tiny_overrides: list[str], tmp_path: Path
) -> None:
    """Rank 1's async writer is SIGKILLed while it holds step 6: the rank says so and the run
    stops (no hang on the peers); step 3 stays published and verified, step 6 never appears."""
    overrides = [
        *tiny_overrides,
        f"output_dir={tmp_path}",
        "run_id=run",
        f"train.train_steps={STEPS}",
        "checkpoint.save_interval=3",
        "checkpoint.async_save=true",
        "train.fault=kill_writer@6:1",
    ]
    proc = run_pretrain(2, overrides, check=False, timeout=180)
    assert proc.returncode != 0
    assert "checkpoint writer process exited with code -9" in proc.stderr, proc.stderr[-3000:]
    layout = RunLayout(tmp_path, "run")
    assert layout.published_steps() == [3]
    assert verify_step_dir(layout.step_dir(3), "run").ok
