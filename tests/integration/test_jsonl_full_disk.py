"""A metrics line the disk cannot take whole is cut back off: no torn line for the next
record to land on (a real size-limited tmpfs, filled from outside the writer)."""

from __future__ import annotations

import errno
import json
import subprocess
from pathlib import Path

import pytest

from pretrain.context.run_dir import append_jsonl


@pytest.fixture
def tiny_disk(tmp_path: Path):  # noqa: ANN201 - yields a Path
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here (needs root): {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_line_that_does_not_fit_leaves_no_torn_line(tiny_disk: Path) -> None:
    path = tiny_disk / "steps.jsonl"
    append_jsonl(path, {"step": 1})
    kept = path.stat().st_size
    filler = tiny_disk / "filler"
    with filler.open("wb", buffering=0) as out:  # every free block: the file's slack is left
        try:
            while out.write(b"\0" * 4096):
                pass
        except OSError:
            pass
    with pytest.raises(OSError) as raised:
        append_jsonl(path, {"step": 2, "pad": "x" * 8192})  # more than the file's slack
    assert raised.value.errno == errno.ENOSPC
    assert path.stat().st_size == kept  # cut back to the last whole line
    filler.unlink()
    append_jsonl(path, {"step": 3})
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 3]
