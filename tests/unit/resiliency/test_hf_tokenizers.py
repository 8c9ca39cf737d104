"""SentencePiece and tiktoken tokenizers as tokenizer.json (resiliency/hf/tokenizer_json.py):
the converted tokenizer encodes and decodes text as the run's own tokenizer (megatron-core's,
through pretrain.data.tokenizer) does, on models and vocabularies made here. sentencepiece and
tiktoken are in the test extra: these run, they do not skip."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest
import sentencepiece as spm

from pretrain.data.tokenizer import build_tokenizer
from resiliency.hf.tokenizer_files import library_tokenizer_json
from resiliency.hf.tokenizer_json import TokenizerConversionError, sentencepiece_tokenizer

# What normalizers and pre-tokenizers get wrong first: runs of spaces, leading and trailing
# spaces, tabs and newlines, non-ASCII and characters no piece covers, digits, empty text.
TEXTS = [
    "def export_step(step_dir: Path, out: Path) -> None:",
    '    """Write the transformers directory."""',
    "",
    " ",
    "  leading and trailing  ",
    "tab\there\nnew  line\r\nend",
    "naïve café ½ ｆｕｌｌｗｉｄｔｈ",
    "日本語のテキスト 🙂",
    "x  y   z",
    "a<sym>b <sym> c<sym>",
    "UPPER lower MiXeD 12345 3.14159",
    "the cat sat on the mat " * 8,
]
CORPUS = [t for t in TEXTS if t.strip()] * 10 + [
    "the quick brown fox jumps over the lazy dog",
    "def main(argv: list[str] | None = None) -> int:",
    "return the cat, the mat and the hat",
]


def sp_model(path: Path, model_type: str, **options: object) -> Path:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_writer=model,
        vocab_size=400,
        hard_vocab_limit=False,
        model_type=model_type,
        character_coverage=0.98,  # leaves characters out: unknown pieces and byte fallback
        minloglevel=2,
        **options,
    )
    path.write_bytes(model.getvalue())
    return path


def assert_same_as_the_run(kind: str, path: Path, texts: list[str]) -> None:
    run = build_tokenizer(kind, str(path))
    converted = library_tokenizer_json(kind, run)
    for text in texts:
        ids = run.tokenize(text)
        assert converted.encode(text, add_special_tokens=False).ids == ids, text
        assert converted.decode(ids, skip_special_tokens=False) == run.detokenize(ids), text


SP_MODELS = {
    "bpe": ("bpe", {}),
    "unigram": ("unigram", {}),
    "bpe_byte_fallback": ("bpe", {"byte_fallback": True}),
    "unigram_user_symbols": (
        "unigram",
        {"byte_fallback": True, "user_defined_symbols": ["<sym>"]},
    ),
    "bpe_identity_spaces_kept": (
        "bpe",
        {
            "normalization_rule_name": "identity",
            "remove_extra_whitespaces": False,
            "user_defined_symbols": ["<sym>", "def"],
        },
    ),
}


@pytest.mark.parametrize("name", SP_MODELS)
def test_sentencepiece_as_tokenizer_json_encodes_as_the_run(name: str, tmp_path: Path) -> None:
    model_type, options = SP_MODELS[name]
    path = sp_model(tmp_path / "sp.model", model_type, **options)
    assert_same_as_the_run("sentencepiece", path, TEXTS)


def test_a_sentencepiece_model_type_without_a_form_is_refused(tmp_path: Path) -> None:
    path = sp_model(tmp_path / "sp.model", "char")
    with pytest.raises(TokenizerConversionError, match="model type CHAR has no tokenizer.json"):
        sentencepiece_tokenizer(path.read_bytes())


def test_tiktoken_as_tokenizer_json_encodes_as_the_run(tmp_path: Path) -> None:
    merges = [b"th", b"the", b"at", b"ca", b"cat", b" t", b" the", b"in", b"ing", b"  "]
    merges += [b"de", b"def", b" def", b"se", b"self", b"\xc3\xa9", b"caf\xc3\xa9"]
    tokens = [bytes([i]) for i in range(256)] + merges
    path = tmp_path / "vocab.json"
    path.write_text(
        json.dumps(
            [
                {"rank": r, "token_bytes": base64.b64encode(t).decode(), "token_str": ""}
                for r, t in enumerate(tokens)
            ]
        )
    )
    # megatron-core encodes special tokens' text as their ids (allowed_special="all"): so here
    assert_same_as_the_run("tiktoken", path, [*TEXTS, "<s> x </s> <SPECIAL_9>"])
