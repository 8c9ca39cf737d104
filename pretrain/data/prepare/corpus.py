"""Tokenize a corpus into megatron's indexed format, in the conventions of Megatron-LM's
tools/preprocess_data.py: PREFIX_<key>_document.bin/.idx for each --json-keys key
(PREFIX_text_document by default), written with megatron-core's IndexedDatasetBuilder.

    python -m pretrain.data.prepare --stdlib --output-prefix data/stdlib
    python -m pretrain.data.prepare --input 'corpus/*.jsonl' --output-prefix data/mine \\
        --json-keys text title --workers 8 \\
        --tokenizer huggingface --tokenizer-path tokenizers/llama3
    python -m pretrain.data.prepare --input 'docs/**/*.txt' --output-prefix data/docs \\
        --tokenizer sentencepiece --tokenizer-path tokenizer.model
    python -m pretrain.data.prepare --stdlib --output-prefix data/stdlib-bpe \\
        --train-tokenizer 8192 --tokenizer-path tokenizers/stdlib-bpe  # train, then tokenize

Inputs ending in .json or .jsonl (also .json.gz, .jsonl.gz) are loose JSON: one object per
line, each key a string or a list of strings (one sequence each). Any other file is one
plain-text document (key "text"). Tokenizers are local files only; nothing is downloaded.

Exit codes: 0 done; 2 bad command line or tokenizer choice; 9 bad or missing input data or
tokenizer file; 130 interrupted. Existing outputs are replaced only when a run succeeds.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import sys
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from pretrain.data.prepare.bpe import MIN_VOCAB, texts_of, train_bpe
from pretrain.data.prepare.encode import Encoded, Encoder, Progress, encode_items, want_bar
from pretrain.data.prepare.inputs import (
    DEFAULT_STDLIB_MAX_BYTES,
    STDLIB_SKIP_DIRS,
    TEXT_KEY,
    Item,
    PrepareConfigError,
    PrepareError,
    check_keys,
    expand_inputs,
    file_documents,
    file_items,
    input_bytes,
    stdlib_documents,
    stdlib_files,
    text_document,
)
from pretrain.data.tokenizer import (
    TOKENIZER_FILES,
    TOKENIZER_KINDS,
    Tokenizer,
    TokenizerError,
    build_tokenizer,
)

__all__ = [
    "DEFAULT_STDLIB_MAX_BYTES",
    "STDLIB_SKIP_DIRS",
    "PrepareConfigError",
    "PrepareError",
    "dataset_prefix",
    "expand_inputs",
    "file_documents",
    "main",
    "prepare_corpus",
    "prepare_items",
    "stdlib_documents",
    "stdlib_files",
    "text_document",
]

log = logging.getLogger("pretrain.data.prepare")  # also when run as __main__

DEFAULT_LOG_INTERVAL = 1000
DOCUMENT_SUFFIX = "_text_document"  # Megatron-LM's preprocess_data.py naming for --json-keys text


def dataset_prefix(output_prefix: str, key: str = TEXT_KEY) -> str:
    """The prefix megatron's IndexedDataset (and data.paths) should be given for `output_prefix`."""
    return f"{output_prefix}_{key}_document"


def prepare_corpus(
    documents: Iterable[str],
    output_prefix: str,
    tokenizer: Tokenizer,
    log_interval: int = DEFAULT_LOG_INTERVAL,
    *,
    append_eod: bool = True,
    workers: int = 1,
) -> tuple[int, int]:
    """Write `documents` (each followed by eod) to dataset_prefix(output_prefix).{bin,idx}.

    Returns (documents, tokens), eod included. Documents that tokenize to nothing are skipped.
    """
    items = (Item(f"document {i}", doc) for i, doc in enumerate(documents, start=1))
    progress = Progress(None, log_interval)
    counts = prepare_items(
        items, output_prefix, tokenizer, (TEXT_KEY,), append_eod, workers, progress
    )
    return counts[TEXT_KEY]


def prepare_items(
    items: Iterable[Item],
    output_prefix: str,
    tokenizer: Tokenizer,
    keys: Sequence[str],
    append_eod: bool,
    workers: int,
    progress: Progress,
) -> dict[str, tuple[int, int]]:
    """Tokenize `items` into one indexed dataset per key; {key: (documents, tokens)}.

    An item whose every key tokenizes to nothing is skipped, so the datasets of several keys
    keep one document per item, in the same order.
    """
    encoder = Encoder(tokenizer, tuple(keys), append_eod)
    prefixes = {key: dataset_prefix(output_prefix, key) for key in keys}
    tmp = {key: f"{prefix}.tmp{os.getpid()}" for key, prefix in prefixes.items()}
    _make_parent(prefixes[keys[0]])
    done = False
    stream = encode_items(encoder, items, workers)
    try:
        counts = _write_indexed(stream, tmp, tokenizer, progress)
        for key, prefix in prefixes.items():
            _publish(tmp[key], prefix)
        done = True
    except OSError as err:  # inputs' OSErrors are PrepareErrors by now: this is the output
        raise PrepareConfigError(
            f"cannot write {output_prefix}_*: {err.strerror or err}; choose a writable "
            "--output-prefix with free space"
        ) from None
    finally:
        stream.close()  # stops the worker pool now, also on error
        progress.close(done)
        for path in (f"{t}{ext}" for t in tmp.values() for ext in (".bin", ".idx")):
            if os.path.exists(path):
                os.remove(path)
    return counts


def _make_parent(prefix: str) -> None:
    parent = os.path.dirname(os.path.abspath(prefix))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as err:
        raise PrepareConfigError(
            f"cannot create the output directory {parent!r}: {err.strerror or err}"
        ) from None


def _write_indexed(
    encoded: Iterator[Encoded],
    tmp: dict[str, str],
    tokenizer: Tokenizer,
    progress: Progress,
) -> dict[str, tuple[int, int]]:
    # The first item is tokenized before megatron-core is imported (seconds, and torch): bad
    # input fails fast, and the worker pool forks from a process without torch in it.
    first = next(encoded, None)
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder  # noqa: PLC0415

    # Same rule as Megatron-LM's preprocess_data.py, so readers infer the same dtype.
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    builders = {key: IndexedDatasetBuilder(f"{t}.bin", dtype=dtype) for key, t in tmp.items()}
    counts = {key: [0, 0] for key in tmp}
    progress.restart()  # rates from here: not counting megatron-core's import
    try:
        for item in itertools.chain([] if first is None else [first], encoded):
            progress.update(item)
            if item.empty:
                continue
            for (key, builder), ids, lengths in zip(builders.items(), item.ids, item.lengths):
                builder.add_document(ids, lengths)
                counts[key][0] += 1
                counts[key][1] += len(ids)
    finally:
        for builder in builders.values():
            builder.data_file.close()  # also on error, so the temp file can be removed
    for key, builder in builders.items():
        builder.finalize(f"{tmp[key]}.idx")
    return {key: (docs, tokens) for key, (docs, tokens) in counts.items()}


def _publish(tmp_prefix: str, prefix: str) -> None:
    # Drop the old .idx first: a kill between the renames then leaves a lone .bin (a loud
    # "missing .idx" on load) instead of a new .bin paired with a stale .idx.
    if os.path.exists(f"{prefix}.idx"):
        os.remove(f"{prefix}.idx")
    os.replace(f"{tmp_prefix}.bin", f"{prefix}.bin")
    os.replace(f"{tmp_prefix}.idx", f"{prefix}.idx")


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m pretrain.data.prepare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--input",
        action="append",
        metavar="FILE_OR_GLOB",
        help="input file or glob (repeatable): loose JSON (.json/.jsonl[.gz]) or plain text",
    )
    source.add_argument(
        "--stdlib",
        action="store_true",
        help="use this Python's standard-library sources as the corpus",
    )
    parser.add_argument(
        "--stdlib-max-bytes",
        type=int,
        default=DEFAULT_STDLIB_MAX_BYTES,
        help="--stdlib corpus size in bytes (default: %(default)s)",
    )
    parser.add_argument(
        "--output-prefix",
        required=True,
        help="writes PREFIX_<key>_document.bin/.idx per key (parent dirs are created)",
    )
    _add_processing_args(parser)
    args = parser.parse_args(argv)
    if args.stdlib_max_bytes <= 0 or args.log_interval <= 0 or args.workers <= 0:
        parser.error("--stdlib-max-bytes, --log-interval and --workers must be positive")
    keys = args.json_keys
    if len(set(keys)) != len(keys) or any(not k or "/" in k or os.sep in k for k in keys):
        parser.error(f"--json-keys {' '.join(keys)}: keys must be distinct names without '/'")
    if args.stdlib and keys != [TEXT_KEY]:
        parser.error("--stdlib documents have the key 'text' only; drop --json-keys")
    if args.train_tokenizer is not None:
        if args.train_tokenizer < MIN_VOCAB or not args.tokenizer_path:
            parser.error(
                f"--train-tokenizer VOCAB needs VOCAB >= {MIN_VOCAB} and --tokenizer-path DIR "
                "(where tokenizer.json is written)"
            )
        if args.tokenizer not in ("byte", "huggingface"):
            parser.error("--train-tokenizer trains a huggingface tokenizer; drop --tokenizer")
        args.tokenizer = "huggingface"
    return args


def _add_processing_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json-keys",
        "--json-key",
        nargs="+",
        default=[TEXT_KEY],
        metavar="KEY",
        help="loose-JSON keys to tokenize, one output dataset each (default: text)",
    )
    parser.add_argument(
        "--append-eod",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="end each document with the tokenizer's end-of-document token, as GPT training "
        "needs (default: on; Megatron-LM's preprocess_data.py needs the flag)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="tokenizing processes; the output is identical for any number (default: 1)",
    )
    parser.add_argument(
        "--tokenizer",
        choices=TOKENIZER_KINDS,
        default="byte",
        help="as data.tokenizer in the training config (default: byte)",
    )
    parser.add_argument(
        "--tokenizer-path",
        "--tokenizer-model",
        help="local tokenizer file or directory: "
        + "; ".join(f"{kind}: {what}" for kind, what in TOKENIZER_FILES.items()),
    )
    parser.add_argument(
        "--train-tokenizer",
        type=int,
        metavar="VOCAB",
        help="first train a byte-level BPE tokenizer of VOCAB ids on the input and save it as "
        "TOKENIZER_PATH/tokenizer.json (then tokenize with it; implies --tokenizer huggingface)",
    )
    parser.add_argument(
        "--log-interval",
        type=int,
        default=DEFAULT_LOG_INTERVAL,
        help="report progress every N documents (a bar instead on a terminal)",
    )


def _items(args: argparse.Namespace) -> tuple[Iterable[Item], int | None]:
    """The input's documents (a fresh iterator each call) and their size for progress."""
    if args.stdlib:
        docs = stdlib_documents(args.stdlib_max_bytes)
        items = (Item(f"stdlib document {i}", d) for i, d in enumerate(docs, 1))
        return items, args.stdlib_max_bytes
    paths = expand_inputs(args.input)
    check_keys(paths, args.json_keys)
    return file_items(paths), input_bytes(paths)


def _run(args: argparse.Namespace) -> dict[str, tuple[int, int]]:
    items, total = _items(args)
    if args.train_tokenizer is not None:
        path = train_bpe(
            texts_of(items, args.json_keys), args.train_tokenizer, Path(args.tokenizer_path)
        )
        log.info("trained a %d-id byte-level BPE tokenizer: %s", args.train_tokenizer, path)
        items, total = _items(args)  # tokenized with it from the start
    tokenizer = build_tokenizer(args.tokenizer, args.tokenizer_path)
    progress = Progress(total, args.log_interval, bar=want_bar())
    return prepare_items(
        items,
        args.output_prefix,
        tokenizer,
        args.json_keys,
        args.append_eod,
        args.workers,
        progress,
    )


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    # megatron-core's import announces missing GPU extras; irrelevant to tokenizing on a CPU.
    logging.getLogger("megatron").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex|pynvml)")
    args = _parse_args(argv)
    start = time.monotonic()
    try:
        counts = _run(args)
    except (PrepareError, TokenizerError) as err:
        # One line, no traceback: the message names the file, line or flag to fix.
        print(f"pretrain.data.prepare: error: {' '.join(str(err).split())}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("pretrain.data.prepare: interrupted; no output was replaced", file=sys.stderr)
        return 130
    for key, (docs, tokens) in counts.items():
        log.info(
            "wrote %s.{bin,idx}: %d documents, %d tokens",
            dataset_prefix(args.output_prefix, key),
            docs,
            tokens,
        )
    log.info("done in %.1fs", time.monotonic() - start)
    return 0

