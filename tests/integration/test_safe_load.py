"""Nothing in a checkpoint runs code: a pickle naming a global off the allow-list is refused
unrun, by ``verify``, by the restore (which then uses the previous step) and at load time.

Unit: the static scan (resiliency/storage/pickle_scan.py) names what live payloads would run
(REDUCE, STACK_GLOBAL from memoized strings, INST) and refuses what it cannot name (EXT, a
STACK_GLOBAL of computed values); compat's load restrictions M-O are each needed (without one,
the payload runs) on this stack. End to end (one 2-rank training run shared): a forged
``model/.metadata`` that touches a marker and then returns the real metadata, re-sealed in the
manifest, is refused by ``python -m resiliency verify`` and skipped by a relaunch, which
restores the previous step and finishes; the same for a forged node-local file.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from pretrain.platform import compat
from pretrain.platform.checkpoint_globals import (
    DCP_METADATA,
    UnsafeCheckpointError,
    admitted_globals,
)
from resiliency.checkpoint.local.store import list_local_files
from resiliency.storage import pickle_scan
from resiliency.storage.checksum import file_checksum
from resiliency.storage.layout import RunLayout
from resiliency.storage.manifest import read_manifest
from tests.helpers import REPO, read_steps, recommit_file, run_pretrain

# On both stacks: what each megatron-core pickles, and the scan; the relaunches below are
# the same code on either (this leg only).
CURRENT_STACK = pytest.mark.current_stack
REFUSED = "which the checkpoint loader does not admit"


class _RunsCode:
    """Unpickles by touching ``marker`` and then returning ``result``: a payload that leaves
    the loaded checkpoint intact, so nothing but the marker tells that it ran."""

    def __init__(self, marker: Path, result: Any = None) -> None:
        self.marker, self.result = marker, result

    def __reduce__(self) -> tuple:
        code = f"(__import__('pathlib').Path({str(self.marker)!r}).touch(), result)[1]"
        return (eval, (code, {"result": self.result}))


class _Reduce:
    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple:
        return (self.func, self.args)


def _ustr(text: str) -> bytes:  # SHORT_BINUNICODE
    data = text.encode()
    return b"\x8c" + bytes([len(data)]) + data


def _memoized_stack_global(marker: Path) -> bytes:
    """subprocess.Popen named by memo gets of strings memoized (and popped) earlier."""
    return b"".join(
        [
            b"\x80\x04",
            _ustr("subprocess") + b"\x94" + b"0",  # push, MEMOIZE (0), POP
            _ustr("Popen") + b"\x94" + b"0",  # MEMOIZE (1), POP
            b"h\x00h\x01\x93",  # BINGET 0, BINGET 1, STACK_GLOBAL
            b"]" + _ustr("touch") + b"a" + _ustr(str(marker)) + b"a",  # ["touch", marker]
            b"\x85R.",  # TUPLE1, REDUCE, STOP
        ]
    )


EXT_CODE = 240


def _payloads(marker: Path) -> dict[str, tuple[bytes, str]]:
    """name: (pickle, what the refusal says)."""
    return {
        "reduce": (
            pickle.dumps(_Reduce(os.system, f"touch {marker}"), protocol=2),
            f"needs global '{os.system.__module__}.system', {REFUSED}",
        ),
        "stack_global": (
            pickle.dumps(_RunsCode(marker), protocol=4),
            f"needs global 'builtins.eval', {REFUSED}",
        ),
        "memoized_stack_global": (
            _memoized_stack_global(marker),
            f"needs global 'subprocess.Popen', {REFUSED}",
        ),
        "inst": (f"(S'touch {marker}'\nios\nsystem\n.".encode(), f"'os.system', {REFUSED}"),
        "ext": (
            b"\x80\x02\x82" + bytes([EXT_CODE]) + _ustr(f"touch {marker}") + b"\x85R.",
            "through the copyreg extension registry (EXT1 code 240)",
        ),
        "computed_names": (
            b"\x80\x04)\x94" + b"0" + b"h\x00" + _ustr("eval") + b"\x93.",
            "from values that are not plain strings",
        ),
    }


# The payloads are live: plain pickle runs them (EXT once a process registers the code).
_LOADS = (
    "import copyreg, os, pickle, sys, time\n"
    f"copyreg.add_extension(os.system.__module__, 'system', {EXT_CODE})\n"
    "pickle.loads(open(sys.argv[1], 'rb').read())\n"
    "time.sleep(0.5)  # Popen's child\n"
)


@pytest.mark.parametrize(
    "name", ["reduce", "stack_global", "memoized_stack_global", "inst", "ext", "computed_names"]
)
@CURRENT_STACK
def test_the_scan_refuses_live_payloads_without_running_them(name: str, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    data, says = _payloads(marker)[name]
    with pytest.raises(UnsafeCheckpointError, match="checkpoint file evil.pkl ") as refused:
        pickle_scan.check_pickle(data, "evil.pkl")
    assert says in str(refused.value) and "\n" not in str(refused.value)
    assert not marker.exists()
    (tmp_path / "evil.pkl").write_bytes(data)
    subprocess.run([sys.executable, "-c", _LOADS, str(tmp_path / "evil.pkl")], check=False)
    if name != "computed_names":  # that one is refused for what it might be, not what it is
        assert marker.exists(), f"payload {name} is not live: the test proves nothing"


@CURRENT_STACK
def test_the_scan_reads_torch_archives_and_dcp_items(tmp_path: Path) -> None:
    """A torch.save archive's data.pkl, and a DCP item at the offset .metadata gives it."""
    marker = tmp_path / "ran"
    torch.save({"rng": torch.arange(4)}, tmp_path / "good.pt")
    torch.save(_RunsCode(marker, torch.ones(2)), tmp_path / "evil.pt")
    model = tmp_path / "model"
    dcp.save({"w": torch.ones(3), "evil": _RunsCode(marker, 1)}, checkpoint_id=str(model))
    _sanitise_storage_meta(model)
    rels = ["good.pt", "model/.metadata", *(f"model/{p.name}" for p in model.glob("*.distcp"))]
    assert pickle_scan.step_pickle_problem(tmp_path, rels) is not None  # the evil item
    problem = pickle_scan.step_pickle_problem(tmp_path, ["evil.pt"])
    assert (
        problem
        == f"checkpoint file evil.pt (evil/data.pkl) needs global 'builtins.eval', {REFUSED}"
    )
    item = pickle_scan.step_pickle_problem(tmp_path, rels[1:])
    assert (
        item.startswith("checkpoint file model/__0_0.distcp at byte ") and "builtins.eval" in item
    )
    assert pickle_scan.step_pickle_problem(tmp_path, ["good.pt"]) is None
    assert not marker.exists()


@CURRENT_STACK
def test_the_scan_walks_each_admitted_pickle_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pickle the walk admitted is not walked again (same bytes, same allow-list); a refused
    one is refused every time, and an admission holds for its own allow-list only. A memo index
    past the pickle's end (C's unpickler would allocate for it) is refused."""
    walked: list[int] = []
    walk = pickle_scan.pickle_globals
    monkeypatch.setattr(
        pickle_scan, "pickle_globals", lambda data, where: walked.append(1) or walk(data, where)
    )
    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(tmp_path / "model"))
    _sanitise_storage_meta(tmp_path / "model")
    metadata = (tmp_path / "model" / ".metadata").read_bytes()
    for _ in range(3):
        pickle_scan.check_pickle(metadata, ".metadata")
    assert len(walked) == 1
    rels = ["model/.metadata", *(f"model/{p.name}" for p in (tmp_path / "model").glob("*.distcp"))]
    pickle_scan.check_step_files(tmp_path, rels)
    after_items = len(walked)
    assert after_items > 1  # the item's pickle, walked once
    pickle_scan.check_step_files(tmp_path, rels)  # .metadata offsets and the item remembered
    assert len(walked) == after_items
    walked.clear()
    evil, says = _payloads(tmp_path / "ran")["stack_global"]
    for _ in range(2):
        with pytest.raises(UnsafeCheckpointError, match="builtins.eval"):
            pickle_scan.check_pickle(evil, "evil.pkl")
    assert len(walked) == 2
    bomb = b"\x80\x02Nr\xff\xff\xff\x7f."  # None, LONG_BINPUT 2**31-1: a 32 GiB memo in C
    with pytest.raises(UnsafeCheckpointError, match="memo slot 2147483647, beyond its 9 bytes"):
        pickle_scan.check_pickle(bomb, "bomb.pkl")
    narrower = frozenset(admitted_globals() - {("torch", "Size")})
    with pytest.raises(UnsafeCheckpointError, match="torch.Size"):
        pickle_scan.check_pickle(metadata, ".metadata", narrower)
    assert not (tmp_path / "ran").exists()


def _sanitise_storage_meta(model: Path) -> None:
    """A plain DCP save records its path as a PosixPath (not admitted: megatron's saves do
    not); megatron-like metadata for the proofs below."""
    metadata = pickle.loads((model / ".metadata").read_bytes())  # our own file
    metadata.storage_meta.checkpoint_id = None
    (model / ".metadata").write_bytes(pickle.dumps(metadata))


# Each of compat's load restrictions, left out (MCORE_RECIPES_COMPAT_SKIP) or not.
_PROOF = """
import json, os, sys
from pathlib import Path
from pretrain.platform import compat
root = Path(sys.argv[1])
out = {"applied": compat.restrict_checkpoint_loads()}
def attempt(name, load):
    try:
        load()
        out[name] = "loaded"
    except BaseException as exc:  # DCP raises CheckpointException, a BaseException
        out[name] = f"{type(exc).__name__}: {exc}"
def metadata():
    from torch.distributed.checkpoint import FileSystemReader
    FileSystemReader(str(root / "m")).read_metadata()
def byte_item():
    import torch, torch.distributed.checkpoint as dcp
    dcp.load({"evil": None, "w": torch.zeros(3)}, checkpoint_id=str(root / "n"), no_dist=True)
def common_pt():
    if compat.mcore_version().startswith(compat.MCORE_0_16):
        from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy
        TorchCommonLoadStrategy().load_common(str(root / "o"))
    else:
        from megatron.core.dist_checkpointing import serialization
        serialization.load_common(str(root / "o"))
attempt("M", metadata)
attempt("N", byte_item)
attempt("O", common_pt)
print(json.dumps(out))
"""


def _proof_dirs(root: Path) -> None:
    for name in "mno":
        (root / name).mkdir(parents=True)
    plain = root / "plain"
    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(plain))
    _sanitise_storage_meta(plain)
    real = pickle.loads((plain / ".metadata").read_bytes())
    (root / "m" / ".metadata").write_bytes(pickle.dumps(_RunsCode(root / "ran-M", real)))
    dcp.save(
        {"w": torch.ones(3), "evil": _RunsCode(root / "ran-N", 1)}, checkpoint_id=str(root / "n")
    )
    _sanitise_storage_meta(root / "n")
    torch.save(_RunsCode(root / "ran-O", {"iteration": 1}), root / "o" / "common.pt")


@CURRENT_STACK
def test_each_load_restriction_is_needed(tmp_path: Path) -> None:
    """Without M, N or O the payload runs (O: with torch's TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD,
    which megatron's unset weights_only then obeys); with them each load is refused."""
    _proof_dirs(tmp_path)
    runs = {}
    for skip in ("M,N,O", ""):
        env = {**os.environ, compat.SKIP_ENV: skip, "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}
        proc = subprocess.run(
            [sys.executable, "-c", _PROOF, str(tmp_path)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[skip] = json.loads(proc.stdout.strip().splitlines()[-1])
        ran = {name for name in "MNO" if (tmp_path / f"ran-{name}").exists()}
        for name in "MNO":
            (tmp_path / f"ran-{name}").unlink(missing_ok=True)
        runs[skip]["ran"] = sorted(ran)
    unrestricted, restricted = runs["M,N,O"], runs[""]
    assert unrestricted["applied"] == [] and unrestricted["ran"] == ["M", "N", "O"]
    assert restricted["applied"] == ["M", "N", "O"] and restricted["ran"] == []
    for name in "MNO":
        assert f"needs global 'builtins.eval', {REFUSED}" in restricted[name], restricted[name]


@CURRENT_STACK
def test_load_restrictions_are_version_gated() -> None:
    assert [entry.name for entry in compat.SAFE_LOADS] == ["M", "N", "O"]
    assert all(entry.affected == compat.BOTH for entry in compat.SAFE_LOADS)
    assert set(compat.CHECKPOINT_GLOBALS) == set(compat.SUPPORTED_MCORE)
    assert admitted_globals("0.16.1") == admitted_globals("0.19.2")  # measured identical
    assert admitted_globals("0.17.0") == admitted_globals("0.19.2")  # unmeasured: the newest


@CURRENT_STACK
def test_every_admitted_global_exists_on_this_stack() -> None:
    """The list names real objects (a typo would admit nothing and refuse good files)."""
    import importlib

    import megatron.core.dist_checkpointing.tensor_aware_state_dict  # noqa: F401

    for module, qualname in admitted_globals():
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)


@CURRENT_STACK
def test_a_safe_load_round_trips_what_checkpoints_hold(tmp_path: Path) -> None:
    state = {
        "cpu_rng": torch.get_rng_state(),
        "cuda": [],
        "bf16": torch.ones(2, dtype=torch.bfloat16),
    }
    torch.save(state, tmp_path / "rank.pt")
    loaded = compat.safe_torch_load(tmp_path / "rank.pt", "rank.pt", map_location="cpu")
    assert (
        torch.equal(loaded["cpu_rng"], state["cpu_rng"]) and loaded["bf16"].dtype == torch.bfloat16
    )
    torch.save(_RunsCode(tmp_path / "ran"), tmp_path / "evil.pt")
    with pytest.raises(UnsafeCheckpointError, match="needs global 'builtins.eval'"):
        compat.safe_torch_load(tmp_path / "evil.pt", "evil.pt")
    # torch's legacy (non-zip) format is a raw pickle: refused unread (so the static scan,
    # which reads torch zip archives, passes over a .pt that is not one).
    (tmp_path / "legacy.pt").write_bytes(pickle.dumps(_RunsCode(tmp_path / "ran"), protocol=2))
    with pytest.raises(UnsafeCheckpointError, match="legacy.pt is not a torch zip archive"):
        compat.safe_torch_load(tmp_path / "legacy.pt", "legacy.pt")
    assert pickle_scan.step_pickle_problem(tmp_path, ["legacy.pt"]) is None
    assert not (tmp_path / "ran").exists()


# ----------------------------------------------------------------------------- end to end
# Persistent steps 2 and 4; node-local steps 1 and 3 (a step due for both tiers is persistent).
STEPS, SAVE_EVERY, LOCAL_STEP = 4, 2, 3


def _overrides(tiny: list[str], root: Path, local: bool = True) -> list[str]:
    return [
        *tiny,
        "parallel.tp=1",  # DP=2 with the distributed optimizer
        f"output_dir={root / 'runs'}",
        "run_id=run",
        f"train.train_steps={STEPS}",
        f"checkpoint.save_interval={SAVE_EVERY}",
        *(
            [
                "checkpoint.local.interval=1",
                "checkpoint.local.replication_factor=1",
                f"checkpoint.local.dir={root / 'local'}",
            ]
            if local
            else []
        ),
    ]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_overrides: list[str]) -> Path:
    root = tmp_path_factory.mktemp("safe-load")
    run_pretrain(2, _overrides(tiny_overrides, root))
    return root


def _copy(trained: Path, tmp_path: Path) -> Path:
    root = tmp_path / "copy"
    shutil.copytree(trained, root)
    return root


def _forge_metadata(step_dir: Path, marker: Path) -> None:
    """model/.metadata runs the payload, then is the real metadata; re-sealed as a careful
    forger would (size and crc32c in the manifest, its checksum in COMMITTED)."""
    path = step_dir / "model" / ".metadata"
    real = pickle.loads(path.read_bytes())  # this run's own file
    path.write_bytes(pickle.dumps(_RunsCode(marker, real)))
    recommit_file(step_dir, "model/.metadata")


def _verify(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "resiliency", "verify", str(path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _attempt(root: Path, attempt: int) -> dict:
    return json.loads(
        (root / "runs" / "run" / "attempts" / f"attempt-{attempt:02d}.json").read_text()
    )


@CURRENT_STACK
@pytest.mark.slow
def test_real_checkpoints_need_only_admitted_globals(trained: Path) -> None:
    """The allow-list, re-measured: every global of the run's pickles (both tiers) is listed,
    and every DCP metadata entry of it is used."""
    layout = RunLayout(trained / "runs", "run")
    found: set[tuple[str, str]] = set()
    for step in layout.published_steps():
        step_dir = layout.step_dir(step)
        rels = [e.path for e in read_manifest(step_dir).files]
        assert pickle_scan.step_pickle_problem(step_dir, rels) is None
        metadata = (step_dir / "model" / ".metadata").read_bytes()
        found |= set(pickle_scan.pickle_globals(metadata, ".metadata"))
        for rel in rels:
            if rel.endswith(".pt"):
                with (step_dir / rel).open("rb") as stream:
                    for where, data in pickle_scan.zip_pickles(stream, rel):
                        found |= set(pickle_scan.pickle_globals(data, where))
    local = sorted((trained / "local").rglob("*_local.pt"))
    assert local
    for path in local:
        with path.open("rb") as stream:
            for where, data in pickle_scan.zip_pickles(stream, path.name):
                found |= set(pickle_scan.pickle_globals(data, where))
    assert found <= admitted_globals(), sorted(found - admitted_globals())
    assert DCP_METADATA <= found, sorted(DCP_METADATA - found)


@CURRENT_STACK
@pytest.mark.slow
def test_verify_refuses_a_forged_metadata_without_running_it(trained: Path, tmp_path: Path) -> None:
    root, marker = _copy(trained, tmp_path), tmp_path / "ran"
    layout = RunLayout(root / "runs", "run")
    _forge_metadata(layout.step_dir(STEPS), marker)
    bad = _verify(layout.step_dir(STEPS))
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert f"checkpoint file model/.metadata needs global 'builtins.eval', {REFUSED}" in bad.stdout
    run = _verify(root / "runs" / "run")
    assert run.returncode == 1 and "newest verified: step 2" in run.stdout, run.stdout
    assert _verify(layout.step_dir(SAVE_EVERY)).returncode == 0  # a real step passes the scan
    assert not marker.exists()
    # ... and the forged file is live: plain unpickling runs it.
    load = "import pickle, sys; pickle.loads(open(sys.argv[1], 'rb').read())"
    metadata = layout.step_dir(STEPS) / "model" / ".metadata"
    subprocess.run([sys.executable, "-c", load, str(metadata)], check=True, capture_output=True)
    assert marker.exists()


@pytest.mark.slow
def test_a_relaunch_skips_the_forged_step_and_restores_the_previous_one(
    trained: Path, tmp_path: Path, tiny_overrides: list[str]
) -> None:
    root, marker = _copy(trained, tmp_path), tmp_path / "ran"
    layout = RunLayout(root / "runs", "run")
    _forge_metadata(layout.step_dir(STEPS), marker)
    # Without checksums at restore the pickle scan still runs, before any load.
    overrides = [*_overrides(tiny_overrides, root, local=False), "checkpoint.full_verify=false"]
    proc = run_pretrain(2, overrides)
    assert f"restore: step {STEPS} failed its re-hash" in proc.stderr
    assert "needs global 'builtins.eval'" in proc.stderr
    assert f"resumed from step-{SAVE_EVERY:09d} at step {SAVE_EVERY}" in proc.stderr
    assert _attempt(root, 2)["restored_step"] == SAVE_EVERY
    assert max(read_steps(root / "runs" / "run")) == STEPS  # finished
    assert _verify(layout.step_dir(STEPS)).returncode == 0  # step 4 saved again, clean
    assert not marker.exists()


@pytest.mark.slow
def test_a_forged_local_tier_file_is_rejected_unrun(
    trained: Path, tmp_path: Path, tiny_overrides: list[str]
) -> None:
    """Persistent step 4 forged, so the newest verified persistent step is 2, and rank 1's
    node-local step 3, which would have been restored instead: the local tier rejects that
    file unrun (its sidecar re-sealed too) and the restore takes persistent step 2."""
    root, marker = _copy(trained, tmp_path), tmp_path / "ran"
    _forge_metadata(RunLayout(root / "runs", "run").step_dir(STEPS), marker)
    rank_dir = next((root / "local").glob("node-*/run/1"))
    entry = next(f for f in list_local_files(rank_dir) if f.step == LOCAL_STEP)
    real = torch.load(entry.path, weights_only=False)  # this run's own file
    torch.save(_RunsCode(marker, real), entry.path)
    meta = json.loads(entry.meta_path.read_text())
    meta.update(bytes=entry.path.stat().st_size, crc32c=file_checksum(entry.path))
    entry.meta_path.write_text(json.dumps(meta))
    proc = run_pretrain(2, _overrides(tiny_overrides, root))
    assert f"{entry.path.name} rejected: checkpoint file {entry.path.name}" in proc.stderr
    assert "needs global 'builtins.eval'" in proc.stderr
    assert f"newest complete step 1 is not newer than persistent step {SAVE_EVERY}" in proc.stderr
    assert _attempt(root, 2)["restored_tier"] == "persistent"
    assert _attempt(root, 2)["restored_step"] == SAVE_EVERY
    assert max(read_steps(root / "runs" / "run")) == STEPS
    assert not marker.exists()
