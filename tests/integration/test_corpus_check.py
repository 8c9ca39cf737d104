"""A resume compares the dataset's index files with the checksums its step recorded: a corpus
rebuilt under the same prefix is refused (exit 2), or resumed with data.allow_changed_corpus=true
and the differences logged. Unit tests of the comparison, then one real run whose corpus is
rebuilt."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pretrain.context import exit_codes
from pretrain.data.prepare.corpus import dataset_prefix, prepare_corpus, stdlib_documents
from pretrain.data.tokenizer import build_tokenizer
from recipes import ConfigError, load_config
from resiliency.checkpoint.restore import plan as restore_plan
from resiliency.storage.checksum import file_checksum
from resiliency.storage.corpus import corpus_changes, describe_change
from resiliency.storage.manifest import Manifest
from tests.ft_helpers import env
from tests.helpers import REPO, run_pretrain

CORPUS_BYTES = 1 << 20  # as conftest's: enough samples for the tiny recipe's splits


def _index(directory: Path, name: str, content: bytes) -> str:
    prefix = str(directory / name)
    Path(prefix + ".idx").write_bytes(content)
    return prefix


# ------------------------------------------------------------------------------ unit


def test_changes_name_the_prefix_the_file_and_both_checksums(tmp_path: Path) -> None:
    a, b = _index(tmp_path, "a", b"index a"), _index(tmp_path, "b", b"index b")
    saved = {a + ".idx": file_checksum(Path(a + ".idx")), b + ".idx": "0badc0de"}
    assert corpus_changes({a + ".idx": saved[a + ".idx"]}, [a]) == []
    changed, = corpus_changes(saved, [a, b])  # fmt: skip
    assert changed == {"prefix": b, "file": b + ".idx", "change": "changed",
                       "saved": "0badc0de", "now": file_checksum(Path(b + ".idx"))}  # fmt: skip
    assert describe_change(changed) == (
        f"prefix {b}: {b}.idx has checksum {changed['now']}, the checkpoint recorded 0badc0de"
    )
    Path(b + ".idx").write_bytes(b"rebuilt, same size")  # the cache never hides a rewrite
    assert corpus_changes(saved, [a, b])[0]["now"] == file_checksum(Path(b + ".idx"))
    c = str(tmp_path / "c")
    kinds = {(x["prefix"], x["change"]) for x in corpus_changes(saved, [b, c])}
    assert kinds == {(a, "removed"), (b, "changed"), (c, "added")}
    Path(b + ".idx").unlink()
    missing, = corpus_changes(saved, [a, b])  # fmt: skip
    assert missing["change"] == "missing" and missing["now"] is None
    assert "is missing (the checkpoint recorded checksum 0badc0de)" in describe_change(missing)


@pytest.fixture()
def one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """check_corpus without a process group: rank 0, a broadcast that returns its value."""
    monkeypatch.setattr(restore_plan.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(restore_plan, "broadcast_object", lambda value: value)


def _manifest(index_files: dict[str, str] | None, kind: str = "indexed") -> Manifest:
    dataset = {} if index_files is None else {"index_files": index_files}
    return Manifest("r", 1, 10, 1, dataset=dataset, config={"data": {"kind": kind}})


def test_check_corpus_refuses_warns_or_skips(
    one_rank: None, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    prefix = _index(tmp_path, "corpus", b"now")
    step = tmp_path / "runs" / "r" / "steps" / "step-000000010"
    cache = tmp_path / "runs" / "r" / "data-cache"
    cache.mkdir(parents=True)
    run = load_config(["recipe=gpt_tiny", "run_id=r", f"data.paths=[{prefix}]"])
    saved = _manifest({prefix + ".idx": "0badc0de"})
    with pytest.raises(ConfigError) as refused:
        restore_plan.check_corpus(run, saved, step, cache.parent)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("restore refused: step-000000010")
    assert f"prefix {prefix}: {prefix}.idx has checksum" in message and "0badc0de" in message
    assert "data.allow_changed_corpus=true" in message and "another run_id" in message
    assert cache.is_dir()  # a refusal changes nothing

    allowed = load_config(["recipe=gpt_tiny", "run_id=r", f"data.paths=[{prefix}]",
                           "data.allow_changed_corpus=true"])  # fmt: skip
    changes = restore_plan.check_corpus(allowed, saved, step, cache.parent)
    assert changes is not None and changes[0]["prefix"] == prefix
    assert "data.allow_changed_corpus=true: resuming step-000000010" in caplog.text
    assert not cache.exists()  # built from the old corpus: rebuilt

    now = {prefix + ".idx": file_checksum(Path(prefix + ".idx"))}
    assert restore_plan.check_corpus(run, _manifest(now), step, cache.parent) is None
    assert restore_plan.check_corpus(run, _manifest(None), step, cache.parent) is None  # older
    mock = load_config(["recipe=gpt_tiny", "run_id=r", "data=mock"])
    assert restore_plan.check_corpus(mock, _manifest({}, "mock"), step, cache.parent) is None


# ----------------------------------------------------------------------- real runs

RUN = "corpus"


def _build(prefix: str, reverse: bool) -> None:
    documents = list(stdlib_documents(CORPUS_BYTES))
    prepare_corpus(documents[::-1] if reverse else documents, prefix, build_tokenizer("byte"))


@pytest.fixture(scope="module")
def corpus_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, list[str]]:
    """Its own corpus (the test rebuilds it) and one run of 2 steps on it, step 2 published."""
    root = tmp_path_factory.mktemp("corpus-run")
    out = str(root / "data" / "mine")
    Path(out).parent.mkdir()
    _build(out, reverse=False)
    prefix = dataset_prefix(out)
    base = [
        "recipe=gpt_tiny",
        f"data.paths=[{prefix}]",
        "train.micro_batch_size=2",
        "train.global_batch_size=8",
        f"output_dir={root / 'runs'}",
        f"run_id={RUN}",
        "checkpoint.save_interval=2",
        "scheduler.decay_steps=4",  # the same schedule in every launch
    ]
    run_pretrain(2, [*base, "train.train_steps=2"])
    return root, out, base


def _relaunch(overrides: list[str]) -> subprocess.CompletedProcess:
    """Through python -m launch.torchrun: the exit code is the failing rank's."""
    return subprocess.run(
        [sys.executable, "-m", "launch.torchrun", "--standalone", "--nproc-per-node=2",
         "-m", "pretrain", *overrides],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=env(),
    )  # fmt: skip


@pytest.mark.slow
def test_a_rebuilt_corpus_is_refused_unless_allowed(
    corpus_run: tuple[Path, str, list[str]],
) -> None:
    root, out, base = corpus_run
    prefix = dataset_prefix(out)
    step = root / "runs" / RUN / "steps" / "step-000000002"
    recorded = json.loads((step / "manifest.json").read_text())["dataset"]["index_files"]
    assert list(recorded) == [prefix + ".idx"]
    _build(out, reverse=True)  # the same documents in another order, under the same prefix
    assert file_checksum(Path(prefix + ".idx")) != recorded[prefix + ".idx"]

    # launch local refuses it before any rank starts: one line, exit 2, nothing started.
    started = time.monotonic()
    launched = subprocess.run(
        [sys.executable, "-m", "launch", "local", *base, "train.train_steps=4",
         "launch.nproc_per_node=2"],
        cwd=REPO, capture_output=True, text=True, timeout=120, env=env(),
    )  # fmt: skip
    assert launched.returncode == exit_codes.CONFIG_ERROR, launched.stderr[-3000:]
    assert time.monotonic() - started < 10  # no rank: the launcher's own judgement
    [line] = [ln for ln in launched.stderr.splitlines() if "ERROR" in ln]
    assert "restore refused: step-000000002 was trained on another corpus" in line
    assert "[rank 1]" not in launched.stderr and "Traceback" not in launched.stderr

    refused = _relaunch([*base, "train.train_steps=4"])
    assert refused.returncode == exit_codes.CONFIG_ERROR, refused.stderr[-3000:]
    # Each rank logs the same one line.
    messages = {line.split("restore refused")[1] for line in refused.stderr.splitlines()
                if "restore refused" in line}  # fmt: skip
    assert len(messages) == 1, refused.stderr[-3000:]
    (message,) = messages
    assert f"prefix {prefix}: {prefix}.idx has checksum" in message
    assert recorded[prefix + ".idx"] in message and "data.allow_changed_corpus=true" in message
    assert "Traceback" not in refused.stderr
    assert not (step.parent / "step-000000004").exists()

    allowed = run_pretrain(2, [*base, "train.train_steps=4", "data.allow_changed_corpus=true"])
    assert "data.allow_changed_corpus=true: resuming step-000000002 on a changed corpus" in (
        allowed.stderr
    )
    attempts = sorted((root / "runs" / RUN / "attempts").glob("attempt-*.json"))
    record = json.loads(attempts[-1].read_text())
    assert record["restored_step"] == 2
    assert record["corpus_changes"][0]["prefix"] == prefix  # what the plan found, recorded
    newest = json.loads((step.parent / "step-000000004" / "manifest.json").read_text())
    assert newest["dataset"]["index_files"] == {
        prefix + ".idx": file_checksum(Path(prefix + ".idx"))
    }
