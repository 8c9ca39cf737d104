"""Can this node's environment run the job? ``python -m launch.slurm.preflight --gpus N
[--need-te[=WHY]]``, run once per node by a GPU job's batch script before anything else.

It checks that torch imports and is a CUDA build, that it sees at least N GPUs, and, where the
recipe needs it (``--need-te``: context parallelism, FP8, TP communication overlap), that
Transformer Engine imports. Each problem is one line naming the node; exit 2 (CONFIG_ERROR)
when there is any, 0 with one ``ok`` line otherwise. A failure is the environment's, not the
node's: the batch script stops the job with exit 2 instead of training or requeueing.
"""

from __future__ import annotations

import argparse
import socket
import sys
import warnings

from pretrain.context import exit_codes


def problems(
    *,
    gpus: int,
    need_te: str | None,
    torch_error: str | None = None,
    torch_version: str | None = None,
    cuda_version: str | None = None,
    device_count: int = 0,
    te_error: str | None = None,
) -> list[str]:
    """What keeps this environment from running the job, one line each (empty: nothing).

    ``gpus``: the GPUs each node's ranks need (launch.gpus_per_node); ``need_te``: why the
    recipe needs Transformer Engine (None: it does not); ``torch_error``: why torch did not
    import (None: it did, at ``torch_version`` built for CUDA ``cuda_version``, None for a CPU
    build, seeing ``device_count`` GPUs); ``te_error``: why Transformer Engine did not import
    (None: it did, or it was not tried)."""
    found = []
    if torch_error is not None:
        found.append(f"torch does not import ({torch_error}): the job needs a CUDA build of torch")
    elif cuda_version is None:
        found.append(
            f"torch {torch_version} is not a CUDA build (torch.version.cuda is None): the job "
            "needs a CUDA build of torch"
        )
    elif device_count < gpus:
        found.append(
            f"torch (CUDA {cuda_version}) sees {device_count} GPU(s), the job needs {gpus} "
            "(launch.gpus_per_node)"
        )
    if need_te is not None and te_error is not None:
        found.append(f"Transformer Engine does not import ({te_error}): {need_te} needs it")
    return found


def _facts(need_te: bool) -> dict[str, object]:
    """The environment's answers, importing torch (and Transformer Engine) here."""
    facts: dict[str, object] = {}
    # The imports' own warnings (torch's pynvml FutureWarning, ...) say nothing about whether
    # the job can run: the job's log gets one line per problem and nothing else.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            import torch
        except Exception as exc:  # noqa: BLE001 - any failure to import is the answer
            facts["torch_error"] = _one_line(exc)
        else:
            facts["torch_version"] = torch.__version__
            facts["cuda_version"] = torch.version.cuda
            if torch.version.cuda is not None:
                facts["device_count"] = torch.cuda.device_count()
        if need_te:
            try:
                import transformer_engine.pytorch  # noqa: F401 - what megatron-core's spec uses
            except Exception as exc:  # noqa: BLE001 - an ABI mismatch raises more than ImportError
                facts["te_error"] = _one_line(exc)
    return facts


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.slurm.preflight", description=__doc__)
    parser.add_argument("--gpus", type=int, required=True, help="GPUs each node needs")
    parser.add_argument(
        "--need-te",
        nargs="?",
        const="the recipe",
        metavar="WHY",
        help="Transformer Engine must import; WHY names the settings that need it",
    )
    args = parser.parse_args(argv)
    facts = _facts(args.need_te is not None)
    host = socket.gethostname()
    found = problems(gpus=args.gpus, need_te=args.need_te, **facts)  # type: ignore[arg-type]
    for problem in found:
        print(f"preflight on {host}: {problem}", file=sys.stderr, flush=True)
    if found:
        return exit_codes.CONFIG_ERROR
    te = ", Transformer Engine imports" if args.need_te is not None else ""
    print(
        f"preflight on {host}: ok: torch {facts['torch_version']} (CUDA {facts['cuda_version']}), "
        f"{facts['device_count']} GPU(s){te}",
        flush=True,
    )
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())
