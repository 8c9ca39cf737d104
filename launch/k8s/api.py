"""Kubernetes API calls of the k8s adapter (kubernetes client): submit, status, logs, delete."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from launch.k8s import trainjob
from launch.k8s.pod import CONTAINER
from launch.k8s.render import API_VERSION, JOB_NAME_LABEL, KIND, Rendered, config_map_prefix
from recipes import ConfigError
from recipes.config.launch import K8sConfig

log = logging.getLogger(__name__)

GROUP, VERSION = API_VERSION.split("/")
PLURAL = "pytorchjobs"
JOB_LABEL = "training.kubeflow.org/job-name"
REPLICA_TYPE_LABEL = "training.kubeflow.org/replica-type"
REPLICA_INDEX_LABEL = "training.kubeflow.org/replica-index"
TRAINER_GROUP, TRAINER_VERSION = trainjob.API_VERSION.split("/")
TRAINJOBS, RUNTIMES = "trainjobs", "clustertrainingruntimes"
NAMESPACED_RUNTIMES = "trainingruntimes"
# The server refuses a field its CRD does not know instead of dropping it: an older Trainer
# whose JobSet lacks onJobFailureMessagePatterns would otherwise keep the rules without their
# patterns, and its first rule (FailJobSet) would end the job at a planned stop.
STRICT = {"field_validation": "Strict"}
# JobSet's labels on a TrainJob's pods (its JobSet has the TrainJob's name) and the Job's index.
JOBSET_LABEL = "jobset.sigs.k8s.io/jobset-name"
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"


class K8sError(RuntimeError):
    """The cluster refused or could not be reached; the message says what it answered."""


def api_client() -> Any:
    """A client for the cluster: in-cluster when running in a pod, else $KUBECONFIG/~/.kube."""
    try:
        # optional k8s extra
        from kubernetes import client, config
    except ModuleNotFoundError:
        raise K8sError(
            "submitting needs the kubernetes client: pip install 'mcore-recipes[k8s]'"
        ) from None
    configuration = client.Configuration()
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        try:
            config.load_incluster_config(client_configuration=configuration)
            return client.ApiClient(configuration)
        except config.ConfigException as exc:
            log.info("no in-cluster credentials (%s); trying kubeconfig", exc)
    # Passed explicitly: the client reads $KUBECONFIG only once, when it is imported.
    path = os.environ.get("KUBECONFIG") or "~/.kube/config"
    try:
        config.load_kube_config(config_file=path, client_configuration=configuration)
    except (config.ConfigException, OSError) as exc:
        raise K8sError(f"cannot load kubeconfig {path}: {exc}") from None
    return client.ApiClient(configuration)


@contextmanager
def _api_errors(action: str) -> Iterator[None]:
    # optional k8s extra
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    try:
        yield
    except ApiException as exc:
        raise K8sError(
            f"{action}: HTTP {exc.status} {exc.reason}: {_status_message(exc)}"
        ) from None
    except HTTPError as exc:
        raise K8sError(f"{action}: cannot reach the API server: {exc}") from None


def _status_message(exc: Any) -> str:
    try:
        return str(json.loads(exc.body).get("message", exc.body))
    except (TypeError, ValueError, AttributeError):
        return str(exc.body)


def submit(api: Any, rendered: Rendered) -> dict[str, Any]:
    """Create the ConfigMap, then (TrainJob) its runtime, then the job, then make the job the
    ConfigMap's owner; returns the job as the server stored it. What was created is removed
    again when the job is refused."""
    # optional k8s extra
    from kubernetes import client

    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    if rendered.pod_run.launch.k8s.runtime:
        _check_cluster_runtime(custom, rendered.pod_run.launch.k8s)  # before anything exists
    # The ConfigMap first: pods that start before their config volume exists sit in
    # ContainerCreating, and the owner's uid exists only once the job does.
    with _api_errors(f"creating ConfigMap {rendered.namespace}/{rendered.config_map_name}"):
        core.create_namespaced_config_map(rendered.namespace, rendered.config_map)
    kind = rendered.job["kind"]
    try:
        if rendered.runtime is not None:  # before the TrainJob that names it
            _create_runtime(custom, rendered.runtime)
        group, version, plural = _resource(kind)
        try:
            with _api_errors(f"creating {kind} {rendered.namespace}/{rendered.name}"):
                created = custom.create_namespaced_custom_object(
                    group, version, rendered.namespace, plural, rendered.job, **STRICT
                )
        except K8sError:
            if rendered.runtime is not None:
                _delete_runtime(custom, rendered.runtime)
            raise
    except K8sError:
        _delete_config_map(core, rendered.namespace, rendered.config_map_name)
        raise
    _set_owner(core, custom, rendered, created.get("metadata", {}).get("uid"))
    if rendered.uploader is not None:
        # Not owned by the job: the uploader must outlive its pods (k8s delete removes it).
        where = f"Deployment {rendered.namespace}/{rendered.uploader['metadata']['name']}"
        with _api_errors(f"creating {where}"):
            client.AppsV1Api(api).create_namespaced_deployment(
                rendered.namespace, rendered.uploader
            )
    return created


def _resource(kind: str) -> tuple[str, str, str]:
    if kind == trainjob.TRAINJOB:
        return TRAINER_GROUP, TRAINER_VERSION, TRAINJOBS
    return GROUP, VERSION, PLURAL


def _check_cluster_runtime(custom: Any, k8s: K8sConfig) -> None:
    """``launch.k8s.runtime``: the cluster's runtime exists, and (``avoid_tainted``) its pods
    do not tolerate every taint, unless ``launch.k8s.tolerations`` replaces theirs (a runtime
    patch replaces the list whole). A ConfigError: what the user named is wrong."""
    name = str(k8s.runtime)
    try:
        with _api_errors(f"reading ClusterTrainingRuntime {name}"):
            runtime = custom.get_cluster_custom_object(
                TRAINER_GROUP, TRAINER_VERSION, RUNTIMES, name
            )
    except K8sError as exc:
        if "HTTP 404" in str(exc):
            raise ConfigError(
                f"launch.k8s.runtime={name}: this cluster has no ClusterTrainingRuntime of that "
                "name (kubectl get clustertrainingruntimes)"
            ) from None
        log.warning("%s: its tolerations are not checked", exc)
        return
    blanket = trainjob.tolerating_every_taint(runtime)
    if k8s.avoid_tainted and not k8s.tolerations and blanket:
        raise ConfigError(
            f"launch.k8s.runtime={name}: its {', '.join(blanket)} pods tolerate every taint, a "
            "node problem detector's too: name the taints to tolerate in launch.k8s.tolerations "
            "(they replace the runtime's), or set launch.k8s.avoid_tainted=false"
        )


def _create_runtime(custom: Any, runtime: dict[str, Any]) -> None:
    """The submission's own runtime (owned by no TrainJob: ``delete`` removes it by its
    labels, after the TrainJob)."""
    kind, name = runtime["kind"], runtime["metadata"]["name"]
    with _api_errors(f"creating {kind} {name}"):
        if kind == trainjob.NAMESPACED_RUNTIME:
            custom.create_namespaced_custom_object(
                TRAINER_GROUP, TRAINER_VERSION, runtime["metadata"]["namespace"],
                NAMESPACED_RUNTIMES, runtime, **STRICT,
            )  # fmt: skip
        else:
            custom.create_cluster_custom_object(
                TRAINER_GROUP, TRAINER_VERSION, RUNTIMES, runtime, **STRICT
            )


def _delete_runtime(custom: Any, runtime: dict[str, Any]) -> None:
    kind, name = runtime["kind"], runtime["metadata"]["name"]
    try:
        with _api_errors(f"deleting {kind} {name}"):
            if kind == trainjob.NAMESPACED_RUNTIME:
                custom.delete_namespaced_custom_object(
                    TRAINER_GROUP, TRAINER_VERSION, runtime["metadata"]["namespace"],
                    NAMESPACED_RUNTIMES, name,
                )  # fmt: skip
            else:
                custom.delete_cluster_custom_object(TRAINER_GROUP, TRAINER_VERSION, RUNTIMES, name)
    except K8sError as exc:
        log.warning("%s", exc)


def _delete_runtimes(custom: Any, namespace: str, name: str, ref: dict[str, Any]) -> None:
    """Every submission's runtime of TrainJob ``name`` (a resubmission renders one of its
    own), of the kind its runtimeRef names; none where that is the cluster's own runtime
    (``launch.k8s.runtime``): we created none, and deleting cluster-scoped objects by label
    needs rights a namespace's user seldom has."""
    selector = f"{JOB_NAME_LABEL}={name}"
    ours = trainjob.runtime_name(str(ref.get("kind")), namespace, config_map_prefix(name))
    try:
        if ref.get("kind") == trainjob.NAMESPACED_RUNTIME:
            with _api_errors(f"deleting TrainingRuntimes {namespace}/{selector}"):
                custom.delete_collection_namespaced_custom_object(
                    TRAINER_GROUP, TRAINER_VERSION, namespace, NAMESPACED_RUNTIMES,
                    label_selector=selector,
                )  # fmt: skip
        elif str(ref.get("name", "")).startswith(ours):
            selector += f",{trainjob.NAMESPACE_LABEL}={namespace}"  # cluster-scoped
            with _api_errors(f"deleting ClusterTrainingRuntimes {selector}"):
                custom.delete_collection_cluster_custom_object(
                    TRAINER_GROUP, TRAINER_VERSION, RUNTIMES, label_selector=selector
                )
    except K8sError as exc:
        log.warning("%s", exc)


def _set_owner(core: Any, custom: Any, rendered: Rendered, uid: str | None) -> None:
    """Owned by the job, the ConfigMap and a namespaced runtime go with it however the job is
    deleted (garbage collector; Trainer's finalizer keeps a runtime while a TrainJob uses it).
    Only metadata changes: allowed on an immutable ConfigMap."""
    namespace, runtime = rendered.namespace, rendered.runtime or {}
    owned: dict[str, Callable[[list[dict[str, Any]]], Any]] = {
        f"ConfigMap {namespace}/{rendered.config_map_name}": lambda patch: (
            core.patch_namespaced_config_map(rendered.config_map_name, namespace, patch)
        )
    }
    if runtime.get("kind") == trainjob.NAMESPACED_RUNTIME:
        name = runtime["metadata"]["name"]
        # The client sends custom objects' patches as merge patches only: an object body,
        # whose list replaces the (absent) one.
        owned[f"TrainingRuntime {namespace}/{name}"] = lambda patch: (
            custom.patch_namespaced_custom_object(
                TRAINER_GROUP, TRAINER_VERSION, namespace, NAMESPACED_RUNTIMES, name,
                {"metadata": {"ownerReferences": patch[0]["value"]}},
            )
        )  # fmt: skip
    hint = f"it outlives the job; `python -m launch k8s delete {rendered.name}` removes it"
    kind = rendered.job["kind"]
    if not uid:
        log.warning(
            "the API server returned the %s without a uid: %s not owned; %s",
            kind, " and ".join(owned), hint,
        )  # fmt: skip
        return
    # Neither controller (the operator controls nothing here) nor blockOwnerDeletion: that
    # needs update rights on pytorchjobs/finalizers, which users who may create jobs often lack.
    owner = {"apiVersion": rendered.job["apiVersion"], "kind": kind, "name": rendered.name,
             "uid": uid}  # fmt: skip
    # A JSON Patch (a list body): every supported client version sends it as one.
    patch = [{"op": "add", "path": "/metadata/ownerReferences", "value": [owner]}]
    for where, apply in owned.items():
        try:
            with _api_errors(f"setting the owner of {where}"):
                apply(patch)
        except K8sError as exc:
            log.warning("%s; %s", exc, hint)


def get_job(api: Any, namespace: str, name: str) -> dict[str, Any]:
    """The job named ``name``: a PyTorchJob, else a TrainJob of that name."""
    # optional k8s extra
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    custom = client.CustomObjectsApi(api)
    try:
        return custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    except ApiException as exc:
        # 403: a cluster with Trainer only (no PyTorchJob, no rights to one) answers so
        if exc.status not in (403, 404):
            raise K8sError(
                f"reading PyTorchJob {namespace}/{name}: HTTP {exc.status} {exc.reason}: "
                f"{_status_message(exc)}"
            ) from None
    with _api_errors(f"reading PyTorchJob or TrainJob {namespace}/{name}"):
        return custom.get_namespaced_custom_object(
            TRAINER_GROUP, TRAINER_VERSION, namespace, TRAINJOBS, name
        )


def replica_logs(
    api: Any, namespace: str, name: str, replica: str, index: int, tail: int | None = None
) -> str:
    """Logs of the trainer container of one replica's newest pod (a TrainJob's node
    ``index``: its pods are one replicated job's, whatever ``replica`` says)."""
    # optional k8s extra
    from kubernetes import client

    core = client.CoreV1Api(api)
    container = CONTAINER
    if get_job(api, namespace, name).get("kind") == trainjob.TRAINJOB:
        selector = f"{JOBSET_LABEL}={name},{COMPLETION_INDEX_LABEL}={index}"
        container = trainjob.NODE
    else:
        selector = (
            f"{JOB_LABEL}={name},{REPLICA_TYPE_LABEL}={replica.lower()},"
            f"{REPLICA_INDEX_LABEL}={index}"
        )
    with _api_errors(f"listing pods of {namespace}/{name}"):
        pods = core.list_namespaced_pod(namespace, label_selector=selector).items
    if not pods:
        raise K8sError(
            f"no pod of {namespace}/{name} matches {selector} (not scheduled yet, or cleaned up)"
        )
    pod = max(pods, key=lambda p: str(p.metadata.creation_timestamp or ""))
    with _api_errors(f"reading logs of pod {namespace}/{pod.metadata.name}"):
        # The raw body: kubernetes 36's deserializer returns str(bytes), "b'...'", for logs.
        reply = core.read_namespaced_pod_log(
            pod.metadata.name, namespace, container=container, tail_lines=tail,
            _preload_content=False,
        )  # fmt: skip
    return reply.data.decode(errors="replace")


def delete(api: Any, namespace: str, name: str) -> str:
    """Delete the job (its pods and owned ConfigMap go with it; a TrainJob's runtimes are
    deleted by their labels) and any ConfigMap rendered for a job of this name that is not
    owned (its owner could not be set). Returns the job's kind."""
    # optional k8s extra
    from kubernetes import client

    custom = client.CustomObjectsApi(api)
    job = get_job(api, namespace, name)
    kind = job.get("kind", KIND)
    group, version, plural = _resource(kind)
    with _api_errors(f"deleting {kind} {namespace}/{name}"):
        custom.delete_namespaced_custom_object(
            group, version, namespace, plural, name, propagation_policy="Background"
        )
    if kind == trainjob.TRAINJOB:
        _delete_runtimes(custom, namespace, name, job.get("spec", {}).get("runtimeRef", {}))
    selector = f"{JOB_NAME_LABEL}={name}"
    try:
        with _api_errors(f"deleting ConfigMaps {namespace}/{selector}"):
            client.CoreV1Api(api).delete_collection_namespaced_config_map(
                namespace, label_selector=selector
            )
        # checkpoint.remote's uploader, if the job had one (its last pass is lost with it:
        # `python -m resiliency upload <run dir>` finishes what it had not copied).
        with _api_errors(f"deleting Deployments {namespace}/{selector}"):
            client.AppsV1Api(api).delete_collection_namespaced_deployment(
                namespace, label_selector=selector
            )
    except K8sError as exc:
        log.warning("%s", exc)
    return kind


def _delete_config_map(core: Any, namespace: str, name: str) -> None:
    try:
        with _api_errors(f"deleting ConfigMap {namespace}/{name}"):
            core.delete_namespaced_config_map(name, namespace)
    except K8sError as exc:
        log.warning("%s", exc)
