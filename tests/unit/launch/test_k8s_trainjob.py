"""Kubeflow Trainer v2 (launch.k8s.api=trainjob): every recipe renders a TrainJob and its
ClusterTrainingRuntime that validate against the real CRDs (the runtime's JobSet against the
JobSet CRD too), with the PyTorchJob's pod; and the failure policy answers the entry point's
real exit codes as the Job and JobSet controllers would (their rules evaluated here from the
Kubernetes and JobSet documentation, not from the code under test)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
from typing import Any

import pytest

from launch.k8s import cli as k8s
from launch.k8s.entry import classify
from launch.k8s.validate import validate_objects
from launch.torchrun import Outcome
from pretrain.context import exit_codes
from recipes import ConfigError
from tests.k8s_helpers import BASE, RECIPES, master, stable_env  # noqa: F401 - autouse

TRAINJOB = "launch.k8s.api=trainjob"


def _node_pod(runtime: dict[str, Any]) -> dict[str, Any]:
    [rjob] = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    return rjob["template"]["spec"]["template"]["spec"]


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_every_recipe_renders_a_trainjob_on_a_runtime_with_the_pytorchjobs_pod(
    recipe: str,
) -> None:
    plan, rendered = k8s.render_run([*RECIPES[recipe], *BASE, TRAINJOB])  # validated inside
    job, runtime, launch = rendered.job, rendered.runtime, plan.run.launch
    assert runtime is not None
    assert [o["kind"] for o in rendered.objects[:3]] == [
        "ConfigMap",
        "TrainingRuntime",
        "TrainJob",
    ]  # the runtime exists before the TrainJob that names it
    assert (job["apiVersion"], job["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    assert job["spec"]["runtimeRef"] == {
        "name": runtime["metadata"]["name"],
        "apiGroup": "trainer.kubeflow.org",
        "kind": "TrainingRuntime",
    }
    assert job["spec"]["trainer"] == {
        "numNodes": launch.nodes,
        "numProcPerNode": launch.nproc_per_node,
    }
    # beside the TrainJob, named like the ConfigMap of the same submission
    assert runtime["metadata"]["namespace"] == job["metadata"]["namespace"]
    assert runtime["metadata"]["name"] == rendered.config_map_name
    # The same pod as the PyTorchJob's master, in the container Trainer configures.
    _, v1 = k8s.render_run([*RECIPES[recipe], *BASE])
    v1_pod, pod = master(v1.job)["template"]["spec"], _node_pod(runtime)
    assert [c["name"] for c in pod["containers"]] == ["node"]
    assert pod.pop("restartPolicy") == "Never"
    assert {**pod["containers"][0], "name": "pytorch"} == v1_pod["containers"][0]
    assert {**pod, "containers": v1_pod["containers"]} == v1_pod


def test_a_cluster_scoped_runtime_is_named_by_its_namespace() -> None:
    argv = [*RECIPES["gpt_tiny"], *BASE, TRAINJOB, "launch.k8s.namespace=team-a"]
    _, own = k8s.render_run(argv)
    _, rendered = k8s.render_run([*argv, "launch.k8s.runtime_scope=cluster"])  # validated
    runtime = rendered.runtime
    assert runtime is not None and own.runtime is not None
    assert runtime["kind"] == rendered.job["spec"]["runtimeRef"]["kind"] == "ClusterTrainingRuntime"
    assert "namespace" not in runtime["metadata"]
    assert runtime["metadata"]["name"] == f"team-a-{rendered.config_map_name}"
    assert runtime["metadata"]["labels"]["mcore-recipes/namespace"] == "team-a"
    assert runtime["spec"] == own.runtime["spec"]  # the same JobSet either way
    with pytest.raises(ConfigError, match="a TrainingRuntime lives in its TrainJob's namespace"):
        validate_objects([{**own.runtime, "metadata": {"name": "x", "labels": {}}}])


def test_volcano_gangs_the_trainjobs_pods_in_its_queue() -> None:
    """gpt_tiny's queue, research, becomes Volcano's (the runtime's template annotation, which
    Trainer's Volcano plugin reads), not Kueue's; validated against the shipped CRDs."""
    volcano = "launch.k8s.gang_scheduler=volcano"
    _, rendered = k8s.render_run([*RECIPES["gpt_tiny"], *BASE, TRAINJOB, volcano])
    runtime = rendered.runtime
    assert runtime is not None
    assert runtime["spec"]["podGroupPolicy"] == {"volcano": {}}
    assert runtime["spec"]["template"]["metadata"] == {
        "annotations": {"scheduling.volcano.sh/queue-name": "research"}
    }
    pod = _node_pod(runtime)
    assert pod["schedulerName"] == "volcano" and pod["priorityClassName"] == "low"
    assert "kueue.x-k8s.io/queue-name" not in rendered.job["metadata"]["labels"]
    for refused, message in (
        ([], "a PyTorchJob's gang scheduler is the training-operator's"),
        ([TRAINJOB, "launch.k8s.runtime=torch-distributed"], "cannot set a runtime's"),
        (
            [TRAINJOB, "launch.k8s.kueue_priority_class=batch"],
            "launch.k8s.kueue_priority_class is Kueue's",
        ),
        ([TRAINJOB, "launch.k8s.gang_scheduler=yunikorn"], "gang_scheduler"),
        ([TRAINJOB, "launch.k8s.queue=Research_Q"], "is not a Volcano Queue name"),
    ):
        with pytest.raises(ConfigError, match=message):
            k8s.render_run([*RECIPES["gpt_tiny"], *BASE, volcano, *refused])


def test_the_remote_tier_is_fetched_by_the_first_nodes_pod_only(tmp_path) -> None:
    remote = ["checkpoint.remote.url=s3://bucket/runs", "launch.k8s.remote_secret=s3-creds"]
    _, v1 = k8s.render_run([*RECIPES["gpt_tiny"], *BASE, *remote])
    _, rendered = k8s.render_run([*RECIPES["gpt_tiny"], *BASE, *remote, TRAINJOB])
    assert rendered.runtime is not None
    [fetch] = _node_pod(rendered.runtime)["initContainers"]
    [v1_fetch] = master(v1.job)["template"]["spec"]["initContainers"]
    sh, flag, script, name, *command = fetch["command"]
    assert command == v1_fetch["command"] and command[:4] == ["python", "-m", "resiliency", "fetch"]
    # Every pod of the Job runs the init container; the completion index says which node it is.
    for index, runs in (("0", True), ("1", False)):
        probe = subprocess.run(
            [sh, flag, script, name, "echo", "fetched"],
            env={"PATH": "/usr/bin:/bin", "JOB_COMPLETION_INDEX": index},
            capture_output=True, text=True, timeout=10,
        )  # fmt: skip
        assert probe.returncode == 0 and (probe.stdout == "fetched\n") == runs


def test_the_queue_admits_the_trainjob_alone() -> None:
    workload_priority = "launch.k8s.kueue_priority_class=batch-low"
    _, rendered = k8s.render_run([*RECIPES["gpt_tiny"], *BASE, TRAINJOB, workload_priority])
    _, pytorchjob = k8s.render_run([*RECIPES["gpt_tiny"], *BASE, workload_priority])
    assert rendered.runtime is not None
    queue, priority = "kueue.x-k8s.io/queue-name", "kueue.x-k8s.io/priority-class"
    for job in (rendered.job, pytorchjob.job):  # on the job, on either API
        assert job["metadata"]["labels"][queue] == "research"
        assert job["metadata"]["labels"][priority] == "batch-low"
    [rjob] = rendered.runtime["spec"]["template"]["spec"]["replicatedJobs"]
    for labels in (
        rendered.runtime["metadata"]["labels"],
        rjob["template"]["spec"]["template"]["metadata"]["labels"],
        master(pytorchjob.job)["template"]["metadata"]["labels"],
    ):
        assert not {queue, priority} & set(labels)  # one workload, admitted once
    assert "suspend" not in rendered.job["spec"]  # Kueue suspends it on admission itself
    assert _node_pod(rendered.runtime)["priorityClassName"] == "low"  # Kueue reads it there


# --- the failure policy, evaluated as the controllers do -------------------------------------


def _job_failure(pod_failure_policy: dict[str, Any], exit_code: int) -> tuple[str, str]:
    """The Job controller (backoffLimit 0, restartPolicy Never): the first podFailurePolicy
    rule whose onExitCodes match fails the Job with reason PodFailurePolicy and the message
    "Container <c> for pod <ns>/<pod> failed with exit code <n> matching <action> rule at
    index <i>"; no match: the pod counts against backoffLimit 0 -> BackoffLimitExceeded."""
    for index, rule in enumerate(pod_failure_policy["rules"]):
        codes = rule["onExitCodes"]
        matched = (exit_code in codes["values"]) == (codes["operator"] == "In")
        if matched and codes["containerName"] == "node":
            assert rule["action"] == "FailJob"
            message = (
                f"Container node for pod ns/job-node-0-0-abcde failed with exit code {exit_code}"
                f" matching FailJob rule at index {index}"
            )
            return "PodFailurePolicy", message
    return "BackoffLimitExceeded", "Job has reached the specified backoff limit"


def _jobset_action(failure_policy: dict[str, Any], reason: str, message: str) -> str:
    """JobSet: the first rule whose reasons (and message patterns, RE2) match decides; none
    matching restarts the set, counted against maxRestarts."""
    for rule in failure_policy["rules"]:
        if reason not in rule.get("onJobFailureReasons", [reason]):
            continue
        patterns = rule.get("onJobFailureMessagePatterns")
        if patterns and not any(re.search(p, message) for p in patterns):
            continue
        return rule["action"]
    return "RestartJobSet"


@pytest.mark.parametrize(
    "outcome, expected",
    [
        (Outcome(exit_codes.INFRASTRUCTURE, planned=False), "RestartJobSet"),  # a lost peer
        (Outcome(-signal.SIGKILL, planned=False), "RestartJobSet"),  # OOM killer, node loss
        (Outcome(-signal.SIGSEGV, planned=False), "RestartJobSet"),
        (Outcome(exit_codes.REQUEUE, planned=False), "RestartJobSetAndIgnoreMaxRestarts"),
        (Outcome(-signal.SIGTERM, planned=True), "RestartJobSetAndIgnoreMaxRestarts"),  # drain
        *[
            (Outcome(code, planned=False), "FailJobSet")
            for code in sorted(exit_codes.DO_NOT_RETRY)  # config, user code, data, budget...
        ],
        (Outcome(42, planned=False), "FailJobSet"),  # unknown: a blind retry could loop
    ],
)
def test_the_failure_policy_answers_the_entry_points_exit_codes(
    outcome: Outcome, expected: str
) -> None:
    _, rendered = k8s.render_run([*RECIPES["gpt_tiny"], *BASE, TRAINJOB])
    assert rendered.runtime is not None
    jobset = rendered.runtime["spec"]["template"]["spec"]
    [rjob] = jobset["replicatedJobs"]
    job_spec = rjob["template"]["spec"]
    assert job_spec["backoffLimit"] == 0  # any failed pod fails the Job: a gang restart
    container_exit, _ = classify(outcome)  # what the entry point exits with, for real
    reason, message = _job_failure(job_spec["podFailurePolicy"], container_exit)
    assert _jobset_action(jobset["failurePolicy"], reason, message) == expected
    assert jobset["failurePolicy"]["maxRestarts"] == 3  # launch.k8s.backoff_limit's default


def test_a_broken_runtime_is_refused_before_submission() -> None:
    _, rendered = k8s.render_run([*RECIPES["gpt_tiny"], *BASE, TRAINJOB])
    assert rendered.runtime is not None
    runtime = rendered.runtime
    jobset = runtime["spec"]["template"]["spec"]
    jobset["failurePolicy"]["rules"][0]["name"] = "do-not-retry"  # JobSet: no hyphens
    jobset["failurePolicy"]["rules"][1]["onJobFailureReasons"] = ["PodFailed"]
    jobset["failurePolicy"]["restartStrategy"] = "Sometimes"  # not in the CRD's enum
    with pytest.raises(ConfigError, match=r"restartStrategy"):
        validate_objects([runtime])
    jobset["failurePolicy"]["restartStrategy"] = "Recreate"
    with pytest.raises(ConfigError) as refused:
        validate_objects([runtime])
    assert "rules[0].name: 'do-not-retry'" in str(refused.value)
    assert "rules[1].onJobFailureReasons: 'PodFailed'" in str(refused.value)


def test_names_too_long_for_jobsets_pods_and_reserved_env_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"launch.k8s.job_name=.*at most 48 characters"):
        k8s.render_run([*RECIPES["gpt_tiny"], *BASE, TRAINJOB, "launch.k8s.job_name=" + "a" * 49])
    with pytest.raises(ConfigError, match=r"\['PET_NNODES'\] are set by the controller"):
        k8s.render_run([*RECIPES["gpt_tiny"], *BASE, TRAINJOB, "+launch.k8s.env.PET_NNODES=4"])


# --- node isolation by evidence (both APIs) ---------------------------------------------------


def _health_report(
    run_dir, job: str, node: str, check: str, detail: str, at: float = 1000.0, ok: bool = False
) -> None:
    """A pod's health report, as the entry point writes it to the shared claim."""
    path = run_dir / "k8s" / "retries" / job / "health" / f"{node}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    checks = [{"name": check, "ok": ok, "detail": detail}, {"name": "cpus", "ok": True,
              "detail": "8 usable"}]  # fmt: skip
    report = {"node": node, "host": "pod-x", "time": at, "ok": ok, "checks": checks}
    path.write_text(json.dumps(report))


@pytest.mark.parametrize("api", ["pytorchjob", "trainjob"])
def test_a_node_that_failed_on_hardware_is_avoided_by_the_next_submission(
    api: str, tmp_path
) -> None:
    run_dir = tmp_path / "gpt_tiny"
    _health_report(run_dir, "job-a", "gpu-17", "gpus", "8 GPUs; uncorrected ECC errors on ['3']")
    _health_report(run_dir, "job-a", "gpu-04", "checkpoint_dir", "0.1 GiB free (need 50)")
    _health_report(run_dir, "job-a", "gpu-05", "shm", "/dev/shm is 0.06 GiB (need 1)")
    _health_report(run_dir, "job-a", "gpu-06", "script", "'/opt/check' exit 3: row remap")
    # repaired since: its newest report passed
    _health_report(run_dir, "job-b", "gpu-06", "script", "'/opt/check' exit 0: ok", 2000, True)
    # a script missing on every pod of a submission is the job's, not the nodes'
    for node in ("gpu-30", "gpu-31"):
        _health_report(run_dir, "job-c", node, "script", "'/opt/gone' exit 127: not found")
    argv = [*RECIPES["gpt_tiny"], *BASE, f"output_dir={tmp_path}", f"launch.k8s.api={api}",
            "launch.k8s.avoid_nodes=[node-manual]"]  # fmt: skip
    _, rendered = k8s.render_run(argv)  # validated against the CRDs with the affinity
    if api == "trainjob":
        assert rendered.runtime is not None
        pods = [_node_pod(rendered.runtime)]
    else:
        pods = [r["template"]["spec"] for r in rendered.job["spec"]["pytorchReplicaSpecs"].values()]
    expected = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchFields": [{
            "key": "metadata.name", "operator": "NotIn", "values": ["gpu-17", "node-manual"]
        }]}]
    }}}  # fmt: skip
    assert all(pod["affinity"] == expected for pod in pods) and len(pods) >= 1
    # the shared volume's failure says nothing about gpu-04; without evidence, no affinity
    _, clean = k8s.render_run([*RECIPES["gpt_tiny"], *BASE, f"output_dir={tmp_path / 'new'}"])
    assert "affinity" not in master(clean.job)["template"]["spec"]


def test_a_trainjob_on_the_clusters_runtime_carries_the_pod_in_its_patch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    argv = [*RECIPES["llama3_70b"], *BASE, TRAINJOB, "launch.k8s.runtime=torch-distributed",
            "launch.k8s.priority_class=high"]  # fmt: skip
    _, own = k8s.render_run(
        [*RECIPES["llama3_70b"], *BASE, TRAINJOB, "launch.k8s.priority_class=high"]
    )
    _, rendered = k8s.render_run(argv)  # validated against the TrainJob CRD, patches included
    assert own.runtime is not None and rendered.runtime is None
    assert [o["kind"] for o in rendered.objects] == ["ConfigMap", "TrainJob"]
    spec, pod = rendered.job["spec"], _node_pod(own.runtime)
    assert spec["runtimeRef"]["name"] == "torch-distributed"
    [container] = pod["containers"]
    trainer = spec["trainer"]
    assert (trainer["image"], trainer["command"], trainer["env"]) == (
        container["image"], container["command"], container["env"],
    )  # fmt: skip
    assert trainer["resourcesPerNode"] == container["resources"]
    [patch] = spec["runtimePatches"]
    [node_job] = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    patched = node_job["template"]["spec"]["template"]["spec"]
    assert node_job["name"] == "node" and patched["volumes"] == pod["volumes"]
    assert patched["containers"] == [
        {"name": "node", "volumeMounts": container["volumeMounts"],
         "securityContext": container["securityContext"]}
    ]  # fmt: skip
    # what the cluster's runtime decides instead, said
    assert "restarts follow its failure policy" in caplog.text
    assert "it also decides priorityClassName" in caplog.text
    for remote in (
        ["checkpoint.remote.url=s3://b/r"],
        ["checkpoint.remote.url=s3://b/r", "launch.k8s.remote_secret=s3"],
    ):
        with pytest.raises(ConfigError, match="cannot add the fetch init container"):
            k8s.render_run([*argv, *remote])
