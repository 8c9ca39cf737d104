"""Compose a run config from the YAML tree and CLI overrides (Hydra's override grammar).

Uses Hydra's Compose API, not ``@hydra.main``: no per-rank ``${now:}`` output dirs, no cwd
changes, and every rank composes the identical config from the identical overrides. A user's
own recipe and group files are added with Hydra's ``hydra.searchpath=[file://DIR]`` override
(``--config-dir DIR``): being an override, it travels with the others to every process that
composes them (a sweep point, the fit check's ``--plan``).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from recipes.checks import ConfigError
from recipes.config.run import RunConfig
from recipes.megatron_names import megatron_hint

CONF_DIR = Path(__file__).resolve().parent / "conf"
SCHEMA_NAME = "run_schema"
SEARCH_PATH_KEY = "hydra.searchpath"
FILE_SCHEME = "file://"

ConfigStore.instance().store(name=SCHEMA_NAME, node=RunConfig)

# `python -m launch ... --config FILE`: the adapters compose with load_config(overrides)
# (launch/common.py), so the file a command starts from is set around the command instead of
# being threaded through every adapter's signature.
_CONFIG_FILE: ContextVar[Path | None] = ContextVar("config_file", default=None)


@contextmanager
def starting_from(path: str | Path | None) -> Iterator[None]:
    """Within it, ``load_config(overrides)`` loads FILE plus the overrides, as
    ``load_config_file`` does (no effect when ``path`` is None)."""
    token = _CONFIG_FILE.set(Path(path) if path is not None else None)
    try:
        yield
    finally:
        _CONFIG_FILE.reset(token)


def started_from() -> Path | None:
    """The config file the command in progress starts from (``starting_from``), if any."""
    return _CONFIG_FILE.get()


def list_recipes(overrides: Sequence[str] = ()) -> list[str]:
    """The recipes the package has, and those a ``hydra.searchpath`` override adds."""
    return group_options("recipe", overrides)


def group_options(group: str, overrides: Sequence[str] = ()) -> list[str]:
    dirs = [CONF_DIR, *search_dirs(overrides)]
    return sorted({p.stem for d in dirs for p in (d / group).glob("*.yaml")})


def load_config(overrides: Sequence[str] = ()) -> RunConfig:
    """Compose, type-check and validate; raises ConfigError with an actionable message."""
    overrides = list(overrides)
    if (pinned := _CONFIG_FILE.get()) is not None:
        return load_config_file(pinned, overrides)
    cfg = compose_tree(overrides)
    try:
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
    except yaml.YAMLError as exc:  # a recipe or group file, ours or a --config-dir one
        raise ConfigError(yaml_error(exc)) from None
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        raise ConfigError(_explain(exc, list(overrides))) from None


def load_config_file(path: str | Path, overrides: Sequence[str] = ()) -> RunConfig:
    """Load a resolved config written by a launcher (pins the run), plus dotlist overrides."""
    overrides = list(overrides)
    if any(_is_search_path(o) for o in overrides):
        raise ConfigError(
            "--config FILE is a whole config and --config-dir DIR (hydra.searchpath) adds "
            "recipes to compose one from: give one of them"
        )
    try:
        base = OmegaConf.structured(RunConfig)
        merged = OmegaConf.merge(base, OmegaConf.load(path), OmegaConf.from_dotlist(overrides))
        run = OmegaConf.to_object(merged)
    except ConfigError:
        raise
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found") from None
    except OSError as exc:  # a folder, no permission: the file named, not a traceback
        raise ConfigError(f"config file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(yaml_error(exc)) from None
    except (OmegaConfBaseException, ValueError) as exc:
        raise ConfigError(_explain(exc, overrides)) from None
    assert isinstance(run, RunConfig)
    return run


def yaml_error(exc: yaml.YAMLError) -> str:
    """``FILE:LINE:COL: YAML syntax error: <problem> (<context>)``: one line, where the parser
    stopped (PyYAML's own text spans four lines, without the file's name when Hydra read it)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).strip().splitlines()[0]
    context = getattr(exc, "context", None)
    where = f"{mark.name}:{mark.line + 1}:{mark.column + 1}: " if mark is not None else ""
    return f"{where}YAML syntax error: {problem}" + (f" ({context})" if context else "")


def search_path_override(entries: Sequence[str]) -> str:
    """``hydra.searchpath=[...]`` with each ``file://`` folder absolute and checked, so the
    override means the same folder in every process that composes it, whatever its cwd."""
    checked = [_search_entry(e) for e in entries]
    quoted = ",".join("'" + e.replace("'", "\\'") + "'" for e in checked)  # Hydra's escape
    return f"{SEARCH_PATH_KEY}=[{quoted}]"


def parse_search_path(item: str) -> list[str]:
    """The entries of a ``hydra.searchpath=...`` override (a list, or a single entry)."""
    try:
        value = OverridesParser.create().parse_override(item).value()
    except HydraException as exc:
        raise ConfigError(f"{item}: {exc}; write {SEARCH_PATH_KEY}=[file://DIR]") from None
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{item}: write {SEARCH_PATH_KEY}=[file://DIR,...]")
    return value


def search_dirs(overrides: Sequence[str]) -> list[Path]:
    """The ``file://`` folders the ``hydra.searchpath`` overrides among ``overrides`` add."""
    entries = [
        entry for item in overrides if _is_search_path(item) for entry in parse_search_path(item)
    ]
    return [Path(e[len(FILE_SCHEME) :]) for e in entries if e.startswith(FILE_SCHEME)]


def override_key(override: str) -> str:
    """The key a ``key=value`` or ``+key=value`` override sets."""
    return override.split("=", 1)[0].lstrip("+")


def _is_search_path(override: str) -> bool:
    return override_key(override) == SEARCH_PATH_KEY


def _search_entry(entry: str) -> str:
    if not entry.startswith(FILE_SCHEME):
        return entry  # pkg://: Hydra resolves it
    folder = Path(entry[len(FILE_SCHEME) :]).expanduser().absolute()
    _check_config_dir(folder)
    return f"{FILE_SCHEME}{folder}"


def _check_config_dir(folder: Path) -> None:
    """A folder of recipe and group files: some of ours (``recipe/``, ``model/``...), none
    named as one of the package's (which comes first on the search path and would win)."""
    groups = sorted(_group_names())
    if not folder.is_dir():
        raise ConfigError(f"config dir {folder} is not a directory")
    present = [g for g in groups if (folder / g).is_dir()]
    if not present:
        raise ConfigError(
            f"config dir {folder} has none of the group folders {groups}: put a recipe in "
            f"{folder}/recipe/<name>.yaml (used as recipe=<name>)"
        )
    for group in present:
        for own in sorted((folder / group).glob("*.yaml")):
            if (CONF_DIR / group / own.name).exists():
                raise ConfigError(
                    f"{own}: the package has {group}={own.stem} too, and it comes first on "
                    "the search path: give yours another name"
                )


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


RECIPE_HEADER = (
    "a recipe file's first line is `# @package _global_` (its keys are the run's: "
    "train.train_steps, not recipe.train.train_steps)"
)


def _unknown_key_message(bad: str) -> str:
    show = "Run `python -m pretrain --show-keys` to list every valid key."
    if bad == "recipe" or bad.startswith("recipe."):  # a recipe file without its header
        return f"unknown config key '{bad}': {RECIPE_HEADER}"
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
    sweep = re.search(r"Ambiguous value for argument '([^=']+)=([^']*)'", text) or re.search(
        r"Sweep parameters '([^=']+)=([^']*)' requires --multirun", text
    )
    if sweep:
        return sweep_message(*sweep.groups())
    header = re.search(r"In '(recipe/[^']+)': Could not override '[^']*@recipe\.", text)
    if header:
        return f"{header.group(1)}.yaml: {RECIPE_HEADER}"
    if "You must specify 'recipe'" in text or "recipe: ???" in text:
        return f"no recipe chosen: add recipe=<name>, one of {list_recipes(overrides)}"
    match = re.search(r"Could not find '(\w+)/(\w+)'", text)
    if match:
        group = match.group(1)
        return f"unknown {group} '{match.group(2)}'; available: {group_options(group, overrides)}"
    listed = re.search(r"Error merging override ([^=\s]+)=(.*)\n.*is not a ListConfig", text)
    if listed:
        key, value = listed.groups()
        return f"{key}={value}: {key} is a list: write {key}=[{value}] ({key}=[a,b] for several)"
    bad = _unknown_override_key(overrides, text)
    if bad is not None:
        return _unknown_key_message(bad)
    typed = _type_error(text)
    if typed is not None:
        return typed
    return f"invalid config: {text.splitlines()[0]}" + (
        "\n" + "\n".join(text.splitlines()[1:4]) if len(text.splitlines()) > 1 else ""
    )


def sweep_message(key: str, value: str) -> str:
    """The one line for a sweep value given without ``-m``: how to sweep, and how to write
    what a comma more likely meant (a list, or a string)."""
    if "(" in value:  # range(), choice(), interval(), glob()
        return f"{key}={value} is a sweep: add -m (--multirun) to run one job per value"
    field = schema_fields().get(key.lstrip("+"))
    is_list = field is not None and type_name(field).startswith("list")
    string = "" if is_list else f", {key}='{value}' for a string"  # not for a list key
    return (
        f"{key}={value}: a comma makes a sweep; add -m to run one job per value, or "
        f"write {key}=[{value}] for a list{string}"
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
            and key != SEARCH_PATH_KEY
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
