"""The update's fixed cost per forward/backward pass: how each compile scope spends host time.

A model of SmolLM2-135M's depth (30 layers) but width 32 and a 256-token vocabulary does almost
no arithmetic, so an update of it takes what the framework costs per layer and per pass: Python,
dispatch, autograd nodes, the compiled graphs' guards and wrappers. For the real model on a GPU
that cost is what the device waits on whenever it outruns the host (on the H200 the update took
about 60 ms per extra pass, whatever the pass's size). Measured here for the same update split into
1 or 4 passes (``microbatch_size``), with

* ``eager``: the decoder as transformers runs it;
* ``layers``: each layer compiled (``--compile-scope layers``, the default on CUDA);
* ``decoder``: the whole decoder as one compiled graph (``--compile-scope decoder``).

The per-pass cost is the difference between the 4-pass and the 1-pass update, over 3; the two
are timed alternately in one process, so that both see the same load on the machine. Each
variant runs in a fresh process (compiled graphs and caches do not carry over).

    python benchmarks/update_host.py                 # CPU, one thread
    python benchmarks/update_host.py --device cuda
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from provenance import check_device, provenance_line

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("eager", "layers", "decoder")


def measure(variant: str, device: str, repeats: int, batch: int, seq: int, layers: int) -> dict:
    """One variant's update of ``batch`` samples in 1 pass and in 4, timed alternately in this
    process (so that both see the same machine), median of ``repeats`` each."""
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(ROOT))
    from rftgym.train.batching import TrainSample
    from rftgym.train.config import TrainConfig
    from rftgym.train.update import optimise
    from rftgym.train.speed import SpeedConfig, apply_training_speedups, make_optimizer

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=256, max_position_embeddings=2 * seq,
                         tie_word_embeddings=True)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    speed = None if variant == "eager" else SpeedConfig(compile_scope=variant)
    applied = apply_training_speedups(model, speed) if speed else {}
    rng = np.random.default_rng(0)
    prompt = seq // 3
    samples = [TrainSample(rng.integers(3, 256, size=seq).tolist(), [0] * prompt + [1] * (seq - prompt),
                           [0.0] * prompt + (-rng.random(seq - prompt)).tolist(),
                           [0.0] * prompt + [float(rng.normal())] * (seq - prompt), i // 8, i % 8)
               for i in range(batch)]
    configs = {passes: TrainConfig(minibatch_size=batch, microbatch_size=batch // passes if passes > 1 else 0,
                                   max_new_tokens=seq - prompt) for passes in (1, 4)}
    optimizer = make_optimizer(model.parameters(), lr=1e-5, fused=speed is not None)
    generator = torch.Generator().manual_seed(0)
    model.train()

    def update(passes: int) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        optimise(model, None, optimizer, samples, configs[passes], 0, generator)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started

    warmup = sum(update(passes) for passes in (1, 4, 1, 4))  # compiles for both batch sizes
    times: dict[int, list[float]] = {1: [], 4: []}
    for _ in range(repeats):
        for passes in (1, 4):
            times[passes].append(update(passes))
    return {"variant": variant, "one_pass_s": float(np.median(times[1])), "four_passes_s": float(np.median(times[4])),
            "warmup_s": warmup, "applied": applied}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--batch", type=int, default=8, help="samples per update (a multiple of 4)")
    parser.add_argument("--seq", type=int, default=24, help="tokens per sample")
    parser.add_argument("--layers", type=int, default=30, help="decoder layers (SmolLM2-135M has 30)")
    parser.add_argument("--repeats", type=int, default=15, help="timed updates per setting (median)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one variant
    args = parser.parse_args()
    check_device(parser, args.device)
    if args.batch % 4 or args.batch < 4:
        parser.error(f"--batch must be a positive multiple of 4 (it is split into 4 passes), got {args.batch}")
    variants = [v for v in args.variants.split(",") if v]
    if set(variants) - set(VARIANTS):
        parser.error(f"unknown variants {sorted(set(variants) - set(VARIANTS))}; choose from {', '.join(VARIANTS)}")
    if not args.one:
        print(provenance_line(), flush=True)
    if args.one:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(measure(args.one, args.device, args.repeats, args.batch, args.seq, args.layers)))
        return
    rows = []
    for variant in variants:
        command = [sys.executable, __file__, "--one", variant, "--device", args.device, "--batch", str(args.batch),
                   "--seq", str(args.seq), "--layers", str(args.layers), "--repeats", str(args.repeats),
                   "--threads", str(args.threads)]
        done = subprocess.run(command, check=False, capture_output=True, text=True)
        if done.returncode:
            print(f"{variant} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
            continue
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    print(f"\nUpdate of {args.batch} x {args.seq} tokens, {args.layers} layers of width 32 ({args.device}, "
          f"{args.threads} thread(s)); median of {args.repeats}, 1 and 4 passes timed alternately:")
    print(f"  {'variant':10} {'1 pass s':>9} {'4 passes s':>11} {'per extra pass ms':>18} {'first 4 updates s':>18}")
    for row in rows:
        per_pass = (row["four_passes_s"] - row["one_pass_s"]) / 3 * 1000
        print(f"  {row['variant']:10} {row['one_pass_s']:9.4f} {row['four_passes_s']:11.4f} {per_pass:18.1f} "
              f"{row['warmup_s']:18.1f}")
    print(json.dumps({"device": args.device, **{row["variant"]: {k: row[k] for k in ("one_pass_s", "four_passes_s")}
                                                for row in rows}}))
    failed = [v for v in variants if v not in {row["variant"] for row in rows}]
    if failed:  # (said on stderr above, each with its error)
        sys.exit(f"update_host: {len(failed)} of {len(variants)} variants failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
