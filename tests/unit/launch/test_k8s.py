"""The k8s adapter: rendered PyTorchJobs against the real CRD schema, golden manifests and
refusals before submission. No cluster: nothing here proves the operator runs these jobs."""

from __future__ import annotations

import copy
import dataclasses
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from launch.__main__ import main as launch_main
from launch.k8s import cli as k8s
from launch.k8s.render import render
from launch.k8s.schema import (
    crd_path,
    crd_schema,
    operator_errors,
    schema_errors,
    to_json_schema,
)
from launch.k8s.validate import validate_objects
from pretrain.context import exit_codes
from recipes import ConfigError
from recipes.load import load_config_file
from resiliency.storage.layout import RunLayout
from resiliency.storage.lease import RunLease
from tests.k8s_helpers import (
    BASE,
    COMMIT,
    GOLDEN,
    GPT,
    GPU_NODE,
    IMAGE,
    NO_FIT,
    RECIPES,
    STDLIB_ON_CLAIM,
    cli,
    container,
    hf_data,
    master,
    stable_env,  # noqa: F401 - autouse fixture
)

pytest.importorskip("jsonschema", reason="the k8s extra validates manifests with jsonschema")


# --- rendering and the CRD schema -------------------------------------------------------------


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_rendered_job_validates_against_crd(recipe: str, tmp_path: Path) -> None:
    plan, rendered = k8s.render_run(RECIPES[recipe] + BASE)
    job, launch = rendered.job, plan.run.launch
    assert schema_errors(job) == [] and operator_errors(job) == []
    assert job["spec"]["nprocPerNode"] == str(launch.nproc_per_node)
    assert master(job)["replicas"] == 1 and master(job)["restartPolicy"] == "ExitCode"
    workers = job["spec"]["pytorchReplicaSpecs"].get("Worker")
    assert (workers or {}).get("replicas", 0) == launch.nodes - 1
    assert job["spec"]["runPolicy"]["schedulingPolicy"]["minAvailable"] == launch.nodes
    limits = container(job)["resources"].get("limits", {})
    assert limits.get("nvidia.com/gpu", 0) == launch.gpus_per_node
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container(job)["env"]}
    assert env["MCORE_RECIPES_NODE"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["MCORE_RECIPES_CODE_COMMIT"] == COMMIT
    assert env["MCORE_RECIPES_IMAGE_DIGEST"] == "sha256:0123456789abcdef"
    # The pods load the embedded config, which pins output_dir to the shared claim's mount.
    pinned = tmp_path / "launch-config.yaml"
    pinned.write_text(rendered.config_map["data"]["launch-config.yaml"])
    pod_run = load_config_file(pinned)
    assert pod_run.output_dir == "/checkpoints" and pod_run.run_id == plan.run.run_id
    assert container(job)["command"][-2:] == ["--config", "/etc/mcore-recipes/launch-config.yaml"]


def test_standby_workers_render() -> None:
    plan, rendered = k8s.render_run([*RECIPES["gpt_tiny"], *BASE, "launch.standby=true"])
    command = container(rendered.job)["command"]
    run_dir = command[command.index("--standby") + 1]  # the pod's view of the run dir
    assert run_dir.endswith(f"/{plan.run.run_id}")
    assert command[command.index("--state-dir") + 1] == f"{run_dir}/k8s/retries"
    assert command[command.index("--") + 1 : command.index("--") + 3] == [
        "-m",
        "launch.standby.worker",
    ]


def test_optional_knobs_render() -> None:
    _, rendered = k8s.render_run(RECIPES["gpt_tiny"] + BASE)
    job = rendered.job
    assert container(job)["resources"] == {
        "limits": {"cpu": "4", "memory": "8Gi"},
        "requests": {"cpu": "4", "memory": "8Gi"},
    }
    assert job["spec"]["runPolicy"]["schedulingPolicy"] == {
        "minAvailable": 2,
        "queue": "research",
        "priorityClass": "low",
    }
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "research"
    assert "kueue.x-k8s.io/queue-name" not in master(job)["template"]["metadata"]["labels"]
    assert master(job)["template"]["spec"]["priorityClassName"] == "low"
    assert {
        "name": "local-ckpt",
        "hostPath": {"path": "/mnt/nvme", "type": "DirectoryOrCreate"},
    } in master(job)["template"]["spec"]["volumes"]
    assert {"name": "NCCL_DEBUG", "value": "WARN"} in container(job)["env"]
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert pod["tolerations"] == [
        {"key": "dedicated", "operator": "Equal", "value": "training", "effect": "NoSchedule"}
    ]
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "c7i.4xlarge"}
    assert pod["imagePullSecrets"] == [{"name": "registry-creds"}]


def test_toleration_values_render_as_the_pod_api_types() -> None:
    tol = "launch.k8s.tolerations=[{key: gen, value: 5, effect: NoExecute, tolerationSeconds: 60}]"
    _, rendered = k8s.render_run(GPT + [tol] + BASE)
    assert master(rendered.job)["template"]["spec"]["tolerations"] == [
        {"key": "gen", "value": "5", "effect": "NoExecute", "tolerationSeconds": 60}
    ]
    assert schema_errors(rendered.job) == []


def test_gpu_pods_are_guaranteed_qos_with_rdma() -> None:
    _, rendered = k8s.render_run(RECIPES["llama3_70b"] + BASE)
    assert schema_errors(rendered.job) == []
    for replica in rendered.job["spec"]["pytorchReplicaSpecs"].values():
        pod = replica["template"]["spec"]
        resources = pod["containers"][0]["resources"]
        # Guaranteed: cpu and memory requested = limited; device-plugin resources likewise.
        assert (
            resources["requests"]
            == resources["limits"]
            == {
                "cpu": "96",
                "memory": "1600Gi",
                "nvidia.com/gpu": 8,
                "rdma/ib": 1,
            }
        )
        assert pod["containers"][0]["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
        assert "tolerations" not in pod and "nodeSelector" not in pod


def test_gpu_pods_without_cpu_and_memory_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"launch.k8s.memory must be set for GPU pods") as info:
        k8s.render_run(["recipe=gpt_125m", STDLIB_ON_CLAIM, "launch.k8s.cpu=96"] + BASE)
    assert "\n" not in str(info.value) and "Guaranteed" in str(info.value)


def test_cpu_pods_without_cpu_and_memory_warn(caplog: pytest.LogCaptureFixture) -> None:
    _, rendered = k8s.render_run(["recipe=gpt_tiny", STDLIB_ON_CLAIM] + BASE)
    assert "launch.k8s.cpu and launch.k8s.memory not set" in caplog.text
    assert container(rendered.job)["resources"] == {}


def test_local_tier_writes_to_the_node_local_volume() -> None:
    _, rendered = k8s.render_run(RECIPES["gpt_tiny"] + BASE)
    assert rendered.pod_run.checkpoint.local.dir == "/local-ckpt"
    mounts = container(rendered.job)["volumeMounts"]
    assert {"name": "local-ckpt", "mountPath": "/local-ckpt"} in mounts


def test_remote_tier_renders_a_fetching_init_container_and_an_uploader_deployment() -> None:
    remote = ["checkpoint.remote.url=s3://bucket/runs", "launch.k8s.remote_secret=s3-creds"]
    _, rendered = k8s.render_run(RECIPES["llama3_70b"] + BASE + remote)
    replicas = rendered.job["spec"]["pytorchReplicaSpecs"]
    [init] = replicas["Master"]["template"]["spec"]["initContainers"]
    assert "initContainers" not in replicas["Worker"]["template"]["spec"]  # the claim is shared
    assert init["command"][:5] == ["python", "-m", "resiliency", "fetch", "/checkpoints/llama3_70b"]
    secret = [{"secretRef": {"name": "s3-creds"}}]
    assert init["envFrom"] == secret and container(rendered.job)["envFrom"] == secret
    uploader = rendered.uploader
    assert uploader is not None and uploader["kind"] == "Deployment"
    pod = uploader["spec"]["template"]["spec"]
    assert pod["containers"][0]["command"][:5] == ["python", "-m", "resiliency", "upload",
                                                   "/checkpoints/llama3_70b"]  # fmt: skip
    assert "--follow" in pod["containers"][0]["command"]
    assert pod["volumes"] == [{"name": "shared-ckpt",
                               "persistentVolumeClaim": {"claimName": "ckpt-rwx"}}]  # fmt: skip
    validate_objects(rendered.objects)  # the pod template against the CRD's PodTemplateSpec
    broken = copy.deepcopy(uploader)
    broken["spec"]["template"]["spec"]["containers"][0]["ports"] = [{"containerPort": "x"}]
    with pytest.raises(ConfigError, match=r"Deployment: spec.template.spec.containers\[0\]"):
        validate_objects([broken])
    _, plain = k8s.render_run(RECIPES["llama3_70b"] + BASE)
    assert plain.uploader is None and "initContainers" not in str(plain.job)


def test_local_tier_defaults_to_a_host_path_per_job(caplog: pytest.LogCaptureFixture) -> None:
    tier = ["checkpoint.local.interval=10", "checkpoint.local.dir=/x", "launch.k8s.namespace=ml"]
    _, rendered = k8s.render_run(GPT + tier + BASE)
    volumes = master(rendered.job)["template"]["spec"]["volumes"]
    # Survives the operator recreating the pod on the same node, unlike an emptyDir.
    assert volumes[0] == {
        "name": "local-ckpt",
        "hostPath": {"path": "/var/lib/mcore-recipes/ml/gpt-125m", "type": "DirectoryOrCreate"},
    }
    assert "emptyDir" not in caplog.text
    _, rendered = k8s.render_run(GPT + tier + ["launch.k8s.local_volume=emptyDir"] + BASE)
    volumes = master(rendered.job)["template"]["spec"]["volumes"]
    assert volumes[0] == {"name": "local-ckpt", "emptyDir": {}}
    assert "local checkpoint tier is deleted with its pod" in caplog.text
    # Without the tier there is no node-local volume at all (no hostPath to be allowed).
    _, rendered = k8s.render_run(GPT + BASE)
    names = [v["name"] for v in master(rendered.job)["template"]["spec"]["volumes"]]
    assert names == ["shared-ckpt", "dshm", "run-config"]


def test_data_paths_must_be_on_a_mounted_volume(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ConfigError) as info:
        k8s.render_run(["recipe=gpt_125m", *GPU_NODE] + BASE)
    message = str(info.value)
    assert message.startswith("data.paths[0]='data/stdlib_text_document' is relative")
    assert "/checkpoints (claim ckpt-rwx)" in message and "\n" not in message
    assert "data.paths=[/checkpoints/data/stdlib_text_document]" in message
    with pytest.raises(ConfigError, match=r"data.tokenizer_path='tokenizers/llama3' is relative"):
        k8s.render_run(["recipe=llama3_8b", "data.paths=[/checkpoints/d]", *GPU_NODE] + BASE)
    with pytest.raises(ConfigError, match=r"data.cache_dir='cache' is relative"):
        k8s.render_run(GPT + ["data.cache_dir=cache"] + BASE)
    # Absolute but on no volume: may be baked into the image, so only a warning.
    k8s.render_run(GPT + ["data.paths=[/opt/data/stdlib_text_document]"] + BASE)
    assert "data.paths[0]=/opt/data/stdlib_text_document is on none of" in caplog.text
    caplog.clear()
    k8s.render_run(GPT + BASE)  # on the claim: nothing to say
    k8s.render_run(["recipe=gpt_125m", "data.kind=mock", *GPU_NODE] + BASE)  # paths unused
    assert "is on none of" not in caplog.text


def test_job_name_is_a_dns_label_that_leaves_room_for_pod_names() -> None:
    long_name = ["recipe=mixtral_8x7b", "run_id=" + "Run_" * 30, *hf_data("mixtral"), *GPU_NODE]
    _, rendered = k8s.render_run(long_name + BASE)
    assert rendered.name.startswith("run-run-run") and len(rendered.name + "-worker-6") <= 63
    with pytest.raises(ConfigError, match="launch.k8s.job_name='Bad_Name'"):
        k8s.render_run(["recipe=gpt_125m", "launch.k8s.job_name=Bad_Name"] + BASE)


def _mutate(path: str, value: Any = None, delete: bool = False) -> Callable[[dict], None]:
    def apply(job: dict) -> None:
        node: Any = job
        # JSON-pointer style: '/' separates, '~1' is a literal '/' inside a key.
        parts = [p.replace("~1", "/") for p in path.split("/")]
        *parents, last = [int(p) if p.isdigit() else p for p in parts]
        for part in parents:
            node = node[part]
        if delete:
            del node[last]
        else:
            node[last] = value

    return apply


C0 = "spec/pytorchReplicaSpecs/Master/template/spec/containers/0"
C0_PATH = "spec.pytorchReplicaSpecs.Master.template.spec.containers[0]"


@pytest.mark.parametrize(
    "mutation, expected",
    [
        (_mutate(f"{C0}/bogus", 1), f"{C0_PATH}.bogus: unknown field"),
        (_mutate("spec/runPolicy/cleanUp", "All"), "spec.runPolicy.cleanUp: unknown field"),
        (
            _mutate("spec/pytorchReplicaSpecs/Master/replicas", "two"),
            "spec.pytorchReplicaSpecs.Master.replicas: 'two' is not of type 'integer'",
        ),
        (
            _mutate(f"{C0}/resources/limits/nvidia.com~1gpu", [8]),
            f"{C0_PATH}.resources.limits['nvidia.com/gpu']: [8] is not of type",
        ),
        (_mutate(f"{C0}/resources/limits/cpu", "lots"), f"{C0_PATH}.resources.limits.cpu: 'lots'"),
        (_mutate(f"{C0}/name", delete=True), f"{C0_PATH}.name: required field is missing"),
        (_mutate(f"{C0}/image", delete=True), f"{C0_PATH}.image: required"),
        (_mutate(f"{C0}/name", "trainer"), "needs a container named 'pytorch'"),
        (_mutate("spec/runPolicy/backoffLimit", 2**31), "greater than the maximum"),
        (_mutate("spec/pytorchReplicaSpecs/Master/restartPolicy", "Sometimes"), "restartPolicy"),
        (_mutate(f"{C0}/volumeMounts/0/name", "nope"), "no volume named 'nope'"),
        (_mutate(f"{C0}/volumeMounts/1/mountPath", "ckpt"), "mountPath: 'ckpt' is not absolute"),
        (_mutate(f"{C0}/volumeMounts/0/mountPath", "/dev/shm"), "duplicate entry"),
    ],
    ids=[
        "unknown-field",
        "unknown-runpolicy-field",
        "wrong-type",
        "gpu-list",
        "bad-quantity",
        "no-name",
        "no-image",
        "no-pytorch-container",
        "int32-range",
        "restart-policy",
        "dangling-mount",
        "relative-mount",
        "duplicate-mount",
    ],
)
def test_validator_rejects_with_path(mutation: Callable[[dict], None], expected: str) -> None:
    _, rendered = k8s.render_run(RECIPES["gpt_125m"] + BASE)
    job = copy.deepcopy(rendered.job)
    mutation(job)
    with pytest.raises(ConfigError) as info:
        validate_objects([rendered.config_map, job])
    assert expected in str(info.value)


def test_schema_conversion_is_strict_where_the_crd_is() -> None:
    node = {
        "type": "object",
        "properties": {
            "q": {
                "x-kubernetes-int-or-string": True,
                "anyOf": [{"type": "integer"}, {"type": "string"}],
            },
            "free": {
                "type": "object",
                "x-kubernetes-preserve-unknown-fields": True,
                "properties": {"a": {"type": "string"}},
            },
            "n": {"type": "integer", "format": "int32"},
        },
    }
    out = to_json_schema(node)
    assert out["additionalProperties"] is False
    assert out["properties"]["q"]["type"] == ["integer", "string"]
    assert "additionalProperties" not in out["properties"]["free"]
    assert out["properties"]["n"]["maximum"] == 2**31 - 1
    # The real CRD really is strict at the container level (not a vacuous schema).
    spec = crd_schema(crd_path())["properties"]["spec"]
    replica = spec["properties"]["pytorchReplicaSpecs"]["additionalProperties"]
    pod = to_json_schema(replica)["properties"]["template"]["properties"]["spec"]
    assert pod["properties"]["containers"]["items"]["additionalProperties"] is False


# --- golden manifests -------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["gpt_125m", "llama3_70b", "gpt_tiny"])
def test_golden_manifest(recipe: str) -> None:
    _, rendered = k8s.render_run(RECIPES[recipe] + BASE)
    text = k8s.to_manifest_yaml(rendered.objects)
    assert list(yaml.safe_load_all(text)) == rendered.objects
    golden = GOLDEN / f"{recipe}.yaml"
    if os.environ.get("MCORE_RECIPES_UPDATE_GOLDEN") == "1":
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert golden.exists(), f"{golden} missing: rerun with MCORE_RECIPES_UPDATE_GOLDEN=1"
    assert text == golden.read_text(), (
        f"{golden} differs from the rendered manifest; if the change is intended, rerun with "
        f"MCORE_RECIPES_UPDATE_GOLDEN=1 and review the diff"
    )


# --- refused before submission ----------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["recipe=gpt_125m", "launch.k8s.shared_pvc=c"], "launch.k8s.image is required"),
        (
            ["recipe=llama3_70b", "launch.nodes=3"] + BASE,
            "launch.nodes=3 x launch.nproc_per_node=8",
        ),
        (
            ["recipe=gpt_125m", "launch.k8s.imagee=x"] + BASE,
            "unknown config key 'launch.k8s.imagee'",
        ),
        (["recipe=gpt_125m", f"launch.k8s.image={IMAGE}"], "launch.k8s.shared_pvc is required"),
        (
            ["recipe=gpt_125m", "launch.k8s.termination_grace_s=60"] + BASE,
            "termination_grace_s=60 is too short",
        ),
        (["recipe=gpt_125m"] + BASE, "launch.k8s.cpu and launch.k8s.memory must be set"),
        (["recipe=gpt_125m", *GPU_NODE] + BASE, "data.paths[0]='data/stdlib_text_document'"),
        (GPT + ["launch.k8s.cpu=lots"] + BASE, "launch.k8s.cpu='lots' is not a Kubernetes"),
        (GPT + ["launch.k8s.capabilities=[CAP_IPC_LOCK]"] + BASE, "no CAP_ prefix"),
        (
            GPT + ["launch.k8s.tolerations=[{key: gpu, efect: NoSchedule}]"] + BASE,
            "launch.k8s.tolerations[0]: unknown field(s) ['efect']",
        ),
        (
            GPT + ["launch.k8s.tolerations=[{key: gpu, effect: NoExecut}]"] + BASE,
            "launch.k8s.tolerations[0].effect='NoExecut' is not one of",
        ),
        (
            GPT + ["launch.k8s.tolerations=[{operator: Exists}]"] + BASE,
            "launch.k8s.tolerations[0] has no key, so it tolerates every taint",
        ),
        (
            GPT + ["launch.k8s.kueue_priority_class=high"] + BASE,
            "launch.k8s.kueue_priority_class='high' names a Kueue WorkloadPriorityClass: it "
            "needs launch.k8s.queue",
        ),
        (
            GPT + ["+launch.k8s.node_selector={gpu: a b}"] + BASE,
            "launch.k8s.node_selector: 'gpu': 'a b' is not a node label",
        ),
        (
            GPT + ["launch.k8s.image_pull_secrets=[Regcred]"] + BASE,
            "launch.k8s.image_pull_secrets: 'Regcred' is not a Secret name",
        ),
        (
            GPT + ["+launch.k8s.extended_resources={rdma: 1}"] + BASE,
            "launch.k8s.extended_resources: 'rdma' is not an extended resource name",
        ),
        (
            GPT + ["+launch.k8s.extended_resources={nvidia.com/gpu: 8}"] + BASE,
            "nvidia.com/gpu comes from launch.gpus_per_node",
        ),
        (
            GPT + ["launch.k8s.local_volume=emptyDir", "launch.k8s.local_host_path=/mnt"] + BASE,
            "launch.k8s.local_host_path='/mnt' needs launch.k8s.local_volume=hostPath",
        ),
    ],
    ids=[
        "no-image",
        "layout",
        "unknown-key",
        "no-pvc",
        "grace",
        "gpu-no-cpu-memory",
        "relative-data",
        "bad-quantity",
        "capability-prefix",
        "toleration-field",
        "toleration-effect",
        "toleration-of-every-taint",
        "kueue-priority-without-queue",
        "node-selector",
        "pull-secret",
        "extended-resource-name",
        "extended-resource-gpu",
        "host-path-with-empty-dir",
    ],
)
def test_bad_input_refused_before_submit(
    overrides: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A kubeconfig that does not exist: reaching the API step would fail differently.
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-such-kubeconfig"))
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        cli(overrides + [f"output_dir={tmp_path}"])
    assert "\n" not in str(info.value)  # one actionable line
    assert not list(tmp_path.rglob("*.yaml"))


def test_bad_key_exits_2_through_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    argv = ["k8s", *GPT, "launch.k8s.capabilities=[ipc_lock]", f"output_dir={tmp_path}"]
    assert launch_main([*argv, *BASE, "--dry-run"]) == exit_codes.CONFIG_ERROR == 2


def test_invalid_env_name_refused() -> None:
    # Hydra's override grammar cannot even spell such a key; a config file could.
    plan, _ = k8s.render_run(RECIPES["gpt_125m"] + BASE)
    bad = dataclasses.replace(plan.run.launch.k8s, env={"9 LIVES": "x"})
    run = dataclasses.replace(plan.run, launch=dataclasses.replace(plan.run.launch, k8s=bad))
    with pytest.raises(ConfigError, match="not valid environment variable names"):
        render(dataclasses.replace(plan, run=run), "test", COMMIT)


def test_live_lease_refuses_submit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-such-kubeconfig"))
    lease = RunLease(RunLayout(tmp_path, "gpt_125m"), attempt=1, timeout_s=60)
    lease.acquire()
    try:
        # exit 6 (LEASE_HELD), as the trainer's own acquire says it
        assert cli(GPT + [f"output_dir={tmp_path}"] + BASE) == exit_codes.LEASE_HELD
        # A dry run only renders (nothing into the run dir), so it still works while the job
        # runs.
        assert cli(GPT + [f"output_dir={tmp_path}", "--dry-run", *NO_FIT] + BASE) == 0
    finally:
        lease.release()


def test_a_submission_refuses_an_image_given_by_tag_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every pod the operator starts or restarts pulls the image again, and a tag can move in
    between: a real submission wants NAME@sha256:DIGEST, or --allow-tag; a dry run renders."""
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-such-kubeconfig"))
    tagged = ["launch.k8s.image=registry.example/mcore-recipes:v1", "launch.k8s.shared_pvc=c"]
    argv = ["k8s", *GPT, f"output_dir={tmp_path}", *tagged, *NO_FIT]
    assert launch_main(argv) == exit_codes.CONFIG_ERROR
    [line] = [ln for ln in capsys.readouterr().err.splitlines() if "ERROR" in ln]
    assert "launch.k8s.image='registry.example/mcore-recipes:v1' names a tag, not a digest" in line
    assert "NAME@sha256:DIGEST" in line and "--allow-tag" in line
    assert not any(tmp_path.iterdir())  # refused before anything is written
    assert launch_main([*argv, "--dry-run"]) == exit_codes.OK
    [warning] = [ln for ln in capsys.readouterr().err.splitlines() if "names a tag" in ln]
    assert "WARNING" in warning and "a submission would be refused" in warning
    # --allow-tag passes the check: the submission goes on to the API (here: no kubeconfig)
    assert launch_main([*argv, "--allow-tag"]) == exit_codes.INFRASTRUCTURE
    assert "cannot load kubeconfig" in capsys.readouterr().err
    assert k8s.tag_only(IMAGE, allow_tag=False) is None  # the digest pins it
