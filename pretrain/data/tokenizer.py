"""Tokenizers usable both by `pretrain.data.prepare` and as megatron-core's
`GPTDatasetConfig.tokenizer`.

megatron-core's GPT datasets read `vocab_size`, `eod` and `pad`, and serialize
`unique_identifiers` into the hash that names their index cache, so every tokenizer here
provides those four. `build_tokenizer` is the one place a tokenizer is made from
(`data.tokenizer`, `data.tokenizer_path`), for the trainer and `pretrain.data.prepare` alike:

- ``byte``: UTF-8 bytes plus eod/pad (no file; megatron-core's ByteLevelTokenizer puts eod and
  pad on bytes 0 and 1, which real text can contain).
- ``huggingface``: a ``tokenizer.json`` (or a directory holding one) through the ``tokenizers``
  library; a directory without one through megatron-core's HuggingFaceTokenizer (transformers).
- ``sentencepiece``: a ``.model`` file through megatron-core's SentencePieceTokenizer.
- ``tiktoken``: megatron's tiktoken vocabulary ``.json`` through megatron-core's
  TikTokenTokenizer.

Nothing is ever downloaded: only local files are read, with Hugging Face's offline switches on.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from collections.abc import Sequence
from typing import Any, Protocol

from pretrain.context.exit_codes import CONFIG_ERROR, DATA

EOD_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")
PAD_CANDIDATES = ("<pad>", "[PAD]", "<|pad|>")
# The same kinds as recipes.config.data.DataConfig accepts for data.tokenizer.
TOKENIZER_KINDS = ("byte", "huggingface", "sentencepiece", "tiktoken")
# What tokenizer_path holds for each kind, for messages.
TOKENIZER_FILES = {
    "huggingface": "a tokenizer.json file or a local Hugging Face tokenizer directory",
    "sentencepiece": "a SentencePiece .model file",
    "tiktoken": "a megatron tiktoken vocabulary .json file",
}
# The pip package each megatron-core tokenizer library needs (not a dependency of this project),
# and what it reads here.
LIBRARY_PACKAGES = {
    "huggingface": ("transformers", "a tokenizer directory without tokenizer.json"),
    "sentencepiece": ("sentencepiece", "a SentencePiece model"),
    "tiktoken": ("tiktoken", "a tiktoken vocabulary"),
}
# megatron-core's TikTokenTokenizer defaults, as Megatron-LM's --tokenizer-type TikTokenizer.
TIKTOKEN_NUM_SPECIAL = 1000
TIKTOKEN_MAX_VOCAB = 2**17
# What megatron-core's tokenizer loaders raise on a malformed file (they assert a lot).
LOADER_ERRORS = (
    AssertionError,
    AttributeError,
    KeyError,
    OSError,
    RuntimeError,
    TypeError,
    ValueError,
)


class TokenizerError(ValueError):
    """A tokenizer could not be built from what was given (a config problem: exit 2)."""

    exit_code = CONFIG_ERROR


class TokenizerFileError(TokenizerError):
    """The tokenizer file is missing or unreadable (a data problem: exit 9)."""

    exit_code = DATA


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
    """A Hugging Face ``tokenizer.json`` (the file, or a directory holding it), read by the
    ``tokenizers`` library: megatron-core's HuggingFaceTokenizer needs transformers, and its
    defaults (use_fast, include_special_tokens) differ between megatron-core 0.16 and 0.19."""

    def __init__(
        self, path: str, eod_token: str | None = None, add_special_tokens: bool = True
    ) -> None:
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            what = "holds no tokenizer.json" if os.path.isdir(path) else "does not exist"
            raise TokenizerFileError(
                f"tokenizer path {path!r} {what} (give a tokenizer.json file or a local "
                "directory holding one)"
            )
        self.path = os.path.abspath(path)
        # True matches Megatron-LM's HuggingFaceTokenizer (e.g. Llama's BOS is kept).
        self.add_special_tokens = add_special_tokens
        self._backend = _load_tokenizer_json(file)
        vocab = self._backend.get_vocab(with_added_tokens=True)
        self.vocab_size: int = self._backend.get_vocab_size(with_added_tokens=True)
        self.eod: int = _find_eod(vocab, eod_token, None, self.path)
        self.pad: int = _find_pad(vocab, None, self.eod)

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
        return list(self._backend.encode(text, add_special_tokens=self.add_special_tokens).ids)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r})"


def _load_tokenizer_json(file: str) -> Any:
    from tokenizers import Tokenizer as RawTokenizer  # noqa: PLC0415 - only loaded when used

    try:
        return RawTokenizer.from_file(file)
    except Exception as err:  # noqa: BLE001 - the Rust loader raises its own Exception type
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise TokenizerFileError(
            f"{file}: not a tokenizers-library tokenizer.json ({reason})"
        ) from None


class MegatronLibraryTokenizer:
    """One of megatron-core's tokenizer libraries (``megatron.core.tokenizers``), with the
    eod/pad rules of this module so every kind behaves alike in the GPT datasets."""

    def __init__(self, library: str, path: str, **kwargs: Any) -> None:
        from megatron.core.tokenizers import MegatronTokenizer  # noqa: PLC0415 - slow import

        self.library = library
        self.path = os.path.abspath(path)
        self._kwargs = kwargs
        try:
            self._mt = MegatronTokenizer.from_pretrained(
                tokenizer_path=self.path, metadata_path={"library": library}, **kwargs
            )
        except LOADER_ERRORS as err:
            reason = " ".join(str(err).split()) or type(err).__name__
            raise TokenizerFileError(
                f"megatron-core's {library} tokenizer cannot load {path!r}: {reason}"
            ) from None
        self.vocab_size: int = int(self._mt.vocab_size)
        self.eod, self.pad = self._special_ids()

    def _special_ids(self) -> tuple[int, int]:
        eod, pad = self._mt.eod, self._mt.pad
        if self.library == "huggingface":
            # The rules of HFTokenizer, so both Hugging Face paths pick the same ids.
            vocab = self._mt._tokenizer.tokenizer.get_vocab()  # the transformers tokenizer
            eod = _find_eod(vocab, None, eod, self.path)
            return eod, _find_pad(vocab, pad, eod)
        if eod is None or not 0 <= eod < self.vocab_size:
            raise TokenizerError(
                f"{self.path}: this {self.library} tokenizer has no end-of-sentence token "
                f"(eos id {eod}); use one trained with an eos token"
            )
        # SentencePiece models often have no pad (id -1): pad == eod, which megatron-core
        # notices and then stops masking pad tokens, which is what we want.
        valid_pad = pad is not None and 0 <= pad < self.vocab_size
        return int(eod), int(pad) if valid_pad else int(eod)

    @property
    def backend(self) -> Any:
        """The library's own tokenizer that encodes the text: the ``tiktoken.Encoding``, the
        ``SentencePieceProcessor`` or the transformers tokenizer (for converters, e.g. the
        Hugging Face export)."""
        return self._mt._tokenizer.tokenizer

    @property
    def unique_identifiers(self) -> dict[str, Any]:
        return {
            "class": type(self).__name__,
            "library": self.library,
            "tokenizer_path": self.path,
            "vocab_size": self.vocab_size,
            "eod": self.eod,
            "pad": self.pad,
            **{k: str(v) for k, v in sorted(self._kwargs.items())},
        }

    def tokenize(self, text: str) -> list[int]:
        return [int(i) for i in self._mt.tokenize(text)]

    def detokenize(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        if self.library == "tiktoken":
            # megatron-core 0.16 decodes token by token and so splits multi-byte characters;
            # tiktoken's own decode (what 0.19 calls) joins the bytes first.
            return self._mt._tokenizer.tokenizer.decode(ids)
        return self._mt.detokenize(ids)

    def __repr__(self) -> str:
        return f"MegatronLibraryTokenizer({self.library!r}, {self.path!r})"


def _find_eod(vocab: dict[str, int], eod_token: str | None, eos_id: int | None, path: str) -> int:
    if eod_token is not None:
        if eod_token not in vocab:
            raise TokenizerError(f"eod_token {eod_token!r} is not in the vocabulary of {path!r}")
        return vocab[eod_token]
    for token in EOD_CANDIDATES:
        if token in vocab:
            return vocab[token]
    if eos_id is not None:
        return int(eos_id)
    raise TokenizerError(
        f"no end-of-document token in {path!r}: none of {list(EOD_CANDIDATES)} is in its "
        "vocabulary and it sets no eos_token; add one of them as a special token"
    )


def _find_pad(vocab: dict[str, int], pad_id: int | None, eod: int) -> int:
    if pad_id is not None:
        return int(pad_id)
    for token in PAD_CANDIDATES:
        if token in vocab:
            return vocab[token]
    # megatron-core notices pad == eod and stops masking pad tokens, which is what we want.
    return eod


def _require_library(kind: str) -> None:
    package, what = LIBRARY_PACKAGES[kind]
    if importlib.util.find_spec(package) is None:
        raise TokenizerError(
            f"tokenizer {kind!r} reads {what} through megatron-core, which needs the "
            f"`{package}` package: pip install {package}"
        )


def _tiktoken_vocab_size(path: str) -> int:
    """Megatron-LM's default vocab size, or the file's own when it is smaller (megatron-core
    asserts the two agree)."""
    try:
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)
    except (OSError, ValueError) as err:
        raise TokenizerFileError(f"{path}: not a megatron tiktoken vocabulary ({err})") from None
    if not isinstance(entries, list):
        raise TokenizerFileError(
            f"{path}: not a megatron tiktoken vocabulary (expected a JSON list of "
            '{"rank", "token_bytes", "token_str"} objects)'
        )
    return min(len(entries) + TIKTOKEN_NUM_SPECIAL, TIKTOKEN_MAX_VOCAB)


def _library_tokenizer(kind: str, path: str) -> Tokenizer:
    if kind == "huggingface":
        # Offline before transformers reads its settings; a local directory never needs the hub.
        os.environ["HF_HUB_OFFLINE"] = os.environ["TRANSFORMERS_OFFLINE"] = "1"
        _require_library(kind)
        # Pinned: megatron-core 0.16 and 0.19 default these differently (ids would differ).
        return MegatronLibraryTokenizer(kind, path, use_fast=True, include_special_tokens=True)
    if not os.path.isfile(path):
        raise TokenizerFileError(f"tokenizer {kind!r}: {path!r} is not a file")
    _require_library(kind)
    if kind == "sentencepiece":
        return MegatronLibraryTokenizer(kind, path)
    return MegatronLibraryTokenizer(
        kind,
        path,
        pattern="v2",
        num_special_tokens=TIKTOKEN_NUM_SPECIAL,
        vocab_size=_tiktoken_vocab_size(path),
    )


def build_tokenizer(kind: str, path: str | None = None, eod_token: str | None = None) -> Tokenizer:
    """The tokenizer of `kind` (see the module doc) from the local file or directory `path`.

    `eod_token` overrides the end-of-document token (huggingface tokenizer.json only).
    """
    if kind not in TOKENIZER_KINDS:
        raise TokenizerError(
            f"unknown tokenizer kind {kind!r}; expected one of {list(TOKENIZER_KINDS)}"
        )
    if kind == "byte":
        if path is not None:
            raise TokenizerError("tokenizer 'byte' reads no file; drop the tokenizer path")
        return ByteTokenizer()
    if not path:
        raise TokenizerError(f"tokenizer {kind!r} needs a tokenizer path ({TOKENIZER_FILES[kind]})")
    if not os.path.exists(path):
        raise TokenizerFileError(
            f"tokenizer path {path!r} does not exist ({TOKENIZER_FILES[kind]})"
        )
    if kind == "huggingface" and (
        os.path.isfile(path) or os.path.isfile(os.path.join(path, "tokenizer.json"))
    ):
        return HFTokenizer(path, eod_token=eod_token)
    if eod_token is not None:
        raise TokenizerError(f"eod_token is only supported for tokenizer.json, not {path!r}")
    return _library_tokenizer(kind, path)


def run_tokenizer(kind: str, path: str | None) -> Tokenizer:
    """A run's tokenizer (``data.tokenizer``, ``data.tokenizer_path``), built once per process:
    the restore planning needs its vocabulary before the Trainer builds the model with it.
    Keyed on the newest modification time of the file (or of a directory's files), so a
    replaced or rewritten file is read anew."""
    return _cached_tokenizer(kind, path, _newest_mtime(path))


def _newest_mtime(path: str | None) -> int | None:
    if not path or not os.path.exists(path):
        return None
    if not os.path.isdir(path):
        return os.stat(path).st_mtime_ns
    with os.scandir(path) as entries:
        return max([os.stat(path).st_mtime_ns, *(e.stat().st_mtime_ns for e in entries)])


@functools.lru_cache(maxsize=4)
def _cached_tokenizer(kind: str, path: str | None, stamp: int | None) -> Tokenizer:
    return build_tokenizer(kind, path)
