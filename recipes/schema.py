"""Structured configs: one kw_only dataclass per concern, each validated in ``__post_init__``.

Checks that need two concerns (model x parallel) live in :class:`RunConfig`; checks that need the
launch environment (world size, device) live in :mod:`recipes.validate`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

# Callers import ConfigError and the launch configs from here too: explicit re-exports.
from recipes.checks import ConfigError as ConfigError
from recipes.checks import one_of, positive, require
from recipes.guard_schema import GuardConfig
from recipes.health_schema import HealthConfig
from recipes.launch_schema import K8sConfig as K8sConfig
from recipes.launch_schema import LaunchConfig
from recipes.launch_schema import SlurmConfig as SlurmConfig
from recipes.logging_schema import LoggingConfig
from recipes.logging_schema import WandbConfig as WandbConfig
from recipes.perf_schema import PerfConfig
from recipes.tier_schema import LocalCheckpointConfig as LocalCheckpointConfig
from recipes.tier_schema import RemoteCheckpointConfig as RemoteCheckpointConfig

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(kw_only=True)
class ModelConfig:
    name: str = "gpt"  # model family name; new runs are named <name>-<launch id>
    num_layers: int = 4  # transformer layers
    hidden_size: int = 64  # model width
    num_attention_heads: int = 4  # query heads per layer
    num_query_groups: Optional[int] = None  # key/value heads (GQA); None: one per query head (MHA)
    ffn_hidden_size: Optional[int] = None  # MLP width; None: 4 x hidden_size
    seq_length: int = 64  # tokens per sample
    max_position_embeddings: Optional[int] = None  # None: seq_length
    # Padded vocab size; None = Megatron's rule (multiple of make_vocab_size_divisible_by * tp).
    # Fix it to keep logits identical across TP sizes (parallelism equivalence, resharding).
    padded_vocab_size: Optional[int] = None
    make_vocab_size_divisible_by: int = 128  # vocab padding multiple (times TP), as Megatron-LM
    position_embedding_type: str = "rope"  # rope | learned_absolute
    rotary_base: int = 10000  # RoPE theta
    normalization: str = "LayerNorm"  # LayerNorm | RMSNorm
    activation: str = "gelu"  # gelu | swiglu
    add_bias_linear: bool = True  # biases in linear layers (off for Llama-style models)
    # tie the input embedding and the output projection
    share_embeddings_and_output_weights: bool = True
    hidden_dropout: float = 0.0  # dropout after attention and MLP
    attention_dropout: float = 0.0  # dropout on attention probabilities
    init_method_std: float = 0.02  # std of the normal weight init
    # Initialise every weight from (seed, global parameter name) so any TP/PP/DP layout starts
    # from identical weights. Costs a full-tensor RNG draw per shard: meant for small models.
    layout_invariant_init: bool = False
    # false: allocate the weights without drawing them (megatron's perform_initialization).
    # The checkpoint hook sets it when it will restore a step, whose weights replace every
    # parameter anyway (0.5 s of a 1.5 GiB model's restart here); without a step to restore
    # it is refused.
    perform_initialization: bool = True
    num_experts: Optional[int] = None  # MoE experts per MLP; None: dense
    moe_router_topk: int = 2  # experts each token is routed to
    moe_ffn_hidden_size: Optional[int] = None  # expert MLP width; None: ffn_hidden_size
    moe_aux_loss_coeff: float = 0.0  # load-balancing loss weight

    def __post_init__(self) -> None:
        positive(
            "model",
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            seq_length=self.seq_length,
            num_query_groups=self.num_query_groups,
            ffn_hidden_size=self.ffn_hidden_size,
            num_experts=self.num_experts,
            moe_router_topk=self.moe_router_topk,
            padded_vocab_size=self.padded_vocab_size,
        )
        require(
            self.hidden_size % self.num_attention_heads == 0,
            f"model.hidden_size={self.hidden_size} must be divisible by "
            f"model.num_attention_heads={self.num_attention_heads}",
        )
        groups = self.num_query_groups or self.num_attention_heads
        require(
            self.num_attention_heads % groups == 0,
            f"model.num_attention_heads={self.num_attention_heads} must be divisible by "
            f"model.num_query_groups={groups}",
        )
        one_of(
            "model",
            "position_embedding_type",
            self.position_embedding_type,
            ("rope", "learned_absolute"),
        )
        one_of("model", "normalization", self.normalization, ("LayerNorm", "RMSNorm"))
        one_of("model", "activation", self.activation, ("gelu", "swiglu"))
        if self.num_experts is not None:
            require(
                self.moe_router_topk <= self.num_experts,
                f"model.moe_router_topk={self.moe_router_topk} exceeds "
                f"model.num_experts={self.num_experts}",
            )
        for key in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, key)
            require(0.0 <= value < 1.0, f"model.{key} must be in [0, 1), got {value}")

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None


@dataclass(kw_only=True)
class ParallelConfig:
    tp: int = 1  # tensor-parallel size
    pp: int = 1  # pipeline-parallel size
    vpp: Optional[int] = None  # virtual pipeline stages per pipeline rank (interleaved 1F1B)
    cp: int = 1  # context-parallel size (CUDA only: Transformer Engine attention)
    ep: int = 1  # expert-parallel size (MoE)
    dp: Optional[int] = None  # None: derived from the world size
    # shard activations along the sequence in TP regions (needs tp > 1)
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        positive(
            "parallel", tp=self.tp, pp=self.pp, vpp=self.vpp, cp=self.cp, ep=self.ep, dp=self.dp
        )
        require(
            not self.sequence_parallel or self.tp > 1,
            "parallel.sequence_parallel=true needs parallel.tp > 1",
        )
        require(
            self.vpp is None or self.pp > 1,
            f"parallel.vpp={self.vpp} needs parallel.pp > 1 (interleaving needs stages)",
        )

    def layout(self, dp: int) -> dict[str, int]:
        """The layout as recorded in checkpoint manifests (vpp 1 = not interleaved)."""
        return {
            "tp": self.tp,
            "pp": self.pp,
            "vpp": self.vpp or 1,
            "cp": self.cp,
            "ep": self.ep,
            "dp": dp,
        }

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    def data_parallel_size(self, world_size: int) -> int:
        """The DP size for ``world_size`` ranks, or a ConfigError naming the mismatch."""
        mp = self.model_parallel_size
        require(
            world_size % mp == 0,
            f"world size {world_size} is not divisible by tp*pp*cp = "
            f"{self.tp}*{self.pp}*{self.cp} = {mp}",
        )
        dp = world_size // mp
        require(
            self.dp is None or self.dp == dp,
            f"parallel.dp={self.dp} but tp*pp*cp*dp must equal the world size {world_size}: "
            f"dp would be {dp} (set parallel.dp=null to derive it)",
        )
        require(
            (dp * self.cp) % self.ep == 0,
            f"parallel.ep={self.ep} must divide dp*cp = {dp}*{self.cp}",
        )
        return dp


@dataclass(kw_only=True)
class OptimizerConfig:
    name: str = "adam"  # adam (megatron-core's AdamW)
    lr: float = 3e-3  # peak learning rate
    min_lr: float = 0.0  # floor of the decay
    weight_decay: float = 0.0  # decoupled weight decay
    adam_beta1: float = 0.9  # Adam beta1
    adam_beta2: float = 0.95  # Adam beta2
    adam_eps: float = 1e-8  # Adam epsilon
    clip_grad: float = 1.0  # global gradient-norm clip; 0: off
    # shard optimizer state over data-parallel ranks (ZeRO-1)
    use_distributed_optimizer: bool = True

    def __post_init__(self) -> None:
        one_of("optimizer", "name", self.name, ("adam", "sgd"))
        require(self.lr > 0, f"optimizer.lr must be > 0, got {self.lr}")
        require(
            0 <= self.min_lr <= self.lr,
            f"optimizer.min_lr={self.min_lr} must be in [0, optimizer.lr={self.lr}]",
        )
        require(self.clip_grad >= 0, f"optimizer.clip_grad must be >= 0, got {self.clip_grad}")


@dataclass(kw_only=True)
class SchedulerConfig:
    warmup_steps: int = 0  # linear warm-up steps from 0 to optimizer.lr
    decay_steps: Optional[int] = None  # None: train.train_steps
    decay_style: str = "cosine"  # cosine | linear | constant
    start_weight_decay: Optional[float] = None  # None: optimizer.weight_decay
    end_weight_decay: Optional[float] = None  # None: start_weight_decay
    weight_decay_incr_style: str = "constant"  # constant | linear | cosine

    def __post_init__(self) -> None:
        require(self.warmup_steps >= 0, "scheduler.warmup_steps must be >= 0")
        positive("scheduler", decay_steps=self.decay_steps)
        one_of(
            "scheduler",
            "decay_style",
            self.decay_style,
            ("constant", "linear", "cosine", "inverse-square-root"),
        )
        one_of(
            "scheduler",
            "weight_decay_incr_style",
            self.weight_decay_incr_style,
            ("constant", "linear", "cosine"),
        )


@dataclass(kw_only=True)
class DataConfig:
    # indexed: megatron .bin/.idx prefixes in `paths`; mock: mcore's MockGPTDataset (smoke only)
    kind: str = "mock"
    paths: list[str] = field(default_factory=list)  # dataset prefixes: <prefix>.bin/.idx
    weights: Optional[list[float]] = None  # blend weights per path; None: by size
    split: str = "98,2,0"  # train,valid,test weights of each dataset
    # byte | huggingface | sentencepiece | tiktoken (as `pretrain.data.prepare --tokenizer`)
    tokenizer: str = "byte"
    # huggingface: a tokenizer.json or a local tokenizer directory; sentencepiece: a .model file;
    # tiktoken: a megatron tiktoken vocabulary .json; byte: none. Never downloaded.
    tokenizer_path: Optional[str] = None
    # The tokenizer's vocabulary size, known without its files: the planners (--plan, resiliency
    # plan) use it where the files are not (a laptop planning a cluster run); a run refuses a
    # tokenizer of another size. None: read from the tokenizer's files.
    vocab_size: Optional[int] = None
    cache_dir: Optional[str] = None  # None: <run dir>/data-cache
    seed: int = 1234  # sample shuffling seed of megatron's GPTDataset
    reset_position_ids: bool = False  # restart position ids after each eod
    reset_attention_mask: bool = False  # no attention across eod (document masking)
    eod_mask_loss: bool = False  # no loss on eod tokens
    # A resume compares each prefix's .idx checksum with the one its checkpoint recorded and
    # refuses a rebuilt corpus (its data cursor would select other samples); true: resume
    # anyway, the differences logged and in the attempt record.
    allow_changed_corpus: bool = False

    def __post_init__(self) -> None:
        one_of("data", "kind", self.kind, ("indexed", "mock"))
        # The same kinds as pretrain.data.tokenizer.TOKENIZER_KINDS (tests/test_prepare.py checks).
        files = {
            "huggingface": "a tokenizer.json file or a local Hugging Face tokenizer directory",
            "sentencepiece": "a SentencePiece .model file",
            "tiktoken": "a megatron tiktoken vocabulary .json file",
        }
        one_of("data", "tokenizer", self.tokenizer, ("byte", *files))
        require(
            self.kind != "indexed" or len(self.paths) > 0,
            "data.kind=indexed needs data.paths (prefixes of .bin/.idx files made by "
            "`python -m pretrain.data.prepare`)",
        )
        require(
            self.weights is None or len(self.weights) == len(self.paths),
            f"data.weights has {len(self.weights or [])} entries for {len(self.paths)} data.paths",
        )
        require(
            self.tokenizer == "byte" or bool(self.tokenizer_path),
            f"data.tokenizer={self.tokenizer} needs data.tokenizer_path "
            f"({files.get(self.tokenizer)})",
        )
        require(
            self.tokenizer != "byte" or self.tokenizer_path is None,
            f"data.tokenizer_path={self.tokenizer_path!r} is not read by data.tokenizer=byte; "
            f"drop it or set data.tokenizer to one of {list(files)}",
        )
        parts = self.split.split(",")
        require(
            len(parts) == 3 and all(p.strip().replace(".", "", 1).isdigit() for p in parts),
            f"data.split={self.split!r} must be three comma-separated weights (train,valid,test)",
        )

    @property
    def split_weights(self) -> tuple[float, float, float]:
        train, valid, test = (float(p) for p in self.split.split(","))
        return train, valid, test


@dataclass(kw_only=True)
class TrainConfig:
    train_steps: int = 20  # optimizer steps of the run (may grow on resume)
    micro_batch_size: int = 2  # samples per forward/backward per rank
    global_batch_size: int = 8  # samples per optimizer step over all data-parallel ranks
    seed: int = 1234  # model init and dropout seed
    device: str = "auto"  # auto | cpu | cuda
    precision: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | fp32 | bf16
    # Bitwise-reproducible steps on CUDA (Megatron-LM's --deterministic-mode): megatron-core's
    # deterministic_mode, torch.use_deterministic_algorithms (warn_only: an op without a
    # deterministic kernel is named in the log, not fatal), cuDNN deterministic, and
    # CUBLAS_WORKSPACE_CONFIG=:4096:8 and NCCL_ALGO=Ring unless set. Slower; CPU runs are
    # deterministic without it.
    deterministic: bool = False
    # Validation on the held-out split every eval_interval steps (None: never) and once at the
    # end, eval_iters global batches each time; the test split too at the end if data.split
    # gives it any weight.
    eval_interval: Optional[int] = None
    eval_iters: int = 10  # validation batches per evaluation
    # Dense peak TFLOP/s per device for MFU; None: looked up for A100/H100/H200, n/a elsewhere.
    peak_tflops: Optional[float] = None
    # Seconds per training step, measured, for the planners (checkpoint.save_interval=auto and
    # the launchers' progress check); None: estimated from the model's FLOPs over launch.gpu's
    # peak at 40 % MFU.
    step_time_s: Optional[float] = None
    # A test-only fault hook ("<kind>@<step>[:rank]"); empty in every shipped recipe.
    fault: str = ""
    guard: GuardConfig = field(default_factory=GuardConfig)  # NaN/inf and loss-spike policy

    def __post_init__(self) -> None:
        positive(
            "train",
            train_steps=self.train_steps,
            micro_batch_size=self.micro_batch_size,
            global_batch_size=self.global_batch_size,
            eval_interval=self.eval_interval,
            eval_iters=self.eval_iters,
            peak_tflops=self.peak_tflops,
        )
        require(
            self.step_time_s is None or self.step_time_s > 0,
            f"train.step_time_s must be > 0 (seconds per step), got {self.step_time_s}",
        )
        require(
            self.global_batch_size % self.micro_batch_size == 0,
            f"train.global_batch_size={self.global_batch_size} must be a multiple of "
            f"train.micro_batch_size={self.micro_batch_size}",
        )
        one_of("train", "device", self.device, ("auto", "cpu", "cuda"))
        one_of("train", "precision", self.precision, ("auto", "fp32", "bf16"))


@dataclass(kw_only=True)
class CheckpointConfig:
    enabled: bool = True  # save and restore at all
    # Steps between persistent saves; None: only at the end; "auto": Young's interval
    # sqrt(2 x save time x MTBF) in steps, from the planner's step time (train.step_time_s, or
    # estimated for launch.gpu) and a save of the checkpoint's bytes at plan_bandwidth
    # (pretrain/fit/timing.py). A launcher pins the number it resolves in the job's config.
    save_interval: Optional[int | str] = None
    # What "auto" and the launchers' progress check plan with: the job's aggregate checkpoint
    # write rate (GB/s) and one GPU's mean time between failures (hours; the job's MTBF is it
    # over the GPU count). 50,000 h: Llama 3 405B saw 419 unexpected interruptions in 54 days
    # on 16,384 H100s (Dubey et al. 2024, section 3.3.4).
    plan_bandwidth: float = 10.0
    plan_gpu_mtbf_h: float = 50000.0  # one GPU's MTBF in hours (the job's: this / its GPUs)
    # fully_reshardable (any layout) | dp_reshardable (faster, same TP/PP)
    optim_format: str = "fully_reshardable"
    async_save: bool = False  # write in a background process; published at a later step boundary
    # Keep a host copy of the checkpointed state between saves and save from it: saves skip
    # page faults on fresh memory (and async saves need no fork). Costs host memory equal to
    # the rank's checkpoint bytes.
    staging_buffers: bool = True
    # Shard files each rank writes in parallel (megatron's thread_count). On one local disk
    # one sequential stream per rank was fastest; parallel file systems may want more.
    writer_threads: int = 1
    resume: bool = True  # restore the newest verified step at start
    load_optimizer: bool = True  # restore optimizer state too (false: weights only)
    keep_last: int = 2  # published steps kept (older ones collected)
    # steps whose checkpoints are never collected; None: none
    milestone_interval: Optional[int] = None
    full_verify: bool = True  # checksum every byte at restore, not only sizes (pickles: always)
    lease_timeout_s: float = 60.0  # a run dir's lease is stale after this long without a heartbeat
    # Restoring with a different train.global_batch_size: refuse, or scale the LR by this rule.
    batch_change_lr_scaling: str = "refuse"
    # Resuming with other optimizer/scheduler values than the checkpoint's: refuse, keep the
    # checkpoint's ("checkpoint") or apply the new ones ("config"); see
    # checkpoint/restore/resume_policy.py.
    schedule_on_resume: str = "refuse"
    # The run dir has published steps but none verifies: refuse (exit 10), or start the run's
    # history over from step 0 (the bad steps are set aside as they are overwritten).
    start_over_if_unverified: bool = False
    # The name of an environment variable holding a key: every published step then carries an
    # HMAC-SHA256 of its manifest, and a restore from any tier rejects a step whose signature
    # is missing or wrong. Set the variable on every rank. None: no signatures.
    signing_key_env: Optional[str] = None
    # Record a fingerprint of each rank's live model and optimizer tensors with every save and
    # check it after a restore on the same layout (refused, exit 10, if any tensor differs):
    # the run continues from exactly the saved state. One extra read of the state per save.
    fingerprint: bool = False
    local: LocalCheckpointConfig = field(default_factory=LocalCheckpointConfig)
    remote: RemoteCheckpointConfig = field(default_factory=RemoteCheckpointConfig)

    def __post_init__(self) -> None:
        one_of(
            "checkpoint", "optim_format", self.optim_format, ("fully_reshardable", "dp_reshardable")
        )
        require(
            self.save_interval in (None, "auto")
            or (isinstance(self.save_interval, int) and self.save_interval >= 1),
            f"checkpoint.save_interval={self.save_interval!r}: give a number of steps (>= 1), "
            "auto (Young's interval from the planner) or null (only at the end)",
        )
        require(
            self.plan_bandwidth > 0 and self.plan_gpu_mtbf_h > 0,
            "checkpoint.plan_bandwidth (GB/s) and checkpoint.plan_gpu_mtbf_h (hours) must be > 0",
        )
        positive(
            "checkpoint",
            milestone_interval=self.milestone_interval,
            writer_threads=self.writer_threads,
        )
        require(
            self.keep_last >= 2,
            f"checkpoint.keep_last={self.keep_last}: at least 2 verified steps are kept, so a "
            "corrupt newest step always has a fallback",
        )
        require(self.lease_timeout_s > 0, "checkpoint.lease_timeout_s must be > 0")
        require(
            self.signing_key_env is None or _ENV_NAME.fullmatch(self.signing_key_env) is not None,
            f"checkpoint.signing_key_env={self.signing_key_env!r}: give the name of an "
            "environment variable holding the key (e.g. CKPT_SIGNING_KEY), not the key itself",
        )
        one_of(
            "checkpoint",
            "batch_change_lr_scaling",
            self.batch_change_lr_scaling,
            ("refuse", "none", "linear", "sqrt"),
        )
        one_of(
            "checkpoint",
            "schedule_on_resume",
            self.schedule_on_resume,
            ("refuse", "checkpoint", "config"),
        )


@dataclass(kw_only=True)
class FtConfig:
    """Hang detection by nvidia-resiliency-ext rank monitors (launch.backend=ft_launcher)."""

    # Timeouts before a section has been observed (resiliency/monitor/timeouts.py). Setup
    # (model build, data, restore) and checkpointing also get this rank's checkpoint bytes at
    # min_io_mb_per_s on top: a bound from what is known rather than one fixed 15 minutes.
    setup_timeout_s: float = 600.0
    step_timeout_s: float = 600.0  # prior timeout of a training step (before learned)
    eval_timeout_s: float = 600.0  # prior timeout of a validation pass
    # prior timeout of a save or restore, plus bytes / min_io_mb_per_s
    checkpointing_timeout_s: float = 60.0
    out_of_section_timeout_s: float = 600.0  # prior timeout between sections (data loading, hooks)
    min_io_mb_per_s: float = 50.0  # conservative per-rank checkpoint write/read bandwidth
    # Once observed: timeout_multiplier x the section's p99, never below timeout_floor_s. With
    # 3 x p99 and 30 s a hung rank is torn down within max(3 x p99, 30 s) + a check interval.
    learn_timeouts: bool = True
    learn_after_steps: int = 10  # steps (and out-of-section gaps) before those two are learned
    timeout_multiplier: float = 3.0  # learned timeout = max(multiplier x p99, floor)
    timeout_floor_s: float = 30.0  # lowest learned timeout
    check_interval_s: float = 1.0  # how often the rank monitor checks
    # ft_launcher's SIGTERM -> SIGKILL grace when it stops a failed group to restart it: a
    # peer is gone, so no collective save can finish and a hung rank ignores SIGTERM; a long
    # grace only delays the restart (nvrx's own default: 30 s on 0.4, 15 s on 0.7).
    workers_stop_timeout_s: float = 10.0
    # Dump every rank's Python stacks shortly before its section times out, and keep a
    # per-rank liveness heartbeat (evidence: which rank hung or stopped, which only waited).
    stack_dumps: bool = True

    def __post_init__(self) -> None:
        for key in (
            "setup_timeout_s",
            "step_timeout_s",
            "eval_timeout_s",
            "checkpointing_timeout_s",
            "min_io_mb_per_s",
            "out_of_section_timeout_s",
            "timeout_floor_s",
            "check_interval_s",
            "workers_stop_timeout_s",
        ):
            require(getattr(self, key) > 0, f"resiliency.ft.{key} must be > 0")
        require(self.timeout_multiplier >= 1, "resiliency.ft.timeout_multiplier must be >= 1")
        positive("resiliency.ft", learn_after_steps=self.learn_after_steps)


@dataclass(kw_only=True)
class StragglerConfig:
    """Straggler reports from nvidia-resiliency-ext's Detector (sections; CUDA kernels on GPU)."""

    enabled: bool = False  # time every rank's steps and report slow ones
    report_interval: int = 20  # steps between reports
    warmup_steps: int = 5  # first steps of every attempt are not timed (allocator, caches)
    # A rank whose score (best rank's time / its time) is below this is named a straggler.
    relative_threshold: float = 0.6
    individual_threshold: float = 0.7  # vs the rank's own best: logged, not a straggler alone
    stop_if_detected: bool = False  # save and exit STRAGGLER

    def __post_init__(self) -> None:
        positive("resiliency.straggler", report_interval=self.report_interval)
        require(self.warmup_steps >= 0, "resiliency.straggler.warmup_steps must be >= 0")
        for key in ("relative_threshold", "individual_threshold"):
            require(0 < getattr(self, key) < 1, f"resiliency.straggler.{key} must be in (0, 1)")


@dataclass(kw_only=True)
class MetricsConfig:
    """Prometheus metrics: <run_dir>/metrics/metrics.prom (rank 0), optionally served over HTTP."""

    enabled: bool = True  # Prometheus text metrics in <run_dir>/metrics
    write_interval_steps: int = 10  # steps between metric file writes
    http_port: int = 0  # 0: no HTTP endpoint

    def __post_init__(self) -> None:
        positive("resiliency.metrics", write_interval_steps=self.write_interval_steps)
        require(0 <= self.http_port < 65536, "resiliency.metrics.http_port must be in [0, 65535]")


@dataclass(kw_only=True)
class WatchConfig:
    """After a restore, compare loss and grad norm with the values logged before the failure."""

    steps: int = 10  # 0: off
    loss_tolerance: float = 0.1  # relative increase that counts as a jump
    grad_norm_tolerance: float = 1.0  # relative grad-norm increase that counts as a jump
    stop_on_jump: bool = False  # fail the run (numeric, not retried) instead of only logging

    def __post_init__(self) -> None:
        require(self.steps >= 0, "resiliency.watch.steps must be >= 0")
        require(
            self.loss_tolerance > 0 and self.grad_norm_tolerance > 0,
            "resiliency.watch tolerances must be > 0",
        )


@dataclass(kw_only=True)
class ResiliencyConfig:
    # SIGTERM / SIGUSR1 -> emergency persistent save at the next step boundary -> exit REQUEUE.
    preemption: bool = True
    emergency_save_timeout_s: float = 120.0  # an emergency save longer than this is abandoned
    # Restarts after infrastructure failures (python -m launch local); other failures stop.
    max_restarts: int = 2
    ft: FtConfig = field(default_factory=FtConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    watch: WatchConfig = field(default_factory=WatchConfig)
    health: HealthConfig = field(default_factory=HealthConfig)

    def __post_init__(self) -> None:
        require(
            self.emergency_save_timeout_s > 0, "resiliency.emergency_save_timeout_s must be > 0"
        )
        require(self.max_restarts >= 0, "resiliency.max_restarts must be >= 0")


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
