"""The tokenizer travels with every checkpoint, and a restore refuses another one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pretrain.context import exit_codes
from resiliency.storage.checksum import describe_files
from resiliency.storage.tokenizer_copy import (
    copy_tokenizer,
    tokenizer_difference,
    tokenizer_record,
)
from tests.helpers import run_pretrain

TEXTS = ["def main():\n    return 0\n", "import os\nprint(os.getcwd())\n", "class A:\n    pass\n"]


def _bpe(directory: Path, texts: list[str]) -> Path:
    """A byte-level BPE tokenizer.json with at least 258 ids (the byte-tokenized corpus's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts * 20, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return directory


def _swapped(source: Path, directory: Path) -> Path:
    """The same tokenizer with two tokens' ids swapped: same vocabulary size, other ids (a
    regenerated file the vocabulary-size check cannot tell apart)."""
    spec = json.loads((source / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    directory.mkdir()
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    return directory


def test_difference_names_each_file(tmp_path: Path) -> None:
    source = tmp_path / "tok"
    source.mkdir()
    (source / "tokenizer.json").write_text("{}")
    (source / "special_tokens_map.json").write_text("{}")
    step = tmp_path / "step"
    step.mkdir()
    copy_tokenizer(step, str(source))
    copies = sorted(p.relative_to(step).as_posix() for p in step.rglob("*") if p.is_file())
    assert copies == ["tokenizer/special_tokens_map.json", "tokenizer/tokenizer.json"]
    saved = tokenizer_record(describe_files(step, copies))  # as the manifest records it
    assert sorted(saved) == ["special_tokens_map.json", "tokenizer.json"]
    assert tokenizer_difference(saved, str(source)) is None
    (source / "tokenizer.json").write_text('{"changed": 1}')
    (source / "special_tokens_map.json").unlink()
    difference = tokenizer_difference(saved, str(source))
    assert "special_tokens_map.json: missing here" in difference
    assert "tokenizer.json: content differs" in difference
    copy_tokenizer(tmp_path / "bytes", None)  # the byte tokenizer: nothing to carry
    assert not (tmp_path / "bytes").exists()


@pytest.mark.slow
def test_a_restore_refuses_another_tokenizer_and_takes_a_copy(
    tiny_overrides: list[str], tmp_path: Path
) -> None:
    trained = _bpe(tmp_path / "trained", TEXTS)
    other = _swapped(trained, tmp_path / "other")
    base = [
        *tiny_overrides,
        f"output_dir={tmp_path}",
        "run_id=tok",
        "data.tokenizer=huggingface",
        "checkpoint.save_interval=2",
        "scheduler.decay_steps=4",  # the same schedule in all three launches
    ]
    run_pretrain(2, [*base, f"data.tokenizer_path={trained}", "train.train_steps=2"])
    step = tmp_path / "tok" / "steps" / "step-000000002"
    manifest = json.loads((step / "manifest.json").read_text())
    files = manifest["tokenizer"]["files"]
    assert (step / "tokenizer" / "tokenizer.json").read_bytes() == (
        trained / "tokenizer.json"
    ).read_bytes()
    assert "tokenizer/tokenizer.json" in {entry["path"] for entry in manifest["files"]}
    refused = run_pretrain(
        2, [*base, f"data.tokenizer_path={other}", "train.train_steps=4"], check=False
    )
    # Under bare torchrun the job exits 1; each rank exits CONFIG_ERROR with one line.
    assert refused.returncode != 0, refused.stderr[-3000:]
    assert f"exitcode  : {exit_codes.CONFIG_ERROR}" in refused.stderr, refused.stderr[-3000:]
    assert "restore refused" in refused.stderr and "tokenizer.json: content differs" in (
        refused.stderr
    )
    moved = shutil.copytree(trained, tmp_path / "moved")  # the same files elsewhere: fine
    run_pretrain(2, [*base, f"data.tokenizer_path={moved}", "train.train_steps=4"])
    latest = tmp_path / "tok" / "steps" / "step-000000004" / "manifest.json"
    assert json.loads(latest.read_text())["tokenizer"]["files"] == files
