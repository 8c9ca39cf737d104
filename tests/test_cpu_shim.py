"""Every CPU-shim patch is still needed (training fails without it) and still works.

"Works" is the rest of the suite: all training tests run with every patch applied.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pretrain import cpu_shim
from tests.helpers import run_pretrain

pytestmark = pytest.mark.slow

# patch -> (recipe whose training path needs it, text of the failure without it)
PROBES = {
    "current_device": ("gpt_tiny", "Torch not compiled with CUDA enabled"),
    "rng": ("gpt_tiny", "Torch not compiled with CUDA enabled"),
    "sync_and_streams": ("gpt_tiny_moe", "torch.cuda.Stream requires CUDA support"),
    "device_kwargs": ("gpt_tiny", "Torch not compiled with CUDA enabled"),
    "tensor_type": ("gpt_tiny", "Wrapped parameters must be one of torch.cuda.FloatTensor"),
    "moe_te_names": ("gpt_tiny_moe", "name 'te_general_gemm' is not defined"),
    "moe_split_sizes": ("gpt_tiny_moe", "all_to_all_single(): incompatible function arguments"),
}


def test_every_patch_has_a_probe_and_a_reason() -> None:
    assert set(PROBES) == {p.name for p in cpu_shim.PATCHES}
    assert all(p.reason and "\n" not in p.reason for p in cpu_shim.PATCHES)


@pytest.mark.parametrize("patch", list(PROBES))
def test_patch_is_still_needed(patch: str, tiny_overrides: list[str], tmp_path: Path) -> None:
    recipe, failure = PROBES[patch]
    proc = run_pretrain(2, [*tiny_overrides, f"recipe={recipe}", f"output_dir={tmp_path}",
                            "train.train_steps=2", "checkpoint.enabled=false"],
                        env={cpu_shim.SKIP_ENV: patch}, check=False, timeout=180)
    assert proc.returncode != 0, f"training passed without shim patch {patch!r}: remove it"
    assert failure in proc.stderr, proc.stderr[-3000:]


def test_unknown_skip_name_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_shim.SKIP_ENV, "no_such_patch")
    monkeypatch.setattr(cpu_shim, "_applied", [])
    with pytest.raises(ValueError, match="no_such_patch"):
        cpu_shim.apply()
