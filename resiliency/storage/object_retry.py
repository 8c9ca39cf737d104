"""The one retry policy of object-store calls: what is transient, what is the user's to fix.

A timeout, a reset connection, a truncated body, a 5xx or throttling answer says nothing about
the step being read or written: the call is retried with capped exponential backoff and full
jitter until ``checkpoint.remote.retry_budget_s`` has passed since its first failure, then
:class:`ObjectStoreUnavailable` (infrastructure, exit 1: the launchers retry the job). Missing
or refused credentials and a missing bucket are :class:`ObjectStoreAccessError` (config, exit 2,
one line saying what to fix), never retried. Anything else (a missing key, a lost condition) is
the caller's to interpret. Only a size or checksum mismatch, or an object the manifest names
that is not there, ever rejects a step (remote.py).

botocore's own retries are off (ObjectStore sets ``total_max_attempts=1``): one policy, one
budget, one log line per retry, instead of silent attempts inside each of ours.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import botocore.exceptions
import urllib3.exceptions

from pretrain.context import exit_codes
from pretrain.context.failures import ClassifiedError

log = logging.getLogger(__name__)
T = TypeVar("T")

# Error codes as AWS and S3-compatible servers spell them.
_THROTTLED = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
              "RequestTimeout", "InternalError", "ServiceUnavailable",
              "TooManyRequests"}  # fmt: skip
_DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken",
           "ExpiredToken", "AllAccessDisabled", "AccountProblem", "InvalidSecurity"}  # fmt: skip
_NO_BUCKET = {"NoSuchBucket"}
# The network, not the request: connection refused, reset, timed out, a body cut short.
_TRANSIENT_TYPES: tuple[type[BaseException], ...] = (
    botocore.exceptions.ConnectionError,  # EndpointConnectionError (refused), connect timeout
    botocore.exceptions.HTTPClientError,  # read timeouts, ConnectionClosedError
    botocore.exceptions.ResponseStreamingError,
    botocore.exceptions.IncompleteReadError,
    urllib3.exceptions.HTTPError,  # ProtocolError, ReadTimeoutError while streaming a body
    ConnectionError,  # ConnectionResetError, BrokenPipeError, ConnectionRefusedError
    TimeoutError,
)
_NO_CREDENTIALS = (
    botocore.exceptions.NoCredentialsError,
    botocore.exceptions.PartialCredentialsError,
)


class ObjectStoreUnavailable(ClassifiedError):
    """The object store did not answer within checkpoint.remote.retry_budget_s: retryable."""

    kind, exit_code, retryable = "infrastructure", exit_codes.INFRASTRUCTURE, True


class ObjectStoreAccessError(ClassifiedError):
    """Credentials missing or refused, or no such bucket: the user's to fix, not retried."""

    kind, exit_code = "config", exit_codes.CONFIG_ERROR


def error_code(exc: botocore.exceptions.ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _status(exc: botocore.exceptions.ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def error_class(exc: BaseException) -> str:
    """``transient``, ``access``, ``no_bucket`` or ``other`` (the caller's to interpret)."""
    if isinstance(exc, _NO_CREDENTIALS):
        return "access"
    if isinstance(exc, botocore.exceptions.ClientError):
        code, status = error_code(exc), _status(exc)
        if code in _NO_BUCKET:
            return "no_bucket"
        if code in _DENIED or status == 403:
            return "access"
        if code in _THROTTLED or status >= 500 or status == 429:
            return "transient"
        return "other"
    return "transient" if isinstance(exc, _TRANSIENT_TYPES) else "other"


def access_line(url: str, exc: BaseException, bucket: bool = False) -> str:
    """One actionable line for an ``access`` or ``no_bucket`` error on ``url`` (``bucket``: a
    404 of the bucket itself)."""
    if bucket or error_class(exc) == "no_bucket":
        return f"{url}: the bucket does not exist: create it, or fix checkpoint.remote.url"
    what = error_code(exc) if isinstance(exc, botocore.exceptions.ClientError) else str(exc)
    return (
        f"{url}: access refused ({what}): set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or a "
        "profile or role) with read, write and delete on the prefix, and check "
        "checkpoint.remote.endpoint_url"
    )


@dataclass(frozen=True)
class RetryPolicy:
    budget_s: float = 120.0  # checkpoint.remote.retry_budget_s
    first_delay_s: float = 0.5
    max_delay_s: float = 15.0

    def delay(self, retry: int) -> float:
        """Full jitter (uniform below the capped exponential): racing clients spread out."""
        return random.uniform(0, min(self.max_delay_s, self.first_delay_s * 2**retry))

    def call(self, url: str, what: str, fn: Callable[[], T]) -> T:
        """``fn()``, retried while its errors are transient and the budget lasts."""
        deadline: float | None = None
        retry = 0
        while True:
            try:
                return fn()
            except Exception as exc:
                kind = error_class(exc)
                if kind in ("access", "no_bucket"):
                    raise ObjectStoreAccessError(access_line(url, exc)) from exc
                if kind != "transient":
                    raise
                now = time.monotonic()
                deadline = deadline if deadline is not None else now + self.budget_s
                wait = self.delay(retry)
                if now + wait > deadline:
                    raise ObjectStoreUnavailable(
                        f"{url}: {what} failed {retry + 1} times over {self.budget_s:g} s "
                        f"(checkpoint.remote.retry_budget_s): {type(exc).__name__}: {exc}"
                    ) from exc
                log.warning("object store: %s %s: %s: %s; retry %d in %.1f s", what, url,
                            type(exc).__name__, exc, retry + 1, wait)  # fmt: skip
                time.sleep(wait)
                retry += 1
