"""The forked side of the standby: become the worker the launcher asked for.

Everything a fresh ``python -m pretrain`` would get from its exec is put back by hand: the
standard streams (the standby worker's own descriptors), argv, environment, working directory,
stdio buffering as ``PYTHONUNBUFFERED`` asks, fresh seeds for Python's and numpy's global
generators (a fork copies the standby's), and the interpreter's exit path (non-daemon threads
joined, then atexit handlers) before the process ends with the worker's exit code.
"""

from __future__ import annotations

import atexit
import io
import os
import random
import runpy
import signal
import sys
import threading
import traceback
from typing import Any

from pretrain.context.process_names import name_this_process, rank_name
from pretrain.context.startup_clock import SPAWNED_ENV


def run_worker(request: dict[str, Any], fds: list[int]) -> int:
    _take_streams(fds)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ[SPAWNED_ENV] = repr(request["spawned"])
    _name_process(os.environ.get("RANK"))
    _reopen_stdio(unbuffered=bool(os.environ.get("PYTHONUNBUFFERED")))
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    sys.argv = [request["argv"][0], *request["argv"][1:]]
    # The standby imported the entry module's dependencies through it; run it afresh as
    # __main__, as `python -m` does (multiprocessing's spawned children find it by its spec).
    sys.modules.pop(f"{request['module']}.__main__", None)
    code = 0
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt:
        # A fresh interpreter ends an uncaught Ctrl-C killed by SIGINT, as shells expect.
        _shut_down(0)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # noqa: BLE001 - as the interpreter would: print it, exit 1
        traceback.print_exc()
        code = 1
    return _shut_down(code)


def _name_process(rank: str | None) -> None:
    """``ps``/``top`` show a forked worker as ``mcore-rank<R>`` (its argv is the standby's)."""
    name_this_process(rank_name(rank))


def _take_streams(fds: list[int]) -> None:
    for target, fd in enumerate(fds):
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)


def _reopen_stdio(unbuffered: bool) -> None:
    # The standby's sys.stdout/err wrap descriptors 1 and 2, now the worker's; only their
    # buffering must follow the worker's environment (read at interpreter start otherwise).
    for name, fd in (("stdout", 1), ("stderr", 2)):
        raw = io.FileIO(fd, "w", closefd=False)
        stream = io.TextIOWrapper(
            io.BufferedWriter(raw),
            encoding="utf-8",
            errors="backslashreplace",
            line_buffering=name == "stderr" or unbuffered,
            write_through=unbuffered,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _shut_down(code: int) -> int:
    """What the interpreter does on its way out, then the caller's os._exit(code)."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # joins non-daemon threads
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - a failing handler must not change the exit code
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return code
