"""Kubeflow Trainer v2 (``launch.k8s.api=trainjob``): a TrainJob and the runtime it runs on,
rendered as pure functions of the validated config.

Trainer v2 replaced the training-operator's PyTorchJob with a ``trainer.kubeflow.org/v1alpha1``
TrainJob that references a runtime: a JobSet template. Each submission gets a runtime of its
own (``launch.k8s.runtime_scope``): a TrainingRuntime in the job's namespace, or a
ClusterTrainingRuntime named after the namespace and the job (cluster-scoped). It holds the
same pod as the PyTorchJob's: Guaranteed QoS, GPUs and extended resources, ``/dev/shm``, the
shared claim, the local tier, the health check, the entry point's exit-code mapping.

Trainer's torch plugin configures the replicated job and the container named ``node`` (it
sets ``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR`` and
``PET_MASTER_PORT`` there, which torchrun and ft_launcher read), and sizes the job from the
TrainJob's ``trainer.numNodes``.

How a failure is answered (the whole set restarts: the source document's safe default):

  entry point's container exit            Job (podFailurePolicy)      JobSet (failurePolicy)
  1-127: "do not retry", budget used up   FailJob, rule 0             FailJobSet
  128+75, 128+15: a planned stop (drain)  FailJob, rule 1             RestartJobSet, uncounted
  any other 128-255: infrastructure       BackoffLimitExceeded (0)    RestartJobSet, counted
                                                                      (maxRestarts)

JobSet matches a Job's failure reason and message, not exit codes, so the exit codes are
turned into reasons by the Job's podFailurePolicy (the Job controller's message names the rule
that matched: "... matching FailJob rule at index N").
"""

from __future__ import annotations

from typing import Any

from launch.k8s.pod import pod_spec
from launch.torchrun import SIGNAL_BASE
from pretrain.context import exit_codes
from recipes import RunConfig

GROUP = "trainer.kubeflow.org"
API_VERSION = f"{GROUP}/v1alpha1"
TRAINJOB, RUNTIME = "TrainJob", "ClusterTrainingRuntime"
NAMESPACED_RUNTIME = "TrainingRuntime"  # launch.k8s.runtime_scope=namespace
VOLCANO_QUEUE_ANNOTATION = "scheduling.volcano.sh/queue-name"  # launch.k8s.gang_scheduler
NODE = "node"  # the replicated job and the container Trainer's torch plugin configures
ANCESTOR_LABEL = f"{GROUP}/trainjob-ancestor-step"  # marks the job that runs the trainer
# Container exits the entry point (launch.k8s.entry) gives a planned stop: the agent stopped
# by SIGTERM (a drain, an eviction) or the ranks' requeue code after an emergency save.
PLANNED_EXITS = sorted({SIGNAL_BASE + 15, SIGNAL_BASE + exit_codes.REQUEUE})
PERMANENT_EXITS = list(range(1, SIGNAL_BASE))  # the entry point's "do not retry" range
DO_NOT_RETRY_RULE, PLANNED_RULE = 0, 1  # podFailurePolicy rule indexes


NAMESPACE_LABEL = "mcore-recipes/namespace"  # the runtime is cluster-scoped: whose job it is


def runtime_kind(run: RunConfig) -> str:
    """The kind of the run's own runtime (``launch.k8s.runtime_scope``)."""
    return NAMESPACED_RUNTIME if run.launch.k8s.runtime_scope == "namespace" else RUNTIME


def runtime_name(kind: str, namespace: str, config_map: str) -> str:
    """The submission's own runtime, named like the ConfigMap its pods mount (per submission:
    a resubmission never finds an earlier one in its way while garbage collection catches
    up); a cluster-scoped one also by the namespace."""
    if kind == NAMESPACED_RUNTIME:
        return config_map
    return f"{namespace}-{config_map}"[:253].rstrip("-.")


def render_runtime(
    run: RunConfig,
    job: str,
    labels: dict[str, str],
    pod_labels: dict[str, str],
    config_map: str,
    env: list[dict[str, Any]],
    affinity: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The run's runtime: a JobSet template of one replicated job, ``node``, whose Job runs
    one pod per node (Trainer sets the count from the TrainJob)."""
    pod = pod_spec(run, job, config_map, env, fetch=True, container_name=NODE, affinity=affinity)
    pod["restartPolicy"] = "Never"  # podFailurePolicy needs it; a failure restarts the set
    k8s = run.launch.k8s
    if k8s.gang_scheduler == "volcano":  # Trainer builds the PodGroup, not the pods' scheduler
        pod["schedulerName"] = "volcano"
    if "initContainers" in pod:
        pod["initContainers"] = [_first_node_only(c) for c in pod["initContainers"]]
    job_spec = {
        "completionMode": "Indexed",  # PET_NODE_RANK is the completion index
        "backoffLimit": 0,  # a failed pod fails the Job: the JobSet restarts the whole set
        "podFailurePolicy": pod_failure_policy(),
        "template": {"metadata": {"labels": dict(pod_labels)}, "spec": pod},
    }
    namespace, kind = run.launch.k8s.namespace, runtime_kind(run)
    metadata: dict[str, Any] = {"name": runtime_name(kind, namespace, config_map)}
    if kind == NAMESPACED_RUNTIME:
        metadata.update(namespace=namespace, labels=dict(labels))
    else:
        metadata["labels"] = {**labels, NAMESPACE_LABEL: namespace}
    jobset: dict[str, Any] = {
        "spec": {
            "failurePolicy": failure_policy(run),
            "replicatedJobs": [
                {
                    "name": NODE,
                    "replicas": 1,
                    "template": {
                        "metadata": {"labels": {ANCESTOR_LABEL: "trainer"}},
                        "spec": job_spec,
                    },
                }
            ],
        }
    }
    spec: dict[str, Any] = {"mlPolicy": {"numNodes": run.launch.nodes, "torch": {}}}
    if k8s.gang_scheduler == "volcano":
        # One PodGroup of every node's pod, priority from their priorityClassName; Trainer
        # reads the queue from the template's annotations.
        spec["podGroupPolicy"] = {"volcano": {}}
        if k8s.queue:
            jobset["metadata"] = {"annotations": {VOLCANO_QUEUE_ANNOTATION: k8s.queue}}
    spec["template"] = jobset
    return {"apiVersion": API_VERSION, "kind": kind, "metadata": metadata, "spec": spec}


def tolerating_every_taint(runtime: dict[str, Any]) -> list[str]:
    """The replicated jobs of a (cluster's) runtime whose pods tolerate every taint: a
    toleration without a key."""
    jobs = runtime.get("spec", {}).get("template", {}).get("spec", {}).get("replicatedJobs", [])

    def tolerations(job: dict[str, Any]) -> list[dict[str, Any]]:
        pod = job.get("template", {}).get("spec", {}).get("template", {}).get("spec", {})
        return pod.get("tolerations") or []

    return [job.get("name", "?") for job in jobs if any(not t.get("key") for t in tolerations(job))]


def node_pod(runtime: dict[str, Any]) -> dict[str, Any]:
    """The pod spec of a rendered runtime's ``node`` job."""
    [node_job] = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    return node_job["template"]["spec"]["template"]["spec"]


def render_trainjob(
    run: RunConfig, job: str, labels: dict[str, str], runtime: str
) -> dict[str, Any]:
    """The TrainJob: its size and its runtime. Kueue admits it by the queue label (and takes
    its priority from the pods' priorityClassName); Kueue suspends it itself until then.
    With ``launch.k8s.gang_scheduler=volcano`` the queue is Volcano's, on the runtime."""
    return {
        "apiVersion": API_VERSION,
        "kind": TRAINJOB,
        "metadata": {"name": job, "namespace": run.launch.k8s.namespace, "labels": labels},
        "spec": {
            "runtimeRef": {"name": runtime, "apiGroup": GROUP, "kind": runtime_kind(run)},
            "trainer": {
                "numNodes": run.launch.nodes,
                "numProcPerNode": run.launch.nproc_per_node,
            },
        },
    }


MANAGER = "mcore-recipes.launch"  # our entry in a TrainJob's runtimePatches
# What a runtimePatch may set on the pod and on the trainer container (Trainer's schema).
# Not initContainers: a patch may only amend those the runtime already has (Trainer's webhook).
PATCHABLE_POD = ("affinity", "imagePullSecrets", "nodeSelector",
                 "terminationGracePeriodSeconds", "tolerations", "volumes")  # fmt: skip
PATCHABLE_CONTAINER = ("volumeMounts", "securityContext")


def on_existing_runtime(
    trainjob: dict[str, Any], pod: dict[str, Any], runtime: str
) -> tuple[dict[str, Any], list[str]]:
    """The TrainJob made to run on the cluster's runtime ``runtime``: the trainer container's
    image, command, env and resources in ``spec.trainer``, the rest of ``pod`` (the pod our own
    runtime would hold) in a runtime patch; and what of ``pod`` the runtime decides instead."""
    [container] = pod["containers"]
    spec = {**trainjob["spec"], "runtimeRef": {"name": runtime, "apiGroup": GROUP, "kind": RUNTIME}}
    spec["trainer"] = {**spec["trainer"], "image": container["image"],
                       "command": container["command"], "env": container["env"]}  # fmt: skip
    if container.get("resources"):
        spec["trainer"]["resourcesPerNode"] = container["resources"]
    patch_container = {"name": NODE, **{k: container[k] for k in PATCHABLE_CONTAINER
                                        if k in container}}  # fmt: skip
    patch_pod = {k: pod[k] for k in PATCHABLE_POD if k in pod}
    patch_pod["containers"] = [patch_container]
    node_job = {"name": NODE, "template": {"spec": {"template": {"spec": patch_pod}}}}
    spec["runtimePatches"] = [
        {"manager": MANAGER, "trainingRuntimeSpec": {"template": {"spec": {
            "replicatedJobs": [node_job]
        }}}}
    ]  # fmt: skip
    dropped = sorted(set(pod) - set(PATCHABLE_POD) - {"containers", "restartPolicy"})
    return {**trainjob, "spec": spec}, dropped


def pod_failure_policy() -> dict[str, Any]:
    """Exit codes into Job failure reasons the JobSet's rules can match (module docstring)."""
    return {
        "rules": [
            {
                "action": "FailJob",
                "onExitCodes": {"containerName": NODE, "operator": "In", "values": values},
            }
            for values in (PERMANENT_EXITS, PLANNED_EXITS)
        ]
    }


def failure_policy(run: RunConfig) -> dict[str, Any]:
    """The JobSet's answer to a failed Job: fail, restart uncounted, or restart counted."""
    on_rule = "PodFailurePolicy"
    return {
        "maxRestarts": run.launch.k8s.backoff_limit,
        "restartStrategy": "Recreate",
        "rules": [
            {
                "name": "do_not_retry",
                "action": "FailJobSet",
                "onJobFailureReasons": [on_rule],
                "onJobFailureMessagePatterns": [f"rule at index {DO_NOT_RETRY_RULE}$"],
            },
            {
                "name": "planned_stop",
                "action": "RestartJobSetAndIgnoreMaxRestarts",
                "onJobFailureReasons": [on_rule],
                "onJobFailureMessagePatterns": [f"rule at index {PLANNED_RULE}$"],
            },
            {
                "name": "infrastructure",
                "action": "RestartJobSet",
                "onJobFailureReasons": ["BackoffLimitExceeded"],
            },
        ],
    }


def _first_node_only(container: dict[str, Any]) -> dict[str, Any]:
    """An init container every pod of the Job shares, run by the first node's pod only (the
    claim is shared: one fetch, as the PyTorchJob's master does)."""
    script = 'if [ "${JOB_COMPLETION_INDEX:-0}" = 0 ]; then exec "$@"; fi'
    return {**container, "command": ["sh", "-c", script, container["name"], *container["command"]]}
