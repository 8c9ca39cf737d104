"""Stack evidence for hangs: which rank was stuck, and which were only waiting for it.

When one rank hangs, every peer soon blocks in a collective waiting for it, and every rank's
section times out within the same monitor tick: the timeouts alone cannot say who hung. Each
rank therefore arms ``faulthandler`` to dump all its Python stacks shortly before the timeout
of the section it is in; the main thread of a victim is inside ``torch.distributed``, the
culprit's is not. The dump is written by a C thread, so it works even while the main thread is
stuck in C code, and before the rank monitor SIGKILLs the rank.

File layout: a fixed-size JSON header (what was armed, when) followed by the dump, if any.
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO

STACKS_DIR = "stacks"  # below <run_dir>/attempts
HEADER_BYTES = 1024
DUMP_FRACTION = 0.9  # of the section timeout: dump before the monitor's SIGKILL
COLLECTIVE_MARKERS = ("torch/distributed/", "torch\\distributed\\")
_THREAD_RE = re.compile(r"^(?:Current thread|Thread) 0x([0-9a-f]+)", re.MULTILINE)
_FRAME_RE = re.compile(r'^\s+File "([^"]+)", line (\d+) in (\S+)', re.MULTILINE)


def stack_path(stacks_dir: Path, rank: int, pid: int) -> Path:
    return stacks_dir / f"rank-{rank:05d}.pid-{pid}.txt"


class StackWatchdog:
    """Per-rank dump file, re-armed at every section start; a dump in a section that then
    finished was a false alarm and is discarded at the next arm."""

    def __init__(self, path: Path, rank: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.rank = path, rank
        self.file: BinaryIO = open(path, "wb+")  # noqa: SIM115 - held open for faulthandler
        self.fd = self.file.fileno()
        os.ftruncate(self.fd, HEADER_BYTES)
        os.lseek(self.fd, HEADER_BYTES, os.SEEK_SET)
        self.context: dict[str, Any] = {
            "rank": rank,
            "pid": os.getpid(),
            "main_thread": f"{threading.main_thread().ident:016x}",
        }

    def arm(self, section: str, timeout_s: float | None, **context: Any) -> None:
        self.disarm()
        if os.lseek(self.fd, 0, os.SEEK_CUR) > HEADER_BYTES:
            os.ftruncate(self.fd, HEADER_BYTES)
            os.lseek(self.fd, HEADER_BYTES, os.SEEK_SET)
        self.context.update(context)
        header = {
            **self.context,
            "section": section,
            "opened_at": time.time(),
            "timeout_s": timeout_s,
        }
        os.pwrite(
            self.fd,
            json.dumps(header).encode()[: HEADER_BYTES - 1].ljust(HEADER_BYTES - 1) + b"\n",
            0,
        )
        if timeout_s:
            faulthandler.dump_traceback_later(
                timeout_s * DUMP_FRACTION, repeat=False, file=self.file
            )

    @staticmethod
    def disarm() -> None:
        faulthandler.cancel_dump_traceback_later()

    def close(self) -> None:
        """Stop watching; keep the file only if it holds a dump."""
        self.disarm()
        dumped = os.lseek(self.fd, 0, os.SEEK_END) > HEADER_BYTES
        self.file.close()
        if not dumped:
            self.path.unlink(missing_ok=True)


def read_stack_dump(path: Path) -> dict[str, Any] | None:
    """Header plus, when a dump exists, its time and whether the main thread waited on peers."""
    try:
        raw = path.read_bytes()
        header = json.loads(raw[:HEADER_BYTES].decode(errors="replace").strip() or "null")
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(header, dict):
        return None
    body = raw[HEADER_BYTES:].decode(errors="replace")
    if not body.strip():
        return {**header, "dumped": False}
    frames = _main_thread_frames(body, header.get("main_thread", ""))
    return {
        **header,
        "dumped": True,
        "dumped_at": path.stat().st_mtime,
        "in_collective": any(m in f for f, _, _ in frames for m in COLLECTIVE_MARKERS),
        "top_frames": [f"{Path(f).name}:{line} {func}" for f, line, func in frames[:6]],
    }


def _main_thread_frames(body: str, main_thread: str) -> list[tuple[str, str, str]]:
    blocks = _THREAD_RE.split(body)
    # split() yields [preamble, id1, block1, id2, block2, ...]
    for ident, block in zip(blocks[1::2], blocks[2::2]):
        if ident.lstrip("0") == main_thread.lstrip("0"):
            return _FRAME_RE.findall(block)
    return []
