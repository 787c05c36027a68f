#!/usr/bin/env bash
# Prepares the GPU checks (benchmarks/gpu/check.sh) for a GPU machine without internet access.
# Run here, in the repository root, with the project's venv set up (make setup). It writes two
# git-ignored folders, to be copied beside the repository there (`du -sh` at the end says their
# size):
#
#   .whl/               Python 3.12 x86-64 wheels of what such a machine may lack: gymnasium
#                       (rftgym's own dependency), gguf, pytest (the CUDA-only tests) and TRL with
#                       the datasets packages it needs (the peer of benchmarks/trainer_gpu.py);
#                       accelerate, which TRL also needs, is taken to be there (check.sh says if not)
#   .devcarry/tokenizer SmolLM2-135M-Instruct's tokenizer files and config.json, read from the
#                       GGUF file: the benchmarks use its architecture with random weights, so
#                       the 98 MB weights need not travel
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
rm -rf .whl .devcarry/tokenizer
mkdir -p .whl .devcarry
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1; do
  platforms+=(--platform "${tag}_x86_64")
done
installed() { "$PYTHON" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
# gymnasium and gguf at the versions the tests here ran with; TRL at the version the README's
# table names. --no-deps: each wheel's own needs are either on a CUDA PyTorch image (numpy,
# pyyaml, tqdm, pyarrow, pandas, xxhash, fsspec, cloudpickle, ...) or named here.
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d .whl \
  "gymnasium==$(installed gymnasium)" "farama-notifications==$(installed farama-notifications)" \
  "gguf==$(installed gguf)" trl==1.16.0 datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18 \
  "pytest==$(installed pytest)" "pluggy==$(installed pluggy)" "iniconfig==$(installed iniconfig)" \
  "pygments==$(installed pygments)"
"$PYTHON" - <<'PY'
import shutil
from pathlib import Path

from rftgym.agents.model_loading import default_model_dir

source = default_model_dir()  # the GGUF file converted once (cached)
out = Path(".devcarry/tokenizer")
out.mkdir()
for path in source.iterdir():
    if path.is_file() and path.suffix not in (".safetensors", ".bin") and path.name != "rftgym_source.json":
        shutil.copy(path, out / path.name)
print("tokenizer and config:", " ".join(sorted(p.name for p in out.iterdir())))
PY
du -sh .whl .devcarry
