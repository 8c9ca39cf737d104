"""Choose the step to restore from: the newest published step that verifies.

latest.json is only a hint that is verified first; the newest verified step always wins, because
a crash between the publish rename and the latest.json update leaves latest one step behind.
Candidates are found by name only and each is verified; mtimes and tmp dirs are never trusted.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pretrain.context.run_dir import RunDir
from resiliency.storage.layout import RunLayout, step_name
from resiliency.storage.signing import SigningKey
from resiliency.storage.verify import Verdict, verify_step_dir

logger = logging.getLogger(__name__)

LATEST_NAME = RunDir(Path(".")).latest_path.name


@dataclass
class Selection:
    step_dir: Path | None
    step: int | None
    source: Literal["latest", "scan", "none"]
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (dir name, reason)
    verdict: Verdict | None = None


def read_latest_hint(layout: RunLayout) -> tuple[int | None, str | None]:
    """(step, None) if latest.json is a well-formed pointer, else (None, why not)."""
    try:
        raw = layout.latest_path.read_text()
    except FileNotFoundError:
        return None, None
    except (OSError, UnicodeDecodeError) as e:
        return None, f"unreadable: {e}"
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        return None, f"not valid JSON: {e}"
    step = data.get("step") if isinstance(data, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return None, f"no valid 'step' in {raw.strip()[:80]!r}"
    # Only the canonical dir for the step is accepted, so a hint cannot lead outside steps/.
    if data.get("dir") != f"steps/{step_name(step)}":
        return None, f"'dir' {data.get('dir')!r} is not steps/{step_name(step)}"
    return step, None


def _skip(skipped: list[tuple[str, str]], name: str, reason: str) -> None:
    logger.warning("restore: skipping %s: %s", name, reason)
    skipped.append((name, reason))


def select_restore_step(
    layout: RunLayout,
    run_id: str,
    full_verify: bool,
    rejected: Mapping[int, str] | None = None,
    key: SigningKey | None = None,
) -> Selection:
    """``rejected``: steps already found bad (step -> reason), e.g. by a collective re-hash.
    ``key``: only steps signed with it are chosen (checkpoint.signing_key_env)."""
    skipped: list[tuple[str, str]] = []
    hint, problem = read_latest_hint(layout)
    if problem is not None:
        _skip(skipped, LATEST_NAME, problem)
    verdicts = {step: Verdict(False, step, reason) for step, reason in (rejected or {}).items()}
    if hint is not None:
        if hint not in verdicts:
            verdicts[hint] = verify_step_dir(layout.step_dir(hint), run_id, full_verify, key)
        if not verdicts[hint].ok:
            _skip(skipped, LATEST_NAME, f"points to step {hint}: {verdicts[hint].reason}")
    for step in reversed(layout.published_steps()):
        verdict = verdicts.get(step) or verify_step_dir(
            layout.step_dir(step), run_id, full_verify, key
        )
        if verdict.ok:
            return _chosen(layout, step, hint, verdict, skipped)
        _skip(skipped, step_name(step), verdict.reason)
    if skipped:  # steps were there and none verifies: worth a warning, not so a fresh run
        logger.warning(
            "restore: no verified checkpoint in %s; starting from scratch", layout.steps_dir
        )
    return Selection(None, None, "none", skipped)


def _chosen(
    layout: RunLayout, step: int, hint: int | None, verdict: Verdict, skipped: list[tuple[str, str]]
) -> Selection:
    source: Literal["latest", "scan"] = "latest" if step == hint else "scan"
    if hint is not None and step > hint:
        logger.warning(
            "restore: latest.json points to step %d but newer step %d verifies; using %d",
            hint,
            step,
            step,
        )
    logger.info("restore: selected %s (via %s)", layout.step_dir(step), source)
    return Selection(layout.step_dir(step), step, source, skipped, verdict)
