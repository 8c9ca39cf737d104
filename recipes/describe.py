"""What ``--help`` and ``--show-keys`` print: recipes, config groups and every key with its
type, default and description.

Descriptions are read from the schema's own source (the comment on a field's line, else the
comment block right above it), so they cannot drift from the code that defines the keys.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from dataclasses import dataclass

from recipes.config.run import RunConfig
from recipes.load import CONF_DIR, is_group, type_name

_FIRST_SENTENCE = re.compile(r"(?<!e\.g)(?<!i\.e)\.\s")  # one line per key
_FIELD_LINE = re.compile(r"^\s+(\w+):\s*[^=]+?(=.*?)?(#\s*(?P<comment>.*))?$")


@dataclass(frozen=True)
class KeyInfo:
    key: str
    type: str
    default: str
    help: str


def describe_keys(node: type = RunConfig, prefix: str = "") -> list[KeyInfo]:
    """Every leaf key of the schema, in declaration order."""
    comments = _field_comments(node)
    keys: list[KeyInfo] = []
    for f in dataclasses.fields(node):
        path = f"{prefix}{f.name}"
        if is_group(f):
            keys.extend(describe_keys(f.default_factory, path + "."))
            continue
        keys.append(KeyInfo(path, type_name(f), _default(f), comments.get(f.name, "")))
    return keys


def composed_keys(run: RunConfig, pattern: str | None = None) -> list[KeyInfo]:
    """Every leaf key (containing ``pattern``) with its value in the composed ``run``."""
    keys = []
    for info in describe_keys():
        if pattern is not None and pattern not in info.key:
            continue
        value: object = run
        for part in info.key.split("."):
            value = getattr(value, part)
        shown = "null" if value is None else repr(value)
        keys.append(dataclasses.replace(info, default=shown))
    return keys


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return "null" if f.default is None else repr(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return repr(f.default_factory())
    return "required"


@functools.cache
def _field_comments(node: type) -> dict[str, str]:
    """field name -> its comment: on the same line, else the comment lines right above."""
    try:
        lines, _ = inspect.getsourcelines(node)
    except (OSError, TypeError):
        return {}
    names = {f.name for f in dataclasses.fields(node)}
    comments: dict[str, str] = {}
    above: list[str] = []
    for line in lines[1:]:
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("#").strip())
            continue
        match = _FIELD_LINE.match(line)
        if match and match.group(1) in names and match.group(1) not in comments:
            text = match.group("comment") or " ".join(above)
            comments[match.group(1)] = _FIRST_SENTENCE.split(text.strip(), maxsplit=1)[0]
        above = []
    return comments


def format_keys(keys: list[KeyInfo]) -> str:
    width = max(len(k.key) for k in keys)
    type_width = max(len(k.type) for k in keys)
    return "\n".join(
        f"{k.key:<{width}}  {k.type:<{type_width}}  = {k.default}"
        + (f"  # {k.help}" if k.help else "")
        for k in keys
    )


def option_summary(group: str, name: str) -> str:
    """The first comment line of ``conf/<group>/<name>.yaml`` (after Hydra's @package line)."""
    for line in (CONF_DIR / group / f"{name}.yaml").read_text().splitlines():
        if line.startswith("# @package"):
            continue
        return line.lstrip("#").strip() if line.startswith("#") else ""
    return ""


def groups() -> dict[str, list[str]]:
    return {
        d.name: sorted(p.stem for p in d.glob("*.yaml"))
        for d in sorted(CONF_DIR.iterdir())
        if d.is_dir()
    }


def catalogue() -> str:
    """Recipes, then the other config groups, one line per option."""
    out = ["recipes (recipe=<name>):"]
    options = groups()
    width = max(len(n) for names in options.values() for n in names)
    out += [f"  {n:<{width}}  {option_summary('recipe', n)}" for n in options.pop("recipe")]
    out.append("config groups (<group>=<option>; a recipe picks them, an override swaps one):")
    for group, names in options.items():
        out.append(f"  {group}:")
        out += [f"    {n:<{width}}  {option_summary(group, n)}" for n in names]
    return "\n".join(out)
