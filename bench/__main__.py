"""``python -m bench [--full]``: P1-P8 as ratios to baselines measured in the same run; P9,
soaks with faults from outside over several seeds, graded by the bench's own reading.

Quick (default): the tiny recipe, P1 P2 P3 P5, and P7 (object-store upload ÷ raw PUT).
``--full``: also the >= 1 GiB-state model for P1-P3, and P4, P6, P8, P9. Every figure is
the median of ``--reps`` repetitions (min and max too); baseline and subject repetitions are
interleaved, so machine drift hits both alike.
Prints a markdown table; ``--json`` / ``--md`` also write it to files.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from bench import hang_detection, remote_upload
from bench.outside_soak import bench_outside
from bench.recovery import bench_recovery
from bench.table import table
from pretrain.context.run_dir import RunDir, iter_jsonl

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
WORKER = str(REPO / "bench" / "worker.py")
GIB = 1 << 30

# The tiny recipe as shipped (TP=2 on 2 ranks), and a 8-layer, hidden-1024 GPT on the same
# layout whose full training state (fp32 weights + Adam moments) is ~1.5 GiB: I/O dominates.
CONFIGS: dict[str, list[str]] = {
    "tiny": ["recipe=gpt_tiny"],
    "1.5GiB": [
        "recipe=gpt_tiny",
        "model.num_layers=8",
        "model.hidden_size=1024",
        "model.num_attention_heads=16",
        "model.ffn_hidden_size=4096",
        "model.layout_invariant_init=false",
        "train.micro_batch_size=2",
        "train.global_batch_size=4",
    ],
}
# The same model with the DP-reshardable optimizer format (P1/P2 only): shows what the default
# fully_reshardable format's save-time re-layout of the optimizer state costs.
CONFIGS["1.5GiB-dp"] = [*CONFIGS["1.5GiB"], "checkpoint.optim_format=dp_reshardable"]
SAVE_ONLY = {"1.5GiB-dp"}
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def stats(values: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def overrides(config: str, work: Path, data: str) -> list[str]:
    return [
        *CONFIGS[config],
        f"data.paths=[{data}]",
        f"output_dir={work / 'runs'}",
        f"run_id={config}",
        "train.train_steps=1000",
        "checkpoint.lease_timeout_s=3",
        "logging.level=WARNING",
    ]


def torchrun(args: list[str], timeout: float = 1200, tries: int = 1, ft: bool = False) -> None:
    """2 ranks of ``args`` under torchrun, or (``ft``) under nvidia-resiliency-ext's
    ft_launcher, as ``launch local launch.backend=ft_launcher`` runs a job: every rank then has
    its fault-tolerance hook (rank monitor heartbeats and sections) as a user's job does."""
    launcher = [sys.executable, "-m", "launch.torchrun", "--ft-launcher"] if ft else [TORCHRUN]
    for attempt in range(tries):
        proc = subprocess.run(
            [*launcher, "--standalone", "--nproc-per-node=2", *args],
            cwd=REPO,
            env=ENV,
            text=True,
            capture_output=True,
            timeout=timeout,
        )
        if proc.returncode == 0:
            return
        err = proc.stderr
        first = err.find("Traceback")
        detail = err[first : first + 6000] if first >= 0 else err[-6000:]
        print(
            f"[bench] {args[:2]} failed ({proc.returncode}), try {attempt + 1}/{tries}:\n{detail}",
            file=sys.stderr,
        )
    raise RuntimeError(f"{args[:2]} failed {tries} times")


def worker(
    mode: str,
    config: str,
    work: Path,
    data: str,
    *extra: str,
    more: tuple[str, ...] = (),
    ft: bool = False,
) -> dict[str, Any]:
    out = work / f"{mode}-{config}.json"
    torchrun([WORKER, mode, f"--out={out}", *extra, *overrides(config, work, data), *more], ft=ft)
    return json.loads(out.read_text())


# ---------------------------------------------------------------- P1 + P2
def bench_save(config: str, work: Path, data: str, reps: int, pairs: int) -> dict[str, Any]:
    return save_figures(worker("save", config, work, data, f"--reps={reps}", f"--pairs={pairs}"))


def save_figures(raw: dict[str, Any]) -> dict[str, Any]:
    """P1 and P2 from the save worker's measurements (bench/worker.py ``mode_save``): P1 the
    save's bandwidth over the raw fsync'd write's, per pair (each pair writes the rank's bytes
    on every one of the 2 ranks), a repetition the median of its pairs; P2 the async save's
    blocked time over its bytes' memcpy time, goal blocked <= 2 x memcpy + 50 ms."""
    asyn = raw["async"]
    nbytes = raw["bytes"]
    sync = [pair for rep in raw["sync"] for pair in rep]

    def save_over_raw(pair: dict[str, Any]) -> float:
        return (pair["bytes"] / pair["save_s"]) / (raw["bytes_per_rank"] * 2 / pair["raw_s"])

    # A repetition: the median of its pairs' ratios (P5's estimator).
    p1 = [statistics.median(save_over_raw(p) for p in rep) for rep in raw["sync"]]
    blocked = [a["blocked_s"] for a in asyn]
    memcpy = [a["memcpy_s"] for a in asyn]
    slowdown = [
        statistics.median(a["busy_steps"]) / statistics.median(a["idle_steps"]) - 1
        for a in asyn
        if a["busy_steps"]
    ]
    raw_slowdown = [
        statistics.median(a["raw_busy_steps"]) / statistics.median(a["idle_steps"]) - 1
        for a in asyn
        if a.get("raw_busy_steps")
    ]
    lost = [
        sum(a["busy_steps"]) - len(a["busy_steps"]) * statistics.median(a["idle_steps"])
        for a in asyn
    ]
    raw_lost = [
        sum(a["raw_busy_steps"]) - len(a["raw_busy_steps"]) * statistics.median(a["idle_steps"])
        for a in asyn
        if "raw_busy_steps" in a
    ]
    phases: dict[str, list[float]] = {}
    for p in sync:
        for key, value in p["phases"].items():
            phases.setdefault(key, []).append(value)
    return {
        "bytes": nbytes,
        "P1": stats(p1),
        "P1_pairs": len(sync),
        "raw_write_GiBps": stats([raw["bytes_per_rank"] * 2 / p["raw_s"] / GIB for p in sync]),
        # A raw write right after a save (not the baseline: see worker.py).
        "raw_after_save_GiBps": stats(
            [raw["bytes_per_rank"] * 2 / p["raw_after_save_s"] / GIB for p in sync]
        ),
        "save_GiBps": stats([p["bytes"] / p["save_s"] / GIB for p in sync]),
        "save_phases_s": {k: statistics.median(v) for k, v in phases.items()},
        "reread_checksum_s": stats([p["reread_checksum_s"] for p in sync]),
        "P2_blocked_over_memcpy": stats([b / m for b, m in zip(blocked, memcpy)]),
        "P2_blocked_s": stats(blocked),
        "P2_memcpy_s": stats(memcpy),
        "P2_save_call_s": stats([a["save_call_s"] for a in asyn]),
        "P2_commit_s": stats([a["commit_s"] for a in asyn]),
        "P2_goal_met": statistics.median(blocked) <= 2 * statistics.median(memcpy) + 0.05,
        # The first async save of an attempt (writer spawned at start, buffers allocated):
        # once per attempt, so one sample per run; the goal applies to it as well.
        "P2_first_blocked_s": raw["async_first"]["blocked_s"],
        "P2_first_save_call_s": raw["async_first"]["save_call_s"],
        "P2_first_commit_s": raw["async_first"]["commit_s"],
        # The dry run that sizes the staging buffers, after the attempt's first step.
        "P2_first_reserve_s": raw["async_first"].get("reserve_s", 0.0),
        "P2_first_blocked_over_memcpy": raw["async_first"]["blocked_s"]
        / raw["async_first"]["memcpy_s"],
        "P2_first_goal_met": raw["async_first"]["blocked_s"]
        <= 2 * raw["async_first"]["memcpy_s"] + 0.05,
        "P2_step_slowdown": stats(slowdown) if slowdown else None,
        "P2_busy_steps": sum(len(a["busy_steps"]) for a in asyn),
        "P2_raw_write_slowdown": stats(raw_slowdown) if raw_slowdown else None,
        "P2_lost_s_per_save": stats(lost),
        "P2_raw_write_lost_s": stats(raw_lost) if raw_lost else None,
        "idle_step_s": stats([statistics.median(a["idle_steps"]) for a in asyn]),
    }


# ---------------------------------------------------------------- P3
def _drop_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _cold_read(paths: list[Path]) -> float:
    _drop_cache(paths)
    buf = bytearray(8 << 20)
    start = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    elapsed = time.perf_counter() - start
    _drop_cache(paths)
    return elapsed


def _first_step_after(run_dir: Path, since: float, proc: subprocess.Popen, limit: float) -> float:
    metrics = RunDir(run_dir).steps_metrics
    deadline = time.time() + limit
    while time.time() < deadline:
        for record in iter_jsonl(metrics):
            if record["time"] > since:
                return record["time"]
        if proc.poll() is not None:
            raise RuntimeError(
                f"restore run exited {proc.returncode}: "
                f"{proc.stderr.read()[-4000:] if proc.stderr else ''}"
            )
        time.sleep(0.05)
    raise TimeoutError("no step after restore")


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and its workers (it starts them in sessions of their own)."""
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    for p in [psutil.Process(proc.pid), *family] if proc.poll() is None else family:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs(family, timeout=30)


def _startup_phases(run_dir: Path, launched: float) -> dict[str, float]:
    """Where a start's time went (a restore's or a fresh one's), from its attempt record's
    startup clock."""
    records = sorted(RunDir(run_dir).attempts_dir.glob("attempt-*.json"))
    times = json.loads(records[-1].read_text()).get("startup", {}) if records else {}
    marks = [
        ("launch", launched),
        ("configure", times.get("configure_at")),
        ("load", times.get("load_started_at")),
        ("first_step", times.get("first_step_started_at")),
        ("done", times.get("first_step_done_at")),
    ]
    names = {
        "launch": "start_s",
        "configure": "plan_and_build_s",
        "load": "load_s",
        "first_step": "first_step_s_only",
    }
    phases = {
        names[a]: tb - ta
        for (a, ta), (_, tb) in zip(marks, marks[1:])
        if ta is not None and tb is not None
    }
    if times.get("first_step_started_at") is not None:
        phases["resumed_s"] = times["first_step_started_at"] - launched
    return phases


_START_PHASES = ("start_s", "plan_and_build_s", "load_s")


def _time_to_training(config: str, work: Path, data: str, run_dir: Path) -> dict[str, float]:
    """Launch the job, wait for its first step, kill it; where the time went (the attempt
    record's startup clock). A run dir with a checkpoint restores it; an empty one starts
    fresh."""
    start = time.time()
    proc = subprocess.Popen(
        [
            TORCHRUN,
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "pretrain",
            *overrides(config, work, data),
            f"output_dir={run_dir.parent}",
        ],
        cwd=REPO,
        env=ENV,
        text=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        first = _first_step_after(run_dir, start, proc, 900) - start
        phases = _startup_phases(run_dir, start)
        deadline = time.time() + 60  # the record's startup clock is written after the step
        while "resumed_s" not in phases and time.time() < deadline:
            time.sleep(0.1)
            phases = _startup_phases(run_dir, start)
    finally:  # the kill of "restore after a kill": the next rep restores again
        _kill_tree(proc)
    if "resumed_s" not in phases:
        raise RuntimeError(f"{run_dir}: no first_step_started_at in the attempt record")
    return {"first_step_s": first, **phases}


def bench_restore(config: str, work: Path, data: str, reps: int, pairs: int) -> dict[str, Any]:
    """P3: (launch -> training resumes) - (launch -> training starts, same job, fresh) over
    the checkpoint's cold read time: what restoring adds to a start, per byte-read time. A
    repetition is the median of ``pairs`` fresh/restore pairs (P5's estimator), the order
    flipped every other pair."""
    run_dir = work / "runs" / config
    step_dir = max(RunDir(run_dir).steps_dir.glob("step-?????????"))
    files = [p for p in step_dir.rglob("*") if p.is_file()]
    nbytes = sum(p.stat().st_size for p in files)
    samples: list[dict[str, float]] = []
    for index in range(reps * pairs):
        sample: dict[str, float] = {}
        for which in ("fresh", "restore") if index % 2 == 0 else ("restore", "fresh"):
            if which == "fresh":
                fresh = work / "fresh" / f"pair{index}" / config  # no checkpoint: a fresh start
                started = _time_to_training(config, work, data, fresh)
                sample["fresh_s"] = started["resumed_s"]
                sample.update({f"fresh_{k}": started[k] for k in _START_PHASES if k in started})
                continue
            sample["read_s"] = _cold_read(files)
            time.sleep(3.5)  # the killed run's lease goes stale (checkpoint.lease_timeout_s=3)
            sample.update(_time_to_training(config, work, data, run_dir))
        samples.append(sample)
    return restore_figures(samples, nbytes, pairs)


def restore_figures(samples: list[dict[str, float]], nbytes: int, pairs: int) -> dict[str, Any]:
    """P3 from fresh/restore pairs: (restore's launch -> training resumes) - (fresh start's
    launch -> training starts), over the checkpoint's cold read time; a repetition is the
    median of ``pairs`` consecutive pairs. Goal <= 1.25."""
    # Restore ends when training resumes (the first step starts); the step itself is training
    # and is reported next to it.
    per_pair = [(s["resumed_s"] - s["fresh_s"]) / s["read_s"] for s in samples]
    ratios = [statistics.median(per_pair[i : i + pairs]) for i in range(0, len(per_pair), pairs)]
    return {
        "bytes": nbytes,
        "P3": stats(ratios),
        "P3_pairs": len(samples),
        # The same in seconds: what a restore adds whatever the disk's read speed.
        "P3_added_s": stats([s["resumed_s"] - s["fresh_s"] for s in samples]),
        "P3_samples": samples,  # every pair, with the restore's startup phases
        "resumed_s": stats([s["resumed_s"] for s in samples]),
        "fresh_s": stats([s["fresh_s"] for s in samples]),
        "first_step_s": stats([s["first_step_s"] for s in samples]),
        "read_s": stats([s["read_s"] for s in samples]),
        "read_GiBps": stats([nbytes / s["read_s"] / GIB for s in samples]),
        "phases_s": {
            k: statistics.median(s[k] for s in samples if k in s)
            for k in (*_START_PHASES, "first_step_s_only")
            if any(k in s for s in samples)
        },
        # Where the added time went: each startup phase's restore - fresh, median over pairs
        # (a fresh start draws the weights in plan_and_build_s, which a restore skips).
        "added_by_phase_s": {
            k: statistics.median(s[k] - s[f"fresh_{k}"] for s in samples)
            for k in _START_PHASES
            if all(k in s and f"fresh_{k}" in s for s in samples)
        },
        "P3_goal_met": statistics.median(ratios) <= 1.25,
    }


# ---------------------------------------------------------------- P6
SOAK_COST_MULTIPLE = 20  # MTBF = 20 x (save + restart cost): a long-run regime, not a storm


def bench_soak(work: Path, data: str, minutes: float) -> dict[str, Any]:
    """P6: the chaos soak's measured goodput over the planner's prediction for the costs the
    soak measured, at MTBF = 20 x (save + restart cost); run through its public CLI (the
    drill is an application beside this one, not a library of it)."""
    out = work / "soak"
    cmd = [
        sys.executable,
        "-m",
        "drill.soak",
        f"--out={out}",
        f"--minutes={minutes}",
        f"--mtbf-x-cost={SOAK_COST_MULTIPLE}",
        "recipe=gpt_tiny",
        f"data.paths=[{data}]",
        "logging.level=WARNING",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, text=True, capture_output=True, check=False)
    if not (out / "soak.json").exists():
        raise RuntimeError(f"soak failed ({proc.returncode}): {proc.stderr[-4000:]}")
    report = json.loads((out / "soak.json").read_text())
    measured, predicted = report.get("goodput"), report.get("goodput_predicted")
    return {
        "P6": measured / predicted if measured and predicted else None,
        "goodput": measured,
        "goodput_predicted": predicted,
        "faults": sum(o["fired"] for o in report["outcomes"]),
        "kinds": sorted({o["spec"].split("@")[0] for o in report["outcomes"] if o["fired"]}),
        "passed": report["passed"],
        "problems": report["problems"],
        "costs": report["costs"],
        "mtbf_s": report.get("mtbf_s"),
        "wall_s": report["wall_s"],
        "steps": report["steps"],
    }


# ---------------------------------------------------------------- P4, P5
def bench_hang(work: Path, data: str, reps: int, stops: int) -> dict[str, Any]:
    seed = random.SystemRandom().randrange(1 << 30)  # in the result: rerun the same stops
    return hang_detection.bench(work, data, reps, stops, seed)


# P5's unit: the mean step time over a block of this many consecutive steps, so periodic hook
# work (metrics files, TensorBoard flushes every resiliency.metrics.write_interval_steps) is in it.
P5_BLOCK_STEPS = 10


def bench_overhead(config: str, work: Path, data: str, reps: int) -> dict[str, Any]:
    # A block of framework steps, one without its TensorBoard hook, one of bare steps, rotating;
    # each ratio compares two blocks seconds apart, so machine drift cancels; every 4 triples
    # make one repetition: the median of their ratios (a block stalled by another tenant of the
    # machine is not overhead). Under ft_launcher, so every default hook of a fault-tolerant job
    # runs (the rank monitor's heartbeats and sections included).
    per_rep = 4
    # No periodic saves (the recipe's save_interval): checkpoint cost is P1/P2's business.
    raw = worker(
        "overhead",
        config,
        work,
        data,
        f"--reps={per_rep * reps}",
        f"--block-steps={P5_BLOCK_STEPS}",
        more=("checkpoint.save_interval=null",),
        ft=True,
    )
    pairs = raw["pairs"]
    groups = [pairs[i : i + per_rep] for i in range(0, len(pairs), per_rep)]

    def med(group: list[dict], key: str) -> float:
        return statistics.median(p[key] for p in group)

    ratios = [statistics.median(p["framework_s"] / p["bare_s"] for p in g) for g in groups]
    # TensorBoard's share: the same framework with and without the reporting hooks.
    reporting = [statistics.median(p["framework_s"] / p["unreported_s"] for p in g) for g in groups]
    unreported = [statistics.median(p["unreported_s"] / p["bare_s"] for p in g) for g in groups]
    shim = raw["shim"]
    return {
        "P5": stats(ratios),
        "P5_without_reporting": stats(unreported),
        "reporting_share": stats(reporting),
        "bare_step_s": stats([med(g, "bare_s") for g in groups]),
        "framework_step_s": stats([med(g, "framework_s") for g in groups]),
        "hooks_ms_per_step": {
            k: round(v * 1e3, 3) for k, v in raw["hooks_s_per_step"].items() if v >= 1e-4
        },
        "shim_calls_per_step": shim["calls_per_step"],
        "shim_s_per_step": shim["per_step_s"],
        "shim_fraction_of_bare_step": shim["per_step_s"] / raw["bare_step_s"],
    }


SECTIONS = ("P1", "P2", "P3", "P4", "P5", "P6", "P7", "P8", "P9")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="add the 1.5 GiB model and P4")
    parser.add_argument("--reps", type=int, default=5, help="repetitions per figure (>= 5)")
    parser.add_argument(
        "--pairs",
        type=int,
        default=3,
        help="P1 and P3: baseline/subject pairs per repetition (its value is their median)",
    )
    parser.add_argument("--hang-reps", type=int, default=1, help="P4 runs per section (~40 s)")
    parser.add_argument("--hang-stops", type=int, default=10, help="P4 random SIGSTOPs")
    parser.add_argument("--only", default="", help="comma-separated sections, e.g. P1,P5")
    parser.add_argument("--soak-minutes", type=float, default=20.0, help="P6's training time")
    parser.add_argument(
        "--soak-seeds", default="1,2,3", help="P9: the outside soaks' seeds, comma-separated"
    )
    parser.add_argument(
        "--configs",
        default="",
        help=f"comma-separated models instead of the defaults: {', '.join(CONFIGS)}",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="where checkpoints go (the disk under test); default: a temp dir",
    )
    parser.add_argument("--keep", action="store_true", help="keep the work dir")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--md", type=Path, default=None)
    return parser


def main(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    only = {s.strip().upper() for s in args.only.split(",") if s.strip()} or set(SECTIONS)
    if not args.full and not args.only:
        only -= {"P4", "P6", "P8", "P9"}  # minutes each: full mode, or asked for by name
    configs = list(CONFIGS) if args.full else ["tiny"]
    if args.configs:
        configs = [c.strip() for c in args.configs.split(",") if c.strip()]
        unknown = sorted(set(configs) - set(CONFIGS))
        if unknown:
            parser.error(f"--configs: unknown {unknown}; choose from {', '.join(CONFIGS)}")
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)  # the disk under test, as named
    work = Path(tempfile.mkdtemp(prefix="bench-", dir=args.workdir))
    warnings.simplefilter("ignore")
    sys.path.insert(0, str(REPO))
    results: dict[str, Any] = {
        "configs": {c: CONFIGS[c] for c in configs},
        "reps": args.reps,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    began = time.perf_counter()

    def section(name: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        value = fn()
        print(f"[bench] {name}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
        return value

    try:
        data = hang_detection.prepare_corpus(work)
        for config in configs:
            if only & {"P1", "P2", "P3"}:  # P3 restores what the save bench wrote
                results.setdefault("save", {})[config] = section(
                    f"P1/P2 {config}",
                    lambda c=config: bench_save(c, work, data, args.reps, args.pairs),
                )
            if "P3" in only and config not in SAVE_ONLY:
                results.setdefault("restore", {})[config] = section(
                    f"P3 {config}",
                    lambda c=config: bench_restore(c, work, data, args.reps, args.pairs),
                )
        if "P4" in only:
            results["hang"] = section(
                "P4", lambda: bench_hang(work, data, args.hang_reps, args.hang_stops)
            )
        if "P5" in only:
            results.setdefault("overhead", {})["tiny"] = section(
                "P5 tiny", lambda: bench_overhead("tiny", work, data, args.reps)
            )
        if "P6" in only:
            results["soak"] = section("P6", lambda: bench_soak(work, data, args.soak_minutes))
        if "P7" in only:  # 512 MiB in 32 objects, raw and protocol runs interleaved
            results["remote"] = section(
                "P7", lambda: remote_upload.bench_remote(work / "remote", 32, 16, 3, 8)
            )
        if "P8" in only:  # a kill per repetition, with and without standby workers
            results["recovery"] = section("P8", lambda: bench_recovery(work, data, args.reps))
        if "P9" in only:  # one outside soak per seed, graded here
            seeds = [int(x) for x in args.soak_seeds.split(",") if x.strip()]
            results["outside"] = section("P9", lambda: bench_outside(work, data, seeds, ENV))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"[bench] work dir kept: {work}", file=sys.stderr)
    results["wall_s"] = time.perf_counter() - began
    if args.json:  # before the table: a figure the table cannot show must not be lost
        args.json.write_text(json.dumps(results, indent=1))
    text = table(results)
    print(text, end="")
    if args.md:
        args.md.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
