"""``python -m launch.standby.worker [pretrain arguments]``: the worker entrypoint torchrun or
ft_launcher starts when ``launch.standby=true`` or the job has spare nodes
(``launch.slurm.spare_nodes``).

It hands its argv, environment and standard streams to this node's standby server
(:mod:`launch.standby.server`), which forks a worker that has already imported torch,
megatron-core and the trainer; it then relays every signal it gets (SIGTERM for an emergency
save, SIGINT, SIGUSR1/2, ...) to that worker and ends the way the worker ended (its exit code,
or killed by the same signal), so the launcher, Slurm and the pod see an ordinary worker.

When no standby answers within ``MCORE_RECIPES_STANDBY_WAIT_S`` (default 120 s: it may still
be importing), or it refuses (not fork-safe, another environment), this process becomes a
plain ``python -m pretrain`` by exec, and says why on stderr. With spare nodes it starts that
worker as its child instead, and when the worker ends tells the node's launcher what the end
means (:mod:`launch.spares`: a node whose worker was killed leaves the job for a spare).
Standard library only.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from launch import spares
from launch.standby import protocol
from pretrain.context.startup_clock import host_clock, process_start
from pretrain.context.worker_exits import record_exit

MODULE = "pretrain"
WAIT_ENV = "MCORE_RECIPES_STANDBY_WAIT_S"
RELAYED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGCONT,
)
# Relayed signals that ask the worker to stop (not SIGCONT, SIGUSR1/2).
STOP_REQUESTS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT})


def main(args: list[str]) -> int:
    spawned = process_start() or host_clock()  # the launcher spawned this process
    name = os.environ.get(protocol.SOCKET_ENV)
    sock = _connect(name) if name else None
    if sock is None:
        return _plain(args, "no standby server" if name else f"{protocol.SOCKET_ENV} not set")
    request = {
        "module": MODULE,
        "argv": [f"-m {MODULE}", *args],
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "spawned": spawned,
        "executable": sys.executable,
    }
    lines = protocol.Lines(sock)
    try:
        sock.settimeout(_wait_s())
        protocol.send_request(sock, request, [0, 1, 2])
        answer = lines.next()
        sock.settimeout(None)
    except OSError as exc:
        return _plain(args, f"the standby did not answer ({exc})")
    if answer is None or "pid" not in answer:
        reason = (answer or {}).get("refused", "it closed the connection")
        return _plain(args, f"the standby refused: {reason}")
    relay = Relay()
    relay.to(lambda signum: protocol.send_message(sock, {"signal": signum}))
    status = _relay_exit(lines, int(answer["pid"]))
    if status is None:
        return 1
    return _end_like(status, relay.stopped)


class Relay:
    """Relays the signals this process gets to its worker (through ``to``); a signal that
    comes before there is a worker is kept and sent once there is one. ``stopped``: one of them
    asked the worker to stop (the launcher's or Slurm's TERM), so its end was not a fault."""

    def __init__(self) -> None:
        self.stopped = False
        self.pending: list[int] = []
        self.deliver: Callable[[int], None] | None = None
        for sig in RELAYED:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.stopped |= signum in STOP_REQUESTS
        if self.deliver is None:
            self.pending.append(signum)
        else:
            self.deliver(signum)

    def to(self, deliver: Callable[[int], None]) -> None:
        self.deliver = deliver
        while self.pending:
            deliver(self.pending.pop(0))


def _relay_exit(lines: protocol.Lines, pid: int) -> int | None:
    """The worker's wait status; None: the standby died (and its workers with it)."""
    message = None
    while message is None or "exit" not in message:
        try:
            message = lines.next()
        except OSError:
            message = None
        if message is None:
            # The standby died (its workers die with it: PR_SET_PDEATHSIG).
            print(f"standby worker: lost the standby server; worker {pid} gone", file=sys.stderr)
            return None
    return int(message["exit"])


def _end_like(status: int, stopped: bool) -> int:
    """End the way the worker ended (its code, or killed by its signal), after telling the
    node's launcher what the end means when the job has spares."""
    spares.after_worker(status, stopped, int(os.environ.get("RANK", "0")))
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        return 128 + sig  # only where the signal does not end a process
    return os.waitstatus_to_exitcode(status)


def _connect(name: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(protocol.bindable(name))
    except OSError:
        sock.close()
        return None
    return sock


def _wait_s() -> float:
    try:
        return float(os.environ.get(WAIT_ENV, "120"))
    except ValueError:
        return 120.0


def _plain(args: list[str], why: str) -> int:
    command = [sys.executable, "-m", MODULE, *args]
    if os.environ.get(protocol.SOCKET_ENV) or not spares.enabled():  # a standby was expected
        print(f"standby worker: {why}; starting plainly", file=sys.stderr, flush=True)
    if spares.enabled():  # stay, as the worker's parent, to see how it ends
        return _spawn(command)
    os.execv(sys.executable, command)
    return 1  # not reached


def _spawn(command: list[str]) -> int:
    """Run the worker as this process's child, relay signals to it, end like it."""
    relay = Relay()  # before the child exists: a TERM now is kept for it, not lost
    worker = subprocess.Popen(command)
    pid = worker.pid
    # os.kill, not Popen.send_signal: that polls (reaps) the child inside the handler, and the
    # waitpid below would then find no child.
    relay.to(lambda signum: _kill(pid, signum))
    _, status = os.waitpid(pid, 0)
    worker.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    if run_dir := os.environ.get(spares.RUN_DIR_ENV):  # first-hand evidence for the post-mortem
        try:
            record_exit(Path(run_dir), pid, status)
        except OSError as exc:
            print(f"standby worker: cannot record the worker's end: {exc}", file=sys.stderr)
    return _end_like(status, relay.stopped)


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass  # already ended: its end is what waitpid reports


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
