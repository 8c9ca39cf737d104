"""The restore's head start: this rank's share of the newest published step read into the
page cache by the kernel's readahead before torch is imported
(resiliency/checkpoint/restore/prefetch.py). Residency is read from outside the process that
prefetched, with util-linux's ``fincore``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from resiliency.checkpoint.restore import prefetch
from resiliency.storage.layout import RunLayout
from resiliency.storage.synthetic import write_random_step

RUN = "run-prefetch"


def _resident_bytes(path: Path) -> int:
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.strip())


def _evict(paths: list[Path], probe: Path) -> None:
    """Drop ``paths`` from the page cache, or skip where residency cannot be seen or dropped."""
    if shutil.which("fincore") is None:
        pytest.skip("util-linux fincore is not installed")
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # only clean pages can be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if _resident_bytes(probe) != 0:
        pytest.skip("this file system keeps files in memory (tmpfs): nothing to evict")


@pytest.fixture
def layout(tmp_path: Path) -> RunLayout:
    layout = RunLayout(tmp_path / "runs", RUN)
    for step in (2, 4):  # two ranks' shard files of 1 MiB each (whole pages)
        write_random_step(layout, step, files=2, size=1 << 20)
    return layout


def _wait_resident(path: Path) -> None:
    deadline = time.monotonic() + 10  # the kernel reads ahead asynchronously
    while _resident_bytes(path) < path.stat().st_size and time.monotonic() < deadline:
        time.sleep(0.05)


def _read_whole(path: Path) -> bool:
    """All of the file's pages resident, but for a few the kernel may drop.

    WILLNEED is advice: under memory pressure or a congested device (a loaded CI host)
    the kernel may skip a readahead window or evict a page again (CI once saw 8 pages of
    6144 missing). One advice call reads at most one window (128 KiB), so an eighth of
    the file missing at most still tells a whole-file read from a first-window one.
    """
    size = path.stat().st_size
    return _resident_bytes(path) >= size - size // 8


def _step_files(layout: RunLayout, step: int) -> list[Path]:
    return [p for p in layout.step_dir(step).rglob("*") if p.is_file()]


def test_the_newest_steps_own_shard_is_read_into_the_page_cache(layout: RunLayout) -> None:
    own, other = (layout.step_dir(4) / "model" / f"__{r}_0.distcp" for r in (1, 0))
    _evict(_step_files(layout, 2) + _step_files(layout, 4), probe=own)
    # Rank 1 of 2, in a process of its own, as a worker would (run dir from the config).
    code = (
        "import sys; from resiliency.checkpoint.restore.prefetch import prefetch_share; "
        "from resiliency.storage.layout import RunLayout; "
        f"print(prefetch_share(RunLayout({str(layout.root)!r}, {RUN!r}), 1, 2))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(done.stdout) >= own.stat().st_size
    _wait_resident(own)
    assert _read_whole(own)  # the whole file, not its first readahead window
    assert _resident_bytes(other) == 0  # rank 0's shard: rank 0 reads it
    assert all(_resident_bytes(p) == 0 for p in _step_files(layout, 2))  # not the newest


def test_no_published_step_or_an_unreadable_manifest_reads_nothing(layout: RunLayout) -> None:
    empty = RunLayout(layout.root, "never-saved")
    assert prefetch.prefetch_share(empty, 0, 1) == 0
    (layout.step_dir(4) / "manifest.json").write_text("{not json")
    assert prefetch.prefetch_share(layout, 0, 2) == 0


def test_a_share_larger_than_half_the_available_memory_is_not_read(
    layout: RunLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    share = prefetch.prefetch_share(layout, 0, 2)
    assert share > 0
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(prefetch, "_available_memory", lambda: 4 * share - 1)  # 2 ranks here
    assert prefetch.prefetch_share(layout, 0, 2) == 0
    monkeypatch.setattr(prefetch, "_available_memory", lambda: 4 * share)
    assert prefetch.prefetch_share(layout, 0, 2) == share


def test_a_shard_longer_than_one_readahead_is_read_whole(tmp_path: Path) -> None:
    """A device's readahead caps what one WILLNEED call reads (128 KiB by default)."""
    layout = RunLayout(tmp_path / "runs", RUN)
    write_random_step(layout, 2, files=1, size=24 << 20)
    (shard,) = [p for p in _step_files(layout, 2) if p.suffix == ".distcp"]
    _evict([shard], probe=shard)
    assert prefetch.prefetch_share(layout, 0, 1) >= shard.stat().st_size
    _wait_resident(shard)
    assert _read_whole(shard)
