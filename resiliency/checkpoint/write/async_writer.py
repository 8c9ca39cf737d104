"""A long-lived, low-priority writer process per rank for async checkpoint saves.

megatron's default async save forks the training process for every save. Until the writers
finish, each page training touches is copied on write (measured: steps 1.6-2x slower while a
1.5 GiB state is written, and niced writers did not help). Here the state is already a copy in
shared-memory staging buffers (see staging.py), so a process spawned once per rank can write
it: training keeps its own pages, and the writer runs at nice 19 so it mostly takes CPU that
training leaves idle. megatron's own persistent caller does not fit: it moves live tensors to
shared memory (later in-place updates leaked into the checkpoint in our measurements) and
needs CUDA in the worker.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import queue
import signal
from typing import Any

from megatron.core.dist_checkpointing.strategies.async_utils import (
    AsyncCaller,
    AsyncCallsQueue,
    AsyncRequest,
)

from pretrain.context import exit_codes
from pretrain.context.failures import ClassifiedError
from resiliency.checkpoint.write.writer_process import WRITER_IGNORES, writer_main

POLL_S = 0.05


class WriterDied(ClassifiedError):
    """The writer process exited before reporting the save it was given: killed from outside
    (the host's OOM killer, an operator), not a fault of the storage or of the run's code, so
    retried from the last published step like a lost peer."""

    kind, exit_code, retryable = "infrastructure", exit_codes.INFRASTRUCTURE, True


class SpawnedWriter(AsyncCaller):
    """megatron AsyncCaller backed by one spawned writer process, started on first use."""

    def __init__(self, checksum_queue: Any) -> None:
        ctx = mp.get_context("spawn")
        self._ctx, self._checksum_queue = ctx, checksum_queue
        self._requests, self._done = ctx.Queue(), ctx.Queue()
        self.process: Any = None
        self._in_flight: int | None = None

    def start(self) -> None:
        """Spawn the writer now (idempotent): its start-up (a fresh interpreter importing torch
        and megatron-core, seconds) then overlaps the run's restore and first steps; started
        lazily, the first save of every attempt waited for it."""
        if self.process is not None:
            return
        # Not a daemon: megatron's write function forks its writer processes from here.
        self.process = self._ctx.Process(
            target=writer_main,
            name="checkpoint-writer",
            args=(self._requests, self._done, self._checksum_queue, os.getpid()),
        )
        # The writer ignores these signals (writer_process.die_with_parent), but only once its
        # start-up imports are done: a Ctrl-C or Slurm's SIGTERM in those seconds killed it
        # mid-import, failing the emergency save. Blocked here, they stay blocked across the
        # spawn until the writer ignores them (CPython's resource_tracker does the same); the
        # rank's own copies are delivered when its mask is restored.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, WRITER_IGNORES)
        try:
            self.process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        # A rank leaving on an error must not wait for (or keep) its writer; normal exits
        # close the queue first, which waits for the last save.
        atexit.register(self.close, abort=True)

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        if async_req.async_fn is None:
            return
        self.start()
        args = list(async_req.async_fn_args)
        if async_req.preload_fn is not None:
            # The write buckets (argument 1, as megatron's own callers do); every tensor in
            # them is a host staging buffer already, so this copies nothing.
            args[1] = async_req.preload_fn()
        self._requests.put(
            (async_req.call_idx, async_req.async_fn, args, dict(async_req.async_fn_kwargs or {}))
        )
        self._in_flight = async_req.call_idx

    def _local_done(self, blocking: bool) -> bool:
        while self._in_flight is not None:
            try:
                call_idx, error = (
                    self._done.get(timeout=POLL_S) if blocking else self._done.get_nowait()
                )
            except queue.Empty:
                if not self.process.is_alive():
                    raise WriterDied(
                        f"checkpoint writer process exited with code "
                        f"{self.process.exitcode} during save call "
                        f"{self._in_flight}"
                    ) from None
                if not blocking:
                    return False
                continue
            if error is not None:
                # Write errors come back through megatron's results queue (raised at
                # finalize); anything else failed the writer itself.
                raise RuntimeError(f"checkpoint writer failed: {error}")
            if call_idx == self._in_flight:
                self._in_flight = None
        return True

    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        done = self._local_done(blocking)
        return done if no_dist else self.sync_all_async_calls(not done)

    def close(self, abort: bool = False) -> None:
        if self.process is None:
            return
        if abort or not self.process.is_alive():
            self.process.kill()
        else:
            self._requests.put(None)
            self.process.join(timeout=60)
            if self.process.is_alive():
                self.process.kill()
        self.process.join()
        # A request the writer never read (it died first: killed, or the launcher's SIGTERM
        # before it could ignore it) is stuck in the queue's feeder thread, which multiprocessing
        # joins at interpreter exit: the rank would hang until the launcher's SIGKILL (30 s
        # under torchrun). Nothing reads it now, so drop it.
        self._requests.cancel_join_thread()
        self.process = None

    def __del__(self) -> None:
        try:
            self.close(abort=True)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class SpawnedWriterQueue(AsyncCallsQueue):
    """megatron's AsyncCallsQueue (same finalize protocol) with one SpawnedWriter per rank."""

    def __init__(self, checksum_queue: Any) -> None:
        super().__init__(persistent=False)
        self.writer = SpawnedWriter(checksum_queue)

    def _get_async_caller(self) -> SpawnedWriter:
        return self.writer

    def close(self, abort: bool = False) -> None:
        try:
            super().close(abort=abort)
        finally:
            self.writer.close(abort=abort)
