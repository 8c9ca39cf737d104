"""The one logging setup for every process: rank-prefixed, INFO by default."""

from __future__ import annotations

import logging
import os
import sys
import warnings

_FORMAT = "%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str = "INFO", rank: int | None = None) -> None:
    """Configure the root logger once per process; safe to call again (level/rank update)."""
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT.format(rank=rank), "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # megatron-core logs every dataset/index build at INFO on every rank: keep it to warnings.
    for noisy in ("megatron.core", "nvidia_resiliency_ext"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    for name, routine in ROUTINE_NOTICES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _RoutineNotices) for f in logger.filters):
            logger.addFilter(_RoutineNotices(routine))
    # Library deprecation/fallback warnings repeat on every rank; keep them for DEBUG runs.
    logging.captureWarnings(True)
    if root.level > logging.DEBUG:
        warnings.filterwarnings("ignore", category=UserWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)


def setup_launcher_logging() -> None:
    """setup_logging for a process that runs torchrun or ft_launcher in-process: the
    launcher's own INFO lines (ft_launcher's rendezvous rounds, worker-group restarts and exit
    codes, under nvidia_resiliency_ext) stay, as a bare launcher prints them: the post-mortems
    and the elastic supervisor read them from its output. Only the ranks' copy of that library
    is quieted."""
    setup_logging("INFO")
    logging.getLogger("nvidia_resiliency_ext").setLevel(logging.INFO)


# Third-party WARNINGs that every normal run prints, by logger: kept for DEBUG runs only, so a
# normal run prints no warning (the loggers' other warnings pass).
ROUTINE_NOTICES = {
    # Said on every start ("Implicit initialization of Rerun State Machine!", "... initialized
    # in mode RerunMode.DISABLED"): its rerun mode is off here by design.
    "megatron.core.rerun_state_machine": (
        "Implicit initialization of Rerun State Machine",
        "RerunStateMachine initialized",
    ),
    # Rank 0 looks into the save's directory after a peer may have begun writing its shards:
    # every save here goes to a tmp dir created empty for it (resiliency/storage/publish.py),
    # and only a committed one is ever published.
    "megatron.core.dist_checkpointing.serialization": (
        "Overwriting old incomplete / corrupted checkpoint",
    ),
    # megatron-core 0.19, on every start: GPTModel is the model both stacks build on purpose
    # (the same class on 0.16); HybridModel is a migration for its own issue, not a fault.
    "megatron.core.models.gpt.gpt_model": ("GPTModel IS DEPRECATED",),
    # megatron-core 0.19: DDP computes the distributed optimizer's parameter layout itself,
    # as 0.16 always did; precomputing it would only move the same computation.
    "megatron.core.distributed.distributed_data_parallel": (
        "DistributedDataParallel: full_param_layout not provided",
    ),
}


class _RoutineNotices(logging.Filter):
    def __init__(self, routine: tuple[str, ...]) -> None:
        super().__init__()
        self.routine = routine

    def filter(self, record: logging.LogRecord) -> bool:
        if logging.getLogger().isEnabledFor(logging.DEBUG):
            return True
        return not str(record.msg).startswith(self.routine)
