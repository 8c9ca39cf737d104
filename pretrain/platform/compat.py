"""Fixes for megatron-core bugs, each gated on the megatron-core releases it was measured on.

F-I live on the torch.optim.Adam path (no Apex / Transformer Engine), taken on CPU and on any GPU
box without Apex or TE; J is in dist_checkpointing's async writer; K is a refused configuration;
L is in the tensor-parallel layers of a model built without initialisation (restores).
Each fix names the bug and the megatron-core versions it bites (``Fix.affected``: version
prefixes, measured by running tests/integration/test_compat.py with the fix left out via
``MCORE_RECIPES_COMPAT_SKIP=F,G``); a version not listed gets no fix. Re-measure before adding
a release: a supported version (``SUPPORTED_MCORE``) missing from a fix's list is a measured
"not needed there", proven by tests/integration/test_compat.py.

F-I patch megatron's DistributedOptimizer class and are applied by :func:`apply` (table
``FIXES``); J-L need objects of the run and are applied where those exist (table
``CALL_SITE_FIXES`` says where). Three more entries are not bug fixes but the only other places
that reach into megatron-core: :func:`route_shard_writer_open` (checksums computed while shards
are written), :func:`fully_reshardable_state_from` (the optimizer state built into staging
buffers), :func:`checkpoint_reader` (the storage reader a restore's load reads shards with)
and :func:`lean_writer_imports` (a lighter megatron-core import in the checkpoint
writer process). nvidia-resiliency-ext's straggler package is located by
:func:`nvrx_straggler`; making it run on CPU is in :mod:`pretrain.platform.cpu_shim`.

M-O (table ``SAFE_LOADS``, applied by :func:`apply` on every stack) restrict what loading a
checkpoint may unpickle to the allow-list ``CHECKPOINT_GLOBALS``
(pretrain/platform/checkpoint_globals.py, torch-free so that the storage layer's static scan shares
it): torch DCP's ``.metadata`` read (M), DCP's byte items, megatron's sharded objects and 0.19's
common state (N), megatron's ``common.pt`` (O). :func:`safe_torch_load` is the same load for the
call sites that are ours (rank state, the node-local tier's nvrx manager).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import io
import logging
import os
import pickle
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib.metadata import version
from typing import IO, Any

import torch

from pretrain.platform.checkpoint_globals import (
    CHECKPOINT_GLOBALS as CHECKPOINT_GLOBALS,  # its home
)
from pretrain.platform.checkpoint_globals import (
    UnsafeCheckpointError,
    admitted_globals,
    global_name,
    refusal,
)
from pretrain.platform.file_queue import FileQueue

log = logging.getLogger(__name__)
SKIP_ENV = "MCORE_RECIPES_COMPAT_SKIP"
MCORE_0_16 = "0.16."  # Python 3.11 leg: megatron-core 0.16.1
MCORE_0_19 = "0.19."  # Python 3.12 leg: megatron-core 0.19.2
SUPPORTED_MCORE = (MCORE_0_16, MCORE_0_19)
# Measured on 0.16.1 and on 0.19.2: tests/integration/test_compat.py shows the bug without the fix
# on both legs.
BOTH = (MCORE_0_16, MCORE_0_19)


@functools.lru_cache(maxsize=1)
def mcore_version() -> str:
    # Cached: importlib.metadata parses the package's METADATA file on every call (a restore
    # asks dozens of times, ~1 ms each).
    return version("megatron-core")


@dataclass(frozen=True)
class Fix:
    name: str
    bug: str
    apply: Callable[[Any], None]  # receives megatron's DistributedOptimizer class
    affected: tuple[str, ...]  # megatron-core version prefixes measured to have the bug


def _prime_empty_adam_state(optimizer: Any) -> None:
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        adam = getattr(inner, "optimizer", None)
        if adam is None:
            continue
        for group in adam.param_groups:
            for param in group["params"]:
                state = adam.state[param]
                if not state:
                    state["exp_avg"] = torch.zeros_like(param.data)
                    state["exp_avg_sq"] = torch.zeros_like(param.data)
                    state["step"] = torch.tensor(0.0)


def _fix_f(cls: Any) -> None:
    original = cls.sharded_state_dict

    @functools.wraps(original)
    def sharded_state_dict(
        self: Any,
        model_sharded_state_dict: Any = None,
        is_loading: bool = False,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if is_loading:
            _prime_empty_adam_state(self)
        return original(self, model_sharded_state_dict or {}, is_loading, *args, **kwargs)

    cls.sharded_state_dict = sharded_state_dict


def _fix_g(cls: Any) -> None:
    original = cls._set_main_param_and_optimizer_states

    @functools.wraps(original)
    def set_states(self: Any, model_param: Any, tensors: dict) -> None:
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        destination = {"param": main_param, **self.optimizer.state[main_param]}
        for key, tensor in destination.items():
            # 'step' was restored from param_groups already; the incoming one is the pre-load value.
            if key in tensors and key != "step":
                tensor.copy_(tensors[key])
        return None

    cls._set_main_param_and_optimizer_states = set_states


def _fix_h(cls: Any) -> None:
    cls.load_parameter_state_from_dp_reshardable = torch.no_grad()(
        cls.load_parameter_state_from_dp_reshardable
    )


def _fix_i(cls: Any) -> None:
    original = cls.load_state_dict

    @functools.wraps(original)
    def load_state_dict(self: Any, state_dict: dict) -> Any:
        result = original(self, state_dict)
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].detach().clone()
        return result

    cls.load_state_dict = load_state_dict


K_AFFECTED: tuple[str, ...] = BOTH  # 0.19.2: the same divergence (loss 5.33 -> 5.80 at step 4)
J_AFFECTED: tuple[str, ...] = BOTH  # 0.19.2: still ctx.Manager() in get_write_results_queue
# 0.19 routes async saves through nvrx's writer, whose own queue Manager is orphaned the same way
# (measured: a rank killed during an async save leaves it behind, holding the job's stdout).
J_NVRX_WRITER: tuple[str, ...] = (MCORE_0_19,)


L_AFFECTED: tuple[str, ...] = (MCORE_0_16,)  # 0.19.2 sets the attributes without the init


def fix_uninitialised_tp_attributes(chunks: list[Any]) -> None:
    """L: with ``perform_initialization=False`` (set when a checkpoint will be restored),
    0.16's tensor-parallel layers never mark their weights as tensor-parallel: the marking
    lives inside the init helper. Grad-norm clipping then counts each TP shard as a duplicate
    and a resumed run silently takes different steps (measured: grad norm 4.507 -> 4.489 at
    the first resumed step, losses drift from the next one).
    """
    if not call_site_fix_needed("L"):
        return
    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    partition_dim = ((VocabParallelEmbedding, 0), (ColumnParallelLinear, 0), (RowParallelLinear, 1))
    for chunk in chunks:
        for module in chunk.modules():
            weight = getattr(module, "weight", None)
            dim = next((d for cls, d in partition_dim if isinstance(module, cls)), None)
            if dim is None or weight is None or hasattr(weight, "tensor_model_parallel"):
                continue
            # megatron's GPT layers all use stride 1 (the init helper's default).
            set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=dim, stride=1)


def vpp_tied_embedding_save_problem(
    vpp: int | None, tied_embeddings: bool, distributed_optimizer: bool, optim_format: str
) -> str | None:
    """K: a measured silent corruption, refused rather than patched (root cause not isolated).

    With virtual pipeline stages, tied embeddings and the distributed optimizer, a
    ``fully_reshardable`` save writes the first stage's embedding optimizer state (main param
    and both Adam moments) wrong; a run resumed from it diverges (loss 5.2 -> 5.8 at the next
    step). Untied embeddings or ``dp_reshardable`` resume bit-exactly.
    """
    affected = call_site_fix_needed("K")
    if (
        affected
        and (vpp or 1) > 1
        and tied_embeddings
        and distributed_optimizer
        and optim_format == "fully_reshardable"
    ):
        return (
            f"megatron-core {mcore_version()} saves a corrupt optimizer state for tied "
            "embeddings with parallel.vpp>1 and checkpoint.optim_format=fully_reshardable "
            "(measured: resumed runs diverge). Use checkpoint.optim_format=dp_reshardable, or "
            "model.share_embeddings_and_output_weights=false."
        )
    return None


def _writer_queue_modules() -> list[Any]:
    """The modules whose module-level write-results queue this release's saves use."""
    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    modules = [filesystem_async]  # sync saves (and async ones on 0.16)
    if mcore_version().startswith(J_NVRX_WRITER):
        # nvrx: loaded only where the feature runs
        from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async as nvrx_fs

        modules.append(nvrx_fs)
    return modules


def fix_orphaned_writer_manager() -> None:
    """J: dist_checkpointing's write-results queue lives in a spawned multiprocessing Manager.

    When a rank is SIGKILLed that Manager (and its resource tracker) outlive it forever,
    holding the rank's stdout/stderr and memory; launchers that restart ranks pile them up.
    From 0.19 on, async saves default to nvidia-resiliency-ext's writer (``async_strategy=
    "nvrx"``), which keeps a queue of its own (``J_NVRX_WRITER``). Both get a directory-backed
    queue instead (pretrain/platform/file_queue.py): no process to orphan, and no Manager to spawn,
    which took ~0.9 s of every (re)start here.
    """
    if not sys.platform.startswith("linux") or not call_site_fix_needed("J"):
        return
    modules = [m for m in _writer_queue_modules() if m._results_queue is None]
    if not modules:
        return
    results = FileQueue.create()
    owner = os.getpid()
    atexit.register(lambda: os.getpid() == owner and results.remove())
    for module in modules:
        module._results_queue = results


def route_shard_writer_open(open_fn: Callable[..., Any]) -> None:
    """Not a bug fix: megatron's shard writers call the builtin ``open`` through their module's
    globals; a name there shadows it, so every shard file a writer (thread, fork or spawned
    process that calls this) opens goes through ``open_fn`` (resiliency's checksumming stream).
    A megatron that opens files some other way bypasses it, and the commit reads files back."""
    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async.open = open_fn


@contextlib.contextmanager
def lean_writer_imports() -> Iterator[None]:
    """Not a bug fix: for the checkpoint writer process only, which runs megatron's write
    function and nothing else. Importing any megatron-core module runs ``megatron.core``'s
    package import, whose fused kernels are decorated with ``torch.compile`` (loading dynamo and
    inductor, 1.0 s of CPU here) and whose inference context imports ``wandb`` when installed
    (0.8 s); both of 5.2 s. Inside this block ``torch.compile`` returns the function unchanged
    and ``wandb`` is not found (megatron-core imports it optionally), so the writer is ready
    that much sooner. Both are restored on exit; the writer never calls a fused kernel."""
    compile_fn, hidden = torch.compile, sys.modules.get("wandb", _ABSENT)

    def no_compile(model: Any = None, **_: Any) -> Any:
        return model if model is not None else (lambda fn: fn)

    torch.compile = no_compile  # type: ignore[assignment]
    sys.modules["wandb"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.compile = compile_fn
        if hidden is _ABSENT:
            sys.modules.pop("wandb", None)
        else:
            sys.modules["wandb"] = hidden  # type: ignore[assignment]


_ABSENT = object()


@contextlib.contextmanager
def fully_reshardable_state_from(
    optimizer: Any,
    build: Callable[[Any, Any], Any] | None = None,
    build_for_load: Callable[[Any, Any], Any] | None = None,
) -> Iterator[None]:
    """Not a bug fix: while active, ``optimizer`` (a megatron DistributedOptimizer instance, not
    the class) builds its fully-reshardable state with ``build(model_sd, metadata)`` (save
    side) and ``build_for_load(model_sd, metadata)`` (load side; ``None`` from it: megatron's
    own) instead of its own gather / zero-filled buffers; the memory-efficient variant, and a
    side given no builder, keep megatron's path."""
    original = optimizer.sharded_param_state_fully_reshardable

    def sharded_param_state(
        model_sd: Any, is_loading: bool = False, metadata: dict | None = None
    ) -> Any:
        builder = build_for_load if is_loading else build
        if builder is None or (metadata or {}).get(
            "distrib_optim_fully_reshardable_mem_efficient", False
        ):
            return original(model_sd, is_loading=is_loading, metadata=metadata)
        built = builder(model_sd, metadata)
        if built is None:
            return original(model_sd, is_loading=is_loading, metadata=metadata)
        return built

    optimizer.sharded_param_state_fully_reshardable = sharded_param_state  # this instance only
    try:
        yield
    finally:
        del optimizer.sharded_param_state_fully_reshardable


@contextlib.contextmanager
def checkpoint_reader(make_reader: Callable[[Any], Any]) -> Iterator[None]:
    """Not a bug fix: while active, megatron's torch_dist load strategy reads the checkpoint
    through ``make_reader(checkpoint_dir)`` (a torch DCP ``StorageReader``) instead of the
    ``FileSystemReader`` it builds in ``strategies.torch._get_filesystem_reader`` (0.16 and 0.19
    both pick their reader there). A megatron without that function keeps its own reader; the
    loaded state is the same, only read more slowly."""
    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    original = getattr(torch_strategy, "_get_filesystem_reader", None)
    if original is None:
        log.info("megatron-core %s: restore reads through its own reader", mcore_version())
        yield
        return

    def reader(checkpoint_dir: Any, *_: Any, **__: Any) -> Any:
        return make_reader(checkpoint_dir)

    torch_strategy._get_filesystem_reader = reader
    try:
        yield
    finally:
        torch_strategy._get_filesystem_reader = original


# nvidia-resiliency-ext moved its straggler package (same Detector API) under attribution/ in 0.7.
NVRX_STRAGGLER_PACKAGE = {
    "0.4.": "nvidia_resiliency_ext.straggler",
    "0.7.": "nvidia_resiliency_ext.attribution.straggler",
}


def nvrx_straggler(submodule: str = "") -> Any:
    """nvrx's straggler package (or one of its submodules) for the installed nvrx release."""
    nvrx = version("nvidia-resiliency-ext")
    package = next(
        (p for v, p in NVRX_STRAGGLER_PACKAGE.items() if nvrx.startswith(v)),
        NVRX_STRAGGLER_PACKAGE["0.7."],
    )
    return importlib.import_module(f"{package}.{submodule}" if submodule else package)


# ---------------------------------------------------------------- M-O: checkpoint loads
def admitted_names(mcore: str | None = None) -> frozenset[str]:
    """The allow-list as the "module.qualname" strings torch's weights-only unpickler uses."""
    return frozenset(global_name(m, q) for m, q in admitted_globals(mcore or mcore_version()))


@functools.cache
def _admitted_objects(mcore: str) -> tuple[tuple[Any, str], ...]:
    """The listed globals torch's weights-only unpickler does not admit by default, for
    ``torch.serialization.safe_globals`` (only listed modules are imported, to resolve them)."""
    from torch import _weights_only_unpickler

    defaults = _weights_only_unpickler._get_allowed_globals()
    found = []
    for module, qualname in sorted(admitted_globals(mcore)):
        name = global_name(module, qualname)
        if name in defaults:
            continue
        try:
            obj = functools.reduce(getattr, qualname.split("."), importlib.import_module(module))
        except (ImportError, AttributeError):  # not on this stack: nothing to admit
            continue
        found.append((obj, name))
    return tuple(found)


def check_torch_archive(source: str | os.PathLike | IO[bytes], where: str) -> None:
    """A ``torch.save`` archive names admitted globals only, or UnsafeCheckpointError; read
    with torch's own zip reader and its weights-only unpickler's static GLOBAL scan (protocol
    2, what torch.save writes: an opcode it does not know is a refusal, not a guess)."""
    from torch import _weights_only_unpickler
    from torch import serialization as ser

    with ser._open_file_like(source, "rb") as opened:
        if not ser._is_zipfile(opened):
            raise UnsafeCheckpointError(f"checkpoint file {where} is not a torch zip archive")
        with ser._open_zipfile_reader(opened) as archive:
            if ser._is_torchscript_zip(archive):
                raise UnsafeCheckpointError(f"checkpoint file {where} is a TorchScript archive")
            data = archive.get_record("data.pkl")
    try:
        names = _weights_only_unpickler.get_globals_in_pkl(io.BytesIO(data))
    except (pickle.UnpicklingError, EOFError, ValueError) as exc:
        raise UnsafeCheckpointError(
            f"checkpoint file {where} is not a pickle torch's weights-only loader reads: {exc}"
        ) from exc
    refused = sorted(set(names) - admitted_names())
    if refused:
        raise UnsafeCheckpointError(refusal(where, refused[0]))


def safe_torch_load(
    source: str | os.PathLike | IO[bytes], where: str, map_location: Any = None
) -> Any:
    """``torch.load`` of checkpoint bytes: the archive's globals checked against the allow-list
    first, then loaded by torch's weights-only unpickler admitting those globals only."""
    check_torch_archive(source, where)
    if hasattr(source, "seek"):
        source.seek(0)
    with torch.serialization.safe_globals(list(_admitted_objects(mcore_version()))):
        return torch.load(source, map_location=map_location, weights_only=True)


class _RestrictedUnpickler(pickle.Unpickler):
    """For DCP's ``.metadata``: a protocol-4 pickle (STACK_GLOBAL, MEMOIZE, FRAME), which
    torch's weights-only unpickler (protocol 2 only) cannot read, so Python's documented way
    to restrict globals is used instead: ``find_class`` resolves listed names only (EXT codes
    and INST go through it too), and nothing else of the file can call anything."""

    def __init__(self, file: IO[bytes], where: str) -> None:
        super().__init__(file)
        self._where, self._admitted = where, admitted_globals(mcore_version())

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._admitted:
            raise UnsafeCheckpointError(refusal(self._where, global_name(module, name)))
        return super().find_class(module, name)


class _MetadataPickle:
    """Stands in for ``pickle`` in torch DCP's filesystem module, whose only ``pickle.load`` is
    ``FileSystemReader.read_metadata`` (every DCP reader's, megatron's and nvrx's included);
    ``pickle.dump`` and the rest are pickle's own."""

    def __getattr__(self, name: str) -> Any:
        return getattr(pickle, name)

    @staticmethod
    def load(file: IO[bytes], **_: Any) -> Any:
        return _RestrictedUnpickler(file, str(getattr(file, "name", ".metadata"))).load()


def _restrict_dcp_metadata() -> None:
    from torch.distributed.checkpoint import filesystem

    filesystem.pickle = _MetadataPickle()  # type: ignore[assignment]


def _restrict_dcp_bytes() -> None:
    from torch.distributed.checkpoint import default_planner

    planner = default_planner.DefaultLoadPlanner
    original = planner.load_bytes

    @functools.wraps(original)
    def load_bytes(self: Any, read_item: Any, value: io.BytesIO) -> None:
        # torch's own body, with its torch.load(value, weights_only=False) made safe
        fqn = read_item.dest_index.fqn
        loaded = safe_torch_load(value, f".distcp item {fqn!r}")
        if self.flatten_state_dict:
            default_planner.set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded

    planner.load_bytes = load_bytes


def _safe_common_load(original: Callable[..., Any], file_name: str) -> Callable[..., Any]:
    @functools.wraps(original)
    def load_common(*args: Any) -> Any:
        path = os.path.join(str(args[-1]), file_name)  # (self,) checkpoint_dir
        if not os.path.isfile(path):
            return original(*args)  # megatron's own missing-file error
        return safe_torch_load(path, path, map_location="cpu")

    return load_common


def _restrict_common_pt() -> None:
    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies import common

    if hasattr(common, "TorchCommonLoadStrategy"):  # 0.16: a strategy method
        strategy = common.TorchCommonLoadStrategy
        strategy.load_common = _safe_common_load(strategy.load_common, common.COMMON_STATE_FNAME)
    if hasattr(serialization, "load_common"):  # 0.19: the legacy common.pt reader
        safe = _safe_common_load(serialization.load_common, common.COMMON_STATE_FNAME)
        serialization.load_common = common.load_common = safe


@dataclass(frozen=True)
class SafeLoad:
    """A third-party load of checkpoint bytes that would run what the file names, restricted
    to the allow-list (``MCORE_RECIPES_COMPAT_SKIP`` leaves it out, as for the fixes)."""

    name: str
    unsafe: str  # what the load does without it (measured: tests/integration/test_safe_load.py)
    apply: Callable[[], None]
    affected: tuple[str, ...]  # megatron-core version prefixes measured to load this way


SAFE_LOADS: tuple[SafeLoad, ...] = (
    SafeLoad(
        "M",
        "torch DCP's FileSystemReader.read_metadata pickle.loads model/.metadata: any global "
        "it names is imported and called (every restore, and our commit's loadability check)",
        _restrict_dcp_metadata,
        BOTH,
    ),
    SafeLoad(
        "N",
        "torch DCP's DefaultLoadPlanner.load_bytes torch.loads each byte item with "
        "weights_only=False: megatron's sharded objects, and 0.19's common state (its "
        "weights_only=True load after it is never reached)",
        _restrict_dcp_bytes,
        BOTH,
    ),
    SafeLoad(
        "O",
        "megatron's common.pt load (0.16: TorchCommonLoadStrategy.load_common; 0.19: the "
        "legacy load_common) leaves weights_only unset: torch's default admits megatron's own "
        "add_safe_globals list too, and TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 admits anything",
        _restrict_common_pt,
        BOTH,
    ),
)
_restricted: list[str] = []


def restrict_checkpoint_loads(mcore: str | None = None) -> list[str]:
    """Apply, once, the load restrictions M-O (not skipped); returns the names applied."""
    if _restricted:
        return list(_restricted)
    mcore = mcore or mcore_version()
    for entry in SAFE_LOADS:
        if entry.name not in skipped() and mcore.startswith(entry.affected):
            entry.apply()
            _restricted.append(entry.name)
    return list(_restricted)


FIXES: tuple[Fix, ...] = (
    Fix(
        "F",
        "sharded_state_dict(is_loading=True) on a never-stepped torch Adam asserts len(steps) == 1",
        _fix_f,
        BOTH,
    ),
    Fix(
        "G",
        "loading copies the pre-load 'step' over the restored one: KeyError for "
        "fully_reshardable, a silently reset Adam step for dp_reshardable",
        _fix_g,
        BOTH,
    ),
    Fix(
        "H",
        "load_parameter_state_from_dp_reshardable runs in-place ops on leaf views outside no_grad",
        _fix_h,
        BOTH,
    ),
    Fix(
        "I",
        "load_state_dict shares one 'step' tensor across params, so each resumed step "
        "adds n_params to it (silently wrong bias correction)",
        _fix_i,
        BOTH,
    ),
)


@dataclass(frozen=True)
class CallSiteFix:
    """A fix that needs objects of the run (model chunks, the writer modules, the config), so
    it is applied where they exist (``where``) instead of by :func:`apply`."""

    name: str
    bug: str
    affected: tuple[str, ...]  # megatron-core version prefixes measured to have the bug
    where: str


CALL_SITE_FIXES: tuple[CallSiteFix, ...] = (
    CallSiteFix(
        "J",
        "dist_checkpointing's write-results queue is a spawned Manager that "
        "outlives a SIGKILLed rank",
        J_AFFECTED,
        "Checkpointer.__init__ -> fix_orphaned_writer_manager()",
    ),
    CallSiteFix(
        "K",
        "vpp>1 + tied embeddings + distributed optimizer: fully_reshardable saves "
        "a corrupt embedding optimizer state (refused, not patched)",
        K_AFFECTED,
        "CheckpointHook.configure -> vpp_tied_embedding_save_problem()",
    ),
    CallSiteFix(
        "L",
        "a model built without initialisation has no tensor-parallel attributes "
        "on its TP weights (grad-norm clipping double counts them)",
        L_AFFECTED,
        "build_components -> fix_uninitialised_tp_attributes()",
    ),
)


def call_site_fix_needed(name: str, mcore: str | None = None) -> bool:
    """Whether call-site fix ``name`` applies to this megatron-core (and is not skipped)."""
    entry = next(f for f in CALL_SITE_FIXES if f.name == name)
    return name not in skipped() and (mcore or mcore_version()).startswith(entry.affected)


_applied: list[str] = []


def is_affected(fix: str, mcore: str, have_fused_adam: bool) -> bool:
    """Whether fix F-I applies: a measured-affected release on the torch-Adam fallback."""
    entry = next(f for f in FIXES if f.name == fix)
    return mcore.startswith(entry.affected) and not have_fused_adam


def needed_fixes(mcore: str | None = None, have_fused_adam: bool | None = None) -> list[str]:
    if mcore is None:
        mcore = mcore_version()
    if have_fused_adam is None:
        # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
        from megatron.core.optimizer import distrib_optimizer

        have_fused_adam = bool(distrib_optimizer.HAVE_APEX_OR_TE)
    return [f.name for f in FIXES if is_affected(f.name, mcore, have_fused_adam)]


def skipped() -> set[str]:
    return {n for n in os.environ.get(SKIP_ENV, "").split(",") if n}


def apply() -> list[str]:
    """Apply, once, the fixes this megatron-core needs; returns the names applied. The load
    restrictions M-O are applied too (:func:`restrict_checkpoint_loads` says which)."""
    restrict_checkpoint_loads()
    if _applied:
        return list(_applied)
    mcore = mcore_version()
    if not mcore.startswith(SUPPORTED_MCORE):
        log.warning(
            "megatron-core %s is not a supported release (%s): no compat fix applied",
            mcore,
            ", ".join(f"{p}x" for p in SUPPORTED_MCORE),
        )
    wanted = set(needed_fixes(mcore)) - skipped()
    if not wanted:
        return []
    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for fix in FIXES:
        if fix.name in wanted:
            fix.apply(DistributedOptimizer)
            _applied.append(fix.name)
    return list(_applied)
