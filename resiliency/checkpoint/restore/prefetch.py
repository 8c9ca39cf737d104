"""The newest published step's files read into the page cache while the process starts.

A restore waits for its shards after the imports, the process group and the model build;
the disk idles meanwhile. Started before torch is imported (pretrain's early-start entry
point), this reads this rank's share of the step the restore will most likely plan
(``latest.json``'s) into the page cache, on a daemon thread: the restore's own single pass
(streaming.py) then finds the bytes in memory and checks every one as before. The share is the
re-hash's (``balanced_share``): at the same layout each rank's own shard files, which its load
reads. Where the plan picks another step, or the layout changed, the only cost is disk
bandwidth spent in the background.

The kernel reads the bytes: ``posix_fadvise(WILLNEED)`` queues readahead into the page cache
without copying a byte to the process. One call reads at most max(read_ahead_kb,
max_sectors_kb) of the file's device (8 MiB on the VM measured here, 128 KiB by default), so
each file is advised 128 KiB at a time, as fast here as 8 MiB calls. For a rank's 0.75 GiB
share this VM spent 0.2 CPU-seconds, against 1.0-1.3 reading it through a buffer, CPU the two
ranks' imports needed on 2 cores (docs/benchmarks.md, P3). A file system that ignores the
advice costs nothing: the load then reads cold, as without the prefetch.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from resiliency.storage.layout import RunLayout
from resiliency.storage.manifest import ManifestError, read_manifest
from resiliency.storage.select import read_latest_hint
from resiliency.storage.verify import balanced_share

if TYPE_CHECKING:
    from recipes.config.run import RunConfig

log = logging.getLogger(__name__)
ADVICE_BYTES = 128 << 10  # per WILLNEED call: what one call reads on any block device
MEMORY_SHARE = 0.5  # of the host's available memory, for all of this host's ranks together


def start_prefetch(run: RunConfig, run_dir: Path, rank: int, world_size: int) -> None:
    """The early-start provider: a daemon thread prefetching this rank's share, if the run
    restores from its persistent tier at all."""
    cfg = run.checkpoint
    if not (cfg.enabled and cfg.resume and cfg.prefetch) or cfg.local.enabled:
        return  # with the node-local tier on, a newer local step may restore instead
    thread = threading.Thread(
        target=prefetch_share,
        args=(RunLayout(run_dir.parent, run.run_id), rank, world_size),
        name="checkpoint-prefetch",
        daemon=True,  # never holds up an exit
    )
    thread.start()


def prefetch_share(layout: RunLayout, rank: int, world_size: int) -> int:
    """Read this rank's share of the latest step into the page cache; the bytes read."""
    step, _ = read_latest_hint(layout)
    if step is None:
        return 0
    step_dir = layout.step_dir(step)
    try:
        files = read_manifest(step_dir).files
    except ManifestError:
        return 0  # the restore's planning says what is wrong with it
    share = balanced_share(files, rank, world_size)
    nbytes = sum(entry.bytes for entry in share)
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    available = _available_memory()
    if available is not None and nbytes * ranks_here > MEMORY_SHARE * available:
        log.info(
            "restore prefetch skipped: this host's share of step %d (%.2f GiB) exceeds half "
            "its available memory",
            step,
            nbytes * ranks_here / (1 << 30),
        )
        return 0
    started = time.perf_counter()
    for entry in sorted(share, key=lambda e: e.path):
        _advise(step_dir / entry.path)
    log.debug(
        "restore prefetch: %d files, %.2f GiB of step %d advised in %.2f s",
        len(share),
        nbytes / (1 << 30),
        step,
        time.perf_counter() - started,
    )
    return nbytes


def _advise(path: Path) -> None:
    """Ask the kernel to read the file into its page cache (asynchronously), in calls of
    ADVICE_BYTES: a larger one is cut short by the kernel."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # gone or unreadable: the restore's checks report it
    try:
        for offset in range(0, os.fstat(fd).st_size, ADVICE_BYTES):
            os.posix_fadvise(fd, offset, ADVICE_BYTES, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


def _available_memory() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None where the kernel does not say)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
