# Every target installs what it needs on a fresh machine: `.venv` at the repository root,
# torch pinned to the CPU build where no NVIDIA GPU is present, the project with its dev
# extra. The stamp file re-runs the install when the dependency lists change.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL ?= builtin:tiny
PORT ?= 8000
PYTEST_ARGS ?=

.PHONY: install serve test bench bench-quick bench-gpu bench-batch bench-capacity lint calibrate clean

install: $(STAMP)

$(STAMP): pyproject.toml requirements-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then \
		$(PY) -m pip install --quiet -e '.[dev,gpu]'; \
	else \
		$(PY) -m pip install --quiet -r requirements-cpu.txt && \
		$(PY) -m pip install --quiet -e '.[dev]'; \
	fi
	touch $(STAMP)

serve: $(STAMP)
	$(PY) -m cluster.serve --model '$(MODEL)' --port $(PORT)

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks.run

bench-quick: $(STAMP)
	$(PY) -m benchmarks.run --quick

# The GPU table (benchmarks/gpu_bench.py): `.venv/bin/python -m benchmarks.gpu_bench`. Only
# where no venv can be installed (a GPU machine without network) with the system Python,
# once torch is there: `python3 -m benchmarks.gpu_bench` (benchmarks/README.md).
bench-gpu: $(STAMP)
	$(PY) -m benchmarks.gpu_bench

# The policies benchmark with 100 requests per capacity trial, so that each trial's P99
# rests on enough requests (benchmarks/results/capacity/; ~20 min on 2 cores, too long
# for make bench, whose capacity trials use 12).
bench-capacity: $(STAMP)
	$(PY) -m benchmarks.policies_bench --capacity-requests 100 --name capacity \
		--out-dir benchmarks/results/capacity

# Batch throughput through `ray job submit` vs LocalEngine vs transformers static batching
# (benchmarks/results/batch.json); starts and stops its own Ray head. NUM ?= 2000 requests.
bench-batch: $(STAMP)
	$(PY) -m benchmarks.batch_bench --num-requests $(or $(NUM),2000)

lint: $(STAMP)
	$(VENV)/bin/ruff check cluster controller workers kvcache tests benchmarks

# Writes budget.json (budget.png beside it); an existing one is kept unless FORCE=1.
calibrate: $(STAMP)
	$(PY) -m cluster.cli calibrate --model '$(MODEL)' --out budget.json $(if $(FORCE),--force)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
