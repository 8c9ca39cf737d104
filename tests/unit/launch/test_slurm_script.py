"""The batch script's container image and NCCL environment, rendered in-process: pyxis's image
syntax from an OCI reference, and the NCCL defaults a multi-node GPU job gets."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from launch.slurm.script import NCCL_DEFAULTS, ScriptInputs, pyxis_image, render_sbatch
from recipes import RunConfig, load_config

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
