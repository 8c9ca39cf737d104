"""Device detection and process-group setup (NCCL on CUDA, gloo + the CPU shim elsewhere)."""

from __future__ import annotations

import datetime
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pretrain.context import startup_clock
from pretrain.platform import compat, cpu_shim
from recipes.config.parallel import ParallelConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: str  # "cpu" | "cuda"

    @property
    def torch_device(self) -> torch.device:
        return (
            torch.device("cuda", self.local_rank) if self.device == "cuda" else torch.device("cpu")
        )


def launch_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun/ft_launcher's environment."""
    return (
        int(os.environ.get("RANK", "0")),
        int(os.environ.get("WORLD_SIZE", "1")),
        int(os.environ.get("LOCAL_RANK", "0")),
    )


def init_distributed(device: str, timeout_s: float = 600.0) -> DistEnv:
    rank, world_size, local_rank = launch_env()
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        backend = "nccl"
    else:
        applied = cpu_shim.apply()
        log.debug("CPU shim patches: %s", applied)
        backend = "gloo"
    log.debug("megatron-core compat fixes: %s", compat.apply())
    # The shim and the fixes import most of megatron-core: the imports end here, not at the
    # trainer's import, so the process group's phase is the rendezvous alone.
    startup_clock.mark("imports")
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
        )
    return DistEnv(rank, world_size, local_rank, device)


def init_model_parallel(par: ParallelConfig) -> None:
    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        virtual_pipeline_model_parallel_size=par.vpp,
        context_parallel_size=par.cp,
        expert_model_parallel_size=par.ep,
    )


def shutdown() -> None:
    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    from megatron.core import parallel_state

    if dist.is_initialized():
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def broadcast_object(value: Any, src: int = 0) -> Any:
    """``value`` from rank ``src`` on every rank (collective)."""
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def probe_ranks(timeout_s: float) -> dict[str, Any]:
    """One timed all-gather over every rank (collective): each rank's usable CPUs, and how
    long the group took to answer. TimeoutError (infrastructure: retried, the node is
    suspect) when a peer does not answer in ``timeout_s``."""
    world = dist.get_world_size()
    mine = torch.tensor([len(os.sched_getaffinity(0))], dtype=torch.int64)
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        mine = mine.cuda()
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    start = time.perf_counter()
    work = dist.all_gather(gathered, mine, async_op=True)
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise TimeoutError(
            f"health: an all-gather over {world} ranks did not finish in {timeout_s:g} s "
            f"(resiliency.health.allreduce_timeout_s): {exc}"
        ) from exc
    return {
        "allgather_s": round(time.perf_counter() - start, 4),
        "cpus_per_rank": [int(t.item()) for t in gathered],
    }
