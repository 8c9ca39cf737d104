"""Make nvidia-resiliency-ext's straggler ``Detector`` run without CUDA (the only place that does).

Two things stand in its way on a CPU box:

* ``straggler.cupti`` imports ``nvrx_cupti_module``, a C++ extension linked against
  ``libcupti.so.12``; without the CUDA toolkit the import fails, and ``Detector.initialize``
  with it. A no-op profiler keeps section timing alive; kernel statistics stay empty, so the GPU
  scores are NaN, as they should be.
* Section timing reads ``time.perf_counter_ns``: wall time. In synchronous training a slow rank
  makes every peer wait for it inside collectives, so all ranks' steps take the same wall time
  and the straggler is invisible. On a GPU the kernel timings (CUPTI) carry the signal; on CPU
  the analogue is the process's CPU time, which a rank blocked in a gloo collective does not
  accumulate (measured: ~0 s CPU over a 2 s wait). The section clock of the straggler module
  alone is switched to CPU time.

``torch.cuda.synchronize`` (called by ``generate_report``) is already a no-op under
:mod:`pretrain.cpu_shim`.
"""

from __future__ import annotations

import logging
import sys
import time
import types
from typing import Any

log = logging.getLogger(__name__)
CUPTI_MODULE = "nvrx_cupti_module"


class NullCuptiProfiler:
    """Same interface as nvrx_cupti_module.CuptiProfiler; records nothing."""

    def __init__(self, **kwargs: Any) -> None:
        pass

    def initialize(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def get_stats(self) -> dict:
        return {}

    def reset(self) -> None:
        pass


def _cpu_clock() -> types.SimpleNamespace:
    return types.SimpleNamespace(perf_counter_ns=time.process_time_ns, monotonic=time.monotonic,
                                 time=time.time)


def install_cupti_stub() -> None:
    """Register the no-op profiler unless the real extension loads (idempotent)."""
    if CUPTI_MODULE in sys.modules:
        return
    try:
        __import__(CUPTI_MODULE)
        return
    except ImportError as exc:
        log.debug("straggler: %s unavailable (%s); CUDA kernel scores disabled", CUPTI_MODULE, exc)
    module = types.ModuleType(CUPTI_MODULE)
    module.CuptiProfiler = NullCuptiProfiler  # type: ignore[attr-defined]
    sys.modules[CUPTI_MODULE] = module


def install(device: str) -> None:
    """Prepare nvrx's straggler package for ``device`` ("cpu" patches; "cuda" leaves it alone)."""
    if device == "cuda":
        return
    install_cupti_stub()
    from pretrain.compat import nvrx_straggler

    detector_module = nvrx_straggler("straggler")

    detector_module.time = _cpu_clock()  # type: ignore[attr-defined]
