"""Elastic data parallelism (``parallel.elastic=true``): the supervisor of a job's nodes.

Under ``launch local`` each node is an ft_launcher process on this machine; under Slurm
(:mod:`launch.slurm.elastic`) each is a one-node ``srun`` step of the job running that node's
ft_launcher. Each launcher joins one c10d rendezvous with
``--nnodes=launch.min_nodes:launch.nodes``; launcher 0 hosts its store. When a node is lost
(its launcher and workers killed from outside), the survivors' workers fail on their next
collective, their launchers restart them, and the rendezvous re-forms without the lost node
once its keep-alive lapses (nvrx: 3 x 5 s): the trainer restores the newest committed step at
the smaller DP, with the same global batch (more micro-batches per rank), sample order and LR
schedule. The supervisor starts a lost node again ``parallel.elastic_min_interval_s`` after
the group re-formed without it (under Slurm the node may have left the allocation: the new
step then fails, and is tried again later); the waiting node makes the running launchers stop
their workers (SIGTERM: an emergency save at the next step boundary) and the group re-forms
at the larger size, which restores that save. Node 0 is never replaced: its launcher holds the
rendezvous store, and its exit is the job's.
"""

from __future__ import annotations

import logging
import re
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import psutil

from pretrain.platform.host import free_port
from recipes import ConfigError
from recipes.config.run import RunConfig

log = logging.getLogger(__name__)
# A waiting node must join within this much of the first one for the start to include it
# (the launchers start together); a re-formed group waits as long after the lost node left.
LAST_CALL_S = 5.0
STOP_GRACE_S = 30.0
# A lost node's keep-alive lapses after 3 x 5 s (nvrx), then the last call: a group that has
# not re-formed by then will not without the node.
REFORM_WAIT_S = 15.0 + LAST_CALL_S + 30.0
# ft_launcher's line when its node joins a round: the group's size in nodes.
_JOINED = re.compile(r"has joined round \d+ of the rendezvous .* in a world of size (\d+)")


# The ft_launcher releases whose rendezvous behaves as this module expects (torch's c10d: a
# membership change restarts the group without spending a restart; the join line above).
# nvrx 0.7's barrier rendezvous logs its joins otherwise and spends a restart on every round.
CHECKED_NVRX = ("0.4.",)


def check_launcher_release(installed: str | None = None) -> None:
    """ConfigError where the installed nvidia-resiliency-ext is not a release elastic runs
    were checked on: a shrink or grow there would silently spend the restart budget."""
    found = installed or metadata.version("nvidia-resiliency-ext")
    if not found.startswith(CHECKED_NVRX):
        raise ConfigError(
            f"parallel.elastic=true runs on nvidia-resiliency-ext 0.4.x only so far (installed: "
            f"{found}; its rendezvous spends a restart on every resize): launch from the "
            "Python 3.11 environment (.venv), or set parallel.elastic=false"
        )


def workers_stop_timeout_s(run: RunConfig) -> float:
    """ft_launcher's SIGTERM -> SIGKILL grace when it stops its workers. A grow stops a
    healthy group, whose ranks make an emergency save first: with parallel.elastic the grace
    covers that save and a step, or the grow would fall back to the last periodic save."""
    grace = run.resiliency.ft.workers_stop_timeout_s
    if run.parallel.elastic:
        return max(grace, run.resiliency.emergency_save_timeout_s + 30.0)
    return grace


def nodes_it_may_lose(run: RunConfig) -> int:
    """Restarts a launch adds to each launcher's budget: a lost node fails the survivors'
    workers once (the launcher restarts them at the smaller size)."""
    return run.launch.nodes - (run.launch.min_nodes or run.launch.nodes)


def join_timeout_s(run: RunConfig) -> float:
    """How long a node waits for the group to form: longer than a lost node takes to return
    (the resize interval plus the re-form wait), or the survivors would give up first."""
    return max(900.0, run.parallel.elastic_min_interval_s + REFORM_WAIT_S + 300.0)


def rendezvous_args(run: RunConfig, endpoint: str, rdzv_id: str, is_host: bool) -> list[str]:
    """ft_launcher's arguments for one node of an elastic job (instead of ``--standalone``)."""
    launch = run.launch
    conf = (
        f"is_host={int(is_host)},last_call_timeout={LAST_CALL_S:g},"
        f"join_timeout={join_timeout_s(run):.0f}"
    )
    return [
        f"--nnodes={launch.min_nodes}:{launch.nodes}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={rdzv_id}",
        f"--rdzv-conf={conf}",
    ]


@dataclass
class Node:
    index: int
    proc: subprocess.Popen[str] | None = None
    pump: threading.Thread | None = None
    lost_at: float | None = None
    done: bool = False  # left with exit 0: the job finished


class ElasticNodes:
    """Runs the nodes, brings lost ones back, and returns node 0's exit code.

    ``command(index, rendezvous)``: node ``index``'s command line, given its launcher's
    rendezvous arguments. ``stopping()``: the job is being stopped as a whole (its nodes' ends
    are not losses, and none returns). ``steps_log``: the run's per-step metrics file, which
    grows with every step trained: a node returns only once the group trained at its new size
    (a grow before the first step at the smaller size would waste that restart)."""

    def __init__(
        self,
        run: RunConfig,
        command: Callable[[int, list[str]], list[str]],
        env: dict[str, str],
        sink: Callable[[int, str], None],
        *,
        endpoint: str | None = None,
        rdzv_id: str | None = None,
        stopping: Callable[[], bool] = lambda: False,
        steps_log: Path | None = None,
        count: int | None = None,
    ) -> None:
        self.run, self.command, self.env, self.sink = run, command, env, sink
        self.endpoint = endpoint or f"127.0.0.1:{free_port()}"
        self.rdzv_id = rdzv_id or uuid.uuid4().hex[:12]
        self.stopping = stopping
        self.nodes = [Node(i) for i in range(count or run.launch.nodes)]
        self.steps_log = steps_log
        self.last_resize = time.monotonic()
        self.steps_at_resize = self._steps_size()  # the metrics file's size then
        self.group_nodes = 0  # nodes in the group node 0 last joined
        self.draining = False  # the job is stopping: nodes that exit are not lost

    def start(self) -> None:
        for node in self.nodes:
            self._spawn(node)

    def _spawn(self, node: Node) -> None:
        rdzv = rendezvous_args(self.run, self.endpoint, self.rdzv_id, is_host=node.index == 0)
        cmd = self.command(node.index, rdzv)
        log.info("elastic: node %d: %s", node.index, " ".join(cmd))
        node.proc = subprocess.Popen(
            cmd,
            env=self.env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            bufsize=1,
            start_new_session=True,  # a node is killed from outside as a group of its own
        )
        node.lost_at = None
        node.pump = threading.Thread(target=self._pump, args=(node,), daemon=True)
        node.pump.start()

    def _pump(self, node: Node) -> None:
        """The node's output to the supervisor; a group formed at a new size restarts the
        resize interval (it counts from when the group trains at that size)."""
        assert node.proc is not None and node.proc.stdout is not None
        for line in node.proc.stdout:
            if node.index == 0 and (m := _JOINED.search(line)):
                self.last_resize = time.monotonic()
                self.steps_at_resize = self._steps_size()
                self.group_nodes = int(m.group(1))
            self.sink(node.index, line)

    def wait(self) -> int:
        """Until node 0 exits (then the others get a grace to end on their own): lost nodes
        come back after the resize interval. The caller calls ``stop_all`` after it."""
        host = self.nodes[0]
        assert host.proc is not None
        while host.proc.poll() is None:
            self.draining = self.draining or self.stopping()
            if not self.draining:
                for node in self.nodes[1:]:
                    self._tend(node)
            time.sleep(0.2)
        self.draining = True
        # The others end with the job on their own (their last records, their launchers'
        # teardown); where node 0 failed they wait on its store, so only briefly.
        self._await_others(STOP_GRACE_S if host.proc.returncode == 0 else LAST_CALL_S)
        return host.proc.returncode  # the caller's stop_all ends the rest, however it ends

    def _await_others(self, grace: float) -> None:
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(
            n.proc is not None and n.proc.poll() is None for n in self.nodes[1:]
        ):
            time.sleep(0.2)

    def _tend(self, node: Node) -> None:
        assert node.proc is not None
        now = time.monotonic()
        if node.lost_at is None:
            code = node.proc.poll()
            if code is None:
                return
            node.lost_at = now
            if code == 0:
                node.done = True  # the job finished: the node left with it
                return
            log.warning(
                "elastic: node %d lost (its launcher exited %d); it returns %.0f s after the "
                "group re-forms without it (parallel.elastic_min_interval_s)",
                node.index,
                code,
                self.run.parallel.elastic_min_interval_s,
            )
            return
        if not node.done and self._may_return(node, now):
            log.warning("elastic: node %d returns; the group grows at its next step", node.index)
            self._spawn(node)

    def _may_return(self, node: Node, now: float) -> bool:
        """A lost node returns once the group re-formed smaller after the loss, trained at that
        size and the resize interval passed, or, where it never re-forms (fewer nodes than
        launch.min_nodes left), after the interval plus the rendezvous' own wait."""
        assert node.lost_at is not None
        interval = self.run.parallel.elastic_min_interval_s
        reformed = self.last_resize > node.lost_at and self.group_nodes < len(self.nodes)
        if reformed:
            trained = self._steps_size() > self.steps_at_resize
            waited = now - self.last_resize
            # a group that re-formed but does not train lets the node back after the wait
            return waited >= interval and (trained or waited >= interval + REFORM_WAIT_S)
        return now - node.lost_at >= interval + REFORM_WAIT_S

    def _steps_size(self) -> int:
        """Sizes, not times: the run dir may be on a file server with a clock of its own."""
        try:
            return self.steps_log.stat().st_size if self.steps_log is not None else 0
        except OSError:
            return 0

    def stop_all(self) -> None:
        """Every node still running: SIGTERM to its launcher (which stops its workers), then,
        after a grace, SIGKILL to the launcher and everything under it (the workers run in
        sessions of their own); then the output pumps are drained."""
        self.draining = True
        live = [n.proc for n in self.nodes if n.proc is not None and n.proc.poll() is None]
        trees = {proc.pid: _tree(proc.pid) for proc in live}
        for proc in live:
            proc.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in live:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for family in trees.values():
            for member in family:
                try:
                    member.kill()
                except psutil.NoSuchProcess:
                    pass
            psutil.wait_procs(family, timeout=10)
        for node in self.nodes:
            if node.pump is not None:
                node.pump.join(timeout=5)

    def signal_all(self, signum: int) -> None:
        self.draining = True  # the launchers stop on their own now: none of them is lost
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                node.proc.send_signal(signum)


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return []
