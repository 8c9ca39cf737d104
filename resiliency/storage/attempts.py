"""Attempt ids and per-attempt records (attempts/attempt-NN.json), plus run.json.

Each record carries an owner token unique to the writing process; a record is created
exclusively and later updated only by the process that created it, so two processes that end
up with the same attempt id (a reused MCORE_RECIPES_ATTEMPT, a race) cannot clobber each other.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import uuid
from pathlib import Path
from typing import Any

from resiliency.storage.layout import RunLayout, atomic_write_json, exclusive_write_json
from resiliency.storage.manifest import utc_now_iso

logger = logging.getLogger(__name__)

ATTEMPT_ENV = "MCORE_RECIPES_ATTEMPT"
_ATTEMPT_RE = re.compile(r"^attempt-(\d{2,})\.json$")
_tokens: dict[int, str] = {}
# An attempt whose record says one of these wrote it at its own end: it writes nothing more.
TERMINAL_STATUSES = frozenset({"finished", "preempted", "interrupted", "failed", "fenced"})
# Ended as planned: rank 0 got through the end hooks (the final or emergency save included).
# "interrupted": the user's Ctrl-C, never a failure, never retried.
PLANNED_STATUSES = ("finished", "preempted", "interrupted")


class AttemptConflictError(RuntimeError):
    """The attempt id is already recorded by another process."""


def recorded_attempts(layout: RunLayout) -> list[int]:
    try:
        names = [p.name for p in layout.attempts_dir.iterdir()]
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _ATTEMPT_RE.match(n)))


def next_attempt_id(layout: RunLayout) -> int:
    """MCORE_RECIPES_ATTEMPT if set, else one past every attempt seen in records or tmp dirs."""
    env = os.environ.get(ATTEMPT_ENV)
    if env is not None and env.strip():
        try:
            attempt = int(env)
        except ValueError as e:
            raise ValueError(f"{ATTEMPT_ENV}={env!r} is not an integer") from e
        if attempt < 0:
            raise ValueError(f"{ATTEMPT_ENV}={attempt} must be >= 0")
        return attempt
    seen = recorded_attempts(layout) + [a for _p, _s, a in layout.tmp_dirs()]
    return max(seen, default=0) + 1


def _owner_token() -> str:
    # Keyed by pid so a forked child does not inherit its parent's identity.
    return _tokens.setdefault(os.getpid(), uuid.uuid4().hex)


def _owner() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "token": _owner_token()}


def _read_owner_token(path: Path) -> str | None:
    try:
        data = json.loads(path.read_text())
        return data.get("owner", {}).get("token")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None


def write_attempt_record(layout: RunLayout, attempt: int, record: dict[str, Any]) -> Path:
    """Create or update this process's attempt-NN.json; never touches another owner's record."""
    layout.attempts_dir.mkdir(parents=True, exist_ok=True)
    path = layout.attempt_path(attempt)
    body = {**record, "attempt": attempt, "owner": _owner(), "updated_at": utc_now_iso()}
    if exclusive_write_json(path, body):
        return path
    if _read_owner_token(path) != _owner_token():
        raise AttemptConflictError(
            f"{path} already belongs to another process; attempt {attempt} is taken "
            f"(unset or change {ATTEMPT_ENV})"
        )
    atomic_write_json(path, body)
    return path


def claim_attempt(layout: RunLayout, record: dict[str, Any]) -> int:
    """Pick the next attempt id and create its record; retries past ids others just claimed."""
    fixed = bool(os.environ.get(ATTEMPT_ENV, "").strip())
    attempt = next_attempt_id(layout)
    while True:
        try:
            write_attempt_record(layout, attempt, record)
            return attempt
        except AttemptConflictError:
            if fixed:
                raise
            attempt += 1


def ensure_run_record(layout: RunLayout, attempt: int) -> dict[str, Any]:
    """Create run.json on the first attempt; later attempts read it back unchanged."""
    layout.run_dir.mkdir(parents=True, exist_ok=True)
    body = {"run_id": layout.run_id, "created_at": utc_now_iso(), "first_attempt": attempt}
    if exclusive_write_json(layout.run_json_path, body):
        logger.info("created %s", layout.run_json_path)
    data = json.loads(layout.run_json_path.read_text())
    if data.get("run_id") != layout.run_id:
        raise ValueError(
            f"{layout.run_json_path} belongs to run {data.get('run_id')!r}, not {layout.run_id!r}"
        )
    return data


def read_attempt_record(layout: RunLayout, attempt: int) -> dict[str, Any] | None:
    """The attempt's record, None if it has none (or it is unreadable)."""
    try:
        record = json.loads(layout.attempt_path(attempt).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None
