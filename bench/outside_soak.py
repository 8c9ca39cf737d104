"""P9: soaks with faults from outside, over several seeds (``python -m bench --only P9``).

Each seed runs ``python -m drill.soak --outside`` through its public CLI: the soak process
SIGKILLs and SIGSTOPs ranks, SIGKILLs checkpoint writers, flips a byte of a published step and
(as root) fills the run's disk, and cuts the run's object store (a real S3 server started
here, behind the soak's proxy), at moments drawn from the seed. This module grades each soak
itself, not by the soak's verdict: it reads both runs' ``metrics/steps.jsonl`` and compares the
losses bit for bit, finds each SIGKILL the soak reports in the launcher's own log (that rank's
-9 exit after the fault's moment), each SIGSTOP there as that rank's monitor timing it out,
each writer kill as the worker group failing, and each full disk as a worker's exit 10, the
launcher's stop and the relaunch after it. A seed meets the goal only if the soak itself also
exited 0 and injected every fault it planned (the plan fits the run's length).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.s3_server import S3Server, running_s3_server
from pretrain.context.run_dir import RunDir
from resiliency.storage.object_store import ObjectStore
from resiliency.storage.remote import committed_remote_steps

REPO = Path(__file__).resolve().parents[1]
STEPS, MTBF_STEPS, SAVE_EVERY = 64, 4, 4


def _losses(run_dir: Path) -> dict[int, float]:
    """This module's own reading: the last line per step wins (a re-run step replaces it)."""
    found: dict[int, float] = {}
    for line in RunDir(run_dir).steps_metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        found[record["step"]] = record["loss"]
    return found


def _kills_in_launcher_log(out: Path, injected: list[dict]) -> tuple[int, int]:
    """(SIGKILLs the soak reports, those the launcher's log shows as that rank's -9 exit
    before the next fault)."""
    text = (out / "logs" / "soak.log").read_bytes()
    ends = [i["log_offset"] for i in injected[1:]] + [len(text)]
    windows = [
        (i["rank"], text[i["log_offset"] : end].decode(errors="replace"))
        for i, end in zip(injected, ends)
        if i["kind"] in ("sigkill", "flip")  # a flip is followed by a rank's SIGKILL
    ]
    seen = sum(
        bool(re.search(rf"failed \(exitcode: -9\) local_rank: {rank}\b", window))
        for rank, window in windows
    )
    return len(windows), seen


# A rank monitor's timeout for a rank (nvrx 0.4: "[RankMonServer<r>@<host>:<rank>] Section ...
# has been open" / "Was out of section"; nvrx 0.7: "[workload:?(<rank>) ...] ... open"), and
# the launcher giving up on its worker group: this module's own reading of the launcher's log.
_MONITOR_TIMEOUT = (
    r"(?:RankMonServer\d+@[^\]]*?:{rank}\]|workload:\?\({rank}\))"
    r".*?(?:has been open for|Was out of section for)"
)
_GROUP_FAILED = re.compile(r"Worker group (?:FAILED|UNHEALTHY)")


def _stops_and_writer_kills_in_launcher_log(out: Path, injected: list[dict]) -> tuple[int, int]:
    """(SIGSTOPs and writer kills the soak reports, those the launcher's log shows: the
    stopped rank's monitor timing it out, or the worker group failing after a lost writer,
    before the next fault)."""
    text = (out / "logs" / "soak.log").read_bytes()
    ends = [i["log_offset"] for i in injected[1:]] + [len(text)]
    seen = total = 0
    for fault, end in zip(injected, ends):
        window = text[fault["log_offset"] : end].decode(errors="replace")
        if fault["kind"] == "sigstop":
            total += 1
            seen += bool(re.search(_MONITOR_TIMEOUT.format(rank=fault["rank"]), window))
        elif fault["kind"] == "kill_writer":
            total += 1
            seen += bool(_GROUP_FAILED.search(window))
    return total, seen


def _full_disks_in_launcher_log(out: Path, injected: list[dict]) -> tuple[int, int]:
    """(disks the soak reports it filled, those after which the launcher's log shows a
    worker's exit 10, the launcher's stop, and a new launch before the next fault)."""
    text = (out / "logs" / "soak.log").read_bytes()
    ends = [i["log_offset"] for i in injected[1:]] + [len(text)]
    windows = [
        text[i["log_offset"] : end].decode(errors="replace")
        for i, end in zip(injected, ends)
        if i["kind"] == "full_disk"
    ]
    seen = sum(
        bool(re.search(r"failed \(exitcode: 10\) local_rank: \d", window))
        and bool(re.search(r"launch local: stop 10 .*\n(?s:.*)launch local: node \S+: ", window))
        for window in windows
    )
    return len(windows), seen


def _flips_gone(injected: list[dict]) -> tuple[int, int]:
    """(bytes the soak flipped, those no published file holds any more at the end): read
    here, from the file system."""
    flips = [i for i in injected if i["kind"] == "flip"]
    gone = 0
    for flip in flips:
        path = Path(flip["flipped"])
        if not path.exists():
            gone += 1
            continue
        with path.open("rb") as f:
            f.seek(flip["flipped_at"])
            gone += f.read(1) != bytes([flip["flipped_to"]])
    return len(flips), gone


def one_soak(
    work: Path, data: str, seed: int, env: dict[str, str], s3: S3Server | None = None
) -> dict[str, Any]:
    out = work / f"outside-{seed}"
    remote = []
    if s3 is not None:  # the soak cuts it from outside (s3_outage)
        env = {**env, **s3.env, "AWS_ENDPOINT_URL": s3.endpoint_url}
        remote = [f"checkpoint.remote.url={s3.url(f'p9-{seed}')}",
                  "checkpoint.remote.follow_interval_s=1"]  # fmt: skip
    cmd = [
        sys.executable, "-m", "drill.soak", "--outside", f"--out={out}", f"--steps={STEPS}",
        f"--mtbf-steps={MTBF_STEPS}", f"--seed={seed}", "recipe=gpt_tiny",
        f"data.paths=[{data}]", f"checkpoint.save_interval={SAVE_EVERY}",
        "checkpoint.async_save=true", "resiliency.ft.timeout_floor_s=4",
        "resiliency.ft.learn_after_steps=3", "resiliency.ft.check_interval_s=0.5",
        "logging.level=WARNING", *remote,
    ]  # fmt: skip
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, text=True, capture_output=True, check=False)
    wall = time.perf_counter() - started
    if not (out / "soak.json").exists():
        raise RuntimeError(f"soak seed {seed} failed ({proc.returncode}): {proc.stderr[-3000:]}")
    remote_newest = None
    if s3 is not None:  # read here, straight from the server (not through the soak's proxy)
        remote_newest = _newest_on_server(s3, f"p9-{seed}/soak")
    return {
        "seed": seed,
        **grade_soak(out, proc.returncode, remote_newest, STEPS),
        "wall_s": round(wall, 1),
    }


def grade_soak(out: Path, soak_exit: int, remote_newest: int | None, steps: int) -> dict[str, Any]:
    """One soak's P9 row, read from its output dir: the soak's report for what it says it did,
    the launcher's log and the file system for whether it happened, both runs' losses."""
    report = json.loads((out / "soak.json").read_text())["outside"]
    injected = report["injected"]
    clean, soak = _losses(out / "runs" / "clean" / "soak"), _losses(out / "runs" / "soak" / "soak")
    kills, kills_seen = _kills_in_launcher_log(out, injected)
    hangs, hangs_seen = _stops_and_writer_kills_in_launcher_log(out, injected)
    flips, flips_gone = _flips_gone(injected)
    disks, disks_seen = _full_disks_in_launcher_log(out, injected)
    return {
        "steps": steps,
        "planned": len(report["plan"]),
        "faults": len(injected),
        "kinds": sorted({i["kind"] for i in injected}),
        "soak_exit": soak_exit,
        "soak_confirmed": sum(i["confirmed"] for i in injected),
        "kills": kills,
        "kills_in_launcher_log": kills_seen,
        "stops_and_writer_kills": hangs,
        "stops_and_writer_kills_in_launcher_log": hangs_seen,
        "flips": flips,
        "flips_no_longer_published": flips_gone,
        "full_disks": disks,
        "full_disks_stopped_and_relaunched": disks_seen,
        "outages": sum(i["kind"] == "s3_outage" for i in injected),
        "remote_newest_step": remote_newest,
        "steps_complete": sorted(soak) == list(range(1, steps + 1)),
        "bit_exact": soak == clean,
    }


def p9_goal_met(runs: list[dict[str, Any]]) -> bool:
    """Every soak exited 0, injected what it planned, lost no step, and every fault it reports
    shows where this module looks."""
    return bool(runs) and all(
        r["soak_exit"] == 0
        and r["faults"] == r["planned"]
        and r["bit_exact"]
        and r["steps_complete"]
        and r["kills"] == r["kills_in_launcher_log"]
        and r["stops_and_writer_kills"] == r["stops_and_writer_kills_in_launcher_log"]
        and r["flips"] == r["flips_no_longer_published"]
        and r["full_disks"] == r["full_disks_stopped_and_relaunched"]
        and (not r["outages"] or r["remote_newest_step"] == r["steps"])
        for r in runs
    )


def _newest_on_server(s3: S3Server, prefix: str) -> int | None:
    """The newest step committed under ``prefix``, read with the server's own credentials."""
    saved = {k: os.environ.get(k) for k in s3.env}
    os.environ.update(s3.env)  # boto3 takes its credentials from the environment
    try:
        committed = committed_remote_steps(ObjectStore(s3.url(prefix), s3.endpoint_url), "soak")
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return committed[-1] if committed else None


def bench_outside(work: Path, data: str, seeds: list[int], env: dict[str, str]) -> dict[str, Any]:
    with running_s3_server(work / "p9-s3") as s3:
        runs = [one_soak(work, data, seed, env, s3) for seed in seeds]
    return {
        "P9_runs": runs,
        "P9_faults": sum(r["faults"] for r in runs),
        "P9_goal_met": p9_goal_met(runs),
    }
