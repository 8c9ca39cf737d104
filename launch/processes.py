"""A run's processes as the operating system shows them: what a fault injected from outside
(the soak, the benchmarks, an operator) aims at. Naming is the launchers' own: a standby's
child is ``mcore-rank<R>`` (:mod:`launch.standby.child`), a plain worker has ``RANK`` in its
environment and the run's config on its command line."""

from __future__ import annotations

from pathlib import Path

import psutil

from pretrain.context.process_names import RANK_PREFIX, WRITER


def rank_workers(run_dir: Path) -> dict[int, psutil.Process]:
    """rank -> the process that trains it (a standby's child, or a plain worker)."""
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if not any(str(run_dir) in part for part in cmdline):
            continue
        try:
            if "launch.standby.server" in cmdline:
                for child in proc.children():
                    name = child.name()
                    if name.startswith(RANK_PREFIX):
                        found[int(name.removeprefix(RANK_PREFIX))] = child
            elif "pretrain" in cmdline and "RANK" in (environ := proc.environ()):
                found[int(environ["RANK"])] = proc
        except psutil.Error:
            continue
    return found


def writers(trainer: psutil.Process) -> list[psutil.Process]:
    """The trainer's checkpoint writer processes (async saves), if any are running."""
    try:
        children = trainer.children(recursive=True)
    except psutil.Error:
        return []
    found = []
    for child in children:
        try:
            if child.name() == WRITER:
                found.append(child)
        except psutil.Error:
            continue
    return found
