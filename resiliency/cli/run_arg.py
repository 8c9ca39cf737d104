"""A run or step argument of ``python -m resiliency``: a path, or a run id under the config's
default ``output_dir``: ``ls tiny`` is ``ls runs/tiny`` where ``tiny`` is not a path here."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from recipes.config.run import RunConfig


def default_output_dir() -> str:
    """``output_dir``'s schema default (recipes/config/run.py): where run dirs live."""
    field = next(f for f in dataclasses.fields(RunConfig) if f.name == "output_dir")
    return str(field.default)


def resolve_run_arg(value: str) -> Path | str:
    """The path ``value`` names: itself when it exists; else, for a relative path (a run id
    ``tiny``, or ``tiny/steps/step-000000030``), the same under the default output_dir. A str:
    the one-line error naming every place tried."""
    path = Path(value)
    if path.exists():
        return path
    root = default_output_dir()
    under = Path(root) / path
    if path.is_absolute() or path.parts[:1] == Path(root).parts[:1]:
        return f"{value} does not exist"
    if under.exists():
        return under
    return (
        f"{value} is neither a path nor a run id under output_dir {root}/ "
        f"(tried {path.absolute()} and {under.absolute()})"
    )
