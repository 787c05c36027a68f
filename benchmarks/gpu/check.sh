#!/usr/bin/env bash
# The GPU checks, on a machine with a CUDA GPU and a CUDA PyTorch but no internet access: the
# repository with .whl/ and .devcarry/ beside it (made by benchmarks/gpu/prepare.sh). Prints the
# CUDA-only tests' result, then benchmarks/trainer_gpu.py's table (rftgym's GRPO step against
# TRL's GRPOTrainer, the update alone in several variants, and a profile of the default update:
# device time by kind of kernel and how busy the device was). Where $OUT names a folder, the
# whole log is written there too. At most about 11 minutes (the tests' and the benchmark's
# timeouts); the saved full run (2026-11-29) took 117 s of benchmark on one H200, the quick one
# (2026-11-30) 70 s and 18 s of tests.
#
#   bash benchmarks/gpu/check.sh                # all of it
#   bash benchmarks/gpu/check.sh --quick        # the tests and the update variants only (no TRL)
#   bash benchmarks/gpu/check.sh --quick ARGS   # ARGS passed on to trainer_gpu.py
set -uo pipefail
cd "$(dirname "$0")/../.."
log=${OUT:-/tmp}/gpu-check.log
exec > >(tee "$log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/rftgym-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
ls .whl/*.whl >/dev/null 2>&1 || { echo ".whl/ is missing (run benchmarks/gpu/prepare.sh here first)"; exit 2; }
[ -f .devcarry/tokenizer/tokenizer.json ] || { echo ".devcarry/tokenizer is missing (run benchmarks/gpu/prepare.sh)"; exit 2; }
pip_install() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/rftgym-site "$@"; }
# All at once; where that fails (a wheel for another Python: prepare.sh fetches them for 3.12 on
# x86-64), one by one, so that what this Python can use still installs and the tests still run.
if ! pip_install .whl/*.whl 2>/dev/null; then
  for wheel in .whl/*.whl; do
    pip_install "$wheel" 2>/dev/null || echo "NOTE: $(basename "$wheel") does not install on $(python3 -V) here"
  done
fi
nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu --format=csv || true
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
# These are GPU checks: without CUDA the CUDA tests skip themselves and the benchmark would run on the CPU.
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
  echo "no CUDA device is usable by this torch here: these checks need one (see nvidia-smi above)"; exit 2; }
python3 -c "import accelerate" 2>/dev/null || echo "NOTE: accelerate is not installed here: the TRL phase (its GRPOTrainer needs it) will report an error"
[ "${1:-}" = "--quick" ] || python3 -c "import trl, datasets" 2>/dev/null || \
  echo "NOTE: trl or datasets does not import here (python3 -c 'import trl, datasets' says why): the TRL phase will fail"

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
# The default update is profiled unless ARGS choose the variants (it must be among them).
case " $* " in *" --update-variants"*) profile=() ;; *) profile=(--profile-variants compiled+ckpt_mlp) ;; esac
timeout -k 20 420 python3 benchmarks/trainer_gpu.py --device cuda "${args[@]}" "${profile[@]}" "$@"
bench=$?
echo "benchmark rc=$bench"
# The log says which part failed; the exit status says that one did.
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
