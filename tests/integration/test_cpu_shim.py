"""Every CPU-shim patch is still needed where applied (training fails without it), is not
applied on a megatron-core release that does not need it, and still works.

"Works" is the rest of the suite: all training tests run with every needed patch applied. The
module runs on both CI legs (megatron-core 0.16.1 with torch +cpu; 0.19.2 with PyPI's CUDA torch
build, whose "no CUDA" errors read differently).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.platform import compat, cpu_shim
from tests.helpers import REPO, run_pretrain

pytestmark = [pytest.mark.slow, pytest.mark.current_stack]
NO_CUDA = (
    "Torch not compiled with CUDA enabled",  # torch +cpu
    "Found no NVIDIA driver on your system",
)  # a CUDA build of torch on a CPU host

# patch -> (recipe whose training path needs it, texts of the failure without it)
PROBES = {
    "current_device": ("gpt_tiny", NO_CUDA),
    "rng": ("gpt_tiny", NO_CUDA),
    "sync_and_streams": (
        "gpt_tiny_moe",
        ("torch.cuda.Stream requires CUDA support", "CUDA driver version is insufficient"),
    ),
    "device_kwargs": ("gpt_tiny", NO_CUDA),
    "tensor_type": ("gpt_tiny", ("Wrapped parameters must be one of torch.cuda.FloatTensor",)),
    "moe_te_names": ("gpt_tiny_moe", ("name 'te_general_gemm' is not defined",)),
    "moe_split_sizes": ("gpt_tiny_moe", ("all_to_all_single(): incompatible function arguments",)),
}


def test_every_patch_has_a_probe_and_a_reason() -> None:
    assert set(PROBES) == {p.name for p in cpu_shim.PATCHES}
    assert all(p.reason and "\n" not in p.reason for p in cpu_shim.PATCHES)


def _train_without(patch: str, tiny_overrides: list[str], tmp_path: Path):
    recipe = PROBES[patch][0]
    return run_pretrain(
        2,
        [
            *tiny_overrides,
            f"recipe={recipe}",
            f"output_dir={tmp_path}",
            "train.train_steps=2",
            "checkpoint.enabled=false",
        ],
        env={cpu_shim.SKIP_ENV: patch},
        check=False,
        timeout=180,
    )


@pytest.mark.parametrize("patch", list(PROBES))
def test_patch_is_still_needed(patch: str, tiny_overrides: list[str], tmp_path: Path) -> None:
    if patch not in cpu_shim.needed():
        pytest.skip(
            f"not applied on megatron-core {compat.mcore_version()} "
            "(test_unneeded_patches_are_not_applied covers it)"
        )
    proc = _train_without(patch, tiny_overrides, tmp_path)
    assert proc.returncode != 0, f"training passed without shim patch {patch!r}: remove it"
    assert any(text in proc.stderr for text in PROBES[patch][1]), proc.stderr[-3000:]


def test_patches_are_version_gated() -> None:
    every = [p.name for p in cpu_shim.PATCHES]
    assert cpu_shim.needed("0.16.1") == every
    # measured on 0.19.2: MoE trains without moe_te_names (moe_utils checks HAVE_TE first)
    assert cpu_shim.needed("0.19.2") == [p for p in every if p != "moe_te_names"]


def test_unneeded_patches_are_not_applied(tiny_overrides: list[str], tmp_path: Path) -> None:
    unneeded = [p.name for p in cpu_shim.PATCHES if p.name not in cpu_shim.needed()]
    if not unneeded:
        pytest.skip(f"every patch is needed on megatron-core {compat.mcore_version()}")
    code = "from pretrain.platform import cpu_shim; print(','.join(cpu_shim.apply()))"
    applied = (
        subprocess.run(
            [sys.executable, "-c", code],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        .stdout.split()[-1]
        .split(",")
    )
    assert applied == cpu_shim.needed()
    for patch in unneeded:  # and the training path that needed it trains without it
        proc = _train_without(patch, tiny_overrides, tmp_path / patch)
        assert proc.returncode == 0, proc.stderr[-3000:]


def test_unknown_skip_name_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_shim.SKIP_ENV, "no_such_patch")
    monkeypatch.setattr(cpu_shim, "_applied", [])
    with pytest.raises(ValueError, match="no_such_patch"):
        cpu_shim.apply()
