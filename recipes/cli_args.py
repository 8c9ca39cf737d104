"""Hydra's command-line conventions on top of the Compose API this project uses.

``@hydra.main`` would change directories, make per-rank ``${now:}`` output dirs and own the
logging; composing instead keeps every rank's config identical, so the flags a Hydra user types
are implemented here: ``--cfg job|hydra|all`` with ``--resolve``, ``--info``, ``-m/--multirun``
(Hydra's own sweep grammar, expanded by its BasicSweeper), ``~key`` deletion, and the ``hydra.*``
keys that have a meaning here. The rest of ``hydra.*`` is refused, never silently ignored.

A sweep value (``a=1,2``, ``range()``, ``choice()``...) is a sweep only with ``-m``: without it
the command is refused (``refuse_sweep``), since a comma meant as a list would otherwise start
one run per element.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException

from recipes.checks import ConfigError
from recipes.load import (
    SEARCH_PATH_KEY,
    is_group,
    override_key,
    parse_search_path,
    schema_fields,
    search_path_override,
    sweep_message,
)

# hydra.* keys with a meaning here -> the key they set. Hydra's run dir is the job's output
# dir; here a run's dir is <output_dir>/<run_id>, so both name output_dir.
HYDRA_KEYS = {"hydra.run.dir": "output_dir", "hydra.sweep.dir": "output_dir"}
CFG_CHOICES = ("job", "hydra", "all")
FLAGS = {
    "--resolve",
    "--info",
    "-m",
    "--multirun",
    "--show-keys",
    "--show-config",
    "--cfg",
    "-c",
    "--config-dir",
    "-cd",
    "--plan",
    "--gpu",
    "--vocab",
    "--json",
}


@dataclass
class CliRequest:
    """What one command line asks for: the overrides, and the Hydra flags among them."""

    overrides: list[str] = field(default_factory=list)
    config_file: str | None = None
    cfg: str | None = None  # --cfg job|hydra|all: print the config, run nothing
    resolve: bool = False
    info: bool = False
    multirun: bool = False
    show_keys: bool = False
    keys_filter: str | None = None  # --show-keys FILTER: keys containing it
    help: bool = False
    # --plan: parameters and memory per GPU at the recipe's layout (pretrain/fit/cli.py)
    plan: bool = False
    gpu: str | None = None  # --gpu NAME|GiB
    vocab: int | None = None  # --vocab N: when the recipe's tokenizer files are not here
    json: bool = False


def parse_args(argv: Sequence[str]) -> CliRequest:
    """Split flags from Hydra overrides; ConfigError for a flag this CLI does not know."""
    req, args = CliRequest(), list(argv)
    while args:
        arg = args.pop(0)
        if arg.startswith("--") and "=" in arg:  # --flag=value, as argparse takes it
            arg, value = arg.split("=", 1)
            args.insert(0, value)
        if arg in ("-h", "--help"):
            req.help = True
        elif arg in ("--cfg", "-c"):
            req.cfg = _value(arg, args, CFG_CHOICES)
        elif arg == "--show-config":  # this project's older spelling of --cfg job --resolve
            req.cfg, req.resolve = "job", True
        elif arg == "--config":
            req.config_file = _value(arg, args)
        elif arg in ("--config-dir", "-cd"):  # Hydra's flag: more recipe and group files
            req.overrides.append(config_dir_override(_value(arg, args)))
        elif arg == "--resolve":
            req.resolve = True
        elif arg == "--info":
            req.info = True
        elif arg in ("-m", "--multirun"):
            req.multirun = True
        elif arg == "--show-keys":
            req.show_keys = True
            if args and not args[0].startswith("-") and "=" not in args[0]:
                req.keys_filter = args.pop(0)
        elif arg in ("--plan", "--json"):
            setattr(req, arg[2:], True)
        elif arg == "--gpu":
            req.gpu = _value(arg, args)
        elif arg == "--vocab":
            req.vocab = _int_value(arg, args)
        elif arg.startswith("-"):
            raise ConfigError(
                f"unknown option {arg!r}; options: {sorted(FLAGS | {'--config', '--help'})}, "
                "then Hydra overrides key=value"
            )
        else:
            req.overrides.append(arg)
    return req


def config_dir_override(folder: str) -> str:
    """``--config-dir DIR`` as the override Hydra reads it: ``hydra.searchpath=[file://DIR]``
    (an override, so a sweep's point processes and the fit check get it too)."""
    return search_path_override([f"file://{folder}"])


def _int_value(flag: str, args: list[str]) -> int:
    value = _value(flag, args)
    if not value.isdigit() or int(value) <= 0:
        raise ConfigError(f"{flag} needs a positive integer, got {value!r}")
    return int(value)


def _value(flag: str, args: list[str], choices: Sequence[str] | None = None) -> str:
    if not args or (choices is not None and args[0] not in choices):
        allowed = f" one of {list(choices)}" if choices else " a value"
        raise ConfigError(f"{flag} needs{allowed}")
    return args.pop(0)


def translate(overrides: Sequence[str]) -> list[str]:
    """Hydra keys to the keys they mean here, ``~key`` to ``key=null`` where the schema allows
    null; ConfigError for the rest."""
    out = []
    for item in overrides:
        key, eq, value = item.partition("=")
        bare = key.lstrip("+")
        if bare.startswith("hydra.") or bare == "hydra":
            out.append(_hydra_key(bare, value, item))
        elif key.startswith("~"):
            out.append(_deletion(key[1:]))
        else:
            out.append(item)
    return out


def _hydra_key(key: str, value: str, item: str) -> str:
    if key in HYDRA_KEYS and value:
        return f"{HYDRA_KEYS[key]}={value}"
    if key == SEARCH_PATH_KEY:
        return search_path_override(parse_search_path(item.lstrip("+")))
    honoured = ", ".join(f"{k} (= {v})" for k, v in HYDRA_KEYS.items())
    honoured += f", {SEARCH_PATH_KEY}=[file://DIR] (= --config-dir DIR)"
    raise ConfigError(
        f"{item!r}: this project composes configs with Hydra's Compose API (no Hydra job, "
        f"working-dir change or Hydra logging), so this key would do nothing; honoured: "
        f"{honoured}; logging: logging.level"
    )


def _deletion(key: str) -> str:
    f = _schema_field(key)
    if f is None:
        raise ConfigError(f"~{key}: unknown config key; `python -m pretrain --show-keys`")
    if f.default is None or "Optional" in str(f.type) or "None" in str(f.type):
        return f"{key}=null"
    if f.default == "":  # e.g. train.fault: empty means unset
        return f"{key}=''"
    if f.default_factory in (list, dict):
        return f"{key}={'[]' if f.default_factory is list else '{}'}"
    raise ConfigError(
        f"~{key}: a {f.type} key cannot be deleted (it has no unset value); "
        f"set it instead: {key}=<value>"
    )


def _schema_field(key: str) -> dataclasses.Field | None:
    f = schema_fields().get(key)
    return None if f is None or is_group(f) else f


def sweep_points(overrides: Sequence[str]) -> list[list[str]]:
    """Every combination of a ``-m`` sweep (``a=1,2 b=x,y``, ``range()``, ``choice()``...), in
    Hydra's own order, each its own run; one point without sweep values.

    Run ids: a swept ``run_id=a,b`` names each point itself. A single ``run_id=X`` cannot name
    several runs, so point i (from 0, Hydra's order) is run ``X-i``: the same command names
    the same runs, and relaunching it continues each point. Without run_id, each point starts
    a new run of its own (``<model>-<launch id>``)."""
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
        [points] = BasicSweeper.split_arguments(parsed, max_batch_size=None)
    except HydraException as exc:
        raise ConfigError(f"bad sweep: {exc}") from None
    if len(points) == 1 or any(_is_run_id(o.input_line) for o in _sweeps(parsed)):
        return [list(p) for p in points]
    return [_point_run_id(list(p), i) for i, p in enumerate(points)]


def refuse_sweep(overrides: Sequence[str]) -> None:
    """Without ``-m``, a sweep value is refused in one line (how to sweep, how to write a list),
    before anything is composed or written: never one run per value unasked."""
    for override in _sweeps(_parsed(overrides)):
        key, _, value = override.input_line.partition("=")
        raise ConfigError(sweep_message(key, value))


def _parsed(overrides: Sequence[str]) -> list:
    try:
        return OverridesParser.create().parse_overrides(list(overrides))
    except HydraException:
        return []  # not overrides (a `launch slurm logs NAME`), or compose reports the error


def _sweeps(parsed: list) -> list:
    return [o for o in parsed if o.is_sweep_override()]


def _is_run_id(override: str) -> bool:
    return override_key(override) == "run_id"


def _point_run_id(point: list[str], index: int) -> list[str]:
    """Point ``index`` of a sweep given one ``run_id=X``: its own run, ``X-<index>``."""
    given = [o for o in point if _is_run_id(o)]
    if not given:
        return point
    name = given[-1].split("=", 1)[1]
    return [o for o in point if o not in given] + [f"run_id={name}-{index}"]
