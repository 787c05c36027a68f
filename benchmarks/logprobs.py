"""Token log-probs + entropy, forward and backward, three ways side by side.

The update computes ``log softmax(hidden @ W.T / T)[target]`` and the entropy for every trained
token. This times one forward + backward of that computation (gradients for the hidden states and
the output weight, from a loss on both outputs) at SmolLM2-135M's sizes (hidden 576, vocabulary
49152):

* ``rftgym fused``: :func:`rftgym.train.token_logprobs.chunked_token_logprobs` (fused linear +
  log-softmax autograd function, elementwise passes compiled on CUDA);
* ``checkpointed chunks``: the same chunks through plain autograd, each under
  ``torch.utils.checkpoint`` (what rftgym used before; the backward re-runs the whole chunk);
* ``full logits``: ``log_softmax`` over the whole ``[tokens, vocab]`` logits at once (the plain
  approach, e.g. a causal-LM forward followed by a gather).

Each method runs in its own subprocess so that its peak memory (CUDA: ``max_memory_allocated``;
CPU: the process's peak RSS above its baseline) is its own.

    python benchmarks/logprobs.py                      # CPU: 2048 tokens, float32
    python benchmarks/logprobs.py --device cuda        # 24576 tokens (64 x 384), bf16 autocast
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rftgym.train.token_logprobs import chunked_token_logprobs
from provenance import check_device, provenance_line

METHODS = ("rftgym fused", "checkpointed chunks", "full logits")


def _plain_chunk(hidden, weight, targets, temperature):
    logits = (hidden @ weight.t()).float() / temperature
    logprobs = F.log_softmax(logits, dim=-1)
    token = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return token, -(logprobs.exp() * logprobs).sum(-1)


def checkpointed_chunks(hidden, weight, targets, temperature, chunk_size):
    flat_h, flat_t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    parts = [checkpoint(_plain_chunk, h, weight, t, temperature, use_reentrant=False, preserve_rng_state=False)
             for h, t in zip(torch.split(flat_h, chunk_size), torch.split(flat_t, chunk_size))]
    return torch.cat([p[0] for p in parts]).view(targets.shape), torch.cat([p[1] for p in parts]).view(targets.shape)


def full_logits(hidden, weight, targets, temperature, chunk_size):
    return _plain_chunk(hidden, weight, targets, temperature)


def fused(hidden, weight, targets, temperature, chunk_size):
    return chunked_token_logprobs(hidden, weight, targets, temperature=temperature, chunk_size=chunk_size,
                                  with_entropy=True)


def run_one(args) -> dict:
    """One method, in this process: warm-up, then the median of ``args.repeats`` timed runs."""
    function = {"rftgym fused": fused, "checkpointed chunks": checkpointed_chunks, "full logits": full_logits}[args.method]
    device = torch.device(args.device)
    torch.manual_seed(0)
    hidden = torch.randn(1, args.tokens, args.hidden, device=device) * 0.5  # the layout does not matter here
    weight = (torch.randn(args.vocab, args.hidden, device=device) * 0.05).requires_grad_(True)
    targets = torch.randint(0, args.vocab, hidden.shape[:2], device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step():
        h = hidden.detach().requires_grad_(True)
        with autocast:
            logp, entropy = function(h, weight, targets, 1.0, args.chunk_size)
        (logp.sum() + 0.01 * entropy.sum()).backward()
        weight.grad = None

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    baseline_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step()  # warm-up (compilation on CUDA)
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - started)
    if device.type == "cuda":
        peak_gb = torch.cuda.max_memory_allocated() / 1e9
    else:
        peak_gb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline_kb) / 1e6
    tokens = hidden.shape[0] * hidden.shape[1]
    # three [tokens x hidden x vocab] matmuls: forward logits, and the two gradient products
    flops = 3 * 2 * tokens * args.hidden * args.vocab
    seconds = sorted(times)[len(times) // 2]
    return {"method": args.method, "tokens": tokens, "seconds": seconds, "tflops": flops / seconds / 1e12,
            "peak_gb": peak_gb}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=None, help="default: 24576 on CUDA, 2048 on CPU")
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--method", choices=METHODS, help="run one method in this process (used internally)")
    args = parser.parse_args()
    check_device(parser, args.device)
    if args.tokens is None:
        args.tokens = 24576 if args.device.startswith("cuda") else 2048
    if args.method:
        print(json.dumps(run_one(args)))
        return
    print(provenance_line(), flush=True)

    rows = []
    for method in METHODS:
        command = [sys.executable, __file__, "--method", method, "--device", args.device, "--tokens", str(args.tokens),
                   "--hidden", str(args.hidden), "--vocab", str(args.vocab), "--chunk-size", str(args.chunk_size),
                   "--repeats", str(args.repeats)]
        done = subprocess.run(command, check=False, capture_output=True, text=True)
        if done.returncode:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            rows.append({"method": method, "error": last})
        else:
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"token log-probs + entropy, forward + backward: {args.tokens} tokens, hidden {args.hidden}, "
          f"vocab {args.vocab}, chunk {args.chunk_size}, {args.device}"
          f"{' (bf16 autocast)' if args.device.startswith('cuda') else ' (float32)'}; median of {args.repeats}")
    print(f"  {'method':22}{'seconds':>9}{'TFLOP/s':>9}{'peak GB':>9}")
    for row in rows:
        if "error" in row:
            print(f"  {row['method']:22}failed: {row['error']}")
        else:
            print(f"  {row['method']:22}{row['seconds']:9.3f}{row['tflops']:9.2f}{row['peak_gb']:9.2f}")
    fused_row = rows[0]
    for row in rows[1:]:
        if "error" not in row and "error" not in fused_row:
            print(f"  {row['method']} against rftgym fused: {row['seconds'] / fused_row['seconds']:.2f}x the time, "
                  f"{row['peak_gb'] / max(fused_row['peak_gb'], 1e-9):.2f}x the peak memory")
    print(json.dumps({row["method"]: {k: v for k, v in row.items() if k != "method"} for row in rows}))


if __name__ == "__main__":
    main()
