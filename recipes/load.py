"""Compose a run config from the YAML tree and CLI overrides (Hydra's override grammar).

Uses Hydra's Compose API, not ``@hydra.main``: no per-rank ``${now:}`` output dirs, no cwd
changes, and every rank composes the identical config from the identical overrides.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from recipes.checks import ConfigError
from recipes.config.run import RunConfig
from recipes.megatron_names import megatron_hint

CONF_DIR = Path(__file__).resolve().parent / "conf"
SCHEMA_NAME = "run_schema"

ConfigStore.instance().store(name=SCHEMA_NAME, node=RunConfig)


def list_recipes() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "recipe").glob("*.yaml"))


def load_config(overrides: Sequence[str] = ()) -> RunConfig:
    """Compose, type-check and validate; raises ConfigError with an actionable message."""
    overrides = list(overrides)
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides)
        _reject_unknown_keys(OmegaConf.to_container(cfg), overrides)
        run = OmegaConf.to_object(cfg)
    except ConfigError:
        raise
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        raise ConfigError(_explain(exc, overrides)) from None
    assert isinstance(run, RunConfig)
    return run


def compose_tree(overrides: Sequence[str], with_hydra: bool = False) -> Any:
    """The composed tree before conversion (interpolations unresolved), for ``--cfg``; with
    Hydra's own node (``hydra.*``: its runtime choices, search path, ...) when asked."""
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose(
                config_name="config", overrides=list(overrides), return_hydra_config=with_hydra
            )
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        raise ConfigError(_explain(exc, list(overrides))) from None


def load_config_file(path: str | Path, overrides: Sequence[str] = ()) -> RunConfig:
    """Load a resolved config written by a launcher (pins the run), plus dotlist overrides."""
    overrides = list(overrides)
    try:
        base = OmegaConf.structured(RunConfig)
        merged = OmegaConf.merge(base, OmegaConf.load(path), OmegaConf.from_dotlist(overrides))
        run = OmegaConf.to_object(merged)
    except ConfigError:
        raise
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found") from None
    except (OmegaConfBaseException, ValueError) as exc:
        raise ConfigError(_explain(exc, overrides)) from None
    assert isinstance(run, RunConfig)
    return run


def to_yaml(run: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(run))


def schema_fields(node: Any = RunConfig, prefix: str = "") -> dict[str, dataclasses.Field]:
    """Every key of the schema (groups such as ``model`` included) -> its dataclass field."""
    fields: dict[str, dataclasses.Field] = {}
    for f in dataclasses.fields(node):
        path = f"{prefix}{f.name}"
        fields[path] = f
        if is_group(f):
            fields.update(schema_fields(f.default_factory, path + "."))
    return fields


def is_group(f: dataclasses.Field) -> bool:
    """A nested config (``model``, ``launch.slurm``), not a value."""
    return isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory)


def type_name(f: dataclasses.Field) -> str:
    """A field's type as a user writes the value: ``int``, ``int or null``, ``list[str]``."""
    text = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return re.sub(r"Optional\[(.*)\]", r"\1 or null", text).replace("typing.", "")


def schema_keys() -> list[str]:
    return list(schema_fields())


def _reject_unknown_keys(tree: Any, overrides: list[str], prefix: str = "") -> None:
    # '+new.key=...' bypasses struct mode in some Hydra paths; the schema is the source of truth.
    valid = set(schema_keys())
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if path not in valid:
            raise ConfigError(_unknown_key_message(path))
        if isinstance(value, dict) and path + "." in {k[: len(path) + 1] for k in valid}:
            _reject_unknown_keys(value, overrides, path + ".")


def _unknown_key_message(bad: str) -> str:
    show = "Run `python -m pretrain --show-keys` to list every valid key."
    if (megatron := megatron_hint(bad)) is not None:
        return f"unknown config key '{bad}': {megatron}. {show}"
    if (parent := _dict_parent(bad)) is not None:
        return (
            f"unknown config key '{bad}': {parent} is a dict, and Hydra adds a key to it only "
            f"with '+': +{bad}=<value>"
        )
    close = difflib.get_close_matches(bad, schema_keys(), n=3, cutoff=0.6)
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    return (
        f"unknown config key '{bad}'.{hint} "
        f"Run `python -m pretrain --show-keys` to list every valid key."
    )


def _dict_parent(bad: str) -> str | None:
    """The longest dict-typed schema key that ``bad`` is a key inside of, or None."""
    fields = schema_fields()
    parts = bad.split(".")
    for end in range(len(parts) - 1, 0, -1):
        field = fields.get(".".join(parts[:end]))
        if field is not None and type_name(field).startswith("dict"):
            return ".".join(parts[:end])
    return None


def _explain(exc: BaseException, overrides: list[str]) -> str:
    """Turn Hydra/OmegaConf errors into one message naming the bad key and close valid ones."""
    text = str(exc).strip()
    cause = exc.__cause__ or exc.__context__
    if cause is not None and str(cause).strip() not in text:
        text = f"{text}\n{str(cause).strip()}"
    sweep = re.search(r"Ambiguous value for argument '([^=']+)=([^']*)'", text)
    if sweep:
        key, value = sweep.groups()
        return (
            f"{key}={value}: a comma makes a sweep; add -m to run one job per value, or "
            f"write {key}=[{value}] for a list, {key}='{value}' for a string"
        )
    if "You must specify 'recipe'" in text or "recipe: ???" in text:
        return f"no recipe chosen: add recipe=<name>, one of {list_recipes()}"
    match = re.search(r"Could not find '(\w+)/(\w+)'", text)
    if match:
        group = match.group(1)
        options = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        return f"unknown {group} '{match.group(2)}'; available: {options}"
    bad = _unknown_override_key(overrides, text)
    if bad is not None:
        return _unknown_key_message(bad)
    typed = _type_error(text)
    if typed is not None:
        return typed
    return f"invalid config: {text.splitlines()[0]}" + (
        "\n" + "\n".join(text.splitlines()[1:4]) if len(text.splitlines()) > 1 else ""
    )


def _type_error(text: str) -> str | None:
    """'train.train_steps=abc: expected int, got 'abc'' from OmegaConf's conversion error."""
    value = re.search(r"Value '(.*?)' (?:of type '\w+' )?could not be converted to (\w+)", text)
    key = re.search(r"full_key: (\S+)", text)
    if value is None or key is None:
        return None
    field = schema_fields().get(key.group(1))
    expected = type_name(field) if field is not None else value.group(2)
    return f"{key.group(1)}={value.group(1)}: expected {expected}, got {value.group(1)!r}"


def _unknown_override_key(overrides: list[str], text: str) -> str | None:
    if "not in" not in text and "Key '" not in text and "Could not override" not in text:
        return None
    valid = set(schema_keys())
    for item in overrides:
        key = item.split("=", 1)[0].lstrip("+~")
        if (
            "=" in item
            and key not in valid
            and "/" not in key
            and "@" not in key
            and key not in _group_names()
        ):
            return key
    match = re.search(r"full_key: (\S+)", text)
    return match.group(1) if match else None


def _group_names() -> set[str]:
    return {p.name for p in CONF_DIR.iterdir() if p.is_dir()}


def load_config_dict(saved: dict[str, Any]) -> RunConfig:
    """The RunConfig of a config saved as a plain dict (a checkpoint manifest's ``config``)."""
    try:
        run = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), saved))
    except (OmegaConfBaseException, ValueError) as exc:
        raise ConfigError(f"saved config does not load: {exc}") from None
    assert isinstance(run, RunConfig)
    return run
