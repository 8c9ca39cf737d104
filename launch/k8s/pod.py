"""The pod template of a rendered PyTorchJob: container, resources, volumes, scheduling keys.

Also the render-time checks that only make sense against the pod as it will run: resources
for the QoS class, the node-local checkpoint volume, and data paths that must be on a volume.
Pure functions of the validated config, like launch.k8s.render.
"""

from __future__ import annotations

import logging
import posixpath
from pathlib import Path
from typing import Any

from launch.common import worker_module
from pretrain.context.run_dir import RunDir
from recipes import ConfigError, RunConfig
from recipes.config.launch import K8sConfig

log = logging.getLogger(__name__)

# Under the run dir: the entry point's retry budget and its pods' health reports, per job id.
STATE_SUBDIR = "k8s/retries"
CONTAINER = "pytorch"  # the operator reads exit codes (and injects PET_* env) for this name only
CONFIG_DIR = "/etc/mcore-recipes"
# The pinned config, mounted from a ConfigMap under the run dir's own name for it.
CONFIG_FILE = RunDir(Path(CONFIG_DIR)).launch_config_path.name
# Default root of the node-local tier's hostPath: one directory per namespace and job, so jobs
# sharing a node never share shards. The kubelet creates it (root, 0755) on first use; nothing
# removes it when the job ends, so clusters that run many jobs clean it up with their node tools.
HOST_PATH_ROOT = "/var/lib/mcore-recipes"
GPU_RESOURCE = "nvidia.com/gpu"


def check_pod(run: RunConfig, name: str) -> None:
    """ConfigError for a pod that would run but not the way the config means; warnings for
    choices that work with a cost the user should know about."""
    _check_qos(run)
    _check_data_paths(run)
    k8s = run.launch.k8s
    if run.checkpoint.local.enabled and k8s.local_volume == "emptyDir":
        log.warning(
            "launch.k8s.local_volume=emptyDir: the local checkpoint tier is deleted with its pod, "
            "so a pod the operator recreates restores from peer replicas or the shared tier only; "
            "the default hostPath (%s) survives pod recreation on the same node",
            local_host_path(k8s, name),
        )


def _check_qos(run: RunConfig) -> None:
    # Requests equal to limits for CPU and memory make the pods Guaranteed: the kubelet evicts
    # them last under node memory pressure (one evicted pod stops every rank until the job
    # restarts from a checkpoint), and the static CPU manager gives exclusive cores only to
    # Guaranteed pods with whole CPUs. With GPU limits alone a pod is BestEffort and the
    # scheduler reserves nothing for its dataloaders, so a GPU job refuses rather than guess
    # the node size; CPU smoke runs (kind, minikube) only warn.
    k8s = run.launch.k8s
    missing = [f"launch.k8s.{key}" for key in ("cpu", "memory") if getattr(k8s, key) is None]
    if not missing:
        return
    keys = " and ".join(missing)
    if run.launch.gpus_per_node > 0:
        raise ConfigError(
            f"{keys} must be set for GPU pods (requests = limits, Guaranteed QoS, so they are "
            f"evicted last): the node's allocatable less its daemons' share, e.g. "
            f"launch.k8s.cpu=96 launch.k8s.memory=1600Gi"
        )
    log.warning(
        "%s not set: the pods are not Guaranteed QoS (evicted first under memory pressure)", keys
    )


def data_mounts(k8s: K8sConfig, local_tier: bool) -> dict[str, str]:
    """Mount path -> what it is, for the volumes that can hold data."""
    mounts = {k8s.shared_mount: f"claim {k8s.shared_pvc}"}
    if local_tier:
        mounts[k8s.local_mount] = f"node-local {k8s.local_volume}"
    return mounts


def _under(path: str, mount: str) -> bool:
    path, mount = posixpath.normpath(path), posixpath.normpath(mount)
    return path == mount or path.startswith(mount.rstrip("/") + "/")


def _check_data_paths(run: RunConfig) -> None:
    data = run.data
    keys: list[tuple[str, str]] = []
    if data.kind == "indexed":
        keys += [(f"data.paths[{i}]", path) for i, path in enumerate(data.paths)]
    if data.tokenizer != "byte" and data.tokenizer_path:
        keys.append(("data.tokenizer_path", data.tokenizer_path))
    if data.cache_dir:
        keys.append(("data.cache_dir", data.cache_dir))
    mounts = data_mounts(run.launch.k8s, run.checkpoint.local.enabled)
    listed = ", ".join(f"{path} ({what})" for path, what in mounts.items())
    for key, path in keys:
        if not path.startswith("/"):
            # Relative paths resolve against the image's working directory, which no volume
            # backs and the config cannot see; data baked into the image is named absolutely
            # (and only warned about, below).
            example = posixpath.join(run.launch.k8s.shared_mount, path)
            if key.startswith("data.paths"):
                example = f"[{example}]"
            raise ConfigError(
                f"{key}={path!r} is relative: in the pod it resolves against the image's "
                f"working directory, on none of the mounted volumes [{listed}]; put it on one "
                f"and give the absolute path, e.g. {key.split('[')[0]}={example}"
            )
        if not any(_under(path, mount) for mount in mounts):
            fate = (
                "the cache is rebuilt in each pod's own filesystem"
                if key == "data.cache_dir"
                else "it must exist in the image"
            )
            log.warning(
                "%s=%s is on none of the pod's mounted volumes [%s]: %s", key, path, listed, fate
            )


def local_host_path(k8s: K8sConfig, name: str) -> str:
    return k8s.local_host_path or f"{HOST_PATH_ROOT}/{k8s.namespace}/{name}"


def pod_spec(
    run: RunConfig,
    name: str,
    config_map: str,
    env: list[dict[str, Any]],
    fetch: bool = False,
    container_name: str = CONTAINER,
    affinity: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``fetch``: an init container brings the newest intact remote step into the shared dir
    when none there verifies (the master's pod: the claim is shared). ``container_name``: the
    name the controller looks for (the training-operator's ``pytorch``, Trainer's ``node``)."""
    k8s = run.launch.k8s
    volumes, mounts = _volumes(run, name, config_map)
    container: dict[str, Any] = {
        "name": container_name,
        "image": k8s.image,
        "command": entry_command(run),
        "env": [dict(var) for var in env],
        "resources": _resources(run),
        "volumeMounts": mounts,
        **remote_env_from(k8s),
    }
    if k8s.capabilities:
        # IPC_LOCK lets NCCL/libibverbs pin (mlock) host memory for RDMA registration.
        container["securityContext"] = {"capabilities": {"add": list(k8s.capabilities)}}
    spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": k8s.termination_grace_s,
        "containers": [container],
        "volumes": volumes,
    }
    if fetch and run.checkpoint.remote.enabled:
        spec["initContainers"] = [fetch_container(run)]
    if k8s.priority_class:
        spec["priorityClassName"] = k8s.priority_class
    if affinity:  # launch.k8s.isolation: nodes that failed on hardware
        spec["affinity"] = affinity
    if k8s.node_selector:
        spec["nodeSelector"] = {str(key): str(value) for key, value in k8s.node_selector.items()}
    if k8s.tolerations:
        # Strings but the seconds: a YAML-typed `value: 1` would fail the pod schema.
        spec["tolerations"] = [
            {key: val if key == "tolerationSeconds" else str(val) for key, val in tol.items()}
            for tol in k8s.tolerations
        ]
    if k8s.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": secret} for secret in k8s.image_pull_secrets]
    return spec


def remote_env_from(k8s: K8sConfig) -> dict[str, Any]:
    return {"envFrom": [{"secretRef": {"name": k8s.remote_secret}}]} if k8s.remote_secret else {}


def fetch_container(run: RunConfig) -> dict[str, Any]:
    """The same selection and verification as the trainer's restore, before it starts."""
    remote, k8s = run.checkpoint.remote, run.launch.k8s
    command = ["python", "-m", "resiliency", "fetch", f"{run.output_dir}/{run.run_id}",
               "--from", str(remote.url), f"--workers={remote.workers}"]  # fmt: skip
    if remote.endpoint_url:
        command.append(f"--endpoint-url={remote.endpoint_url}")
    return {
        "name": "fetch-checkpoint",
        "image": k8s.image,
        "command": command,
        "volumeMounts": [{"name": "shared-ckpt", "mountPath": k8s.shared_mount}],
        **remote_env_from(k8s),
    }


def entry_command(run: RunConfig) -> list[str]:
    state_dir = f"{run.output_dir}/{run.run_id}/{STATE_SUBDIR}"
    return [
        "python",
        "-m",
        "launch.k8s.entry",
        "--launcher",
        run.launch.backend,
        "--retries",
        str(run.launch.k8s.backoff_limit),
        "--state-dir",
        state_dir,
        *(["--standby", f"{run.output_dir}/{run.run_id}"] if run.launch.standby else []),
        "--",
        "-m",
        worker_module(run),
        "--config",
        f"{CONFIG_DIR}/{CONFIG_FILE}",
    ]


def _resources(run: RunConfig) -> dict[str, Any]:
    launch, k8s = run.launch, run.launch.k8s
    amounts: dict[str, Any] = {}
    for key, value in (("cpu", k8s.cpu), ("memory", k8s.memory)):
        if value is not None:
            amounts[key] = str(value)
    if launch.gpus_per_node > 0:
        amounts[GPU_RESOURCE] = launch.gpus_per_node
    amounts.update({str(key): int(count) for key, count in k8s.extended_resources.items()})
    # Requests equal limits for every resource: Guaranteed QoS for cpu/memory (see _check_qos);
    # device-plugin resources cannot be overcommitted, the API server demands request = limit.
    return {"limits": dict(amounts), "requests": dict(amounts)} if amounts else {}


def _volumes(
    run: RunConfig, name: str, config_map: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    k8s = run.launch.k8s
    volumes: list[dict[str, Any]] = [
        {"name": "shared-ckpt", "persistentVolumeClaim": {"claimName": k8s.shared_pvc}},
        # Memory-backed: torch dataloader workers and NCCL's intra-node transport share tensors
        # through /dev/shm, which container runtimes cap at 64 MiB. It is charged to the pod's
        # memory limit, which also bounds its size.
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        {"name": "run-config", "configMap": {"name": config_map}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "shared-ckpt", "mountPath": k8s.shared_mount},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "run-config", "mountPath": CONFIG_DIR, "readOnly": True},
    ]
    if run.checkpoint.local.enabled:
        local: dict[str, Any] = {"emptyDir": {}}
        if k8s.local_volume == "hostPath":
            local = {"hostPath": {"path": local_host_path(k8s, name), "type": "DirectoryOrCreate"}}
        volumes.insert(0, {"name": "local-ckpt", **local})
        mounts.insert(0, {"name": "local-ckpt", "mountPath": k8s.local_mount})
    return volumes, mounts
