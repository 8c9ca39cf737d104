"""Kubernetes (Kubeflow PyTorchJob): render, validate and submit a run; status, logs, delete.

  python -m launch k8s recipe=NAME launch.k8s.image=IMAGE launch.k8s.shared_pvc=CLAIM
                       [key=value ...] [--dry-run] [--out FILE] [--skip-fit-check]
                       [--skip-remote-check] [--allow-tag]
  python -m launch k8s status NAME [--namespace NS]
  python -m launch k8s logs NAME [--namespace NS] [--replica master|worker] [--index I] [--tail N]
  python -m launch k8s delete NAME [--namespace NS]

The first word after `k8s` picks the action when it is status, logs or delete; otherwise every
word is a config override and the run is rendered as a ConfigMap (the pinned config, mounted
at /etc/mcore-recipes) plus a kubeflow.org/v1 PyTorchJob, validated against the operator's CRD
(launch/k8s/schema.py). The progress check and the layout's memory per GPU against launch.gpu
(`python -m pretrain --plan`) refuse what cannot run, with --dry-run too. --dry-run prints the
manifest (and writes it to --out FILE when given), never writing into the run dir; without,
the image must be pinned by digest (NAME@sha256:DIGEST; --allow-tag takes a tag: a tag can
move between pod restarts, and the ranks would then run different code), the run dir is
checked for a live owner, both objects are created with the kubernetes client
(in-cluster credentials in a pod, else $KUBECONFIG or ~/.kube/config), and the job is made the
ConfigMap's owner, so deleting the job (`k8s delete` or kubectl) deletes its ConfigMap; only
once the cluster took the job are the manifest (<output_dir>/<run_id>/k8s/NAME.yaml, or --out)
and the pinned config written into the run dir. Inside the pods output_dir is
launch.k8s.shared_mount. --namespace (default: default) applies to status/logs/delete; a
submission uses launch.k8s.namespace.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import secrets
from pathlib import Path
from typing import Any

from launch.common import (
    LaunchPlan,
    Refusal,
    check_fit,
    check_progress,
    check_remote_tier,
    check_resume,
    check_run_dir_free,
    outside_run_dir,
    plan_launch,
    record_submission,
    refuse_elastic,
    refused_code,
    write_resolved_config,
)
from launch.k8s import api as k8s_api
from launch.k8s.render import Rendered, render, to_manifest_yaml
from launch.k8s.validate import validate_objects
from pretrain.context import exit_codes
from recipes import ConfigError
from resiliency.storage.manifest import code_commit

log = logging.getLogger(__name__)

ACTIONS = ("status", "logs", "delete")
# An image pinned by its content: NAME@sha256:<hex> (or another OCI digest algorithm).
_DIGEST = re.compile(r"@[a-z0-9]+(?:[+._-][a-z0-9]+)*:[0-9a-fA-F]+$")
# Fixes the otherwise random per-submission id (labels, retry-budget key), for stable output.
SUBMISSION_ENV = "MCORE_RECIPES_SUBMISSION_ID"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="render, validate and print the manifest; submit nothing",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="write the manifest here instead of the run dir (--dry-run: besides printing it)",
    )
    parser.add_argument(
        "--skip-fit-check",
        action="store_true",
        help="submit (or render) even if `python -m pretrain --plan` says the layout does not fit",
    )
    parser.add_argument(
        "--skip-progress-check",
        action="store_true",
        help="submit even if the termination grace cannot cover a step and an emergency save",
    )
    parser.add_argument(
        "--skip-remote-check",
        action="store_true",
        help="checkpoint.remote: do not probe the object store from this host (credentials "
        "only the pods hold; their trainer still probes it)",
    )
    parser.add_argument(
        "--allow-tag",
        action="store_true",
        help="submit an image given by tag only (no @sha256: digest); a tag can move between "
        "pod restarts, so the ranks of one job could run different code",
    )
    parser.add_argument("--namespace", help="namespace for status/logs/delete (default: default)")
    parser.add_argument(
        "--replica", choices=("master", "worker"), default="master", help="logs: which replica type"
    )
    parser.add_argument(
        "--index",
        type=int,
        default=0,
        help="logs: replica index (a TrainJob: the node's index; --replica does not apply)",
    )
    parser.add_argument("--tail", type=int, help="logs: only the last N lines")


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    try:
        if overrides and overrides[0] in ACTIONS:
            return _manage(overrides[0], overrides[1:], args)
        return _launch(args, overrides)
    except k8s_api.K8sError as exc:
        log.error("%s", exc)
        return exit_codes.INFRASTRUCTURE
    except Refusal as exc:
        return refused_code(exc)


def render_run(overrides: list[str]) -> tuple[LaunchPlan, Rendered]:
    """Plan, render and validate: everything short of writing or submitting."""
    plan = plan_launch(overrides, check_files=False)  # pod paths: checked against the mounts
    refuse_elastic(plan, "k8s")
    submission = os.environ.get(SUBMISSION_ENV) or secrets.token_hex(4)
    rendered = render(plan, submission, code_commit())
    validate_objects(rendered.objects)
    return plan, rendered


def _launch(args: argparse.Namespace, overrides: list[str]) -> int:
    if args.namespace is not None:
        raise ConfigError(
            "--namespace is for status/logs/delete; to submit elsewhere set launch.k8s.namespace"
        )
    plan, rendered = render_run(overrides)
    _check(args, plan)
    text = to_manifest_yaml(rendered.objects)
    if args.dry_run:
        if args.out is not None:
            _write(args.out, text)
        print(text, end="")
        return exit_codes.OK
    return _submit(args, plan, rendered, text)


def _check(args: argparse.Namespace, plan: LaunchPlan) -> None:
    """Every check that can refuse the job, the dry run's too, before anything is written."""
    unpinned = tag_only(plan.run.launch.k8s.image or "", args.allow_tag)
    if unpinned and not args.dry_run:
        raise ConfigError(unpinned)
    if args.dry_run and args.out is not None:
        outside_run_dir(plan, args.out)  # before the slow checks
    if not args.skip_progress_check:  # a pod has no time limit: the grace is what is judged
        grace = plan.run.launch.k8s.termination_grace_s
        check_progress(plan, None, grace, "launch.k8s.termination_grace_s")
    if not args.dry_run:
        check_run_dir_free(plan)
        if plan.run_dir.is_dir():  # the volume mounted here too: judge its newest step
            # (init_from's path is the pods'; only the ranks see it for sure)
            check_resume(plan, warm_start=False)
        if not args.skip_remote_check:  # seconds at most: before the fit check's model plan
            check_remote_tier(plan)
    if not args.skip_fit_check:  # the dry run too: it says what a submission would
        check_fit(plan)
    if unpinned:  # a dry run's: last, so a refused one gets its one line only
        log.warning("dry run: a submission would be refused: %s", unpinned)


def tag_only(image: str, allow_tag: bool) -> str | None:
    """Why a submission refuses ``image`` (None: it does not). The image must name its
    content: every pod the operator starts or restarts pulls it again, and a tag can move in
    between (a push, a retag), so the ranks of one job, or its restarts, would run different
    code on the same checkpoint."""
    if allow_tag or _DIGEST.search(image):
        return None
    return (
        f"launch.k8s.image={image!r} names a tag, not a digest: a tag can move between pod "
        "restarts and the ranks would run different code; give NAME@sha256:DIGEST (`make "
        "image` builds one; push it and take the digest) or pass --allow-tag"
    )


def _submit(args: argparse.Namespace, plan: LaunchPlan, rendered: Rendered, text: str) -> int:
    created = k8s_api.submit(k8s_api.api_client(), rendered)
    # Only now, the cluster having taken the job: a refused submission leaves the run dir as
    # it was. The pods read their config from the ConfigMap; these are the run's record.
    path = args.out or plan.run_dir / "k8s" / f"{rendered.name}.yaml"
    _write(path, text)
    write_resolved_config(dataclasses.replace(plan, run=rendered.pod_run))
    record_submission(
        plan,
        "k8s",
        {
            "namespace": rendered.namespace,
            "name": rendered.name,
            "uid": created.get("metadata", {}).get("uid"),
            "manifest": str(path),
        },
    )
    log.info(
        "submitted %s %s/%s; follow it with `python -m launch k8s status %s --namespace %s`",
        rendered.job["kind"],
        rendered.namespace,
        rendered.name,
        rendered.name,
        rendered.namespace,
    )
    return exit_codes.OK


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    log.info("wrote %s", path)


def _manage(action: str, words: list[str], args: argparse.Namespace) -> int:
    if len(words) != 1:
        raise ConfigError(
            f"usage: python -m launch k8s {action} NAME [--namespace NS]; got {words}"
        )
    name, namespace = words[0], args.namespace or "default"
    api = k8s_api.api_client()
    if action == "status":
        print(format_status(k8s_api.get_job(api, namespace, name)), end="")
    elif action == "logs":
        print(
            k8s_api.replica_logs(api, namespace, name, args.replica, args.index, args.tail), end=""
        )
    else:
        kind = k8s_api.delete(api, namespace, name)
        log.info("deleted %s %s/%s", kind, namespace, name)
    return exit_codes.OK


def format_status(job: dict[str, Any]) -> str:
    """The job's conditions (oldest first) and per-replica pod counts, one line each."""
    meta, status = job.get("metadata", {}), job.get("status") or {}
    lines = [f"{meta.get('namespace')}/{meta.get('name')}"]
    conditions = status.get("conditions") or []
    for cond in conditions:
        lines.append(
            f"  {cond.get('lastTransitionTime', '-'):<22} {cond.get('type'):<10} "
            f"{cond.get('status'):<6} {cond.get('reason', '')}: "
            f"{cond.get('message', '')}"
        )
    if not conditions:
        lines.append("  no conditions yet (the operator has not reconciled the job)")
    for rtype, counts in sorted((status.get("replicaStatuses") or {}).items()):
        summary = ", ".join(
            f"{k}={counts[k]}" for k in ("active", "succeeded", "failed") if k in counts
        )
        lines.append(f"  {rtype}: {summary or 'no pods'}")
    for jobs in status.get("jobsStatus") or []:  # a TrainJob: its JobSet's replicated jobs
        keys = ("active", "ready", "succeeded", "failed", "suspended")
        summary = ", ".join(f"{k}={jobs[k]}" for k in keys if jobs.get(k))
        lines.append(f"  {jobs.get('name')}: {summary or 'no jobs'}")
    return "\n".join(lines) + "\n"
