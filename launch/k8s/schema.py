"""Validate rendered Kubernetes objects offline, the way the API server and the operator would.

The PyTorchJob is checked against the CRD's own ``openAPIV3Schema`` (training-operator v1.9),
converted to JSON Schema: unknown fields are rejected wherever the CRD lists ``properties``
(the API server would prune or refuse them), ``x-kubernetes-int-or-string`` nodes take both,
int32/int64 are range-checked, ``x-kubernetes-list-type: map`` keys must be unique. CEL rules
(``x-kubernetes-validations``) are not evaluated. The CRD embeds the full PodTemplateSpec schema,
so the pod template is checked to the same depth.

The CRD ships in this package (``launch/k8s/schemas/kubeflow.org_pytorchjobs.yaml``): the
training-operator's ``manifests/base/crds/`` file, unchanged, from kubeflow/training-operator
branch ``release-1.9`` (commit 078ec30ff26649a07d2e28893c332d4cef70e233), Apache-2.0; the last
release line that defines PyTorchJob. ``$MCORE_RECIPES_PYTORCHJOB_CRD`` points at another copy,
e.g. the one a cluster serves (``kubectl get crd pytorchjobs.kubeflow.org -o yaml``).

On top run the checks the schema cannot express but the operator's webhook
(``ValidateV1PyTorchJob``) and the pod API make: a job that passed the CRD but fails those is
accepted and then never starts a pod, so they belong before submission too.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from recipes import ConfigError

CRD_ENV = "MCORE_RECIPES_PYTORCHJOB_CRD"
CRD_FILE = "kubeflow.org_pytorchjobs.yaml"

REPLICA_TYPES = ("Master", "Worker")
RESTART_POLICIES = ("Always", "OnFailure", "Never", "ExitCode")
CLEAN_POD_POLICIES = ("All", "Running", "None")
DEFAULT_CONTAINER = "pytorch"
CONFIG_MAP_MAX_BYTES = 1 << 20  # etcd's object size limit applies to a ConfigMap's data

DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")
_CONFIG_KEY = re.compile(r"[-._a-zA-Z0-9]+")
_INT_RANGES = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}
# Kept for the list-map uniqueness check; everything else x-kubernetes-* is dropped.
_LIST_MAP_KEYS = "x-kubernetes-list-map-keys"


def crd_path() -> Path:
    """The PyTorchJob CRD: $MCORE_RECIPES_PYTORCHJOB_CRD, else the copy shipped in the package."""
    env = os.environ.get(CRD_ENV)
    if env:
        path = Path(env)
        if not path.is_file():
            raise ConfigError(
                f"PyTorchJob CRD not found at {path} (${CRD_ENV}); manifests are validated "
                f"against it before submission. Point {CRD_ENV} at a copy, e.g. "
                f"`kubectl get crd pytorchjobs.kubeflow.org -o yaml > crd.yaml`"
            )
        return path
    return shipped_crd(CRD_FILE)


def shipped_crd(file: str) -> Path:
    """A CRD shipped in this package (``launch/k8s/schemas/``)."""
    shipped = resources.files("launch.k8s").joinpath("schemas", file)
    # A wheel installs unpacked, so this is a real file; a zipped install is not supported.
    path = shipped if isinstance(shipped, Path) else Path(str(shipped))
    if not path.is_file():
        raise ConfigError(
            f"CRD not found at {path} (shipped with the package; reinstall mcore-recipes); "
            "manifests are validated against it before submission"
        )
    return path


@functools.lru_cache(maxsize=8)
def crd_schema(path: Path, version: str = "v1") -> dict[str, Any]:
    """The ``openAPIV3Schema`` of ``version`` in the CRD file at ``path``."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load(path.read_text(), Loader=loader)  # noqa: S506 - a safe loader
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            return entry["schema"]["openAPIV3Schema"]
    raise ConfigError(f"{path} defines no version {version!r} of {crd['metadata']['name']}")


def to_json_schema(node: Any) -> Any:
    """Convert one Kubernetes structural-schema node (recursively) to strict JSON Schema."""
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {name: to_json_schema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not"):
            out[key] = to_json_schema(value)
        elif key in ("allOf", "anyOf", "oneOf"):
            out[key] = [to_json_schema(sub) for sub in value]
        elif key == _LIST_MAP_KEYS or not (
            key.startswith("x-kubernetes-")
            or key in ("description", "default", "format", "nullable")
        ):
            out[key] = value
    if node.get("x-kubernetes-int-or-string"):
        out.pop("anyOf", None)
        out["type"] = ["integer", "string"]
    elif node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if out.get("type") == "integer" and node.get("format") in _INT_RANGES:
        out["minimum"], out["maximum"] = _INT_RANGES[node["format"]]
    if (
        "properties" in node
        and "additionalProperties" not in node
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def _unique_list_map_keys(
    validator: Any, keys: Sequence[str], instance: Any, schema: Mapping[str, Any]
) -> Iterator[Any]:
    # optional k8s extra
    from jsonschema import ValidationError

    if not isinstance(instance, list):
        return
    seen: set[tuple[Any, ...]] = set()
    for item in instance:
        if isinstance(item, dict):
            key = tuple(item.get(k) for k in keys)
            if key in seen:
                yield ValidationError(f"duplicate entry with {dict(zip(keys, key, strict=True))}")
            seen.add(key)


@functools.lru_cache(maxsize=8)
def _validator(
    path: Path, pod_template: bool = False, version: str = "v1", subpath: tuple[str, ...] = ()
) -> Any:
    """The CRD's schema, or (``pod_template``) the core PodTemplateSpec schema it embeds, or
    the node at ``subpath`` (keys into the schema) of ``version``."""
    try:
        # optional k8s extra
        from jsonschema import Draft202012Validator, validators
    except ModuleNotFoundError:
        raise ConfigError(
            "the k8s adapter validates manifests with jsonschema: pip install 'mcore-recipes[k8s]'"
        ) from None
    strict = validators.extend(Draft202012Validator, {_LIST_MAP_KEYS: _unique_list_map_keys})
    schema = crd_schema(path, version)
    if pod_template:
        replicas = schema["properties"]["spec"]["properties"]["pytorchReplicaSpecs"]
        schema = replicas["additionalProperties"]["properties"]["template"]
    for key in subpath:
        schema = schema[key]
    return strict(to_json_schema(schema))


def format_path(parts: Sequence[Any]) -> str:
    """``["spec", "containers", 0, "limits", "nvidia.com/gpu"]`` -> ``spec.containers[0]...``."""
    text = ""
    for part in parts:
        if isinstance(part, int):
            text += f"[{part}]"
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]*", str(part)):
            text += f".{part}" if text else str(part)
        else:
            text += f"[{part!r}]"
    return text or "<root>"


def schema_errors(
    job: Mapping[str, Any],
    path: Path | None = None,
    pod_template: bool = False,
    *,
    version: str = "v1",
    subpath: tuple[str, ...] = (),
    where: Sequence[str] = (),
) -> list[str]:
    """Every place ``job`` (or a pod template, or the part of an object at ``where`` checked
    against the schema node at ``subpath``) breaks the CRD schema, as ``path: message``."""
    validator = _validator(path or crd_path(), pod_template, version, subpath)
    lines = []
    prefix = ["spec", "template"] if pod_template else list(where)
    for error in validator.iter_errors(job):
        where = prefix + list(error.absolute_path)
        if error.validator == "additionalProperties" and error.validator_value is False:
            known = set(error.schema.get("properties", {}))
            lines += [
                f"{format_path(where + [k])}: unknown field"
                for k in error.instance
                if k not in known
            ]
        elif error.validator == "required":
            lines += [
                f"{format_path(where + [k])}: required field is missing"
                for k in error.validator_value
                if k not in error.instance
            ]
        else:
            lines.append(f"{format_path(where)}: {error.message}")
    return sorted(set(lines))


def operator_errors(job: Mapping[str, Any]) -> list[str]:
    """What the training-operator's webhook and the pod API reject but the CRD schema allows."""
    errors = []
    if job.get("apiVersion") != "kubeflow.org/v1" or job.get("kind") != "PyTorchJob":
        errors.append(
            f"<root>: expected kubeflow.org/v1 PyTorchJob, got "
            f"{job.get('apiVersion')} {job.get('kind')}"
        )
    errors += metadata_errors(job.get("metadata", {}), "metadata", DNS1035_LABEL, 63)
    spec = job.get("spec", {})
    if (
        spec.get("nprocPerNode") not in (None, "auto", "cpu", "gpu")
        and not str(spec.get("nprocPerNode")).isdigit()
    ):
        errors.append(f"spec.nprocPerNode: {spec['nprocPerNode']!r} is not auto|cpu|gpu|<int>")
    clean = spec.get("runPolicy", {}).get("cleanPodPolicy")
    if clean is not None and clean not in CLEAN_POD_POLICIES:
        errors.append(f"spec.runPolicy.cleanPodPolicy: {clean!r} not in {list(CLEAN_POD_POLICIES)}")
    replicas = spec.get("pytorchReplicaSpecs", {})
    if "Master" not in replicas:
        errors.append("spec.pytorchReplicaSpecs.Master: required (rank 0 and the rendezvous)")
    for rtype, replica in replicas.items():
        errors += _replica_errors(rtype, replica, f"spec.pytorchReplicaSpecs.{rtype}")
    return errors


def metadata_errors(
    meta: Mapping[str, Any], where: str, name_re: re.Pattern[str], max_len: int
) -> list[str]:
    errors = []
    name = meta.get("name", "")
    if not name_re.fullmatch(name) or len(name) > max_len:
        errors.append(
            f"{where}.name: {name!r} must match {name_re.pattern} and have at most "
            f"{max_len} characters"
        )
    namespace = meta.get("namespace", "")
    if not DNS1123_LABEL.fullmatch(namespace) or len(namespace) > 63:
        errors.append(f"{where}.namespace: {namespace!r} is not a DNS-1123 label")
    errors += label_errors(meta.get("labels", {}), f"{where}.labels")
    return errors


def label_errors(labels: Mapping[str, Any], where: str) -> list[str]:
    errors = []
    for key, value in labels.items():
        prefix, _, name = key.rpartition("/")
        if (
            (prefix and not DNS1123_SUBDOMAIN.fullmatch(prefix))
            or len(name) > 63
            or not _LABEL_VALUE.fullmatch(name)
            or not name
        ):
            errors.append(f"{where}[{key!r}]: invalid label key")
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.fullmatch(value):
            errors.append(f"{where}[{key!r}]: invalid label value {value!r}")
    return errors


def _replica_errors(rtype: str, replica: Mapping[str, Any], where: str) -> list[str]:
    errors = []
    if rtype not in REPLICA_TYPES:
        errors.append(f"{where}: replica type must be one of {list(REPLICA_TYPES)}")
    if rtype == "Master" and replica.get("replicas", 1) != 1:
        errors.append(f"{where}.replicas: there must be exactly 1 Master replica")
    if replica.get("restartPolicy", "Never") not in RESTART_POLICIES:
        errors.append(
            f"{where}.restartPolicy: {replica['restartPolicy']!r} not in {list(RESTART_POLICIES)}"
        )
    template = replica.get("template", {})
    errors += label_errors(
        template.get("metadata", {}).get("labels", {}), f"{where}.template.metadata.labels"
    )
    return errors + pod_errors(template.get("spec", {}), f"{where}.template.spec")


def pod_errors(
    pod: Mapping[str, Any], where: str, container_name: str = DEFAULT_CONTAINER
) -> list[str]:
    """A pod the controller runs: it needs its container named ``container_name``, volumes
    its mounts name, absolute paths, valid environment names."""
    containers = pod.get("containers", [])
    errors = [] if containers else [f"{where}.containers: at least one container is required"]
    if containers and container_name not in [c.get("name") for c in containers]:
        errors.append(
            f"{where}.containers: the controller needs a container named {container_name!r}"
        )
    volumes = [v.get("name", "") for v in pod.get("volumes", [])]
    errors += [
        f"{where}.volumes[{i}].name: {n!r} is not a DNS-1123 label"
        for i, n in enumerate(volumes)
        if not DNS1123_LABEL.fullmatch(n)
    ]
    errors += [
        f"{where}.volumes[{i}].hostPath.path: {v['hostPath'].get('path')!r} is not absolute"
        for i, v in enumerate(pod.get("volumes", []))
        if "hostPath" in v and not str(v["hostPath"].get("path", "")).startswith("/")
    ]
    for i, container in enumerate(containers):
        errors += _container_errors(container, set(volumes), f"{where}.containers[{i}]")
    return errors


def _container_errors(container: Mapping[str, Any], volumes: set[str], where: str) -> list[str]:
    errors = []
    if not container.get("image"):
        errors.append(f"{where}.image: required (the operator rejects containers without one)")
    for i, mount in enumerate(container.get("volumeMounts", [])):
        if mount.get("name") not in volumes:
            errors.append(f"{where}.volumeMounts[{i}].name: no volume named {mount.get('name')!r}")
        if not str(mount.get("mountPath", "")).startswith("/"):
            errors.append(
                f"{where}.volumeMounts[{i}].mountPath: {mount.get('mountPath')!r} is not absolute"
            )
    for i, var in enumerate(container.get("env", [])):
        if not _ENV_NAME.fullmatch(var.get("name", "")):
            errors.append(
                f"{where}.env[{i}].name: {var.get('name')!r} is not a valid "
                f"environment variable name"
            )
    return errors


def deployment_errors(deployment: Mapping[str, Any], path: Path | None = None) -> list[str]:
    """The uploader's Deployment: its pod template against the core PodTemplateSpec schema the
    CRD embeds, its containers like the job's, and a selector that matches its own pods."""
    errors = metadata_errors(deployment.get("metadata", {}), "metadata", DNS1123_SUBDOMAIN, 253)
    if deployment.get("apiVersion") != "apps/v1":
        errors.append(f"apiVersion: {deployment.get('apiVersion')!r}, expected 'apps/v1'")
    spec = deployment.get("spec", {})
    template = spec.get("template", {})
    errors += schema_errors(template, path, pod_template=True)
    selector = spec.get("selector", {}).get("matchLabels", {})
    labels = template.get("metadata", {}).get("labels", {})
    if not selector or any(labels.get(k) != v for k, v in selector.items()):
        errors.append("spec.selector.matchLabels: must be non-empty and match the pod labels")
    pod = template.get("spec", {})
    volumes = {v.get("name", "") for v in pod.get("volumes", [])}
    for i, container in enumerate(pod.get("containers", [])):
        errors += _container_errors(container, volumes, f"spec.template.spec.containers[{i}]")
    return errors


def config_map_errors(config_map: Mapping[str, Any]) -> list[str]:
    """The core ConfigMap rules that matter here: name, keys, total size."""
    errors = metadata_errors(config_map.get("metadata", {}), "metadata", DNS1123_SUBDOMAIN, 253)
    data = config_map.get("data", {})
    errors += [f"data[{key!r}]: invalid key" for key in data if not _CONFIG_KEY.fullmatch(key)]
    size = sum(len(key) + len(str(value).encode()) for key, value in data.items())
    if size > CONFIG_MAP_MAX_BYTES:
        errors.append(f"data: {size} bytes exceeds the {CONFIG_MAP_MAX_BYTES}-byte limit")
    return errors
