"""Before any rank starts: the object store is reachable with these credentials and honours the
conditional writes the remote protocol relies on.

The protocol's guarantees (an object is never overwritten, latest.json never moves backwards)
rest on the server refusing a second ``If-None-Match: *`` PUT and an ``If-Match`` PUT with a
stale ETag with 412. Some S3-compatible servers (and proxies in front of them) drop those
headers and overwrite silently; the probe finds out with one small object under
``<prefix>/<run_id>/.probe-<random>``, deleted again. Missing credentials, a wrong endpoint or
a missing bucket fail here too, in seconds, instead of in the uploader after training started.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

from pretrain.context import exit_codes
from pretrain.context.failures import ClassifiedError
from recipes.config.checkpoint import RemoteCheckpointConfig
from resiliency.storage.object_retry import ObjectStoreAccessError, ObjectStoreUnavailable
from resiliency.storage.object_store import ObjectStore, PreconditionFailed

log = logging.getLogger(__name__)
PREFLIGHT_BUDGET_S = 30.0  # a wrong endpoint is reported in this long, not after the full budget
ALLOW_KEY = "checkpoint.remote.allow_unconditional"


class RemotePreflightError(ClassifiedError):
    """The object store cannot serve the remote tier as configured: fix the config first."""

    kind, exit_code = "config", exit_codes.CONFIG_ERROR


@dataclass(frozen=True)
class PreflightResult:
    url: str
    conditional: bool  # the server refused both stale conditional writes
    seconds: float


def check_remote(
    remote: RemoteCheckpointConfig, run_id: str, at_launch: bool = True
) -> PreflightResult | None:
    """The preflight for a run's ``checkpoint.remote`` (None when the tier is off)."""
    if remote.url is None:
        return None
    budget = min(remote.retry_budget_s, PREFLIGHT_BUDGET_S) if at_launch else remote.retry_budget_s
    store = ObjectStore(remote.url, remote.endpoint_url, workers=1, retry_budget_s=budget)
    return preflight(store, run_id, remote.allow_unconditional, at_launch)


def preflight(
    store: ObjectStore, run_id: str, allow_unconditional: bool, at_launch: bool = True
) -> PreflightResult:
    """At launch (a user is there) a store that does not answer is a config error: a wrong
    endpoint. In the trainer (a requeued job, a restarted pod) it is an outage:
    ObjectStoreUnavailable, retried by the launchers like any infrastructure failure."""
    started = time.monotonic()
    try:
        store.head_bucket()
        conditional = _probe(store, f"{run_id}/.probe-{uuid.uuid4().hex[:12]}")
    except ObjectStoreAccessError as exc:
        raise RemotePreflightError(f"checkpoint.remote: {exc}") from exc
    except ObjectStoreUnavailable as exc:
        if not at_launch:
            raise
        raise RemotePreflightError(
            f"checkpoint.remote: {store.url} did not answer ({exc}); check "
            "checkpoint.remote.endpoint_url (or AWS_ENDPOINT_URL), or launch again once the "
            "object store is back"
        ) from exc
    result = PreflightResult(store.url, conditional, time.monotonic() - started)
    if not conditional:
        line = (
            f"checkpoint.remote: {store.url} ignores conditional writes (If-None-Match / "
            "If-Match): remote steps could be overwritten and latest.json moved backwards"
        )
        if not allow_unconditional:
            raise RemotePreflightError(f"{line}; use a server that honours them, or set "
                                       f"{ALLOW_KEY}=true to accept the risk")  # fmt: skip
        log.warning("%s (%s=true)", line, ALLOW_KEY)
    return result


def _probe(store: ObjectStore, rel: str) -> bool:
    """PUT, GET, a second create and a stale replace (both must lose), DELETE."""
    body = b"mcore-recipes preflight probe\n"
    etag = store.put_bytes(rel, body)
    try:
        got = store.get_bytes(rel)
        if got is None or got[0] != body:
            raise RemotePreflightError(f"checkpoint.remote: {store.url}/{rel} reads back wrong")
        return _refuses(store, rel, None) and _refuses(store, rel, f'"{etag.strip(chr(34))}-0"')
    finally:
        store.delete(rel)


def _refuses(store: ObjectStore, rel: str, if_match: str | None) -> bool:
    """A write the server must refuse (412): a create of an existing key, or a stale ETag."""
    try:
        store.put_bytes(rel, b"must not be written\n", if_match=if_match)
    except PreconditionFailed:
        return True
    return False
