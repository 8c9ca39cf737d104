"""The k8s adapter: rendered PyTorchJobs against the real CRD schema, refusals before submission,
the submit/status/logs/delete calls against a loopback API-server stand-in, and the in-pod
exit-code wrapper. No cluster: nothing here proves the operator runs these jobs."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml

from launch import k8s
from launch.__main__ import main as launch_main
from launch.k8s_entry import Outcome, RetryBudget, classify
from launch.k8s_render import render
from launch.k8s_schema import (
    CRD_ENV,
    CRD_FILE,
    crd_path,
    crd_schema,
    operator_errors,
    schema_errors,
    to_json_schema,
    validate_objects,
)
from pretrain import exit_codes
from recipes import ConfigError
from recipes.load import load_config_file
from resiliency.storage.layout import RunLayout
from resiliency.storage.lease import RunLease
from tests.helpers import REPO

pytest.importorskip("jsonschema", reason="the k8s extra validates manifests with jsonschema")

GOLDEN = Path(__file__).parent / "golden" / "k8s"
SHARED_CRD = REPO.parent / "shared" / "k8s" / CRD_FILE  # where the shipped copy was taken from
IMAGE = "registry.example/mcore-recipes@sha256:0123456789abcdef"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "test-token-123"
BASE = [f"launch.k8s.image={IMAGE}", "launch.k8s.shared_pvc=ckpt-rwx"]
# The recipes' data paths are relative (for local runs); in a pod they must be on a volume.
STDLIB_ON_CLAIM = "data.paths=[/checkpoints/data/stdlib_text_document]"
GPU_NODE = ["launch.k8s.cpu=96", "launch.k8s.memory=1600Gi"]  # Guaranteed QoS on GPU pods


def _hf_data(name: str) -> list[str]:
    return [
        f"data.paths=[/checkpoints/data/{name}_text_document]",
        f"data.tokenizer_path=/checkpoints/tokenizers/{name}",
    ]


RECIPES = {
    # Each names its run (as a user continuing one would): the goldens are stable across launches.
    "gpt_125m": ["recipe=gpt_125m", "run_id=gpt_125m", STDLIB_ON_CLAIM, *GPU_NODE],
    "llama3_70b": [
        "recipe=llama3_70b",
        "run_id=llama3_70b",
        *_hf_data("llama3"),
        *GPU_NODE,
        # An InfiniBand cluster: RDMA devices from the device plugin, memory pinning for NCCL,
        # the local checkpoint tier on its default node-local hostPath.
        "+launch.k8s.extended_resources={rdma/ib: 1}",
        "launch.k8s.capabilities=[IPC_LOCK]",
        "checkpoint.local.interval=50",
        "checkpoint.local.dir=/nvme/ckpt",
    ],
    "mixtral_8x7b": ["recipe=mixtral_8x7b", "run_id=mixtral_8x7b", *_hf_data("mixtral"), *GPU_NODE],
    "gpt_tiny": [
        "recipe=gpt_tiny",
        "run_id=gpt_tiny",
        STDLIB_ON_CLAIM,
        "launch.nodes=2",
        "launch.nproc_per_node=1",
        "launch.k8s.cpu=4",
        "launch.k8s.memory=8Gi",
        "launch.k8s.queue=research",
        "launch.k8s.priority_class=low",
        "+launch.k8s.env.NCCL_DEBUG=WARN",
        "launch.k8s.local_volume=hostPath",
        "launch.k8s.local_host_path=/mnt/nvme",
        "checkpoint.local.interval=10",
        "checkpoint.local.dir=/ignored/in/pods",
        "launch.k8s.tolerations=[{key: dedicated, operator: Equal, value: training, "
        "effect: NoSchedule}]",
        "+launch.k8s.node_selector={node.kubernetes.io/instance-type: c7i.4xlarge}",
        "launch.k8s.image_pull_secrets=[registry-creds]",
    ],
}
GPT = RECIPES["gpt_125m"]


@pytest.fixture(autouse=True)
def stable_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MCORE_RECIPES_CODE_COMMIT", COMMIT)
    monkeypatch.setenv(k8s.SUBMISSION_ENV, "test")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)


def cli(argv: list[str]) -> int:
    """What `python -m launch k8s ARGV` runs, in-process."""
    parser = argparse.ArgumentParser()
    k8s.add_arguments(parser)
    args, overrides = parser.parse_known_args(argv)
    return k8s.run(args, overrides)


def master(job: dict[str, Any]) -> dict[str, Any]:
    return job["spec"]["pytorchReplicaSpecs"]["Master"]


def container(job: dict[str, Any]) -> dict[str, Any]:
    return master(job)["template"]["spec"]["containers"][0]


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
    long_name = ["recipe=mixtral_8x7b", "run_id=" + "Run_" * 30, *_hf_data("mixtral"), *GPU_NODE]
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
        with pytest.raises(ConfigError, match="owned by a live job"):
            cli(GPT + [f"output_dir={tmp_path}"] + BASE)
        # A dry run only renders, so it still works while the job runs.
        assert cli(GPT + [f"output_dir={tmp_path}", "--dry-run"] + BASE) == 0
    finally:
        lease.release()


# --- the API calls, against a loopback stand-in -----------------------------------------------


def _status(code: int, message: str = "") -> dict[str, Any]:
    failed = code >= 400
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure" if failed else "Success",
        "metadata": {},
        **({"message": message, "code": code} if failed else {}),
    }


class FakeApiServer:
    """Answers the handful of API-server routes the adapter uses; records every request.
    Keeps ConfigMaps and jobs by name (a second create of one is 409 AlreadyExists), and
    collects a deleted job's owned ConfigMaps at once, as the garbage collector would later."""

    def __init__(self, fail_job_create: bool = False) -> None:
        self.requests: list[dict[str, Any]] = []
        self.jobs: dict[str, dict[str, Any]] = {}
        self.config_maps: dict[str, dict[str, Any]] = {}
        self.fail_job_create = fail_job_create
        self.fail_patch = False
        self.uids = iter(f"u-{i}" for i in range(1, 100))
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                url = urlsplit(self.path)
                request = {
                    "method": self.command,
                    "path": url.path,
                    "query": parse_qs(url.query),
                    "auth": self.headers.get("Authorization"),
                    "content_type": self.headers.get("Content-Type"),
                    "body": json.loads(raw) if raw else None,
                }
                fake.requests.append(request)
                status, body = fake.answer(request)
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header(
                    "Content-Type", "text/plain" if isinstance(body, str) else "application/json"
                )
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = do_PATCH = _serve

        return Handler

    def answer(self, req: dict[str, Any]) -> tuple[int, Any]:
        parts = req["path"].strip("/").split("/")
        if "configmaps" in parts:
            return self._config_maps(req, parts)
        if req["method"] == "POST" and parts[-1] == "pytorchjobs":
            if self.fail_job_create:
                return 422, _status(422, "admission webhook denied the request")
            name = req["body"]["metadata"]["name"]
            if name in self.jobs:
                return 409, _status(409, f'pytorchjobs.kubeflow.org "{name}" already exists')
            uid = next(self.uids)
            created = {**req["body"], "metadata": {**req["body"]["metadata"], "uid": uid}}
            self.jobs[name] = created
            return 201, created
        if req["method"] == "DELETE" and "pytorchjobs" in parts:
            job = self.jobs.pop(parts[-1])
            uid = job["metadata"]["uid"]
            for name, cm in list(self.config_maps.items()):
                if uid in [o["uid"] for o in cm["metadata"].get("ownerReferences", [])]:
                    del self.config_maps[name]
            return 200, _status(200)
        if req["method"] == "GET" and "pytorchjobs" in parts:
            job = self.jobs.get(parts[-1])
            if job is None:
                return 404, _status(404, f'pytorchjobs "{parts[-1]}" not found')
            return 200, {
                **job,
                "status": {
                    "conditions": [
                        {
                            "type": "Created",
                            "status": "True",
                            "reason": "PyTorchJobCreated",
                            "message": "created",
                            "lastTransitionTime": "2030-01-01T00:00:00Z",
                        },
                        {
                            "type": "Running",
                            "status": "True",
                            "reason": "PyTorchJobRunning",
                            "message": "running",
                            "lastTransitionTime": "2030-01-01T00:01:00Z",
                        },
                    ],
                    "replicaStatuses": {"Master": {"active": 1}, "Worker": {"active": 7}},
                },
            }
        if req["method"] == "GET" and parts[-1] == "pods":
            return 200, {
                "apiVersion": "v1",
                "kind": "PodList",
                "metadata": {},
                "items": [
                    {
                        "metadata": {
                            "name": "job-master-0",
                            "namespace": parts[3],
                            "creationTimestamp": "2030-01-01T00:00:00Z",
                        },
                        "spec": {"containers": [{"name": "pytorch", "image": IMAGE}]},
                    }
                ],
            }
        if req["method"] == "GET" and parts[-1] == "log":
            return 200, "step 1 loss 10.9\nstep 2 loss 10.7\n"
        return 404, _status(404, f"no route {req['method']} {req['path']}")

    def _config_maps(self, req: dict[str, Any], parts: list[str]) -> tuple[int, Any]:
        if req["method"] == "POST":
            name = req["body"]["metadata"]["name"]
            if name in self.config_maps:
                return 409, _status(409, f'configmaps "{name}" already exists')
            self.config_maps[name] = copy.deepcopy(req["body"])
            return 201, req["body"]
        if req["method"] == "PATCH":
            if self.fail_patch:
                return 403, _status(403, "configmaps is forbidden: cannot patch")
            # JSON Patch, the one form the adapter sends: add one field of metadata.
            assert req["content_type"] == "application/json-patch+json"
            [op] = req["body"]
            assert op["op"] == "add" and op["path"] == "/metadata/ownerReferences"
            self.config_maps[parts[-1]]["metadata"]["ownerReferences"] = op["value"]
            return 200, self.config_maps[parts[-1]]
        if req["method"] == "DELETE" and parts[-1] == "configmaps":  # by label selector
            key, value = req["query"]["labelSelector"][0].split("=")
            for name, cm in list(self.config_maps.items()):
                if cm["metadata"]["labels"].get(key) == value:
                    del self.config_maps[name]
            return 200, _status(200)
        if req["method"] == "DELETE":
            self.config_maps.pop(parts[-1], None)
            return 200, _status(200)
        return 404, _status(404, f"no route {req['method']} {req['path']}")


@pytest.fixture
def api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeApiServer]:
    fake = FakeApiServer()
    fake.thread.start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "fake",
                "clusters": [{"name": "fake", "cluster": {"server": fake.url}}],
                "users": [{"name": "tester", "user": {"token": TOKEN}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "tester"}}],
            }
        )
    )
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    yield fake
    fake.server.shutdown()
    fake.server.server_close()


def test_submit_posts_the_rendered_objects(api: FakeApiServer, tmp_path: Path) -> None:
    argv = RECIPES["llama3_70b"] + [f"output_dir={tmp_path}", "launch.k8s.namespace=team-a"] + BASE
    _, rendered = k8s.render_run(argv)
    assert cli(argv) == 0
    cm_path = "/api/v1/namespaces/team-a/configmaps"
    assert [(r["method"], r["path"]) for r in api.requests] == [
        ("POST", cm_path),
        ("POST", "/apis/kubeflow.org/v1/namespaces/team-a/pytorchjobs"),
        ("PATCH", f"{cm_path}/llama3-70b-config-test"),
    ]
    assert all(r["auth"] == f"Bearer {TOKEN}" for r in api.requests)
    assert api.requests[0]["body"] == rendered.config_map
    assert api.requests[1]["body"] == rendered.job
    # Once the job exists it owns the ConfigMap: deleting the job deletes the ConfigMap.
    assert api.config_maps["llama3-70b-config-test"]["metadata"]["ownerReferences"] == [
        {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": "llama3-70b", "uid": "u-1"}
    ]
    run_dir = tmp_path / "llama3_70b"
    assert (
        list(yaml.safe_load_all((run_dir / "k8s" / "llama3-70b.yaml").read_text()))
        == rendered.objects
    )
    assert load_config_file(run_dir / "launch-config.yaml").output_dir == "/checkpoints"
    record = json.loads((run_dir / "submission-k8s.json").read_text())
    assert (record["name"], record["namespace"], record["uid"]) == ("llama3-70b", "team-a", "u-1")


def test_resubmit_after_delete_never_collides(
    api: FakeApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = GPT + [f"output_dir={tmp_path}"] + BASE
    monkeypatch.setenv(k8s.SUBMISSION_ENV, "first")
    assert cli(argv) == 0
    # Deleted behind the adapter's back (kubectl delete pytorchjob): the owner reference lets
    # the garbage collector take the ConfigMap along.
    job_url = f"{api.url}/apis/kubeflow.org/v1/namespaces/default/pytorchjobs/gpt-125m"
    urllib.request.urlopen(urllib.request.Request(job_url, method="DELETE"), timeout=10).close()
    assert api.config_maps == {}
    # Even while a collected ConfigMap still lingers, a resubmission gets a name of its own.
    api.config_maps["gpt-125m-config-first"] = {"metadata": {"labels": {}}}
    monkeypatch.setenv(k8s.SUBMISSION_ENV, "second")
    assert cli(argv) == 0
    assert "gpt-125m-config-second" in api.config_maps


def test_unowned_config_map_is_still_deleted_with_its_job(
    api: FakeApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    api.fail_patch = True
    assert cli(GPT + [f"output_dir={tmp_path}"] + BASE) == 0  # the job runs regardless
    assert "HTTP 403" in caplog.text and "python -m launch k8s delete gpt-125m" in caplog.text
    assert "ownerReferences" not in api.config_maps["gpt-125m-config-test"]["metadata"]
    assert cli(["delete", "gpt-125m"]) == 0
    assert api.requests[-1]["query"]["labelSelector"] == ["mcore-recipes/job-name=gpt-125m"]
    assert api.config_maps == {} and api.jobs == {}


def test_rejected_job_rolls_back_its_config_map(
    api: FakeApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    api.fail_job_create = True
    assert cli(GPT + [f"output_dir={tmp_path}"] + BASE) == exit_codes.INFRASTRUCTURE
    assert [(r["method"], r["path"]) for r in api.requests][-1] == (
        "DELETE",
        "/api/v1/namespaces/default/configmaps/gpt-125m-config-test",
    )
    assert "HTTP 422" in caplog.text and "admission webhook denied" in caplog.text
    assert api.config_maps == {}


def test_status_logs_delete(
    api: FakeApiServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli(RECIPES["llama3_70b"] + [f"output_dir={tmp_path}"] + BASE) == 0
    capsys.readouterr()
    assert cli(["status", "llama3-70b"]) == 0
    out = capsys.readouterr().out
    assert "default/llama3-70b" in out and "Running" in out and "Worker: active=7" in out
    assert cli(["logs", "llama3-70b", "--replica", "worker", "--index", "3", "--tail", "5"]) == 0
    assert capsys.readouterr().out == "step 1 loss 10.9\nstep 2 loss 10.7\n"
    assert cli(["delete", "llama3-70b", "--namespace", "default"]) == 0
    calls = [(r["method"], r["path"]) for r in api.requests[3:]]
    assert calls == [
        ("GET", "/apis/kubeflow.org/v1/namespaces/default/pytorchjobs/llama3-70b"),
        ("GET", "/api/v1/namespaces/default/pods"),
        ("GET", "/api/v1/namespaces/default/pods/job-master-0/log"),
        ("DELETE", "/apis/kubeflow.org/v1/namespaces/default/pytorchjobs/llama3-70b"),
        ("DELETE", "/api/v1/namespaces/default/configmaps"),
    ]
    pods, log_req = api.requests[4], api.requests[5]
    assert pods["query"]["labelSelector"] == [
        "training.kubeflow.org/job-name=llama3-70b,training.kubeflow.org/replica-type=worker,"
        "training.kubeflow.org/replica-index=3"
    ]
    assert log_req["query"]["container"] == ["pytorch"] and log_req["query"]["tailLines"] == ["5"]
    assert all(r["auth"] == f"Bearer {TOKEN}" for r in api.requests)
    assert api.config_maps == {}
    assert cli(["status", "nope"]) == exit_codes.INFRASTRUCTURE


def test_cli_subprocess_dry_run(tmp_path: Path) -> None:
    out = tmp_path / "job.yaml"
    env = {**os.environ, "MCORE_RECIPES_CODE_COMMIT": COMMIT, k8s.SUBMISSION_ENV: "test"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch",
            "k8s",
            "recipe=gpt_tiny",
            STDLIB_ON_CLAIM,
            "launch.nodes=2",
            "launch.nproc_per_node=1",
            f"output_dir={tmp_path}",
            "--dry-run",
            "--out",
            str(out),
        ]
        + BASE,
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    docs = list(yaml.safe_load_all(proc.stdout))
    assert [d["kind"] for d in docs] == ["ConfigMap", "PyTorchJob"]
    assert out.read_text() == proc.stdout
    proc = subprocess.run(
        [sys.executable, "-m", "launch", "k8s", "recipe=gpt_tiny", "--dry-run"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == exit_codes.CONFIG_ERROR
    assert "launch.k8s.image is required" in proc.stderr


# --- the CRD ships with the package -----------------------------------------------------------


def test_crd_is_the_shipped_copy_unless_overridden(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(CRD_ENV, raising=False)
    assert crd_path() == REPO / "launch" / "schemas" / CRD_FILE
    monkeypatch.setenv(CRD_ENV, str(tmp_path / "crd.yaml"))
    with pytest.raises(ConfigError, match=r"not found at .*crd.yaml \(\$MCORE_RECIPES_PYTORCHJOB"):
        crd_path()


@pytest.mark.skipif(not SHARED_CRD.is_file(), reason=f"{SHARED_CRD} not present")
def test_shipped_crd_is_the_shared_copy() -> None:
    shipped = REPO / "launch" / "schemas" / CRD_FILE
    assert shipped.read_bytes() == SHARED_CRD.read_bytes()


def _install_wheel(tmp_path: Path) -> Path:
    """Build a wheel from a copy of the sources (building in the checkout would write build/
    and *.egg-info there) and unpack it into a directory of its own; returns that directory."""
    src, site = tmp_path / "src", tmp_path / "site"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for package in ("recipes", "pretrain", "resiliency", "launch", "drill", "bench"):
        shutil.copytree(REPO / package, src / package, ignore=skip)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    wheels = tmp_path / "wheels"
    build = ["wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src)]
    proc = subprocess.run(pip + build, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [wheel] = wheels.glob("mcore_recipes-*.whl")
    install = ["install", "--no-deps", "--no-index", "--target", str(site), str(wheel)]
    proc = subprocess.run(pip + install, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return site


def test_installed_wheel_renders_and_validates_outside_the_repo(tmp_path: Path) -> None:
    site = _install_wheel(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site), k8s.SUBMISSION_ENV: "test"}
    env.pop(CRD_ENV, None)
    run = dict(cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)
    probe = "import launch, recipes, launch.k8s_schema as s; print(launch.__file__, s.crd_path())"
    proc = subprocess.run([sys.executable, "-c", probe], **run)
    assert proc.returncode == 0, proc.stderr
    shipped = site / "launch" / "schemas" / CRD_FILE
    assert proc.stdout.split() == [str(site / "launch" / "__init__.py"), str(shipped)]
    argv = [*RECIPES["llama3_70b"], *BASE, f"output_dir={tmp_path / 'runs'}", "--dry-run"]
    proc = subprocess.run([sys.executable, "-m", "launch", "k8s", *argv], **run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config_map, job = yaml.safe_load_all(proc.stdout)
    assert job["kind"] == "PyTorchJob" and config_map["kind"] == "ConfigMap"
    assert schema_errors(job, shipped) == [] and operator_errors(job) == []
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 7


# --- the in-pod wrapper -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "outcome, expected",
    [
        (Outcome(0, False), (0, False)),
        (Outcome(exit_codes.NUMERIC, False), (exit_codes.NUMERIC, False)),
        (Outcome(exit_codes.CONFIG_ERROR, False), (exit_codes.CONFIG_ERROR, False)),
        (Outcome(exit_codes.REQUEUE, False), (203, False)),
        (Outcome(exit_codes.INFRASTRUCTURE, False), (129, True)),
        (Outcome(-9, False), (137, True)),
        (Outcome(-15, True), (143, False)),
        (Outcome(42, False), (42, False)),
    ],
)
def test_exit_code_mapping(outcome: Outcome, expected: tuple[int, bool]) -> None:
    # The operator retries a container exit code >= 128 (IsRetryableExitCode), fails on 1-127.
    assert classify(outcome) == expected


def test_retry_budget_counts_unplanned_restarts(tmp_path: Path) -> None:
    budget = RetryBudget(tmp_path / "node-0.json", limit=2)
    assert budget.start() and budget.finish(counted=True)  # retry 1
    assert budget.start() and budget.finish(counted=False)  # preempted: free
    assert budget.start()  # killed before recording: counted at the next start (retry 2)
    assert budget.start() and not budget.finish(counted=True)  # retry 3 > 2


def test_wrapper_recovers_the_worker_exit_code_torchrun_drops(tmp_path: Path) -> None:
    script = tmp_path / "exit.py"
    script.write_text("import sys\nsys.exit(75)\n")
    env = {**os.environ, "MCORE_RECIPES_JOB_ID": "job-test", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.k8s_entry",
            "--retries",
            "1",
            "--state-dir",
            str(tmp_path / "state"),
            "--",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(script),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 128 + exit_codes.REQUEUE, proc.stderr[-3000:]
    state = json.loads((tmp_path / "state" / "job-test" / "node-0.json").read_text())
    assert state == {"retries": 0, "running": False}


def test_ft_launcher_entry_gets_its_config(tmp_path: Path) -> None:
    """ft_launcher refuses to start without --ft-cfg-path: the pod entry writes it."""
    from launch.k8s_entry import with_ft_config
    from recipes import load_config, to_yaml

    pinned = tmp_path / "launch-config.yaml"
    pinned.write_text(to_yaml(load_config(["recipe=gpt_tiny", "launch.backend=ft_launcher"])))
    args = with_ft_config(["--nnodes=2", "-m", "pretrain", "--config", str(pinned)], tmp_path)
    flag, path = args[0].split("=", 1)
    assert flag == "--ft-cfg-path" and Path(path).is_file()
    assert "rank_section_timeouts" in Path(path).read_text() or "section" in Path(path).read_text()
    assert args[1:] == ["--nnodes=2", "-m", "pretrain", "--config", str(pinned)]


def test_pod_on_an_unhealthy_node_exits_before_torchrun(tmp_path: Path) -> None:
    """The node health check runs in the pod before the launcher: a failing one exits as an
    infrastructure failure (the operator retries it), counted in the budget, no rank started."""
    from recipes import load_config, to_yaml

    pinned = tmp_path / "launch-config.yaml"
    run = load_config(
        ["recipe=gpt_tiny", f"output_dir={tmp_path}", "resiliency.health.script=/bin/false"]
    )
    pinned.write_text(to_yaml(run))
    env = {**os.environ, "MCORE_RECIPES_JOB_ID": "job-sick", "MCORE_RECIPES_NODE": "pod-0"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.k8s_entry",
            "--retries",
            "2",
            "--state-dir",
            str(tmp_path / "state"),
            "--",
            "--standalone",
            "-m",
            "pretrain",
            "--config",
            str(pinned),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == exit_codes.INFRASTRUCTURE, proc.stderr[-3000:]
    assert "UNHEALTHY: script: '/bin/false' exit 1" in proc.stderr
    assert "torchrun" not in proc.stderr.lower().replace("launch.k8s_entry", "")
    health = tmp_path / "state" / "job-sick" / "health"
    [report] = [json.loads(p.read_text()) for p in health.glob("*.json")]
    assert report["ok"] is False
    state = json.loads((tmp_path / "state" / "job-sick" / "node-0.json").read_text())
    assert state == {"retries": 1, "running": False}
