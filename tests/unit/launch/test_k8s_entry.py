"""The PyTorchJob CRD shipped in the package (used from an installed wheel), and the in-pod
wrapper: exit codes for the operator, the retry budget, the node health check."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from launch.k8s import cli as k8s
from launch.k8s.entry import Outcome, RetryBudget, classify
from launch.k8s.schema import (
    CRD_ENV,
    CRD_FILE,
    crd_path,
    operator_errors,
    schema_errors,
)
from pretrain.context import exit_codes
from recipes import ConfigError
from tests.helpers import REPO
from tests.k8s_helpers import (
    BASE,
    RECIPES,
    SHARED_CRD,
    stable_env,  # noqa: F401 - autouse fixture
)

pytest.importorskip("jsonschema", reason="the k8s extra validates manifests with jsonschema")


# --- the CRD ships with the package -----------------------------------------------------------


def test_crd_is_the_shipped_copy_unless_overridden(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(CRD_ENV, raising=False)
    assert crd_path() == REPO / "launch" / "k8s" / "schemas" / CRD_FILE
    monkeypatch.setenv(CRD_ENV, str(tmp_path / "crd.yaml"))
    with pytest.raises(ConfigError, match=r"not found at .*crd.yaml \(\$MCORE_RECIPES_PYTORCHJOB"):
        crd_path()


@pytest.mark.skipif(not SHARED_CRD.is_file(), reason=f"{SHARED_CRD} not present")
def test_shipped_crd_is_the_shared_copy() -> None:
    shipped = REPO / "launch" / "k8s" / "schemas" / CRD_FILE
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
    probe = "import launch, recipes, launch.k8s.schema as s; print(launch.__file__, s.crd_path())"
    proc = subprocess.run([sys.executable, "-c", probe], **run)
    assert proc.returncode == 0, proc.stderr
    shipped = site / "launch" / "k8s" / "schemas" / CRD_FILE
    assert proc.stdout.split() == [str(site / "launch" / "__init__.py"), str(shipped)]
    argv = [*RECIPES["llama3_70b"], *BASE, f"output_dir={tmp_path / 'runs'}", "--dry-run"]
    proc = subprocess.run([sys.executable, "-m", "launch", "k8s", *argv], **run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config_map, job = yaml.safe_load_all(proc.stdout)
    assert job["kind"] == "PyTorchJob" and config_map["kind"] == "ConfigMap"
    assert schema_errors(job, shipped) == [] and operator_errors(job) == []
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 7
    # Kubeflow Trainer v2: every GPU recipe, against the CRDs the wheel ships (the TrainJob,
    # the TrainingRuntime or ClusterTrainingRuntime, and the JobSet its template embeds)
    for recipe, runtime in (
        ("gpt_125m", "ClusterTrainingRuntime"),
        ("llama3_70b", "TrainingRuntime"),
        ("mixtral_8x7b", "TrainingRuntime"),
    ):
        scope = "cluster" if runtime.startswith("Cluster") else "namespace"
        argv = [*RECIPES[recipe], *BASE, f"output_dir={tmp_path / 'runs'}", "--dry-run"]
        argv += ["launch.k8s.api=trainjob", f"launch.k8s.runtime_scope={scope}"]
        argv += ["--skip-fit-check"]  # the wheel's planner ran once, above
        proc = subprocess.run([sys.executable, "-m", "launch", "k8s", *argv], **run)
        assert proc.returncode == 0, proc.stderr[-3000:]
        kinds = [obj["kind"] for obj in yaml.safe_load_all(proc.stdout)]
        assert kinds[:3] == ["ConfigMap", runtime, "TrainJob"], kinds
    schemas = {p.name for p in (site / "launch" / "k8s" / "schemas").glob("*.yaml")}
    assert {
        "trainer.kubeflow.org_trainjobs.yaml",
        "trainer.kubeflow.org_clustertrainingruntimes.yaml",
        "trainer.kubeflow.org_trainingruntimes.yaml",
        "jobset.x-k8s.io_jobsets.yaml",
    } <= schemas


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
        # The user's stop (a worker's 130, or the agent's SIGINT) fails the job, not retried.
        (Outcome(130, False), (13, False)),
        (Outcome(-2, True), (13, False)),
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


def _pod_entry(
    tmp_path: Path,
    retries: int,
    env: dict[str, str],
    launcher_args: list[str],
    entry_args: tuple[str, ...] = (),
) -> subprocess.CompletedProcess:
    """The pod's entry point, as the manifest runs it, with state under ``tmp_path``."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.k8s.entry",
            "--retries",
            str(retries),
            "--state-dir",
            str(tmp_path / "state"),
            *entry_args,
            "--",
            *launcher_args,
        ],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_pod_entry_starts_the_standby_its_workers_are_forked_from(tmp_path: Path) -> None:
    """launch.standby in a pod: the entry starts the standby before torchrun; both ranks are
    forked by it (its reaping record), and their exit code (a config error) is the pod's."""
    run_dir = tmp_path / "run"
    env = {"MCORE_RECIPES_JOB_ID": "job-test"}
    workers = ["--standalone", "--nproc-per-node", "2", "-m", "launch.standby.worker"]
    proc = _pod_entry(
        tmp_path, 1, env, [*workers, "recipe=no_such_recipe"], ("--standby", str(run_dir))
    )
    assert proc.returncode == exit_codes.CONFIG_ERROR, proc.stderr[-3000:]
    assert "standby: ready" in proc.stderr and "starting plainly" not in proc.stderr
    reaped = (run_dir / "attempts" / "standby").glob("*.jsonl")
    codes = [json.loads(line)["exit_code"] for p in reaped for line in p.read_text().splitlines()]
    assert codes == [exit_codes.CONFIG_ERROR] * 2


def test_wrapper_recovers_the_worker_exit_code_torchrun_drops(tmp_path: Path) -> None:
    script = tmp_path / "exit.py"
    script.write_text("import sys\nsys.exit(75)\n")
    env = {"MCORE_RECIPES_JOB_ID": "job-test", "OMP_NUM_THREADS": "1"}
    proc = _pod_entry(tmp_path, 1, env, ["--standalone", "--nproc-per-node", "2", str(script)])
    assert proc.returncode == 128 + exit_codes.REQUEUE, proc.stderr[-3000:]
    state = json.loads((tmp_path / "state" / "job-test" / "node-0.json").read_text())
    assert state == {"retries": 0, "running": False}


def test_ft_launcher_entry_gets_its_config(tmp_path: Path) -> None:
    """ft_launcher refuses to start without --ft-cfg-path: the pod entry writes it."""
    from launch.k8s.entry import with_ft_config
    from recipes import load_config, to_yaml

    pinned = tmp_path / "launch-config.yaml"
    pinned.write_text(to_yaml(load_config(["recipe=gpt_tiny", "launch.backend=ft_launcher"])))
    args = with_ft_config(["--nnodes=2", "-m", "pretrain", "--config", str(pinned)], tmp_path)
    flag, path = args[0].split("=", 1)
    assert flag == "--ft-cfg-path" and Path(path).is_file()
    assert "rank_section_timeouts" in Path(path).read_text() or "section" in Path(path).read_text()
    assert args[1] == "--workers-stop-timeout=10"  # resiliency.ft.workers_stop_timeout_s
    assert args[2:] == ["--nnodes=2", "-m", "pretrain", "--config", str(pinned)]


def test_pod_on_an_unhealthy_node_exits_before_torchrun(tmp_path: Path) -> None:
    """The node health check runs in the pod before the launcher: a failing one exits as an
    infrastructure failure (the operator retries it), counted in the budget, no rank started."""
    from recipes import load_config, to_yaml

    pinned = tmp_path / "launch-config.yaml"
    run = load_config(
        ["recipe=gpt_tiny", f"output_dir={tmp_path}", "resiliency.health.script=/bin/false"]
    )
    pinned.write_text(to_yaml(run))
    env = {"MCORE_RECIPES_JOB_ID": "job-sick", "MCORE_RECIPES_NODE": "pod-0"}
    proc = _pod_entry(tmp_path, 2, env, ["--standalone", "-m", "pretrain", "--config", str(pinned)])
    # 129: the operator (ExitCode) and the JobSet's policy retry 128-255; 1 would be permanent
    assert proc.returncode == 129, proc.stderr[-3000:]
    assert "UNHEALTHY: script: '/bin/false' exit 1" in proc.stderr
    assert "torchrun" not in proc.stderr.lower().replace("launch.k8s.entry", "")
    health = tmp_path / "state" / "job-sick" / "health"
    [report] = [json.loads(p.read_text()) for p in health.glob("*.json")]
    assert report["ok"] is False
    state = json.loads((tmp_path / "state" / "job-sick" / "node-0.json").read_text())
    assert state == {"retries": 1, "running": False}
    # The site's check script speaks for the node's hardware: a Node-style condition for the
    # cluster's operators (the pod edits no Node object)
    written = tmp_path / "state" / "job-sick" / "node-conditions" / "pod-0.json"
    condition = json.loads(written.read_text())
    assert condition["node"] == "pod-0"
    assert {k: condition["condition"][k] for k in ("type", "status", "reason")} == {
        "type": "McoreRecipesHardwareFault",
        "status": "True",
        "reason": "HealthCheckFailed",
    }
    assert "script: '/bin/false' exit 1" in condition["condition"]["message"]
