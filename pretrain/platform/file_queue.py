"""A FIFO of pickled items in a directory: megatron's write-results queue without a server.

megatron's checkpoint writers hand their results to the rank through a queue served by a
spawned multiprocessing Manager. That Manager costs ~0.9 s of every start on this machine and
outlives a SIGKILLed rank (compat fix J). This queue is a directory: ``put`` from any process
(the rank, its forked writers, a spawned writer: the queue pickles as its path), ``get`` in
the rank. Nothing runs in the background, so nothing can be orphaned; a killed rank leaves a
directory that the next queue on the machine removes.
"""

from __future__ import annotations

import os
import pickle
import queue
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from pretrain.platform.host import pid_alive, pid_namespace_inode

PREFIX = "mcore-recipes-results-"
SUFFIX = ".pkl"
POLL_S = 0.01


def _scratch_root() -> Path:
    """RAM-backed when the machine has /dev/shm: results are small and read back at once."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _owner(name: str) -> tuple[int, int] | None:
    """(pid namespace, pid) a queue dir's name records, None for a name not ours."""
    ns, _, rest = name[len(PREFIX) :].partition("-")
    pid = rest.split("-", 1)[0]
    return (int(ns), int(pid)) if ns.isdigit() and pid.isdigit() else None


def remove_stale(root: Path) -> None:
    """Directories of queues whose owning process is gone (SIGKILLed ranks). Only queues of
    this pid namespace are judged: /dev/shm may be shared with containers whose pids we cannot
    see (a pod's containers, hostIPC), and their live queues must not be swept."""
    here = pid_namespace_inode()
    for path in root.glob(f"{PREFIX}*"):
        owner = _owner(path.name)
        if owner is not None and owner[0] == here and not pid_alive(owner[1]):
            shutil.rmtree(path, ignore_errors=True)


class FileQueue:
    """The queue methods megatron's writers use (``put``, ``get``, ``get_nowait``, ``empty``)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    @classmethod
    def create(cls, root: Path | None = None) -> FileQueue:
        """A new queue owned by this process, in a fresh directory under ``root``."""
        root = root or _scratch_root()
        remove_stale(root)
        prefix = f"{PREFIX}{pid_namespace_inode()}-{os.getpid()}-"
        return cls(Path(tempfile.mkdtemp(prefix=prefix, dir=root)))

    def put(self, item: Any) -> None:
        # Names sort in put order (same clock on one machine); rename makes an item whole.
        name = f"{time.time_ns():020d}-{os.getpid()}-{uuid.uuid4().hex}"
        tmp = self.directory / f".{name}.tmp"
        tmp.write_bytes(pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL))
        tmp.rename(self.directory / f"{name}{SUFFIX}")

    def _oldest(self) -> Path | None:
        names = sorted(n for n in os.listdir(self.directory) if n.endswith(SUFFIX))
        return self.directory / names[0] if names else None

    def get_nowait(self) -> Any:
        path = self._oldest()
        if path is None:
            raise queue.Empty
        item = pickle.loads(path.read_bytes())
        path.unlink()
        return item

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return self.get_nowait()
            except queue.Empty:
                if not block or (deadline is not None and time.monotonic() >= deadline):
                    raise
                time.sleep(POLL_S)

    def empty(self) -> bool:
        return self._oldest() is None

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
