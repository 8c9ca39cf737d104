"""data.tokenizer kinds: the DataConfig checks, and each backend on files made here (offline).

SentencePiece and tiktoken go through megatron-core's tokenizer library, which needs those
packages; their tests are skipped where the package is not installed, and the refusal is
tested instead.
"""

from __future__ import annotations

import base64
import importlib.util
import io
import json
from pathlib import Path

import pytest

from pretrain.data.prepare.corpus import dataset_prefix, prepare_corpus
from pretrain.data.tokenizer import (
    TOKENIZER_KINDS,
    HFTokenizer,
    MegatronLibraryTokenizer,
    TokenizerError,
    TokenizerFileError,
    build_tokenizer,
)
from recipes import ConfigError, load_config
from recipes.config.data import DataConfig

TEXTS = ["the cat sat on the mat", "a dog ate the cat food", "hello world, naïve café"]


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def read_back(output_prefix: str) -> list[list[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(dataset_prefix(output_prefix))
    return [dataset[i].tolist() for i in range(len(dataset))]


def gpt_sample(prefix: str, tok: object, cache: Path) -> object:
    """The first training sample megatron-core's GPTDataset builds with `tok`."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    config = GPTDatasetConfig(
        random_seed=1,
        sequence_length=8,
        blend=([prefix], None),
        split="1,0,0",
        tokenizer=tok,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=str(cache),
    )
    builder = BlendedMegatronDatasetBuilder(GPTDataset, [4, None, None], lambda: True, config)
    return builder.build()[0][0]["tokens"]


def test_data_config_takes_exactly_the_tokenizer_kinds() -> None:
    for kind in TOKENIZER_KINDS:
        DataConfig(tokenizer=kind, tokenizer_path=None if kind == "byte" else "tok")
    with pytest.raises(ConfigError) as err:
        DataConfig(tokenizer="wordpiece")
    assert str(list(TOKENIZER_KINDS)) in str(err.value)
    with pytest.raises(ConfigError, match=r"^data.tokenizer=sentencepiece needs data.tokenizer_pa"):
        DataConfig(tokenizer="sentencepiece")
    with pytest.raises(ConfigError, match="is not read by data.tokenizer=byte"):
        DataConfig(tokenizer="byte", tokenizer_path="tok")
    # Through the Hydra overrides too, as one line.
    with pytest.raises(ConfigError) as err:
        load_config(["recipe=gpt_tiny", "data.tokenizer=tiktoken"])
    assert "a megatron tiktoken vocabulary .json file" in str(err.value)
    assert "\n" not in str(err.value).strip()
    run = load_config(["recipe=gpt_tiny", "data.tokenizer=tiktoken", "data.tokenizer_path=v.json"])
    assert (run.data.tokenizer, run.data.tokenizer_path) == ("tiktoken", "v.json")


def test_huggingface_tokenizer_json_file(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>", "<|endoftext|>"])
    raw.train_from_iterator(TEXTS * 10, trainer)
    path = tmp_path / "my-bpe.json"  # a file, not a directory
    raw.save(str(path))
    tok = build_tokenizer("huggingface", str(path))
    assert isinstance(tok, HFTokenizer)
    assert tok.eod == raw.token_to_id("<|endoftext|>") == tok.pad  # no pad token: pad == eod
    for text in TEXTS:
        assert tok.tokenize(text) == raw.encode(text).ids
    path.write_text("{not json", encoding="utf-8")
    with pytest.raises(TokenizerFileError, match="not a tokenizers-library tokenizer.json"):
        build_tokenizer("huggingface", str(path))


@pytest.fixture
def hide_library(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201 - a callable
    """Make ``find_spec`` report a package as absent, so the missing-library path is tested
    whether or not the package is installed here."""
    real = importlib.util.find_spec

    def hide(package: str) -> None:
        def find_spec(name: str, *args: object) -> object:
            return None if name == package else real(name, *args)

        monkeypatch.setattr(importlib.util, "find_spec", find_spec)

    return hide


def test_huggingface_directory_without_tokenizer_json_names_the_package(
    tmp_path: Path, hide_library
) -> None:
    hide_library("transformers")
    (tmp_path / "tokenizer_config.json").write_text("{}", encoding="utf-8")
    with pytest.raises(TokenizerError, match=r"needs the `transformers` package: pip install"):
        build_tokenizer("huggingface", str(tmp_path))


@pytest.mark.parametrize("kind", ["sentencepiece", "tiktoken"])
def test_a_missing_library_is_one_line_naming_the_package(
    kind: str, tmp_path: Path, hide_library
) -> None:
    hide_library(kind)
    path = tmp_path / "tokenizer.file"
    path.write_bytes(b"\0")
    with pytest.raises(TokenizerError) as err:
        build_tokenizer(kind, str(path))
    assert str(err.value).endswith(f"pip install {kind}") and err.value.exit_code == 2


@pytest.fixture
def sp_model(tmp_path: Path) -> Path:
    spm = pytest.importorskip("sentencepiece")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXTS * 20),
        model_writer=model,
        vocab_size=45,
        model_type="bpe",
        character_coverage=1.0,
        minloglevel=2,
    )
    path = tmp_path / "sp.model"
    path.write_bytes(model.getvalue())
    return path


def test_sentencepiece_through_megatron_core(tmp_path: Path, sp_model: Path) -> None:
    import sentencepiece as spm

    direct = spm.SentencePieceProcessor(model_file=str(sp_model))
    tok = build_tokenizer("sentencepiece", str(sp_model))
    assert isinstance(tok, MegatronLibraryTokenizer)
    assert tok.vocab_size == direct.get_piece_size() and tok.eod == direct.eos_id()
    assert tok.pad == tok.eod  # the model has no pad piece (id -1)
    for text in TEXTS:
        assert tok.tokenize(text) == direct.encode(text)
    prepare_corpus(TEXTS * 10, str(tmp_path / "sp"), tok)
    assert read_back(str(tmp_path / "sp")) == [direct.encode(t) + [tok.eod] for t in TEXTS] * 10
    sample = gpt_sample(dataset_prefix(str(tmp_path / "sp")), tok, tmp_path / "cache")
    assert sample.shape == (8,) and int(sample.max()) < tok.vocab_size
    sp_model.write_bytes(b"not a model")
    with pytest.raises(TokenizerFileError, match="cannot load"):
        build_tokenizer("sentencepiece", str(sp_model))


def tiktoken_vocab(path: Path, merges: list[bytes]) -> None:
    """megatron's tiktoken vocabulary format: the 256 bytes, then merges, by rank."""
    tokens = [bytes([i]) for i in range(256)] + merges
    entries = [
        {"rank": r, "token_bytes": base64.b64encode(t).decode(), "token_str": t.decode("latin-1")}
        for r, t in enumerate(tokens)
    ]
    path.write_text(json.dumps(entries), encoding="utf-8")


def test_tiktoken_through_megatron_core(tmp_path: Path) -> None:
    pytest.importorskip("tiktoken")
    path = tmp_path / "vocab.json"
    merges = [b"th", b"the", b"at", b"ca", b"cat"]
    tiktoken_vocab(path, merges)
    tok = build_tokenizer("tiktoken", str(path))
    assert isinstance(tok, MegatronLibraryTokenizer)
    # 1000 special ids first (</s> is id 2), then the vocabulary, as Megatron-LM's TikTokenizer.
    assert (tok.vocab_size, tok.eod, tok.pad) == (1000 + 256 + len(merges), 2, 4)
    assert tok.tokenize("the cat") == [1256 + 1, ord(" ") + 1000, 1256 + 4]
    assert tok.detokenize(tok.tokenize("naïve café")) == "naïve café"
    path.write_text('{"not": "a list"}', encoding="utf-8")
    with pytest.raises(TokenizerFileError, match="not a megatron tiktoken vocabulary"):
        build_tokenizer("tiktoken", str(path))
