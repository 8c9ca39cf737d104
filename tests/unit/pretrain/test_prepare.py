"""pretrain.data.tokenizer and pretrain.data.prepare: real files in tmp_path, read back via
megatron-core."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from pretrain.context.exit_codes import DATA
from pretrain.data.prepare.corpus import (
    STDLIB_SKIP_DIRS,
    PrepareError,
    dataset_prefix,
    file_documents,
    main,
    prepare_corpus,
    stdlib_documents,
    stdlib_files,
)
from pretrain.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    TokenizerError,
    TokenizerFileError,
    build_tokenizer,
)

REPO = Path(__file__).resolve().parents[3]
DOCS = ["hello world", "naïve café — 日本語 🚀", "line one\nline two\n", "x"]


def read_back(output_prefix: str) -> list[list[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(dataset_prefix(output_prefix))
    # One sequence per document, so document boundaries are exactly the sequence boundaries.
    assert list(dataset.document_indices) == list(range(len(dataset) + 1))
    return [dataset[i].tolist() for i in range(len(dataset))]


def expected(tokenizer, docs: list[str]) -> list[list[int]]:
    return [tokenizer.tokenize(d) + [tokenizer.eod] for d in docs]


def output_files(directory: Path) -> list[str]:
    return sorted(
        p.name for p in directory.iterdir() if p.suffix in (".bin", ".idx") or ".tmp" in p.name
    )


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", "</s>", "<pad>"])
    tok.train_from_iterator(["the cat sat on the mat", "a dog ate the cat food"], trainer)
    directory = tmp_path / "tok"
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    return directory


def test_byte_tokenizer_round_trip_and_special_ids() -> None:
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.eod, tok.pad) == (258, 256, 257)
    for text in DOCS:
        ids = tok.tokenize(text)
        assert ids == list(text.encode("utf-8")) and max(ids) < 256
        assert tok.detokenize(ids) == text
    assert tok.detokenize(tok.tokenize("ab") + [tok.eod]) == "ab"
    assert json.loads(json.dumps(tok.unique_identifiers))["class"] == "ByteTokenizer"


def test_build_tokenizer_errors(tmp_path: Path) -> None:
    assert isinstance(build_tokenizer("byte", None), ByteTokenizer)
    with pytest.raises(TokenizerError, match="unknown tokenizer kind"):
        build_tokenizer("wordpiece", None)
    with pytest.raises(TokenizerError, match=r"'sentencepiece' needs a tokenizer path"):
        build_tokenizer("sentencepiece", None)
    with pytest.raises(TokenizerFileError, match="does not exist"):
        build_tokenizer("huggingface", str(tmp_path / "missing"))
    with pytest.raises(TokenizerError, match="reads no file"):
        build_tokenizer("byte", str(tmp_path))
    with pytest.raises(TokenizerFileError, match="holds no tokenizer.json"):
        HFTokenizer(str(tmp_path))


def test_prepare_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text(
        "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS)),
        encoding="utf-8",
    )
    prefix = str(tmp_path / "out" / "nested" / "corpus")  # parents do not exist yet
    tok = ByteTokenizer()
    docs, tokens = prepare_corpus(file_documents([str(path)]), prefix, tok)
    want = expected(tok, DOCS)
    assert (docs, tokens) == (len(DOCS), sum(map(len, want)))
    assert read_back(prefix) == want
    assert output_files(tmp_path / "out" / "nested") == [
        "corpus_text_document.bin",
        "corpus_text_document.idx",
    ]


def test_prepare_plain_text_uint16(tmp_path: Path) -> None:
    paths = []
    for i, doc in enumerate(DOCS):
        paths.append(tmp_path / f"doc{i}.txt")
        paths[-1].write_text(doc, encoding="utf-8")
    prefix = str(tmp_path / "plain")
    prepare_corpus(file_documents(map(str, paths)), prefix, ByteTokenizer())
    assert read_back(prefix) == expected(ByteTokenizer(), DOCS)
    # 2 bytes per token: uint16, as megatron picks for small vocabularies.
    want_bytes = 2 * sum(len(d.encode()) + 1 for d in DOCS)
    assert os.path.getsize(dataset_prefix(prefix) + ".bin") == want_bytes


def test_stdlib_corpus_is_deterministic_and_fills_the_cap(tmp_path: Path) -> None:
    cap = 256 * 1024
    blobs = []
    for run in ("a", "b"):
        docs, tokens = prepare_corpus(stdlib_documents(cap), str(tmp_path / run), ByteTokenizer())
        text_bytes = tokens - docs  # each document adds one eod
        assert 0.95 * cap < text_bytes <= cap
        blobs.append(
            tuple(
                Path(dataset_prefix(str(tmp_path / run)) + ext).read_bytes()
                for ext in (".bin", ".idx")
            )
        )
    assert blobs[0] == blobs[1]


def test_stdlib_selection_skips_tests_and_vendored_code() -> None:
    root = Path(sysconfig.get_paths()["stdlib"])
    relative = [p.relative_to(root).as_posix() for p in stdlib_files()]
    assert relative == sorted(relative) and "os.py" in relative
    assert not any(set(r.split("/")[:-1]) & STDLIB_SKIP_DIRS for r in relative)


def test_hf_tokenizer_from_local_dir(tmp_path: Path, hf_dir: Path) -> None:
    tok = build_tokenizer("huggingface", str(hf_dir))
    assert isinstance(tok, HFTokenizer)
    assert tok.eod == tok.tokenize("</s>")[0] and tok.pad != tok.eod
    docs = ["the cat sat", "a dog ate the mat", "cat food"]
    assert all(2 < i < tok.vocab_size for d in docs for i in tok.tokenize(d))
    assert tok.detokenize(tok.tokenize("the cat")) == "the cat"
    prefix = str(tmp_path / "hf")
    prepare_corpus(docs, prefix, tok)
    assert read_back(prefix) == expected(tok, docs)
    assert json.loads(json.dumps(tok.unique_identifiers))["vocab_size"] == tok.vocab_size


def test_hf_tokenizer_without_eod_token_is_a_clear_error(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models

    directory = tmp_path / "noeos"
    directory.mkdir()
    Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")).save(
        str(directory / "tokenizer.json")
    )
    with pytest.raises(TokenizerError, match="no end-of-document token"):
        HFTokenizer(str(directory))
    assert HFTokenizer(str(directory), eod_token="a").eod == 0


def test_tokenizers_plug_into_megatron_gpt_dataset(tmp_path: Path, hf_dir: Path) -> None:
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    for name, tok in (("byte", ByteTokenizer()), ("hf", HFTokenizer(str(hf_dir)))):
        prefix = str(tmp_path / name)
        prepare_corpus(["the cat sat on the mat"] * 40, prefix, tok)
        config = GPTDatasetConfig(
            random_seed=1,
            sequence_length=8,
            blend=([dataset_prefix(prefix)], None),
            split="1,0,0",
            tokenizer=tok,
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            path_to_cache=str(tmp_path / f"cache-{name}"),
        )
        train, _, _ = BlendedMegatronDatasetBuilder(
            GPTDataset, [4, None, None], lambda: True, config
        ).build()
        sample = train[0]
        assert sample["tokens"].shape == (8,) and int(sample["tokens"].max()) < tok.vocab_size


def test_missing_json_key_names_file_and_line(tmp_path: Path, capsys) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n\n{"content": "no text key"}\n', encoding="utf-8")
    with pytest.raises(PrepareError, match=r"bad\.jsonl:3: no 'text' key"):
        list(file_documents([str(path)]))
    assert main(["--input", str(path), "--output-prefix", str(tmp_path / "out")]) == DATA
    assert "bad.jsonl:3" in capsys.readouterr().err
    assert output_files(tmp_path) == []  # nothing half-written, no temp files left


def test_failed_run_keeps_previous_output(tmp_path: Path) -> None:
    prefix = str(tmp_path / "keep")
    prepare_corpus(["first"], prefix, ByteTokenizer())
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": 3}\n', encoding="utf-8")
    with pytest.raises(PrepareError, match="bad.jsonl:2"):
        prepare_corpus(file_documents([str(bad)]), prefix, ByteTokenizer())
    assert read_back(prefix) == expected(ByteTokenizer(), ["first"])
    assert output_files(tmp_path) == ["keep_text_document.bin", "keep_text_document.idx"]


def test_cli_errors(tmp_path: Path, capsys) -> None:
    out = str(tmp_path / "out")
    assert main(["--input", str(tmp_path / "nothing-*.jsonl"), "--output-prefix", out]) == DATA
    assert "matched no files" in capsys.readouterr().err
    hf = ["--tokenizer", "huggingface", "--tokenizer-path", str(tmp_path / "no-such-dir")]
    assert main(["--stdlib", "--output-prefix", out, *hf]) == DATA
    err = capsys.readouterr().err
    assert "no-such-dir" in err and "does not exist" in err
    assert output_files(tmp_path) == []


def test_cli_entrypoint_subprocess(tmp_path: Path) -> None:
    for i, doc in enumerate(DOCS):
        (tmp_path / f"d{i}.txt").write_text(doc, encoding="utf-8")
    prefix = str(tmp_path / "cli" / "docs")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pretrain.data.prepare",
            "--input",
            str(tmp_path / "d*.txt"),
            "--output-prefix",
            prefix,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert f"{len(DOCS)} documents" in result.stderr
    assert read_back(prefix) == expected(ByteTokenizer(), DOCS)


def test_json_suffix_is_loose_json_not_plain_text(tmp_path: Path) -> None:
    path = tmp_path / "five.json"  # the case: 5 JSON lines were "1 documents"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS + ["five"]), "utf-8")
    prefix = str(tmp_path / "five")
    assert main(["--input", str(path), "--output-prefix", prefix]) == 0
    assert read_back(prefix) == expected(ByteTokenizer(), DOCS + ["five"])


def test_prepare_corpus_with_workers_matches_one_process(tmp_path: Path, hf_dir: Path) -> None:
    tok = HFTokenizer(str(hf_dir))
    docs = [f"the cat sat {'on the mat ' * (i % 5)}" for i in range(400)]
    outputs = []
    for workers in (1, 3):
        prefix = str(tmp_path / f"w{workers}")
        assert prepare_corpus(docs, prefix, tok, workers=workers) == (
            400,
            400 + sum(len(tok.tokenize(d)) for d in docs),
        )
        outputs.append([Path(dataset_prefix(prefix) + e).read_bytes() for e in (".bin", ".idx")])
    assert outputs[0] == outputs[1]
    assert read_back(str(tmp_path / "w3")) == expected(tok, docs)


def test_train_tokenizer_then_tokenize_with_it(tmp_path: Path) -> None:
    """--train-tokenizer: a byte-level BPE trained on the input, saved as tokenizer.json and
    used for the output; every document decodes back to its text (no unknown ids), and the
    merges make it shorter than the bytes."""
    paths = []
    for i, doc in enumerate(DOCS * 30):
        paths.append(tmp_path / f"doc{i}.txt")
        paths[-1].write_text(f"{doc} {i}", encoding="utf-8")
    prefix, tok_dir = str(tmp_path / "bpe"), tmp_path / "tok"
    argv = ["--input", str(tmp_path / "doc*.txt"), "--output-prefix", prefix]
    assert main([*argv, "--train-tokenizer", "300", "--tokenizer-path", str(tok_dir)]) == 0
    tok = build_tokenizer("huggingface", str(tok_dir))
    assert isinstance(tok, HFTokenizer) and 257 < tok.vocab_size <= 300
    docs = [Path(p).read_text(encoding="utf-8") for p in sorted(map(str, paths))]
    got = read_back(prefix)
    assert got == expected(tok, docs)
    assert all(tok.detokenize(ids[:-1]) == doc for ids, doc in zip(got, docs))
    assert sum(map(len, got)) < sum(len(d.encode()) + 1 for d in docs)
    with pytest.raises(SystemExit):  # a vocabulary below the 256 bytes + EOD is refused
        main([*argv, "--train-tokenizer", "100", "--tokenizer-path", str(tok_dir)])
