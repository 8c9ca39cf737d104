"""checkpoint.signing_key_env: every published step carries an HMAC of its manifest, and a
restore from any tier rejects a step whose signature is missing or wrong (falling back to the
previous step). Unit tests of the pieces, then one real signed run that a forger edits."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from bench.s3_server import S3Server
from pretrain.context import exit_codes
from recipes import ConfigError, load_config
from resiliency.checkpoint.local.store import REJECTED_SUFFIX, VerifiedLocalManager
from resiliency.storage.checksum import file_checksum
from resiliency.storage.layout import MANIFEST_NAME, RunLayout
from resiliency.storage.object_store import ObjectStore
from resiliency.storage.publish import begin_step, publish, write_manifest_and_commit
from resiliency.storage.remote import fetch_newest, upload_step, verify_remote_step
from resiliency.storage.select import select_restore_step
from resiliency.storage.signing import (
    SIGNATURE_PREFIX,
    key_from_env,
    marker_text,
    parse_marker,
    record_problem,
    sign_record,
    signature_problem,
)
from resiliency.storage.synthetic import synthetic_manifest, write_payload
from resiliency.storage.verify import verify_step_dir
from tests.helpers import REPO, recommit_file, run_pretrain

ENV = "CKPT_KEY"
KEY = key_from_env(ENV, {ENV: "the-run-key"})
OTHER = key_from_env(ENV, {ENV: "another-key"})
UNSIGNED = f"manifest is not signed (checkpoint.signing_key_env={ENV} is set)"
MISMATCH = f"manifest signature does not match the key in ${ENV}"


def _step(layout: RunLayout, step: int, signed: bool, algorithm: str | None = None) -> Path:
    tmp = begin_step(layout, step, 1)
    write_payload(tmp, step)
    algorithm = algorithm or ("sha256" if signed else "crc32c")
    manifest = synthetic_manifest(layout, step, 1, tmp, algorithm=algorithm)
    write_manifest_and_commit(tmp, manifest, KEY if signed else None)
    return publish(layout, tmp, step)


# ------------------------------------------------------------------------------ unit


def test_sign_and_check() -> None:
    raw = b'{"step": 10}'
    text = marker_text(raw, KEY)
    checksum, signature = parse_marker(text)
    assert text.splitlines()[1] == SIGNATURE_PREFIX + signature
    assert parse_marker(marker_text(raw, None)) == (checksum, None)  # the first line unchanged
    assert signature_problem(raw, signature, KEY) is None
    assert signature_problem(raw, signature, OTHER) == MISMATCH
    assert signature_problem(raw + b" ", signature, KEY) == MISMATCH
    assert signature_problem(raw, None, KEY) == UNSIGNED
    assert signature_problem(raw, None, None) is None  # no key: nothing required
    assert signature_problem(raw, "0" * 64, None) is None  # nor looked at
    assert "the-run-key" not in repr(KEY)


def test_a_named_key_variable_must_hold_a_key() -> None:
    assert key_from_env(None) is None
    with pytest.raises(ConfigError, match=rf"signing_key_env={ENV}: \${ENV} is not set"):
        key_from_env(ENV, {})
    with pytest.raises(ConfigError, match=rf"\${ENV} is empty"):
        key_from_env(ENV, {ENV: ""})
    with pytest.raises(ConfigError, match="name of an environment variable"):
        load_config(["recipe=gpt_tiny", "checkpoint.signing_key_env='my secret'"])


def test_unset_key_is_one_config_error_before_any_model(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    proc = subprocess.run(
        [sys.executable, "-m", "pretrain", "recipe=gpt_tiny", "data=mock",
         f"checkpoint.signing_key_env={ENV}", f"output_dir={tmp_path / 'runs'}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == exit_codes.CONFIG_ERROR, proc.stderr[-2000:]
    assert f"config error: checkpoint.signing_key_env={ENV}: ${ENV} is not set" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "runs").exists()


def test_restore_skips_unsigned_and_wrongly_signed_steps(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path, "run")
    _step(layout, 2, signed=True)
    forged = _step(layout, 4, signed=False)
    assert verify_step_dir(forged, "run", full=False).ok  # its checksums are all fine
    chosen = select_restore_step(layout, "run", full_verify=False, key=KEY)
    assert chosen.step == 2
    assert chosen.skipped[-1] == ("step-000000004", UNSIGNED)  # after latest.json's hint
    assert select_restore_step(layout, "run", full_verify=False).step == 4  # no key: ignored
    wrong = select_restore_step(layout, "run", full_verify=False, key=OTHER)
    assert wrong.step is None
    assert wrong.skipped[1:] == [("step-000000004", UNSIGNED), ("step-000000002", MISMATCH)]


def test_a_signature_over_crc32c_checksums_is_refused(tmp_path: Path) -> None:
    """crc32c is linear: a forger who edits a file can restore its crc32c (and size) with
    four more edited bytes, so a signature over crc32c entries would not bind the bytes."""
    layout = RunLayout(tmp_path, "run")
    weak = _step(layout, 2, signed=True, algorithm="crc32c")
    verdict = verify_step_dir(weak, "run", full=True, key=KEY)
    assert not verdict.ok
    assert "checksummed with crc32c, which an edit can match" in verdict.reason
    assert verify_step_dir(weak, "run", full=True).ok  # unkeyed: crc32c is fine
    strong = _step(layout, 4, signed=True)
    assert verify_step_dir(strong, "run", full=True, key=KEY).ok
    manifest = json.loads((strong / MANIFEST_NAME).read_text())
    assert {entry["algorithm"] for entry in manifest["files"]} == {"sha256"}


def test_a_remote_step_must_be_signed_too(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the real object store (SeaweedFS), uploaded by the real uploader."""
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    store = ObjectStore(s3.url(f"signing-{uuid.uuid4().hex[:8]}"), s3.endpoint_url, workers=2)
    source = RunLayout(tmp_path / "source", "run")
    upload_step(store, _step(source, 2, signed=True), "run", 2)
    upload_step(store, _step(source, 4, signed=False), "run", 2)
    verdict = verify_remote_step(store, "run", 4, full=True, key=KEY)
    assert not verdict.ok and verdict.reason == UNSIGNED
    assert verify_remote_step(store, "run", 4, full=True).ok
    fresh = RunLayout(tmp_path / "fresh", "run")
    fetched = fetch_newest(store, fresh, 1, 2, key=KEY)
    assert fetched == fresh.step_dir(2) and fresh.published_steps() == [2]
    assert verify_step_dir(
        fetched, "run", full=False, key=KEY
    ).ok  # re-published with its signature


@pytest.mark.current_stack
def test_local_sidecars_are_signed_and_checked(tmp_path: Path) -> None:
    record = {"step": 4, "crc32c": "00ff00ff", "bytes": 10}
    signed = sign_record(record, KEY)
    assert record_problem(signed, KEY) is None and record_problem(record, None) is None
    assert (
        record_problem(record, KEY)
        == f"sidecar is not signed (checkpoint.signing_key_env={ENV} is set)"
    )
    assert record_problem({**signed, "crc32c": "12345678"}, KEY) == (
        f"sidecar signature does not match the key in ${ENV}"
    )
    manager = VerifiedLocalManager(tmp_path, "run", {"world_size": 1}, keep_last=3, key=KEY)
    manager._rank = 0  # no process group needed for the file side
    for step in (1, 2):
        manager._save({"w": torch.full((4,), float(step))}, (step, 0, "run"))
    # A writer without the key replaces step 2 and rewrites its sidecar to match.
    path = manager.rank_dir / "iter_0000002_0_local.pt"
    torch.save({"w": torch.zeros(4)}, path)
    meta_path = path.with_name(path.name + ".meta.json")
    meta = json.loads(meta_path.read_text())
    meta.update(bytes=path.stat().st_size, crc32c=file_checksum(path))
    meta_path.write_text(json.dumps(meta))
    fresh = VerifiedLocalManager(tmp_path, "run", {"world_size": 1}, keep_last=3, key=KEY)
    fresh._rank = 0
    assert [i[0] for i in fresh._my_ckpt_ids()] == [1]
    assert (manager.rank_dir / f"iter_0000002_0_local.pt{REJECTED_SUFFIX}").is_file()
    unkeyed = VerifiedLocalManager(tmp_path / "plain", "run", {"world_size": 1}, keep_last=3)
    unkeyed._rank = 0
    unkeyed._save({"w": torch.ones(2)}, (5, 0, "run"))
    keyed = VerifiedLocalManager(tmp_path / "plain", "run", {"world_size": 1}, keep_last=3, key=KEY)
    keyed._rank = 0
    assert keyed._my_ckpt_ids() == []  # saved unsigned: not trusted under a key


# ----------------------------------------------------------------------- real runs

RUN = "signed"


def _overrides(tiny: list[str], root: Path) -> list[str]:
    return [
        *tiny,
        f"output_dir={root}",
        f"run_id={RUN}",
        "train.train_steps=4",
        "checkpoint.save_interval=2",
        f"checkpoint.signing_key_env={ENV}",
    ]


@pytest.fixture(scope="module")
def signed_run(tiny_overrides: list[str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One signed run of 4 steps, steps 2 and 4 published; tests copy it before editing."""
    root = tmp_path_factory.mktemp("signed") / "runs"
    run_pretrain(2, _overrides(tiny_overrides, root), env={ENV: "the-run-key"})
    return root


def _verify(run_dir: Path, key: str | None, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if key is not None:
        env[ENV] = key
    return subprocess.run(
        [sys.executable, "-m", "resiliency", "verify", str(run_dir), *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.slow
def test_a_forged_step_is_rejected_and_the_previous_one_restored(
    signed_run: Path, tiny_overrides: list[str], tmp_path: Path
) -> None:
    root = Path(shutil.copytree(signed_run, tmp_path / "runs"))
    layout = RunLayout(root, RUN)
    assert layout.published_steps() == [2, 4]
    for step in (2, 4):
        verdict = verify_step_dir(layout.step_dir(step), RUN, key=KEY)
        assert verdict.ok and {e.algorithm for e in verdict.manifest.files} == {"sha256"}
    # The forger edits a payload file of the newest step and re-seals it: checksums agree.
    state = layout.step_dir(4) / "train_state.json"
    state.write_text(json.dumps({**json.loads(state.read_text()), "forged": True}))
    recommit_file(layout.step_dir(4), "train_state.json")

    assert _verify(layout.run_dir, None).returncode == 0  # without a key nothing tells
    keyed = _verify(layout.run_dir, "the-run-key", "--signing-key-env", ENV)
    assert keyed.returncode == 1, keyed.stdout
    assert f"BAD step-000000004: {UNSIGNED}" in keyed.stdout
    assert "OK  step-000000002" in keyed.stdout
    wrong = _verify(layout.run_dir, "another-key", "--signing-key-env", ENV, "--quick")
    assert wrong.returncode == 1 and f"BAD step-000000002: {MISMATCH}" in wrong.stdout
    unset = _verify(layout.run_dir, None, "--signing-key-env", ENV)
    assert unset.returncode == 2 and f"${ENV} is not set" in unset.stdout

    relaunch = run_pretrain(2, _overrides(tiny_overrides, root), env={ENV: "the-run-key"})
    assert f"step-000000004: {UNSIGNED}" in relaunch.stderr
    attempts = sorted(layout.attempts_dir.glob("attempt-*.json"))
    assert json.loads(attempts[-1].read_text())["restored_step"] == 2
    assert list(layout.steps_dir.glob(".rejected-step-000000004-*"))  # set aside, kept
    assert verify_step_dir(layout.step_dir(4), RUN, key=KEY).ok  # trained again, signed
