"""What the outside faults need around the soak's job, and which kinds this machine allows.

``full_disk`` needs a file system of the run's own to fill (:mod:`drill.soak.disk`, root);
``s3_outage`` needs the job's object store (``checkpoint.remote.url``) at an ``http://``
endpoint (``AWS_ENDPOINT_URL``: a local S3 server) that the soak can put behind its
:class:`~drill.fault_proxy.FaultProxy`. Without them the default kinds leave these out, saying
so; asked for by ``--kinds``, the soak refuses before any run (exit 2).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from drill.fault_proxy import FaultProxy
from drill.jobs import DrillError
from drill.soak import disk
from recipes import RunConfig
from resiliency.storage.object_store import ObjectStore
from resiliency.storage.remote import committed_remote_steps

log = logging.getLogger(__name__)

NEEDS = {
    "full_disk": "root (the soak mounts a tmpfs of its own for the run to fill)",
    "s3_outage": "checkpoint.remote.url and an http:// AWS_ENDPOINT_URL (a local S3 server the "
    "soak can put behind its proxy)",
}


def usable_kinds(kinds: tuple[str, ...], given: bool, run: RunConfig) -> tuple[str, ...]:
    """``kinds`` less those this machine or config cannot inject (refused if ``given``)."""
    can = {"full_disk": disk.can_mount(), "s3_outage": _endpoint(run) is not None}
    missing = [k for k in kinds if not can.get(k, True)]
    if missing and given:
        raise DrillError(
            "; ".join(f"--kinds {k} needs {NEEDS[k]}" for k in missing)
            + ": provide it or leave the kind out of --kinds"
        )
    for kind in missing:
        log.warning("soak: %s left out: it needs %s", kind, NEEDS[kind])
    usable = tuple(k for k in kinds if k not in missing)
    if not usable:
        raise DrillError("no fault kind can be injected here")
    return usable


def _endpoint(run: RunConfig) -> str | None:
    endpoint = os.environ.get("AWS_ENDPOINT_URL", "")
    parts = urlsplit(endpoint)
    usable = run.checkpoint.remote.url and parts.scheme == "http" and parts.port
    return endpoint if usable else None


def remote_prefix(run: RunConfig, name: str) -> str | None:
    """Launch ``name``'s (clean, soak) own prefix of the run's object store: both runs are
    called ``soak`` and must not meet there."""
    url = run.checkpoint.remote.url
    return f"{url.rstrip('/')}/{name}" if url else None


def remote_url(run: RunConfig, name: str) -> list[str]:
    """The override that gives launch ``name`` its prefix (none without an object store)."""
    prefix = remote_prefix(run, name)
    return [f"checkpoint.remote.url={prefix}"] if prefix else []


@dataclass
class Around:
    """The soak run's surroundings while it runs."""

    overrides: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    disk_root: Path | None = None
    proxy: FaultProxy | None = None
    remote_newest: Callable[[], int | None] | None = None


@contextlib.contextmanager
def around_soak(
    kinds: tuple[str, ...], run: RunConfig, run_dir: Path, clean_dir: Path
) -> Iterator[Around]:
    """Mount the run's disk and start the proxy the kinds need; undo both at the end."""
    around = Around()
    with contextlib.ExitStack() as stack:
        if "full_disk" in kinds:  # sized by what the clean run wrote
            around.disk_root = run_dir.parent
            size = disk.SIZE_FACTOR * disk.bytes_under(clean_dir) + disk.HEADROOM
            disk.mount_tmpfs(around.disk_root, size)
            stack.callback(disk.unmount_keeping, around.disk_root)
            # That tmpfs is smaller than the node check's default free-space floor.
            around.overrides.append("resiliency.health.min_free_gib=0")
        endpoint = _endpoint(run)
        if "s3_outage" in kinds and endpoint is not None:
            around.proxy = stack.enter_context(FaultProxy(endpoint))
            around.env["AWS_ENDPOINT_URL"] = around.proxy.endpoint_url
            url = remote_prefix(run, "soak")
            assert url is not None  # an endpoint is only usable with checkpoint.remote.url
            around.remote_newest = lambda: _newest(ObjectStore(url, endpoint), run_dir.name)
            log.info("soak: the soak run's object store is behind %s", around.proxy.endpoint_url)
        yield around


def _newest(store: ObjectStore, run_id: str) -> int | None:
    steps = committed_remote_steps(store, run_id)
    return steps[-1] if steps else None
