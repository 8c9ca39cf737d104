"""The tokenizer of a run as a transformers tokenizer directory (tokenizer.json and config)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tokenizers import Tokenizer

from pretrain.data.tokenizer import ByteTokenizer

EOD_TOKEN, PAD_TOKEN = "<|endoftext|>", "<|pad|>"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte: the alphabet of a byte-level tokenizer."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer_json() -> dict:
    """tokenizer.json that encodes text exactly as :class:`ByteTokenizer` (UTF-8 bytes as ids
    0..255, end-of-document 256, padding 257): byte-level BPE without merges."""
    byte = ByteTokenizer()
    vocab = {char: b for b, char in _bytes_to_unicode().items()}
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
    out: Path, kind: str, files: list[Path], eod: int | None, max_length: int
) -> None:
    """Write ``out``'s tokenizer: the run's own files (a huggingface tokenizer), or the byte
    tokenizer's equivalent; tokenizer_config.json added when the files hold none."""
    if kind == "byte":
        (out / "tokenizer.json").write_text(json.dumps(byte_tokenizer_json(), ensure_ascii=False))
        eod_text: str | None = EOD_TOKEN
        pad: str | None = PAD_TOKEN
    elif kind == "huggingface":
        for path in files:
            shutil.copy2(path, out / path.name)
        if (out / "tokenizer_config.json").exists():
            return
        eod_text, pad = _token_text(out / "tokenizer.json", eod), None
    else:
        raise ValueError(f"tokenizer {kind!r} has no transformers form here")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_length,
        "eos_token": eod_text,
        "pad_token": pad,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _token_text(tokenizer_json: Path, token_id: int | None) -> str | None:
    if token_id is None:
        return None
    return Tokenizer.from_file(str(tokenizer_json)).id_to_token(token_id)
