"""Render one run as Kubernetes objects: a ConfigMap with the pinned config and a PyTorchJob
(or, with ``launch.k8s.api=trainjob``, a TrainJob and its runtime:
:mod:`launch.k8s.trainjob`).

Pure functions of the validated config (no cluster access, no clock): the same plan, code commit
and submission id always give the same objects, which is what the golden tests rely on.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass
from typing import Any

import yaml

from launch.common import LaunchPlan, rank_env, uploader_args
from launch.k8s import isolation, trainjob
from launch.k8s.pod import CONFIG_FILE, check_pod, pod_spec, remote_env_from
from recipes import ConfigError, RunConfig, to_yaml
from recipes.config.launch import K8sConfig

log = logging.getLogger(__name__)

API_VERSION, KIND = "kubeflow.org/v1", "PyTorchJob"
LABEL = "mcore-recipes/"
JOB_NAME_LABEL = f"{LABEL}job-name"  # on the ConfigMap: `k8s delete` finds it by this
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
UPLOADER_LABEL = f"{LABEL}uploader"  # the uploader Deployment's selector
# The wrapper needs this long after torchrun's workers stop to record the outcome and exit.
GRACE_MARGIN_S = 15
_ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")


@dataclass(frozen=True)
class Rendered:
    name: str
    namespace: str
    pod_run: RunConfig  # the config the pods load: output_dir is the shared mount
    config_map: dict[str, Any]
    job: dict[str, Any]  # the PyTorchJob, or the TrainJob (launch.k8s.api)
    uploader: dict[str, Any] | None = None  # checkpoint.remote: a Deployment of its own
    runtime: dict[str, Any] | None = None  # the TrainJob's own runtime (namespaced or cluster)

    @property
    def objects(self) -> list[dict[str, Any]]:
        """In the order they are created: the runtime before the TrainJob that names it."""
        runtime = [self.runtime] if self.runtime else []
        return [self.config_map, *runtime, self.job, *([self.uploader] if self.uploader else [])]

    @property
    def config_map_name(self) -> str:
        return self.config_map["metadata"]["name"]


def render(plan: LaunchPlan, submission: str, code_commit: str | None) -> Rendered:
    """ConfigError for settings that cannot work on a cluster; otherwise the two objects."""
    k8s = plan.run.launch.k8s
    if not k8s.image:
        raise ConfigError(
            "launch.k8s.image is required: the container image with this repo and "
            "its dependencies installed (e.g. launch.k8s.image=registry/mcore:tag)"
        )
    if not k8s.shared_pvc:
        raise ConfigError(
            "launch.k8s.shared_pvc is required: the ReadWriteMany claim that holds "
            "checkpoints, so they outlive the pod and its node"
        )
    _check_grace(plan.run)
    _check_env(k8s)
    if k8s.runtime and plan.run.checkpoint.remote.enabled:
        raise ConfigError(
            f"launch.k8s.runtime={k8s.runtime} with checkpoint.remote: a TrainJob cannot add "
            "the fetch init container or a Secret's variables (envFrom) to a runtime it does "
            "not render; drop launch.k8s.runtime (a runtime of the run's own)"
        )
    name = job_name(plan.run)
    pod_run = pod_paths(plan.run, k8s)
    check_pod(pod_run, name)
    labels = run_labels(plan.run, submission)
    cm_name = config_map_name(name, submission)
    cm_labels = {**labels, JOB_NAME_LABEL: name}
    config_map = render_config_map(cm_name, k8s.namespace, cm_labels, to_yaml(pod_run))
    env = _env(pod_run, name, submission, code_commit)
    uploader = render_uploader(pod_run, name, labels)
    avoid = isolation.avoided_nodes(plan.run, plan.run_dir)
    affinity = isolation.anti_affinity(avoid) if avoid else None
    if k8s.api == "trainjob":
        runtime = trainjob.render_runtime(
            pod_run, name, {**labels_without_queue(labels), JOB_NAME_LABEL: name},
            labels_without_queue(labels), cm_name, env, affinity,
        )  # fmt: skip
        job = trainjob.render_trainjob(pod_run, name, labels, runtime["metadata"]["name"])
        if k8s.runtime:
            pod = trainjob.node_pod(runtime)
            job, dropped = trainjob.on_existing_runtime(job, pod, k8s.runtime)
            log.warning(
                "launch.k8s.runtime=%s: restarts follow its failure policy, not the entry "
                "point's exit-code mapping%s",
                k8s.runtime,
                f"; it also decides {', '.join(dropped)} (a TrainJob cannot set them)"
                if dropped
                else "",
            )
            return Rendered(name, k8s.namespace, pod_run, config_map, job, uploader)
        return Rendered(name, k8s.namespace, pod_run, config_map, job, uploader, runtime)
    job = render_job(pod_run, name, labels, cm_name, env, affinity)
    return Rendered(name, k8s.namespace, pod_run, config_map, job, uploader)


def labels_without_queue(labels: dict[str, str]) -> dict[str, str]:
    """Kueue admits the job as one workload; the queue label on anything else (its pods, where
    Kueue's pod integration is on; the runtime) would queue it a second time."""
    return {k: v for k, v in labels.items() if k not in (KUEUE_QUEUE_LABEL, KUEUE_PRIORITY_LABEL)}


def uploader_name(job: str) -> str:
    return f"{job}-uploader"


def render_uploader(run: RunConfig, name: str, labels: dict[str, str]) -> dict[str, Any] | None:
    """checkpoint.remote: the uploader as a Deployment, not a sidecar: a sidecar dies with a
    force-deleted pod, this one outlives the job's pods (and restarts on its own if it dies).
    It reads the shared claim only; `python -m launch k8s delete` removes it with the job."""
    args = uploader_args(run, f"{run.output_dir}/{run.run_id}", follow=True)
    if args is None:
        return None
    k8s = run.launch.k8s
    selector = {UPLOADER_LABEL: label_value(name)}
    container = {
        "name": "uploader",
        "image": k8s.image,
        "command": ["python", *args],
        "volumeMounts": [{"name": "shared-ckpt", "mountPath": k8s.shared_mount}],
        "resources": {"requests": {"cpu": "1", "memory": "2Gi"}},
        **remote_env_from(k8s),
    }
    spec: dict[str, Any] = {
        "containers": [container],
        "volumes": [
            {"name": "shared-ckpt", "persistentVolumeClaim": {"claimName": k8s.shared_pvc}}
        ],
        "terminationGracePeriodSeconds": 60,  # SIGTERM: it finishes the object in flight
    }
    if k8s.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": secret} for secret in k8s.image_pull_secrets]
    pod_labels = labels_without_queue(labels)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": uploader_name(name),
            "namespace": k8s.namespace,
            "labels": {**labels, JOB_NAME_LABEL: name},
        },  # fmt: skip
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": selector},
            "template": {"metadata": {"labels": {**pod_labels, **selector}}, "spec": spec},
        },
    }


def pod_paths(run: RunConfig, k8s: K8sConfig) -> RunConfig:
    """Inside the pod, persistent checkpoints live on the shared claim, the local tier on the
    node-local volume."""
    checkpoint = run.checkpoint
    if checkpoint.local.enabled:
        local = dataclasses.replace(checkpoint.local, dir=k8s.local_mount)
        checkpoint = dataclasses.replace(checkpoint, local=local)
    return dataclasses.replace(run, output_dir=k8s.shared_mount, checkpoint=checkpoint)


def config_map_name(job: str, submission: str) -> str:
    """Unique per submission: a resubmit never collides with a ConfigMap that is still there
    (garbage collection of a deleted job's ConfigMap is asynchronous)."""
    suffix = re.sub(r"[^a-z0-9]+", "-", submission.lower()).strip("-") or "0"
    return f"{config_map_prefix(job)}{suffix}"[:253].rstrip("-")


def config_map_prefix(job: str) -> str:
    """What the name of every submission's ConfigMap of ``job`` starts with."""
    return f"{job}-config-"


def _check_grace(run: RunConfig) -> None:
    grace, save = run.launch.k8s.termination_grace_s, run.resiliency.emergency_save_timeout_s
    if run.resiliency.preemption and grace < save + GRACE_MARGIN_S:
        raise ConfigError(
            f"launch.k8s.termination_grace_s={grace} is too short: the kubelet kills the pod "
            f"{grace}s after SIGTERM, but the emergency save may take "
            f"resiliency.emergency_save_timeout_s={save:g}s (+{GRACE_MARGIN_S}s to exit). "
            f"Raise the grace period or lower the timeout."
        )


def _check_env(k8s: K8sConfig) -> None:
    bad = [key for key in k8s.env if not _ENV_NAME.fullmatch(str(key))]
    if bad:
        raise ConfigError(f"launch.k8s.env: {bad} are not valid environment variable names")
    reserved = [key for key in k8s.env if str(key).startswith("PET_")]
    if reserved:
        raise ConfigError(
            f"launch.k8s.env: {reserved} are set by the controller (the node's rank, the "
            "group's size and address, which torchrun reads as PET_*): drop them"
        )


def job_name(run: RunConfig) -> str:
    """launch.k8s.job_name as given, else run_id made a DNS-1035 label short enough that the
    operator's pod and service names (``<name>-worker-<i>``; JobSet's
    ``<name>-node-0-<i>-<5 random>``) stay within 63 characters."""
    nodes = run.launch.nodes
    if run.launch.k8s.api == "trainjob":
        suffix = f"-{trainjob.NODE}-0-{nodes - 1}-xxxxx"
    else:
        suffix = max("-master-0", f"-worker-{nodes - 2}" if nodes > 1 else "", key=len)
    limit = 63 - len(suffix)
    explicit = run.launch.k8s.job_name
    if explicit is not None:
        if not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", explicit) or len(explicit) > limit:
            raise ConfigError(
                f"launch.k8s.job_name={explicit!r} must be lowercase letters, "
                f"digits and '-', start with a letter, end alphanumeric, and have "
                f"at most {limit} characters (pod names append {suffix!r})"
            )
        return explicit
    name = re.sub(r"[^a-z0-9]+", "-", run.run_id.lower()).strip("-")
    if name and not name[0].isalpha():
        name = f"run-{name}"
    name = name[:limit].rstrip("-")
    if not name:
        raise ConfigError(f"run_id={run.run_id!r} gives no valid job name; set launch.k8s.job_name")
    return name


def label_value(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text)[:63].strip("-_.")


def run_labels(run: RunConfig, submission: str) -> dict[str, str]:
    labels = {
        f"{LABEL}run-id": label_value(run.run_id),
        f"{LABEL}model": label_value(run.model.name),
        f"{LABEL}submission": label_value(submission),
    }
    if run.launch.k8s.queue and run.launch.k8s.gang_scheduler != "volcano":
        # Kueue admits jobs by this label; Volcano reads runPolicy.schedulingPolicy.queue (a
        # TrainJob's runtime gets Volcano's queue annotation instead: launch.k8s.trainjob).
        labels[KUEUE_QUEUE_LABEL] = label_value(run.launch.k8s.queue)
    if run.launch.k8s.kueue_priority_class:
        labels[KUEUE_PRIORITY_LABEL] = run.launch.k8s.kueue_priority_class
    return labels


def render_config_map(
    name: str, namespace: str, labels: dict[str, str], config_yaml: str
) -> dict[str, Any]:
    # Why a ConfigMap and not the file on the PVC: the pods must not depend on the submitting
    # host seeing the claim, and an immutable per-submission object cannot be rewritten by a
    # later submission of the same run while this one is still restarting pods from it. Once
    # the job exists the ConfigMap gets an ownerReference to it (launch.k8s.api.submit), so
    # deleting the job by any means deletes the ConfigMap too.
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "immutable": True,
        "data": {CONFIG_FILE: config_yaml},
    }


def render_job(
    run: RunConfig,
    name: str,
    labels: dict[str, str],
    config_map: str,
    env: list[dict[str, Any]],
    affinity: dict[str, Any] | None = None,
) -> dict[str, Any]:
    launch, k8s = run.launch, run.launch.k8s
    pod_labels = labels_without_queue(labels)
    pod = {"run": run, "name": name, "config_map": config_map, "env": env, "affinity": affinity}
    replicas = {"Master": _replica(1, pod_labels, fetch=True, **pod)}
    if launch.nodes > 1:
        replicas["Worker"] = _replica(launch.nodes - 1, pod_labels, **pod)
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name, "namespace": k8s.namespace, "labels": dict(labels)},
        "spec": {
            "nprocPerNode": str(launch.nproc_per_node),
            "runPolicy": _run_policy(run),
            "pytorchReplicaSpecs": replicas,
        },
    }


def _run_policy(run: RunConfig) -> dict[str, Any]:
    k8s = run.launch.k8s
    scheduling: dict[str, Any] = {"minAvailable": run.launch.nodes}  # gang: all pods or none
    if k8s.queue:
        scheduling["queue"] = k8s.queue
    if k8s.priority_class:
        scheduling["priorityClass"] = k8s.priority_class
    # backoffLimit is recorded for tools that read it, but the operator applies it only to
    # OnFailure/Always replicas; with ExitCode the retry budget is kept by launch.k8s.entry.
    # cleanPodPolicy Running frees GPUs held by surviving pods once the job ends, and keeps
    # the failed pods so `python -m launch k8s logs` can still read them.
    return {
        "backoffLimit": k8s.backoff_limit,
        "cleanPodPolicy": "Running",
        "schedulingPolicy": scheduling,
    }


def _replica(
    count: int,
    labels: dict[str, str],
    *,
    run: RunConfig,
    name: str,
    config_map: str,
    env: list[dict[str, Any]],
    affinity: dict[str, Any] | None,
    fetch: bool = False,
) -> dict[str, Any]:
    # ExitCode: the operator recreates a pod whose container exited 128-255 (on another node if
    # need be) and fails the job for 1-127. launch.k8s.entry maps trainer exit codes onto that.
    return {
        "replicas": count,
        "restartPolicy": "ExitCode",
        "template": {
            "metadata": {"labels": dict(labels)},
            "spec": pod_spec(run, name, config_map, env, fetch=fetch, affinity=affinity),
        },
    }


def _env(
    run: RunConfig, name: str, submission: str, code_commit: str | None
) -> list[dict[str, Any]]:
    k8s = run.launch.k8s
    values: dict[str, str] = {}
    if code_commit:
        values["MCORE_RECIPES_CODE_COMMIT"] = code_commit
    if "@sha256:" in k8s.image:
        values["MCORE_RECIPES_IMAGE_DIGEST"] = k8s.image.split("@", 1)[1]
    values["MCORE_RECIPES_JOB_ID"] = f"{name}-{submission}"  # lease owner id; retry-budget key
    # torchrun SIGKILLs workers 30 s after SIGTERM by default: too soon for an emergency save.
    shutdown_s = max(k8s.termination_grace_s - GRACE_MARGIN_S, 0)
    values["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(shutdown_s)
    values["PYTHONUNBUFFERED"] = "1"
    values.update(rank_env(run))
    values.update({str(key): str(value) for key, value in k8s.env.items()})
    env: list[dict[str, Any]] = [{"name": key, "value": value} for key, value in values.items()]
    # The node's name for its health report (resiliency.monitor.health): the pod name changes with
    # every recreation, the node is what an operator cordons.
    node = {"fieldRef": {"fieldPath": "spec.nodeName"}}
    return [*env, {"name": "MCORE_RECIPES_NODE", "valueFrom": node}]


class _Dumper(yaml.SafeDumper):
    """Multi-line strings as literal blocks (the embedded config stays readable); no aliases."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _str)


def to_manifest_yaml(objects: list[dict[str, Any]]) -> str:
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, default_flow_style=False)
