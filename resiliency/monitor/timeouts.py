"""Learned, bounded hang timeouts for every section a rank reports to its rank monitor.

Sections: ``setup`` (connect -> first step: model build, restore), ``step``, ``eval``,
``checkpointing`` (sync saves, async commits, local-tier saves, the final save) and the time
outside any section. The rule, per section:

* learned, once observed (``learn_after_steps`` times for step and out-of-section, once for the
  others): ``timeout_multiplier`` x the p99 of the observed durations, never below
  ``timeout_floor_s``. With the defaults (3 x p99, 30 s) a hung rank is torn down within
  max(3 x p99, 30 s) + the monitor's check interval;
* before the first observation, bounded from what is known: ``<section>_timeout_s``, and for
  ``checkpointing`` (and ``setup`` when it restores) plus this rank's checkpoint bytes at the
  conservative ``min_io_mb_per_s``, instead of one fixed 15 minutes.

Observations persist in ``<run_dir>/ft_timeouts.json``, so a restarted attempt starts with what
the previous one learned. Pure Python: no nvrx, no torch (unit-testable, cheap).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from recipes.config.resiliency import FtConfig

SECTIONS = ("setup", "step", "eval", "checkpointing")
OUT_OF_SECTION = "out_of_section"
MAX_SAMPLES = 256  # newest durations kept per section: a p99 of a long run's recent behaviour
CHANGE = 0.1  # tell the rank monitor only when a timeout moved by more than this fraction
# Checkpoint bytes per parameter before a checkpoint exists: fp32 weights and main copy plus two
# Adam moments (an upper bound for bf16 models: the bound must not be too short).
BYTES_PER_PARAM = 16


def p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


class SectionTimeouts:
    """Observed durations per section and the timeout each one implies."""

    def __init__(self, cfg: "FtConfig", saved: dict[str, Any] | None = None) -> None:
        self.cfg = cfg
        saved = saved or {}
        samples = saved.get("samples", {})
        self.samples: dict[str, list[float]] = {
            name: [float(s) for s in samples.get(name, [])][-MAX_SAMPLES:]
            for name in (*SECTIONS, OUT_OF_SECTION)
        }
        # Whether an observed setup included a restore: a fresh start's setup says nothing
        # about how long reading a large checkpoint takes.
        self.setup_restored_seen = bool(saved.get("setup_restored_seen", False))
        self.rank_bytes = 0  # this rank's checkpoint bytes (0: unknown yet)
        self.restoring = False

    # -- inputs
    def observe(self, section: str, seconds: float, restored: bool = False) -> None:
        samples = self.samples[section]
        samples.append(round(seconds, 4))
        del samples[:-MAX_SAMPLES]
        if section == "setup" and restored:
            self.setup_restored_seen = True

    def set_checkpoint_bytes(self, rank_bytes: int, restoring: bool | None = None) -> None:
        self.rank_bytes = rank_bytes
        if restoring is not None:
            self.restoring = restoring

    # -- the rule
    def needed(self, section: str) -> int:
        return self.cfg.learn_after_steps if section in ("step", OUT_OF_SECTION) else 1

    def learned(self, section: str) -> bool:
        return self.cfg.learn_timeouts and len(self.samples[section]) >= self.needed(section)

    def transfer_s(self) -> float:
        """Seconds to move this rank's checkpoint bytes at the conservative bandwidth."""
        return self.rank_bytes / (self.cfg.min_io_mb_per_s * 1e6)

    def _base(self, section: str) -> float:
        cfg = self.cfg
        return {
            "setup": cfg.setup_timeout_s,
            "step": cfg.step_timeout_s,
            "eval": cfg.eval_timeout_s,
            "checkpointing": cfg.checkpointing_timeout_s,
            OUT_OF_SECTION: cfg.out_of_section_timeout_s,
        }[section]

    def _moves_checkpoint(self, section: str) -> bool:
        return section == "checkpointing" or (section == "setup" and self.restoring)

    def prior(self, section: str) -> float:
        transfer = self.transfer_s() if self._moves_checkpoint(section) else 0.0
        return self._base(section) + transfer

    def timeout(self, section: str) -> float:
        if not self.learned(section):
            return round(self.prior(section), 3)
        cfg = self.cfg
        value = max(cfg.timeout_multiplier * p99(self.samples[section]), cfg.timeout_floor_s)
        if section == "setup" and self.restoring and not self.setup_restored_seen:
            value += self.transfer_s()  # learned from fresh starts only: add the read
        return round(value, 3)

    def all(self) -> dict[str, float]:
        return {name: self.timeout(name) for name in (*SECTIONS, OUT_OF_SECTION)}

    def rule(self, section: str) -> str:
        """How the section's timeout was set, for the log and the persisted file."""
        cfg = self.cfg
        if self.learned(section):
            samples = self.samples[section]
            return (
                f"{cfg.timeout_multiplier:g} x p99 {p99(samples):.2f} s of {len(samples)}, "
                f"floor {cfg.timeout_floor_s:g} s"
            )
        rule = f"not observed yet: {self._base(section):g} s"
        if self._moves_checkpoint(section):
            rule += f" + {self.rank_bytes / 1e6:.1f} MB at {cfg.min_io_mb_per_s:g} MB/s"
        return rule

    # -- persistence
    def state(self) -> dict[str, Any]:
        return {
            "samples": self.samples,
            "setup_restored_seen": self.setup_restored_seen,
            "timeouts": self.all(),
            "rules": {name: self.rule(name) for name in (*SECTIONS, OUT_OF_SECTION)},
            "multiplier": self.cfg.timeout_multiplier,
            "floor_s": self.cfg.timeout_floor_s,
        }


def moved(old: dict[str, float], new: dict[str, float]) -> bool:
    """Whether any timeout changed enough to be worth an update message to the monitor."""
    return any(abs(new[k] - old.get(k, 0.0)) > CHANGE * max(old.get(k, 0.0), 1e-9) for k in new)
