"""The state fingerprint (resiliency/checkpoint/fingerprint.py): exact, order-free, and moved
by any single flipped bit; the end-to-end refusal is in tests/integration/test_ckpt_faults.py."""

from __future__ import annotations

import pytest
import torch

from resiliency.checkpoint import fingerprint


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.uint8])
def test_one_flipped_bit_changes_the_digest(dtype: torch.dtype) -> None:
    tensor = (torch.arange(1000, dtype=torch.float64) / 7).to(dtype)
    flipped = tensor.clone()
    bits = flipped.view(
        {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    )
    bits[517] ^= 1
    assert fingerprint.tensor_digest(tensor) == fingerprint.tensor_digest(tensor.clone())
    assert fingerprint.tensor_digest(tensor) != fingerprint.tensor_digest(flipped)


def test_chunked_sums_equal_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    tensor = torch.randn(10_000, generator=torch.Generator().manual_seed(3))
    whole = fingerprint.tensor_digest(tensor)
    monkeypatch.setattr(fingerprint, "_CHUNK", 333)
    assert fingerprint.tensor_digest(tensor) == whole
    assert fingerprint.tensor_digest(tensor.reshape(100, 100).t().contiguous().t()) == whole


def test_state_fingerprint_covers_weights_main_params_and_moments() -> None:
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    saved = fingerprint.state_fingerprint([model], optimizer)
    assert {k.rsplit(".", 1)[-1] for k in saved} >= {"weight", "bias", "param", "exp_avg"}
    with torch.no_grad():
        optimizer.state[model.weight]["exp_avg_sq"][0, 0] *= 2
    changed = fingerprint.differences(saved, fingerprint.state_fingerprint([model], optimizer))
    assert len(changed) == 1 and changed[0].startswith("optimizer0.group0.0.exp_avg_sq: ")
