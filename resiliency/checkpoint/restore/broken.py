"""Deliberately broken restores (``train.fault=break_*@<step>[:<rank>]``): the controls of the
resume-equivalence gate (drill/equivalence). A gate that has never seen a broken restore fail
proves nothing (Megatron-LM PR #7421), so each break is a bug the anchors' users met for real,
made as small as that part of the state can be wrong: one draw too many from one RNG stream
(Megatron-LM PR #6858: the expert-parallel one), Adam's step counter dropped (Megatron-Bridge
PR #3832), one rank's data cursor lost (Megatron-Bridge PR #5637), one element of one
parameter one ulp off. Inert unless a break_* fault names this rank and step.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

from resiliency.checkpoint.fingerprint import inner_optimizers

log = logging.getLogger(__name__)


def cursor_dropped(train_state: dict[str, Any], breaks: frozenset[str]) -> dict[str, Any]:
    """``train_state`` with, under "data_cursor", this rank's data from sample 0."""
    if "data_cursor" not in breaks:
        return train_state
    return {**train_state, "consumed_samples": 0, "consumed_tokens": 0}


def break_restored(chunks: list[Any], optimizer: Any, breaks: frozenset[str]) -> None:
    """After a restore: get wrong what ``breaks`` names."""
    if not breaks:
        return
    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    if "rng_python" in breaks:
        random.random()
    if "rng_numpy" in breaks:
        np.random.random()
    if "rng_torch" in breaks:
        torch.rand(1)
    if "rng_ep" in breaks:
        with get_cuda_rng_tracker().fork("expert-parallel-rng"):
            torch.rand(1, device="cuda" if torch.cuda.is_available() else "cpu")
    if "adam_step" in breaks:
        _drop_step_counters(optimizer)
    if "param" in breaks:
        name, param = next(iter(chunks[0].named_parameters()))
        with torch.no_grad():
            flat = param.data.view(-1)
            flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=flat.dtype))
        log.warning("fault injection: %s[0] restored one ulp off", name)


def _drop_step_counters(optimizer: Any) -> None:
    """Every optimizer step counter back to 0, as a fresh optimizer's."""
    for inner in inner_optimizers(optimizer):
        for state in inner.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"].zero_()
            elif "step" in state:
                state["step"] = 0
        for group in inner.param_groups:
            if "step" in group:
                group["step"] = 0
