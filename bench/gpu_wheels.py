"""``make gpu-wheels``: the wheels an air-gapped GPU node needs to run this checkout.

Where PyPI is reachable: downloads the cp312 manylinux wheels of every runtime dependency
(pyproject.toml, Python 3.12 markers) and of their dependencies in turn that the node does not
have (``bench/gpu_node_packages.txt``: the node's own packages, torch among them), builds the
sdist-only ones into wheels, retags wheels whose manylinux tag is newer than a node's pip may
accept, and checks that they and this checkout's tracked files fit in 60 MiB (what one command
may carry to the node). Idempotent: a wheel already in the folder is kept.

    python -m bench.gpu_wheels [--dest .whl]
    # then, on the node:  python3 -m bench.gpu_check --wheels .whl
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
NODE_PACKAGES = Path(__file__).with_name("gpu_node_packages.txt")
LIMIT_MIB = 60  # of the 64 MiB a device command carries: room for the command's own files
PYTHON = "3.12"
# Newest first; pip matches a platform tag exactly, so each manylinux level is named.
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (39, 35, 34, 31, 28, 27, 24, 17)]
PLATFORMS += ["manylinux2014_x86_64", "manylinux1_x86_64"]
MARKERS = {"python_version": PYTHON, "sys_platform": "linux", "platform_machine": "x86_64"}


def canonical(name: str) -> str:
    return canonicalize_name(name)


def node_packages() -> set[str]:
    lines = NODE_PACKAGES.read_text().splitlines()
    return {canonical(line) for line in lines if line.strip() and not line.startswith("#")}


def runtime_requirements() -> list[str]:
    """pyproject's dependencies that apply on the node's Python."""
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return [spec for req in deps if (spec := applies(req)) is not None]


def applies(requirement: str) -> str | None:
    """The requirement without its marker if the marker holds on the node (no extras), else
    None (packaging evaluates the marker, as pip does)."""
    spec, _, marker = requirement.partition(";")
    if marker.strip() and not Marker(marker).evaluate({**MARKERS, "extra": ""}):
        return None
    return spec.strip()


def requirement_name(spec: str) -> str:
    return canonicalize_name(Requirement(spec).name)


def wheel_requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        text = archive.read(meta).decode()
    reqs = [
        line[len("Requires-Dist:") :].strip()
        for line in text.splitlines()
        if line.startswith("Requires-Dist:")
    ]
    return [
        spec for req in reqs if (spec := applies(req.replace("(", "").replace(")", ""))) is not None
    ]


def wheel_name(wheel: Path) -> str:
    return canonical(wheel.name.split("-")[0])


def download(spec: str, dest: Path) -> Path:
    """One distribution's wheel for the node; an sdist-only one is built into a wheel here."""
    before = set(dest.glob("*.whl"))
    pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(dest)]
    tags = ["--only-binary=:all:", "--python-version", PYTHON, "--implementation", "cp"]
    tags += [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    if subprocess.run([*pip, *tags, spec], capture_output=True).returncode != 0:
        with tempfile.TemporaryDirectory() as build:  # sdist only (antlr4-python3-runtime)
            subprocess.run([*pip, "--no-binary=:all:", "-d", build, spec], check=True)
            sdist = next(Path(build).iterdir())
            wheel = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest)]
            subprocess.run([*wheel, str(sdist)], check=True)
    new = set(dest.glob("*.whl")) - before
    if not new:
        raise SystemExit(f"gpu-wheels: no wheel for {spec}")
    return retag(new.pop())


def retag(wheel: Path) -> Path:
    """manylinux_2_39 wheels (nvrx 0.7) are refused by a pip on an older glibc although their
    one extension is GPU-only: carried as linux_x86_64, which every x86-64 pip accepts (the
    Makefile's install does the same)."""
    renamed = re.sub(r"manylinux_2_(3[5-9])_x86_64", "linux_x86_64", wheel.name)
    if renamed == wheel.name:
        return wheel
    return wheel.rename(wheel.with_name(renamed))


def collect(dest: Path) -> list[Path]:
    """Download the closure of the runtime requirements minus what the node has."""
    have = node_packages()
    pending = runtime_requirements()
    seen: set[str] = set()
    existing = {wheel_name(w): w for w in dest.glob("*.whl")}
    wheels = []
    while pending:
        spec = pending.pop(0)
        name = requirement_name(spec)
        if name in have or name in seen:
            continue
        seen.add(name)
        wheel = existing.get(name) or download(spec, dest)
        print(f"gpu-wheels: {wheel.name} ({wheel.stat().st_size / 2**20:.2f} MiB)")
        wheels.append(wheel)
        pending.extend(wheel_requirements(wheel))
    return wheels


def tracked_bytes() -> int:
    """This checkout's tracked files: what a device command carries besides the wheels."""
    names = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.split(b"\0")
    return sum(
        (REPO / n.decode()).stat().st_size for n in names if n and (REPO / n.decode()).is_file()
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=REPO / ".whl")
    args = parser.parse_args(argv)
    args.dest.mkdir(parents=True, exist_ok=True)
    wheels = collect(args.dest)
    extra = [w for w in args.dest.glob("*.whl") if w not in wheels]
    for stale in extra:  # left by an older resolve: two versions of one package break the install
        print(f"gpu-wheels: removing {stale.name} (not needed now)")
        stale.unlink()
    wheel_mib = sum(w.stat().st_size for w in wheels) / 2**20
    tree_mib = tracked_bytes() / 2**20
    total = wheel_mib + tree_mib
    print(
        f"gpu-wheels: {len(wheels)} wheels {wheel_mib:.1f} MiB + tracked tree {tree_mib:.1f} MiB "
        f"= {total:.1f} MiB (limit {LIMIT_MIB})"
    )
    if total > LIMIT_MIB:
        print(
            f"gpu-wheels: over {LIMIT_MIB} MiB: a device command carries at most 64",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
