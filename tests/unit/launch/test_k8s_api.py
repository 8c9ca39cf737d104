"""The k8s adapter's submit/status/logs/delete calls against a loopback API-server stand-in."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml

from launch.k8s import cli as k8s
from pretrain.context import exit_codes
from recipes import ConfigError
from recipes.load import load_config_file
from tests.helpers import REPO
from tests.k8s_helpers import (
    BASE,
    COMMIT,
    GPT,
    IMAGE,
    NO_FIT,
    RECIPES,
    STDLIB_ON_CLAIM,
    TOKEN,
    cli,
    stable_env,  # noqa: F401 - autouse fixture
)

pytest.importorskip("jsonschema", reason="the k8s extra validates manifests with jsonschema")


# --- the API calls, against a loopback stand-in -----------------------------------------------


def _delete_selected(
    store: dict[str, dict[str, Any]], req: dict[str, Any], prefix: str = ""
) -> None:
    """A delete-collection by label selector ("k=v,k2=v2"): every object of ``store`` whose
    key starts with ``prefix`` (a namespace) and whose labels match."""
    wanted = dict(kv.split("=") for kv in req["query"]["labelSelector"][0].split(","))
    for name, obj in list(store.items()):
        labels = obj["metadata"].get("labels", {})
        if name.startswith(prefix) and all(labels.get(k) == v for k, v in wanted.items()):
            del store[name]


def _status(code: int, message: str = "") -> dict[str, Any]:
    failed = code >= 400
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure" if failed else "Success",
        "metadata": {},
        **({"message": message, "code": code} if failed else {}),
    }


_KINDS = {"pytorchjobs": "PyTorchJob", "trainjobs": "TrainJob"}


class FakeApiServer:
    """Answers the handful of API-server routes the adapter uses; records every request.
    Keeps ConfigMaps and jobs by name (a second create of one is 409 AlreadyExists), and
    collects a deleted job's owned ConfigMaps and TrainingRuntimes at once, as the garbage
    collector would later."""

    def __init__(self, fail_job_create: bool = False) -> None:
        self.requests: list[dict[str, Any]] = []
        self.jobs: dict[str, dict[str, Any]] = {}
        self.config_maps: dict[str, dict[str, Any]] = {}
        self.deployments: dict[str, dict[str, Any]] = {}
        self.runtimes: dict[str, dict[str, Any]] = {}  # ClusterTrainingRuntimes by name
        self.ns_runtimes: dict[str, dict[str, Any]] = {}  # TrainingRuntimes by "NS/name"
        self.pod_selectors: list[str] = []
        self.forbid_pytorchjobs = False
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
        if "deployments" in parts:
            return self._deployments(req)
        if "clustertrainingruntimes" in parts:
            return self._runtimes(req, parts)
        if "trainingruntimes" in parts:
            return self._namespaced_runtimes(req, parts)
        jobs = [p for p in ("pytorchjobs", "trainjobs") if p in parts]
        if self.forbid_pytorchjobs and "pytorchjobs" in parts:  # a Trainer-only cluster
            return 403, _status(403, "pytorchjobs.kubeflow.org is forbidden")
        if req["method"] == "POST" and parts[-1] in ("pytorchjobs", "trainjobs"):
            if self.fail_job_create:
                return 422, _status(422, "admission webhook denied the request")
            name = req["body"]["metadata"]["name"]
            if name in self.jobs:
                return 409, _status(409, f'{parts[-1]} "{name}" already exists')
            uid = next(self.uids)
            created = {**req["body"], "metadata": {**req["body"]["metadata"], "uid": uid}}
            self.jobs[name] = created
            return 201, created
        if jobs and self.jobs.get(parts[-1], {}).get("kind") != _KINDS[jobs[0]]:
            return 404, _status(404, f'{jobs[0]} "{parts[-1]}" not found')
        if req["method"] == "DELETE" and jobs:
            job = self.jobs.pop(parts[-1])
            uid = job["metadata"]["uid"]
            for owned in (self.config_maps, self.ns_runtimes):
                for name, obj in list(owned.items()):
                    if uid in [o["uid"] for o in obj["metadata"].get("ownerReferences", [])]:
                        del owned[name]
            return 200, _status(200)
        if req["method"] == "GET" and "trainjobs" in parts:
            job = self.jobs[parts[-1]]
            condition = {
                "type": "Created",
                "status": "True",
                "reason": "JobSetCreated",
                "message": "created",
                "lastTransitionTime": "2030-01-01T00:00:00Z",
            }
            jobs_status = [{"name": "node", "active": 2, "ready": 2, "succeeded": 0, "failed": 0}]
            return 200, {**job, "status": {"conditions": [condition], "jobsStatus": jobs_status}}
        if req["method"] == "GET" and "pytorchjobs" in parts:
            job = self.jobs[parts[-1]]
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
            self.pod_selectors.append(req["query"]["labelSelector"][0])
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

    def _runtimes(self, req: dict[str, Any], parts: list[str]) -> tuple[int, Any]:
        """Cluster-scoped: /apis/trainer.kubeflow.org/v1alpha1/clustertrainingruntimes[/name]."""
        assert parts[:4] == ["apis", "trainer.kubeflow.org", "v1alpha1", "clustertrainingruntimes"]
        if req["method"] == "POST":
            name = req["body"]["metadata"]["name"]
            if name in self.runtimes:
                return 409, _status(409, f'clustertrainingruntimes "{name}" already exists')
            self.runtimes[name] = copy.deepcopy(req["body"])
            return 201, req["body"]
        if req["method"] == "DELETE" and parts[-1] == "clustertrainingruntimes":  # by labels
            _delete_selected(self.runtimes, req)
            return 200, _status(200)
        if parts[-1] not in self.runtimes:
            return 404, _status(404, f'clustertrainingruntimes "{parts[-1]}" not found')
        if req["method"] == "GET":
            return 200, self.runtimes[parts[-1]]
        if req["method"] == "DELETE":
            del self.runtimes[parts[-1]]
            return 200, _status(200)
        return 404, _status(404, f"no route {req['method']} {req['path']}")

    def _namespaced_runtimes(self, req: dict[str, Any], parts: list[str]) -> tuple[int, Any]:
        """/apis/trainer.kubeflow.org/v1alpha1/namespaces/NS/trainingruntimes[/name], kept
        by "NS/name"."""
        assert parts[:4] == ["apis", "trainer.kubeflow.org", "v1alpha1", "namespaces"]
        namespace, kind = parts[4], "trainingruntimes"
        if req["method"] == "POST":
            assert req["body"]["metadata"]["namespace"] == namespace
            key = f"{namespace}/{req['body']['metadata']['name']}"
            if key in self.ns_runtimes:
                return 409, _status(409, f'{kind} "{key}" already exists')
            self.ns_runtimes[key] = copy.deepcopy(req["body"])
            return 201, req["body"]
        if req["method"] == "DELETE" and parts[-1] == kind:  # by labels
            _delete_selected(self.ns_runtimes, req, prefix=f"{namespace}/")
            return 200, _status(200)
        key = f"{namespace}/{parts[-1]}"
        if key not in self.ns_runtimes:
            return 404, _status(404, f'{kind} "{parts[-1]}" not found')
        if req["method"] == "PATCH":  # the owner: a merge patch, the client's one form here
            assert req["content_type"] == "application/merge-patch+json"
            assert list(req["body"]) == ["metadata"] and list(req["body"]["metadata"]) == [
                "ownerReferences"
            ]
            self.ns_runtimes[key]["metadata"].update(req["body"]["metadata"])
            return 200, self.ns_runtimes[key]
        if req["method"] == "DELETE":
            del self.ns_runtimes[key]
            return 200, _status(200)
        return 404, _status(404, f"no route {req['method']} {req['path']}")

    def _deployments(self, req: dict[str, Any]) -> tuple[int, Any]:
        if req["method"] == "POST":
            assert req["path"].startswith("/apis/apps/v1/namespaces/")
            self.deployments[req["body"]["metadata"]["name"]] = copy.deepcopy(req["body"])
            return 201, req["body"]
        if req["method"] == "DELETE":  # by label selector
            _delete_selected(self.deployments, req)
            return 200, _status(200)
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
            _delete_selected(self.config_maps, req)
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


def test_remote_tier_submits_its_uploader_and_delete_removes_it(
    api: FakeApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role to wait for
    remote = ["checkpoint.remote.url=s3://bucket/runs", "launch.k8s.remote_secret=s3-creds"]
    argv = RECIPES["llama3_70b"] + [f"output_dir={tmp_path}", *remote] + BASE
    _, rendered = k8s.render_run(argv)
    with pytest.raises(ConfigError, match="checkpoint.remote: s3://bucket/runs"):
        cli(
            argv + NO_FIT
        )  # no object store reachable from here: refused before anything is submitted
    assert not [r for r in api.requests if r["method"] == "POST"]
    # Credentials only the pods hold (launch.k8s.remote_secret): the pods' trainer probes.
    assert cli([*argv, *NO_FIT, "--skip-remote-check"]) == 0
    posted = [r for r in api.requests if r["method"] == "POST"]
    assert posted[-1]["path"] == "/apis/apps/v1/namespaces/default/deployments"
    assert posted[-1]["body"] == rendered.uploader
    assert list(api.deployments) == ["llama3-70b-uploader"]
    assert cli(["delete", "llama3-70b"]) == 0
    assert api.deployments == {} and api.config_maps == {}


def test_resubmit_after_delete_never_collides(
    api: FakeApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = GPT + [f"output_dir={tmp_path}"] + BASE + NO_FIT
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
    assert cli(GPT + [f"output_dir={tmp_path}"] + BASE + NO_FIT) == 0  # the job runs regardless
    assert "HTTP 403" in caplog.text and "python -m launch k8s delete gpt-125m" in caplog.text
    assert "ownerReferences" not in api.config_maps["gpt-125m-config-test"]["metadata"]
    assert cli(["delete", "gpt-125m"]) == 0
    assert api.requests[-1]["query"]["labelSelector"] == ["mcore-recipes/job-name=gpt-125m"]
    assert api.config_maps == {} and api.jobs == {}


def test_rejected_job_rolls_back_its_config_map(
    api: FakeApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    api.fail_job_create = True
    assert cli(GPT + [f"output_dir={tmp_path}"] + BASE + NO_FIT) == exit_codes.INFRASTRUCTURE
    assert [(r["method"], r["path"]) for r in api.requests][-1] == (
        "DELETE",
        "/api/v1/namespaces/default/configmaps/gpt-125m-config-test",
    )
    assert "HTTP 422" in caplog.text and "admission webhook denied" in caplog.text
    assert api.config_maps == {}


def test_status_logs_delete(
    api: FakeApiServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli(RECIPES["llama3_70b"] + [f"output_dir={tmp_path}"] + BASE + NO_FIT) == 0
    capsys.readouterr()
    assert cli(["status", "llama3-70b"]) == 0
    out = capsys.readouterr().out
    assert "default/llama3-70b" in out and "Running" in out and "Worker: active=7" in out
    assert cli(["logs", "llama3-70b", "--replica", "worker", "--index", "3", "--tail", "5"]) == 0
    assert capsys.readouterr().out == "step 1 loss 10.9\nstep 2 loss 10.7\n"
    assert cli(["delete", "llama3-70b", "--namespace", "default"]) == 0
    calls = [(r["method"], r["path"]) for r in api.requests[3:]]
    job_path = "/apis/kubeflow.org/v1/namespaces/default/pytorchjobs/llama3-70b"
    assert calls == [
        ("GET", job_path),  # status
        ("GET", job_path),  # logs: which kind of job
        ("GET", "/api/v1/namespaces/default/pods"),
        ("GET", "/api/v1/namespaces/default/pods/job-master-0/log"),
        ("GET", job_path),  # delete: which kind of job
        ("DELETE", job_path),
        ("DELETE", "/api/v1/namespaces/default/configmaps"),
        ("DELETE", "/apis/apps/v1/namespaces/default/deployments"),
    ]
    pods, log_req = api.requests[5], api.requests[6]
    assert pods["query"]["labelSelector"] == [
        "training.kubeflow.org/job-name=llama3-70b,training.kubeflow.org/replica-type=worker,"
        "training.kubeflow.org/replica-index=3"
    ]
    assert log_req["query"]["container"] == ["pytorch"] and log_req["query"]["tailLines"] == ["5"]
    assert all(r["auth"] == f"Bearer {TOKEN}" for r in api.requests)
    assert api.config_maps == {}
    assert cli(["status", "nope"]) == exit_codes.INFRASTRUCTURE


@pytest.mark.parametrize("scope", ["namespace", "cluster"])
def test_a_trainjob_is_submitted_followed_and_deleted_with_its_runtime(
    scope: str,
    api: FakeApiServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    argv = [
        *RECIPES["llama3_70b"],
        f"output_dir={tmp_path}",
        *BASE,
        "launch.k8s.api=trainjob",
        f"launch.k8s.runtime_scope={scope}",
    ]
    _, rendered = k8s.render_run(argv)
    argv += NO_FIT
    assert cli(argv) == 0
    trainer = "/apis/trainer.kubeflow.org/v1alpha1"
    cm_path = "/api/v1/namespaces/default/configmaps"
    runtimes = {"namespace": "namespaces/default/trainingruntimes",
                "cluster": "clustertrainingruntimes"}[scope]  # fmt: skip
    assert [(r["method"], r["path"]) for r in api.requests] == [
        ("POST", cm_path),
        ("POST", f"{trainer}/{runtimes}"),  # before the TrainJob that names it
        ("POST", f"{trainer}/namespaces/default/trainjobs"),
        ("PATCH", f"{cm_path}/llama3-70b-config-test"),
        # a namespaced runtime is owned by its TrainJob too; a cluster-scoped one cannot be
        *(
            [("PATCH", f"{trainer}/{runtimes}/llama3-70b-config-test")]
            if scope == "namespace"
            else []
        ),
    ]
    assert api.requests[1]["body"] == rendered.runtime
    assert api.requests[2]["body"] == rendered.job
    # Unknown fields refused, not dropped (an older JobSet's runtime would lose the patterns)
    assert all(api.requests[i]["query"]["fieldValidation"] == ["Strict"] for i in (1, 2))
    owner = {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
             "name": "llama3-70b", "uid": "u-1"}  # fmt: skip
    assert api.config_maps["llama3-70b-config-test"]["metadata"]["ownerReferences"] == [owner]
    if scope == "namespace":
        owned = api.ns_runtimes["default/llama3-70b-config-test"]["metadata"]["ownerReferences"]
        assert owned == [owner]
    capsys.readouterr()
    assert cli(["status", "llama3-70b"]) == 0
    out = capsys.readouterr().out
    assert "default/llama3-70b" in out and "node: active=2, ready=2" in out, out
    assert cli(["logs", "llama3-70b", "--index", "1"]) == 0
    assert api.pod_selectors[-1] == (
        "jobset.sigs.k8s.io/jobset-name=llama3-70b,batch.kubernetes.io/job-completion-index=1"
    )
    assert api.requests[-1]["query"]["container"] == ["node"]
    # Where PyTorchJobs are forbidden (a Trainer-only cluster), a TrainJob is still found.
    api.forbid_pytorchjobs = True
    assert cli(["status", "llama3-70b"]) == 0
    api.forbid_pytorchjobs = False
    # Resubmitted while the first runtime lingers: a runtime of its own; delete takes both,
    # and no other namespace's job of the same name.
    api.jobs.clear()
    labels = {"mcore-recipes/job-name": "llama3-70b", "mcore-recipes/namespace": "other"}
    kept = {"namespace": api.ns_runtimes, "cluster": api.runtimes}[scope]
    sep = {"namespace": "/", "cluster": "-"}[scope]
    kept[f"other{sep}llama3-70b-config-x"] = {"metadata": {"labels": labels}}
    monkeypatch.setenv(k8s.SUBMISSION_ENV, "second")
    assert cli(argv) == 0
    assert sorted(kept) == [
        f"default{sep}llama3-70b-config-second",
        f"default{sep}llama3-70b-config-test",
        f"other{sep}llama3-70b-config-x",
    ]
    assert cli(["delete", "llama3-70b"]) == 0
    assert api.jobs == {} and list(kept) == [f"other{sep}llama3-70b-config-x"]
    assert api.config_maps == {}


def test_a_refused_trainjob_rolls_back_its_runtime_and_config_map(
    api: FakeApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    api.fail_job_create = True
    argv = [*GPT, f"output_dir={tmp_path}", *BASE, "launch.k8s.api=trainjob", *NO_FIT]
    assert cli(argv) == exit_codes.INFRASTRUCTURE
    assert "HTTP 422" in caplog.text
    assert api.runtimes == {} and api.ns_runtimes == {} and api.config_maps == {}
    assert [r["method"] for r in api.requests if "trainingruntimes" in r["path"]] == [
        "POST",
        "DELETE",
    ]  # created, then rolled back


def test_a_trainjob_on_the_clusters_runtime_is_checked_against_it_before_anything_is_created(
    api: FakeApiServer, tmp_path: Path
) -> None:
    """The stock torch-distributed runtime (Trainer's Helm chart, copied from
    ../shared/k8s/trainer-v2 with its upstream commit), as a cluster holds it:
    missing, or with pods that tolerate every taint, the submission is refused before any
    object exists; with the taints named (they replace the runtime's) or avoid_tainted=false
    it goes ahead."""
    helm = (REPO / "tests/golden/trainer-v2/torch-distributed.yaml").read_text()  # a copy
    stock = yaml.safe_load("\n".join(line for line in helm.splitlines() if "{{" not in line))
    name = stock["metadata"]["name"]
    argv = [*GPT, f"output_dir={tmp_path}", *BASE, "launch.k8s.api=trainjob",
            f"launch.k8s.runtime={name}", *NO_FIT]  # fmt: skip
    with pytest.raises(
        ConfigError,
        match="no ClusterTrainingRuntime of that name",
    ):
        cli(argv)
    api.runtimes[name] = copy.deepcopy(stock)
    [node] = api.runtimes[name]["spec"]["template"]["spec"]["replicatedJobs"]
    node["template"]["spec"]["template"]["spec"]["tolerations"] = [{"operator": "Exists"}]
    with pytest.raises(ConfigError, match="node pods tolerate every taint"):
        cli(argv)
    assert [r["method"] for r in api.requests] == ["GET", "GET"] and api.config_maps == {}
    gpu = "launch.k8s.tolerations=[{key: nvidia.com/gpu, operator: Exists}]"
    assert cli([*argv, gpu]) == 0
    [job] = api.jobs.values()
    [patch] = job["spec"]["runtimePatches"]
    [patched] = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert patched["template"]["spec"]["template"]["spec"]["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists"}
    ]
    assert cli(["delete", "gpt-125m"]) == 0
    assert cli([*argv, "launch.k8s.avoid_tainted=false"]) == 0
    assert list(api.runtimes) == [name]  # the cluster's: never created or deleted by us
    assert not [r for r in api.requests if r["method"] in ("POST", "DELETE", "PATCH")
                and "trainingruntimes" in r["path"]]  # fmt: skip


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
