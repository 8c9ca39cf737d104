"""What a standby worker and its node's standby server say to each other, and where they meet.

They meet on an abstract Unix socket (Linux: no file to clean up, private to the node's network
namespace: the pod, or the host) named after the run directory, whose name the launcher puts
in each worker's environment (:data:`SOCKET_ENV`). A request is a length-prefixed JSON body
(argv, environment, working directory, the worker's spawn moment) sent with the worker's
standard streams as SCM_RIGHTS descriptors; every later message is one JSON line: the server
answers ``{"pid": N}`` or ``{"refused": why}``, relays ``{"signal": N}`` from the worker and
ends with ``{"exit": wait status}``. Standard library only: the standby worker must start in
milliseconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
from pathlib import Path
from typing import Any

SOCKET_ENV = "MCORE_RECIPES_STANDBY"
# Read by libraries when they load (the OpenMP and BLAS thread pools, Python's hash seed and
# module path): a worker forked from a standby loaded under other values would not be the
# process a plain start makes, so the standby refuses it and the worker starts plainly.
LOADED_WITH = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "PYTHONHASHSEED",
    "PYTHONPATH",
    "PYTHONSAFEPATH",
)
_HEADER = struct.Struct("!I")
STREAMS = 3  # stdin, stdout, stderr


def address(run_dir: Path) -> str:
    """The abstract socket name of ``run_dir``'s standby on this node, written with a leading
    ``@`` as ``ss -x`` shows it (an environment variable cannot hold the NUL byte)."""
    digest = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:24]
    return f"@mcore-recipes-standby-{digest}"


def bindable(name: str) -> str:
    """``name`` as bind/connect take it, on this node: a leading ``@`` is the abstract
    namespace's NUL; under Slurm the node's name is appended, so that several nodes of one
    host (a test cluster, or nodes sharing a network namespace) keep their standbys apart."""
    node = os.environ.get("SLURMD_NODENAME")
    name = f"{name}-{node}" if node else name
    return "\0" + name[1:] if name.startswith("@") else name


def loaded_with(env: dict[str, str]) -> dict[str, str | None]:
    return {key: env.get(key) for key in LOADED_WITH}


def send_request(sock: socket.socket, body: dict[str, Any], fds: list[int]) -> None:
    data = json.dumps(body).encode()
    socket.send_fds(sock, [_HEADER.pack(len(data))], fds)
    sock.sendall(data)


def receive_request(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    header, fds, _flags, _addr = socket.recv_fds(sock, _HEADER.size, STREAMS)
    if len(header) != _HEADER.size:
        for fd in fds:
            os.close(fd)
        raise ConnectionError("short request header")
    (size,) = _HEADER.unpack(header)
    try:
        return json.loads(_read_exactly(sock, size)), list(fds)
    except (OSError, ValueError):
        for fd in fds:  # the worker's streams: not held open by a request that failed
            os.close(fd)
        raise


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 16))
        if not chunk:
            raise ConnectionError("request cut short")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def send_message(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


class Lines:
    """JSON lines from a stream socket, one message per line."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buffer = sock, b""

    def next(self) -> dict[str, Any] | None:
        """The next message (blocking); None at end of stream."""
        while b"\n" not in self.buffer:
            chunk = self.sock.recv(4096)
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def ready(self) -> list[dict[str, Any]]:
        """Every message that has fully arrived, reading once (for a select loop); raises
        ConnectionError at end of stream."""
        chunk = self.sock.recv(4096)
        if not chunk:
            raise ConnectionError("closed")
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        return [json.loads(line) for line in lines if line]
