"""The files a run reads and the directory it writes, checked before any process starts.

A missing data prefix found by the ranks costs a torchrun start, a process group and two
tracebacks; found here it is one line naming the path and the nearest file that exists.
"""

from __future__ import annotations

import difflib
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

from recipes.checks import ConfigError
from recipes.config.run import RunConfig


class DataInputError(ConfigError):
    """A data prefix or tokenizer file the run needs does not exist (exit 9, DATA)."""


def check_inputs(run: RunConfig, check_output: bool = True) -> None:
    """DataInputError for missing data or tokenizer files; ConfigError for an output dir that
    cannot be written. Paths are checked as this process sees them."""
    data = run.data
    if data.kind == "indexed":
        for prefix in data.paths:
            _check_prefix(prefix)
    if data.tokenizer_path and not Path(data.tokenizer_path).exists():
        raise DataInputError(
            f"data.tokenizer_path={data.tokenizer_path}: not found{_nearest(data.tokenizer_path)}"
        )
    if check_output:
        check_writable(Path(run.output_dir), "output_dir")


def signing_key(name: str | None, environ: Mapping[str, str] | None = None) -> bytes | None:
    """The key in ``$name`` (checkpoint.signing_key_env); None when no variable is named. Named
    but unset or empty is a ConfigError: a run asked to sign must never save or trust unsigned
    steps. Checked by every rank at start, before any model is built."""
    if not name:
        return None
    env = os.environ if environ is None else environ
    value = env.get(name, "")
    if not value:
        state = "empty" if name in env else "not set"
        raise ConfigError(
            f"checkpoint.signing_key_env={name}: ${name} is {state} in this process's "
            "environment. Set it, with the same key, on every rank (and for `python -m "
            "resiliency verify --signing-key-env`), or drop checkpoint.signing_key_env to "
            "save and restore without signatures"
        )
    return value.encode()


def check_environment(run: RunConfig) -> None:
    """What the run needs from its environment: the signing key, when one is named."""
    if run.checkpoint.enabled:
        signing_key(run.checkpoint.signing_key_env)


def _check_prefix(prefix: str) -> None:
    missing = [prefix + s for s in (".bin", ".idx") if not Path(prefix + s).is_file()]
    if not missing:
        return
    raise DataInputError(
        f"data.paths: {prefix!r} is not a dataset prefix ({' and '.join(missing)} not "
        f"found){_nearest_prefix(prefix)}; build one with `python -m pretrain.data.prepare`"
    )


def _nearest_prefix(prefix: str) -> str:
    """The dataset in the same directory the user most likely meant (megatron names them
    <name>_text_document, so 'out/mine' usually means 'out/mine_text_document')."""
    path = Path(prefix)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        return _nearest(str(parent), what="directory")
    found = sorted(
        str(parent / p.stem) if str(path.parent) != "." else p.stem
        for p in parent.glob("*.bin")
        if p.with_suffix(".idx").is_file()
    )
    starts = [f for f in found if Path(f).name.startswith(path.name)]
    close = starts or difflib.get_close_matches(prefix, found, n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else ""


def _nearest(path: str, what: str = "path") -> str:
    """The closest existing sibling of ``path`` (or its nearest existing parent)."""
    probe = Path(path)
    while not probe.parent.exists() and probe.parent != probe:
        probe = probe.parent
    parent = probe.parent
    if probe == Path(path) and parent.is_dir():
        names = [p.name for p in parent.iterdir()]
        close = difflib.get_close_matches(probe.name, names, n=1, cutoff=0.6)
        if close:
            return f"; did you mean {str(parent / close[0])!r}?"
    return f" ({what}: nearest existing parent is {str(parent)!r})"


def existing_ancestor(path: Path) -> Path:
    """``path`` itself if it exists, else its nearest existing parent (a dir a run creates
    later is judged by the one it will be created in)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable(directory: Path, key: str) -> None:
    """The nearest existing ancestor of ``directory`` accepts a file: the run can create it."""
    probe = existing_ancestor(directory)
    if not probe.is_dir():
        raise ConfigError(f"{key}={directory}: {probe} exists and is not a directory")
    try:
        with tempfile.NamedTemporaryFile(dir=probe, prefix=".write-check-"):
            pass
    except OSError as exc:
        user = os.environ.get("USER") or os.getuid()
        raise ConfigError(
            f"{key}={directory}: cannot write in {probe} as {user} ({exc.strerror}); "
            "choose a writable directory"
        ) from None
