"""Every manifest records the commit its code ran from: found from the repo root of a real git
clone (not a directory beside the package), with -dirty when tracked files were edited."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO

PRINT_COMMIT = "from resiliency.storage.manifest import code_commit; print(code_commit())"


def _commit_seen_by(clone: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k != "MCORE_RECIPES_CODE_COMMIT"}
    env["PYTHONPATH"] = str(clone)
    out = subprocess.run([sys.executable, "-c", PRINT_COMMIT], cwd=clone / "launch", env=env,
                         capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    return out.stdout.strip()


def test_the_commit_comes_from_the_clone_and_says_dirty(tmp_path: Path) -> None:
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(clone)], check=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip
    assert _commit_seen_by(clone) == head
    readme = clone / "README.md"
    readme.write_text(readme.read_text() + "\nedited\n")
    assert _commit_seen_by(clone) == f"{head}-dirty"
    (clone / "untracked.txt").write_text("not part of the code")
    readme.write_text(readme.read_text().removesuffix("\nedited\n"))
    assert _commit_seen_by(clone) == head  # untracked files do not count
