"""One update over samples of varied length, padded rows against packed rows, side by side.

A GRPO step's samples differ in length: prompts of different sizes, replies from a few tokens to
the ``max_new_tokens`` cap. Padded rows (``rftgym.train.batching.collate``, what TRL's
GRPOTrainer does by default) compute every row at the longest sample's length; packed rows
(``--pack-sequences``, :mod:`rftgym.train.packing`) place samples one after another. This times
``rftgym.train.update.optimise`` both ways on the same samples and the same initial weights, and
checks that both give the same loss.

With ``--pass-samples N`` it also times gradient accumulation two ways at about the same
activation memory: N samples per forward/backward pass (``--microbatch-size``), against passes
of at most N x the longest sample's tokens (``--microbatch-tokens``, verl's dynamic batch size),
padded and packed.

The model is SmolLM2-135M-Instruct's architecture (random weights: the time does not depend on
them), with ``--layers`` decoder layers. Sample lengths are drawn (seeded): prompt 60-140 tokens,
reply 8-``new-tokens`` tokens, a quarter of the replies cut at the cap.

    python benchmarks/packing.py                     # CPU: 16 samples, 6 layers
    python benchmarks/packing.py --pass-samples 4    # and gradient accumulation by samples / tokens
    python benchmarks/packing.py --device cuda --samples 64 --layers 0
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rftgym.train.batching import TrainSample, collate  # noqa: E402
from rftgym.train.config import TrainConfig  # noqa: E402
from rftgym.train.update import microbatches, optimise  # noqa: E402
from rftgym.train.packing import collate_packed  # noqa: E402
from rftgym.train.speed import SpeedConfig, apply_training_speedups, make_optimizer  # noqa: E402
from provenance import check_device, provenance_line  # noqa: E402


def make_model(args):
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer_gpu import default_tokenizer_dir  # the carried config on a machine without the GGUF

    config = AutoConfig.from_pretrained(default_tokenizer_dir())
    if args.layers:
        config.num_hidden_layers = args.layers
    torch.manual_seed(0)
    with torch.device(args.device):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def make_samples(args, vocab: int) -> list[TrainSample]:
    rng = np.random.default_rng(args.seed)
    noise = np.random.default_rng(args.seed + 1)  # apart, so that the lengths do not depend on it
    samples = []
    for index in range(args.samples):
        prompt = int(rng.integers(60, 141))
        reply = args.new_tokens if rng.random() < 0.25 else int(rng.integers(8, args.new_tokens + 1))
        ids = rng.integers(3, vocab, size=prompt + reply).tolist()
        # Old log-probs near the random model's own (about -log vocab), so that ratios sit inside
        # the clip range and the compared loss depends on every log-prob the update computes.
        old = (-math.log(vocab) + noise.normal(0.0, 0.1, reply)).tolist()
        samples.append(TrainSample(ids, [0] * prompt + [1] * reply, [0.0] * prompt + old,
                                   [0.0] * prompt + [float(noise.normal())] * reply, index // 8, index % 8))
    return samples


def timed_updates(args, model, samples, options: dict) -> dict:
    on_cuda = args.device == "cuda"
    model = copy.deepcopy(model)
    if on_cuda:
        apply_training_speedups(model, SpeedConfig(checkpoint_mlp=True))
    model.train()
    config = TrainConfig(minibatch_size=len(samples), max_new_tokens=args.new_tokens, group_size=8, kl_coef=0.0,
                         learning_rate=1e-6, **options)
    optimizer = make_optimizer(model.parameters(), lr=1e-6)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if on_cuda else nullcontext

    def update():
        return optimise(model, None, optimizer, samples, config, 0, torch.Generator().manual_seed(0), None, autocast)

    def sync():
        if on_cuda:
            torch.cuda.synchronize()

    first = update()  # warm-up (compilation on CUDA); its loss is compared across the two layouts
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.repeats):
        sync()
        started = time.perf_counter()
        update()
        sync()
        times.append(time.perf_counter() - started)
    passes = microbatches(samples, config)
    shapes = [(collate_packed(part, 0) if config.pack_sequences else collate(part, 0))["input_ids"].shape
              for part in passes]
    return {"update_s": float(np.median(times)), "passes": len(passes), "rows": sum(r for r, _ in shapes),
            "largest_pass": max(r * w for r, w in shapes), "positions": sum(r * w for r, w in shapes),
            "first_loss": first["loss"], "peak_gb": torch.cuda.max_memory_allocated() / 2**30 if on_cuda else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6, help="decoder layers (0: the model's 30)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pass-samples", type=int, default=0,
                        help="also time gradient accumulation: N samples per pass against a token budget of N x "
                             "the longest sample")
    args = parser.parse_args()
    check_device(parser, args.device)
    print(provenance_line(), flush=True)

    model = make_model(args)
    samples = make_samples(args, model.config.vocab_size)
    tokens = sum(len(s.token_ids) for s in samples)
    variants = {"padded": {}, "packed": {"pack_sequences": True}}
    if args.pass_samples:
        budget = args.pass_samples * max(len(s.token_ids) for s in samples)
        variants.update({
            f"padded, {args.pass_samples} per pass": {"microbatch_size": args.pass_samples},
            f"padded, <= {budget} tokens per pass": {"microbatch_tokens": budget},
            f"packed, <= {budget} tokens per pass": {"microbatch_tokens": budget, "pack_sequences": True},
        })
    results = {name: timed_updates(args, model, samples, options) for name, options in variants.items()}
    print(f"device: {args.device}  torch {torch.__version__}  layers {model.config.num_hidden_layers}  "
          f"{args.samples} samples, {tokens} tokens, lengths {min(len(s.token_ids) for s in samples)}-"
          f"{max(len(s.token_ids) for s in samples)}")
    name_width = max(len(name) for name in results) + 2
    print(f"{'layout':<{name_width}}{'update s':>9}{'passes':>8}{'rows':>6}{'largest pass':>14}{'positions':>11}"
          f"{'padding':>9}{'peak GiB':>9}  first loss")
    for name, r in results.items():
        peak = "-" if r["peak_gb"] is None else f"{r['peak_gb']:.2f}"
        print(f"{name:<{name_width}}{r['update_s']:>9.3f}{r['passes']:>8}{r['rows']:>6}{r['largest_pass']:>14}"
              f"{r['positions']:>11}{1 - tokens / r['positions']:>9.1%}{peak:>9}  {r['first_loss']:.6f}")
    speedup = results["padded"]["update_s"] / results["packed"]["update_s"]
    same = all(abs(r["first_loss"] - results["padded"]["first_loss"]) < 1e-4 for r in results.values())
    print(f"packed / padded: {speedup:.2f}x faster; same loss in every layout: {same}")
    if args.pass_samples:
        by_count = results[f"padded, {args.pass_samples} per pass"]["update_s"]
        print("by tokens / by samples per pass: " + ", ".join(
            f"{name.split(',')[0]} {by_count / r['update_s']:.2f}x faster"
            for name, r in results.items() if "tokens" in name))
    print(json.dumps({"device": args.device, "tokens": tokens, "speedup": speedup, **results}))


if __name__ == "__main__":
    main()
