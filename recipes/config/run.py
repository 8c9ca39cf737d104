"""A whole run: every concern's section, and the checks that need two of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from recipes.checks import require
from recipes.config.checkpoint import CheckpointConfig
from recipes.config.data import DataConfig
from recipes.config.launch import LaunchConfig
from recipes.config.logging import LoggingConfig
from recipes.config.model import ModelConfig
from recipes.config.optim import OptimizerConfig, SchedulerConfig
from recipes.config.parallel import ParallelConfig
from recipes.config.perf import PerfConfig
from recipes.config.resiliency import ResiliencyConfig
from recipes.config.train import TrainConfig


@dataclass(kw_only=True)
class RunConfig:
    # None: each launch starts a new run, named by recipes.validate.resolve_run_id; continuing a
    # run needs its run_id (README "Resume").
    run_id: Optional[str] = None
    output_dir: str = "runs"  # where run dirs live: <output_dir>/<run_id>
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    resiliency: ResiliencyConfig = field(default_factory=ResiliencyConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    perf: PerfConfig = field(default_factory=PerfConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)

    @property
    def tokens_per_step(self) -> int:
        """Tokens one optimizer step trains on, as configured (the post-mortem's unit of loss)."""
        return self.train.global_batch_size * self.model.seq_length

    def __post_init__(self) -> None:
        require(
            self.run_id is None
            or (bool(self.run_id) and "/" not in self.run_id and self.run_id not in (".", "..")),
            f"run_id={self.run_id!r} must be a non-empty name without '/'",
        )
        model, par = self.model, self.parallel
        require(
            model.num_attention_heads % par.tp == 0,
            f"model.num_attention_heads={model.num_attention_heads} is not divisible by "
            f"parallel.tp={par.tp}",
        )
        groups = model.num_query_groups or model.num_attention_heads
        require(
            groups % par.tp == 0,
            f"model.num_query_groups={groups} is not divisible by parallel.tp={par.tp}",
        )
        stages = par.pp * (par.vpp or 1)
        require(
            model.num_layers % stages == 0,
            f"model.num_layers={model.num_layers} is not divisible by pp*vpp = "
            f"{par.pp}*{par.vpp or 1} = {stages}",
        )
        if model.padded_vocab_size is not None:
            require(
                model.padded_vocab_size % par.tp == 0,
                f"model.padded_vocab_size={model.padded_vocab_size} is not divisible by "
                f"parallel.tp={par.tp}",
            )
        if par.ep > 1:
            require(model.is_moe, f"parallel.ep={par.ep} needs an MoE model (model.num_experts)")
            require(
                model.num_experts % par.ep == 0,
                f"parallel.ep={par.ep} must divide model.num_experts={model.num_experts}",
            )
        require(
            self.train.eval_interval is None or self.data.split_weights[1] > 0,
            f"train.eval_interval={self.train.eval_interval} needs a validation split, but "
            f"data.split={self.data.split!r} gives it no weight; e.g. data.split=98,2,0",
        )
        require(
            not self.perf.overlap_param_gather or self.optimizer.use_distributed_optimizer,
            "perf.overlap_param_gather=true needs optimizer.use_distributed_optimizer=true "
            "(it overlaps the distributed optimizer's parameter all-gather)",
        )
        if model.is_moe and par.tp > 1:
            require(
                par.sequence_parallel,
                "MoE with parallel.tp > 1 needs parallel.sequence_parallel=true (Megatron-Core)",
            )
        if par.elastic:
            self._check_elastic()
        require(
            self.launch.min_nodes is None or par.elastic,
            f"launch.min_nodes={self.launch.min_nodes} is the fewest nodes of an elastic job: "
            "set parallel.elastic=true (or launch.slurm.min_nodes to shrink at a requeue)",
        )

    def _check_elastic(self) -> None:
        """parallel.elastic: what a resize inside the job relies on, refused with the reason."""
        launch, ckpt = self.launch, self.checkpoint
        require(
            launch.backend == "ft_launcher",
            "parallel.elastic=true needs launch.backend=ft_launcher (its rendezvous re-forms "
            "the group at the new size inside the job)",
        )
        require(
            launch.min_nodes is not None and launch.min_nodes < launch.nodes,
            f"parallel.elastic=true needs launch.min_nodes below launch.nodes={launch.nodes} "
            f"(got {launch.min_nodes}): the fewest nodes the job keeps training on",
        )
        require(
            ckpt.enabled and ckpt.resume,
            "parallel.elastic=true needs checkpoint.enabled=true and checkpoint.resume=true: "
            "every resize restores the newest committed step at the new size",
        )
        require(
            ckpt.optim_format == "fully_reshardable",
            "parallel.elastic=true needs checkpoint.optim_format=fully_reshardable: a "
            "dp_reshardable step holds each DP rank's flat optimizer shard in the bucket layout "
            "of the DP size that saved it, while a resize restores at any size between "
            "launch.min_nodes and launch.nodes; the fully_reshardable format keeps the "
            "optimizer state in model space, which any DP size reads",
        )
        require(
            launch.slurm.min_nodes is None and launch.slurm.spare_nodes == 0,
            "parallel.elastic=true replaces launch.slurm.min_nodes (shrink at a requeue) and "
            "launch.slurm.spare_nodes (hot spares): set neither",
        )
        require(
            not launch.standby,
            "parallel.elastic=true does not run with launch.standby=true yet (one standby per "
            "run dir and host, while elastic nodes may share a host)",
        )
