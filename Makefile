# Two entry points on a fresh machine: `make pretrain` and `make test`.
# PY picks the stack: 3.11 (default) -> .venv with megatron-core 0.16.1 + nvrx 0.4.1;
# PY=3.12 -> .venv312 with megatron-core 0.19.x + nvrx 0.7.x (pyproject's python_version markers).
PY ?= 3.11
PY_VERSION := $(patsubst python%,%,$(PY))
PYTHON ?= $(or $(wildcard $(shell pyenv prefix $(PY_VERSION) 2>/dev/null)/bin/python$(PY_VERSION)),python$(PY_VERSION))
VENV ?= $(if $(filter 3.11,$(PY_VERSION)),.venv,.venv$(subst .,,$(PY_VERSION)))
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0
NPROC ?= 2
RUN_ID ?= gpt_tiny-$(shell date +%Y%m%d-%H%M%S)
CORPUS := data/stdlib_text_document.bin
BPE_CORPUS := data/stdlib-bpe_text_document.bin
PYTEST_ARGS ?=

.PHONY: install pretrain test test-all lint corpus clean image

install: $(STAMP)

# torch goes first and pinned, so resolving the rest never pulls a multi-GB CUDA build
# (on 3.11 the local +cpu wheel; on 3.12 PyPI's build, which runs on CPU, ~2.9 GB).
# nvrx 0.7 is on PyPI only as manylinux_2_39 wheels; on an older glibc (Debian 12: 2.36) pip
# rejects the tag although the wheel's one extension (the GPU-only CUPTI module) needs
# GLIBC_2.32, so the wheel is fetched for its own tag and installed retagged.
NVRX_CURRENT := nvidia-resiliency-ext>=0.7.0,<0.8
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==$(TORCH_VERSION)
	@if [ "$(PY_VERSION)" != 3.11 ] && ! $(BIN)/pip install -q '$(NVRX_CURRENT)' >/dev/null 2>&1; then \
	  echo "nvrx: no wheel for this glibc; installing the manylinux_2_39 wheel retagged"; \
	  rm -rf $(VENV)/wheels; \
	  $(BIN)/pip download -q --no-deps --only-binary=:all: --platform manylinux_2_39_$(shell uname -m) \
	    --python-version $(PY_VERSION) -d $(VENV)/wheels '$(NVRX_CURRENT)' && \
	  for w in $(VENV)/wheels/*-manylinux_2_39_*.whl; do mv "$$w" "$${w%-manylinux_2_39_*}-linux_$(shell uname -m).whl"; done && \
	  $(BIN)/pip install -q $(VENV)/wheels/*.whl; \
	fi
	$(BIN)/pip install -q -e '.[test]'
	touch $@

corpus: $(CORPUS) $(BPE_CORPUS)

$(CORPUS): | $(STAMP)
	$(BIN)/python -m pretrain.data.prepare --stdlib --output-prefix data/stdlib

# The same corpus with an 8k byte-level BPE tokenizer trained on it (data=stdlib_bpe).
$(BPE_CORPUS): | $(STAMP)
	$(BIN)/python -m pretrain.data.prepare --stdlib --output-prefix data/stdlib-bpe \
		--train-tokenizer 8192 --tokenizer-path tokenizers/stdlib-bpe

pretrain: $(STAMP) $(CORPUS) $(BPE_CORPUS)
	OMP_NUM_THREADS=1 $(BIN)/python -m launch.torchrun --standalone --nproc-per-node $(NPROC) -m pretrain \
		recipe=gpt_tiny_bpe run_id=$(RUN_ID) $(ARGS)
	$(BIN)/python -m resiliency ls runs/$(RUN_ID)

# The unit tests run on $(WORKERS) pytest-xdist workers, a file per worker (a module's
# fixtures are built once). So do the integration tests (multi-rank jobs, faults timed from
# outside): a job keeps about 70 % of this machine's cores busy while it launches, meets its
# peers and waits on I/O, timeouts or Slurm. Those in SERIAL_TESTS time what they test (a
# detection within its goal, a lease's expiry, an upload within its interval, faults at
# drawn moments) and run alone, last. Any phase may select nothing (pytest's exit 5) as long
# as another ran: a filter that matches nothing at all still fails. A failing phase does not
# stop the later ones; make exits with the first failure's code. PYTEST_ARGS naming test
# paths (make test PYTEST_ARGS=tests/unit/...) runs just those, in one plain pytest.
WORKERS ?= 2
PYTEST := OMP_NUM_THREADS=1 $(BIN)/python -m pytest
PARALLEL := -n $(WORKERS) --dist loadfile
SERIAL_TESTS := $(patsubst %,tests/integration/test_%.py,straggler fencing elastic \
	soak_outside ft hangs remote_faults standby)
TEST_PATHS := $(filter tests% ./tests% %.py,$(PYTEST_ARGS))
test: $(STAMP)
ifneq ($(TEST_PATHS),)
	$(PYTEST) $(PYTEST_ARGS)
else
	@ran=0; failed=0; for phase in \
	  "$(PARALLEL) tests/unit" \
	  "$(PARALLEL) tests/integration $(addprefix --ignore=,$(SERIAL_TESTS))" \
	  "$(SERIAL_TESTS)"; do \
	  code=0; $(PYTEST) $$phase $(PYTEST_ARGS) || code=$$?; \
	  if [ $$code = 0 ]; then ran=1; elif [ $$code != 5 ] && [ $$failed = 0 ]; then failed=$$code; fi; \
	done; \
	if [ $$failed != 0 ]; then exit $$failed; fi; \
	if [ $$ran = 0 ]; then exit 5; fi
endif

# Everything, the exhaustive tests too (matrix remainders, random-stop repeats): ~10 min more.
test-all: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -m "slow or not slow" $(PYTEST_ARGS)

# ruff (lint + format) and import-linter's layer contracts (pyproject.toml [tool.importlinter]).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

# The training image (Dockerfile: this package installed on NVIDIA's PyTorch container). The
# build records the commit in the image; the image id it prints is what jobs record as
# MCORE_RECIPES_IMAGE_DIGEST (give launch.slurm.container_image / launch.k8s.image the pushed
# name@digest). Without a Docker daemon here it prints the command to run where there is one.
IMAGE ?= mcore-recipes
image:
	@commit=$$(git rev-parse HEAD)$$(git diff --quiet HEAD -- || echo -dirty); \
	tag=$(IMAGE):$$(git rev-parse --short=12 HEAD); \
	echo "docker build --build-arg CODE_COMMIT=$$commit -t $$tag ."; \
	if docker info >/dev/null 2>&1; then \
		docker build --build-arg CODE_COMMIT=$$commit -t $$tag . && \
		docker image inspect --format '{{.Id}}' $$tag; \
	else echo "no Docker daemon here: run the command above where one is"; fi

clean:
	rm -rf $(VENV) data runs .pytest_cache

# P1-P5 as ratios to this machine's limits (docs/benchmarks.md); BENCH_ARGS=--full adds the
# 1.5 GiB-state model and hang detection (~15 min).
.PHONY: bench
bench: $(STAMP)
	$(BIN)/python -m bench $(BENCH_ARGS)

# The prepared GPU check (docs/running.md, "GPU check"): one CUDA GPU, the PyPI (CUDA) torch of the 3.12
# stack plus Transformer Engine; bf16 (+ fp8 where supported) on gpt_125m, 50 steps with
# validation, a checkpoint, a SIGKILL and an exact resume; prints tokens/s, TFLOP/s and MFU.
.PHONY: gpu-smoke
gpu-smoke:
	$(MAKE) install PY=3.12
	.venv312/bin/python -c "import transformer_engine" 2>/dev/null || \
	  .venv312/bin/pip install -q --no-build-isolation 'transformer-engine[pytorch]'
	.venv312/bin/python -m bench.gpu_smoke $(ARGS)

# The air-gapped GPU node (docs/running.md, "GPU check"): `make gpu-wheels` here, where PyPI is,
# fetches the cp312 wheels of every runtime dependency the node lacks into .whl (git-ignored)
# and checks they and the tree fit in 60 MiB; on the node, with its own python3 and torch:
#   python3 -m bench.gpu_check --wheels .whl        (JSON and logs into $$OUT or --out)
# `make gpu-check-dry` runs every section of that check at toy size on this CPU (~1 min).
.PHONY: gpu-wheels gpu-check-dry
gpu-wheels: $(STAMP)
	$(BIN)/python -m bench.gpu_wheels

gpu-check-dry:
	$(MAKE) install PY=3.12
	.venv312/bin/python -m bench.gpu_check --dry-run
