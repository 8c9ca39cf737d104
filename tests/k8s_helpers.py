"""What the k8s adapter tests share: the recipes they render, a stable environment and
accessors into a rendered PyTorchJob."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from launch.k8s import cli as k8s
from launch.k8s.schema import (
    CRD_FILE,
)
from resiliency.storage.manifest import code_commit
from tests.helpers import REPO

pytest.importorskip("jsonschema", reason="the k8s extra validates manifests with jsonschema")

GOLDEN = Path(__file__).parent / "golden" / "k8s"
SHARED_CRD = REPO.parent / "shared" / "k8s" / CRD_FILE  # where the shipped copy was taken from
IMAGE = "registry.example/mcore-recipes@sha256:0123456789abcdef"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "test-token-123"
BASE = [f"launch.k8s.image={IMAGE}", "launch.k8s.shared_pvc=ckpt-rwx"]
# The API tests after the first submit without the fit check (a process importing megatron-core,
# ~5 s each): test_submit_posts_the_rendered_objects and test_memory_fit keep it.
NO_FIT = ["--skip-fit-check"]
# The recipes' data paths are relative (for local runs); in a pod they must be on a volume.
STDLIB_ON_CLAIM = "data.paths=[/checkpoints/data/stdlib_text_document]"
GPU_NODE = ["launch.k8s.cpu=96", "launch.k8s.memory=1600Gi"]  # Guaranteed QoS on GPU pods


def hf_data(name: str) -> list[str]:
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
        *hf_data("llama3"),
        *GPU_NODE,
        # An InfiniBand cluster: RDMA devices from the device plugin, memory pinning for NCCL,
        # the local checkpoint tier on its default node-local hostPath.
        "+launch.k8s.extended_resources={rdma/ib: 1}",
        "launch.k8s.capabilities=[IPC_LOCK]",
        "checkpoint.local.interval=50",
        "checkpoint.local.dir=/nvme/ckpt",
    ],
    "mixtral_8x7b": ["recipe=mixtral_8x7b", "run_id=mixtral_8x7b", *hf_data("mixtral"), *GPU_NODE],
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
def stable_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("MCORE_RECIPES_CODE_COMMIT", COMMIT)
    monkeypatch.setenv(k8s.SUBMISSION_ENV, "test")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    code_commit.cache_clear()  # once per process: an earlier test may have asked git already
    yield
    code_commit.cache_clear()


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
