"""Faults from outside the trainer (``python -m drill.soak --outside``).

The soak process itself, not the trainer, injects each fault into the running job: SIGKILL of a
rank's trainer (``sigkill``), SIGSTOP of one (``sigstop``: a hang the launcher's rank monitor
must catch), SIGKILL of a rank's checkpoint writer (``kill_writer``), bit rot in the newest
published step followed by a rank's SIGKILL (``flip``: one byte of its largest file inverted in
place, at a position drawn from the seed, once an older step is published too, so the restart
must refuse that step and restore the one before), a full disk (``full_disk``: the soak run's
own tmpfs, :mod:`drill.soak.disk`, filled to the last byte; the run must stop at its next save
with exit 10, not retried, its published steps untouched; the soak then acts as the operator,
deletes the filler and relaunches the same command) and an object-store outage (``s3_outage``,
for a run with ``checkpoint.remote.url``: the soak puts the job's S3 endpoint behind
:class:`~drill.fault_proxy.FaultProxy`, which answers every request 503 for a duration drawn
from the seed; the uploader must ride it out), at moments drawn from the seed it prints: after
the job trains again (one new step since the last fault), an exponential gap with mean
``--mtbf`` seconds, then the fault, on a rank drawn from the seed.

Each fault's effect is confirmed from evidence the trainer does not write: the process it hit is
gone (the operating system), and the launcher's log, after the moment of the fault, reports that
rank's death with the expected exit (-9 for a kill; 1, a lost writer, at the rank's next save)
or, for a stopped rank, its rank monitor's timeout; for a full disk, the launch's own exit
status (10) and the file system's free bytes after the fill (none); for an outage, the proxy's
count of requests it refused, and at the end the run's newest published step committed in the
object store (read past the proxy); for a flipped byte, in addition, that by the end of the run
no published step holds it at that path (the refused step set aside or saved anew). The
trajectory is read straight from ``metrics/steps.jsonl`` by :func:`losses`, apart from the
soak's report code, and compared bit for bit with the clean run's.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from drill.fault_proxy import FaultProxy
from drill.soak import disk
from launch.processes import rank_workers, writers
from pretrain.context import exit_codes
from pretrain.context.run_dir import RunDir
from resiliency.storage.layout import RunLayout

log = logging.getLogger(__name__)

OUTSIDE_KINDS = ("sigkill", "sigstop", "kill_writer", "flip", "full_disk", "s3_outage")
OUTAGE_S = (5.0, 20.0)  # s3_outage: its duration, uniform in this range
FULL_BYTES = 64 << 10  # free bytes at most after a fill: a full disk (a block or two of slack)
TARGET_WAIT_S = 20.0  # a rank's trainer or writer not there yet (between attempts)
EFFECT_WAIT_S = 180.0  # the longest a fault's effect may take to show (a hang: its timeout)


@dataclass(frozen=True)
class OutsideFault:
    kind: str
    rank: int
    gap_s: float  # after the job trains again (a new step since the previous fault)
    where: float = 0.0  # flip: the byte's position, a fraction of the file's size
    outage_s: float = 0.0  # s3_outage: how long the object store answers 503


@dataclass
class Injection:
    kind: str
    rank: int
    pid: int  # the process hit
    at: float  # wall time
    log_offset: int  # the launcher log's size then: the evidence comes after it
    evidence: str = ""
    confirmed: bool = False
    flipped: str = ""  # flip: the file (absolute path) ...
    flipped_at: int = -1  # ... the byte's offset in it ...
    flipped_to: int = -1  # ... and the value written there
    free_bytes: int = -1  # full_disk: what the file system had left after the fill ...
    exit_code: int | None = None  # ... and how the launch it hit ended
    outage_s: float = 0.0  # s3_outage: how long it lasted ...
    refused: int = 0  # ... the requests the proxy answered 503 meanwhile ...
    remote_newest: int | None = None  # ... and the newest step committed remotely at the end
    local_newest: int | None = None  # (the run's newest published step then)


@dataclass
class OutsideRun:
    seed: int
    plan: list[OutsideFault]
    injected: list[Injection] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    exit_code: int | None = None

    def record(self) -> dict:
        return {
            "seed": self.seed,
            "plan": [asdict(f) for f in self.plan],
            "injected": [asdict(i) for i in self.injected],
            "skipped": self.skipped,
            "exit_code": self.exit_code,
        }


def plan_outside(
    rng: random.Random, count: int, mtbf_s: float, nproc: int, kinds: tuple[str, ...]
) -> list[OutsideFault]:
    """``count`` faults: kinds dealt from shuffled decks, ranks and gaps from ``rng``."""
    plan, deck = [], []
    for _ in range(count):
        deck = deck or rng.sample(list(kinds), len(kinds))
        kind = deck.pop()
        rank, gap = rng.randrange(nproc), rng.expovariate(1 / mtbf_s)
        where = rng.random() if kind == "flip" else 0.0
        outage = rng.uniform(*OUTAGE_S) if kind == "s3_outage" else 0.0
        plan.append(OutsideFault(kind, rank, gap, where, outage))
    return plan


def _steps_done(run_dir: Path) -> int:
    try:
        return len(RunDir(run_dir).steps_metrics.read_text().splitlines())
    except FileNotFoundError:
        return 0


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


class OutsideDriver:
    """Injects ``plan`` into the job ``run_dir`` that ``job`` (its launcher) runs."""

    def __init__(
        self,
        run_dir: Path,
        launcher_log: Path,
        run: OutsideRun,
        hang_after_steps: int = 0,
        timeout_s: float = 3600.0,
        disk_root: Path | None = None,
        proxy: FaultProxy | None = None,
        remote_newest: Callable[[], int | None] | None = None,
    ) -> None:
        self.run_dir, self.launcher_log, self.run = run_dir, launcher_log, run
        self.disk_root = disk_root  # full_disk: the soak run's own tmpfs
        # s3_outage: the proxy in front of the job's object store, and the newest step
        # committed there, read past the proxy
        self.proxy, self.remote_newest = proxy, remote_newest
        self._refused_before = 0  # the proxy's count when the outage began
        self._outage_timer: threading.Timer | None = None  # ends the outage under way
        self.deadline = time.monotonic() + timeout_s  # the job's, like its launch timeout
        # A hang is caught by the learned timeouts (resiliency.ft.learn_after_steps); before
        # them the launcher waits the untrained default (minutes).
        self.earliest = {"sigstop": hang_after_steps}

    def drive(self, job: subprocess.Popen, relaunch: Callable[[], subprocess.Popen]) -> None:
        """Inject the plan into ``job``; ``relaunch()`` starts the job again (after a full
        disk, which the launcher does not retry)."""
        for fault in self.run.plan:
            if fault.kind == "s3_outage":
                self._outage_over()  # one outage at a time: each is counted on its own
            ready = self._wait_training(
                job, self.earliest.get(fault.kind, 0), published=fault.kind == "flip"
            )
            if not ready or not self._sleep(job, fault.gap_s):
                self.run.skipped.append(f"{fault.kind} on rank {fault.rank}: the job had ended")
                continue
            injection = self._inject(fault, job)
            if injection is None:
                self.run.skipped.append(f"{fault.kind} on rank {fault.rank}: no target process")
                continue
            self.run.injected.append(injection)
            log.info(
                "soak: %s rank %d (pid %d) from outside", fault.kind, fault.rank, injection.pid
            )
            if fault.kind == "full_disk":
                job = self._operate(job, injection, relaunch)
            elif fault.kind == "s3_outage":
                self._outage(job, injection)
            else:
                self._await_effect(job, injection)
        try:
            self.run.exit_code = job.wait(timeout=max(self.deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            job.kill()
            self.run.exit_code = job.wait()
        self._outage_over()
        self._read_remote()
        text = self.launcher_log.read_bytes()
        ends = [i.log_offset for i in self.run.injected[1:]] + [len(text)]
        for injection, end in zip(self.run.injected, ends):
            confirm(injection, text[:end])

    def _await_effect(self, job: subprocess.Popen, injection: Injection) -> None:
        """Until the launcher restarts the group after ``injection`` (a lost writer shows at
        its rank's next save), so the next fault does not hide this one's effect."""
        deadline = min(time.monotonic() + EFFECT_WAIT_S, self.deadline)
        while job.poll() is None and time.monotonic() < deadline:
            text = self.launcher_log.read_bytes()[injection.log_offset :]
            if _GROUP_FAILED.search(text.decode(errors="replace")):
                return
            time.sleep(0.1)

    def _operate(
        self, job: subprocess.Popen, injection: Injection, relaunch: Callable[[], subprocess.Popen]
    ) -> subprocess.Popen:
        """A full disk: wait for the launch to end, free the disk (the operator's fix), and
        relaunch the same command when it stopped as a full disk must (exit 10)."""
        try:
            injection.exit_code = job.wait(timeout=max(self.deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            injection.exit_code = None
        assert self.disk_root is not None
        disk.empty(self.disk_root)
        if injection.exit_code != exit_codes.CHECKPOINT_IO:
            return job  # finished before a save needed the disk, or failed otherwise: judged
        log.info("soak: the run stopped on the full disk (exit 10); filler deleted, relaunching")
        return relaunch()

    def _outage(self, job: subprocess.Popen, injection: Injection) -> None:
        """The object store answers 503 for the outage's length (cut short only by the
        deadline), then serves again, on a timer: the faults planned after it are injected
        while it lasts (the job trains on through an outage, so the plan does not count its
        length). The proxy counts what it refused."""
        assert self.proxy is not None
        proxy, before = self.proxy, self._refused_before

        def end() -> None:
            proxy.set_mode("pass")
            injection.refused = proxy.faults_injected - before

        length = max(0.0, min(injection.outage_s, self.deadline - time.monotonic()))
        self._outage_timer = threading.Timer(length, end)
        self._outage_timer.daemon = True
        self._outage_timer.start()

    def _outage_over(self) -> None:
        """Wait for the outage under way, if any, to end as planned."""
        if self._outage_timer is not None:
            self._outage_timer.join()
            self._outage_timer = None

    def _read_remote(self) -> None:
        """After the job: its newest published step and the newest committed remotely."""
        outages = [i for i in self.run.injected if i.kind == "s3_outage"]
        if not outages or self.remote_newest is None:
            return
        published = RunLayout.from_run_dir(self.run_dir).published_steps()
        newest = self.remote_newest()
        for injection in outages:
            injection.local_newest = published[-1] if published else None
            injection.remote_newest = newest

    def _wait_training(self, job: subprocess.Popen, earliest: int, published: bool) -> bool:
        """Until a step was logged since the last fault, and ``earliest`` steps in all (and,
        with ``published``, a step published to rot)."""
        seen = _steps_done(self.run_dir)
        while job.poll() is None and time.monotonic() < self.deadline:
            done = _steps_done(self.run_dir)
            if (
                done > seen
                and done >= earliest
                and (not published or _newest_published(self.run_dir) is not None)
                and rank_workers(self.run_dir)
            ):
                return True
            time.sleep(0.1)
        return False

    @staticmethod
    def _sleep(job: subprocess.Popen, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if job.poll() is not None:
                return False
            time.sleep(min(0.05, max(deadline - time.monotonic(), 0)))
        return job.poll() is None

    def _inject(self, fault: OutsideFault, job: subprocess.Popen) -> Injection | None:
        if fault.kind == "full_disk":
            if self.disk_root is None:
                return None
            offset = _size(self.launcher_log)
            left = disk.fill(self.disk_root)
            return Injection(fault.kind, fault.rank, job.pid, time.time(), offset, free_bytes=left)
        if fault.kind == "s3_outage":
            if self.proxy is None:
                return None
            offset = _size(self.launcher_log)
            self._refused_before = self.proxy.faults_injected
            self.proxy.set_mode("http_503", count=1 << 40)
            return Injection(
                fault.kind, fault.rank, job.pid, time.time(), offset, outage_s=fault.outage_s
            )
        target = self._target(fault)
        if target is None:
            return None
        offset = _size(self.launcher_log)
        flipped = flip_byte(self.run_dir, fault.where) if fault.kind == "flip" else None
        if fault.kind == "flip" and flipped is None:
            return None  # nothing published yet
        sig = signal.SIGSTOP if fault.kind == "sigstop" else signal.SIGKILL
        try:
            target.send_signal(sig)
        except psutil.Error:
            return None
        injection = Injection(fault.kind, fault.rank, target.pid, time.time(), offset)
        if flipped is not None:
            injection.flipped, injection.flipped_at, injection.flipped_to = flipped
        return injection

    def _target(self, fault: OutsideFault) -> psutil.Process | None:
        """The rank's trainer, or its checkpoint writer (started beside the first steps of an
        attempt): waited for a while, as a process may be between attempts."""
        deadline = time.monotonic() + TARGET_WAIT_S
        while time.monotonic() < deadline:
            trainer = rank_workers(self.run_dir).get(fault.rank)
            if trainer is not None and fault.kind != "kill_writer":
                return trainer
            found = writers(trainer) if trainer is not None else []
            if found:
                return found[0]
            time.sleep(0.1)
        return None


def _newest_published(run_dir: Path) -> Path | None:
    """The newest published step, if an older one is published too: rotting the only
    verified step stops the run by design (exit 10, nothing to fall back to), which is not
    what a soak that must finish measures."""
    published = sorted(
        d for d in RunDir(run_dir).steps_dir.glob("step-?????????") if (d / "COMMITTED").exists()
    )
    return published[-1] if len(published) >= 2 else None


def flip_byte(run_dir: Path, where: float) -> tuple[str, int, int] | None:
    """Invert one byte of the newest published step's largest file, in place (bit rot: the
    checksums in its manifest are left as they were); (path, offset, new value), or None
    while fewer than two steps are published."""
    newest = _newest_published(run_dir)
    files = [p for p in newest.rglob("*") if p.is_file()] if newest is not None else []
    target = max(files, key=lambda p: p.stat().st_size, default=None)
    if target is None or target.stat().st_size == 0:
        return None
    at = min(int(where * target.stat().st_size), target.stat().st_size - 1)
    fd = os.open(target, os.O_RDWR)
    try:
        value = os.pread(fd, 1, at)[0] ^ 0xFF
        os.pwrite(fd, bytes([value]), at)
        os.fsync(fd)
    finally:
        os.close(fd)
    return str(target), at, value


def _still_flipped(injection: Injection) -> bool:
    """The flipped byte is still published at its path (the step neither refused nor saved
    anew)."""
    try:
        fd = os.open(injection.flipped, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        return os.pread(fd, 1, injection.flipped_at) == bytes([injection.flipped_to])
    finally:
        os.close(fd)


# ft_launcher / torchrun: "failed (exitcode: -9) local_rank: 0 (pid: 123) of binary: ...".
_EXIT = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
# The rank monitor's timeout: nvrx 0.4 "[RankMonServer<r>@<host>:<rank>] Section ... has been
# open" / "Was out of section"; nvrx 0.7 "[workload:?(<rank>) ...] ... Section ... open".
_MONITOR = re.compile(
    r"(?:\[RankMonServer\d+@[^\]]*?:(\d+)\]|\[workload:\?\((\d+)\)[^\]]*\])"
    r".*?(?:has been open for|Was out of section for)"
)
# The launcher restarting (or giving up on) the group: a lost writer fails its rank at its next
# save, and which rank the launcher reports first depends on who exits first (a peer waiting in
# the save's collective may be killed by its monitor sooner).
_GROUP_FAILED = re.compile(r"Worker group (?:FAILED|UNHEALTHY)")


def confirm(injection: Injection, launcher_log: bytes) -> None:
    """Mark ``injection`` confirmed when the launcher's log between its moment and the next
    fault's (``launcher_log`` ends there) shows its effect on that rank, and the process it hit
    is gone (or, stopped, was killed)."""
    after = launcher_log[injection.log_offset :].decode(errors="replace")
    if injection.kind == "full_disk":
        _confirm_full_disk(injection, after)
        return
    if injection.kind == "s3_outage":
        _confirm_outage(injection)
        return
    gone = not psutil.pid_exists(injection.pid) or _is_zombie(injection.pid)
    if injection.kind == "sigstop":
        hits = [
            m.group(0)
            for m in _MONITOR.finditer(after)
            if int(m.group(1) or m.group(2)) == injection.rank
        ]
    elif injection.kind == "kill_writer":
        hits = [m.group(0) for m in _GROUP_FAILED.finditer(after)]
    else:
        hits = [
            m.group(0)
            for m in _EXIT.finditer(after)
            if int(m.group(2)) == injection.rank and int(m.group(1)) == -signal.SIGKILL
        ]
    injection.confirmed = bool(hits) and gone
    injection.evidence = (
        f"launcher: {hits[0]!r}; pid {injection.pid} {'gone' if gone else 'STILL ALIVE'}"
        if hits
        else f"launcher log shows no effect on rank {injection.rank} after the fault"
    )
    if injection.kind == "flip":
        rotten = _still_flipped(injection)
        injection.confirmed = injection.confirmed and not rotten
        injection.evidence += f"; {injection.flipped}@{injection.flipped_at} " + (
            "STILL PUBLISHED with the flipped byte" if rotten else "no longer published"
        )


def _confirm_full_disk(injection: Injection, after: str) -> None:
    """The file system had no room left after the fill (the soak's own reading), the launch
    ended with 10 (its exit status), and the launcher logged a rank's exit 10."""
    hits = [
        m.group(0) for m in _EXIT.finditer(after) if int(m.group(1)) == exit_codes.CHECKPOINT_IO
    ]
    full = 0 <= injection.free_bytes <= FULL_BYTES
    stopped = injection.exit_code == exit_codes.CHECKPOINT_IO
    injection.confirmed = bool(hits) and full and stopped
    injection.evidence = (
        f"{injection.free_bytes} bytes free after the fill; the launch exited "
        f"{injection.exit_code}; launcher: {hits[0]!r}"
        if hits
        else f"launcher log shows no exit 10 after the fill (launch exit {injection.exit_code})"
    )


def _confirm_outage(injection: Injection) -> None:
    """The proxy refused requests during the outage (the job met it), and at the end the
    object store holds the run's newest published step (the job rode it out)."""
    caught_up = injection.local_newest is not None and (
        injection.remote_newest == injection.local_newest
    )
    injection.confirmed = injection.refused > 0 and caught_up
    injection.evidence = (
        f"proxy: {injection.refused} request(s) answered 503 in {injection.outage_s:.1f} s; "
        f"newest step committed remotely at the end {injection.remote_newest} "
        f"(published locally {injection.local_newest})"
    )


def _is_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def losses(run_dir: Path) -> dict[int, float]:
    """step -> loss, the last line per step (a re-run step replaces the one before it)."""
    found: dict[int, float] = {}
    for line in RunDir(run_dir).steps_metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a killed writer's torn last line
        found[int(record["step"])] = float(record["loss"])
    return found


def judge_outside(run: OutsideRun, clean_dir: Path, soak_dir: Path, steps: int) -> list[str]:
    """What is wrong with the soak (empty: nothing): its exit, a planned fault it could not
    inject (the plan fits the run's length, so the job did not run as planned), each fault's
    evidence, and the trajectory (:func:`trajectory_problems`)."""
    problems = [] if run.exit_code == 0 else [f"the soak run exited {run.exit_code}"]
    problems += [f"a planned fault was not injected: {skipped}" for skipped in run.skipped]
    problems += [
        f"{i.kind} on rank {i.rank} not confirmed: {i.evidence}"
        for i in run.injected
        if not i.confirmed
    ]
    return problems + trajectory_problems(clean_dir, soak_dir, steps)


def trajectory_problems(clean_dir: Path, soak_dir: Path, steps: int) -> list[str]:
    """The soak's losses against the clean run's, bit for bit, every step present."""
    clean, soak = losses(clean_dir), losses(soak_dir)
    problems = []
    missing = sorted(set(range(1, steps + 1)) - set(soak))
    if missing:
        problems.append(f"the soak run never logged steps {missing[:5]}")
    differ = [step for step in clean if soak.get(step) != clean[step]]
    if differ:
        problems.append(f"losses differ from the clean run at steps {differ[:5]}")
    return problems
