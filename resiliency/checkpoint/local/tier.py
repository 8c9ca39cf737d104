"""The fast tier: frequent node-local saves, replicated to peers on other nodes.

Restore order (collective): the newest local step that every rank can assemble from verified
copies (its own or a replica), if it is newer than the newest verified persistent step; else
the persistent tier. The local tier serves the same topology only. Local files use the
``dp_reshardable`` optimizer format: the fastest to write, and resharding is not needed here.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from pretrain.context import startup_clock
from recipes import ConfigError
from resiliency.checkpoint import rank_state as state_io
from resiliency.checkpoint.local.store import VerifiedLocalManager, node_rank, ranks_per_node
from resiliency.checkpoint.state_dict import sharded_training_state
from resiliency.storage.signing import key_from_env

if TYPE_CHECKING:
    from pretrain.train.view import TrainerView
    from recipes.config.checkpoint import LocalCheckpointConfig
    from resiliency.checkpoint.checkpointer import Checkpointer

log = logging.getLogger(__name__)
LOCAL_OPTIM_FORMAT = "dp_reshardable"
ALGO = "atomic"  # every rank keeps all of its own tensors: restore needs no peer but replicas


def node_dir(cfg: "LocalCheckpointConfig") -> Path:
    """On a real cluster ``dir`` is on node-local disk; the node subdir keeps simulated nodes
    on one machine apart and costs nothing on real ones."""
    assert cfg.dir is not None
    return Path(cfg.dir) / f"node-{node_rank():03d}"


def replication_strategy(cfg: "LocalCheckpointConfig", world_size: int) -> Any:
    """Clique replication across nodes (collective: every rank builds the same groups)."""
    if cfg.replication_factor == 1:
        return None
    # nvrx: loaded only where the feature runs
    from nvidia_resiliency_ext.checkpointing.local.replication.strategies import (
        CliqueReplicationStrategy,
    )

    jump = cfg.replication_jump or ranks_per_node(world_size)
    factor = cfg.replication_factor
    if world_size % (jump * factor):
        raise ConfigError(
            f"checkpoint.local.replication_factor={factor} with replication_jump={jump} (ranks "
            f"per node) needs a world size divisible by {jump * factor}, got {world_size}: each "
            "copy must land on a different node. Use more nodes, or replication_factor=1 "
            "(node-local only, lost with the node)."
        )
    return CliqueReplicationStrategy.from_replication_params(
        replication_jump=jump, replication_factor=factor
    )


def gather(value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def rank_state_object(data: Any) -> Any:
    """This rank's RNG streams as a per-rank sharded object: they differ between ranks, so
    they must not sit in the common state, which megatron checks for equality across ranks."""
    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    rank, world = dist.get_rank(), dist.get_world_size()
    return ShardedObject("rank_state", data, (world,), (rank,), replica_id=0)


class LocalTier:
    def __init__(
        self, cfg: "LocalCheckpointConfig", trainer: "TrainerView", checkpointer: "Checkpointer"
    ) -> None:
        self.cfg, self.trainer, self.checkpointer = cfg, trainer, checkpointer
        run, world = trainer.run, dist.get_world_size()
        signature = {
            "run_id": run.run_id,
            "world_size": world,
            "parallelism": run.parallel.layout(trainer.parts.plan.dp_size),
            "optim_format": LOCAL_OPTIM_FORMAT,
        }
        self.manager = VerifiedLocalManager(
            node_dir(cfg),
            run.run_id,
            signature,
            cfg.keep_last,
            replication_strategy(cfg, world),
            key_from_env(run.checkpoint.signing_key_env),
        )

    # ------------------------------------------------------------ restore
    def choose(self, persistent_step: int | None) -> int | None:
        """Collective: the local step to restore, or None to use the persistent tier."""
        problems = [p for p in gather(self.manager.signature_problem()) if p]
        if problems:
            self._info(
                "local tier skipped: %s; the local tier restores the same topology only",
                problems[0],
            )
            return None
        for step in sorted({s for s in gather(self.manager.failed_restore()) if s is not None}):
            self._info(
                "local step %d: a restore from it did not finish in an earlier attempt; "
                "not trying it again",
                step,
            )
            self.manager.reject_step(step, "its restore did not finish in an earlier attempt")
        latest = self.manager.find_latest()
        if latest < 0:
            self._info("local tier: no step that every rank can assemble from verified copies")
            return None
        if persistent_step is not None and latest <= persistent_step:
            self._info(
                "local tier: newest complete step %d is not newer than persistent step "
                "%d; restoring the persistent one",
                latest,
                persistent_step,
            )
            return None
        self._info(
            "local tier: step %d (every shard verified) is newer than persistent step %s; "
            "restoring it",
            latest,
            persistent_step,
        )
        return latest

    def restore(self, step: int) -> None:
        """Collective: load ``step`` (own files, missing shards from peers' replicas)."""
        self.manager.mark_restoring(step, self.checkpointer.attempt)
        self.checkpointer.faults.at_checkpoint("restore", step)
        source = self.copy_used(step)
        sources = gather(source)
        self._info(
            "local tier: step %d from %s",
            step,
            "; ".join(f"rank {r}: {text}" for r, text in enumerate(sources)),
        )
        started = time.perf_counter()
        tasd, _ = self.manager.load()
        sharded = sharded_training_state(
            self.trainer.parts,
            LOCAL_OPTIM_FORMAT,
            is_loading=True,
            with_optimizer=self.checkpointer.cfg.load_optimizer,
        )
        sharded["rank_state"] = rank_state_object(None)
        loaded = tasd.to_state_dict(sharded, algo=ALGO)
        startup_clock.mark("restore_read")
        self.checkpointer.apply_loaded(
            loaded,
            loaded["train_state"],
            loaded["rank_state"],
            f"local step {step} ({source})",
            restored=(step, "local"),
            started=started,
        )
        self.manager.clear_restoring()
        self._info("local tier: restored step %d in %.2f s", step, time.perf_counter() - started)

    def copy_used(self, step: int) -> str:
        """Which copy of this rank's shard ``step`` loads: its own, or a peer's replica (and on
        which node). From what ``choose`` gathered: every rank's verified local files."""
        rank, world = dist.get_rank(), dist.get_world_size()
        held = getattr(self.manager, "globally_available_ids", None) or []

        def holds(holder: int) -> bool:
            return any(i[0] == step and i[1] == rank for i in held[holder])

        per_node = ranks_per_node(world)
        if rank < len(held) and holds(rank):
            return f"own copy, {self.manager.rank_dir}"
        holders = [r for r in range(len(held)) if holds(r)]
        if not holders:
            return "no verified copy found"
        return f"replica held by rank {holders[0]} on node-{holders[0] // per_node:03d}"

    def discard_after(self, step: int) -> None:
        """Drop local files newer than the step training continues from (every rank)."""
        self.manager.discard_after(step)
        self.manager.clear_restoring()

    # --------------------------------------------------------------- save
    def save(self) -> None:
        """Collective, synchronous: write this rank's shard and the replicas it holds."""
        # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
        from megatron.core.dist_checkpointing.tensor_aware_state_dict import (
            MCoreTensorAwareStateDict,
        )

        step = self.trainer.state.step
        self.checkpointer.check_fence(f"local-tier save of step {step}")
        sharded = sharded_training_state(self.trainer.parts, LOCAL_OPTIM_FORMAT)
        sharded["train_state"] = self.checkpointer.trainer.state_dict()
        sharded["rank_state"] = rank_state_object(state_io.capture_rng(self.trainer.env.device))
        tasd, _ = MCoreTensorAwareStateDict.from_state_dict(sharded, algo=ALGO)
        self.manager.save(tasd, step, is_async=False)

    def _info(self, message: str, *args: Any) -> None:
        if dist.get_rank() == 0:
            log.info(message, *args)
