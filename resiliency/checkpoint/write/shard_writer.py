"""megatron's shard write function, run on threads of the calling process instead of forks.

megatron-core writes each rank's write buckets from processes it forks for every save. Forking a
rank that holds GiBs of model, optimizer and staging memory copies its page tables, and every
page the rank writes afterwards takes a copy-on-write fault: measured on a 1.5 GiB state, the
next save's state dict and staging took 0.27 + 0.09 s after forked writes and 0.10 + 0.03 s
without. The bytes themselves are written by the same megatron function
(``FileSystemWriterAsync.write_preloaded_data``), so the files are the same; the write syscalls
release the GIL, so threads write in parallel as the processes did.

torch.save's zip CRC-32 of every record is skipped while the writers run: the writers already
crc32c every byte on its way to the kernel (checksum.py) and restores verify those checksums,
so it was a second pass over the data (~0.13 s per 490 MiB on this machine's cores).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from pretrain.platform.compat import route_shard_writer_open
from resiliency.storage.checksum import WriterChecksums

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _without_zip_crc() -> Iterator[None]:
    if not hasattr(torch.serialization, "set_crc32_options"):  # older torch: nothing to skip
        yield
        return
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


def write_buckets_on_threads(
    transform_list: list[Any],
    use_msc: bool,
    rank: int,
    write_buckets: list[Any],
    results_queue: Any,
) -> None:
    """Drop-in for megatron 0.16's ``FileSystemWriterAsync.write_preloaded_data_multiproc``:
    same arguments, same result on ``results_queue`` ({bucket index: write results} or the
    first exception)."""
    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    local: queue.Queue = queue.Queue()
    # megatron's per-bucket writer takes one item off this queue and marks it done when it
    # finishes, as it does with its JoinableQueue.
    pending: queue.Queue = queue.Queue()
    kwargs = {"use_msc": True} if use_msc else {}
    threads = []
    for idx, bucket in enumerate(write_buckets):
        pending.put(idx)
        threads.append(
            threading.Thread(
                target=_write_without_zip_crc,
                name=f"shard-writer-{idx}",
                args=(
                    FileSystemWriterAsync.write_preloaded_data,
                    transform_list,
                    idx,
                    bucket,
                    local,
                    pending,
                    True,
                ),
                kwargs=kwargs,
            )
        )
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    results: dict[int, Any] = {}
    while not local.empty():
        idx, outcome = local.get()
        if isinstance(outcome, BaseException):
            log.error("rank %d: shard writer %d failed: %s", rank, idx, outcome)
            results_queue.put(outcome)
            return
        results[idx] = outcome
    if len(results) != len(write_buckets):
        results_queue.put(
            RuntimeError(f"shard writers reported {len(results)} of {len(write_buckets)} buckets")
        )
        return
    results_queue.put(results)


def _write_without_zip_crc(write_fn: Callable, *args: Any, **kwargs: Any) -> None:
    # torch's serialization config is per thread: this covers the calling thread's writes (and
    # the threads of write_buckets_on_threads, each of which starts here).
    with _without_zip_crc():
        write_fn(*args, **kwargs)


def _in_process_writer(fn: Any) -> Callable | None:
    """The in-process equivalent of a megatron write function, or None if it is unknown."""
    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    if not isinstance(fn, functools.partial):
        return None
    if fn.func is getattr(FileSystemWriterAsync, "write_preloaded_data_multiproc", None):
        return write_buckets_on_threads  # 0.16: a fork per bucket
    # 0.19 (and nvrx 0.7's writer it uses) write on threads already.
    if getattr(fn.func, "__name__", "") == "write_preloaded_data_multithread":
        return fn.func
    return None


def in_process_writes(request: Any) -> Any:
    """The megatron AsyncRequest with its write function run in the calling process, on
    threads, without torch.save's zip CRC-32; a request whose write function is something else
    (another release, another strategy) is returned as it is."""
    if request is None or request.async_fn is None:
        return request
    writer = _in_process_writer(request.async_fn)
    if writer is None:
        log.debug("shard writes: %r is not a known megatron writer; left as is", request.async_fn)
        return request
    fn = request.async_fn
    return request._replace(
        async_fn=functools.partial(_write_without_zip_crc, writer, *fn.args, **fn.keywords)
    )


_WRITER_CHECKSUMS: WriterChecksums | None = None


def install_writer_checksums(reports: Any = None) -> WriterChecksums:
    """Installed as the ``open`` that megatron's filesystem_async module resolves when a writer
    opens a shard file (in this process and the writers it forks); a megatron version that opens
    files some other way just reports nothing, and the commit falls back to reading files back.
    ``reports``: the queue of the rank that owns this (spawned) writer process."""
    global _WRITER_CHECKSUMS
    if _WRITER_CHECKSUMS is None:
        _WRITER_CHECKSUMS = WriterChecksums(reports)
        route_shard_writer_open(_WRITER_CHECKSUMS.open)
    return _WRITER_CHECKSUMS


def writer_checksums() -> WriterChecksums:
    """One per process: megatron's shard writers hash what they write (see checksum.py)."""
    return install_writer_checksums()
