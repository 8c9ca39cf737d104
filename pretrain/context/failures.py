"""Failure classes and the exit code (retry decision) each one maps to.

An error whose raiser knows its class derives from :class:`ClassifiedError` and says so in its
class attributes; everything else is classified here by type (and, for lost peers, by message).
No torch import: the storage layer and the CLIs classify errors too.
"""

from __future__ import annotations

import errno
import sys
from dataclasses import dataclass
from typing import ClassVar

from pretrain.context import exit_codes, interrupts
from recipes import ConfigError
from recipes.inputs import DataInputError

# Local storage refusing writes: the same on fresh hardware, so not worth a retry.
LOCAL_IO_ERRNOS = frozenset({errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT})
# CUDA's OutOfMemoryError says "out of memory"; torch's CPU allocator raises a RuntimeError
# "DefaultCPUAllocator: can't allocate memory ... (Cannot allocate memory)" (ENOMEM).
OOM_MARKERS = ("out of memory", "can't allocate memory", "cannot allocate memory")
INFRA_MARKERS = (
    "gloo",
    "nccl",
    "connection reset",
    "connection closed",
    "timed out",
    "broken pipe",
    "socket",
    "peer",
    "watchdog",
)


class ClassifiedError(RuntimeError):
    """Base of errors that carry their own failure class (kind, exit code, retry decision)."""

    kind: ClassVar[str] = "user_code"
    exit_code: ClassVar[int] = exit_codes.USER_CODE
    retryable: ClassVar[bool] = False


class NonFiniteError(FloatingPointError):
    """Loss or grad norm is NaN/inf: numeric failure, not worth a retry."""


@dataclass(frozen=True)
class Failure:
    # config | infrastructure | oom | user_code | data | numeric | topology | lease | checkpoint
    # | interrupted
    kind: str
    exit_code: int
    retryable: bool
    message: str


def classify(exc: BaseException) -> Failure:
    """Map an exception raised in the trainer to its class and exit code."""
    message = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, DataInputError):
        return Failure("data", exit_codes.DATA, False, message)
    if isinstance(exc, ConfigError):
        return Failure("config", exit_codes.CONFIG_ERROR, False, message)
    if isinstance(exc, ClassifiedError):
        return Failure(exc.kind, exc.exit_code, exc.retryable, message)
    if isinstance(exc, NonFiniteError) or _is_megatron_nan_check(exc):
        return Failure("numeric", exit_codes.NUMERIC, False, message)
    if isinstance(exc, MemoryError) or any(m in str(exc).lower() for m in OOM_MARKERS):
        return Failure("oom", exit_codes.OOM, False, message)
    if isinstance(exc, OSError) and exc.errno in LOCAL_IO_ERRNOS:
        return Failure("checkpoint", exit_codes.CHECKPOINT_IO, False, message)
    if isinstance(exc, (FileNotFoundError, UnicodeDecodeError)):
        return Failure("data", exit_codes.DATA, False, message)
    if _is_infrastructure(exc):
        if interrupts.requested():  # a peer that stopped at once on a second Ctrl-C
            return Failure("interrupted", exit_codes.INTERRUPTED, False, f"Ctrl-C: {message}")
        return Failure("infrastructure", exit_codes.INFRASTRUCTURE, True, message)
    return Failure("user_code", exit_codes.USER_CODE, False, message)


def _is_megatron_nan_check(exc: BaseException) -> bool:
    """megatron-core DDP's check_for_nan_in_grad: "found NaN (Inf) in local grad norm ..." (a
    real NaN in the backward pass), the same numeric failure as the loop's own check."""
    text = str(exc)
    markers = ("found NaN in local grad", "found Inf in local grad")
    return isinstance(exc, RuntimeError) and any(m in text for m in markers)


def _is_infrastructure(exc: BaseException) -> bool:
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    # A torch.distributed error can only exist once torch.distributed is loaded.
    dist = sys.modules.get("torch.distributed")
    if dist is not None and isinstance(exc, (dist.DistBackendError, dist.DistNetworkError)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(m in text for m in INFRA_MARKERS)
