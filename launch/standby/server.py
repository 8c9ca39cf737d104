"""``python -m launch.standby.server RUN_DIR``: one per node, started by the launchers before
the workers; imports torch, megatron-core and the trainer once, then forks a worker for every
standby worker (:mod:`launch.standby.worker`) that asks, the way ``multiprocessing``'s
forkserver with preloaded modules does.

Fork-safe by construction, and checked before it serves: one thread (the OpenMP and BLAS
pools start only where the launcher's ``OMP_NUM_THREADS`` lets them, and the standby refuses
workers whose environment differs in such a variable), no CUDA context, no process group, no
open run files. The loop is single-threaded (``select`` over the listening socket, each
worker's connection and a SIGCHLD wake-up pipe), so a fork never copies a lock held by another
thread. Each worker it forks dies with it (``PR_SET_PDEATHSIG``) and is SIGKILLed when its
standby worker goes away, so no worker outlives the process its launcher watches.

Each reaped worker is appended to ``attempts/standby/<host>.jsonl`` with the host clock of its
death (the recovery ledger's fault moment: :mod:`resiliency.monitor.recovery`).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import logging
import os
import select
import signal
import socket
import struct
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from launch.standby import protocol
from pretrain.context.worker_exits import record_exit

log = logging.getLogger("launch.standby")
# What a worker imports on its way to the first step (measured: 4.2 s of a 5.9 s start here).
PRELOAD = (
    "torch",
    "torch.distributed",
    "pretrain.__main__",
    "pretrain.train.session",
    "resiliency.hooks",
    "megatron.core.dist_checkpointing",
    "megatron.core.optimizer",
)
PR_SET_PDEATHSIG = 1
WORKER_MODULE = "pretrain"
REQUEST_TIMEOUT_S = 10.0


def preload(modules: tuple[str, ...] = PRELOAD) -> float:
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the libraries' fallback notices: the worker's to log
        for name in modules:
            importlib.import_module(name)
    return time.perf_counter() - started


def fork_hazards() -> list[str]:
    """What would make a fork of this process unlike a fresh start ([] when none)."""
    hazards = []
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        hazards.append(f"{threads} threads (set OMP_NUM_THREADS/OPENBLAS_NUM_THREADS=1)")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        hazards.append("a CUDA context")
    if (
        torch is not None
        and torch.distributed.is_available()
        and torch.distributed.is_initialized()
    ):
        hazards.append("a process group")
    return hazards


class Server:
    def __init__(self, run_dir: Path, listener: socket.socket) -> None:
        self.listener = listener
        self.run_dir = run_dir
        self.workers: dict[socket.socket, int] = {}  # connection -> its worker's pid
        self.lines: dict[socket.socket, protocol.Lines] = {}
        self.hazards: list[str] = []
        self.stopping = False
        self.wake_r, self.wake_w = socket.socketpair()
        self.pid = os.getpid()

    def serve(self) -> None:
        self.wake_w.setblocking(False)
        signal.set_wakeup_fd(self.wake_w.fileno())
        signal.signal(signal.SIGCHLD, lambda *_: None)  # only wakes the loop (wake-up fd)
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        while not self.stopping or self.workers:
            sources = [self.wake_r, *self.workers] + ([] if self.stopping else [self.listener])
            ready, _, _ = select.select(sources, [], [], 5.0)
            for source in ready:
                if source is self.listener and not self.stopping:
                    self._accept()
                elif source is self.wake_r:
                    self.wake_r.recv(4096)
                elif source in self.workers:
                    self._from_worker(source)
            self._reap()

    def _stop(self, signum: int, _frame: object) -> None:
        self.stopping = True
        self.listener.close()  # new workers start plainly; the loop waits for its own
        for pid in self.workers.values():
            _kill(pid, signal.SIGTERM)

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        # A standby worker sends its request at once; one that does not must not stall the
        # loop every other worker waits on.
        conn.settimeout(REQUEST_TIMEOUT_S)
        try:
            request, fds = protocol.receive_request(conn)
            conn.settimeout(None)
        except (OSError, ValueError) as exc:
            log.warning("standby: bad request: %s", exc)
            conn.close()
            return
        refused = self._refusal(request, conn)
        if refused:
            for fd in fds:
                os.close(fd)
            protocol.send_message(conn, {"refused": refused})
            conn.close()
            return
        try:
            pid = os.fork()
        except OSError as exc:  # out of processes or memory: this worker starts plainly
            pid = -1
            refused = f"fork failed: {exc}"
        if pid == 0:
            self._become_worker(conn, request, fds)  # never returns
        for fd in fds:
            os.close(fd)
        if pid < 0:
            protocol.send_message(conn, {"refused": refused})
            conn.close()
            return
        self.workers[conn], self.lines[conn] = pid, protocol.Lines(conn)
        try:
            protocol.send_message(conn, {"pid": pid})
        except OSError:  # its standby worker left while the request queued: so does the worker
            _kill(pid, signal.SIGKILL)
            self._forget(conn)
            return
        log.info("standby: forked worker %d (RANK=%s)", pid, request["env"].get("RANK"))

    def _refusal(self, request: dict[str, Any], conn: socket.socket) -> str | None:
        # An abstract socket has no file permissions: only this user's processes are served.
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        if uid != os.getuid():
            return f"uid {uid} is not this standby's user"
        if request.get("module") != WORKER_MODULE:
            return f"only {WORKER_MODULE} is started here, not {request.get('module')!r}"
        if self.hazards:
            return "the standby is not fork-safe: " + ", ".join(self.hazards)
        mine, theirs = protocol.loaded_with(dict(os.environ)), protocol.loaded_with(request["env"])
        differ = sorted(k for k in mine if mine[k] != theirs[k])
        if differ:
            return f"loaded with other {', '.join(differ)} than the worker's"
        theirs_exe = os.path.realpath(request.get("executable") or "")
        if theirs_exe != os.path.realpath(sys.executable):
            return f"runs {os.path.realpath(sys.executable)}, the worker {theirs_exe}"
        return None

    def _from_worker(self, conn: socket.socket) -> None:
        pid = self.workers[conn]
        try:
            messages = self.lines[conn].ready()
        except (OSError, ValueError):
            # Its standby worker is gone (killed, or the launcher tore it down): so is this one.
            _kill(pid, signal.SIGKILL)
            self._forget(conn)
            return
        for message in messages:
            if "signal" in message:
                _kill(pid, int(message["signal"]))

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self._record_exit(pid, status)
            conn = next((c for c, p in self.workers.items() if p == pid), None)
            if conn is not None:
                try:
                    protocol.send_message(conn, {"exit": status})
                except OSError:
                    pass
                self._forget(conn)

    def _record_exit(self, pid: int, status: int) -> None:
        body = record_exit(self.run_dir, pid, status)
        log.info("standby: worker %d ended (%s)", pid, body.get("signal") or body.get("exit_code"))

    def _forget(self, conn: socket.socket) -> None:
        self.workers.pop(conn, None)
        self.lines.pop(conn, None)
        conn.close()

    def _become_worker(self, conn: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            for sig in (signal.SIGCHLD, signal.SIGTERM):
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)  # as a fresh interpreter
            _die_with_parent(signal.SIGKILL)
            if os.getppid() != self.pid:  # the standby died before the line above
                os._exit(1)
            for sock in (self.listener, self.wake_r, self.wake_w, conn, *self.workers):
                sock.close()
            from launch.standby.child import run_worker

            code = run_worker(request, fds)
        finally:
            os._exit(code)


def _die_with_parent(sig: int) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig))


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.standby.server")
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)
    # Ends with the launcher that started it, however that ends (its workers end with it).
    _die_with_parent(signal.SIGTERM)
    logging.basicConfig(
        level=logging.INFO, format="[standby %(asctime)s] %(message)s", datefmt="%H:%M:%S"
    )
    # The launcher names it for its workers; on its own, the run dir's default name.
    name = os.environ.get(protocol.SOCKET_ENV) or protocol.address(args.run_dir)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # Bound before the imports: a worker that connects early waits for them, not for
        # nothing (its own plain start would import the same modules anyway).
        listener.bind(protocol.bindable(name))
    except OSError as exc:
        log.error("standby: cannot listen for %s (%s): one is already running?", args.run_dir, exc)
        return 1
    listener.listen(256)
    server = Server(args.run_dir, listener)
    seconds = preload()
    server.hazards = fork_hazards()
    if server.hazards:
        log.error("standby: not fork-safe (%s): workers start plainly", ", ".join(server.hazards))
    else:
        log.info("standby: ready for %s (imports took %.1f s)", args.run_dir, seconds)
    server.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
