"""Choose the step to restore and validate its topology, before any model is built; its files
are re-hashed while the model is built, and confirmed before anything is loaded."""

from __future__ import annotations

import dataclasses
import logging
import shutil
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from pretrain.context import exit_codes
from pretrain.context.failures import ClassifiedError
from pretrain.context.run_dir import RunDir
from pretrain.platform.distributed import broadcast_object
from pretrain.train.fault_injection import FaultInjector
from recipes.config.checkpoint import CheckpointConfig, RemoteCheckpointConfig
from recipes.config.run import RunConfig
from resiliency.checkpoint.restore.init_source import (
    InitSource,
    InitSourceError,
    fetched_dir,
    from_step_dir,
    init_target,
    is_remote,
    judge,
    resolve_local,
    split_remote,
)
from resiliency.checkpoint.restore.preflight import (
    check_must_match,
    check_tokenizer,
    corpus_refusal,
    corpus_to_check,
    target_for,
)
from resiliency.checkpoint.restore.share_check import ShareCheck
from resiliency.checkpoint.restore.topology import (
    Target,
    TopologyRefusedError,
    TopologyReport,
    validate,
)
from resiliency.storage.checksum import FileEntry
from resiliency.storage.corpus import corpus_changes, describe_change
from resiliency.storage.layout import MODEL_DIR, RunLayout
from resiliency.storage.manifest import Manifest, read_manifest
from resiliency.storage.object_retry import ObjectStoreAccessError, ObjectStoreUnavailable
from resiliency.storage.object_store import ObjectStore
from resiliency.storage.pickle_scan import step_pickle_problem
from resiliency.storage.remote import committed_remote_steps, fetch_newest
from resiliency.storage.select import select_restore_step
from resiliency.storage.signing import SigningKey, key_from_env
from resiliency.storage.verify import balanced_share, checksum_problem, io_problem

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestorePlan:
    step_dir: Path
    manifest: Manifest
    report: TopologyReport
    tier: str = "persistent"  # or "remote": fetched from the object store by this plan
    # This rank's share of the step's files, re-hashed (unless checkpoint.full_verify is off)
    # and pickle-scanned in the background while the model is built (I/O next to CPU work).
    rehash: Future[str | None] | None = field(default=None, compare=False)
    # The shard files of that share the streaming read checks as it reads them (the re-hash
    # skips those): share_check.py.
    share_check: ShareCheck | None = field(default=None, compare=False)
    # How the corpus differs from the one the step recorded, resumed anyway because
    # data.allow_changed_corpus=true (corpus.corpus_changes); None when nothing differs.
    corpus_changes: list[dict[str, Any]] | None = None
    # A warm start (checkpoint.init_from): another run's step, loaded as this run's step 0.
    init: InitSource | None = None

    def check_metadata_files(self, checksums: bool = True) -> str | None:
        """Collective: the first problem any rank finds in the step's small model files (the
        ones a load reads before any shard: megatron's common state, DCP's metadata), each
        rank checking them all itself (checksums unless ``checksums`` is off, and the static
        pickle scan). All ranks get the same answer, so they enter the load together or not
        at all."""
        names = [e for e in self.manifest.files if _read_before_shards(e.path)]
        return _first_on_any_rank(files_problem(self.step_dir, names, checksums))

    def confirm(self) -> str | None:
        """Collective: the first checksum or pickle problem any rank found in its share."""
        if self.rehash is None:
            return None
        if self.share_check is not None:
            self.share_check.release()  # the read is over: the re-hash takes what is left
        problem = self.rehash.result()
        if problem is None and self.share_check is not None:
            problem = self.share_check.problem
        return _first_on_any_rank(problem)


def _first_on_any_rank(problem: str | None) -> str | None:
    """Collective: the first rank's problem, if any rank has one (the same answer on all)."""
    problems: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    return next((p for p in problems if p is not None), None)


def files_problem(
    step_dir: Path,
    entries: list[FileEntry],
    checksums: bool,
    hashes: Callable[[str], bool] = lambda _: True,
) -> str | None:
    """The first checksum mismatch (unless ``checksums`` is off; only of the entries
    ``hashes`` takes) or inadmissible pickle among ``entries`` of ``step_dir``; an I/O error is
    this rank's problem with the step."""
    try:
        problem = None
        if checksums:
            problem = next(
                (
                    p
                    for e in entries
                    if hashes(e.path) and (p := checksum_problem(step_dir / e.path, e))
                ),
                None,
            )
        return problem or step_pickle_problem(step_dir, [e.path for e in entries])
    except OSError as exc:
        return f"rank {dist.get_rank()}: {io_problem(exc)}"


def _read_before_shards(rel_path: str) -> bool:
    """A file of the step's model dir that megatron's load reads before any shard."""
    parts = rel_path.split("/")
    return len(parts) == 2 and parts[0] == MODEL_DIR and not parts[1].endswith(".distcp")


class UnrecoverableRunError(ClassifiedError):
    """The run has published steps and none of them verifies: starting over would silently
    replace its history, so the run stops until someone decides."""

    kind, exit_code = "checkpoint", exit_codes.CHECKPOINT_IO


def pick_checkpoint(
    layout: RunLayout,
    run_id: str,
    rejected: Mapping[int, str],
    start_over: bool = False,
    remote: RemoteCheckpointConfig | None = None,
    attempt: int = 0,
    key: SigningKey | None = None,
) -> tuple[Path | None, str]:
    """Rank 0 picks the newest step whose marker, manifest and file sizes check out (and, with
    ``key``, whose manifest is signed with it) and that is not ``rejected``; with none, the
    newest the remote tier holds intact (fetched here). Every rank gets the same (step dir,
    tier) (collective). Published steps of which none verifies stop the run, unless
    ``start_over``."""
    choice, tier, refusal, error = None, "persistent", None, None
    if dist.get_rank() == 0:
        selection = select_restore_step(
            layout, run_id, full_verify=False, rejected=rejected, key=key
        )
        for name, reason in selection.skipped:
            log.warning("restore: skipped %s: %s", name, reason)
        choice = str(selection.step_dir) if selection.step_dir else None
        remote_steps: list[int] = []
        if choice is None and remote is not None and remote.enabled:
            try:
                fetched, remote_steps = fetch_from_remote(remote, layout, attempt, rejected, key)
                choice, tier = (str(fetched), "remote") if fetched else (None, tier)
            except (ObjectStoreUnavailable, ObjectStoreAccessError) as exc:
                error = exc  # every rank raises it: the store is out, no step is to blame
        if error is None and choice is None and (layout.published_steps() or remote_steps):
            refusal = _unrecoverable(layout, selection.skipped, start_over, remote_steps)
    choice, tier, refusal, error = broadcast_object((choice, tier, refusal, error))
    if error is not None:
        raise error
    if refusal is not None:
        raise UnrecoverableRunError(refusal)
    if choice is None:
        log.info("restore: no verified checkpoint in %s; starting fresh", layout.run_dir)
        return None, tier
    return Path(choice), tier


def fetch_from_remote(
    remote: RemoteCheckpointConfig,
    layout: RunLayout,
    attempt: int,
    rejected: Mapping[int, str],
    key: SigningKey | None = None,
) -> tuple[Path | None, list[int]]:
    """Last in the restore order (local, replica, shared, remote): the newest remote step that
    verifies and downloads intact, published into the shared steps dir; and the committed
    remote steps there were."""
    assert remote.url is not None
    store = ObjectStore(
        remote.url, remote.endpoint_url, remote.workers, retry_budget_s=remote.retry_budget_s
    )
    log.warning(
        "restore: no verified step in %s; looking in the remote tier %s",
        layout.steps_dir,
        remote.url,
    )
    below = min(rejected) if rejected else None  # a rejected step is not fetched again
    steps = [s for s in committed_remote_steps(store, layout.run_id) if below is None or s < below]
    return fetch_newest(store, layout, attempt, remote.workers, below, steps, key), steps


def _unrecoverable(
    layout: RunLayout, skipped: list[tuple[str, str]], start_over: bool, remote: list[int]
) -> str | None:
    steps = layout.published_steps()
    if remote:  # every committed remote step failed its checks (each one logged why)
        skipped = [*skipped, ("remote tier", f"steps {remote} committed, none fetched intact")]
    if start_over:
        log.warning(
            "restore: none of the %d published steps in %s verifies; "
            "checkpoint.start_over_if_unverified=true: training starts over from step 0",
            len(steps),
            layout.steps_dir,
        )
        return None
    reasons = "\n".join(f"  {name}: {reason}" for name, reason in skipped)
    foreign = any("another run" in reason for _, reason in skipped)
    return (
        f"{layout.steps_dir} holds {len(steps)} published step(s) and none verifies"
        f"{f' (nor any of the remote tier, {len(remote)} committed)' if remote else ''}:\n"
        f"{reasons}\nNothing was changed. Repair or restore the steps (python -m resiliency "
        "verify <step dir> says why), or start this run's history over with "
        "checkpoint.start_over_if_unverified=true."
        + (
            " To train from another run's step, start a run of its own from it: "
            "checkpoint.init_from=<that step dir or run dir> (a warm start)."
            if foreign
            else ""
        )
    )


def reads_shards_early(cfg: CheckpointConfig) -> bool:
    """Whether the checkpoint hook reads the planned step's shards before the confirm, while
    the step is re-hashed (with the node-local tier on, that tier may restore instead)."""
    return not cfg.local.enabled


def start_rehash(
    step_dir: Path,
    manifest: Manifest,
    faults: FaultInjector | None = None,
    checksums: bool = True,
    reads_shards: bool = False,
) -> tuple[Future[str | None], ShareCheck]:
    """Re-hash this rank's share of the files on a helper thread (reads and crc32c release
    the GIL); together the ranks read the checkpoint once, next to the load that reads the
    shards into place meanwhile (checkpoint hook: nothing is applied before the confirm).
    An I/O error is this rank's problem with the step, reported in the collective that
    confirms the plan like a checksum mismatch (never raised past its peers' wait). So is a
    pickle in the share that names a global the loader does not admit (pickle_scan.py, found
    statically; the load admits only the same allow-list). Without ``checksums``
    (checkpoint.full_verify=false) only the pickles are read: a forged step is still refused
    here, and the previous one planned, rather than failing the load. With ``reads_shards``
    the shard files of the share are left to the streaming read where it reads them
    (share_check.py): the small files first, the shard files after the read."""
    rank = dist.get_rank()
    mine = balanced_share(manifest.files, rank, dist.get_world_size())
    check = ShareCheck({e.path: e for e in mine}, reads_shards and checksums)
    mine.sort(key=lambda e: ShareCheck.is_shard(e.path))  # stable: small files first

    def first_problem() -> str | None:
        try:
            if faults is not None:
                faults.at_rehash(manifest.step)
        except OSError as exc:
            return f"rank {rank}: {io_problem(exc)}"
        return files_problem(step_dir, mine, checksums, check.rehash_takes)

    future: Future[str | None] = Future()

    def run() -> None:
        future.set_running_or_notify_cancel()
        try:
            future.set_result(first_problem())
        except BaseException as exc:  # noqa: BLE001 - the confirm re-raises it
            future.set_exception(exc)

    # A daemon: a rank that leaves before the confirm (a refused resume, a failed build)
    # must not wait at exit for a re-hash nobody reads (nor for the read it waits on).
    threading.Thread(target=run, name="rehash", daemon=True).start()
    return future, check


def check_topology(manifest: Manifest, target: Target, warm_start: bool = False) -> TopologyReport:
    """Validate; a refusal raises with the diff table and the user's options. A layout change
    is worth a warning on a resume; a warm start is expected to change it (logged at INFO)."""
    report = validate(manifest, target)
    if report.refused:
        raise TopologyRefusedError(
            f"checkpoint step {manifest.step} cannot be restored into this layout:\n"
            f"{report.table()}"
        )
    if not report.same_layout and dist.get_rank() == 0:
        level = logging.INFO if warm_start else logging.WARNING
        log.log(level, "restore: topology changes from the checkpoint's:\n%s", report.table())
    return report


def check_corpus(
    run: RunConfig, manifest: Manifest, step_dir: Path, run_dir: Path
) -> list[dict[str, Any]] | None:
    """Collective: the dataset's index files are the ones the step recorded, or ConfigError
    naming each difference (rank 0 re-hashes them, every rank gets its answer). With
    data.allow_changed_corpus=true the differences are logged and returned instead, and the
    run's own index cache (built from the old corpus, named by config, not content) is
    removed so that megatron rebuilds it. A step saved before index checksums were recorded,
    or mock data, is not checked."""
    saved = corpus_to_check(run, manifest)
    if saved is None:
        return None
    changes = corpus_changes(saved, run.data.paths) if dist.get_rank() == 0 else None
    if changes and run.data.allow_changed_corpus:
        _drop_stale_cache(run, run_dir)
    changes = broadcast_object(changes)
    if not changes:
        return None
    if not run.data.allow_changed_corpus:
        raise corpus_refusal(step_dir, changes)
    what = "; ".join(describe_change(c) for c in changes)
    if dist.get_rank() == 0:
        log.warning(
            "restore: data.allow_changed_corpus=true: resuming %s on a changed corpus (%s); "
            "the data cursor now selects other samples than the saved run would have",
            step_dir.name,
            what,
        )
    return changes


def _drop_stale_cache(run: RunConfig, run_dir: Path) -> None:
    """Rank 0: megatron's sample index cache of the old corpus would be reused as is."""
    if run.data.cache_dir is not None:
        log.warning(
            "restore: data.cache_dir=%s may hold megatron index caches built from the old "
            "corpus (they are named by config, not content): remove them before this resume",
            run.data.cache_dir,
        )
        return
    cache = RunDir(run_dir).data_cache_dir  # the index cache when data.cache_dir is unset
    if cache.is_dir():
        shutil.rmtree(cache)
        log.warning("restore: removed %s, built from the old corpus (rebuilt now)", cache)


def plan_restore(
    run: RunConfig,
    layout: RunLayout,
    world_size: int,
    dp: int,
    vocab_size: int,
    rejected: Mapping[int, str] | None = None,
    attempt: int = 0,
) -> tuple[RunConfig, RestorePlan | None]:
    """Returns the run config to build (checkpoint's padded vocab pinned) and what to load.

    With ``checkpoint.full_verify`` the plan's files are still being re-hashed: call
    :meth:`RestorePlan.confirm` (all ranks) before loading; on a problem, plan again with the
    step in ``rejected``.
    """
    step_dir, tier = pick_checkpoint(
        layout,
        run.run_id,
        rejected or {},
        run.checkpoint.start_over_if_unverified,
        run.checkpoint.remote,
        attempt,
        key_from_env(run.checkpoint.signing_key_env),
    )
    if step_dir is None:
        return run, None
    manifest = read_manifest(step_dir)
    faults = FaultInjector.parse(run.train.fault, dist.get_rank())
    rehash, share_check = start_rehash(
        step_dir, manifest, faults, run.checkpoint.full_verify, reads_shards_early(run.checkpoint)
    )
    target = target_for(run, world_size, dp, vocab_size)
    if manifest.weights_only:  # nothing of the optimizer to reshard: any layout loads it
        target = dataclasses.replace(target, load_optimizer=False)
    check_tokenizer(manifest, run.data.tokenizer_path, step_dir)
    check_must_match(run, manifest)  # before the topology: a shape change is exit 2, not 3
    report = check_topology(manifest, target)
    changes = check_corpus(run, manifest, step_dir, layout.run_dir)
    padded = manifest.tokenizer.get("padded_vocab_size")
    model = dataclasses.replace(run.model, padded_vocab_size=padded)
    plan = RestorePlan(
        step_dir, manifest, report, tier, rehash, share_check=share_check, corpus_changes=changes
    )
    return dataclasses.replace(run, model=model), plan


def plan_init(
    run: RunConfig,
    run_dir: Path,
    world_size: int,
    dp: int,
    vocab_size: int,
    rejected: Mapping[int, str] | None = None,
    attempt: int = 0,
) -> tuple[RunConfig, RestorePlan]:
    """Collective: checkpoint.init_from's step to load as this run's step 0 (a run with no
    step of its own): rank 0 resolves it (downloads an s3:// source into the run dir), every
    rank judges it (init_source.judge, the topology) and re-hashes its share, as a restore."""
    spec = run.checkpoint.init_from
    assert spec is not None
    key = key_from_env(run.checkpoint.signing_key_env)
    found, error = None, None
    if dist.get_rank() == 0:
        try:
            found = str(_resolve_init(run, run_dir, rejected or {}, attempt, key).step_dir)
        except Exception as exc:  # noqa: BLE001 - every rank raises it
            error = exc
    found, error = broadcast_object((found, error))
    if error is not None:
        raise error
    source = from_step_dir(spec, Path(found))
    pinned = judge(run, source)  # the source's padded vocab, once the layout is judged
    manifest = source.manifest
    rehash, share_check = start_rehash(
        source.step_dir,
        manifest,
        FaultInjector.parse(run.train.fault, dist.get_rank()),
        run.checkpoint.full_verify,
        reads_shards_early(run.checkpoint),
    )
    # This launch's own padded vocab (if it sets one) is judged against the source's.
    report = check_topology(manifest, init_target(run, world_size, dp, vocab_size, source), True)
    run = pinned
    if dist.get_rank() == 0:
        log.info(
            "warm start: %s of run %r (%s) as step 0, loading %s",
            source.step_dir.name,
            manifest.run_id,
            spec,
            source.loads(run.checkpoint.init_load),
        )
    plan = RestorePlan(
        source.step_dir, manifest, report, "init", rehash, share_check=share_check, init=source
    )
    return run, plan


def _resolve_init(
    run: RunConfig,
    run_dir: Path,
    rejected: Mapping[int, str],
    attempt: int,
    key: SigningKey | None,
) -> InitSource:
    """Rank 0: the local source's step, or the newest intact step of an s3:// source,
    downloaded into this run's dir (kept there: a retry before the first save reuses it)."""
    spec = run.checkpoint.init_from
    assert spec is not None
    if not is_remote(spec):
        return resolve_local(spec, run_dir, rejected, key)
    url, source_run = split_remote(spec)
    layout = fetched_dir(run_dir, source_run)
    if layout.published_steps():
        try:
            return resolve_local(str(layout.run_dir), run_dir, rejected, key)
        except ClassifiedError:
            pass  # none verifies: fetch again
    remote = run.checkpoint.remote
    store = ObjectStore(
        url, remote.endpoint_url, remote.workers, retry_budget_s=remote.retry_budget_s
    )
    below = min(rejected) if rejected else None
    fetched = fetch_newest(store, layout, attempt, remote.workers, below, key=key)
    if fetched is None:
        raise InitSourceError(
            f"checkpoint.init_from={spec}: no committed step there fetched intact"
        )
    return resolve_local(str(fetched), run_dir, rejected, key)
