"""Who a process is on this machine: pids mean something only within one pid namespace of
one boot, so anything that judges a process by its pid (a stale lease, a leftover queue dir)
asks here first."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path


def pid_namespace_inode() -> int:
    """This process's pid namespace (0 where /proc does not say): containers sharing one
    /dev/shm (a pod's sidecars, hostIPC) each see other pids, or the same pids for others."""
    try:
        match = re.fullmatch(r"pid:\[(\d+)\]", os.readlink("/proc/self/ns/pid"))
    except OSError:
        return 0
    return int(match.group(1)) if match else 0


def boot_and_pid_namespace() -> str | None:
    """Boot id + pid namespace: a reboot reuses pids, and hostname alone does not say whether
    a pid is meaningful to us (containers with host networking share the node's hostname)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return None


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` names a live process in this pid namespace."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def free_port() -> int:
    """A TCP port on the loopback nobody listens on now (a rendezvous endpoint or a process
    group's MASTER_PORT on one machine); the caller binds it soon, and a race is possible."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
