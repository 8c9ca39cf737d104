# Two entry points on a fresh machine: `make pretrain` and `make test`.
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0
NPROC ?= 2
RUN_ID ?= gpt_tiny-$(shell date +%Y%m%d-%H%M%S)
CORPUS := data/stdlib_text_document.bin
PYTEST_ARGS ?=

.PHONY: install pretrain test corpus clean

install: $(STAMP)

# torch goes first and pinned, so resolving the rest never pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==$(TORCH_VERSION)
	$(BIN)/pip install -q -e '.[test]'
	touch $@

corpus: $(CORPUS)

$(CORPUS): | $(STAMP)
	$(BIN)/python -m pretrain.prepare --stdlib --output-prefix data/stdlib

pretrain: $(STAMP) $(CORPUS)
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc-per-node $(NPROC) -m pretrain \
		recipe=gpt_tiny run_id=$(RUN_ID) $(ARGS)
	$(BIN)/python -m resiliency ls runs/$(RUN_ID)

test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) data runs .pytest_cache

# P1-P5 as ratios to this machine's limits (README "Benchmarks"); BENCH_ARGS=--full adds the
# 1.5 GiB-state model and hang detection (~15 min).
.PHONY: bench
bench: $(STAMP)
	$(BIN)/python -m bench $(BENCH_ARGS)
