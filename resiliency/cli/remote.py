"""``python -m resiliency upload`` and the s3:// forms of ``ls`` and ``verify``: the object-store
tier (resiliency/storage/remote.py has the protocol)."""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path
from types import FrameType

from pretrain.context import exit_codes
from resiliency.cli.base import EXIT_BAD, EXIT_OK, EXIT_USAGE, Command
from resiliency.cli.recorded import recorded_setting
from resiliency.monitor.remote_metrics import RemoteUploadMetrics
from resiliency.storage.layout import RunLayout, parse_step, step_name
from resiliency.storage.lease import GenerationPin, LeaseLostError
from resiliency.storage.object_retry import ObjectStoreAccessError, ObjectStoreUnavailable
from resiliency.storage.object_store import ObjectStore
from resiliency.storage.remote import (
    UploadPass,
    committed_remote_steps,
    fetch_newest,
    read_latest,
    remote_steps,
    upload_run,
    verify_remote_step,
)
from resiliency.storage.select import select_restore_step
from resiliency.storage.signing import SigningKey


def split_remote(url: str, endpoint_url: str | None) -> tuple[ObjectStore, str, int | None]:
    """s3://bucket/prefix/<run_id>[/steps/step-N] -> (store at the prefix, run_id, step)."""
    parts = url.rstrip("/").split("/")
    step = parse_step(parts[-1]) if len(parts) > 5 and parts[-2] == "steps" else None
    if step is not None:
        parts = parts[:-2]
    if len(parts) < 4:
        raise ValueError(f"{url}: give s3://bucket[/prefix]/<run_id>")
    return ObjectStore("/".join(parts[:-1]), endpoint_url), parts[-1], step


def remote_ls(url: str, endpoint_url: str | None, full: bool, key: SigningKey | None = None) -> int:
    store, run_id, _ = split_remote(url, endpoint_url)
    committed = set(committed_remote_steps(store, run_id))
    latest = read_latest(store, run_id)
    print(f"run:         {store.url}/{run_id}")
    print(f"latest.json: {'step ' + str(latest) if latest is not None else 'none'}")
    print(f"{'STEP':>10}  {'DIR':<16}  {'COMMITTED':<9}  CHECK")
    all_ok = True
    for step in reversed(remote_steps(store, run_id)):
        verdict = verify_remote_step(store, run_id, step, full, key) if step in committed else None
        check = verdict.reason if verdict else "incomplete upload (no COMMITTED): never restored"
        all_ok &= verdict is None or verdict.ok
        mark = "yes" if step in committed else "no"
        print(f"{step:>10}  {step_name(step):<16}  {mark:<9}  {check}", flush=True)
    return EXIT_OK if all_ok else EXIT_BAD


def remote_verify(
    url: str, endpoint_url: str | None, full: bool, key: SigningKey | None = None
) -> int:
    store, run_id, only = split_remote(url, endpoint_url)
    steps = [only] if only is not None else list(reversed(remote_steps(store, run_id)))
    if not steps:
        print(f"BAD {url}: no remote step to verify")
        return EXIT_BAD
    bad = 0
    for step in steps:
        verdict = verify_remote_step(store, run_id, step, full, key)
        bad += not verdict.ok
        print(f"{'OK ' if verdict.ok else 'BAD'} {step_name(step)}: {verdict.reason}", flush=True)
    return EXIT_BAD if bad else EXIT_OK


def _stop_event(follow: bool) -> threading.Event:
    """Set by SIGTERM/SIGINT under --follow: the launchers stop it so; the object in flight is
    finished, not the pass."""
    stop = threading.Event()
    if follow:

        def request_stop(signum: int, frame: FrameType | None) -> None:
            stop.set()

        signal.signal(signal.SIGTERM, request_stop)
        signal.signal(signal.SIGINT, request_stop)
    return stop


def _wait_for_run_dir(
    layout: RunLayout, follow: bool, stop: threading.Event, interval: float
) -> bool:
    """The run dir exists, or (--follow) appears: the launchers start the uploader before the
    trainer has created it. False: not a run dir, or stopped while waiting."""
    if layout.steps_dir.is_dir():
        return True
    if not follow:
        print(f"error: {layout.run_dir} has no steps/: not a run dir")
        return False
    print(f"waiting for {layout.steps_dir} to appear", flush=True)
    while not stop.wait(min(interval, 2.0)):
        if layout.steps_dir.is_dir():
            return True
    return False


def _print_pass(result: UploadPass, url: str) -> None:
    for r in result.reports:
        rate = r.bytes_sent / 2**20 / max(r.seconds, 1e-9)
        print(f"uploaded step {r.step} to {url}: {r.sent} objects sent, {r.skipped} already "
              f"there, {r.bytes_sent / 2**20:.1f} MiB in {r.seconds:.2f} s ({rate:.1f} MiB/s)",
              flush=True)  # fmt: skip
    for step, why in result.skipped:
        print(f"skipped step {step}: {why}", flush=True)


def _behind(result: UploadPass) -> int | None:
    """The newest local step that should be on the remote tier and is not (None: caught up).
    A step skipped because it does not verify locally or was deleted is not owed."""
    skipped = {step for step, _ in result.skipped}
    owed = [s for s in result.local if s not in skipped]
    newest = owed[-1] if owed else None
    return None if newest is None or newest in result.committed else newest


def cmd_upload(args: argparse.Namespace) -> int:
    """Exit 0: caught up (the newest verified local step is committed remotely); 1 it is not
    (the store was out, or an object did not verify); 2 usage, credentials or bucket; 6 the
    run's lease moved to another job (its own uploader takes over). --follow ends only by a
    signal, a lease loss or an access error: per-step and network errors are retried."""
    layout = RunLayout.from_run_dir(Path(args.run_dir))
    stop = _stop_event(args.follow)
    if args.keep_last < 2:
        print(f"error: --keep-last={args.keep_last}: keep at least 2 remote steps")
        return EXIT_USAGE
    if not _wait_for_run_dir(layout, args.follow, stop, args.interval):
        return EXIT_OK if stop.is_set() else EXIT_USAGE
    url = args.to or recorded_setting(layout, "remote.url").value
    if not url:
        print("error: give --to s3://bucket/prefix (the run records no checkpoint.remote.url)")
        return EXIT_USAGE
    budget = args.retry_budget_s or recorded_setting(layout, "remote.retry_budget_s").value
    store = ObjectStore(url, args.endpoint_url, args.workers, retry_budget_s=float(budget))
    pin = GenerationPin(layout)  # the job whose lease it serves: a takeover fences its deletes
    interval = recorded_setting(layout, "save_interval").value
    metrics, verified = RemoteUploadMetrics(layout, interval), set()
    where = f"{store.url}/{layout.run_id}"
    while True:
        result = None
        try:
            result = upload_run(store, layout, args.workers, args.keep_last,
                                args.milestone_interval, pin, verified)  # fmt: skip
            _print_pass(result, where)
            metrics.record(result)
        except ObjectStoreUnavailable as exc:  # the next pass tries again
            print(f"error: {exc}", flush=True)
            metrics.record(None, errors=1)
        except ObjectStoreAccessError as exc:
            print(f"error: {exc}", flush=True)
            return EXIT_USAGE
        except LeaseLostError as exc:  # another job owns the run now; its uploader takes over
            print(f"error: {exc}")
            return exit_codes.LEASE_HELD
        if not args.follow or stop.wait(args.interval):
            return _final_word(result, where)


def _final_word(result: UploadPass | None, where: str) -> int:
    if result is None:
        print(f"BEHIND: the last pass to {where} failed; the newest steps may not be there")
        return EXIT_BAD
    remote = result.committed[-1] if result.committed else None
    print(f"newest local step: {result.newest_local}; newest remote committed step: {remote}")
    if (owed := _behind(result)) is not None:
        print(f"BEHIND: local step {owed} is not committed on {where}")
        return EXIT_BAD
    return EXIT_OK


def cmd_fetch(args: argparse.Namespace) -> int:
    """Before a pod's trainer starts (a Kubernetes init container): the run dir has a step
    that verifies, or the newest intact remote step is fetched into it, by the same selection
    and verification code the trainer's own restore uses."""
    layout = RunLayout.from_run_dir(Path(args.run_dir))
    url = args.source or recorded_setting(layout, "remote.url").value
    if not url:
        print("error: give --from s3://bucket/prefix (the run records no checkpoint.remote.url)")
        return EXIT_USAGE
    local = select_restore_step(layout, layout.run_id, full_verify=False)
    if local.step_dir is not None:
        print(f"{local.step_dir} verifies: nothing to fetch")
        return EXIT_OK
    store = ObjectStore(url, args.endpoint_url, args.workers)
    try:
        committed = committed_remote_steps(store, layout.run_id)
        if not committed:
            print(f"no committed step in {store.url}/{layout.run_id}: the run starts fresh")
            return EXIT_OK
        fetched = fetch_newest(store, layout, FETCH_ATTEMPT, args.workers, committed=committed)
    except ObjectStoreUnavailable as exc:  # not the steps' fault: the pod's restart retries
        print(f"error: {exc}")
        return EXIT_BAD
    except ObjectStoreAccessError as exc:
        print(f"error: {exc}")
        return EXIT_USAGE
    if fetched is None:
        print(f"BAD: none of the remote steps {committed} fetched intact from {store.url}")
        return EXIT_BAD
    print(f"fetched {store.url}/{layout.run_id}/steps/{fetched.name} into {fetched}")
    return EXIT_OK


def _add_fetch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="the run dir to restore into (<root>/<run_id>)")
    p.add_argument("--from", dest="source", help="s3://bucket[/prefix] (default: the run's own)")
    p.add_argument("--endpoint-url", help="S3-compatible server (default: AWS_ENDPOINT_URL)")
    p.add_argument("--workers", type=int, default=8, help="objects downloaded in parallel")


def _add_upload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a run dir (<root>/<run_id>)")
    p.add_argument("--to", help="s3://bucket[/prefix] (default: the run's checkpoint.remote.url)")
    p.add_argument("--endpoint-url", help="S3-compatible server (default: AWS_ENDPOINT_URL)")
    p.add_argument("--follow", action="store_true", help="keep uploading new steps until SIGTERM")
    p.add_argument("--interval", type=float, default=10.0, help="--follow: seconds between scans")
    p.add_argument("--workers", type=int, default=8, help="objects uploaded in parallel")
    p.add_argument("--keep-last", type=int, default=3, help="remote steps kept (plus milestones)")
    p.add_argument("--milestone-interval", type=int, help="remote steps never deleted: multiples")
    p.add_argument(
        "--retry-budget-s",
        type=float,
        help="per call, transient errors retried this long (default: the run's)",
    )


FETCH_ATTEMPT = 99  # the tmp dir's tag: no training attempt writes while it runs (lease)
COMMANDS = {
    "fetch": Command(
        "no local step verifies? fetch the newest intact one from the object store (init step)",
        _add_fetch_args,
        cmd_fetch,
        epilog="Exit 0: a local step verifies, one was fetched, or the remote has none; 1: the "
        "remote has committed steps and none downloads intact.",
    ),
    "upload": Command(
        "copy a run's committed steps to an object store (s3://), resumable; --follow keeps on",
        _add_upload_args,
        cmd_upload,
        epilog="Objects are never overwritten; COMMITTED is written last; latest.json only "
        "moves forward. Credentials: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or a profile.",
    ),
}
