"""Failure classes and the exit code (retry decision) each one maps to."""

from __future__ import annotations

from dataclasses import dataclass

from resiliency import exit_codes

INFRA_MARKERS = ("gloo", "nccl", "connection reset", "connection closed", "timed out",
                 "broken pipe", "socket", "peer", "watchdog")


class NonFiniteError(FloatingPointError):
    """Loss or grad norm is NaN/inf: numeric failure, not worth a retry."""


class TopologyRefusedError(RuntimeError):
    """The checkpoint cannot be restored into the requested layout."""


@dataclass(frozen=True)
class Failure:
    kind: str  # infrastructure | oom | user_code | data | numeric | topology | lease | checkpoint
    exit_code: int
    retryable: bool
    message: str


def classify(exc: BaseException) -> Failure:
    """Map an exception raised in the trainer to its class and exit code."""
    from resiliency.checkpointer import CheckpointSaveError, RestoreError
    from resiliency.lease import LeaseHeldError

    from recipes import ConfigError

    message = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, ConfigError):
        return Failure("config", exit_codes.CONFIG_ERROR, False, message)
    if isinstance(exc, LeaseHeldError):
        return Failure("lease", exit_codes.LEASE_HELD, False, message)
    if isinstance(exc, TopologyRefusedError):
        return Failure("topology", exit_codes.TOPOLOGY_REFUSED, False, message)
    if isinstance(exc, NonFiniteError):
        return Failure("numeric", exit_codes.NUMERIC, False, message)
    if isinstance(exc, (MemoryError,)) or "out of memory" in str(exc).lower():
        return Failure("oom", exit_codes.OOM, False, message)
    if isinstance(exc, (CheckpointSaveError, RestoreError)):
        return Failure("checkpoint", exit_codes.CHECKPOINT_IO, False, message)
    if isinstance(exc, (FileNotFoundError, UnicodeDecodeError)) or "data" in type(exc).__name__.lower():
        return Failure("data", exit_codes.DATA, False, message)
    if _is_infrastructure(exc):
        return Failure("infrastructure", exit_codes.INFRASTRUCTURE, True, message)
    return Failure("user_code", exit_codes.USER_CODE, False, message)


def _is_infrastructure(exc: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(exc, (dist.DistBackendError, dist.DistNetworkError, ConnectionError,
                        TimeoutError)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(m in text for m in INFRA_MARKERS)
