"""Which rank hung: evidence that tells the stuck or stopped rank from the peers waiting on it.

When one rank stops, every peer soon blocks in a collective waiting for it and the rank monitors
time them all out within the same tick, so neither the timeouts nor the order in which the
sections opened say who hung (the first rank to open a section is milliseconds ahead, at
random). Two kinds of evidence do (:mod:`resiliency.monitor.stacks`):

1. **Liveness heartbeats.** A stopped process (SIGSTOP, a frozen node, a swapped-out host) stops
   beating; its victims beat on until they are killed. The rank with by far the longest stall is
   the one that stopped, and its last beat is when it stopped: its last progress.
2. **Stack dumps**, where every rank was alive: the main thread of a victim waits inside
   ``torch.distributed``; the hung rank's does not.

Where neither tells (all stacks alike, several ranks stalled together), the answer is
"undetermined" and the reasoning says why, rather than a guess.
"""

from __future__ import annotations

from typing import Any

from resiliency.monitor.stacks import BEAT_S

UNDETERMINED = "undetermined"
# Shorter stalls are scheduling noise on a loaded host (a GIL held by a long C call).
STALL_MIN_S = 4 * BEAT_S
DOMINANCE = 2.0  # the stopped rank's stall must be this many times any other rank's


def rank_stalls(
    dumps: dict[int, dict[str, Any]], killed_at: dict[int, float] | None = None
) -> dict[int, tuple[float, float]]:
    """rank -> (longest stall in seconds, when it began) from the heartbeat slots.

    A rank that stopped for good has its stall end at the last beat any rank made (the peers
    beat until the group was torn down), or at its own rank monitor's kill (``killed_at``):
    a rank killed for waiting too long stops beating too, and its silence after the kill is
    no stall (without this, a peer waiting in a collective, killed first, read as the stopped
    rank while the hung one slept on, beating). One continued before its kill shows the gap.
    """
    beats = [d["beat_at"] for d in dumps.values() if d.get("beat_at")]
    if not beats:
        return {}
    last_alive = max(beats)
    killed_at = killed_at or {}
    stalls = {}
    for rank, dump in dumps.items():
        if not dump.get("beat_at"):
            continue
        silent = max(0.0, min(last_alive, killed_at.get(rank, last_alive)) - dump["beat_at"])
        if silent >= dump.get("stall_s", 0.0):
            stalls[rank] = (silent, dump["beat_at"])
        else:
            stalls[rank] = (dump["stall_s"], dump.get("stall_from") or dump["beat_at"])
    return stalls


def _by_heartbeat(
    dumps: dict[int, dict[str, Any]], killed_at: dict[int, float]
) -> dict[str, Any] | None:
    stalls = rank_stalls(dumps, killed_at)
    stalled = {r: s for r, s in stalls.items() if s[0] >= STALL_MIN_S}
    if not stalled:
        return None
    top = max(stalled, key=lambda r: stalled[r][0])
    longest, since = stalled[top]
    rivals = {r: s for r, s in stalls.items() if r != top and s[0] * DOMINANCE > longest}
    if rivals:
        together = sorted({**rivals, top: stalled[top]}.items())
        names = ", ".join(f"rank {r} {s[0]:.1f} s" for r, s in together)
        return _undetermined(
            "heartbeat",
            f"several ranks stopped responding together ({names}): a whole node, or the "
            "host, stalled",
            candidates=sorted([top, *rivals]),
        )
    others = max((s[0] for r, s in stalls.items() if r != top), default=0.0)
    return {
        "rank": top,
        "rule": "heartbeat",
        "reason": (
            f"rank {top} stopped responding for {longest:.1f} s (no liveness beat after "
            f"{since:.3f}); every other rank kept beating (longest stall {others:.1f} s): it "
            "was stopped or frozen, the others only waited for it"
        ),
        "last_progress_at": since,
    }


def _by_stack(dumps: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    dumped = {r: d for r, d in dumps.items() if d.get("dumped")}
    outside = [r for r, d in dumped.items() if not d.get("in_collective")]
    if len(outside) != 1 or len(dumped) < 2:
        return None
    rank = outside[0]
    dump = dumped[rank]
    return {
        "rank": rank,
        "rule": "stack",
        "reason": (
            f"rank {rank} was alive but stuck outside any collective in section "
            f"{dump.get('section')} (top frame {(dump.get('top_frames') or ['?'])[0]}); "
            f"ranks {sorted(set(dumped) - {rank})} were waiting inside torch.distributed"
        ),
        "last_progress_at": dump.get("progress_at") or dump.get("opened_at"),
    }


def _undetermined(rule: str, reason: str, candidates: list[int] | None = None) -> dict[str, Any]:
    found: dict[str, Any] = {"rank": UNDETERMINED, "rule": rule, "reason": reason}
    if candidates:
        found["candidates"] = candidates
    return found


def attribute_hang(
    dumps: dict[int, dict[str, Any]], killed_at: dict[int, float] | None = None
) -> dict[str, Any]:
    """The hung rank and the reasoning (``rank`` is ``"undetermined"`` where nothing tells).
    ``killed_at``: rank -> when its rank monitor killed it (a section timeout)."""
    if not dumps:
        return _undetermined("none", "no rank left liveness or stack evidence")
    found = _by_heartbeat(dumps, killed_at or {}) or _by_stack(dumps)
    if found is not None:
        return found
    dumped = sorted(r for r, d in dumps.items() if d.get("dumped"))
    waiting = sorted(r for r in dumped if dumps[r].get("in_collective"))
    return _undetermined(
        "none",
        f"every rank kept beating and the stacks do not tell (dumped: {dumped}, waiting in a "
        f"collective: {waiting})",
    )


def last_progress(dumps: dict[int, dict[str, Any]]) -> float | None:
    """Where no rank is named: the earliest last progress of any rank (the hang began after)."""
    times = [d.get("progress_at") or d.get("opened_at") for d in dumps.values()]
    return min((t for t in times if t), default=None)
