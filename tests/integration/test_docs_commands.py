"""The commands README.md and docs/ print run as printed, and their links resolve.

Every line of a ```bash block that starts with `.venv/bin/python -m ` or `make` is a command.
The cheap ones (CHEAP: help, config views, the capacity planner, the launchers' dry runs; each a
second or two) are run from the repo root with this interpreter and must exit 0; a dry run
gets `output_dir=` under tmp_path and renders into a folder under it (TMPDIR), so nothing is
written into the checkout. Every other one must name a module that exists (and, for
`python -m resiliency` and `python -m launch`, one of their subcommands) or a target of the
Makefile.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import REPO

PYTHON = ".venv/bin/python"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
# Run as printed: matched against the words after `python -m`.
CHEAP = (
    r"^\S+( [a-z0-9]+)? --help$",
    r"^pretrain( |$).*--(show-keys|cfg|info)\b",
    r"^resiliency (capacity|plan) ",
    r"^launch (slurm|k8s) (.* )?--dry-run\b",
)
DRY_RUN = re.compile(r"^launch (slurm|k8s) ")
FENCE = re.compile(r"^```(\w*)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@dataclass(frozen=True)
class Command:
    where: str  # file:line of its first line
    text: str  # as printed, continuation lines joined, the comment dropped

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.text, comments=True)

    @property
    def module_args(self) -> str:
        """`pretrain --help` for `.venv/bin/python -m pretrain --help`; "" for make."""
        argv = self.argv
        return " ".join(argv[2:]) if argv[:2] == [PYTHON, "-m"] else ""


def bash_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, line) of every line inside a ```bash block, continuations joined."""
    lines, out, in_bash, pending = path.read_text().splitlines(), [], False, None
    for number, line in enumerate(lines, 1):
        fence = FENCE.match(line)
        if fence:
            in_bash = not in_bash and fence.group(1) == "bash"
            continue
        if not in_bash:
            continue
        start, text = pending or (number, "")
        text += line.rstrip().removesuffix("\\").rstrip() + " "
        pending = (start, text) if line.rstrip().endswith("\\") else None
        if pending is None:
            out.append((start, " ".join(text.split())))
    return out


def doc_commands() -> list[Command]:
    """Every command of README.md and docs/, each text once (its first occurrence)."""
    seen: dict[str, Command] = {}
    for path in DOCS:
        for number, text in bash_lines(path):
            if text.startswith(f"{PYTHON} -m ") or re.match(r"make( |$)", text):
                where = f"{path.relative_to(REPO)}:{number}"
                command = Command(where, shlex.join(shlex.split(text, comments=True)))
                seen.setdefault(command.text, command)
    return list(seen.values())


def is_cheap(command: Command) -> bool:
    return any(re.search(pattern, command.module_args) for pattern in CHEAP)


COMMANDS = doc_commands()
CHEAP_COMMANDS = [c for c in COMMANDS if is_cheap(c)]
OTHER_COMMANDS = [c for c in COMMANDS if not is_cheap(c)]


def test_the_docs_print_commands_of_both_kinds() -> None:
    assert len(CHEAP_COMMANDS) >= 10, [c.text for c in CHEAP_COMMANDS]
    assert {"make pretrain", "make test"} <= {c.text for c in COMMANDS}


def runnable(command: Command, tmp_path: Path) -> list[str]:
    """The command with this interpreter; a dry run writes under tmp_path."""
    argv = [sys.executable, *command.argv[1:]]
    if DRY_RUN.match(command.module_args):
        argv = [a for a in argv if not a.startswith("output_dir=")]
        argv.append(f"output_dir={tmp_path / 'runs'}")
    return argv


@pytest.mark.parametrize("command", CHEAP_COMMANDS, ids=lambda c: c.where)
def test_a_cheap_command_runs_as_printed(command: Command, tmp_path: Path) -> None:
    # TMPDIR: where a dry run without --out renders
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp_path)}
    proc = subprocess.run(runnable(command, tmp_path), cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, f"{command.where}: {command.text}\n{proc.stderr[-3000:]}"


def make_targets() -> set[str]:
    text = (REPO / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w-]*):", text, re.M))


def subcommands(module: str) -> set[str] | None:
    """The first words `python -m <module>` accepts, where it has subcommands we can list."""
    if module == "resiliency":
        from resiliency.cli import load_commands

        return {*load_commands(), "soak"}
    if module == "launch":
        from launch.__main__ import BACKENDS

        return set(BACKENDS)
    return None


def problem(command: Command) -> str | None:
    """Why the command names nothing real; None when it does."""
    argv = command.argv
    if argv[0] == "make":
        words = [a for a in argv[1:] if "=" not in a and not a.startswith("-")]
        missing = set(words) - make_targets()
        return f"no make target {sorted(missing)}" if missing else None
    module, rest = argv[2], [a for a in argv[3:] if not a.startswith("-")]
    if importlib.util.find_spec(module) is None:
        return f"no module {module}"
    known = subcommands(module)
    if known is not None and (not rest or rest[0] not in known):
        return f"python -m {module}: {rest[:1]} is not one of {sorted(known)}"
    return None


@pytest.mark.parametrize("command", OTHER_COMMANDS, ids=lambda c: c.where)
def test_every_other_command_names_a_real_module_or_target(command: Command) -> None:
    assert problem(command) is None, f"{command.where}: {command.text}: {problem(command)}"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    in_code = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            in_code = not in_code
        elif not in_code and (m := re.match(r"#+ (.*)", line)):
            base = slug(m.group(1))
            anchor, n = base, 0
            while anchor in found:  # a repeated heading gets -1, -2, ...
                n += 1
                anchor = f"{base}-{n}"
            found.add(anchor)
    return found


def links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # not links inside code
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_internal_links_resolve(path: Path) -> None:
    broken = []
    for target in links(path):
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading with anchor #{anchor}")
    assert not broken, broken
