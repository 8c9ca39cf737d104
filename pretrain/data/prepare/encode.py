"""Tokenizing items for `pretrain.data.prepare`, in this process or a pool of workers, in input order,
with progress on stderr (a tqdm bar on a terminal, else a log line every N documents)."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any

import numpy

from pretrain.data.prepare.inputs import Item, item_texts
from pretrain.data.tokenizer import Tokenizer

log = logging.getLogger("pretrain.data.prepare")

CHUNK_ITEMS = 64  # items per task sent to a worker: amortizes the pickling round trip
IN_FLIGHT_PER_WORKER = 4  # tasks queued per worker: keeps workers busy, bounds memory


@dataclass(frozen=True)
class Encoded:
    """One item's output: per key, the token ids and the length of each of its sequences."""

    ids: list[numpy.ndarray]
    lengths: list[list[int]]
    nbytes: int

    @property
    def empty(self) -> bool:
        return not any(len(ids) for ids in self.ids)


@dataclass(frozen=True)
class Encoder:
    tokenizer: Tokenizer
    keys: tuple[str, ...]
    append_eod: bool

    def encode(self, item: Item) -> Encoded:
        ids: list[numpy.ndarray] = []
        lengths: list[list[int]] = []
        for sequences in item_texts(item, self.keys):
            doc: list[int] = []
            lens: list[int] = []
            for text in sequences:
                seq = self.tokenizer.tokenize(text)
                if seq:
                    doc.extend(seq)
                    lens.append(len(seq))
            # As Megatron-LM: the eod closes the document's last sequence; empty stays empty.
            if doc and self.append_eod:
                doc.append(self.tokenizer.eod)
                lens[-1] += 1
            # int32 holds any vocabulary; the writer narrows to megatron's dtype.
            ids.append(numpy.asarray(doc, dtype=numpy.int32))
            lengths.append(lens)
        return Encoded(ids, lengths, item.nbytes)

    def encode_chunk(self, chunk: list[Item]) -> list[Encoded]:
        return [self.encode(item) for item in chunk]


# The encoder a forked worker inherits: the tokenizer is not rebuilt or pickled per worker.
_WORKER_ENCODER: Encoder | None = None


def _worker_init() -> None:
    # Ctrl-C reaches the whole process group: the parent handles it and stops the pool, so
    # the workers must not each print a KeyboardInterrupt traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _worker_encode_chunk(chunk: list[Item]) -> list[Encoded]:
    assert _WORKER_ENCODER is not None, "pool started without an encoder"
    return _WORKER_ENCODER.encode_chunk(chunk)


def encode_items(encoder: Encoder, items: Iterable[Item], workers: int) -> Iterator[Encoded]:
    """`encoder.encode` of each item, in input order, on `workers` processes."""
    if workers <= 1:
        yield from map(encoder.encode, items)
        return
    global _WORKER_ENCODER  # handed to forked workers, see above
    # fork: workers inherit the built tokenizer. The tokenizers library would warn (and
    # serialize) after a fork once its own thread pool ran; we never use it in the parent.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _WORKER_ENCODER = encoder
    try:
        with multiprocessing.get_context("fork").Pool(workers, _worker_init) as pool:
            yield from _ordered(pool, iter(items), workers)
            # Let the workers see the end and exit: the with-block's terminate() SIGTERMs them,
            # and one killed holding the task queue's lock leaves its peers (and join) waiting.
            pool.close()
            pool.join()
    finally:
        _WORKER_ENCODER = None


def _ordered(pool: Any, items: Iterator[Item], workers: int) -> Iterator[Encoded]:
    # apply_async with a bounded queue, not imap: imap reads the whole input ahead into memory.
    pending: deque[Any] = deque()
    while chunk := list(islice(items, CHUNK_ITEMS)):
        pending.append(pool.apply_async(_worker_encode_chunk, (chunk,)))
        if len(pending) >= IN_FLIGHT_PER_WORKER * workers:
            yield from pending.popleft().get()
    while pending:
        yield from pending.popleft().get()


class Progress:
    """Documents, input MB and tokens so far: a tqdm bar on a terminal, else log lines."""

    def __init__(self, total_bytes: int | None, log_interval: int, bar: bool = False) -> None:
        self.docs = self.nbytes = self.tokens = 0
        self.total_bytes = total_bytes
        self.log_interval = log_interval
        self.start = time.monotonic()
        self._want_bar = bar
        self._bar: Any = None

    def restart(self) -> None:
        """Rates from now on; the bar appears now (after the slow imports, not before)."""
        self.start = time.monotonic()
        if self._want_bar and self._bar is None:
            self._bar = _tqdm_bar(self.total_bytes)

    def update(self, encoded: Encoded) -> None:
        self.docs += 1
        self.nbytes += encoded.nbytes
        self.tokens += sum(len(ids) for ids in encoded.ids)
        if self._bar is not None:
            self._bar.update(encoded.nbytes)
            if self.docs % self.log_interval == 0:
                self._bar.set_postfix_str(f"{self.docs} docs, {self.tokens} tokens", False)
        elif self.docs % self.log_interval == 0:
            log.info("%s", self.line())

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        mb = self.nbytes / 1e6
        done = f" of {self.total_bytes / 1e6:.1f}" if self.total_bytes else ""
        return (
            f"{self.docs} documents ({self.docs / elapsed:.0f}/s), {mb:.1f}{done} MB "
            f"({mb / elapsed:.2f} MB/s), {self.tokens} tokens"
        )

    def close(self, done: bool = False) -> None:
        if self._bar is not None:
            if done and self._bar.total:
                self._bar.update(self._bar.total - self._bar.n)  # bytes of skipped blank lines
            self._bar.close()


def _tqdm_bar(total_bytes: int | None) -> Any:
    try:
        from tqdm import tqdm  # noqa: PLC0415 - optional: log lines without it
    except ImportError:
        return None
    tqdm.monitor_interval = 0  # no monitor thread: the worker pool may fork after this
    return tqdm(
        total=total_bytes,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="tokenizing",
        file=sys.stderr,
        dynamic_ncols=True,
    )


def want_bar() -> bool:
    """A bar only on an interactive terminal: in logs and pipes its redraws are noise."""
    try:
        return sys.stderr.isatty() and os.get_terminal_size(sys.stderr.fileno()).columns >= 40
    except (OSError, ValueError):  # no terminal, or a closed/replaced stderr
        return False
