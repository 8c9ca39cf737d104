"""Stack evidence for hangs: which rank was stuck, and which were only waiting for it.

When one rank hangs, every peer soon blocks in a collective waiting for it, and every rank's
section times out within the same monitor tick: the timeouts alone cannot say who hung. Each
rank therefore arms ``faulthandler`` to dump all its Python stacks shortly before the timeout
of the section it is in; the main thread of a victim is inside ``torch.distributed``, the
culprit's is not. The dump is written by a C thread, so it works even while the main thread is
stuck in C code, and before the rank monitor SIGKILLs the rank.

Each beat also says which file the rank is blocked on, if a thread has been in a file syscall
since the beat before (``blocked_in``: syscall, path, since; resiliency/monitor/io_wait.py): the
main thread's, else the longest wait of another thread on a path (a save's writer threads): a
rank stuck on a hung mount is named with the path it waits for.

A stopped rank (SIGSTOP, a frozen node) dumps nothing: every thread stops, the dump thread too.
So each rank also keeps a liveness heartbeat: a thread stamps the file every ``BEAT_S`` with the
time and the longest stall it saw between two beats. A stopped rank's beats end (or, if it is
continued before it is killed, show one long stall) while its victims beat on until they are
killed: that tells the stopped rank apart even where every stack looks alike.

File layout: a fixed-size JSON header (what was armed, when), the heartbeat slot, then the dump.
"""

from __future__ import annotations

import faulthandler
import json
import linecache
import os
import re
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO

from resiliency.monitor.io_wait import blocked_in, threads

STACKS_DIR = "stacks"  # below <run_dir>/attempts
HEADER_BYTES = 2048
ARM_BYTES = 864  # the arm header; the heartbeat slot is the rest of HEADER_BYTES (a path fits)
BEAT_S = 0.5
DUMP_FRACTION = 0.9  # of the section timeout: dump before the monitor's SIGKILL
COLLECTIVE_MARKERS = ("torch/distributed/", "torch\\distributed\\")
# megatron-core waits on the work handle of a collective it started asynchronously (the
# tensor-parallel backward, DDP's grad reduce, pipeline p2p): ``handle.wait()`` is C++, so the
# innermost Python frame of a rank blocked there (or failing there) is megatron's own line.
_MEGATRON = ("megatron/core/", "megatron\\core\\")
_HANDLE_WAIT = re.compile(r"\.wait\(\s*\)")
_THREAD_RE = re.compile(r"^(?:Current thread|Thread) 0x([0-9a-f]+)", re.MULTILINE)
_FRAME_RE = re.compile(r'^\s+File "([^"]+)", line (\d+) in (\S+)', re.MULTILINE)


def waits_on_peers(frames: list[tuple[str, int]]) -> bool:
    """Whether a stack, innermost frame first, as (file, line), is inside a collective: a
    ``torch.distributed`` frame anywhere, or megatron-core's wait on an async collective's
    handle as the innermost frame."""
    if any(m in file for file, _ in frames for m in COLLECTIVE_MARKERS):
        return True
    if not frames or not any(m in frames[0][0] for m in _MEGATRON):
        return False
    return bool(_HANDLE_WAIT.search(linecache.getline(frames[0][0], frames[0][1])))


def stack_path(stacks_dir: Path, rank: int, pid: int) -> Path:
    return stacks_dir / f"rank-{rank:05d}.pid-{pid}.txt"


class StackWatchdog:
    """Per-rank dump file, re-armed at every section start; a dump in a section that then
    finished was a false alarm and is discarded at the next arm. Also the liveness heartbeat."""

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
        self.progress_at = time.time()  # the last section start or end: the rank's progress
        self._stop = threading.Event()
        self._write_beat(self.progress_at, 0.0, None)  # alive from the start, even if stopped now
        self._beater = threading.Thread(target=self._beat, name="stack-heartbeat", daemon=True)
        self._beater.start()

    def _beat(self) -> None:
        last, stall, stall_from = time.time(), 0.0, None
        pid, main = os.getpid(), threading.main_thread().native_id or 0
        seen: dict[int, dict[str, Any]] = {}  # thread -> the file syscall it is in, since
        while not self._stop.wait(BEAT_S):
            now = time.time()
            if now - last - BEAT_S > stall:
                stall, stall_from = now - last - BEAT_S, last
            last = now
            seen = _file_calls(pid, main, seen, now)
            try:
                self._write_beat(now, stall, stall_from, _longest_wait(seen, main, now))
            except (OSError, ValueError):
                return  # closed under us: the rank is exiting

    def _write_beat(
        self, now: float, stall: float, stall_from: float | None, blocked: dict | None = None
    ) -> None:
        beat = {
            "beat_at": round(now, 3),
            "stall_s": round(stall, 3),
            "stall_from": stall_from and round(stall_from, 3),
            "progress_at": round(self.progress_at, 3),
            **({"blocked_in": blocked} if blocked else {}),
        }
        os.pwrite(self.fd, _slot(beat, HEADER_BYTES - ARM_BYTES), ARM_BYTES)

    def arm(self, section: str, timeout_s: float | None, **context: Any) -> None:
        self.disarm()
        if os.lseek(self.fd, 0, os.SEEK_CUR) > HEADER_BYTES:
            os.ftruncate(self.fd, HEADER_BYTES)
            os.lseek(self.fd, HEADER_BYTES, os.SEEK_SET)
        self.context.update(context)
        self.progress_at = time.time()
        self.header = {
            **self.context,
            "section": section,
            "opened_at": self.progress_at,
            "timeout_s": timeout_s,
        }
        os.pwrite(self.fd, _slot(self.header, ARM_BYTES), 0)
        if timeout_s:
            faulthandler.dump_traceback_later(
                timeout_s * DUMP_FRACTION, repeat=False, file=self.file
            )

    def update(self, **context: Any) -> None:
        """Add context (e.g. the attempt, known only after setup opened) to the armed header."""
        self.context.update(context)
        if getattr(self, "header", None) is not None:
            self.header.update(context)
            os.pwrite(self.fd, _slot(self.header, ARM_BYTES), 0)

    def disarm(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        self.progress_at = time.time()

    def close(self, keep: bool = False) -> None:
        """Stop watching; keep the file if it holds a dump, or (``keep``) when the rank failed:
        its last beats are a peer's liveness evidence. A rank that lost its peer in a
        collective errors out cleanly; without its beats the stopped peer's silence had nothing
        to be measured against (the peer read as "kept beating")."""
        self.disarm()
        self._stop.set()
        self._beater.join(timeout=2 * BEAT_S)
        dumped = os.lseek(self.fd, 0, os.SEEK_END) > HEADER_BYTES
        self.file.close()
        if not dumped and not keep:
            self.path.unlink(missing_ok=True)


def _file_calls(
    pid: int, main: int, before: dict[int, dict[str, Any]], now: float
) -> dict[int, dict[str, Any]]:
    """Each thread's current file syscall, with since when (kept from ``before`` while it is the
    same call). The main thread's in any file; another thread's only in a path of the file
    system (a write pool's fsync of a shard), not a pipe or socket an idle helper waits on."""
    calls: dict[int, dict[str, Any]] = {}
    for tid in threads(pid):
        call = blocked_in(pid, tid)
        if call is None or (tid != main and not _on_a_file_system(call["path"])):
            continue
        was = before.get(tid)
        same = was is not None and all(was[k] == v for k, v in call.items())
        calls[tid] = was if same else {**call, "since": round(now - BEAT_S, 3)}  # type: ignore[assignment]
    return calls


def _longest_wait(calls: dict[int, dict[str, Any]], main: int, now: float) -> dict | None:
    """The main thread's wait, else the longest of the others; named once it lasted a beat (a
    read that returns at once is not a wait)."""
    # since is at most a beat before the first look: seen again a beat later, it lasted one
    lasting = {tid: c for tid, c in calls.items() if c["since"] <= now - 1.5 * BEAT_S}
    if main in lasting:
        return lasting[main]
    if not lasting:
        return None
    return min(lasting.values(), key=lambda c: c["since"])


def _on_a_file_system(path: str) -> bool:
    return path.startswith("/") and not path.startswith(("/dev/", "/proc/", "/sys/"))


def _slot(record: dict[str, Any], size: int) -> bytes:
    return json.dumps(record).encode()[: size - 1].ljust(size - 1) + b"\n"


def _read_slot(raw: bytes) -> Any:
    try:
        return json.loads(raw.decode(errors="replace").strip() or "null")
    except json.JSONDecodeError:
        return None


def read_stack_dump(path: Path) -> dict[str, Any] | None:
    """Header and last heartbeat plus, when a dump exists, its time and whether the main thread
    waited on peers."""
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    header = _read_slot(raw[:ARM_BYTES])
    if not isinstance(header, dict):
        return None
    beat = _read_slot(raw[ARM_BYTES:HEADER_BYTES])
    if isinstance(beat, dict):
        header = {**header, **beat}
    body = raw[HEADER_BYTES:].decode(errors="replace")
    if not body.strip():
        return {**header, "dumped": False}
    frames = _main_thread_frames(body, header.get("main_thread", ""))
    return {
        **header,
        "dumped": True,
        "dumped_at": path.stat().st_mtime,
        "in_collective": waits_on_peers([(f, int(line)) for f, line, _ in frames]),
        "top_frames": [f"{Path(f).name}:{line} {func}" for f, line, func in frames[:6]],
    }


def _main_thread_frames(body: str, main_thread: str) -> list[tuple[str, str, str]]:
    blocks = _THREAD_RE.split(body)
    # split() yields [preamble, id1, block1, id2, block2, ...]
    for ident, block in zip(blocks[1::2], blocks[2::2]):
        if ident.lstrip("0") == main_thread.lstrip("0"):
            return _FRAME_RE.findall(block)
    return []
