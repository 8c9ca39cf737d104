"""Validate the Trainer v2 objects (:mod:`launch.k8s.trainjob`) offline, as the API server,
Trainer's and JobSet's webhooks and the Job API would.

Each object is checked against its CRD's ``openAPIV3Schema`` shipped in this package
(``launch/k8s/schemas/``, copied unchanged: kubeflow/trainer ``manifests/base/crds/`` at
8c0f5059bd51, kubernetes-sigs/jobset ``config/components/crd/bases/`` at 08dfbdfd6827,
Apache-2.0), the runtime's embedded JobSet spec against the JobSet CRD's own ``spec`` too.
The CRDs' CEL rules (``x-kubernetes-validations``) are not evaluated by the schema check:
the ones a rendered object could break are re-done here by hand, with the webhooks' checks
that no schema expresses (a TrainJob that breaks those is accepted and never runs a pod).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from launch.k8s import trainjob
from launch.k8s.schema import (
    DNS1035_LABEL,
    DNS1123_SUBDOMAIN,
    label_errors,
    metadata_errors,
    pod_errors,
    schema_errors,
    shipped_crd,
)

TRAINJOB_CRD = "trainer.kubeflow.org_trainjobs.yaml"
RUNTIME_CRDS = {
    trainjob.RUNTIME: "trainer.kubeflow.org_clustertrainingruntimes.yaml",
    trainjob.NAMESPACED_RUNTIME: "trainer.kubeflow.org_trainingruntimes.yaml",
}
JOBSET_CRD = "jobset.x-k8s.io_jobsets.yaml"
VERSION, JOBSET_VERSION = "v1alpha1", "v1alpha2"
# The Job failure reasons JobSet's webhook accepts in a failure-policy rule.
JOB_FAILURE_REASONS = (
    "BackoffLimitExceeded",
    "DeadlineExceeded",
    "FailedIndexes",
    "MaxFailedIndexesExceeded",
    "PodFailurePolicy",
)
_RULE_NAME = re.compile(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?")
# JobSet names a pod <jobset>-<replicated job>-<job index>-<completion index>-<5 random>.
_POD_SUFFIX_RANDOM = 6


def trainjob_errors(job: Mapping[str, Any]) -> list[str]:
    errors = schema_errors(job, shipped_crd(TRAINJOB_CRD), version=VERSION)
    if errors:
        return errors
    errors = metadata_errors(job.get("metadata", {}), "metadata", DNS1035_LABEL, 63)
    spec = job.get("spec", {})
    ref = spec.get("runtimeRef", {})
    if ref.get("apiGroup") != trainjob.GROUP or ref.get("kind") not in RUNTIME_CRDS:
        errors.append(f"spec.runtimeRef: {dict(ref)} names no Trainer runtime")
    trainer = spec.get("trainer", {})
    if trainer.get("numProcPerNode", 1) < 1:  # CEL: self >= 1
        errors.append("spec.trainer.numProcPerNode: must be >= 1")
    errors += [
        f"spec.trainer.env[{i}].name: {var['name']!r} is reserved for Trainer's torch plugin"
        for i, var in enumerate(trainer.get("env", []))
        if var.get("name", "").startswith("PET_")
    ]
    return errors


def runtime_errors(runtime: Mapping[str, Any]) -> list[str]:
    """A TrainingRuntime or ClusterTrainingRuntime against its CRD, its JobSet template
    against JobSet's, and what the webhooks check."""
    kind = str(runtime.get("kind"))
    errors = schema_errors(runtime, shipped_crd(RUNTIME_CRDS[kind]), version=VERSION)
    jobset = runtime.get("spec", {}).get("template", {}).get("spec", {})
    errors += schema_errors(
        jobset,
        shipped_crd(JOBSET_CRD),
        version=JOBSET_VERSION,
        subpath=("properties", "spec"),
        where=("spec", "template", "spec"),
    )
    if errors:
        return sorted(set(errors))
    meta = runtime.get("metadata", {})
    name = meta.get("name", "")
    if not DNS1123_SUBDOMAIN.fullmatch(name) or len(name) > 253:
        errors.append(f"metadata.name: {name!r} is not a DNS-1123 subdomain")
    if kind == trainjob.RUNTIME and "namespace" in meta:
        errors.append("metadata.namespace: a ClusterTrainingRuntime is cluster-scoped")
    if kind == trainjob.NAMESPACED_RUNTIME and not meta.get("namespace"):
        errors.append("metadata.namespace: a TrainingRuntime lives in its TrainJob's namespace")
    errors += label_errors(meta.get("labels", {}), "metadata.labels")
    errors += _failure_policy_errors(jobset)
    where = "spec.template.spec.replicatedJobs"
    replicated = jobset.get("replicatedJobs", [])
    if trainjob.NODE not in [r.get("name") for r in replicated]:
        errors.append(f"{where}: Trainer's torch plugin needs one named {trainjob.NODE!r}")
    for i, rjob in enumerate(replicated):
        errors += _replicated_job_errors(rjob, f"{where}[{i}]")
    return errors


def pair_errors(job: Mapping[str, Any], runtime: Mapping[str, Any]) -> list[str]:
    """The TrainJob against the runtime it names: the name, and its pods' names."""
    errors = []
    ref = job.get("spec", {}).get("runtimeRef", {})
    meta = runtime.get("metadata", {})
    if (ref.get("name"), ref.get("kind")) != (meta.get("name"), runtime.get("kind")):
        errors.append(f"spec.runtimeRef: {dict(ref)} is not the rendered runtime")
    if "namespace" in meta and meta["namespace"] != job.get("metadata", {}).get("namespace"):
        errors.append("metadata.namespace: a TrainingRuntime must be in its TrainJob's namespace")
    name = job.get("metadata", {}).get("name", "")
    nodes = job.get("spec", {}).get("trainer", {}).get("numNodes", 1)
    longest = f"{name}-{trainjob.NODE}-0-{max(nodes - 1, 0)}" + "x" * _POD_SUFFIX_RANDOM
    if len(longest) > 63:
        errors.append(
            f"metadata.name: {name!r} is too long: JobSet's pod names ({longest[:-6]}-xxxxx) "
            "must be DNS-1035 labels of at most 63 characters"
        )
    return errors


def _failure_policy_errors(jobset: Mapping[str, Any]) -> list[str]:
    where = "spec.template.spec.failurePolicy.rules"
    rules = jobset.get("failurePolicy", {}).get("rules", [])
    names = [r.get("name", "") for r in rules]
    errors = [f"{where}: rule names must be unique"] if len(set(names)) < len(names) else []
    jobs = {r.get("name") for r in jobset.get("replicatedJobs", [])}
    for i, rule in enumerate(rules):
        name = rule.get("name", "")
        if not _RULE_NAME.fullmatch(name) or len(name) > 128:
            errors.append(f"{where}[{i}].name: {name!r} must match {_RULE_NAME.pattern}")
        errors += [
            f"{where}[{i}].onJobFailureReasons: {reason!r} not in {list(JOB_FAILURE_REASONS)}"
            for reason in rule.get("onJobFailureReasons", [])
            if reason not in JOB_FAILURE_REASONS
        ]
        errors += [
            f"{where}[{i}].targetReplicatedJobs: no replicated job {target!r}"
            for target in rule.get("targetReplicatedJobs", [])
            if target not in jobs
        ]
        for pattern in rule.get("onJobFailureMessagePatterns", []):
            try:
                re.compile(pattern)
            except re.error as exc:
                errors.append(f"{where}[{i}].onJobFailureMessagePatterns: {pattern!r}: {exc}")
    return errors


def _replicated_job_errors(rjob: Mapping[str, Any], where: str) -> list[str]:
    template = rjob.get("template", {})
    errors = label_errors(template.get("metadata", {}).get("labels", {}), f"{where}.template")
    if template.get("metadata", {}).get("labels", {}).get(trainjob.ANCESTOR_LABEL) and (
        rjob.get("replicas", 1) != 1
    ):
        errors.append(f"{where}.replicas: the trainer's replicated job must have 1 replica")
    job_spec = template.get("spec", {})
    pod = job_spec.get("template", {}).get("spec", {})
    pod_where = f"{where}.template.spec.template.spec"
    errors += pod_errors(pod, pod_where, container_name=trainjob.NODE)
    policy = job_spec.get("podFailurePolicy")
    if policy is not None:
        if pod.get("restartPolicy") != "Never":
            errors.append(f"{pod_where}.restartPolicy: podFailurePolicy needs 'Never'")
        rules = policy.get("rules", [])
        for i, rule in enumerate(rules):
            errors += _exit_code_errors(
                rule.get("onExitCodes"), f"{where}.template.spec.podFailurePolicy.rules[{i}]"
            )
    return errors


def _exit_code_errors(codes: Mapping[str, Any] | None, where: str) -> list[str]:
    """The Job API's rules for onExitCodes: In|NotIn, sorted distinct values, no 0 with In."""
    if codes is None:
        return []
    values: Sequence[int] = codes.get("values", [])
    errors = []
    if codes.get("operator") not in ("In", "NotIn"):
        errors.append(f"{where}.onExitCodes.operator: {codes.get('operator')!r} not In|NotIn")
    if list(values) != sorted(set(values)) or not 0 < len(values) <= 255:
        errors.append(f"{where}.onExitCodes.values: 1-255 distinct values in ascending order")
    if codes.get("operator") == "In" and 0 in values:
        errors.append(f"{where}.onExitCodes.values: 0 is not allowed with In")
    return errors
