"""``python -m launch.slurm.elastic``: the batch script's supervisor of an elastic job's nodes
(``parallel.elastic=true`` under ``launch slurm``).

Without elastic the script runs one ``srun`` step with a launcher on every node, and a node
that fails ends the step. Here every node of the allocation runs its own one-node step (its
ft_launcher joins one c10d rendezvous with ``--nnodes=launch.min_nodes:launch.nodes``), so a
lost node ends only its own step: the others re-form at the smaller size and go on training
(:mod:`launch.elastic`). The job is submitted with ``--no-kill``, so Slurm keeps it running
when a node of the allocation fails. A node's step that ended is started again on the same
node ``parallel.elastic_min_interval_s`` after the group re-formed without it: where the node
is back (its launcher or workers died, the node did not), the group grows back at the next
step; where Slurm took the node out of the allocation, the new step fails and is tried again
after the interval.

The first node's launcher hosts the rendezvous store: its step's exit is the job's, and the
batch script's retry policy decides what follows, as without elastic. Once the batch shell
got Slurm's warning signal (the job-stopping mark) no node is started again.

Each node's output goes to the job log with the node's index as its label, the way
``srun --label`` numbers tasks (the post-mortem reads the log per node).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from launch.elastic import ElasticNodes
from pretrain.context.run_dir import RunDir
from pretrain.platform.logs import setup_logging
from recipes.load import load_config_file

log = logging.getLogger(__name__)
NODE, RENDEZVOUS = "@NODE@", "@RENDEZVOUS@"  # placeholders in the node step's command


def node_command(step: list[str], node: str, rendezvous: list[str]) -> list[str]:
    """The step's command for ``node``: ``@NODE@`` replaced inside every argument, and the
    ``@RENDEZVOUS@`` argument replaced by the launcher's rendezvous arguments."""
    command: list[str] = []
    for arg in step:
        command += rendezvous if arg == RENDEZVOUS else [arg.replace(NODE, node)]
    return command


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    setup_logging()
    run = load_config_file(args.config)
    names = args.nodes.split()
    if not run.launch.min_nodes or not run.launch.min_nodes <= len(names) <= run.launch.nodes:
        log.error(
            "elastic: the allocation has %d node(s) (%s); launch.min_nodes=%s and "
            "launch.nodes=%d allow no group on it: resubmit the job",
            len(names),
            " ".join(names),
            run.launch.min_nodes,
            run.launch.nodes,
        )
        return 1
    stop_mark = Path(args.stop_mark)
    write_lock = threading.Lock()

    def sink(index: int, line: str) -> None:
        with write_lock:
            sys.stdout.write(f"{index}: {line}")
            sys.stdout.flush()

    nodes = ElasticNodes(
        run,
        lambda index, rendezvous: node_command(args.step, names[index], rendezvous),
        dict(os.environ),
        sink,
        endpoint=args.endpoint,
        rdzv_id=args.rdzv_id,
        stopping=stop_mark.exists,
        steps_log=RunDir(Path(run.output_dir) / str(run.run_id)).steps_metrics,
        count=len(names),  # a requeued job may hold fewer nodes than it asked for
    )
    # Slurm ends the job with TERM to every process of it (scancel, time limit): the steps
    # end on their own; none of them is lost.
    signal.signal(signal.SIGTERM, lambda *_: setattr(nodes, "draining", True))
    nodes.start()
    try:
        code = nodes.wait()
    finally:
        nodes.stop_all()
    log.info("elastic: node 0 (%s) step ended with %d", names[0], code)
    return code


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m launch.slurm.elastic", description=__doc__)
    parser.add_argument("--config", required=True, help="the run's pinned config")
    parser.add_argument(
        "--nodes", required=True, help="the allocation's node names (scontrol show hostnames)"
    )
    parser.add_argument("--endpoint", required=True, help="HOST:PORT of the rendezvous store")
    parser.add_argument("--rdzv-id", required=True)
    parser.add_argument("--stop-mark", required=True, help="exists once the job is stopping")
    parser.add_argument(
        "step",
        nargs=argparse.REMAINDER,
        help=f"after --: one node's step, with {NODE} and a {RENDEZVOUS} argument",
    )
    args = parser.parse_args(argv)
    if args.step[:1] == ["--"]:
        args.step = args.step[1:]
    if RENDEZVOUS not in args.step:
        parser.error(f"the node step needs a {RENDEZVOUS} argument")
    return args


if __name__ == "__main__":
    sys.exit(main())
