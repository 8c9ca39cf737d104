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
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml

from launch import k8s
from launch.k8s_entry import Outcome, RetryBudget, classify
from launch.k8s_render import render
from launch.k8s_schema import (
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

try:
    crd_path()
except ConfigError as exc:
    pytest.skip(f"PyTorchJob CRD unavailable: {exc}", allow_module_level=True)

GOLDEN = Path(__file__).parent / "golden" / "k8s"
IMAGE = "registry.example/mcore-recipes@sha256:0123456789abcdef"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "test-token-123"
BASE = [f"launch.k8s.image={IMAGE}", "launch.k8s.shared_pvc=ckpt-rwx"]
RECIPES = {
    # Each names its run (as a user continuing one would): the goldens are stable across launches.
    "gpt_125m": ["recipe=gpt_125m", "run_id=gpt_125m"],
    "llama3_70b": ["recipe=llama3_70b", "run_id=llama3_70b"],
    "mixtral_8x7b": ["recipe=mixtral_8x7b", "run_id=mixtral_8x7b"],
    "gpt_tiny": [
        "recipe=gpt_tiny",
        "run_id=gpt_tiny",
        "launch.nodes=2",
        "launch.nproc_per_node=1",
        "launch.k8s.cpu=4",
        "launch.k8s.memory=8Gi",
        "launch.k8s.queue=research",
        "launch.k8s.priority_class=low",
        "+launch.k8s.env.NCCL_DEBUG=WARN",
        "launch.k8s.local_volume=hostPath",
        "launch.k8s.local_host_path=/mnt/nvme",
    ],
}


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
    env = {e["name"]: e["value"] for e in container(job)["env"]}
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


def test_local_tier_writes_to_the_node_local_volume() -> None:
    _, rendered = k8s.render_run(
        RECIPES["gpt_tiny"]
        + BASE
        + ["checkpoint.local.interval=10", "checkpoint.local.dir=/ignored/in/pods"]
    )
    assert rendered.pod_run.checkpoint.local.dir == "/local-ckpt"
    mounts = container(rendered.job)["volumeMounts"]
    assert {"name": "local-ckpt", "mountPath": "/local-ckpt"} in mounts


def test_job_name_is_a_dns_label_that_leaves_room_for_pod_names() -> None:
    _, rendered = k8s.render_run(["recipe=mixtral_8x7b", "run_id=" + "Run_" * 30] + BASE)
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
        (_mutate(f"{C0}/volumeMounts/1/mountPath", "/dev/shm"), "duplicate entry"),
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
    ],
    ids=["no-image", "layout", "unknown-key", "no-pvc", "grace"],
)
def test_bad_input_refused_before_submit(
    overrides: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A kubeconfig that does not exist: reaching the API step would fail differently.
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-such-kubeconfig"))
    with pytest.raises(ConfigError, match=re.escape(message)):
        cli(overrides + [f"output_dir={tmp_path}"])
    assert not list(tmp_path.rglob("*.yaml"))


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
            cli(["recipe=gpt_125m", "run_id=gpt_125m", f"output_dir={tmp_path}"] + BASE)
        # A dry run only renders, so it still works while the job runs.
        assert (
            cli(
                ["recipe=gpt_125m", "run_id=gpt_125m", f"output_dir={tmp_path}", "--dry-run"] + BASE
            )
            == 0
        )
    finally:
        lease.release()


# --- the API calls, against a loopback stand-in -----------------------------------------------


class FakeApiServer:
    """Answers the handful of API-server routes the adapter uses; records every request."""

    def __init__(self, fail_job_create: bool = False) -> None:
        self.requests: list[dict[str, Any]] = []
        self.jobs: dict[str, dict[str, Any]] = {}
        self.fail_job_create = fail_job_create
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

            do_GET = do_POST = do_DELETE = _serve

        return Handler

    def answer(self, req: dict[str, Any]) -> tuple[int, Any]:
        parts = req["path"].strip("/").split("/")
        if req["method"] == "POST" and parts[-1] == "configmaps":
            return 201, req["body"]
        if req["method"] == "POST" and parts[-1] == "pytorchjobs":
            if self.fail_job_create:
                return 422, {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "status": "Failure",
                    "message": "admission webhook denied the request",
                    "code": 422,
                }
            created = {**req["body"], "metadata": {**req["body"]["metadata"], "uid": "u-1"}}
            self.jobs[created["metadata"]["name"]] = created
            return 201, created
        if req["method"] == "GET" and "pytorchjobs" in parts:
            job = self.jobs.get(parts[-1])
            if job is None:
                return 404, {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "status": "Failure",
                    "message": f'pytorchjobs "{parts[-1]}" not found',
                    "code": 404,
                }
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
        if req["method"] == "DELETE":
            return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success", "metadata": {}}
        return 404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404}


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
    argv = [
        "recipe=llama3_70b",
        "run_id=llama3_70b",
        f"output_dir={tmp_path}",
        "launch.k8s.namespace=team-a",
    ] + BASE
    _, rendered = k8s.render_run(argv)
    assert cli(argv) == 0
    assert [(r["method"], r["path"]) for r in api.requests] == [
        ("POST", "/api/v1/namespaces/team-a/configmaps"),
        ("POST", "/apis/kubeflow.org/v1/namespaces/team-a/pytorchjobs"),
    ]
    assert all(r["auth"] == f"Bearer {TOKEN}" for r in api.requests)
    assert api.requests[0]["body"] == rendered.config_map
    assert api.requests[1]["body"] == rendered.job
    run_dir = tmp_path / "llama3_70b"
    assert (
        list(yaml.safe_load_all((run_dir / "k8s" / "llama3-70b.yaml").read_text()))
        == rendered.objects
    )
    assert load_config_file(run_dir / "launch-config.yaml").output_dir == "/checkpoints"
    record = json.loads((run_dir / "submission-k8s.json").read_text())
    assert (record["name"], record["namespace"], record["uid"]) == ("llama3-70b", "team-a", "u-1")


def test_rejected_job_rolls_back_its_config_map(
    api: FakeApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    api.fail_job_create = True
    assert (
        cli(["recipe=gpt_125m", "run_id=gpt_125m", f"output_dir={tmp_path}"] + BASE)
        == exit_codes.INFRASTRUCTURE
    )
    assert [(r["method"], r["path"]) for r in api.requests][-1] == (
        "DELETE",
        "/api/v1/namespaces/default/configmaps/gpt-125m-config",
    )
    assert "HTTP 422" in caplog.text and "admission webhook denied" in caplog.text


def test_status_logs_delete(
    api: FakeApiServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli(["recipe=llama3_70b", "run_id=llama3_70b", f"output_dir={tmp_path}"] + BASE) == 0
    capsys.readouterr()
    assert cli(["status", "llama3-70b"]) == 0
    out = capsys.readouterr().out
    assert "default/llama3-70b" in out and "Running" in out and "Worker: active=7" in out
    assert cli(["logs", "llama3-70b", "--replica", "worker", "--index", "3", "--tail", "5"]) == 0
    assert capsys.readouterr().out == "step 1 loss 10.9\nstep 2 loss 10.7\n"
    assert cli(["delete", "llama3-70b", "--namespace", "default"]) == 0
    calls = [(r["method"], r["path"]) for r in api.requests[2:]]
    assert calls == [
        ("GET", "/apis/kubeflow.org/v1/namespaces/default/pytorchjobs/llama3-70b"),
        ("GET", "/api/v1/namespaces/default/pods"),
        ("GET", "/api/v1/namespaces/default/pods/job-master-0/log"),
        ("DELETE", "/apis/kubeflow.org/v1/namespaces/default/pytorchjobs/llama3-70b"),
        ("DELETE", "/api/v1/namespaces/default/configmaps/llama3-70b-config"),
    ]
    pods, log_req = api.requests[3], api.requests[4]
    assert pods["query"]["labelSelector"] == [
        "training.kubeflow.org/job-name=llama3-70b,training.kubeflow.org/replica-type=worker,"
        "training.kubeflow.org/replica-index=3"
    ]
    assert log_req["query"]["container"] == ["pytorch"] and log_req["query"]["tailLines"] == ["5"]
    assert all(r["auth"] == f"Bearer {TOKEN}" for r in api.requests)
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
