"""``python -m resiliency capacity``: sizes, storage, Young interval vs. hand-computed figures."""

from __future__ import annotations

import math

import pytest

from resiliency.cli import main
from resiliency.cli.capacity import Interval, Storage, checkpoint_size, parse_count, parse_duration

# params -> (bytes per version at 14 B/param, x keep 3, +20 %, +30 %), worked out by hand
HAND = {
    "7B": (98e9, 294e9, 352.8e9, 382.2e9),
    "70e9": (980e9, 2.94e12, 3.528e12, 3.822e12),
    "405B": (5.67e12, 17.01e12, 20.412e12, 22.113e12),
}


@pytest.mark.parametrize("params", sorted(HAND))
def test_sizes_match_hand_figures(params: str) -> None:
    version, kept, low, high = HAND[params]
    size = checkpoint_size(parse_count(params), "adam", "bf16")
    assert size.bytes_per_param == 14
    assert [c.bytes_per_param for c in size.components] == [2, 4, 8]
    assert size.bytes == pytest.approx(version)
    storage = Storage(size.bytes, keep=3)
    assert storage.retained_bytes == pytest.approx(kept)
    assert storage.with_headroom() == (pytest.approx(low), pytest.approx(high))


@pytest.mark.parametrize(
    "optimizer, dtype, per_param",
    [
        ("adam", "bf16", 14),
        ("adam", "fp16", 14),
        ("adam", "fp32", 16),  # megatron's optimizer saves fp32 main params for fp32 too
        ("sgd", "bf16", 10),
        ("sgd", "fp32", 12),
    ],
)
def test_bytes_per_param(optimizer: str, dtype: str, per_param: int) -> None:
    assert checkpoint_size(1e9, optimizer, dtype).bytes_per_param == per_param


def test_young_interval() -> None:
    interval = Interval(save_s=30, mtbf_s=3 * 3600)
    assert interval.young_s == pytest.approx(math.sqrt(2 * 30 * 10800))  # 804.98 s
    assert interval.young_s == pytest.approx(804.984, abs=1e-3)
    assert interval.expected_loss_s == pytest.approx(804.984 / 2 + 30, abs=1e-3)


@pytest.mark.parametrize(
    "text, value",
    [
        ("70e9", 70e9),
        ("7B", 7e9),
        ("405B", 405e9),
        ("405b", 405e9),
        ("1.5T", 1.5e12),
        ("125M", 125e6),
        ("7000000000", 7e9),
        ("7_000_000_000", 7e9),
    ],
)
def test_parse_count(text: str, value: float) -> None:
    assert parse_count(text) == pytest.approx(value)


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("3h", 10800),
        ("90m", 5400),
        ("45s", 45),
        ("1d", 86400),
        ("1h30m", 5400),
        ("30", 30),
        ("2.5h", 9000),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["3x", "h", "", "-5", "1h30"])
def test_bad_durations_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(bad)


@pytest.mark.parametrize("bad", ["seventy", "0", "7Q"])
def test_bad_counts_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_count(bad)


def test_a_bare_small_count_is_refused_naming_the_scaled_forms() -> None:
    with pytest.raises(ValueError, match="give the count with its scale, e.g. 70e9 or 70B"):
        parse_count("70")


def test_cli_prints_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "plan",
                "--params",
                "70e9",
                "--optimizer",
                "adam",
                "--dtype",
                "bf16",
                "--keep",
                "3",
                "--mtbf",
                "3h",
                "--save-seconds",
                "30",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    for needle in (
        "14 B/param  total = 980.00 GB (912.7 GiB) per version",
        "keeping 3 version(s): 2.94 TB",
        "3.53 TB - 3.82 TB",
        "= 13.4 min",
        "interval/2 + save = 7.2 min",
        "gradients",
        "RNG",
        "indices",
    ):
        assert needle in out, (needle, out)


def test_cli_refuses_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--params", "lots"]) == 2
    assert "parameter count" in capsys.readouterr().out
    assert main(["plan", "--params", "7B", "--mtbf", "soon"]) == 2
