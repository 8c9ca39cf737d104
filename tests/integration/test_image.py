"""The training image: the Dockerfile is checked here (no Docker daemon in CI), and its one
install step, docker/install.sh, is run for real into a fresh venv: the package installed (not
editable), its CLIs working away from the checkout, the build's commit recorded."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _instructions() -> list[tuple[str, str]]:
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1]) for ln in lines]


def test_the_dockerfile_installs_every_package_on_a_pinned_base() -> None:
    steps = _instructions()
    base = dict(
        re.findall(r"ARG (\w+)=(\S+)", " ".join(f"ARG {a}" for k, a in steps if k == "ARG"))
    )
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d{2}\.\d{2}-py3", base["BASE"]), base
    assert ("FROM", "${BASE}") in steps
    copied = {a.split()[0] for k, a in steps if k == "COPY"}
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages | {"pyproject.toml", "docker/install.sh"} <= copied, copied
    assert ("RUN", 'bash docker/install.sh "${CODE_COMMIT}"') in steps
    # the last WORKDIR is not the package's source tree, which would shadow the install
    assert [a for k, a in steps if k == "WORKDIR"][-1] != "/opt/mcore-recipes"


@pytest.mark.slow
def test_the_install_step_works_in_a_fresh_venv(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    # What the base image provides (torch and the rest): this environment's packages, seen
    # through a path entry, so pip finds them installed and fetches nothing.
    site = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    Path(site, "base-image.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {**os.environ, "PYTHON": str(python)}
    env.pop("PYTHONPATH", None)
    commit = "0123456789abcdef0123456789abcdef01234567"
    out = subprocess.run(["bash", str(REPO / "docker" / "install.sh"), commit], env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    probe = subprocess.run(
        [str(python), "-c", "import recipes, resiliency.storage.manifest as m; "
         "print(recipes.__file__); print(m.code_commit())"],
        cwd="/", env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr[-3000:]
    where, recorded = probe.stdout.split()
    assert Path(where).is_relative_to(venv), where  # installed, not this checkout
    assert recorded == commit
    configs = subprocess.run([str(python), "-m", "pretrain", "--help"], cwd="/", env=env,
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert configs.returncode == 0 and "llama3_70b" in configs.stdout, configs.stderr[-2000:]
