"""Resiliency features as train-loop hooks; each is absent (not just idle) when disabled."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pretrain.distributed import DistEnv
    from pretrain.loop import TrainHook
    from recipes.schema import RunConfig


def build_hooks(run: "RunConfig", env: "DistEnv", run_dir: Path) -> list["TrainHook"]:
    return []
