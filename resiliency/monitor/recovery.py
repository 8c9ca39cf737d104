"""The recovery ledger of one fault: where the time from the fault to the first step of the
attempt that recovered from it went, phase by phase.

Each boundary is a moment some process saw with its own eyes, on its host's clock
(:mod:`pretrain.context.startup_clock`, ``CLOCK_BOOTTIME``), so the phases add up to the
recovery's wall time because the boundaries meet, not because one phase is the remainder:

- ``fault``: the failing worker's death as its parent reaped it (the standby server, or the
  worker entrypoint with hot spares: :mod:`pretrain.context.worker_exits`), else the moment
  the failing rank recorded its own failure, else
  the launcher's log line (then detection reads 0: nobody saw the death sooner);
- ``detection``: -> the launcher logged the worker group failed (its log's stamp);
- ``teardown``: -> the launcher began the next round (every old rank gone), or exited;
- ``spawn``: -> the kernel started the new rank 0 (its standby worker where one was used);
- then the new rank 0's own marks: imports, process group, setup, model build, restore read,
  restore load, first step.

A missing mark (no restore: nothing read) is a phase of 0 s named in ``absent``. The launcher's
boundaries come from its log's wall-clock stamps, moved onto the host clock by the offset the
reader measured as it read them. A phase is measured only when both its ends were read from one
clock (one host and boot): a fault on another node leaves detection None, a new rank 0 on
another host than the launcher leaves spawn and the total None (``cross_host``).

The work lost with the fault: the steps done after the checkpoint the next attempt restored,
and the persistent save that was in flight (started, never committed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pretrain.context.run_dir import RunDir, read_jsonl
from pretrain.context.startup_clock import PHASES as PROCESS_PHASES
from pretrain.context.worker_exits import worker_exits
from resiliency.storage.attempts import read_attempt_record, recorded_attempts
from resiliency.storage.layout import RunLayout

LAUNCHER_PHASES = ("detection", "teardown", "spawn")
PHASES = LAUNCHER_PHASES + PROCESS_PHASES


def reaped_ranks(
    run_dir: Path, record: dict[str, Any], window: tuple[float, float]
) -> dict[int, dict[str, Any]]:
    """rank -> how its worker ended, as the standby that forked it saw (pids from the
    attempt's rank inventory); the exit code is -N for a signal, as the launcher logs it."""
    worker_rank = {(r.get("host"), r["pid"]): r["rank"] for r in record.get("ranks", [])}
    found: dict[int, dict[str, Any]] = {}
    for event in worker_exits(run_dir, set(worker_rank), window):
        code = -event["signal"] if "signal" in event else event.get("exit_code")
        rank = worker_rank[(event["host"], event["pid"])]
        found.setdefault(rank, {**event, "time": event["wall"], "exit_code": code})
    return found


Moment = tuple[float | None, str]  # (host clock, whose clock: "host/boot")


def clock_of(identity: dict[str, Any]) -> str:
    """Whose clock a stamp was read from (stamps compare only within one host and boot)."""
    return f"{identity.get('host')}/{identity.get('boot_id')}"


def fault_moment(
    failure: dict[str, Any],
    reaped_by_rank: dict[int, dict[str, Any]],
    offset: float,
    reader: dict[str, str],
) -> tuple[float, str, str, float]:
    """(host clock, source, whose clock, wall time) of the fault behind ``failure``
    (postmortem's first failure); ``reaped_by_rank``: the attempt's :func:`reaped_ranks`;
    ``offset``/``reader``: the launcher log reader's wall-to-clock offset and host. The wall
    time is the stamp's own (another host's clock cannot be converted with the reader's
    offset)."""
    reaped = reaped_by_rank.get(failure["rank"])
    if reaped is not None and reaped["wall"] <= failure["time"] + 1e-3:
        return (
            float(reaped["clock"]),
            "the worker's parent reaped it",
            clock_of(reaped),
            float(reaped["wall"]),
        )
    if failure.get("clock") is not None:
        return (
            float(failure["clock"]),
            "the rank's own failure record",
            clock_of(failure),
            float(failure["time"]),
        )
    return (
        failure["time"] + offset,
        f"{failure['source']} (wall clock)",
        clock_of(reader),
        float(failure["time"]),
    )


def _gap(start: Moment, end: Moment) -> float | None:
    """end - start, when both are known and read from the same clock."""
    if start[0] is None or end[0] is None or start[1] != end[1]:
        return None
    return round(end[0] - start[0], 3)


def recovery_ledger(
    fault: tuple[float, str, str],
    detected: float | None,
    torn_down: float | None,
    following: dict[str, Any],
    reader: dict[str, str],
    detection_measured: bool = True,
) -> dict[str, Any]:
    """The phases from ``fault`` to the first step of ``following`` (the next attempt's
    record); ``detected``/``torn_down``: the launcher's moments on ``reader``'s clock. A
    phase whose two ends were read from different hosts' clocks is None; so is detection
    when the fault's moment is known only as its detection (``detection_measured`` false:
    listed in ``not_measured``, and the total counts from the detection)."""
    startup = following.get("startup_clock") or {}
    marks, rank0 = startup.get("marks", {}), clock_of(startup)
    launcher = clock_of(reader)
    points: list[tuple[str, Moment]] = [
        ("detection", (detected, launcher)),
        ("teardown", (torn_down, launcher)),
        ("spawn", (marks.get("spawned"), rank0)),
        *((p, (marks.get(p), rank0)) for p in PROCESS_PHASES),
    ]
    seconds: dict[str, float | None] = {}
    absent: list[str] = []
    previous: Moment = (fault[0], fault[2])
    for name, moment in points:
        if moment[0] is None and name in ("restore_read", "restore_load") and marks:
            absent.append(name)  # nothing restored: the phase took no time
            moment = previous
        seconds[f"{name}_s"] = _gap(previous, moment)
        if name == "detection" and not detection_measured:
            seconds["detection_s"] = None
        previous = moment
    done = marks.get("first_step")
    return {
        "clock": "CLOCK_BOOTTIME of " + launcher,
        "fault_at_clock": round(fault[0], 3),
        "fault_source": fault[1],
        "detected_at_clock": None if detected is None else round(detected, 3),
        **seconds,
        "total_s": round(done - fault[0], 3) if done is not None and rank0 == fault[2] else None,
        "absent": absent,
        "not_measured": [] if detection_measured else ["detection"],
        **({} if rank0 == launcher or not marks else {"cross_host": startup.get("host")}),
    }


def save_in_flight(run_dir: Path, window: tuple[float, float], restored: int | None) -> int | None:
    """The newest persistent save started in ``window`` that never committed, if it is
    newer than what the next attempt restored: its work went with the fault."""
    committed = set(_published_steps(run_dir))
    started = [
        s["step"]
        for s in read_jsonl(RunDir(run_dir).checkpoint_metrics)
        if s.get("tier") == "persistent" and window[0] <= s.get("time", -1.0) <= window[1]
    ]
    lost = [s for s in started if s not in committed and s > (restored or 0)]
    return max(lost, default=None)


def _published_steps(run_dir: Path) -> list[int]:
    return RunLayout.from_run_dir(run_dir).published_steps()


def recoveries(run_dir: Path) -> dict[int, dict[str, Any]]:
    """attempt -> the recovery ledger of its fault, for every attempt a later one recovered."""
    layout = RunLayout.from_run_dir(run_dir)
    found = {}
    for attempt in recorded_attempts(layout):
        record = read_attempt_record(layout, attempt) or {}
        if record.get("rto"):
            found[attempt] = record["rto"]
    return found


def format_recovery(attempt: int, rto: dict[str, Any]) -> str:
    """One line per phase of the recovery from ``attempt``'s fault."""
    total = rto.get("total_s")
    head = f"recovery from attempt {attempt}'s fault ({rto.get('fault_source', '?')})"
    lines = [head + (f": {total:.2f} s to the next first step" if total is not None else "")]
    for name in PHASES:
        value = rto.get(f"{name}_s")
        shown = "       n/a" if value is None else f"{value:8.3f} s"
        none = "  (none)" if name in rto.get("absent", []) else ""
        if name in rto.get("not_measured", []):
            shown, none = (
                "not measured",
                "  (only the launcher saw the fault; the total counts from here)",
            )
        lines.append(f"  {name:<14} {shown}{none}")
    lost = rto.get("work_lost") or {}
    if lost:
        flight = lost.get("save_in_flight")
        lines.append(
            f"  work lost: {lost.get('steps', 0)} step(s)"
            + (f", the save of step {flight} in flight" if flight is not None else "")
        )
    return "\n".join(lines)
