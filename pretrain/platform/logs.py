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
    # Library deprecation/fallback warnings repeat on every rank; keep them for DEBUG runs.
    logging.captureWarnings(True)
    if root.level > logging.DEBUG:
        warnings.filterwarnings("ignore", category=UserWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
