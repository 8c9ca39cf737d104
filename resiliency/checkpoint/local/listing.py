"""What the node-local tier holds for a run, read from its node dirs (no process group)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from resiliency.checkpoint.local.store import content_problem, list_local_files, read_meta


@dataclass
class LocalStep:
    step: int
    world_size: int | None = None
    bytes: int = 0
    copies: dict[int, list[tuple[str, str | None]]] = field(
        default_factory=dict
    )  # owner -> (where, problem)

    @property
    def complete(self) -> bool:
        """Every rank's shard has at least one verified copy somewhere."""
        if not self.world_size:
            return False
        return all(
            any(problem is None for _, problem in self.copies.get(rank, []))
            for rank in range(self.world_size)
        )


def scan_local_tier(local_dir: Path, run_id: str) -> list[LocalStep]:
    """Every step found under ``<local_dir>/node-*/<run_id>/<rank>/``, newest first."""
    steps: dict[int, LocalStep] = {}
    copies: dict[int, dict[int, list[tuple[str, str | None]]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for rank_dir in sorted(local_dir.glob(f"node-*/{run_id}/*")):
        for entry in list_local_files(rank_dir):
            if entry.dirty:
                continue
            meta = read_meta(entry)
            problem = content_problem(entry, meta) if meta else "no checksum sidecar"
            record = steps.setdefault(entry.step, LocalStep(entry.step))
            record.world_size = record.world_size or (meta or {}).get("signature", {}).get(
                "world_size"
            )
            record.bytes += entry.path.stat().st_size
            kind = "own" if str(entry.owner) == rank_dir.name else "replica"
            where = f"{rank_dir.parent.parent.name} rank {rank_dir.name} ({kind})"
            copies[entry.step][entry.owner].append((where, problem))
    for step, record in steps.items():
        record.copies = dict(copies[step])
    return [steps[s] for s in sorted(steps, reverse=True)]


def describe_copies(record: LocalStep) -> str:
    parts = []
    for owner in sorted(record.copies):
        held = ", ".join(
            where + ("" if problem is None else f" BAD({problem})")
            for where, problem in record.copies[owner]
        )
        parts.append(f"r{owner}: {held}")
    return "; ".join(parts)
