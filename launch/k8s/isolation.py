"""Nodes a run's pods must not land on again: those whose health check failed with hardware
evidence, named by the reports the pods wrote, plus ``launch.k8s.avoid_nodes``.

A pod's entry point checks its node before the launcher starts (:mod:`launch.k8s.entry`) and
writes the report to the shared claim (``<run dir>/k8s/retries/<job id>/health/<node>.json``,
the node by ``spec.nodeName``). Where the check failed on the node's hardware (its GPUs: count,
nvidia-smi, uncorrected ECC; the site's own check script saying no), the entry point also
writes the node's condition in the shape of a Node status condition
(``.../node-conditions/<node>.json``), for an operator or a node problem detector to act on:
the trainer never edits a Node object (taints and cordons are the cluster's to set).

The next submission of the run (``python -m launch k8s``, on either API) reads those reports
where the run dir is visible to it and renders required node anti-affinity to those nodes
(``matchFields`` on ``metadata.name``: a node's name, not its hostname label). Only each
node's newest report counts (a node that passed since is forgiven), and a failure every pod
of a submission shares is the job's, not a node's. A failure of the shared checkpoint volume
(``checkpoint_dir``), of ``/dev/shm`` (sized by the pod's memory limit) or of the pod's CPU
allocation says nothing about the node, so it excludes none.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Set
from pathlib import Path
from typing import Any

from launch.k8s.pod import STATE_SUBDIR
from recipes import RunConfig
from resiliency.monitor.health import NodeReport, read_reports
from resiliency.storage.layout import atomic_write_json

log = logging.getLogger(__name__)
_SCRIPT_SAID_NO = re.compile(r"' exit [1-9][0-9]*:")

# /dev/shm is not among them: in a pod it is a memory-backed emptyDir sized by the pod's
# memory limit, so its failure is the job's configuration, not the node.
HARDWARE_CHECKS = frozenset({"gpus", "script"})
CONDITION_TYPE = "McoreRecipesHardwareFault"
CONDITIONS_DIR = "node-conditions"


def hardware_failures(report: dict[str, Any], ignored: Set[str] = frozenset()) -> list[str]:
    """The failed checks of a node report that point at the node's hardware: its GPUs, or the
    site's script where it ran and said no (one that is missing or timed out says nothing
    about the node); none of the ``ignored`` checks."""
    return [
        f"{check['name']}: {check['detail']}"
        for check in report.get("checks", [])
        if not check.get("ok")
        and check.get("name") in HARDWARE_CHECKS
        and check.get("name") not in ignored
        and (check["name"] != "script" or _SCRIPT_SAID_NO.search(str(check.get("detail"))))
    ]


def failed_nodes(run_dir: Path) -> dict[str, list[str]]:
    """{node: its hardware failures}, from each node's newest health report of the run's pods
    (a node that passed since is forgiven). A failure every pod of a submission shares is the
    job's (a wrong GPU count, a site script that fails everywhere), not a node's."""
    newest: dict[str, tuple[float, list[str]]] = {}  # node: (report time, failures)
    for job_dir in sorted((run_dir / STATE_SUBDIR).glob("*/health")):
        reports = [r for r in read_reports(job_dir) if "unreadable" not in r]
        shared = _shared_failures(reports)
        for report in reports:
            node, at = str(report["node"]), float(report.get("time", 0))
            if node not in newest or at >= newest[node][0]:
                newest[node] = (at, hardware_failures(report, shared))
    return {node: failures for node, (_, failures) in newest.items() if failures}


def _shared_failures(reports: list[dict[str, Any]]) -> set[str]:
    """The checks that failed on every node of a submission of two or more nodes."""
    if len(reports) < 2:
        return set()
    failed = [{c["name"] for c in r.get("checks", []) if not c.get("ok")} for r in reports]
    return set.intersection(*failed)


def avoided_nodes(run: RunConfig, run_dir: Path) -> list[str]:
    """launch.k8s.avoid_nodes and every node with hardware evidence in ``run_dir`` (the run
    dir as this host sees it; nothing where the claim is not mounted here, which is said)."""
    reports = run_dir / STATE_SUBDIR
    if not reports.is_dir():
        log.info(
            "no pod health reports at %s (the claim is not mounted here at output_dir, or no "
            "pod ran yet): only launch.k8s.avoid_nodes is kept off",
            reports,
        )
    found = failed_nodes(run_dir)
    for node, failures in found.items():
        log.warning(
            "node %s failed its health check on hardware (%s): the pods are kept off it",
            node,
            "; ".join(failures),
        )
    return sorted(set(run.launch.k8s.avoid_nodes) | set(found))


def anti_affinity(nodes: list[str]) -> dict[str, Any]:
    """Required: the scheduler never places a pod on these nodes."""
    term = {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": nodes}]}
    return {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [term]
        }}
    }  # fmt: skip


def write_condition(report: NodeReport, directory: Path) -> Path | None:
    """The node's condition, as a Node status condition, where its check failed on hardware;
    None where it did not."""
    failures = hardware_failures(report.to_dict())
    if not failures:
        return None
    condition = {
        "node": report.node,
        "condition": {
            "type": CONDITION_TYPE,
            "status": "True",
            "reason": "HealthCheckFailed",
            "message": "; ".join(failures)[:1024],
            "lastTransitionTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
    }
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{report.node}.json"
    atomic_write_json(path, condition)
    return path
