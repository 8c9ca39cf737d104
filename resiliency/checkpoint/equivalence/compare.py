"""Two runs' state dumps (state_dump.py) compared: byte for byte per rank on the same layout,
or, across a data-parallel size change, each parameter's and optimizer tensor's whole value put
together from the ranges the ranks own. Reports every difference in a fixed order (steps, then
kinds of state as a restore puts them back, then ranks), so the first one named is the first
thing the restore got wrong.

Across a DP change two things are not compared byte for byte, by design: the RNG streams (a
restore on another topology reseeds them: checkpointer.apply_loaded) and the state after the
first resumed step (the gradient is summed over another split of the batch, so in another
order): those are compared within ``rtol``, the restored step itself exactly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from resiliency.checkpoint.equivalence import state_dump

# The order a difference is looked for in (the first one found is reported first).
KINDS = ("loop", "scheduler", "optimizer-group", "data", "rng", "model", "optimizer", "grad")
LAYOUT_KEYS = ("world", "dp", "tp", "pp", "ep", "cp", "vpp")
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class DumpError(ValueError):
    """The dumps cannot be compared (missing, or layouts too different)."""


@dataclass(frozen=True)
class Difference:
    step: int
    where: str  # "rank 1", or "ranks 0-1" for a whole tensor put together
    name: str
    detail: str

    def __str__(self) -> str:
        return f"step {self.step}, {self.where}: {self.name}: {self.detail}"


@dataclass
class Verdict:
    mode: str  # "same layout" | "data-parallel change"
    steps: list[int]
    compared: int = 0
    differences: list[Difference] = field(default_factory=list)
    not_compared: list[str] = field(default_factory=list)

    @property
    def equivalent(self) -> bool:
        return not self.differences


def load_run(root: Path) -> dict[int, dict[int, dict[str, Any]]]:
    """step -> rank -> dump, for every dump under ``root``."""
    dumps: dict[int, dict[int, dict[str, Any]]] = {}
    for path in sorted(root.glob("step-*/rank-*.pt")):
        dump = state_dump.read(path)
        dumps.setdefault(dump["step"], {})[dump["layout"]["rank"]] = dump
    if not dumps:
        raise DumpError(f"no state dumps under {root} (checkpoint.dump_state_at wrote none)")
    return dumps


def compare_runs(reference: Path, resumed: Path, rtol: float = 1e-5) -> Verdict:
    ref, res = load_run(reference), load_run(resumed)
    steps = sorted(set(ref) & set(res))
    if not steps:
        raise DumpError(f"no step dumped by both runs ({sorted(ref)} vs {sorted(res)})")
    first_ref, first_res = ref[steps[0]][0]["layout"], res[steps[0]][0]["layout"]
    same = all(first_ref[k] == first_res[k] for k in LAYOUT_KEYS)
    if not same and any(first_ref[k] != first_res[k] for k in ("tp", "pp", "ep", "cp", "vpp")):
        raise DumpError(
            "the runs differ in model parallelism "
            f"({_shape(first_ref)} vs {_shape(first_res)}): only a data-parallel change "
            "can be compared"
        )
    verdict = Verdict("same layout" if same else "data-parallel change", steps)
    for step in steps:
        restored = all(d["grads_of"] is None for d in res[step].values())
        compare = _compare_same if same else _compare_dp_change
        compare(verdict, step, ref[step], res[step], 0.0 if same or restored else rtol)
        if restored:
            verdict.not_compared.append(
                f"step {step}: gradients (the resumed run restored this step; gradients are "
                "not saved state, every step starts from zero)"
            )
    if not same:
        verdict.not_compared.append(
            "RNG streams (a restore on another data-parallel size reseeds them)"
        )
    verdict.differences.sort(key=lambda d: (d.step, _kind_order(d.name), d.where))
    return verdict


def _shape(layout: dict[str, Any]) -> str:
    return " ".join(f"{k}={layout[k]}" for k in LAYOUT_KEYS)


def _kind_order(name: str) -> int:
    kind = name.split("/", 1)[0]
    return KINDS.index(kind) if kind in KINDS else len(KINDS)


def _compare_same(
    verdict: Verdict, step: int, ref: dict[int, Any], res: dict[int, Any], rtol: float
) -> None:
    for rank in sorted(set(ref) | set(res)):
        if rank not in ref or rank not in res:
            which = "reference" if rank not in ref else "resumed run"
            verdict.differences.append(
                Difference(step, f"rank {rank}", "dump", f"none from the {which}")
            )
            continue
        a, b = ref[rank], res[rank]
        with_grads = a["grads_of"] is not None and b["grads_of"] is not None
        where = f"rank {rank}"
        _compare_maps(verdict, step, where, a["values"], b["values"], _compare_value, rtol)
        ta, tb = (_drop_grads(d["tensors"], with_grads) for d in (a, b))
        _compare_maps(verdict, step, where, ta, tb, _compare_tensor, rtol)


def _drop_grads(tensors: dict[str, Any], keep: bool) -> dict[str, Any]:
    return tensors if keep else {k: v for k, v in tensors.items() if not k.startswith("grad/")}


def _compare_maps(verdict, step, where, a, b, compare, rtol) -> None:  # noqa: ANN001
    for name in list(a) + [n for n in b if n not in a]:
        verdict.compared += 1
        if name not in a or name not in b:
            detail = "absent from the " + ("reference" if name not in a else "resumed run")
            verdict.differences.append(Difference(step, where, name, detail))
            continue
        detail = compare(a[name], b[name], rtol)
        if detail:
            verdict.differences.append(Difference(step, where, name, detail))


def _compare_value(a: Any, b: Any, rtol: float) -> str | None:
    if _values_equal(a, b, rtol):
        return None
    return f"{_short(a)} (reference) != {_short(b)} (resumed)"


def _values_equal(a: Any, b: Any, rtol: float) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=rtol)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_values_equal(x, y, rtol) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_values_equal(a[k], b[k], rtol) for k in a)
    return type(a) is type(b) and a == b


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _compare_tensor(a: torch.Tensor, b: torch.Tensor, rtol: float) -> str | None:
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype}{list(a.shape)} (reference) vs {b.dtype}{list(b.shape)} (resumed)"
    bits_a = a.contiguous().reshape(-1).view(_BITS[a.element_size()])
    bits_b = b.contiguous().reshape(-1).view(_BITS[b.element_size()])
    unequal = bits_a != bits_b
    count = int(unequal.sum())
    if count == 0:
        return None
    first = int(unequal.nonzero()[0])
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    if rtol > 0 and a.is_floating_point():
        scale = float(flat_a.abs().max())
        worst = float((flat_a - flat_b).abs().max())
        if worst <= rtol * max(scale, 1e-30):
            return None
        return f"max |difference| {worst:.3g} > rtol {rtol:g} x max |value| {scale:.3g}"
    return (
        f"{count} of {a.numel()} elements differ, first at [{first}]: "
        f"{flat_a[first].item()!r} (reference) vs {flat_b[first].item()!r} (resumed)"
    )


def _compare_dp_change(
    verdict: Verdict, step: int, ref: dict[int, Any], res: dict[int, Any], rtol: float
) -> None:
    """Model parallelism equal, DP differs: per model-parallel coordinate, every resumed rank's
    replica against the reference's, and each ranged tensor put together whole."""
    with_grads = all(d["grads_of"] is not None for d in (*ref.values(), *res.values()))
    for coord in sorted({tuple(d["layout"]["model_rank"]) for d in ref.values()}):
        ref_ranks = _ranks_at(ref, coord)
        res_ranks = _ranks_at(res, coord)
        where = f"tp,pp rank {coord[0]},{coord[1]}"
        base_values, base_model = _per_rank_parts(ref[ref_ranks[0]])
        for rank in res_ranks:
            values, model = _per_rank_parts(res[rank])
            _compare_maps(verdict, step, f"rank {rank}", base_values, values, _compare_value, rtol)
            _compare_maps(verdict, step, f"rank {rank}", base_model, model, _compare_tensor, rtol)
        whole_ref = _assemble(verdict, step, where, [ref[r] for r in ref_ranks], with_grads)
        whole_res = _assemble(verdict, step, where, [res[r] for r in res_ranks], with_grads)
        _compare_maps(verdict, step, where, whole_ref, whole_res, _compare_tensor, rtol)
    batch_ref = sorted(_all(d["values"]["data/next_batch"] for d in ref.values()))
    batch_res = sorted(_all(d["values"]["data/next_batch"] for d in res.values()))
    verdict.compared += 1
    if batch_ref != batch_res:
        verdict.differences.append(
            Difference(
                step, "all ranks", "data/next_batch", "the next global batch's samples differ"
            )
        )


def _per_rank_parts(dump: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A dump's values (but its next batch, compared whole) and its model tensors: what every
    replica of a model-parallel coordinate holds in full."""
    values = {k: v for k, v in dump["values"].items() if k != "data/next_batch"}
    model = {k: v for k, v in dump["tensors"].items() if k.startswith("model/")}
    return values, model


def _ranks_at(dumps: dict[int, Any], coord: tuple[int, ...]) -> list[int]:
    return sorted(r for r, d in dumps.items() if tuple(d["layout"]["model_rank"]) == coord)


def _all(lists: Iterable[list[int]]) -> list[int]:
    return [x for items in lists for x in items]


def _assemble(
    verdict: Verdict, step: int, where: str, dumps: list[dict[str, Any]], with_grads: bool
) -> dict[str, torch.Tensor]:
    """optimizer/* and grad/* tensors whole, from the ranges the given ranks own (a per-range
    scalar, e.g. Adam's step counter, must be the same in each)."""
    pieces: dict[str, list[tuple[int, int, int, torch.Tensor]]] = {}
    for dump in dumps:
        for key, tensor in _drop_grads(dump["tensors"], with_grads).items():
            kind, _, rest = key.partition("/")
            if kind not in ("optimizer", "grad"):
                continue
            param = rest.rsplit("/", 1)[0] if kind == "optimizer" else rest
            start, end, numel = dump["ranges"].get(param, [0, tensor.numel(), tensor.numel()])
            pieces.setdefault(key, []).append((start, end, numel, tensor))
    whole = {}
    for key, parts in pieces.items():
        start, end, numel, first = parts[0]
        if key.endswith("/step") or first.numel() != end - start:  # one value per range
            whole[key] = first
            for *_, other in parts[1:]:
                if _compare_tensor(first, other, 0.0):
                    verdict.differences.append(
                        Difference(step, where, key, "ranks of one run hold different values")
                    )
            continue
        out = torch.empty(numel, dtype=first.dtype)
        covered = torch.zeros(numel, dtype=torch.bool)
        for start, end, _, tensor in parts:
            out[start:end] = tensor
            covered[start:end] = True
        if not bool(covered.all()):
            missing = int((~covered).sum())
            verdict.differences.append(
                Difference(step, where, key, f"{missing} of {numel} elements held by no rank")
            )
        whole[key] = out
    return whole
