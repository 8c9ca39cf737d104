"""``python -m launch.standby.worker [pretrain arguments]``: the worker entrypoint torchrun or
ft_launcher starts when ``launch.standby=true``.

It hands its argv, environment and standard streams to this node's standby server
(:mod:`launch.standby.server`), which forks a worker that has already imported torch,
megatron-core and the trainer; it then relays every signal it gets (SIGTERM for an emergency
save, SIGINT, SIGUSR1/2, ...) to that worker and ends the way the worker ended (its exit code,
or killed by the same signal), so the launcher, Slurm and the pod see an ordinary worker.

When no standby answers within ``MCORE_RECIPES_STANDBY_WAIT_S`` (default 120 s: it may still
be importing), or it refuses (not fork-safe, another environment), this process becomes a
plain ``python -m pretrain`` by exec, and says why on stderr. Standard library only.
"""

from __future__ import annotations

import os
import signal
import socket
import sys

from launch.standby import protocol
from pretrain.context.startup_clock import host_clock, process_start

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
    for sig in RELAYED:
        signal.signal(sig, lambda signum, _f: protocol.send_message(sock, {"signal": signum}))
    return _relay_exit(lines, int(answer["pid"]))


def _relay_exit(lines: protocol.Lines, pid: int) -> int:
    """Wait for the worker's end and end alike."""
    message = None
    while message is None or "exit" not in message:
        try:
            message = lines.next()
        except OSError:
            message = None
        if message is None:
            # The standby died (its workers die with it: PR_SET_PDEATHSIG).
            print(f"standby worker: lost the standby server; worker {pid} gone", file=sys.stderr)
            return 1
    status = int(message["exit"])
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
    print(f"standby worker: {why}; starting plainly", file=sys.stderr, flush=True)
    os.execv(sys.executable, [sys.executable, "-m", MODULE, *args])
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
