"""Which step a warm start's checkpoint.init_from names, and what it refuses, on real step dirs
(published by the storage protocol, no model): a step dir, a run dir's newest verified step,
an s3:// run prefix's parts; each wrong input one ConfigError naming it."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from pretrain.context import exit_codes
from recipes import ConfigError, load_config
from resiliency.checkpoint.restore.init_source import (
    InitSourceError,
    judge,
    judge_warm_start,
    resolve_local,
    split_remote,
)
from resiliency.storage.layout import RunLayout
from resiliency.storage.synthetic import write_synthetic_step


@pytest.fixture
def source(tmp_path: Path) -> RunLayout:
    layout = RunLayout(tmp_path / "runs", "A")
    for step in (2, 4):
        write_synthetic_step(layout, step)
    return layout


def test_a_step_dir_a_run_dir_and_a_copied_step(source: RunLayout, tmp_path: Path) -> None:
    here = tmp_path / "runs" / "B"
    assert resolve_local(str(source.step_dir(2)), here).manifest.step == 2
    newest = resolve_local(str(source.run_dir), here)
    assert newest.step_dir == source.step_dir(4) and newest.manifest.run_id == "A"
    marker = (source.step_dir(4) / "COMMITTED").read_text().split()[0]
    assert newest.record("weights") == {"from": str(source.run_dir), "run_id": "A", "step": 4,
                                        "manifest": marker, "load": "weights"}  # fmt: skip
    copied = tmp_path / "elsewhere" / "step-000000004"  # a step moved out of its run dir
    copied.parent.mkdir()
    os.rename(source.step_dir(4), copied)
    assert resolve_local(str(copied), here).manifest.run_id == "A"
    assert resolve_local(str(source.run_dir), here).manifest.step == 2  # what is left


def test_a_step_that_does_not_verify_falls_back_in_a_run_dir_only(
    source: RunLayout, tmp_path: Path
) -> None:
    shard = next(p for p in source.step_dir(4).rglob("*") if p.is_file() and p.stat().st_size)
    os.truncate(shard, shard.stat().st_size - 1)
    here = tmp_path / "runs" / "B"
    assert resolve_local(str(source.run_dir), here).manifest.step == 2
    with pytest.raises(InitSourceError, match="does not verify") as refused:
        resolve_local(str(source.step_dir(4)), here)
    assert refused.value.exit_code == exit_codes.CHECKPOINT_IO
    with pytest.raises(InitSourceError, match="holds no step that verifies"):
        resolve_local(str(source.run_dir), here, rejected={2: "re-hash failed"})


@pytest.mark.parametrize(
    "spec, says",
    [
        ("missing", "no such file or directory"),
        ("runs", "neither a step dir"),
        ("runs/B", "this run's own dir"),
    ],
)
def test_wrong_paths_are_one_config_error(
    source: RunLayout, tmp_path: Path, spec: str, says: str
) -> None:
    (tmp_path / "runs" / "B").mkdir()
    with pytest.raises(ConfigError, match=says):
        resolve_local(str(tmp_path / spec), tmp_path / "runs" / "B")


def test_s3_prefixes() -> None:
    assert split_remote("s3://bucket/team/runs/A/") == ("s3://bucket/team/runs", "A")
    assert split_remote("s3://bucket/A") == ("s3://bucket", "A")
    for bad in ("s3://bucket", "s3://"):
        with pytest.raises(ConfigError, match="give s3://bucket"):
            split_remote(bad)


def test_config_section() -> None:
    with pytest.raises(ConfigError, match="init_load"):
        load_config(["recipe=gpt_tiny", "checkpoint.init_load=optimizer"])
    with pytest.raises(ConfigError, match="init_from needs checkpoint.enabled=true"):
        load_config(["recipe=gpt_tiny", "checkpoint.init_from=x", "checkpoint.enabled=false"])
    with pytest.raises(ConfigError, match="init_from is empty"):
        load_config(["recipe=gpt_tiny", "checkpoint.init_from=' '"])


def test_a_relaunch_is_not_judged_against_the_source(source: RunLayout, tmp_path: Path) -> None:
    """Once the run has a step of its own, init_from is not read (even when it is gone)."""
    run = load_config(["recipe=gpt_tiny", f"checkpoint.init_from={tmp_path / 'gone'}"])
    own = RunLayout(tmp_path / "runs", "B")
    with pytest.raises(ConfigError, match="no such file"):
        judge_warm_start(run, own.run_dir, 2, 1)
    write_synthetic_step(own, 1)
    assert judge_warm_start(run, own.run_dir, 2, 1) is None


def test_another_model_is_refused_with_its_keys(source: RunLayout, tmp_path: Path) -> None:
    found = resolve_local(str(source.run_dir), tmp_path / "runs" / "B")
    saved = found.manifest.config
    run = load_config(["recipe=gpt_tiny"])
    if not saved:  # a synthetic step records no config: give it this run's, then change one
        saved.update(dataclasses.asdict(run))
    saved["model"]["hidden_size"] = run.model.hidden_size * 2
    with pytest.raises(ConfigError, match=r"another model than this run's \(model.hidden_size"):
        judge(run, found)
