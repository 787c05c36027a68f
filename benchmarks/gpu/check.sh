#!/usr/bin/env bash
# The GPU checks, on a machine with a CUDA GPU and a CUDA PyTorch but no internet access: the
# repository with .whl/ and .devcarry/ beside it (made by benchmarks/gpu/prepare.sh). Prints the
# CUDA-only tests' result, then benchmarks/trainer_gpu.py's table (rftgym's GRPO step against
# TRL's GRPOTrainer, the update alone in several variants, and a profile of the default update:
# device time by kind of kernel and how busy the device was). Where $OUT names a folder, the
# whole log is written there too. At most about 11 minutes (the tests' and the benchmark's
# timeouts); the last full run took about 6 on one H200.
#
#   bash benchmarks/gpu/check.sh                # all of it
#   bash benchmarks/gpu/check.sh --quick        # the tests and the update variants only (no TRL)
#   bash benchmarks/gpu/check.sh --quick ARGS   # ARGS passed on to trainer_gpu.py
set -uo pipefail
cd "$(dirname "$0")/../.."
log=${OUT:-/tmp}/gpu-check.log
exec > >(tee "$log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/rftgym-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/rftgym-site .whl/*.whl || { echo "could not install .whl/: prepare.sh fetches it for Python 3.12 on x86-64 (run it first)"; exit 2; }
[ -f .devcarry/tokenizer/tokenizer.json ] || { echo ".devcarry/tokenizer is missing (run benchmarks/gpu/prepare.sh)"; exit 2; }
nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu --format=csv || true
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
python3 -c "import accelerate" 2>/dev/null || echo "NOTE: accelerate is not installed here: the TRL phase (its GRPOTrainer needs it) will report an error"

echo "# CUDA-only tests"
timeout 240 python3 -m pytest -q -p no:cacheprovider -rs -k cuda \
  tests/agents/test_fast_decode.py tests/train/test_host_sync.py tests/train/test_token_logprobs.py \
  tests/train/test_speed.py
tests=$?
echo "pytest rc=$tests"

echo "# benchmarks/trainer_gpu.py"
args=()
if [ "${1:-}" = "--quick" ]; then
  shift
  args=(--peers none --steps 2 --update-variants eager,compiled+ckpt_mlp,bf16+compiled+ckpt_mlp,decoder+ckpt_mlp,decoder+cudagraphs,compiled+autotune)
fi
timeout -k 20 420 python3 benchmarks/trainer_gpu.py "${args[@]}" --profile-variants compiled+ckpt_mlp "$@"
bench=$?
echo "benchmark rc=$bench"
# The log says which part failed; the exit status says that one did.
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
