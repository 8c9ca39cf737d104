"""Decide, before anything is loaded, whether a checkpoint can restore into a target layout.

Measured on megatron-core 0.16.1 (CPU, gloo): a ``fully_reshardable`` checkpoint reshards across
TP, PP, VPP and DP with weights and Adam moments exactly equal; ``dp_reshardable`` optimizer state
only survives DP changes (otherwise mcore dies with "Global shape mismatch" or a KeyError); an EP
change of an MoE model fails inside mcore (the number of chained optimizers changes). The model's
shape never changes across a restore.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from resiliency.manifest import Manifest

Verdict = Literal["same", "reshardable", "refused"]
MODEL_SHAPE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                    "ffn_hidden_size", "num_experts", "moe_ffn_hidden_size", "activation",
                    "normalization", "add_bias_linear", "share_embeddings_and_output_weights",
                    "position_embedding_type")
LAYOUT_DIMS = ("tp", "pp", "vpp", "cp", "ep", "dp")


@dataclass(frozen=True)
class Target:
    """What the restoring job will be: its layout, model shape and restore options."""
    parallelism: dict[str, int]
    world_size: int
    model: dict[str, Any]
    vocab_size: int
    padded_vocab_size: int | None  # None: the checkpoint's is kept
    global_batch_size: int
    load_optimizer: bool
    batch_change_lr_scaling: str  # refuse | none | linear | sqrt
    tier: str = "persistent"


@dataclass(frozen=True)
class DimensionVerdict:
    name: str
    saved: Any
    target: Any
    verdict: Verdict
    reason: str = ""


@dataclass
class TopologyReport:
    rows: list[DimensionVerdict] = field(default_factory=list)
    options: list[str] = field(default_factory=list)

    @property
    def refused(self) -> bool:
        return any(r.verdict == "refused" for r in self.rows)

    @property
    def same_layout(self) -> bool:
        return all(r.verdict == "same" for r in self.rows if r.name in LAYOUT_DIMS)

    def table(self) -> str:
        width = max(len(r.name) for r in self.rows) if self.rows else 10
        header = f"{'dimension':<{width}} {'checkpoint':>17} {'target':>17}  verdict"
        lines = [header, "-" * len(header)]
        for row in self.rows:
            note = f"  ({row.reason})" if row.reason else ""
            lines.append(f"{row.name:<{width}} {_fmt(row.saved):>17} {_fmt(row.target):>17}  "
                         f"{row.verdict}{note}")
        verdict = "REFUSED" if self.refused else "OK"
        lines.append(f"verdict: {verdict}")
        lines += [f"  option: {o}" for o in self.options] if self.refused else []
        return "\n".join(lines)


def _fmt(value: Any) -> str:
    return "-" if value is None else str(value)


def validate(manifest: Manifest, target: Target) -> TopologyReport:
    report = TopologyReport()
    _check_model(manifest, target, report)
    _check_layout(manifest, target, report)
    _check_batch(manifest, target, report)
    if report.refused:
        report.options = _options(report)
    return report


def _check_model(manifest: Manifest, target: Target, report: TopologyReport) -> None:
    saved_model = manifest.config.get("model", {})
    for key in MODEL_SHAPE_KEYS:
        saved, wanted = saved_model.get(key), target.model.get(key)
        verdict: Verdict = "same" if saved == wanted else "refused"
        report.rows.append(DimensionVerdict(f"model.{key}", saved, wanted, verdict,
                                            "" if verdict == "same" else "model shape changed"))
    saved_vocab = manifest.tokenizer.get("vocab_size")
    report.rows.append(DimensionVerdict(
        "vocab_size", saved_vocab, target.vocab_size,
        "same" if saved_vocab == target.vocab_size else "refused",
        "" if saved_vocab == target.vocab_size else "tokenizer changed"))
    saved_padded = manifest.tokenizer.get("padded_vocab_size")
    tp = target.parallelism["tp"]
    wanted_padded = target.padded_vocab_size or saved_padded
    if wanted_padded != saved_padded:
        row = DimensionVerdict("padded_vocab_size", saved_padded, wanted_padded, "refused",
                               "set model.padded_vocab_size to the checkpoint's value")
    elif saved_padded and saved_padded % tp:
        row = DimensionVerdict("padded_vocab_size", saved_padded, wanted_padded, "refused",
                               f"not divisible by the target tp={tp}")
    else:
        row = DimensionVerdict("padded_vocab_size", saved_padded, wanted_padded, "same",
                               "kept from the checkpoint")
    report.rows.append(row)


def _check_layout(manifest: Manifest, target: Target, report: TopologyReport) -> None:
    fmt = manifest.optim_format
    for dim in LAYOUT_DIMS:
        saved, wanted = manifest.parallelism.get(dim, 1), target.parallelism.get(dim, 1)
        if saved == wanted:
            report.rows.append(DimensionVerdict(dim, saved, wanted, "same"))
            continue
        report.rows.append(DimensionVerdict(dim, saved, wanted, *_layout_change(dim, fmt, target)))
    report.rows.append(DimensionVerdict("world_size", manifest.world_size, target.world_size,
                                        "same" if manifest.world_size == target.world_size
                                        else "reshardable"))
    report.rows.append(DimensionVerdict("optimizer format", fmt, fmt, "same"))


def _layout_change(dim: str, fmt: str, target: Target) -> tuple[Verdict, str]:
    if target.tier != "persistent":
        return "refused", f"the {target.tier} tier restores the same layout only"
    if dim == "ep" and target.model.get("num_experts"):
        return "refused", ("megatron-core 0.16.1 cannot reshard MoE optimizer state across EP "
                           "(the number of chained optimizers changes)")
    if not target.load_optimizer:
        return "reshardable", "weights only: the optimizer starts fresh"
    if dim == "dp" or fmt == "fully_reshardable":
        return "reshardable", ""
    return "refused", f"dp_reshardable optimizer state reshards across dp only, not {dim}"


def _check_batch(manifest: Manifest, target: Target, report: TopologyReport) -> None:
    saved = manifest.config.get("train", {}).get("global_batch_size")
    wanted = target.global_batch_size
    if saved == wanted:
        report.rows.append(DimensionVerdict("global_batch_size", saved, wanted, "same",
                                            "micro-batches recomputed for the new dp"))
    elif target.batch_change_lr_scaling == "refuse":
        report.rows.append(DimensionVerdict(
            "global_batch_size", saved, wanted, "refused",
            "set checkpoint.batch_change_lr_scaling=none|linear|sqrt to allow it"))
    else:
        report.rows.append(DimensionVerdict(
            "global_batch_size", saved, wanted, "reshardable",
            f"lr scaled by rule '{target.batch_change_lr_scaling}'"))


def _options(report: TopologyReport) -> list[str]:
    refused = [r.name for r in report.rows if r.verdict == "refused"]
    if any(name.startswith("model.") or "vocab" in name for name in refused):
        return ["restore only into the same model (layers, hidden, heads, vocab); a new model "
                "needs a new run_id"]
    if refused == ["global_batch_size"]:
        return ["keep train.global_batch_size as saved, or set "
                "checkpoint.batch_change_lr_scaling=none|linear|sqrt"]
    return [
        "restore from a checkpoint saved with checkpoint.optim_format=fully_reshardable",
        "conversion: resume once on the saved layout with checkpoint.optim_format="
        "fully_reshardable, save, then change the layout",
        "checkpoint.load_optimizer=false: weights only, with a FRESH optimizer (the loss "
        "trajectory changes; loudly warned)",
    ]


def scale_lr(value: float, saved_batch: int, target_batch: int, rule: str) -> float:
    ratio = target_batch / saved_batch
    return {"none": value, "linear": value * ratio, "sqrt": value * ratio ** 0.5}[rule]
