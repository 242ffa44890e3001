# `make demo` and `make test` set everything up themselves (idempotent) and then run.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Pinned so CPU-only machines take the local CPU wheel instead of the multi-GB CUDA stack.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install demo demo-search demo-search-tools demo-safe demo-vision test bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	DS_BUILD_OPS=0 $(BIN)/pip install -q --no-build-isolation -c constraints.txt 'deepspeed>=0.15'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/alignrl demo

demo-search: $(STAMP)
	$(BIN)/alignrl demo search

demo-search-tools: $(STAMP)
	$(BIN)/alignrl demo search --tool-loop

demo-safe: $(STAMP)
	$(BIN)/alignrl demo safe

demo-vision: $(STAMP)
	$(BIN)/alignrl demo vision

# Two pytest processes share the tests (a test file each at a time) and the cores; their OpenMP threads sleep
# while they wait instead of spinning, which would starve the other process's. Tests that time fractions of a
# second (marked serial) run alone afterwards. The package is byte-compiled first: where PYTHONDONTWRITEBYTECODE is
# set, every process the tests start (ranks, samplers, services, Ray workers) would compile it again, about half a
# second of CPU each here.
test: $(STAMP)
	$(BIN)/python -m compileall -q src
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder \
		-m "not serial" --durations=25
	$(BIN)/python -m pytest -m serial

bench: $(STAMP)
	$(BIN)/pip install -q -c constraints.txt -e '.[bench]'
	$(BIN)/python benchmarks/grpo_vs_trl.py

clean:
	rm -rf $(VENV) output
