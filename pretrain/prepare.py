"""Tokenize a corpus into megatron's indexed format: ``{PREFIX}_text_document.bin/.idx``.

    python -m pretrain.prepare --input 'corpus/*.jsonl' --output-prefix data/mycorpus
    python -m pretrain.prepare --stdlib --output-prefix data/stdlib
    python -m pretrain.prepare --input 'docs/**/*.txt' --output-prefix data/docs \\
        --tokenizer huggingface --tokenizer-path tokenizers/llama3

Inputs ending in ``.jsonl`` hold one JSON object per line (text under ``--json-key``); any other
file is one plain-text document.
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import sys
import sysconfig
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy

from pretrain.tokenizer import TOKENIZER_KINDS, Tokenizer, TokenizerError, build_tokenizer

log = logging.getLogger(__name__)

DEFAULT_STDLIB_MAX_BYTES = 4 * 1024 * 1024
DEFAULT_LOG_INTERVAL = 1000
DOCUMENT_SUFFIX = "_text_document"  # Megatron-LM's preprocess_data.py naming for --json-keys text
# Tests, vendored/third-party code, demos and generated tables: not representative source code.
STDLIB_SKIP_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idle_test",
        "idlelib",
        "lib2to3",
        "turtledemo",
        "__pycache__",
        "__phello__",
        "pydoc_data",
        "encodings",
        "lib-dynload",
    }
)


class PrepareError(ValueError):
    """The corpus cannot be prepared as asked (bad input, missing files)."""


def dataset_prefix(output_prefix: str) -> str:
    """The prefix megatron's IndexedDataset (and data.paths) should be given for `output_prefix`."""
    return f"{output_prefix}{DOCUMENT_SUFFIX}"


def expand_inputs(patterns: Sequence[str]) -> list[str]:
    """Files matched by each pattern, sorted per pattern; every pattern must match a file."""
    files: list[str] = []
    seen: set[str] = set()
    for pattern in patterns:
        # An existing path is taken literally so names containing glob characters still work.
        if os.path.isfile(pattern):
            matches = [pattern]
        else:
            matches = sorted(glob.glob(pattern, recursive=True))
        matches = [m for m in matches if os.path.isfile(m)]
        if not matches:
            raise PrepareError(f"--input {pattern!r} matched no files")
        files.extend(m for m in matches if m not in seen)
        seen.update(matches)
    return files


def jsonl_documents(path: str, json_key: str = "text") -> Iterator[str]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if raw.strip():
                yield _jsonl_text(_utf8(raw, f"{path}:{lineno}"), json_key, f"{path}:{lineno}")


def _utf8(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise PrepareError(f"{where}: not valid UTF-8 ({err.reason} at byte {err.start})") from err


def _jsonl_text(line: str, json_key: str, where: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise PrepareError(f"{where}: invalid JSON ({err.msg})") from err
    if not isinstance(record, dict) or json_key not in record:
        raise PrepareError(f"{where}: no {json_key!r} key in this line (set --json-key)")
    text = record[json_key]
    if not isinstance(text, str):
        raise PrepareError(f"{where}: {json_key!r} is {type(text).__name__}, expected a string")
    return text


def text_document(path: str) -> str:
    # Bytes, not read_text(): no newline translation, so documents are the files verbatim.
    return _utf8(Path(path).read_bytes(), path)


def file_documents(paths: Iterable[str], json_key: str = "text") -> Iterator[str]:
    for path in paths:
        if path.endswith(".jsonl"):
            yield from jsonl_documents(path, json_key)
        else:
            yield text_document(path)


def stdlib_files() -> list[Path]:
    """This Python's standard-library .py files, in a fixed (sorted relative path) order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [
            d for d in dirnames if d not in STDLIB_SKIP_DIRS and not d.startswith("config-")
        ]
        files.extend(Path(dirpath, name) for name in filenames if name.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def stdlib_documents(max_bytes: int = DEFAULT_STDLIB_MAX_BYTES) -> Iterator[str]:
    """Standard-library sources, one file per document, in order, up to max_bytes in total.

    A file that would overflow the budget is skipped rather than ending the walk, so the corpus
    fills the budget closely instead of stopping short before one large module.
    """
    budget = max_bytes
    for path in stdlib_files():
        if path.stat().st_size > budget:
            continue
        # Bytes, not read_text(): no newline translation, so the corpus is the files verbatim.
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue  # a legacy-encoded file would only add mojibake
        budget -= len(raw)
        yield text


def prepare_corpus(
    documents: Iterable[str],
    output_prefix: str,
    tokenizer: Tokenizer,
    log_interval: int = DEFAULT_LOG_INTERVAL,
) -> tuple[int, int]:
    """Write `documents` (each followed by eod) to dataset_prefix(output_prefix).{bin,idx}.

    Returns (documents, tokens), eod included. Documents that tokenize to nothing are skipped.
    """
    from megatron.core.datasets.indexed_dataset import DType  # noqa: PLC0415 - slow import

    prefix = dataset_prefix(output_prefix)
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    tmp = f"{prefix}.tmp{os.getpid()}"
    # Same rule as Megatron-LM's preprocess_data.py, so readers infer the same dtype.
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    try:
        counts = _write_indexed(documents, tmp, tokenizer, dtype, log_interval)
        _publish(tmp, prefix)
    finally:
        for path in (f"{tmp}.bin", f"{tmp}.idx"):
            if os.path.exists(path):
                os.remove(path)
    return counts


def _write_indexed(
    documents: Iterable[str],
    tmp_prefix: str,
    tokenizer: Tokenizer,
    dtype: type[numpy.number],
    log_interval: int,
) -> tuple[int, int]:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder  # noqa: PLC0415

    builder = IndexedDatasetBuilder(f"{tmp_prefix}.bin", dtype=dtype)
    docs = tokens = 0
    start = time.monotonic()
    try:
        for text in documents:
            ids = tokenizer.tokenize(text)
            if not ids:
                continue
            ids.append(tokenizer.eod)
            builder.add_document(numpy.asarray(ids, dtype=dtype), [len(ids)])
            docs, tokens = docs + 1, tokens + len(ids)
            if docs % log_interval == 0:
                _log_progress(docs, tokens, start)
    finally:
        builder.data_file.close()  # also on error, so the temp file can be removed
    builder.finalize(f"{tmp_prefix}.idx")
    return docs, tokens


def _log_progress(docs: int, tokens: int, start: float) -> None:
    elapsed = max(time.monotonic() - start, 1e-9)
    log.info("%d documents, %d tokens (%.0f tokens/s)", docs, tokens, tokens / elapsed)


def _publish(tmp_prefix: str, prefix: str) -> None:
    # Drop the old .idx first: a kill between the renames then leaves a lone .bin (a loud
    # "missing .idx" on load) instead of a new .bin paired with a stale .idx.
    if os.path.exists(f"{prefix}.idx"):
        os.remove(f"{prefix}.idx")
    os.replace(f"{tmp_prefix}.bin", f"{prefix}.bin")
    os.replace(f"{tmp_prefix}.idx", f"{prefix}.idx")


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m pretrain.prepare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--input",
        action="append",
        metavar="FILE_OR_GLOB",
        help="input file or glob (repeatable); .jsonl or plain text",
    )
    source.add_argument(
        "--stdlib",
        action="store_true",
        help="use this Python's standard-library sources as the corpus",
    )
    parser.add_argument("--stdlib-max-bytes", type=int, default=DEFAULT_STDLIB_MAX_BYTES)
    parser.add_argument(
        "--output-prefix",
        required=True,
        help=f"writes PREFIX{DOCUMENT_SUFFIX}.bin/.idx (parent dirs are created)",
    )
    parser.add_argument("--tokenizer", choices=TOKENIZER_KINDS, default="byte")
    parser.add_argument("--tokenizer-path", help="local tokenizer directory (huggingface)")
    parser.add_argument("--json-key", default="text")
    parser.add_argument(
        "--log-interval",
        type=int,
        default=DEFAULT_LOG_INTERVAL,
        help="log progress every N documents",
    )
    args = parser.parse_args(argv)
    if args.stdlib_max_bytes <= 0 or args.log_interval <= 0:
        parser.error("--stdlib-max-bytes and --log-interval must be positive")
    return args


def _documents(args: argparse.Namespace) -> Iterable[str]:
    if args.stdlib:
        return stdlib_documents(args.stdlib_max_bytes)
    return file_documents(expand_inputs(args.input), args.json_key)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    # megatron-core's import announces missing GPU extras; irrelevant to tokenizing on a CPU.
    logging.getLogger("megatron").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex|pynvml)")
    args = _parse_args(argv)
    start = time.monotonic()
    try:
        tokenizer = build_tokenizer(args.tokenizer, args.tokenizer_path)
        docs, tokens = prepare_corpus(
            _documents(args), args.output_prefix, tokenizer, args.log_interval
        )
    except (PrepareError, TokenizerError) as err:
        raise SystemExit(f"pretrain.prepare: error: {err}") from None
    log.info(
        "wrote %s.{bin,idx}: %d documents, %d tokens in %.1fs",
        dataset_prefix(args.output_prefix),
        docs,
        tokens,
        time.monotonic() - start,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
