"""Tokenizers usable both by `pretrain.prepare` and as megatron-core's `GPTDatasetConfig.tokenizer`.

megatron-core's GPT datasets read `vocab_size`, `eod` and `pad`, and serialize
`unique_identifiers` into the hash that names their index cache, so every tokenizer here
provides those four. Nothing is ever downloaded.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from typing import Any, Protocol

EOD_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")
PAD_CANDIDATES = ("<pad>", "[PAD]", "<|pad|>")
TOKENIZER_KINDS = ("byte", "huggingface")


class TokenizerError(ValueError):
    """A tokenizer could not be built from what was given."""


class Tokenizer(Protocol):
    vocab_size: int
    eod: int
    pad: int

    @property
    def unique_identifiers(self) -> dict[str, Any]: ...

    def tokenize(self, text: str) -> list[int]: ...

    def detokenize(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, plus end-of-document and padding ids."""

    vocab_size: int = 258
    eod: int = 256
    pad: int = 257

    @property
    def unique_identifiers(self) -> dict[str, Any]:
        return {"class": type(self).__name__, "vocab_size": self.vocab_size}

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Sequence[int]) -> str:
        # Special ids have no byte form; dropping them keeps the text readable.
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a local directory only."""

    def __init__(
        self, path: str, eod_token: str | None = None, add_special_tokens: bool = True
    ) -> None:
        if not os.path.isdir(path):
            raise TokenizerError(
                f"tokenizer directory {path!r} does not exist (it must be a local "
                "directory holding tokenizer.json or a transformers tokenizer)"
            )
        self.path = os.path.abspath(path)
        # True matches Megatron-LM's HuggingFaceTokenizer (e.g. Llama's BOS is kept).
        self.add_special_tokens = add_special_tokens
        self._backend = _load_backend(self.path)
        vocab = _vocab(self._backend)
        self.vocab_size: int = _vocab_size(self._backend)
        self.eod: int = _find_eod(vocab, eod_token, self._backend, self.path)
        self.pad: int = _find_pad(vocab, self._backend, self.eod)

    @property
    def unique_identifiers(self) -> dict[str, Any]:
        return {
            "class": type(self).__name__,
            "tokenizer_path": self.path,
            "vocab_size": self.vocab_size,
            "eod": self.eod,
            "pad": self.pad,
            "add_special_tokens": self.add_special_tokens,
        }

    def tokenize(self, text: str) -> list[int]:
        if _is_fast_file(self._backend):
            return list(self._backend.encode(text, add_special_tokens=self.add_special_tokens).ids)
        return list(self._backend.encode(text, add_special_tokens=self.add_special_tokens))

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r})"


def _is_fast_file(backend: Any) -> bool:
    from tokenizers import Tokenizer as RawTokenizer  # noqa: PLC0415 - only loaded when used

    return isinstance(backend, RawTokenizer)


def _load_backend(path: str) -> Any:
    tokenizer_json = os.path.join(path, "tokenizer.json")
    if os.path.isfile(tokenizer_json):
        from tokenizers import Tokenizer as RawTokenizer  # noqa: PLC0415

        return RawTokenizer.from_file(tokenizer_json)
    if importlib.util.find_spec("transformers") is None:
        raise TokenizerError(
            f"{path!r} has no tokenizer.json and `transformers` is not installed: "
            "provide a tokenizer.json (tokenizers library format) or "
            "`pip install transformers sentencepiece`"
        )
    from transformers import AutoTokenizer  # noqa: PLC0415

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as err:
        raise TokenizerError(
            f"transformers could not load a tokenizer from {path!r}: {err}"
        ) from err


def _vocab(backend: Any) -> dict[str, int]:
    if _is_fast_file(backend):
        return backend.get_vocab(with_added_tokens=True)
    return backend.get_vocab()


def _vocab_size(backend: Any) -> int:
    if _is_fast_file(backend):
        return backend.get_vocab_size(with_added_tokens=True)
    return len(backend)  # unlike .vocab_size, len() counts added tokens


def _find_eod(vocab: dict[str, int], eod_token: str | None, backend: Any, path: str) -> int:
    if eod_token is not None:
        if eod_token not in vocab:
            raise TokenizerError(f"eod_token {eod_token!r} is not in the vocabulary of {path!r}")
        return vocab[eod_token]
    for token in EOD_CANDIDATES:
        if token in vocab:
            return vocab[token]
    eos_id = getattr(backend, "eos_token_id", None)
    if eos_id is not None:
        return int(eos_id)
    raise TokenizerError(
        f"no end-of-document token in {path!r}: none of {list(EOD_CANDIDATES)} "
        "is in its vocabulary; pass eod_token explicitly"
    )


def _find_pad(vocab: dict[str, int], backend: Any, eod: int) -> int:
    pad_id = getattr(backend, "pad_token_id", None)
    if pad_id is not None:
        return int(pad_id)
    for token in PAD_CANDIDATES:
        if token in vocab:
            return vocab[token]
    # megatron-core notices pad == eod and stops masking pad tokens, which is what we want.
    return eod


def build_tokenizer(kind: str, path: str | None = None, eod_token: str | None = None) -> Tokenizer:
    """Build a tokenizer by kind: "byte" (no files needed) or "huggingface" (local `path`)."""
    if kind == "byte":
        return ByteTokenizer()
    if kind == "huggingface":
        if path is None:
            raise TokenizerError("tokenizer kind 'huggingface' needs a local tokenizer directory")
        return HFTokenizer(path, eod_token=eod_token)
    raise TokenizerError(
        f"unknown tokenizer kind {kind!r}; expected one of {list(TOKENIZER_KINDS)}"
    )
