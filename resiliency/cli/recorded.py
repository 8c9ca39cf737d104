"""A run's recorded ``checkpoint.*`` settings, and which file said so.

The trainer writes the config it ran with to ``<run_dir>/config.yaml`` at every start
(pretrain/train/session.py); launchers pin theirs in ``<run_dir>/launch-config.yaml``; every
published step's ``manifest.json`` carries the resolved config it was saved with. Tools that act on
a run (``gc``) take the run's own settings from there, newest record first, before any built-in
default, and say which source they used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from recipes.config.checkpoint import CheckpointConfig
from resiliency.storage.layout import RunLayout
from resiliency.storage.manifest import ManifestError, read_manifest


@dataclass(frozen=True)
class Setting:
    value: Any
    source: str  # human: which file (or default) the value came from


def schema_default(key: str) -> Any:
    """``CheckpointConfig``'s default for ``key`` (``remote.url``: nested; read from the schema,
    so it cannot drift)."""
    node: Any = CheckpointConfig()
    for part in key.split("."):
        node = getattr(node, part)
    return node


def recorded_setting(layout: RunLayout, key: str) -> Setting:
    """``checkpoint.<key>`` as the run recorded it; the schema default when nothing did."""
    skipped: list[str] = []
    for source, config in _recorded_configs(layout, skipped):
        try:
            found = OmegaConf.select(config, f"checkpoint.{key}", throw_on_missing=True)
        except OmegaConfBaseException as exc:
            skipped.append(f"{source}: {exc}")
            continue
        if found is not None or _has_key(config, key):
            return Setting(found, f"checkpoint.{key} in {source}")
    note = f"; skipped {'; '.join(skipped)}" if skipped else ""
    return Setting(
        schema_default(key),
        f"schema default: the run records no checkpoint.{key}{note}",
    )


def _has_key(config: Any, key: str) -> bool:
    checkpoint = OmegaConf.select(config, "checkpoint")
    return checkpoint is not None and key in checkpoint


def _recorded_configs(layout: RunLayout, skipped: list[str]) -> list[tuple[str, Any]]:
    """(source, config) in order of preference; unreadable records are noted in ``skipped``."""
    found: list[tuple[str, Any]] = []
    for path in layout.dir.config_files:  # the trainer's record first, then the launch pin
        if not path.is_file():
            continue
        try:
            found.append((str(path), OmegaConf.load(path)))
        except (OSError, ValueError, yaml.YAMLError, OmegaConfBaseException) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            skipped.append(f"{path} unreadable ({first})")
    steps = layout.published_steps()
    if steps:  # the newest step's manifest: a run dir copied without its yaml files
        step_dir = layout.step_dir(steps[-1])
        try:
            config = read_manifest(step_dir).config
        except ManifestError as exc:
            skipped.append(f"{step_dir.name}/manifest.json unreadable ({exc})")
            config = {}
        if config:
            found.append((str(step_dir / "manifest.json"), OmegaConf.create(config)))
    return found
