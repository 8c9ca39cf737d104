"""Every rendered object checked before anything is submitted: a ConfigError listing each
problem (:mod:`launch.k8s.schema` for the PyTorchJob, the ConfigMap and the uploader's
Deployment; :mod:`launch.k8s.trainjob_schema` for the TrainJob and its runtime)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from launch.k8s import trainjob_schema
from launch.k8s.schema import config_map_errors, deployment_errors, operator_errors, schema_errors
from recipes import ConfigError

_SHOWN = 20


def validate_objects(objects: Sequence[Mapping[str, Any]], path: Path | None = None) -> None:
    """Raise ConfigError listing every problem in the rendered objects. ``path``: the
    PyTorchJob CRD to check against (default: $MCORE_RECIPES_PYTORCHJOB_CRD or the shipped
    one)."""
    checks: dict[str, Callable[[Mapping[str, Any]], list[str]]] = {
        "PyTorchJob": lambda obj: schema_errors(obj, path) or operator_errors(obj),
        "ConfigMap": config_map_errors,
        "Deployment": lambda obj: deployment_errors(obj, path),
        "TrainJob": trainjob_schema.trainjob_errors,
        **{kind: trainjob_schema.runtime_errors for kind in trainjob_schema.RUNTIME_CRDS},
    }
    problems = []
    for obj in objects:
        kind = str(obj.get("kind"))
        check = checks.get(kind)
        errors = check(obj) if check else [f"<root>: unexpected kind {kind!r}"]
        problems += [f"{kind}: {line}" for line in errors]
    by_kind = {obj.get("kind"): obj for obj in objects}
    runtimes = [by_kind[k] for k in trainjob_schema.RUNTIME_CRDS if k in by_kind]
    if not problems and "TrainJob" in by_kind and runtimes:
        pair = trainjob_schema.pair_errors(by_kind["TrainJob"], runtimes[0])
        problems += [f"TrainJob: {line}" for line in pair]
    if problems:
        more = [f"... and {len(problems) - _SHOWN} more"] if len(problems) > _SHOWN else []
        shown = problems[:_SHOWN] + more
        raise ConfigError("rendered manifest is invalid:\n  " + "\n  ".join(shown))
