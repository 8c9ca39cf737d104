"""The batch script's container image, NCCL environment and GPU preflight, rendered
in-process: pyxis's image syntax from an OCI reference, the NCCL defaults a multi-node GPU
job gets, the environment a job runs with (launch.slurm.python, or a warning), and the
preflight that stops a GPU job whose environment cannot run it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from launch.__main__ import main as launch_main
from launch.slurm.preflight import problems
from launch.slurm.script import (
    NCCL_DEFAULTS,
    ScriptInputs,
    environment_warning,
    pyxis_image,
    render_sbatch,
)
from pretrain.context import exit_codes
from recipes import ConfigError, RunConfig, load_config

RUN_DIR = Path("/shared/runs/r")
INPUTS = ScriptInputs(
    config_path=RUN_DIR / "launch-config.yaml",
    run_dir=RUN_DIR,
    workdir=Path("/shared/work"),
    bin_dir=Path("/shared/venv/bin"),
    code_commit="0123abc",
    image_digest=None,
)
DIGEST = "sha256:" + "ab" * 32
GPU_NODES = ["launch.gpus_per_node=8", "launch.nproc_per_node=8"]


def _script(*overrides: str) -> str:
    run: RunConfig = load_config(["recipe=gpt_tiny", "run_id=r", *overrides])
    return render_sbatch(run, INPUTS)


@pytest.mark.parametrize(
    "given, pyxis",
    [
        # an OCI reference names its registry before the first "/": pyxis wants "#" there
        ("nvcr.io/nvidia/pytorch:25.01-py3", "nvcr.io#nvidia/pytorch:25.01-py3"),
        (f"nvcr.io/nvidia/pytorch@{DIGEST}", f"nvcr.io#nvidia/pytorch@{DIGEST}"),  # kept
        ("docker://ghcr.io/org/img:1", "ghcr.io#org/img:1"),
        ("registry.example:5000/team/img:v2", "registry.example:5000#team/img:v2"),
        ("localhost/img", "localhost#img"),
        ("alice@nvcr.io/nvidia/pytorch:25.01-py3", "alice@nvcr.io#nvidia/pytorch:25.01-py3"),
        # left alone: already pyxis, Docker Hub names, files, other enroot schemes
        ("nvcr.io#nvidia/pytorch:25.01-py3", "nvcr.io#nvidia/pytorch:25.01-py3"),
        ("ubuntu:24.04", "ubuntu:24.04"),
        ("nvidia/cuda:12.4.1-base-ubuntu22.04", "nvidia/cuda:12.4.1-base-ubuntu22.04"),
        ("/images/pytorch.sqsh", "/images/pytorch.sqsh"),
        ("./pytorch.sqsh", "./pytorch.sqsh"),
        ("dockerd://mcore-recipes:dev", "dockerd://mcore-recipes:dev"),
    ],
)
def test_an_image_reference_becomes_pyxis_syntax(given: str, pyxis: str) -> None:
    assert pyxis_image(given) == pyxis


def test_the_script_gives_pyxis_its_syntax_and_records_the_reference_as_given() -> None:
    image = f"nvcr.io/nvidia/pytorch@{DIGEST}"
    script = _script(f"launch.slurm.container_image={image}")
    assert f"--container-image='nvcr.io#nvidia/pytorch@{DIGEST}'" in script
    assert f"--container-image={image}" not in script
    assert f"export MCORE_RECIPES_IMAGE_DIGEST={image}\n" in script  # the manifests' record


def test_a_multi_node_gpu_job_gets_the_nccl_defaults_unless_set() -> None:
    script = _script("launch.nodes=2", *GPU_NODES, "+launch.slurm.env={NCCL_DEBUG: INFO}")
    for name, value in NCCL_DEFAULTS.items():
        line = f"export {name}=${{{name}:-{value}}}"
        assert (line in script) == (name != "NCCL_DEBUG"), name
    assert "export NCCL_DEBUG=INFO\n" in script  # launch.slurm.env's, verbatim
    assert "export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}\n" in script
    assert 'echo "NCCL environment: ' in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_the_submitting_environment_wins_over_a_default(tmp_path: Path) -> None:
    """The rendered lines, run by bash: a variable the submitting shell set (--export=ALL)
    is kept, an empty or unset one gets the default."""
    script = _script("launch.nodes=2", *GPU_NODES)
    lines = [ln for ln in script.splitlines() if ln.startswith("export ") and ":-" in ln]
    probe = "\n".join([*lines, 'echo "$NCCL_IB_TIMEOUT $NCCL_DEBUG $NCCL_NVLS_ENABLE"'])
    env = {"PATH": "/usr/bin:/bin", "NCCL_IB_TIMEOUT": "23", "NCCL_DEBUG": ""}
    out = subprocess.run(["bash", "-c", probe], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["23", "WARN", "0"], out.stderr


@pytest.mark.parametrize(
    "overrides",
    [
        ["launch.nodes=1", *GPU_NODES],  # one node: no fabric between its GPUs to tune
        ["launch.nodes=2", "launch.nproc_per_node=1"],  # CPU nodes
    ],
    ids=["one-gpu-node", "cpu-nodes"],
)
def test_no_nccl_defaults_without_a_fabric_of_gpus(overrides: list[str]) -> None:
    script = _script(*overrides)
    assert "no NCCL defaults" in script
    assert not any(f"export {name}=" in script for name in NCCL_DEFAULTS)


# ------------------------------------------------------------------ environment and preflight

CLUSTER_PYTHON = "/cluster/envs/train/bin/python3.12"


def _flat(script: str) -> str:
    return " ".join(script.replace("\\\n", " ").split())


def _section(script: str, name: str, following: str) -> str:
    """The lines under the script's ``# ---- name`` header, up to the next section's."""
    start = script.index(f"-- {name}\n") + len(f"-- {name}\n")
    return script[start : script.rindex("\n", start, script.index(f"-- {following}\n"))]


def test_a_gpu_job_checks_its_environment_on_every_node_before_anything_else() -> None:
    script = _script(*GPU_NODES)
    flat = _flat(script)
    preflight = (
        'srun --nodes="$SLURM_NNODES" --ntasks="$SLURM_NNODES" --ntasks-per-node=1 '
        '--cpus-per-task="$SLURM_CPUS_ON_NODE" --kill-on-bad-exit=0 --export=ALL --label '
        "/shared/venv/bin/python -m launch.slurm.preflight --gpus 8 && PREFLIGHT_RC=0"
    )
    assert preflight in flat, flat
    # before the node health check, the retry policy's first call and the training step
    first = flat.index("-m launch.slurm.preflight")
    for later in ('health "$HEALTH_DIR"', "AFTER_ATTEMPT=$(policy", "-m pretrain --config"):
        assert first < flat.index(later), later
    section = _section(script, "preflight", "node health")
    assert 'if [ "$PREFLIGHT_RC" != 0 ]; then' in section and "\n        exit 2\n" in section
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_transformer_engine_is_checked_where_the_recipe_needs_it() -> None:
    assert "--need-te" not in _script(*GPU_NODES)  # gpt_tiny: megatron-core's local spec
    assert "--gpus 8 --need-te=parallel.cp=2 " in _flat(_script(*GPU_NODES, "parallel.cp=2"))
    fp8 = _flat(_script(*GPU_NODES, "perf.fp8=e4m3"))
    assert "--need-te=perf.fp8=e4m3 " in fp8
    llama = load_config(["recipe=llama3_8b", "run_id=r"])  # CP=2: only TE implements it
    assert "--gpus 8 --need-te=parallel.cp=2 " in _flat(render_sbatch(llama, INPUTS))


def test_a_cpu_job_has_no_preflight() -> None:
    script = _script("launch.nodes=2", "launch.nproc_per_node=1")
    assert "launch.slurm.preflight" not in script and "PREFLIGHT_RC" not in script
    assert "# (a CPU job: no preflight)" in script


def test_in_a_container_the_preflight_runs_in_it() -> None:
    image = f"nvcr.io/nvidia/pytorch@{DIGEST}"
    flat = _flat(_script(*GPU_NODES, f"launch.slurm.container_image={image}"))
    assert "--no-container-mount-home python -m launch.slurm.preflight --gpus 8 " in flat
    assert "/shared/venv/bin" not in flat


@pytest.mark.parametrize("backend", ["torchrun", "ft_launcher"])
def test_launch_slurm_python_is_the_environment_the_job_runs_with(backend: str) -> None:
    script = _script(
        *GPU_NODES, f"launch.slurm.python={CLUSTER_PYTHON}", f"launch.backend={backend}"
    )
    flat = _flat(script)
    which = " --ft-launcher" if backend == "ft_launcher" else ""
    assert f"' launcher {CLUSTER_PYTHON} -m launch.torchrun{which} " in flat, flat
    for module in ("launch.slurm.preflight", "resiliency.monitor.health", "launch.retry_policy"):
        assert f"{CLUSTER_PYTHON} -m {module}" in flat, module
    assert "/shared/venv/bin" not in script  # nothing of the submitting environment
    cpu = _script(
        "launch.nodes=2", "launch.nproc_per_node=1", f"launch.slurm.python={CLUSTER_PYTHON}"
    )
    assert f"launcher {CLUSTER_PYTHON} -m launch.torchrun " in _flat(cpu)  # CPU jobs too


@pytest.mark.parametrize(
    "value, message",
    [
        ("envs/train/bin/python", "must be the absolute path of a python executable"),
        ("/cluster/envs/train/bin/", "must be the absolute path of a python executable"),
    ],
)
def test_launch_slurm_python_must_be_an_absolute_path(value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(["recipe=gpt_tiny", f"launch.slurm.python={value}"])


def test_launch_slurm_python_and_an_image_exclude_each_other() -> None:
    with pytest.raises(ConfigError, match="exclude each other"):
        load_config(
            ["recipe=gpt_tiny", f"launch.slurm.python={CLUSTER_PYTHON}",
             "launch.slurm.container_image=nvcr.io/nvidia/pytorch:25.01-py3"]
        )  # fmt: skip


def test_a_gpu_job_on_the_submitting_environment_is_warned_with_both_fixes() -> None:
    def warning(*overrides: str) -> str | None:
        run = load_config(["recipe=llama3_8b", "run_id=r", *overrides])
        return environment_warning(run, Path("/home/me/mcore-recipes/.venv/bin"))

    text = warning()
    assert text is not None
    assert "runs the submitting environment (/home/me/mcore-recipes/.venv/bin)" in text
    assert "a CUDA build of torch there and Transformer Engine (for parallel.cp=2)" in text
    assert "launch.slurm.container_image=NAME@sha256:DIGEST" in text
    assert "launch.slurm.python=" in text
    assert warning(f"launch.slurm.python={CLUSTER_PYTHON}") is None
    assert warning(f"launch.slurm.container_image=nvcr.io/nvidia/pytorch@{DIGEST}") is None
    cpu = ["launch.gpus_per_node=0", "launch.nodes=1", "launch.nproc_per_node=4"]
    assert warning(*cpu) is None


def test_the_dry_run_says_the_warning_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["slurm", "--dry-run", "--skip-fit-check", "--out", str(tmp_path / "dry"),
            "recipe=gpt_tiny", "data=mock", f"output_dir={tmp_path}", "run_id=g"]  # fmt: skip
    assert launch_main([*argv, "launch.nproc_per_node=2", "launch.gpus_per_node=2"]) == 0
    err = capsys.readouterr().err
    [line] = [ln for ln in err.splitlines() if "launch.slurm.python" in ln]
    assert "WARNING" in line and "runs the submitting environment" in line
    assert launch_main([*argv, "run_id=c", "launch.nproc_per_node=2"]) == 0  # a CPU job
    assert "launch.slurm.python" not in capsys.readouterr().err


@pytest.mark.parametrize("srun_rc, exits", [(2, 2), (1, 2), (127, 2), (0, None)])
def test_a_failed_preflight_ends_the_job_with_exit_2_before_it_trains(
    srun_rc: int, exits: int | None
) -> None:
    """The rendered section, run by bash with srun standing in: any failure (a problem found,
    a python or package missing) ends the script with CONFIG_ERROR, which the retry policy and
    Slurm never requeue; a pass goes on."""
    section = _section(_script(*GPU_NODES), "preflight", "node health")
    stub = f"SIGNALED_BY= SLURM_NNODES=2 SLURM_CPUS_ON_NODE=8\nsrun() {{ return {srun_rc}; }}\n"
    driver = f"{stub}{section}\necho reached the health check\n"
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", driver], capture_output=True, text=True)
    if exits is None:
        assert out.returncode == 0 and "reached the health check" in out.stdout, out
    else:
        assert out.returncode == exits == exit_codes.CONFIG_ERROR, out
        assert f"preflight FAILED (exit {srun_rc})" in out.stdout
        assert "reached the health check" not in out.stdout


@pytest.mark.parametrize(
    "facts, expected",
    [
        # a CUDA build that sees the node's GPUs, TE where needed: nothing to say
        (dict(cuda_version="12.8", device_count=8, need_te="parallel.cp=2"), []),
        (dict(cuda_version="12.8", device_count=8, need_te=None, te_error="No module"), []),
        # a CPU build: one line, not a second about the GPUs it cannot see
        (dict(torch_version="2.8.0+cpu", need_te=None),
         ["torch 2.8.0+cpu is not a CUDA build (torch.version.cuda is None): the job needs a "
          "CUDA build of torch"]),
        (dict(torch_error="ModuleNotFoundError: No module named 'torch'", need_te=None),
         ["torch does not import (ModuleNotFoundError: No module named 'torch'): the job needs "
          "a CUDA build of torch"]),
        (dict(cuda_version="12.8", device_count=4, need_te=None),
         ["torch (CUDA 12.8) sees 4 GPU(s), the job needs 8 (launch.gpus_per_node)"]),
        (dict(cuda_version="12.8", device_count=8, need_te="parallel.cp=2",
              te_error="ImportError: libcudnn.so.9"),
         ["Transformer Engine does not import (ImportError: libcudnn.so.9): parallel.cp=2 "
          "needs it"]),
        (dict(torch_version="2.8.0+cpu", need_te="perf.fp8=e4m3", te_error="No module"),
         ["torch 2.8.0+cpu is not a CUDA build (torch.version.cuda is None): the job needs a "
          "CUDA build of torch",
          "Transformer Engine does not import (No module): perf.fp8=e4m3 needs it"]),
    ],
)  # fmt: skip
def test_the_preflight_decides_from_the_facts(facts: dict, expected: list[str]) -> None:
    assert problems(gpus=8, **facts) == expected
