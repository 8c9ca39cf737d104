"""Run on this machine under torchrun or nvidia-resiliency-ext's ft_launcher, then decide.

`python -m launch local [--nproc N] [--max-restarts K] key=value ...` validates the overrides,
pins the resolved config in <run_dir>/launch-config.yaml and runs the launcher chosen by
launch.backend:

* ft_launcher: rank monitors watch the sections every rank reports
  (resiliency/monitor/fault_tolerance.py); a hung or dead rank gets the whole worker group
  torn down and restarted in place (at most K times), resuming from the newest verified
  checkpoint. Ranks that fail deterministically ask ft_launcher not to restart.
* torchrun: torchrun runs once per launch; this wrapper relaunches it after infrastructure
  failures, at most K times.

The launcher's output is passed through (and kept in <run_dir>/launch-local.log) and read for
the events the attempt records need (detection, teardown, exit codes, monitor timeouts). When
the launcher is done, each attempt of this launch gets its root cause, losses and RTO
(resiliency/monitor/postmortem.py), and the exit code comes from launch/retry_policy.py: 0
when finished, REQUEUE (75) after a preemption (SIGTERM), INTERRUPTED (130) after a Ctrl-C
(docs/fault-tolerance.md#ctrl-c), a "do not retry" code otherwise (RETRY_BUDGET_EXHAUSTED after
K restarts). Either signal is forwarded to the launcher, whose ranks make an emergency save; a
run that did not finish ends with the command that resumes it. A run dir whose storage stops
answering, or ranks that outlive SIGKILL, end the launch with NODE_UNHEALTHY (14) without
waiting on either (launch/stuck_node.py).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import select
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import FrameType

import psutil

from launch import spares
from launch.common import (
    LaunchPlan,
    Refusal,
    check_remote_tier,
    check_resume,
    check_run_dir_free,
    plan_launch,
    rank_env,
    refused_code,
    worker_module,
    write_resolved_config,
)
from launch.deferred_record import spool_record
from launch.elastic import (
    ElasticNodes,
    check_launcher_release,
    nodes_it_may_lose,
    workers_stop_timeout_s,
)
from launch.kept_log import KeptLog, open_kept_log
from launch.processes import rank_workers
from launch.retry_policy import (
    STOP,
    Decision,
    decide,
    newest_attempt,
    newest_attempt_exits,
    read_outcome,
)
from launch.standby.launch import Standby, standby_env
from launch.stuck_node import KILL_GRACE_S, POLL_S, NodeVerdict, StuckWatch
from launch.uploader import Uploader
from pretrain.context import exit_codes, interrupts
from pretrain.context.run_dir import RunDir
from pretrain.context.startup_clock import host_clock
from recipes import ConfigError
from recipes.inputs import check_inputs
from recipes.load import override_key, started_from
from resiliency.monitor.fault_tolerance import write_launcher_config
from resiliency.monitor.health import describe, preflight
from resiliency.monitor.postmortem import LauncherEvents, finalize_attempts, read_record
from resiliency.monitor.storage_probe import storage_hung
from resiliency.storage.attempts import recorded_attempts
from resiliency.storage.layout import RunLayout

log = logging.getLogger(__name__)
# Forwarded to the launcher (its own process group): SIGHUP and SIGQUIT too, which a terminal
# sends its foreground group and torch elastic answers by stopping its workers.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
# A second SIGINT counts as a second press past this; the ranks' own window (SAME_PRESS_S)
# starts a little later, when the launcher's forwarded first press reaches them.
SECOND_PRESS_S = 1.5 * interrupts.SAME_PRESS_S
# What a stop signal leaves the ranks beyond the emergency save's own bound: the step in flight.
STOP_SLACK_S = 30.0
# Exits after which the same launch continues the run from its newest verified step.
RESUMABLE = frozenset({exit_codes.INTERRUPTED, exit_codes.REQUEUE, exit_codes.INFRASTRUCTURE,
                       exit_codes.RETRY_BUDGET_EXHAUSTED, exit_codes.NODE_UNHEALTHY})  # fmt: skip
# After a failure, what the launcher gets to stop the failed ranks before launch local looks:
# its SIGTERM -> SIGKILL grace plus a few of its monitor intervals.
STOP_DEADLINE_SLACK_S = 20.0
# The launcher stops with this process (util-linux's setpriv: no preexec_fn in a process with
# threads): SIGTERM, so a SIGKILL of this one still stops the ranks (emergency save, exit 75)
# instead of leaving them training as orphans in their own sessions. Where setpriv is missing
# the launcher outlives a SIGKILL of this process.
_DIE_WITH_PARENT = ["setpriv", "--pdeathsig", "TERM", "--"] if shutil.which("setpriv") else []


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="ranks on this machine (default: launch.nproc_per_node)",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=None,
        help="restarts after infrastructure failures (default: resiliency.max_restarts)",
    )


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    if args.nproc is not None:
        overrides = [*overrides, f"launch.nproc_per_node={args.nproc}"]
    try:
        plan = plan_launch(overrides, check_files=False)
    except Refusal as exc:
        return refused_code(exc)
    # Before anything reads the run dir: on a hung mount that read would never return.
    if (hung := _storage_silent(plan)) is not None:
        log.error("launch local: %s; nothing was started: drain this node, or fix the mount", hung)
        return exit_codes.NODE_UNHEALTHY
    try:
        plan = _checked_plan(plan)
    except Refusal as exc:
        return refused_code(exc)
    # Only now, every check passed: a refused launch leaves the run dir byte-identical.
    config = write_resolved_config(plan)
    budget = plan.run.resiliency.max_restarts if args.max_restarts is None else args.max_restarts
    return LocalSupervisor(plan, config, budget).run()


def _storage_silent(plan: LaunchPlan) -> str | None:
    """Why the run dir's storage is taken for hung (no answer within the health timeout)."""
    return storage_hung(plan.run_dir, plan.run.resiliency.health.storage_timeout_s)


def _checked_plan(plan: LaunchPlan) -> LaunchPlan:
    """Every check the launcher makes before it writes anything, after the config and the
    layout: the inputs and the output dir, elastic's limits, a live owner of the run dir,
    the object store."""
    check_inputs(plan.run)
    if plan.run.parallel.elastic:
        if plan.device == "cuda":
            raise ConfigError(
                "parallel.elastic=true under launch local runs on CPU only so far: every node "
                "launcher on this machine would start its ranks on the same GPUs"
            )
        check_launcher_release()
    check_run_dir_free(plan)
    check_resume(plan)
    check_remote_tier(plan)
    return plan


def launcher_command(
    plan: LaunchPlan, config: Path, restarts: int, rendezvous: list[str] | None = None
) -> list[str]:
    """The launcher's command line: one node on its own (``--standalone``), or one node of an
    elastic job (``rendezvous``: launch/elastic.py)."""
    run, bin_dir = plan.run, Path(sys.executable).parent
    common = [*(rendezvous or ["--standalone"]), f"--nproc-per-node={run.launch.nproc_per_node}"]
    tail = ["-m", worker_module(run), "--config", str(config)]
    if run.launch.backend == "torchrun":
        # launch.torchrun: torchrun in-process, whose exit is the failing rank's code and whose
        # stop by a signal is one line (bare torchrun re-raises it as a traceback).
        launcher = [sys.executable, "-m", "launch.torchrun"]
        return [*launcher, *common, "--max-restarts=0", *tail]
    ft = run.resiliency.ft
    return [
        str(bin_dir / "ft_launcher"),
        *common,
        f"--max-restarts={restarts}",
        f"--monitor-interval={ft.check_interval_s}",
        f"--workers-stop-timeout={workers_stop_timeout_s(run):g}",
        # SIGTERM -> SIGKILL grace: room for the ranks' emergency save.
        f"--term-timeout={run.resiliency.emergency_save_timeout_s + STOP_SLACK_S:.0f}",
        f"--ft-cfg-path={write_launcher_config(run, plan.run_dir)}",
        # nvrx's CLI default (true) overrides the config file's enable_nic_monitor: said again
        # here, or a CPU host logs an NVML traceback per rank monitor.
        f"--ft-enable-nic-monitor={str(run.launch.gpus_per_node > 0).lower()}",
        *tail,
    ]


class LocalSupervisor:
    def __init__(self, plan: LaunchPlan, config: Path, max_restarts: int) -> None:
        self.plan, self.config, self.max_restarts = plan, config, max_restarts
        self.layout = RunLayout.from_run_dir(plan.run_dir)
        self.events = LauncherEvents()
        self.signal: int | None = None
        self.interrupted_at: float | None = None  # the first Ctrl-C (SIGINT), monotonic
        self.child: subprocess.Popen[bytes] | None = None
        self.verdict: NodeVerdict | None = None  # this node was given up on (launch/stuck_node.py)
        self.pump_stop = threading.Event()
        self.nodes: ElasticNodes | None = None  # parallel.elastic: the launchers acting as nodes
        self.keep_lock = threading.Lock()
        run = plan.run
        self.tokens_per_step = run.tokens_per_step

    def run(self) -> int:
        if not _names_run_id(self.plan.overrides):
            run = self.plan.run
            log.info("launch local: new run %r in %s/ (continue it with run_id=%s)",
                     run.run_id, run.output_dir, run.run_id)  # fmt: skip
        uploader = Uploader(self.plan)
        uploader.start()
        standby = Standby(self.plan.run_dir) if self.plan.run.launch.standby else None
        try:
            code = self._supervise()
        finally:
            if standby is not None:
                standby.stop()
            # After a verdict the run dir does not answer (or may not): no final pass.
            caught_up = uploader.finish(final_pass=self.verdict is None)
        if code == exit_codes.OK and not caught_up:
            return exit_codes.REMOTE_BEHIND
        if code in RESUMABLE:  # the last line: what continues this run from its newest step
            log.info("launch local: exit %d; resume with: %s", code, resume_command(self.plan))
        return code

    def _supervise(self) -> int:
        before = newest_attempt(self.plan.run_dir)
        previous = {sig: signal.signal(sig, self._forward) for sig in FORWARDED}
        try:
            while self.signal is None:
                used = self._restarts_used(before)
                if self.verdict is not None or (self.events.launches and self._storage_hung()):
                    return self._give_up_node(before)
                if not self._healthy(len(self.events.launches)):
                    return exit_codes.INFRASTRUCTURE
                if self.signal is not None:  # came during the health check: nothing started
                    break
                code = self._launch(max(0, self.max_restarts - used))
                if self.verdict is not None:
                    return self._give_up_node(before)
                if code == exit_codes.OK and not self._attempts(before):
                    # Runs without checkpoints keep no attempt records: nothing to decide.
                    log.info("launch local: finished (no attempt record: checkpoints are off)")
                    return exit_codes.OK
                decision = self._decide(before)
                if self.interrupted_at is not None and decision.exit_code != exit_codes.OK:
                    return exit_codes.INTERRUPTED  # the user's stop: no retry, no requeue
                if decision.action == STOP:
                    return decision.exit_code
                if self.signal is not None or self._preempted(before):
                    return exit_codes.REQUEUE  # the caller (scheduler, user) requeues
                log.warning("relaunching: %s", decision.reason)
            # stopped by a signal before (re)launching
            return exit_codes.INTERRUPTED if self.interrupted_at else exit_codes.REQUEUE
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _storage_hung(self) -> bool:
        """Before a relaunch: does the run dir's storage answer at all (every check after
        this one reads it)?"""
        hung = _storage_silent(self.plan)
        if hung is not None:
            self.verdict = NodeVerdict(hung, [], time.time())
        return hung is not None

    def _give_up_node(self, before: int) -> int:
        """The verdict said, nothing written to the run dir; its record follows when the
        storage answers (a detached recorder, launch/deferred_record.py)."""
        assert self.verdict is not None
        for line in self.verdict.lines():
            log.error("launch local: %s", line)
        try:
            spool = spool_record(self.plan.run_dir, before, self.events, self.tokens_per_step,
                                 self.verdict)  # fmt: skip
            later = f"the attempt is recorded once the run dir answers (pending in {spool})"
        except OSError as exc:  # this node's own disk too: the verdict still stands
            later = f"the attempt's record cannot wait on this node ({exc})"
        log.error("launch local: this node cannot go on (exit %d): drain it, then resume "
                  "elsewhere; %s", exit_codes.NODE_UNHEALTHY, later)  # fmt: skip
        return exit_codes.NODE_UNHEALTHY

    def _on_verdict(self, verdict: NodeVerdict) -> None:
        """From the stuck watch: kill the launcher (its teardown waits on the stuck ranks) and
        stop passing on output (a stuck rank keeps the pipe open)."""
        self.verdict = verdict
        child = self.child
        if child is not None and child.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(child.pid, signal.SIGKILL)
        self.pump_stop.set()

    def _stuck_watch(self) -> StuckWatch:
        run = self.plan.run
        deadline = workers_stop_timeout_s(run) + STOP_DEADLINE_SLACK_S
        probe_s = run.resiliency.health.storage_timeout_s
        quiet = lambda: self.signal is not None  # noqa: E731 - a stop asked for: ranks saving
        return StuckWatch(
            self.plan.run_dir, self.events, probe_s, deadline, self._on_verdict, quiet
        )

    def _healthy(self, launch: int) -> bool:
        """This machine's health check before every launch (one node: nothing to exclude, so
        an unhealthy one stops the run with the reason instead of failing minutes later)."""
        directory = self.plan.run_dir / "health" / f"local-{os.getpid()}-{launch}"
        report = preflight(self.plan.run, directory)
        if report is None:
            return True
        (log.info if report.ok else log.error)("launch local: %s", describe(report))
        return report.ok

    def _restarts_used(self, before: int) -> int:
        """Group starts so far (attempt records, or launches that left none) minus the first;
        with parallel.elastic, an attempt that began at a new size was a resize, not a retry."""
        if not self.events.launches:
            return 0
        attempts = self._attempts(before)
        if self.plan.run.parallel.elastic:
            attempts = [a for a in attempts if not read_record(self.layout, a).get("resized")]
        return max(len(attempts), len(self.events.launches)) - 1

    def _attempts(self, before: int) -> list[int]:
        return [a for a in recorded_attempts(self.layout) if a > before]

    def _decide(self, before: int) -> Decision:
        finalize_attempts(self.layout, self._attempts(before), self.events, self.tokens_per_step,
                          interrupted=self.interrupted_at is not None)  # fmt: skip
        seen = newest_attempt_exits(self.layout, self._attempts(before), self.events)
        decision = decide(
            self.plan.run_dir,
            self._restarts_used(before),
            self.max_restarts,
            before,
            seen_exits=seen,
        )
        if self.interrupted_at is not None:
            outcome = read_outcome(self.plan.run_dir, before)
            log.info("launch local: stopped by Ctrl-C (%s)", outcome.detail)
        else:
            log.info("launch local: %s", decision.line())
        return decision

    def _preempted(self, before: int) -> bool:
        outcome = read_outcome(self.plan.run_dir, before)
        return outcome.status == "preempted" or outcome.exit_code == exit_codes.REQUEUE

    def _launch(self, restarts: int) -> int:
        standby = standby_env(self.plan.run_dir) if self.plan.run.launch.standby else {}
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **standby, **rank_env(self.plan.run)}
        env["PYTHONWARNINGS"] = _quiet_pynvml(env.get("PYTHONWARNINGS"))
        # torchrun sets 1 itself when unset, with a banner of warnings saying so.
        env.setdefault("OMP_NUM_THREADS", "1")
        # torch elastic SIGKILLs its workers this long after it signals them (default 30 s):
        # the step in flight and the emergency save must fit (ft_launcher: --term-timeout).
        grace = self.plan.run.resiliency.emergency_save_timeout_s + STOP_SLACK_S
        env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", f"{grace:.0f}")
        if self.plan.run.parallel.elastic:
            return self._launch_nodes(restarts, env)
        cmd = launcher_command(self.plan, self.config, restarts)
        log.info("launch local: %s", " ".join(cmd))
        started = time.time()
        keep = open_kept_log(RunDir(self.plan.run_dir).launcher_log)
        self.pump_stop = threading.Event()  # this launch's
        watch = self._stuck_watch()
        try:
            # Its own process group: a terminal's Ctrl-C (or a signal to this job's group)
            # reaches the launcher once, forwarded from here, not twice (a second signal
            # inside torch elastic's shutdown abandons it with a traceback). It dies with
            # this process all the same (PR_SET_PDEATHSIG), as a group member would.
            self.child = subprocess.Popen(
                [*_DIE_WITH_PARENT, *cmd], env=env, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, process_group=0,
            )  # fmt: skip
            if self.signal is not None:  # it came before the child could be signalled
                self.child.send_signal(self.signal)
            watch.start()
            assert self.child.stdout is not None
            self._pump(self.child.stdout.fileno(), keep)
            self.child.stdout.close()
            code = self._wait_launcher(self.child)
        finally:
            watch.stop()
            if keep is not None:
                keep.close()
        self.events.launches.append([started, time.time()])
        self.child = None
        log.info("launch local: %s exited %d", self.plan.run.launch.backend, code)
        return code

    def _launch_nodes(self, restarts: int, env: dict[str, str]) -> int:
        """parallel.elastic: ``launch.nodes`` launchers of one job on this machine; launcher 0's
        exit is the launch's (launch/elastic.py)."""
        started = time.time()
        keep = open_kept_log(RunDir(self.plan.run_dir).launcher_log)

        def sink(index: int, line: str) -> None:
            self.events.feed(line, time.time(), host_clock())  # unprefixed: its own stamp
            line = f"[node {index}] {line}"
            with self.keep_lock:
                sys.stderr.write(line)
                if keep is not None:
                    keep.write(line)

        nodes = ElasticNodes(
            self.plan.run,
            # Each lost node fails the survivors' workers once (a restart of theirs); a grow
            # does not count (torch elastic: a membership change is not a retry).
            lambda _index, rendezvous: launcher_command(
                self.plan, self.config, restarts + nodes_it_may_lose(self.plan.run), rendezvous
            ),
            # the worker entrypoint tells its launcher to end on a "do not retry" exit
            {**env, spares.ELASTIC_ENV: "1", spares.RUN_DIR_ENV: str(self.plan.run_dir)},
            sink,
            steps_log=RunDir(self.plan.run_dir).steps_metrics,
        )
        self.nodes = nodes
        try:
            nodes.start()
            code = nodes.wait()
        finally:
            nodes.stop_all()  # however this ends, no node outlives the launch
            self.nodes = None
            with self.keep_lock:
                if keep is not None:
                    keep.close()
        self.events.launches.append([started, time.time()])
        log.info("launch local: node 0's launcher exited %d", code)
        return code

    def _pump(self, fd: int, keep: KeptLog | None) -> None:
        """The launcher's output, line by line, until its end or a verdict (a rank stuck in
        uninterruptible sleep holds the pipe open: no end would come)."""
        pending = b""
        while not self.pump_stop.is_set():
            if not select.select([fd], [], [], POLL_S)[0]:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            for raw in lines:
                self._pass_on(raw.decode(errors="replace") + "\n", keep)
        if pending:
            self._pass_on(pending.decode(errors="replace"), keep)
        sys.stderr.flush()

    def _pass_on(self, line: str, keep: KeptLog | None) -> None:
        self.events.feed(line, time.time(), host_clock())
        sys.stderr.write(line)
        if keep is not None:
            keep.write(line)

    def _wait_launcher(self, child: subprocess.Popen[bytes]) -> int:
        """The launcher's exit code; after a verdict, its SIGKILL's if it does not go (a
        launcher stuck on the storage too)."""
        while True:
            try:
                return child.wait(timeout=POLL_S)
            except subprocess.TimeoutExpired:
                if self.verdict is not None and time.time() - self.verdict.at > KILL_GRACE_S:
                    return -signal.SIGKILL

    def _forward(self, signum: int, frame: FrameType | None) -> None:
        # A signal handler: it says what it does with os.write (_say), never through logging,
        # whose stream this process may be in the middle of writing (the pump).
        if signum == signal.SIGINT:
            now = time.monotonic()
            if self.interrupted_at is not None:
                if now - self.interrupted_at >= SECOND_PRESS_S:
                    self._stop_at_once()
                return  # the same press, delivered again
            self.interrupted_at = now
            _say("Ctrl-C: the ranks stop after the step in flight with an emergency save; "
                 "Ctrl-C again to stop at once without it")  # fmt: skip
        self.signal = signum
        if self.nodes is not None:
            _say(f"forwarding {signal.Signals(signum).name} to the nodes")
            self.nodes.signal_all(signum)
        if self.child is not None and self.child.poll() is None:
            _say(f"forwarding {signal.Signals(signum).name} to the launcher")
            self.child.send_signal(signum)

    def _stop_at_once(self) -> None:
        """A second Ctrl-C: each rank is told again and exits 130 at once, without a save
        (pretrain/context/interrupts.py); the launcher then ends as its workers did."""
        _say("second Ctrl-C: stopping the ranks now, without an emergency save (the last "
             "published step is intact)")  # fmt: skip
        for proc in rank_workers(self.plan.run_dir).values():
            with contextlib.suppress(psutil.Error):  # gone already
                proc.send_signal(signal.SIGINT)


def _say(message: str) -> None:
    """One WARNING line from a signal handler, in the log's format, straight to stderr."""
    stamp = time.strftime("%H:%M:%S")
    line = f"{stamp} [rank 0] WARNING {__name__}: launch local: {message}\n"
    with contextlib.suppress(OSError):  # stderr gone: the exit code still says it
        os.write(2, line.encode())


def _quiet_pynvml(user: str | None) -> str:
    """torch.cuda warns at import that the pynvml package (an nvrx dependency) is deprecated:
    the launcher processes import it before any logging setup could filter it. Kept out of a
    normal run's output; the user's own PYTHONWARNINGS come first and still apply."""
    quiet = "ignore:The pynvml package is deprecated:FutureWarning"
    return f"{user},{quiet}" if user else quiet


def _names_run_id(overrides: list[str]) -> bool:
    return any(override_key(o) == "run_id" for o in overrides)


def resume_command(plan: LaunchPlan) -> str:
    """The command line that continues this run: the same overrides, its run_id named."""
    python = os.path.relpath(sys.executable)
    if python.startswith(".."):
        python = sys.executable
    overrides = [o for o in plan.overrides if override_key(o) != "run_id"]
    config = started_from()
    start = ["--config", str(config.resolve())] if config is not None else []
    return shlex.join([python, "-m", "launch", "local", *start, *overrides,
                       f"run_id={plan.run.run_id}"])  # fmt: skip
