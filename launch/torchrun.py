"""python -m launch.torchrun [torchrun options] -m pretrain [overrides]: torchrun whose
exit code is the documented one.

torchrun (and ft_launcher) exit 1 whenever a worker fails, whatever code it returned, so a
scheduler that reads the exit code would retry a config error (2) forever. This runs the same
launcher in-process with the same arguments and exits with the code of the rank that failed
first (torch elastic's error files order the failures), or the signal's 128+N when a worker was
killed, or 130 after a Ctrl-C (the ranks saved first). Use it wherever a scheduler or wrapper
decides from the exit code; python -m launch does the same and also decides on requeues.
"""

from __future__ import annotations

import importlib
import logging
import signal
import sys
from dataclasses import dataclass

from pretrain.context import exit_codes, interrupts
from pretrain.platform.logs import setup_launcher_logging

log = logging.getLogger(__name__)

LAUNCHERS = {
    "torchrun": "torch.distributed.run",
    "ft_launcher": "nvidia_resiliency_ext.fault_tolerance.launcher",
}
SIGNAL_BASE = 128


@dataclass(frozen=True)
class Outcome:
    code: int  # root-cause worker exit code; negative: killed by that signal
    planned: bool  # the platform stopped the agent (SIGTERM): preemption, eviction, delete


def run_launcher(launcher: str, argv: list[str]) -> Outcome:
    """Run torchrun or ft_launcher in this process; the first failing worker's outcome."""
    module = importlib.import_module(LAUNCHERS[launcher])
    try:
        module.run(module.parse_args(argv))
    except Exception as exc:  # noqa: BLE001 - every way out becomes an exit code
        # Duck-typed: ft_launcher raises its own vendored copies of torch.elastic's classes.
        if hasattr(exc, "get_first_failure"):
            rank, failure = exc.get_first_failure()
            log.error("rank %s failed first, exit code %s", rank, failure.exitcode)
            return Outcome(int(failure.exitcode), planned=False)
        if hasattr(exc, "sigval"):
            name = signal.Signals(int(exc.sigval)).name
            log.info("%s stopped by %s: its workers were told to stop first", launcher, name)
            return Outcome(-int(exc.sigval), planned=True)
        log.exception("launcher failed")
        return Outcome(exit_codes.INFRASTRUCTURE, planned=False)
    return Outcome(exit_codes.OK, planned=False)


def process_exit_code(outcome: Outcome) -> int:
    """A worker killed by signal N exits 128+N, as a shell reports it."""
    return SIGNAL_BASE - outcome.code if outcome.code < 0 else outcome.code


@interrupts.one_line_on_ctrl_c("before the launcher started its workers")
def main(argv: list[str]) -> int:
    setup_launcher_logging()
    launcher = "torchrun"
    if argv[:1] == ["--ft-launcher"]:
        launcher, argv = "ft_launcher", argv[1:]
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.split("\n\n")[0])
        print("  add --ft-launcher first to run nvidia-resiliency-ext's ft_launcher instead")
        return exit_codes.OK
    return process_exit_code(run_launcher(launcher, argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
