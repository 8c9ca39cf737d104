"""Decide, before anything is loaded, whether a checkpoint can restore into a target layout.

Measured on megatron-core 0.16.1 (CPU, gloo): a ``fully_reshardable`` checkpoint reshards across
TP, PP, VPP and DP with weights and Adam moments exactly equal; ``dp_reshardable`` optimizer state
only survives DP changes (otherwise mcore dies with "Global shape mismatch" or a KeyError); an EP
change of an MoE model fails inside mcore (the number of chained optimizers changes). The model's
shape never changes across a restore.

Across megatron-core releases (``CROSS_VERSION``, measured with both supported stacks): a 0.16.x
checkpoint restores under 0.19.x with weights and Adam moments exactly equal (fully_reshardable
across layouts too; dp_reshardable on the same layout); a 0.19.x checkpoint does not load under
0.16.x; any other pair is unmeasured and refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Literal

from pretrain.context import exit_codes
from pretrain.context.failures import ClassifiedError
from resiliency.storage.manifest import Manifest

Verdict = Literal["same", "reshardable", "refused"]
MODEL_SHAPE_KEYS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "ffn_hidden_size",
    "num_experts",
    "moe_ffn_hidden_size",
    "activation",
    "normalization",
    "add_bias_linear",
    "share_embeddings_and_output_weights",
    "position_embedding_type",
)
LAYOUT_DIMS = ("tp", "pp", "vpp", "cp", "ep", "dp")
MCORE = "megatron-core"
# (saved release series, restoring series) -> None: restores (measured); str: why it is refused.
CROSS_VERSION: dict[tuple[str, str], str | None] = {
    ("0.16", "0.19"): None,
    ("0.19", "0.16"): (
        "megatron-core 0.19 writes the common state inside the torch_dist shards "
        "(no model/common.pt), which megatron-core 0.16 cannot read"
    ),
}


class TopologyRefusedError(ClassifiedError):
    """The checkpoint cannot be restored into the requested layout."""

    kind, exit_code = "topology", exit_codes.TOPOLOGY_REFUSED


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
    mcore_version: str | None = None  # the restoring megatron-core; None: this process's


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
            lines.append(
                f"{row.name:<{width}} {_fmt(row.saved):>17} {_fmt(row.target):>17}  "
                f"{row.verdict}{note}"
            )
        verdict = "REFUSED" if self.refused else "OK"
        lines.append(f"verdict: {verdict}")
        lines += [f"  option: {o}" for o in self.options] if self.refused else []
        return "\n".join(lines)


def _fmt(value: Any) -> str:
    return "-" if value is None else str(value)


def validate(manifest: Manifest, target: Target) -> TopologyReport:
    report = TopologyReport()
    _check_version(manifest, target, report)
    _check_model(manifest, target, report)
    _check_layout(manifest, target, report)
    _check_batch(manifest, target, report)
    if report.refused:
        report.options = _options(report)
    return report


def _series(version: str) -> str:
    return ".".join(version.split(".")[:2])


def _check_version(manifest: Manifest, target: Target, report: TopologyReport) -> None:
    """The megatron-core that saved the checkpoint against the one that will restore it."""
    saved = manifest.versions.get(MCORE)
    wanted = target.mcore_version or metadata.version(MCORE)
    if saved is None:
        row = DimensionVerdict(
            MCORE,
            saved,
            wanted,
            "reshardable",
            "not recorded in the manifest: assumed to be this release",
        )
    elif _series(saved) == _series(wanted):
        row = DimensionVerdict(MCORE, saved, wanted, "same")
    else:
        pair = (_series(saved), _series(wanted))
        if pair not in CROSS_VERSION:
            row = DimensionVerdict(
                MCORE,
                saved,
                wanted,
                "refused",
                f"restoring a megatron-core {pair[0]} checkpoint with {pair[1]} is not measured",
            )
        elif CROSS_VERSION[pair] is not None:
            row = DimensionVerdict(MCORE, saved, wanted, "refused", str(CROSS_VERSION[pair]))
        elif (
            manifest.optim_format == "dp_reshardable"
            and target.load_optimizer
            and any(
                manifest.parallelism.get(d, 1) != target.parallelism.get(d, 1) for d in LAYOUT_DIMS
            )
        ):
            row = DimensionVerdict(
                MCORE,
                saved,
                wanted,
                "refused",
                "dp_reshardable optimizer state across megatron-core releases "
                "is measured on the same layout only",
            )
        else:
            row = DimensionVerdict(
                MCORE,
                saved,
                wanted,
                "reshardable",
                f"{pair[0]} -> {pair[1]} measured: weights and Adam moments restore exactly",
            )
    report.rows.append(row)


def _check_model(manifest: Manifest, target: Target, report: TopologyReport) -> None:
    saved_model = manifest.config.get("model", {})
    for key in MODEL_SHAPE_KEYS:
        saved, wanted = saved_model.get(key), target.model.get(key)
        verdict: Verdict = "same" if saved == wanted else "refused"
        report.rows.append(
            DimensionVerdict(
                f"model.{key}",
                saved,
                wanted,
                verdict,
                "" if verdict == "same" else "model shape changed",
            )
        )
    saved_vocab = manifest.tokenizer.get("vocab_size")
    report.rows.append(
        DimensionVerdict(
            "vocab_size",
            saved_vocab,
            target.vocab_size,
            "same" if saved_vocab == target.vocab_size else "refused",
            "" if saved_vocab == target.vocab_size else "tokenizer changed",
        )
    )
    saved_padded = manifest.tokenizer.get("padded_vocab_size")
    tp = target.parallelism["tp"]
    wanted_padded = target.padded_vocab_size or saved_padded
    if wanted_padded != saved_padded:
        row = DimensionVerdict(
            "padded_vocab_size",
            saved_padded,
            wanted_padded,
            "refused",
            "set model.padded_vocab_size to the checkpoint's value",
        )
    elif saved_padded and saved_padded % tp:
        row = DimensionVerdict(
            "padded_vocab_size",
            saved_padded,
            wanted_padded,
            "refused",
            f"not divisible by the target tp={tp}",
        )
    else:
        row = DimensionVerdict(
            "padded_vocab_size", saved_padded, wanted_padded, "same", "kept from the checkpoint"
        )
    report.rows.append(row)


def _check_layout(manifest: Manifest, target: Target, report: TopologyReport) -> None:
    fmt = manifest.optim_format
    for dim in LAYOUT_DIMS:
        saved, wanted = manifest.parallelism.get(dim, 1), target.parallelism.get(dim, 1)
        if saved == wanted:
            report.rows.append(DimensionVerdict(dim, saved, wanted, "same"))
            continue
        report.rows.append(DimensionVerdict(dim, saved, wanted, *_layout_change(dim, fmt, target)))
    report.rows.append(
        DimensionVerdict(
            "world_size",
            manifest.world_size,
            target.world_size,
            "same" if manifest.world_size == target.world_size else "reshardable",
        )
    )
    report.rows.append(DimensionVerdict("optimizer format", fmt, fmt, "same"))


def _layout_change(dim: str, fmt: str, target: Target) -> tuple[Verdict, str]:
    if target.tier != "persistent":
        return "refused", f"the {target.tier} tier restores the same layout only"
    if not target.load_optimizer:  # the weights themselves reshard along every dimension
        return "reshardable", "weights only: the optimizer starts fresh"
    if dim == "ep" and target.model.get("num_experts"):
        return "refused", (
            "megatron-core 0.16.1 cannot reshard MoE optimizer state across EP "
            "(the number of chained optimizers changes)"
        )
    if dim == "dp" or fmt == "fully_reshardable":
        return "reshardable", ""
    return "refused", f"dp_reshardable optimizer state reshards across dp only, not {dim}"


def _check_batch(manifest: Manifest, target: Target, report: TopologyReport) -> None:
    saved = manifest.config.get("train", {}).get("global_batch_size")
    wanted = target.global_batch_size
    if saved != wanted and manifest.weights_only:
        note = "an imported step: nothing was trained at the saved batch"
        report.rows.append(DimensionVerdict("global_batch_size", saved, wanted, "same", note))
    elif saved == wanted:
        report.rows.append(
            DimensionVerdict(
                "global_batch_size",
                saved,
                wanted,
                "same",
                "micro-batches recomputed for the new dp",
            )
        )
    elif target.batch_change_lr_scaling == "refuse":
        report.rows.append(
            DimensionVerdict(
                "global_batch_size",
                saved,
                wanted,
                "refused",
                "set checkpoint.batch_change_lr_scaling=none|linear|sqrt to allow it",
            )
        )
    else:
        report.rows.append(
            DimensionVerdict(
                "global_batch_size",
                saved,
                wanted,
                "reshardable",
                f"lr scaled by rule '{target.batch_change_lr_scaling}'",
            )
        )


def _options(report: TopologyReport) -> list[str]:
    refused = [r.name for r in report.rows if r.verdict == "refused"]
    if MCORE in refused:
        saved = next(r.saved for r in report.rows if r.name == MCORE)
        return [
            f"restore with the megatron-core that saved it ({saved}): the Python 3.11 stack "
            "(make install) for 0.16.x, the Python 3.12 stack (make install PY=3.12) "
            "for 0.19.x"
        ]
    if any(name.startswith("model.") or "vocab" in name for name in refused):
        return [
            "restore only into the same model (layers, hidden, heads, vocab); a new model "
            "needs a new run_id"
        ]
    if refused == ["global_batch_size"]:
        return [
            "keep train.global_batch_size as saved, or set "
            "checkpoint.batch_change_lr_scaling=none|linear|sqrt"
        ]
    return [
        "restore from a checkpoint saved with checkpoint.optim_format=fully_reshardable",
        "conversion: resume once on the saved layout with checkpoint.optim_format="
        "fully_reshardable, save, then change the layout",
        "checkpoint.load_optimizer=false: weights only, with a FRESH optimizer (the loss "
        "trajectory changes; loudly warned)",
    ]


def scale_lr(value: float, saved_batch: int, target_batch: int, rule: str) -> float:
    ratio = target_batch / saved_batch
    return {"none": value, "linear": value * ratio, "sqrt": value * ratio**0.5}[rule]


def resize_of(manifest: Manifest, world_size: int, dp: int) -> dict[str, Any] | None:
    """The attempt record's ``resized`` field: the restored step's size and this one, when
    they differ (None when they do not)."""
    saved_dp = manifest.parallelism.get("dp")
    if manifest.world_size == world_size and saved_dp in (None, dp):
        return None
    return {
        "kind": "grow" if world_size > manifest.world_size else "shrink",
        "from": {"world_size": manifest.world_size, "dp": saved_dp},
        "to": {"world_size": world_size, "dp": dp},
        "step": manifest.step,
    }
