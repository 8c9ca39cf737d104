"""The launcher's output kept in the run dir (``launch-local.log``) by a child process, so that
keeping it can never stop the launcher: a hung mount blocks the child's write, not the pump
that passes the ranks' output on and reads the events a decision needs.

Lines go to the child through a non-blocking pipe. While the child is stuck they wait in a
bounded backlog, oldest dropped first (and counted in the log once it moves again); a child
that dies (a full disk) ends the keeping with one warning naming its error. At the end the
child gets a few seconds to finish and is otherwise left to finish when the storage answers.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)
BACKLOG_BYTES = 8 << 20  # lines held while the run dir does not answer
CLOSE_WAIT_S = 5.0
# Appends stdin to the file line by line; on an error, says it on stderr (one line) and exits.
_WRITER = (
    "import sys\n"
    "try:\n"
    "    with open(sys.argv[1], 'ab', buffering=0) as out:\n"
    "        for line in sys.stdin.buffer:\n"
    "            out.write(line)\n"
    "except OSError as exc:\n"
    "    sys.stderr.write(str(exc)); sys.exit(1)\n"
)


class KeptLog:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.child = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _WRITER, str(path)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True,  # a Ctrl-C at the terminal is the launcher's to answer
        )  # fmt: skip
        assert self.child.stdin is not None
        self.pipe = self.child.stdin.fileno()
        os.set_blocking(self.pipe, False)
        self.backlog: collections.deque[bytes] = collections.deque()
        self.held = self.dropped = 0
        self.open = True

    def write(self, line: str) -> None:
        if not self.open:
            return
        self._hold(line.encode(errors="replace"))
        self._flush()

    def close(self) -> None:
        """Hand over what is held and let the child finish, within CLOSE_WAIT_S in all."""
        if not self.open:
            return
        deadline = time.monotonic() + CLOSE_WAIT_S
        self._flush()
        while self.backlog and self.open and (left := deadline - time.monotonic()) > 0:
            select.select([], [self.pipe], [], left)  # writable again: the child moved
            self._flush()
        if not self.open:
            return  # the child died: already said
        self.open = False
        if self.backlog:
            log.warning("launch: %d lines not kept in %s: the run dir does not answer",
                        len(self.backlog) + self.dropped, self.path)  # fmt: skip
        try:
            self.child.stdin.close()  # type: ignore[union-attr]
        except OSError:
            pass
        try:
            self.child.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return  # it finishes (or not) when the storage answers; never waited for

    def _hold(self, data: bytes) -> None:
        self.backlog.append(data)
        self.held += len(data)
        while self.held > BACKLOG_BYTES:
            self.held -= len(self.backlog.popleft())
            self.dropped += 1

    def _flush(self) -> None:
        if self.dropped and self.backlog:
            note = f"[launch: {self.dropped} lines not kept here: the run dir did not answer]\n"
            self.backlog.appendleft(note.encode())
            self.held += len(self.backlog[0])
            self.dropped = 0
        while self.backlog:
            data = self.backlog[0]
            try:
                sent = os.write(self.pipe, data)
            except BlockingIOError:
                return  # the child is behind (a slow or hung mount): held for now
            except BrokenPipeError:
                self._child_gone()
                return
            self.held -= sent
            if sent < len(data):
                self.backlog[0] = data[sent:]
                return
            self.backlog.popleft()

    def _child_gone(self) -> None:
        self.open = False
        self.backlog.clear()
        self.child.wait()
        why = self.child.stderr.read().decode(errors="replace") if self.child.stderr else ""
        log.warning("launch: stopped keeping %s: %s", self.path, why.strip() or
                    f"its writer exited {self.child.returncode}")  # fmt: skip


def open_kept_log(path: Path) -> KeptLog | None:
    """A KeptLog of ``path``; None, with a warning, where no writer can be started."""
    try:
        return KeptLog(path)
    except OSError as exc:
        log.warning("launch: cannot keep %s: %s", path, exc)
        return None
