# The README's two commands: `make run` and `make test`. Each installs what it needs.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test lint bench-models bench-cache bench-miss bench-workload bench-faults bench-redis-scale bench-triton bench-remote soak clean setup \
	triton-repository triton-serve

$(STAMP): requirements.txt requirements-dev.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch/torchvision come from this machine's local index (pinned in requirements.txt).
	$(PY) -m pip install --quiet -r requirements-dev.txt
	@touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	@scripts/ensure_system_deps.sh --optional redis-server
	$(PY) app.py

test: $(STAMP)
	@scripts/ensure_system_deps.sh redis-server redis-tools chromium postgresql nginx prometheus kubernetes-client
	$(VENV)/bin/ruff check .
	$(PY) -m pytest

# 30 minutes (SOAK_MINUTES=1 for a short run); the report goes to stdout and test-artifacts/soak.txt.
soak: $(STAMP)
	@scripts/ensure_system_deps.sh redis-server
	$(PY) -m pytest -m soak -s tests/test_soak.py

bench-models: $(STAMP)
	$(PY) -m bench.models

bench-cache: $(STAMP)
	@scripts/ensure_system_deps.sh redis-server
	$(PY) -m bench.cache

bench-miss: $(STAMP)
	@scripts/ensure_system_deps.sh redis-server
	$(PY) -m bench.miss_overhead

# About an hour on 2 CPUs; writes bench/REPORT.md and bench/workload_chart.html.
bench-workload: $(STAMP)
	@scripts/ensure_system_deps.sh redis-server
	$(PY) -m bench.workload --http

# About 8 minutes on 2 CPUs; figures go to docs/RELIABILITY.md by hand.
bench-faults: $(STAMP)
	@scripts/ensure_system_deps.sh redis-server redis-tools
	$(PY) -m faults

# One Redis node against a 3-primary cluster and a Sentinel-managed primary (about 2 minutes).
bench-redis-scale: $(STAMP)
	@scripts/ensure_system_deps.sh redis-server redis-tools
	$(PY) -m bench.redis_scale

# A cached REST hit against NVIDIA Triton's response cache (about 2 minutes; the first run also
# makes .venv-triton with nvidia-pytriton from PyPI, scripts/triton_venv.sh).
bench-triton: $(STAMP)
	$(PY) -m bench.triton_peer

# Two replicas in front of one Triton server (their models remote) against the same two with local
# models and against Triton's own response cache, one Zipf stream (a few minutes; needs
# redis-server, and makes .venv-triton on first use).
bench-remote: $(STAMP)
	@scripts/ensure_system_deps.sh redis-server
	$(PY) -m bench.remote

# The served models as a Triton/KServe model repository (MODELS_CONFIG's, or the built-ins): ONNX
# graphs, config.pbtxt with dynamic batching and this app's model versions (docs/REMOTE.md).
triton-repository: $(STAMP)
	@test -n "$(DIR)" || { echo "usage: make triton-repository DIR=<folder>" >&2; exit 2; }
	$(PY) -m serving.repository "$(DIR)"

# A real tritonserver (nvidia-pytriton's, CPU) serving that repository: HTTP on PORT, gRPC on
# PORT+1, metrics on PORT+2 (PORT: 8000 unless given), on every interface, until Ctrl-C. The first
# run makes .venv-triton.
triton-serve:
	@test -n "$(DIR)" || { echo "usage: make triton-serve DIR=<folder> [PORT=8000]" >&2; exit 2; }
	@set -o pipefail; python=$$(scripts/triton_venv.sh | tail -n 1) && \
	exec "$$python" serving/triton_serve.py --repository "$(DIR)" --http-port $(or $(PORT),8000) --address 0.0.0.0

clean:
	rm -rf $(VENV) .venv-triton .pytest_cache .ruff_cache test-artifacts
