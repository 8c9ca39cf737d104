#!/usr/bin/env bash
# Install mcore-recipes (not editable) into a Python that already has torch: the Dockerfile's
# one install step, and what tests/integration/test_image.py runs in a fresh venv where Docker is absent.
#   docker/install.sh [CODE_COMMIT]      (PYTHON=... picks the interpreter; default python)
# The base image's own builds of torch and Transformer Engine are kept: NGC's torch is a
# pre-release build (2.6.0a0+...) that pip would otherwise "upgrade" from PyPI to a CPU wheel.
set -euo pipefail
commit=${1:-unknown}
here=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python}
req=$(mktemp)
trap 'rm -f "$req"' EXIT
# pyproject's dependencies and the k8s and hf extras, all but torch (environment markers kept)
"$python" - "$here/pyproject.toml" > "$req" <<'PY'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
extras = project["optional-dependencies"]
wanted = project["dependencies"] + extras["k8s"] + extras["hf"]
print("\n".join(d for d in wanted if not d.replace(" ", "").startswith("torch")))
PY
"$python" -m pip install --no-cache-dir --quiet -r "$req"
# The package itself from this tree, not its dependencies again (they are in place above).
"$python" -m pip install --no-cache-dir --quiet --no-deps --no-build-isolation \
    --ignore-installed "$here"
# Provenance: the commit the image was built from (resiliency.storage.manifest.code_commit).
site=$(cd / && "$python" -c 'import pathlib, resiliency; print(pathlib.Path(resiliency.__file__).parent)')
echo "$commit" > "$site/BUILD_COMMIT"
# Smoke: the CLIs import from the installed package, away from any checkout.
(cd / && "$python" -m pretrain --help > /dev/null && "$python" -m launch --help > /dev/null)
echo "installed mcore-recipes ($commit) into $("$python" -c 'import sys; print(sys.prefix)')"
