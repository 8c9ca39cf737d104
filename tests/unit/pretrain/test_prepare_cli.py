"""`python -m pretrain.data.prepare` through the real CLI: subprocesses, real exit codes and stderr.

Each CLI process pays megatron-core's import (~5 s of CPU), so where two runs are compared the
run under test is a subprocess and the reference is `main()` in this process, run meanwhile.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.context.exit_codes import CONFIG_ERROR, DATA
from pretrain.data.prepare.corpus import dataset_prefix, main
from pretrain.data.tokenizer import build_tokenizer

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.current_stack  # the indexed format and the tokenizers, on both stacks

WORDS = "the cat sat on a mat while dogs ate food naïve café 日本 🚀".split()


def record(i: int) -> dict:
    text = " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(1 + i % 23))
    # A list is one document of several sequences (Megatron-LM's --split-sentences output).
    value: str | list[str] = [text, f"part two {i}"] if i % 11 == 0 else text
    title = "" if i % 13 == 0 else f"title {i} {WORDS[i % len(WORDS)]}"
    return {"text": value, "title": title, "id": i}


def write_corpus(path: Path, n: int) -> list[dict]:
    records = [record(i) for i in range(n)]
    lines = "".join(json.dumps(r, ensure_ascii=i % 2 == 0) + "\n" for i, r in enumerate(records))
    lines = lines.replace("\n", "\n\n", 1)  # a blank line is skipped, as before
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(lines.encode("utf-8")))
    else:
        path.write_text(lines, encoding="utf-8")
    return records


@pytest.fixture(scope="module")
def bpe_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small BPE tokenizer.json trained here (the tokenizers library; nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>", "<pad>"])
    tok.train_from_iterator([" ".join(WORDS)] * 20, trainer)
    path = tmp_path_factory.mktemp("tok") / "bpe.json"
    tok.save(str(path))
    return path


def start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pretrain.data.prepare", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=180)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_together(*argv: list[str]) -> list[subprocess.CompletedProcess]:
    """Run several `python -m pretrain.data.prepare` at once; each with its own exit code."""
    return [finish(proc) for proc in [start(args) for args in argv]]


def documents(prefix: str) -> list[list[list[int]]]:
    """Each document of megatron's IndexedDataset at `prefix`, as its sequences' ids."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    bounds = dataset.document_indices.tolist()
    return [[dataset[s].tolist() for s in range(a, b)] for a, b in zip(bounds, bounds[1:])]


def files_of(prefix: str) -> tuple[bytes, bytes]:
    return tuple(Path(prefix + ext).read_bytes() for ext in (".bin", ".idx"))


def test_workers_2_is_byte_identical_to_1_and_matches_the_tokenizer(
    tmp_path: Path, bpe_json: Path
) -> None:
    # .json: loose JSON (one object per line), no longer read as one plain-text document.
    corpus = tmp_path / "corpus.json"
    records = write_corpus(corpus, 300)  # several 64-item chunks per worker: order is tested
    common = ["--input", str(corpus), "--json-keys", "text", "title", "--log-interval", "100"]
    common += ["--tokenizer", "huggingface", "--tokenizer-path", str(bpe_json)]
    proc = start([*common, "--output-prefix", str(tmp_path / "w2"), "--workers", "2"])
    assert main([*common, "--output-prefix", str(tmp_path / "w1"), "--workers", "1"]) == 0
    two = finish(proc)
    assert two.returncode == 0, two.stderr
    assert "300 documents (" in two.stderr and "MB/s" in two.stderr  # progress lines
    tok = build_tokenizer("huggingface", str(bpe_json))
    for key in ("text", "title"):
        w1, w2 = (dataset_prefix(str(tmp_path / run), key) for run in ("w1", "w2"))
        assert files_of(w1) == files_of(w2), key
        assert f"wrote {w2}.{{bin,idx}}: 300 documents" in two.stderr
        want = []
        for r in records:
            parts = [tok.tokenize(t) for t in (r[key] if isinstance(r[key], list) else [r[key]])]
            seqs = [p for p in parts if p]
            if seqs:  # the eod closes the last sequence; an empty title stays an empty document
                seqs[-1] = seqs[-1] + [tok.eod]
            want.append(seqs)
        assert documents(w2) == want
    assert sum(1 for r in records if r["title"] == "") > 0  # the empty-document case was met


def test_append_eod_adds_exactly_one_eod_per_document(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl.gz"  # gzipped loose JSON
    records = write_corpus(corpus, 120)
    common = ["--input", str(corpus), "--workers", "2"]
    proc = start([*common, "--output-prefix", str(tmp_path / "eod"), "--append-eod"])
    assert main([*common, "--output-prefix", str(tmp_path / "plain"), "--no-append-eod"]) == 0
    with_eod = finish(proc)
    assert with_eod.returncode == 0, with_eod.stderr
    eod = build_tokenizer("byte").eod
    plain = documents(dataset_prefix(str(tmp_path / "plain")))
    ended = documents(dataset_prefix(str(tmp_path / "eod")))
    assert len(plain) == len(ended) == len(records)
    for p, e, r in zip(plain, ended, records):
        flat_p, flat_e = sum(p, []), sum(e, [])
        assert flat_e == flat_p + [eod] and flat_e.count(eod) == 1
        assert e[:-1] == p[:-1] and e[-1] == p[-1] + [eod]  # it closes the last sequence
        texts = r["text"] if isinstance(r["text"], list) else [r["text"]]
        assert flat_p == list("".join(texts).encode("utf-8"))


def test_a_line_missing_a_key_is_one_line_with_its_number(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a", "title": "b"}\n\n{"text": "no title"}\n', encoding="utf-8")
    (result,) = run_together(
        [
            *("--input", str(bad), "--output-prefix", str(tmp_path / "out")),
            *("--json-keys", "text", "title", "--workers", "2"),  # raised in a worker
        ]
    )
    assert result.returncode == DATA
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("pretrain.data.prepare: error: ")
    assert f"{bad}:3: no 'title' key in this line" in lines[0] and "--json-keys" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]  # nothing left behind


def test_usage_and_tokenizer_errors_exit_codes(tmp_path: Path) -> None:
    text = tmp_path / "a.txt"
    text.write_text("plain", encoding="utf-8")
    model = tmp_path / "m.model"
    model.write_bytes(b"not a model")
    out = ["--output-prefix", str(tmp_path / "out")]
    vocab = str(tmp_path / "missing.json")
    cases = [
        # (argv, exit code, text in the one stderr line)
        (["--input", str(text), *out, "--workers", "0"], CONFIG_ERROR, "must be positive"),
        (["--input", str(text), *out, "--tokenizer", "wordpiece"], CONFIG_ERROR, "invalid choice"),
        (["--input", str(text), *out, "--json-keys", "text", "title"], CONFIG_ERROR, "a.txt"),
        (["--input", str(tmp_path / "nope*.json"), *out], DATA, "matched no files"),
        (
            ["--input", str(text), *out, "--tokenizer", "sentencepiece"],
            CONFIG_ERROR,
            "needs a tokenizer path",
        ),
        (
            [*("--input", str(text), *out, "--tokenizer", "tiktoken"), "--tokenizer-path", vocab],
            DATA,
            f"{vocab!r} does not exist",
        ),
        (
            ["--input", str(text), "--output-prefix", str(text / "sub" / "out")],
            CONFIG_ERROR,
            "cannot create the output directory",
        ),
    ]
    if _missing("sentencepiece"):
        sp = ["--tokenizer", "sentencepiece", "--tokenizer-path", str(model)]
        cases.append((["--input", str(text), *out, *sp], CONFIG_ERROR, "pip install sentencepiece"))
    results = run_together(*(argv for argv, _, _ in cases))
    for (argv, code, needle), result in zip(cases, results):
        lines = result.stderr.strip().splitlines()
        assert result.returncode == code, (argv, result.stderr)
        assert needle in lines[-1] and "Traceback" not in result.stderr, (argv, result.stderr)
        if not lines[0].startswith("usage:"):  # argparse prints its usage, then one line
            assert len(lines) == 1 and lines[0].startswith("pretrain.data.prepare: error: ")
    assert not (tmp_path / "out_text_document.bin").exists()


def _missing(module: str) -> bool:
    return importlib.util.find_spec(module) is None
