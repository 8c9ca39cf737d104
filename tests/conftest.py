from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.s3_server import S3Server, running_s3_server
from drill.fault_proxy import FaultProxy
from pretrain.data.prepare.corpus import dataset_prefix, prepare_corpus, stdlib_documents
from pretrain.data.tokenizer import build_tokenizer

CORPUS_BYTES = 1 << 20


@pytest.fixture(scope="session")
def stdlib_corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A small real corpus (Python stdlib sources, byte tokens); returns the data prefix."""
    prefix = str(tmp_path_factory.mktemp("corpus") / "stdlib")
    prepare_corpus(stdlib_documents(CORPUS_BYTES), prefix, build_tokenizer("byte"))
    return dataset_prefix(prefix)


@pytest.fixture(scope="session")
def tiny_overrides(stdlib_corpus: str) -> list[str]:
    """gpt_tiny on the stdlib corpus, short: the base of every training test."""
    return [
        "recipe=gpt_tiny",
        f"data.paths=[{stdlib_corpus}]",
        "train.train_steps=10",
        "train.micro_batch_size=2",
        "train.global_batch_size=8",
    ]


@pytest.fixture()
def run_root(tmp_path: Path) -> Path:
    return tmp_path / "runs"


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One real S3 server (SeaweedFS on 127.0.0.1) for every test that needs one; tests keep
    to prefixes of their own."""
    with running_s3_server(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server


@pytest.fixture()
def proxy(s3: S3Server) -> Iterator[FaultProxy]:
    """A fault-injecting TCP proxy in front of the server (drill/fault_proxy.py)."""
    with FaultProxy(s3.endpoint_url) as fault_proxy:
        yield fault_proxy
