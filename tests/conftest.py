from __future__ import annotations

from pathlib import Path

import pytest

from pretrain.prepare import dataset_prefix, prepare_corpus, stdlib_documents
from pretrain.tokenizer import build_tokenizer

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
