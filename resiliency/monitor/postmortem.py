"""After an attempt ends: which rank failed first, what was lost, and how long recovery took.

Evidence per rank, best first: the failure file the rank wrote itself
(``attempts/ranks/attempt-NN.rank-R.failure.json``), its stack dump (a hang: see
:mod:`resiliency.monitor.stacks`), the exit code the launcher logged. A rank that failed inside a
collective (lost peer, collective timeout) or was stopped by the launcher is a *victim*: the
first failing rank is the earliest non-victim, not the last timeout. The launcher wrapper merges
the result into ``attempts/attempt-NN.json`` once the attempt's processes are gone, so the retry
decision (:mod:`launch.retry_policy`) reads the root cause.

A hang (a rank monitor fired, nobody raised) is attributed by :mod:`resiliency.monitor.attribution`
from liveness heartbeats and stacks; the record keeps its reasoning under ``hang``, and says
``"undetermined"`` where the evidence cannot tell.

RTO of a failed attempt: the recovery ledger of :mod:`resiliency.monitor.recovery` (detection,
teardown, spawn, imports, process group, setup, model build, restore read and load, first
step, and the work lost), built from the launcher's log and the next attempt's own marks.
"""

from __future__ import annotations

import json
import logging
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pretrain.context import exit_codes
from pretrain.context.run_dir import RunDir, iter_jsonl
from pretrain.context.startup_clock import host_identity, wall_to_clock_offset
from resiliency.monitor.attribution import UNDETERMINED, attribute_hang, last_progress
from resiliency.monitor.recovery import (
    clock_of,
    fault_moment,
    reaped_ranks,
    recovery_ledger,
    save_in_flight,
)
from resiliency.monitor.stacks import STACKS_DIR, read_stack_dump
from resiliency.storage.attempts import PLANNED_STATUSES
from resiliency.storage.layout import RunLayout, atomic_write_json

log = logging.getLogger(__name__)

# Per-rank files live below attempts/, so globs for attempt records never pick them up.
FAILURES_DIR = "ranks"
CODE_CLASSES = {
    exit_codes.USER_CODE: "user_code",
    exit_codes.NUMERIC: "numeric",
    exit_codes.OOM: "oom",
    exit_codes.DATA: "data",
    exit_codes.TOPOLOGY_REFUSED: "topology",
    exit_codes.CONFIG_ERROR: "config",
    exit_codes.LEASE_HELD: "lease",
    exit_codes.CHECKPOINT_IO: "checkpoint",
    exit_codes.STRAGGLER: "straggler",
    exit_codes.REQUEUE: "preempted",
    exit_codes.INTERRUPTED: "interrupted",
    exit_codes.INFRASTRUCTURE: "infrastructure",
}
_JOIN = re.compile(r"attempts to join the next round of the rendezvous")
_DETECT = re.compile(r"Worker group (FAILED|UNHEALTHY)")
_EXIT = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
# The rank monitor's timeout line: nvrx 0.4 "[RankMonServer<r>@<host>:<rank>] Section ...";
# nvrx 0.7 "[workload:?(<rank>) infra:?(?)] rank_monitor_server.py:<n> [Cycle <c>] Section ...".
_MONITOR = re.compile(
    r"(?:\[RankMonServer\d+@[^\]]*?:(\d+)\]|\[workload:\?\((\d+)\)[^\]]*\] \S+)"
    r" (?:\[Cycle \d+\] )?(?:Section '([^']+)' has been open"
    r"|Was (out of section)) for ([\d.]+) seconds\. Timeout is ([\d.]+)"
)


# torchelastic and nvrx 0.4: "[2026-12-01 18:33:48,003] [WARNING] ..."; nvrx 0.7:
# "2026-12-01 18:38:19,835 [WARNING] ..." (local time of the launcher's host: this host).
_STAMP = re.compile(r"^\[?(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})\]? ")


def _stamp(line: str) -> float | None:
    match = _STAMP.match(line)
    if match is None:
        return None
    try:
        return (
            time.mktime(time.strptime(match.group(1), "%Y-%m-%d %H:%M:%S"))
            + int(match.group(2)) / 1e3
        )
    except ValueError:
        return None


def failure_path(layout: RunLayout, attempt: int, rank: int) -> Path:
    return layout.attempts_dir / FAILURES_DIR / f"attempt-{attempt:02d}.rank-{rank}.failure.json"


# ------------------------------------------------------------------ launcher log
@dataclass
class LauncherEvents:
    """What torchrun/ft_launcher logged, stamped with the wall time each line arrived."""

    joins: list[float] = field(default_factory=list)  # a worker group (re)starting
    detections: list[float] = field(default_factory=list)  # the launcher saw a rank fail
    exits: list[dict[str, Any]] = field(default_factory=list)
    monitor_timeouts: list[dict[str, Any]] = field(default_factory=list)
    launches: list[list[float]] = field(default_factory=list)  # [start, end] per launcher run
    # host clock - wall clock as the reader saw it (None: not read live; the ledger measures it)
    clock_offset: float | None = None
    host: dict[str, str] = field(default_factory=host_identity)  # the reader's host and boot

    def feed(self, line: str, now: float, clock: float | None = None) -> None:
        """``now``: the wall time the line arrived; ``clock``: the host clock then."""
        if clock is not None:
            self.clock_offset = clock - now
        # The launcher's own stamp where the line has one: a reader that falls behind (a full
        # pipe downstream) must not move the events in time.
        now = _stamp(line) or now
        if _JOIN.search(line):
            self.joins.append(now)
        elif _DETECT.search(line):
            self.detections.append(now)
        elif m := _EXIT.search(line):
            self.exits.append(
                {
                    "time": now,
                    "exit_code": int(m.group(1)),
                    "local_rank": int(m.group(2)),
                    "pid": int(m.group(3)),
                }
            )
        elif m := _MONITOR.search(line):
            self.monitor_timeouts.append(
                {
                    "time": now,
                    "rank": int(m.group(1) or m.group(2)),
                    "section": m.group(3) or "out_of_section",
                    "open_s": float(m.group(5)),
                    "timeout_s": float(m.group(6)),
                }
            )


# ------------------------------------------------------------------ progress
def last_step_between(run_dir: Path, start: float, end: float) -> int | None:
    """The last step rank 0 logged in [start, end) (steps.jsonl), None if none."""
    last = None
    for record in iter_jsonl(RunDir(run_dir).steps_metrics):
        if start <= record.get("time", 0.0) < end:
            last = record["step"]
    return last


def lost_steps(last_step: int | None, restored_step: int | None) -> int:
    """Steps done after the checkpoint that the next attempt restores: redone, i.e. lost."""
    if last_step is None:
        return 0
    return max(0, last_step - (restored_step or 0))


# ------------------------------------------------------------------ evidence
def read_record(layout: RunLayout, attempt: int) -> dict[str, Any]:
    try:
        return json.loads(layout.attempt_path(attempt).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def rank_failures(layout: RunLayout, attempt: int) -> dict[int, dict[str, Any]]:
    found = {}
    for path in (layout.attempts_dir / FAILURES_DIR).glob(
        f"attempt-{attempt:02d}.rank-*.failure.json"
    ):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        found[int(data["rank"])] = data
    return found


def rank_stacks(
    layout: RunLayout, attempt: int, window: tuple[float, float]
) -> dict[int, dict[str, Any]]:
    """rank -> its stack file of this attempt (heartbeat, and the dump if one was made).

    A file armed before the attempt number was known (early setup) belongs to the attempt whose
    window holds its arm time.
    """
    found = {}
    for path in (layout.attempts_dir / STACKS_DIR).glob("rank-*.txt"):
        dump = read_stack_dump(path)
        if not dump:
            continue
        mine = dump.get("attempt") == attempt or (
            "attempt" not in dump and window[0] <= dump.get("opened_at", 0.0) <= window[1]
        )
        if mine:
            found[int(dump["rank"])] = dump
    return found


def _from_failure_file(data: dict[str, Any]) -> dict[str, Any]:
    victim = bool(data.get("in_collective")) and data.get("failure_class") == "infrastructure"
    return {
        "rank": data["rank"],
        "time": data["time"],
        "source": "rank",
        "failure_class": data["failure_class"],
        "exit_code": data["exit_code"],
        "cause": data.get("cause", data["failure_class"]),
        "victim": victim,
        "detail": data.get("message", "")[:500],
        "clock": data.get("clock"),  # the rank's host clock when it failed, and whose
        "host": data.get("host"),
        "boot_id": data.get("boot_id"),
    }


def _from_stack(dump: dict[str, Any]) -> dict[str, Any]:
    waiting = dump.get("in_collective", False)
    cause = (
        f"waiting in a collective in section {dump.get('section')}"
        if waiting
        else f"hang in section {dump.get('section')} (step {dump.get('step')})"
    )
    if blocked := dump.get("blocked_in"):  # the heartbeat's last look: the file it waits for
        waited = float(dump.get("beat_at", blocked["since"])) - float(blocked["since"])
        cause += f": blocked in {blocked['syscall']}({blocked['path']}) for {waited:.0f} s"
    return {
        "rank": dump["rank"],
        "time": dump["opened_at"],
        "source": "stack",
        "failure_class": "infrastructure",
        "exit_code": exit_codes.INFRASTRUCTURE,
        "cause": cause,
        "victim": waiting,
        "detail": dump.get("top_frames", []),
    }


def _from_exit(rank: int, event: dict[str, Any]) -> dict[str, Any]:
    code = event["exit_code"]
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
        # SIGTERM comes from the launcher tearing the group down after another rank failed.
        return {
            "rank": rank,
            "time": event["time"],
            "source": "launcher",
            "failure_class": "infrastructure",
            "exit_code": exit_codes.INFRASTRUCTURE,
            "cause": f"killed by {name}",
            "victim": -code == signal.SIGTERM,
            "detail": "",
        }
    return {
        "rank": rank,
        "time": event["time"],
        "source": "launcher",
        "failure_class": CODE_CLASSES.get(code, "unknown"),
        "exit_code": code,
        "cause": f"exit code {code}",
        "victim": False,
        "detail": "",
    }


def first_failure(evidence: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The earliest non-victim failure, else the earliest of all."""
    culprits = [e for e in evidence if not e["victim"]] or evidence
    return min(culprits, key=lambda e: e["time"]) if culprits else None


def rank_exits(
    record: dict[str, Any], events: LauncherEvents, window: tuple[float, float]
) -> dict[int, dict[str, Any]]:
    """rank -> the first exit the launcher logged for it in the window (pids from the record)."""
    pid_rank = {r["pid"]: r["rank"] for r in record.get("ranks", [])}
    found: dict[int, dict[str, Any]] = {}
    for event in events.exits:
        if window[0] <= event["time"] <= window[1]:
            found.setdefault(pid_rank.get(event["pid"], event["local_rank"]), event)
    return found


def collect_evidence(
    layout: RunLayout,
    attempt: int,
    record: dict[str, Any],
    events: LauncherEvents,
    window: tuple[float, float],
    reaped: dict[int, dict[str, Any]],
) -> list[dict[str, Any]]:
    """Every rank's failure, best evidence first; ``reaped``: the attempt's
    :func:`~resiliency.monitor.recovery.reaped_ranks`."""
    by_rank = {
        rank: _from_exit(rank, event) for rank, event in rank_exits(record, events, window).items()
    }
    for rank, event in reaped.items():
        # The standby that forked the worker saw its end first-hand, before the launcher did.
        by_rank[rank] = {**_from_exit(rank, event), "source": "standby"}
    for rank, dump in rank_stacks(layout, attempt, window).items():
        if dump.get("dumped"):
            by_rank[rank] = _from_stack(dump)
    for rank, data in rank_failures(layout, attempt).items():
        by_rank[rank] = _from_failure_file(data)
    return sorted(by_rank.values(), key=lambda e: e["time"])


# ------------------------------------------------------------------ RTO
def _first_after(times: list[float], after: float, before: float) -> float | None:
    return min((t for t in times if after <= t <= before), default=None)


def recovery_times(
    reaped: dict[int, dict[str, Any]],
    first: dict[str, Any],
    following: dict[str, Any],
    events: LauncherEvents,
    window: tuple[float, float],
) -> dict[str, Any]:
    """The recovery ledger of ``first`` (the attempt's root failure), up to ``following``'s
    first step: the launcher's moments from its log, the new rank 0's from its own marks."""
    offset = events.clock_offset if events.clock_offset is not None else wall_to_clock_offset()
    fault, source, whose, fault_wall = fault_moment(first, reaped, offset, events.host)
    if whose == clock_of(events.host):  # the launcher's own clock: converted exactly
        fault_wall = fault - offset
    ends = [end for _, end in events.launches]
    # Not before the attempt began: a fast restart follows the previous detection closely.
    after = max(fault_wall - 1.0, window[0])
    detected = _first_after(events.detections, after, window[1])
    if detected is None:
        detected = _first_after(ends, fault_wall, float("inf"))
    if detected is not None and source.endswith("(wall clock)"):
        # Only the launcher saw this death: it cannot have seen it before it happened.
        fault = min(fault, detected + offset)
        fault_wall = fault - offset
    # The fault's moment is the launcher's own report of it (no reaper, no record of the
    # rank's): it is the detection, so how long detection took is not measured.
    unmeasured = detected is not None and first.get("source") == "launcher"
    torn_down = None
    if detected is not None:
        torn_down = _first_after(events.joins + ends, detected, float("inf"))
    rto = recovery_ledger(
        (fault, source, whose),
        None if detected is None else detected + offset,
        None if torn_down is None else torn_down + offset,
        following,
        events.host,
        detection_measured=not unmeasured,
    )
    rto["failure_at"] = round(fault_wall, 3)  # wall clock, as every other record time
    return rto


# ------------------------------------------------------------------ finalize
def summarize(
    layout: RunLayout,
    attempt: int,
    record: dict[str, Any],
    following: dict[str, Any] | None,
    events: LauncherEvents,
    tokens_per_step: int,
) -> dict[str, Any]:
    start = record.get("start_time", 0.0)
    end = following.get("start_time") if following else None
    end = end or max([e for _, e in events.launches] + [time.time()])
    # The standby's record of each worker's end, read once for the evidence, codes and RTO.
    reaped = reaped_ranks(layout.run_dir, record, (start, end))
    evidence = collect_evidence(layout, attempt, record, events, (start, end), reaped)
    last = last_step_between(layout.run_dir, start, end)
    restore_point = (
        following.get("restored_step")
        if following is not None
        else max([s for s in layout.published_steps() if last is None or s <= last], default=0)
    )
    lost = lost_steps(last, restore_point)
    summary: dict[str, Any] = {
        "last_step": last,
        "lost_steps": lost,
        "lost_tokens": lost * tokens_per_step,
        "exit_codes": _exit_codes(layout, attempt, record, events, (start, end), reaped),
    }
    monitor = [m for m in events.monitor_timeouts if start <= m["time"] <= end]
    if monitor:
        summary["monitor_timeouts"] = monitor
    if record.get("status") in PLANNED_STATUSES:
        return summary  # a planned exit (rank 0 got through on_end): no root cause to find
    first = first_failure(evidence)
    if _is_hang(evidence, monitor):
        dumps = rank_stacks(layout, attempt, (start, end))
        killed_at: dict[int, float] = {}
        for timeout in monitor:
            rank = timeout["rank"]
            killed_at[rank] = min(killed_at.get(rank, timeout["time"]), timeout["time"])
        summary["hang"] = attribute_hang(dumps, killed_at)
        first = _hang_culprit(summary["hang"], dumps, evidence)
    summary.update(_failure_fields(record, first, evidence))
    if first is not None and following is not None:
        rto = recovery_times(reaped, first, following, events, (start, end))
        flight = save_in_flight(layout.run_dir, (start, end), following.get("restored_step"))
        rto["work_lost"] = {"steps": lost, "save_in_flight": flight}
        summary["rto"] = rto
    return summary


def _is_hang(evidence: list[dict[str, Any]], monitor: list[dict[str, Any]]) -> bool:
    """A rank monitor fired, or stacks were dumped, and no rank failed on its own."""
    raised = any(e["source"] == "rank" and not e["victim"] for e in evidence)
    return not raised and (bool(monitor) or any(e["source"] == "stack" for e in evidence))


def _hang_culprit(
    hang: dict[str, Any], dumps: dict[int, dict[str, Any]], evidence: list[dict[str, Any]]
) -> dict[str, Any]:
    """The failure the attempt record names for a hang; marks the other ranks as victims."""
    rank = hang["rank"]
    for entry in evidence:
        entry["victim"] = entry["rank"] != rank
    section = dumps.get(rank, {}).get("section") if rank != UNDETERMINED else None
    at = hang.get("last_progress_at") or last_progress(dumps)
    return {
        "rank": rank,
        "time": at if at is not None else min((e["time"] for e in evidence), default=time.time()),
        "source": "hang",
        "failure_class": "infrastructure",
        "exit_code": exit_codes.INFRASTRUCTURE,
        "cause": (
            f"hang in section {section} ({hang['rule']})"
            if rank != UNDETERMINED
            else "hang: the hung rank is undetermined" + _storage_waits(evidence)
        ),
        "victim": False,
        "detail": hang["reason"],
    }


def _storage_waits(evidence: list[dict[str, Any]]) -> str:
    """Where no rank stands out because every one waits on the storage (a hung mount under a
    save): the first rank's wait, named."""
    for entry in sorted(evidence, key=lambda e: e["rank"]):
        if entry["source"] == "stack" and ": blocked in " in entry["cause"]:
            return f"; rank {entry['rank']} {entry['cause'].split(': ', 1)[1]}"
    return ""


def _exit_codes(
    layout: RunLayout,
    attempt: int,
    record: dict[str, Any],
    events: LauncherEvents,
    window: tuple[float, float],
    reaped: dict[int, dict[str, Any]],
) -> dict[str, Any]:
    """Process exit codes per rank (negative: killed by that signal; None: not known).

    Known from the rank's failure file or the launcher's log; ranks of a clean exit share it.
    """
    clean = record.get("exit_code") if record.get("status") in PLANNED_STATUSES else None
    codes: dict[str, Any] = {str(r["rank"]): clean for r in record.get("ranks", [])}
    codes.update({str(r): e["exit_code"] for r, e in rank_exits(record, events, window).items()})
    codes.update({str(r): e["exit_code"] for r, e in reaped.items()})
    codes.update({str(r): f["exit_code"] for r, f in rank_failures(layout, attempt).items()})
    return codes


def _failure_fields(
    record: dict[str, Any], first: dict[str, Any] | None, evidence: list[dict[str, Any]]
) -> dict[str, Any]:
    fields: dict[str, Any] = {"evidence": evidence}
    if record.get("status") in (None, "starting", "running"):  # ended before it could say so
        stopped = first is not None and first["exit_code"] == exit_codes.INTERRUPTED
        fields["status"] = "interrupted" if stopped else "failed"  # a second Ctrl-C, or killed
    if first is None:
        return fields
    reported = {k: record[k] for k in ("failure_class", "exit_code") if k in record}
    if reported and reported != {
        "failure_class": first["failure_class"],
        "exit_code": first["exit_code"],
    }:
        fields["reported_by_rank0"] = reported
    fields.update(
        first_failing_rank=first["rank"],
        failure_class=first["failure_class"],
        failure_cause=first["cause"],
        exit_code=first["exit_code"],
        failure_time=first["time"],
    )
    return fields


def finalize_attempts(
    layout: RunLayout,
    attempts: list[int],
    events: LauncherEvents,
    tokens_per_step: int,
    interrupted: bool = False,
) -> None:
    """Merge root cause, losses and RTO into each attempt's record (its processes are gone).
    ``interrupted``: the launcher stopped the newest attempt on the user's Ctrl-C; a record
    its ranks could not finish (a second Ctrl-C stops them at once) says so."""
    records = {a: read_record(layout, a) for a in attempts}
    for index, attempt in enumerate(attempts):
        record = records[attempt]
        if not record:
            continue
        following = records.get(attempts[index + 1]) if index + 1 < len(attempts) else None
        summary = summarize(layout, attempt, record, following, events, tokens_per_step)
        unfinished = record.get("status") in (None, "starting", "running")
        if interrupted and following is None and unfinished:
            summary.update(status="interrupted", exit_code=exit_codes.INTERRUPTED,
                           failure_class="interrupted")  # fmt: skip
        try:
            atomic_write_json(
                layout.attempt_path(attempt), {**record, **summary, "finalized_at": time.time()}
            )
        except OSError as exc:  # a full disk: the record stays as the ranks wrote it
            log.warning("post-mortem of attempt %d not recorded: %s", attempt, exc)
