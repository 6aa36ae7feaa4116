# Two commands matter on a fresh machine: `make demo` and `make test`.
# Each sets up what it needs (venv, torch 2.13.0, Mooncake, the extension build).
VENV ?= .venv
PY := $(VENV)/bin/python
SOURCES := $(shell find csrc -type f) setup.py

.PHONY: setup setup-vllm setup-sglang test-setup main-env vllm-demo build test test-quick test-vllm test-sglang test-full test-gpu demo bench cuda-check npu-check wheel-check clean

setup: $(VENV)/.ready

$(VENV)/.ready: scripts/setup_env.sh requirements-dev.txt
	VENV=$(VENV) bash scripts/setup_env.sh

build: setup torch_kvops/.built

# vLLM (~3.4 GB) only for the tests and the vLLM example, not for `make demo`.
setup-vllm: $(VENV)/.vllm-ready

$(VENV)/.vllm-ready: $(VENV)/.ready scripts/setup_vllm.sh requirements-vllm.txt constraints-vllm.txt
	VENV=$(VENV) bash scripts/setup_vllm.sh

# SGLang (~6 GB, torch 2.14.1) in its own environment, with a built copy of torch_kvops:
# for the SGLang plugin's tests. Rebuilt when the package or the extension changes.
SGLANG_VENV ?= .venv-sglang
PACKAGE := $(shell find torch_kvops -name '*.py' -not -path '*/__pycache__/*') pyproject.toml

setup-sglang: $(SGLANG_VENV)/.ready

$(SGLANG_VENV)/.ready: scripts/setup_sglang.sh requirements-sglang.txt $(SOURCES) $(PACKAGE)
	SGLANG_VENV=$(SGLANG_VENV) bash scripts/setup_sglang.sh

torch_kvops/.built: $(SOURCES) $(VENV)/.ready
	MAX_JOBS=2 bash scripts/phase.sh "the extension, built in place (torch_kvops/_C*.so)" \
		$(PY) setup.py -q build_ext --inplace
	touch $@

# The main environment (extension, then vLLM: its pip run must not change what the build
# compiles against) and SGLang's share nothing, and most of each is waiting on the
# package registry: set up side by side, they take about as long as the longer one.
test-setup:
	$(MAKE) -j2 main-env setup-sglang

main-env: build
	$(MAKE) setup-vllm

# The test tiers (docs/testing.md; which modules: tests/tiers.py, from each module's
# markers). Each runs its modules on 2 workers (pytest-xdist; tests/module_scheduler.py
# keeps big fleets apart), then those marked `alone` with nothing beside them. The
# module lists are named, so a run collects only its own modules.
TIER = $(PY) tests/tiers.py
define run_tier
	@modules="$$($(TIER) $(1))" && test -n "$$modules" || { echo "tier $(1): no modules (tests/tiers.py)"; exit 1; }; \
	echo "[test-$(1)] $$(echo $$modules | wc -w) modules on 2 workers"; \
	$(PY) -m pytest -q -n 2 --dist loadscope $$modules
	@alone="$$($(TIER) $(1) --alone)" || exit 1; \
	if [ -n "$$alone" ]; then echo "[test-$(1)] alone: $$alone"; $(PY) -m pytest -q $$alone; fi
endef

# the gate: README's test command and what CI runs (.ci/run)
test: test-setup
	$(call run_tier,gate)

# every unit and process module in the main environment (no fleet, namespace or
# compiler): what a contributor runs every few minutes
test-quick: main-env
	$(call run_tier,quick)

# every module of one engine, and every module of all (today's whole suite)
test-vllm: main-env
	$(call run_tier,vllm)

test-sglang: test-setup
	$(call run_tier,sglang)

test-full: test-setup
	$(call run_tier,full)

# GPU-only tests; run where a CUDA device exists (not in CI: CI has no GPU).
test-gpu: build
	$(PY) -m pytest -q tests_gpu

demo: build
	$(PY) -m torch_kvops.demo

bench: build
	$(PY) -m torch_kvops.bench

# P/D disaggregation with two vLLM engines and KvopsLayerwiseConnector (docs/vllm.md).
vllm-demo: build setup-vllm
	$(PY) examples/vllm_disagg.py

# Compiles and links the CUDA backend against the CUDA build of torch on a CPU-only machine.
cuda-check: setup
	VENV=$(VENV) bash scripts/check_cuda_build.sh

# Compiles and links the Ascend NPU backend against the real torch_npu wheel (no CANN, no
# NPU): -Werror, --no-undefined, ACL symbols linked only where torch_npu links them too.
npu-check: setup
	VENV=$(VENV) bash scripts/check_npu_build.sh

# Builds the wheel, installs it into a clean venv and uses the installed package (~2 min).
wheel-check: setup
	VENV=$(VENV) bash scripts/check_wheel.sh

clean:
	rm -rf build torch_kvops/_C*.so torch_kvops/.built
