"""pretrain/context/run_dir.py is the one owner of a run directory's entry names and of its
JSON-lines files: no other module spells a name, and readers survive a writer killed mid-line."""

from __future__ import annotations

import json
import re
from pathlib import Path

from pretrain.context.run_dir import RunDir, append_jsonl, last_by_step, read_jsonl
from resiliency.storage.layout import RunLayout
from tests.helpers import REPO

PACKAGES = ("recipes", "pretrain", "resiliency", "launch", "drill", "bench")
NAMES = (
    "steps.jsonl",
    "eval.jsonl",
    "checkpoints.jsonl",
    "config.yaml",
    "launch-config.yaml",
    "run.json",
    "latest.json",
    "data-cache",
    "ft_timeouts.json",
    "LEASE.generation",
    "tensorboard",
)


def test_each_entry_name_is_spelt_in_one_module() -> None:
    owner = REPO / "pretrain" / "context" / "run_dir.py"
    spelt: dict[str, list[str]] = {name: [] for name in NAMES}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            text = path.read_text()
            for name in NAMES:
                if re.search(rf"([\"']){re.escape(name)}\1", text):
                    spelt[name].append(str(path.relative_to(REPO)))
    assert {n: p for n, p in spelt.items() if p != [str(owner.relative_to(REPO))]} == {}


def test_run_layout_names_its_entries_through_the_run_dir(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path, "run")
    paths = RunDir.of(tmp_path, "run")
    assert layout.dir == paths
    assert (layout.latest_path, layout.lease_path, layout.metrics_dir) == (
        tmp_path / "run" / "latest.json",
        tmp_path / "run" / "LEASE",
        tmp_path / "run" / "metrics",
    )
    assert paths.steps_metrics == tmp_path / "run" / "metrics" / "steps.jsonl"


def test_readers_skip_a_torn_line_and_keep_the_last_record_of_a_step(tmp_path: Path) -> None:
    path = RunDir(tmp_path).steps_metrics
    for step, loss in ((1, 3.0), (2, 2.5), (2, 2.4)):  # step 2 redone after a restart
        append_jsonl(path, {"step": step, "loss": loss})
    with path.open("a") as stream:
        stream.write(json.dumps({"step": 3, "loss": 2.0})[:9])  # killed mid-line
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 2]
    assert last_by_step(path)[2]["loss"] == 2.4
    assert read_jsonl(tmp_path / "missing.jsonl") == []
