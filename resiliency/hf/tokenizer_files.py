"""The tokenizer of a run as a transformers tokenizer directory (tokenizer.json and config)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tokenizers import Tokenizer

from pretrain.data.tokenizer import ByteTokenizer
from pretrain.data.tokenizer import Tokenizer as RunTokenizer
from resiliency.hf.tokenizer_json import (
    TokenizerConversionError,
    bytes_to_unicode,
    sentencepiece_tokenizer,
    tiktoken_tokenizer,
)

EOD_TOKEN, PAD_TOKEN = "<|endoftext|>", "<|pad|>"
TOKENIZER_JSON, TOKENIZER_CONFIG = "tokenizer.json", "tokenizer_config.json"
# Kinds megatron-core's tokenizer libraries read, converted to a tokenizer.json here.
LIBRARY_KINDS = ("sentencepiece", "tiktoken")


def byte_tokenizer_json() -> dict:
    """tokenizer.json that encodes text exactly as :class:`ByteTokenizer` (UTF-8 bytes as ids
    0..255, end-of-document 256, padding 257): byte-level BPE without merges."""
    byte = ByteTokenizer()
    vocab = {char: b for b, char in bytes_to_unicode().items()}
    specials = [(EOD_TOKEN, byte.eod), (PAD_TOKEN, byte.pad)]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": text,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for text, i in specials
        ],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": False,
            "use_regex": False,
        },
        "post_processor": None,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": False,
            "use_regex": False,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab | dict(specials),
            "merges": [],
        },
    }


def write_tokenizer_dir(
    out: Path,
    kind: str,
    files: list[Path],
    tokenizer: RunTokenizer,
    max_length: int,
    converted: Tokenizer | None = None,
) -> None:
    """Write ``out``'s tokenizer: the run's own files (a huggingface tokenizer), or a
    tokenizer.json that encodes as the run's ``tokenizer`` did (byte, SentencePiece, tiktoken:
    the step's own file copied beside it); tokenizer_config.json added when the files hold
    none. ``converted``: the tokenizer.json of a SentencePiece or tiktoken run, converted
    already (the export does it before it touches ``out``)."""
    eod_text: str | None
    pad: str | None
    if kind == "byte":
        (out / "tokenizer.json").write_text(json.dumps(byte_tokenizer_json(), ensure_ascii=False))
        eod_text, pad = EOD_TOKEN, PAD_TOKEN
    elif kind == "huggingface":
        for path in files:
            shutil.copyfile(path, out / path.name)
        if (out / "tokenizer_config.json").exists():
            return
        eod_text, pad = _token_text(out / "tokenizer.json", tokenizer.eod), None
    elif kind in LIBRARY_KINDS:
        for path in files:
            if path.name not in (TOKENIZER_JSON, TOKENIZER_CONFIG):
                shutil.copyfile(path, out / path.name)
        converted = converted or library_tokenizer_json(kind, tokenizer)
        converted.save(str(out / TOKENIZER_JSON))
        eod_text = converted.id_to_token(tokenizer.eod)
        pad = None if tokenizer.pad == tokenizer.eod else converted.id_to_token(tokenizer.pad)
    else:
        raise TokenizerConversionError(f"tokenizer {kind!r} has no transformers form here")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_length,
        "eos_token": eod_text,
        "pad_token": pad,
        "clean_up_tokenization_spaces": False,
    }
    (out / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def library_tokenizer_json(kind: str, tokenizer: RunTokenizer) -> Tokenizer:
    """tokenizer.json of a SentencePiece or tiktoken tokenizer, from the library object
    megatron-core loaded for the run."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None:
        raise TokenizerConversionError(f"{tokenizer!r} is not a megatron-core {kind} tokenizer")
    if kind == "sentencepiece":
        return sentencepiece_tokenizer(backend.serialized_model_proto())
    return tiktoken_tokenizer(backend)


def _token_text(tokenizer_json: Path, token_id: int | None) -> str | None:
    if token_id is None:
        return None
    return Tokenizer.from_file(str(tokenizer_json)).id_to_token(token_id)
