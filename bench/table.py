"""``python -m bench``'s markdown table: one row per figure, its goal and whether it was met."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.outside_soak import p9_goal_met
from bench.remote_upload import rows as remote_rows
from resiliency.monitor.recovery import PHASES

GIB = 1 << 30


def fmt(s: dict[str, float] | None, digits: int = 3) -> tuple[str, str, str]:
    if not s:
        return ("n/a", "", "")
    return (f"{s['median']:.{digits}f}", f"{s['min']:.{digits}f}", f"{s['max']:.{digits}f}")


def _one(value: float | None) -> dict[str, float] | None:
    return None if value is None else {"median": value, "min": value, "max": value}


def _hang_rows(hang: dict[str, Any], row: Callable[..., None]) -> None:
    """P4: one row per section, then the attribution rate of random stops."""
    for name, r in hang.get("sections", {}).items():
        row(
            f"P4 hang detection, {name}",
            "tiny",
            _one(r["detection_s"]),
            f"≤ {r['goal_s']:.1f} s",
            r["goal_met"],
            1,
            note=f"section {r['section']}, timeout {r['timeout_s']:.1f} s; stopped rank "
            f"named {r['named_right']} ({', '.join(r['rules'])})",
        )
    if "random" in hang:
        r = hang["random"]
        row(
            "P4 random SIGSTOPs: stopped rank named",
            "tiny",
            _one(r["named_right"]),
            f"{r['stops']}/{r['stops']}",
            r["named_right"] == r["stops"],
            0,
            note=f"of {r['stops']} (undetermined {r['undetermined']}); sections "
            + ", ".join(f"{k} {v}" for k, v in sorted(r["sections"].items())),
        )


class Rows:
    """The table's rows: metric, model, median/min/max, goal, met, notes."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, ...]] = []

    def __call__(
        self,
        metric: str,
        config: str,
        s: dict | None,
        goal: str,
        met: Any,
        digits: int = 3,
        note: str = "",
    ) -> None:
        verdict = "" if met is None else ("yes" if met else "**no**")
        self.rows.append((metric, config, *fmt(s, digits), goal, verdict, note))


def table(results: dict[str, Any]) -> str:
    row = Rows()
    _save_rows(results.get("save", {}), row)
    _restore_rows(results.get("restore", {}), row)
    _hang_rows(results.get("hang", {}), row)
    _overhead_rows(results.get("overhead", {}), row)
    _soak_rows(results.get("soak"), row)
    _recovery_rows(results.get("recovery"), row)
    _outside_rows(results.get("outside"), row)
    if "remote" in results:
        ratio, note = remote_rows(results["remote"])
        row("P7 object-store upload ÷ raw PUT throughput", "512 MiB", ratio, "≥ 0.8",
            ratio["median"] >= 0.8, note=note)  # fmt: skip
    head = (
        "| metric | model | median | min | max | goal | met | notes |\n"
        "|---|---|---|---|---|---|---|---|\n"
    )
    return head + "\n".join("| " + " | ".join(r) + " |" for r in row.rows) + "\n"


def _pairs_note(r: dict[str, Any]) -> str:
    if "raw_after_save_GiBps" not in r:  # a result from before this estimator
        return ""
    return (
        f"; median of {r['P1_pairs'] // r['P1']['n']} pairs per repetition; raw writes start the"
        f" kernel's writeback as they go, as the save's writers do, and follow a raw write, as"
        f" the saves do (one right after a save: {r['raw_after_save_GiBps']['median']:.2f} GiB/s)"
    )


def _save_rows(save: dict[str, Any], row: Rows) -> None:
    for config, r in save.items():
        gib = r["bytes"] / GIB
        row(
            "P1 save ÷ raw fsync'd write bandwidth",
            config,
            r["P1"],
            "≥ 0.8",
            r["P1"]["median"] >= 0.8,
            note=f"{gib:.3f} GiB; save {r['save_GiBps']['median']:.2f} GiB/s, raw "
            f"{r['raw_write_GiBps']['median']:.2f} GiB/s" + _pairs_note(r),
        )
        row(
            "P2 async blocked ÷ (bytes ÷ memcpy)",
            config,
            r["P2_blocked_over_memcpy"],
            "≤ 2× + 50 ms",
            r["P2_goal_met"],
            1,
            note=f"blocked {r['P2_blocked_s']['median']:.3f} s (call "
            f"{r['P2_save_call_s']['median']:.3f} + commit "
            f"{r['P2_commit_s']['median']:.3f}), memcpy {r['P2_memcpy_s']['median']:.3f} s",
        )
        row(
            "P2 first async save of an attempt, blocked ÷ (bytes ÷ memcpy)",
            config,
            _one(r["P2_first_blocked_over_memcpy"]),
            "≤ 2× + 50 ms",
            r["P2_first_goal_met"],
            1,
            note=f"blocked {r['P2_first_blocked_s']:.3f} s (call "
            f"{r.get('P2_first_save_call_s', 0):.3f} + commit {r.get('P2_first_commit_s', 0):.3f}; "
            f"sizing the staging buffers blocked {r.get('P2_first_reserve_s', 0):.3f} s after "
            "the attempt's first step; writer spawned at start; one sample per run)",
        )
        sd = r["P2_step_slowdown"]
        row(
            "P2 step slowdown while writing",
            config,
            sd,
            "≤ 0.05",
            None if sd is None else sd["median"] <= 0.05,
            note=_slowdown_note(r) if sd else "no step started while the writer ran",
        )


def _restore_pairs_note(r: dict[str, Any]) -> str:
    if "P3_added_s" not in r:  # a result from before pairs per repetition
        return ""
    added = r["P3_added_s"]
    by_phase = r.get("added_by_phase_s", {})
    return (
        f"; median of {r['P3_pairs'] // r['P3']['n']} pairs per repetition; a restore added"
        f" {added['median']:.2f} s to a start [{added['min']:.2f}-{added['max']:.2f}]"
        + (
            " (restore − fresh by phase: "
            + ", ".join(f"{k.removesuffix('_s')} {v:+.2f} s" for k, v in by_phase.items())
            + ")"
            if by_phase
            else ""
        )
    )


def _restore_rows(restore: dict[str, Any], row: Rows) -> None:
    for config, r in restore.items():
        row(
            "P3 (launch→resumed − launch→fresh start) ÷ (bytes ÷ cold read)",
            config,
            r["P3"],
            "≤ 1.25",
            r["P3_goal_met"],
            2,
            note=f"resumed {r['resumed_s']['median']:.1f} s (first step done "
            f"{r['first_step_s']['median']:.1f} s), fresh start "
            f"{r['fresh_s']['median']:.1f} s, cold read "
            f"{r['read_GiBps']['median']:.2f} GiB/s, {r['bytes'] / GIB:.3f} GiB; "
            + ", ".join(f"{k} {v:.1f}" for k, v in r.get("phases_s", {}).items())
            + _restore_pairs_note(r),
        )


def _overhead_rows(overhead: dict[str, Any], row: Rows) -> None:
    for config, r in overhead.items():
        row(
            "P5 framework step ÷ bare megatron-core step",
            config,
            r["P5"],
            "≤ 1.01",
            r["P5"]["median"] <= 1.01,
            note=f"bare {r['bare_step_s']['median'] * 1e3:.1f} ms/step; framework without "
            f"TensorBoard ÷ bare {r['P5_without_reporting']['median']:.3f}, with ÷ without "
            f"{r['reporting_share']['median']:.3f}; CPU shim (not product "
            f"cost) ≈ {r['shim_s_per_step'] * 1e3:.1f} ms/step = "
            f"{r['shim_fraction_of_bare_step']:.1%} of the bare step; hooks (ms/step): "
            + ", ".join(
                f"{k} {v:.1f}"
                for k, v in sorted(r["hooks_ms_per_step"].items(), key=lambda kv: -kv[1])[:3]
            ),
        )


def _soak_rows(soak: dict[str, Any] | None, row: Rows) -> None:
    if soak:
        row(
            "P6 soak goodput ÷ planner's prediction (MTBF = 20 × (save + restart))",
            "tiny",
            _one(soak["P6"]),
            "≥ 0.95",
            None if soak["P6"] is None else soak["P6"] >= 0.95 and soak["passed"],
            note=f"goodput {100 * (soak['goodput'] or 0):.1f} % measured, "
            f"{100 * (soak['goodput_predicted'] or 0):.1f} % predicted; {soak['faults']} faults "
            f"({', '.join(soak['kinds'])}) in {soak['wall_s'].get('soak', 0):.0f} s, MTBF "
            f"{soak['mtbf_s'] or 0:.0f} s; trajectory "
            + ("bit-exact" if soak["passed"] else "; ".join(soak["problems"])),
        )


def _recovery_rows(recovery: dict[str, Any] | None, row: Rows) -> None:
    """P8 with and without standby workers; the notes carry one recovery's ledger."""
    for mode, r in (recovery or {}).items():
        ledger = r.get("ledger") or {}
        phases = ", ".join(
            f"{name} {ledger[f'{name}_s']:.2f}"
            for name in PHASES
            if isinstance(ledger.get(f"{name}_s"), float)
        )
        goal = "≤ 0.6" if mode == "standby" else ""
        row(
            f"P8 restart (kill → first step) ÷ fresh start, {mode} workers",
            "tiny",
            {"median": r["P8"], "min": r["P8_min"], "max": r["P8_max"]},
            goal,
            r["P8"] <= 0.6 if mode == "standby" else None,
            note=f"restart {r['recovery_s']:.2f} s, fresh start {r['fresh_s']:.2f} s (medians); "
            f"one ledger (s): {phases}",
        )


def _outside_rows(outside: dict[str, Any] | None, row: Rows) -> None:
    """P9: one row per seed, graded by the bench's own reading (not the soak's verdict)."""
    for r in (outside or {}).get("P9_runs", []):
        flips, gone = r.get("flips", 0), r.get("flips_no_longer_published", 0)
        disks, stopped = r.get("full_disks", 0), r.get("full_disks_stopped_and_relaunched", 0)
        outages, remote = r.get("outages", 0), r.get("remote_newest_step")
        hangs = r.get("stops_and_writer_kills", 0)
        hangs_seen = r.get("stops_and_writer_kills_in_launcher_log", 0)
        row(
            f"P9 soak, faults from outside, seed {r['seed']}: bit-exact",
            "tiny",
            _one(float(r["bit_exact"])),
            "1 (bit-exact)",
            p9_goal_met([r]),
            0,
            note=f"{r['faults']} of {r.get('planned', '?')} planned faults injected "
            f"({', '.join(r['kinds'])}); SIGKILLs in the launcher's log "
            f"{r['kills_in_launcher_log']}/{r['kills']}; SIGSTOPs and writer kills there "
            f"{hangs_seen}/{hangs}; flipped bytes no longer published {gone}/{flips}; full "
            f"disks stopped (exit 10) and relaunched {stopped}/{disks}; S3 outages {outages}, "
            f"newest step in the object store at the end {remote}; the soak's own exit "
            f"{r['soak_exit']}, confirmed {r['soak_confirmed']}/{r['faults']}; {r['wall_s']:.0f} s",
        )


def _slowdown_note(r: dict[str, Any]) -> str:
    note = (
        f"{r['P2_busy_steps']} steps started while the writer ran; training time lost per "
        f"save {r['P2_lost_s_per_save']['median']:.2f} s (idle step "
        f"{r['idle_step_s']['median']:.2f} s)"
    )
    raw = r.get("P2_raw_write_slowdown")
    if raw:
        note += (
            f"; floor: a nice-19 process writing the same bytes + fsync slows steps by "
            f"{raw['median']:.2f} (lost {r['P2_raw_write_lost_s']['median']:.2f} s)"
        )
    return note
