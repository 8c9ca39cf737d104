"""Nodes a run's pods must not land on again: those whose health check failed with hardware
evidence, named by the reports the pods wrote, plus ``launch.k8s.avoid_nodes``.

A pod's entry point checks its node before the launcher starts (:mod:`launch.k8s.entry`) and
writes the report to the shared claim (``<run dir>/k8s/retries/<job id>/health/<node>.json``,
the node by ``spec.nodeName``). Where the check failed on the node's hardware (its GPUs: count,
nvidia-smi, uncorrected ECC; ``/dev/shm``; the site's own check script), the entry point also
writes the node's condition in the shape of a Node status condition
(``.../node-conditions/<node>.json``), for an operator or a node problem detector to act on:
the trainer never edits a Node object (taints and cordons are the cluster's to set).

The next submission of the run (``python -m launch k8s``, on either API) reads those reports
where the run dir is visible to it and renders required node anti-affinity to those nodes
(``matchFields`` on ``metadata.name``: a node's name, not its hostname label). A failure of
the shared checkpoint volume (``checkpoint_dir``) or of the pod's CPU allocation says nothing
about the node, so it excludes none.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from launch.k8s.pod import STATE_SUBDIR
from recipes import RunConfig
from resiliency.monitor.health import NodeReport

log = logging.getLogger(__name__)

HARDWARE_CHECKS = frozenset({"gpus", "shm", "script"})
CONDITION_TYPE = "McoreRecipesHardwareFault"
CONDITIONS_DIR = "node-conditions"


def hardware_failures(report: dict[str, Any]) -> list[str]:
    """The failed checks of a node report that point at the node's hardware."""
    return [
        f"{check['name']}: {check['detail']}"
        for check in report.get("checks", [])
        if not check.get("ok") and check.get("name") in HARDWARE_CHECKS
    ]


def failed_nodes(run_dir: Path) -> dict[str, list[str]]:
    """{node: its hardware failures} from every health report of the run's pods."""
    found: dict[str, list[str]] = {}
    for path in sorted((run_dir / STATE_SUBDIR).glob("*/health/*.json")):
        try:
            report = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        failures = hardware_failures(report)
        if failures and report.get("node"):
            found[str(report["node"])] = failures
    return found


def avoided_nodes(run: RunConfig, run_dir: Path) -> list[str]:
    """launch.k8s.avoid_nodes and every node with hardware evidence in ``run_dir`` (the run
    dir as this host sees it; nothing where the claim is not mounted here)."""
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
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(condition, indent=1))
    tmp.replace(path)
    return path
