"""Worker: ``python -m pretrain --plan`` for several recipes in one process (one megatron-core
import). argv: OUT.json, then cases as ``name|vocab|override override ...``; writes
{name: plan JSON}."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

warnings.simplefilter("ignore")


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from pretrain.fit.cli import as_json, make_plan

    out, results = Path(sys.argv[1]), {}
    for case in sys.argv[2:]:
        name, vocab, overrides = case.split("|")
        plan = make_plan(overrides.split(), vocab=int(vocab) if vocab else None)
        results[name] = json.loads(as_json(plan))
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
