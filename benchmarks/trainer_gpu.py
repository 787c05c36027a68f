"""One GRPO step of rftgym against TRL's GRPOTrainer on the same architecture, side by side.

The model is SmolLM2-135M-Instruct's architecture with random weights (throughput does not
depend on the weights) and its real tokenizer, read from a local directory. Every step is
``prompts x samples`` completions of exactly ``new-tokens`` tokens (end-of-turn is ignored by both
tools), sampled at temperature 1, then one optimizer step over all of them.

Phases, each guarded so that one failure still leaves the others' numbers:

1. decode: decode steps/s of rftgym's fast path (static KV cache, one CUDA graph per step), of
   rftgym's generic transformers loop, and of plain ``model.generate``;
2. ours: whole GRPO steps (generate -> rewards/advantages -> update through
   ``rftgym.train.update.optimise``), the first (warm-up: graph capture, compilation) excluded;
3. trl: ``GRPOTrainer`` steps, the first excluded, its ``generate`` calls timed separately;
4. update-only: ``optimise`` at a fixed batch (default 64 x 384 tokens) for several speed settings;
   ``--profile-variants`` profiles one more update of the named ones (device time by kind of
   kernel, how busy the device was, the top kernels), to show where the time goes.

Both trainers keep float32 master weights and run under bfloat16 autocast on CUDA.

    python benchmarks/trainer_gpu.py                       # full settings, on CUDA
    python benchmarks/trainer_gpu.py --device cpu --prompts 2 --samples 2 --new-tokens 8 --layers 2

Prints a table, then one JSON line with the headline figures (the last line of output).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import signal
import sys
import tempfile
import time
import traceback
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rftgym.agents.hf_policy import HFPolicy, SamplingConfig  # noqa: E402
from rftgym.train.advantages import compute_advantages  # noqa: E402
from rftgym.train.batching import TrainSample  # noqa: E402
from rftgym.train.config import TrainConfig  # noqa: E402
from rftgym.train.update import optimise  # noqa: E402
from rftgym.train.speed import (  # noqa: E402
    SpeedConfig,
    apply_training_speedups,
    make_optimizer,
    flop_parameters,
    update_flops,
)
from provenance import check_device, provenance_line  # noqa: E402

PEAK_FLOPS = {"cuda": 989e12, "cpu": 1e12}  # H200 dense bf16; the CPU figure is only a placeholder
QUESTIONS = [
    "What is the capital of France?", "Add 17 and 25, then explain each step.",
    "Write a haiku about autumn leaves.", "List three prime numbers greater than 50.",
    "Why is the sky blue? Answer briefly.", "Translate 'good morning' into Spanish and German.",
    "Name a sorting algorithm and give its worst-case complexity.", "What does DNA stand for?",
]
UPDATE_VARIANTS = {
    "eager": None,  # the product without speed.py: HF decoder as is, plain AdamW
    "compiled": SpeedConfig(),
    "compiled+ckpt_mlp": SpeedConfig(checkpoint_mlp=True),
    # The model held in bf16 (no autocast: bf16 activations throughout), fp32 master weights in
    # the optimizer (rftgym.train.master_weights), as `rftgym train --dtype bfloat16` runs.
    "bf16+compiled+ckpt_mlp": SpeedConfig(checkpoint_mlp=True),
    # Gradient accumulation (TrainConfig.microbatch_size): the same update in microbatches.
    "compiled+micro16": SpeedConfig(),
    "compiled+micro8": SpeedConfig(),
    # The whole decoder as one compiled graph (--compile-scope decoder): the host's work per
    # forward once instead of per layer; with microbatches that cost is paid once per pass.
    "decoder": SpeedConfig(compile_scope="decoder"),
    "decoder+ckpt_mlp": SpeedConfig(compile_scope="decoder", checkpoint_mlp=True),
    "decoder+micro8": SpeedConfig(compile_scope="decoder"),
    # CUDA graphs for the decoder's forward and backward (the host launches each graph once, not
    # its hundreds of kernels), and GEMM kernels autotuned for the narrow (576-wide) matrices.
    "decoder+cudagraphs": SpeedConfig(compile_scope="decoder", checkpoint_mlp=True, compile_mode="reduce-overhead"),
    "compiled+autotune": SpeedConfig(checkpoint_mlp=True, compile_mode="max-autotune-no-cudagraphs"),
}
MICROBATCH = {"compiled+micro16": 16, "compiled+micro8": 8, "decoder+micro8": 8}


# ---------------------------------------------------------------- helpers

class Clock:
    def __init__(self, device: str):
        self.device = device

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def now(self) -> float:
        self.sync()
        return time.perf_counter()


def reset_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def reset_peak(device: str) -> None:
    """Per-step peak memory, keeping the allocator's cache: an empty cache would make the timed
    step allocate from the driver again, which a training loop does only once."""
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_gb(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None


def default_tokenizer_dir() -> Path:
    carried = ROOT / ".devcarry" / "tokenizer"
    if (carried / "tokenizer.json").is_file():
        return carried
    from rftgym.agents.model_loading import default_model_dir

    return default_model_dir()


def make_model(args, tokenizer_dir: Path, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tokenizer_dir)
    if args.layers:
        config.num_hidden_layers = args.layers
    torch.manual_seed(seed)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def model_flops(model, samples: list[TrainSample]) -> float:
    """FLOPs of one update over ``samples`` (speed.update_flops), the output layer counted at the
    trained positions, where the update runs it (as TRL computes logits for completions only)."""
    config = model.config
    counts = flop_parameters(model)
    return update_flops(counts.pop("parameters"), [len(s.token_ids) for s in samples], config.num_hidden_layers,
                        config.num_attention_heads * (getattr(config, "head_dim", None)
                                                      or config.hidden_size // config.num_attention_heads),
                        head_positions=sum(sum(s.loss_mask[1:]) for s in samples), **counts)


def autocast_for(device: str):
    return (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device == "cuda" else nullcontext


def prompt_ids(policy: HFPolicy, prompts: int) -> list[list[int]]:
    from rftgym.core.messages import Context, MessageIds

    ids = MessageIds.from_rng(np.random.default_rng(0))
    contexts = [Context((ids.message("user", QUESTIONS[i % len(QUESTIONS)]),)) for i in range(prompts)]
    return [policy.chat.prompt_ids(c) for c in contexts]


def ignore_end_of_turn(policy: HFPolicy) -> None:
    # Fixed-length replies for both tools: no token id is -1, so no row ever stops.
    policy.chat.stop_ids = (-1,)


def train_config(args, samples: int, new_tokens: int) -> TrainConfig:
    return TrainConfig(max_new_tokens=new_tokens, minibatch_size=samples, group_size=max(2, args.samples),
                       temperature=1.0, learning_rate=1e-6, kl_coef=0.0, rollout_batch_size=samples)


def guarded(results: dict, name: str):
    """Run a phase; on failure record the error (and print the traceback) instead of stopping."""
    def wrap(function):
        started = time.perf_counter()
        try:
            results[name] = function()
        except Exception as exc:  # a benchmark phase may fail in any way; the others still report
            traceback.print_exc()
            results[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        results[name]["phase_seconds"] = round(time.perf_counter() - started, 1)
        print(f"[{name}] {json.dumps(results[name], default=str)}", flush=True)
        return results[name]
    return wrap


# ---------------------------------------------------------------- phase 1: decode

def phase_decode(args, tokenizer, tokenizer_dir) -> dict:
    clock = Clock(args.device)
    model = make_model(args, tokenizer_dir, seed=1)
    prompts = prompt_ids(HFPolicy(model, tokenizer, fast_decode=False), args.prompts)
    prompts = [p for p in prompts for _ in range(args.samples)]
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, temperature=1.0, max_batch_size=len(prompts), seed=0)
    out: dict = {"batch": len(prompts), "new_tokens": args.new_tokens}
    autocast = autocast_for(args.device)

    fast = HFPolicy(model, tokenizer, sampling=sampling, fast_decode=True)
    ignore_end_of_turn(fast)
    reset_memory(args.device)
    with autocast():
        started = clock.now()
        fast.generate(prompts)  # captures the graph
        out["fast_first_call_s"] = clock.now() - started
        started = clock.now()
        replies = fast.generate(prompts)
        seconds = clock.now() - started
    assert all(len(r.sampled_ids) == args.new_tokens for r in replies), "fast path stopped early"
    out["fast_steps_per_s"] = args.new_tokens / seconds
    out["fast_peak_gb"] = peak_gb(args.device)
    out["fast_path_used"] = fast.fast_decode_reason is None

    if "hf" not in args.peer_set:
        return out
    generic = HFPolicy(model, tokenizer, sampling=sampling, fast_decode=False)
    ignore_end_of_turn(generic)
    # The slow loops decode fewer steps (the fast path's count would take minutes), each after an
    # untimed warm-up call, as the fast path's timed call follows its capture.
    steps = min(args.new_tokens, args.generic_tokens)
    out["peer_steps"] = steps
    generic_sampling = SamplingConfig(max_new_tokens=steps, temperature=1.0, max_batch_size=len(prompts))
    with autocast():
        generic.generate(prompts, generic_sampling)
        started = clock.now()
        generic.generate(prompts, generic_sampling)
        out["generic_steps_per_s"] = steps / (clock.now() - started)

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), generic.pad_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        attention[row, width - len(p):] = 1
    ids, attention = ids.to(args.device), attention.to(args.device)
    with autocast(), torch.inference_mode():
        for _ in range(2):   # the first call warms up; the second, timed, is what counts
            started = clock.now()
            model.generate(input_ids=ids, attention_mask=attention, do_sample=True, max_new_tokens=steps,
                           min_new_tokens=steps, pad_token_id=generic.pad_id)
        out["hf_generate_steps_per_s"] = steps / (clock.now() - started)
    out["fast_vs_hf_generate"] = out["fast_steps_per_s"] / out["hf_generate_steps_per_s"]
    out["fast_vs_generic"] = out["fast_steps_per_s"] / out["generic_steps_per_s"]
    del fast, generic, model
    return out


# ---------------------------------------------------------------- phase 2: ours

def grpo_samples(prompts, replies, rewards: np.ndarray, group: int) -> list[TrainSample]:
    advantages = compute_advantages("grpo", torch.tensor(rewards, dtype=torch.float32).view(-1, group)).view(-1)
    samples = []
    for index, (prompt, reply) in enumerate(zip(prompts, replies)):
        n, m = len(prompt), len(reply.sampled_ids)
        value = float(advantages[index])
        samples.append(TrainSample(token_ids=list(prompt) + reply.sampled_ids, loss_mask=[0] * n + [1] * m,
                                   old_logprobs=[0.0] * n + reply.logprobs, advantages=[0.0] * n + [value] * m,
                                   group=index // group, episode=index % group))
    return samples


def phase_ours(args, tokenizer, tokenizer_dir) -> dict:
    clock = Clock(args.device)
    model = make_model(args, tokenizer_dir, seed=2)
    # The CUDA defaults of `rftgym train`: compiled layers and MLP recomputation.
    speed = apply_training_speedups(model, SpeedConfig(checkpoint_mlp=True)) if args.speed else {"speed": "off"}
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, temperature=1.0,
                              max_batch_size=args.prompts * args.samples, seed=0)
    policy = HFPolicy(model, tokenizer, sampling=sampling, fast_decode=True)
    ignore_end_of_turn(policy)
    prompts = [p for p in prompt_ids(policy, args.prompts) for _ in range(args.samples)]
    config = train_config(args, len(prompts), args.new_tokens)
    optimizer = make_optimizer(model.parameters(), lr=config.learning_rate, fused=args.speed)
    autocast = autocast_for(args.device)
    rng = np.random.default_rng(0)
    generator = torch.Generator().manual_seed(0)
    steps = []
    for step in range(args.steps):
        reset_peak(args.device)
        started = clock.now()
        model.eval()
        with autocast():
            replies = policy.generate(prompts)
        generated = clock.now()
        samples = grpo_samples(prompts, replies, rng.random(len(prompts)), args.samples)
        scored = clock.now()
        model.train()
        optimise(model, None, optimizer, samples, config, policy.pad_id, generator, None, autocast)
        done = clock.now()
        flops = model_flops(model, samples)
        steps.append({"step_s": done - started, "generate_s": generated - started, "score_s": scored - generated,
                      "update_s": done - scored, "update_flops": flops, "peak_gb": peak_gb(args.device)})
    timed = steps[1:] if len(steps) > 1 else steps
    mean = {k: float(np.mean([s[k] for s in timed])) for k in ("step_s", "generate_s", "score_s", "update_s")}
    n = len(prompts)
    return {
        "samples": n, "timed_steps": len(timed), "warmup_step_s": steps[0]["step_s"],
        "samples_per_s": n / mean["step_s"], **mean,
        "decode_steps_per_s": args.new_tokens / mean["generate_s"],
        "update_mfu": float(np.mean([s["update_flops"] for s in timed])) / mean["update_s"] / PEAK_FLOPS[args.device],
        "peak_gb": max((s["peak_gb"] or 0) for s in timed) if args.device == "cuda" else None,
        "fast_path_used": policy.fast_decode_reason is None, "speed": speed,
    }


# ---------------------------------------------------------------- phase 3: TRL

def phase_trl(args, tokenizer, tokenizer_dir) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    clock = Clock(args.device)
    model = make_model(args, tokenizer_dir, seed=3)
    generate_seconds: list[float] = []
    plain_generate = model.generate

    def timed_generate(*a, **k):  # TRL calls model.generate on the unwrapped model: time it
        started = clock.now()
        result = plain_generate(*a, **k)
        generate_seconds.append(clock.now() - started)
        return result

    model.generate = timed_generate

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.begin, self.seconds, self.peaks = 0.0, [], []

        def on_step_begin(self, *_, **__):
            reset_peak(args.device)
            self.begin = clock.now()

        def on_step_end(self, *_, **__):
            self.seconds.append(clock.now() - self.begin)
            self.peaks.append(peak_gb(args.device))

    n = args.prompts * args.samples
    rows = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(args.prompts * (args.trl_steps + 1))]
    dataset = Dataset.from_dict({"prompt": rows})
    rng = np.random.default_rng(0)

    def reward(completions, **_):
        return rng.random(len(completions)).tolist()

    timer = StepTimer()
    with tempfile.TemporaryDirectory() as out_dir:
        config = GRPOConfig(
            output_dir=out_dir, per_device_train_batch_size=n, gradient_accumulation_steps=1, num_generations=args.samples,
            steps_per_generation=1, num_iterations=1, max_completion_length=args.new_tokens,
            generation_kwargs={"min_new_tokens": args.new_tokens}, temperature=1.0, beta=0.0, learning_rate=1e-6,
            max_steps=args.trl_steps, logging_steps=1, save_strategy="no", report_to="none", seed=0,
            bf16=args.device == "cuda", use_cpu=args.device == "cpu", dataloader_num_workers=0,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[timer])
        trainer.train()
    timed = timer.seconds[1:] if len(timer.seconds) > 1 else timer.seconds
    gen_timed = generate_seconds[1:] if len(generate_seconds) > 1 else generate_seconds
    step_s, gen_s = float(np.mean(timed)), float(np.mean(gen_timed))
    return {"samples": n, "timed_steps": len(timed), "step_s_min": min(timed), "step_s_max": max(timed),
            "warmup_step_s": timer.seconds[0], "samples_per_s": n / step_s,
            "step_s": step_s, "generate_s": gen_s, "rest_s": step_s - gen_s,
            "decode_steps_per_s": args.new_tokens / gen_s, "gradient_checkpointing": config.gradient_checkpointing,
            "peak_gb": max(timer.peaks[1:] or timer.peaks)
            if args.device == "cuda" else None}


# ---------------------------------------------------------------- phase 4: update only

def phase_update(args, tokenizer, tokenizer_dir, variant: str) -> dict:
    clock = Clock(args.device)
    model = make_model(args, tokenizer_dir, seed=4)
    bf16_weights = variant.startswith("bf16+")
    if bf16_weights:
        model.to(torch.bfloat16)
    speed = UPDATE_VARIANTS[variant]
    applied = apply_training_speedups(model, speed) if speed else {}
    prompt = args.update_seq // 3
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    samples = []
    for index in range(args.update_batch):
        ids = rng.integers(3, vocab, size=args.update_seq).tolist()
        n = args.update_seq - prompt
        samples.append(TrainSample(ids, [0] * prompt + [1] * n, [0.0] * prompt + (-rng.random(n) * 5).tolist(),
                                   [0.0] * prompt + [float(rng.normal())] * n, index // 8, index % 8))
    config = replace(train_config(args, len(samples), args.update_seq - prompt),
                     microbatch_size=MICROBATCH.get(variant, 0))
    optimizer = make_optimizer(model.parameters(), lr=config.learning_rate, fused=speed is not None)
    flops = model_flops(model, samples)
    generator = torch.Generator().manual_seed(0)
    autocast = nullcontext if bf16_weights else autocast_for(args.device)
    model.train()
    started = clock.now()
    optimise(model, None, optimizer, samples, config, 0, generator, None, autocast)  # warm-up (compiles)
    warmup = clock.now() - started
    reset_peak(args.device)   # the cache kept: emptied, the first timed step would allocate from the driver again
    times = []
    for _ in range(args.update_repeats):
        started = clock.now()
        optimise(model, None, optimizer, samples, config, 0, generator, None, autocast)
        times.append(clock.now() - started)
    seconds = float(np.median(times))
    result = {"batch": args.update_batch, "seq": args.update_seq, "warmup_s": warmup, "update_s": seconds,
              "tflops": flops / seconds / 1e12, "mfu": flops / seconds / PEAK_FLOPS[args.device],
              "peak_gb": peak_gb(args.device), "applied": applied}
    if variant in args.profile_variants:
        result["profile"] = profile_update(
            args.device, lambda: optimise(model, None, optimizer, samples, config, 0, generator, None, autocast))
    return result


KERNEL_KINDS = (  # first match wins; matched against lower-cased kernel (or, on CPU, op) names
    ("matmul", ("gemm", "cutlass", "cublas", "matmul", "aten::mm", "aten::addmm", "aten::bmm", "sm90_xmma",
                "nvjet")),
    ("attention", ("flash", "fmha", "attention", "efficient_attention")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("compiled (triton)", ("triton",)),
    ("copy / cast", ("copy", "memcpy", "memset", "to_copy", "aten::to", "fill")),
)


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in lowered for k in keys)), "other")


def profile_update(device: str, step) -> dict:
    """One update under torch.profiler: device time by kind of kernel, the share of the step's wall
    time the device was busy (low: launch-bound, the host is the bottleneck), the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    clock = Clock(device)
    with profile(activities=activities) as prof:
        started = clock.now()
        step()
        wall = clock.now() - started
    rows = []
    for event in prof.key_averages():
        if device == "cuda":
            if str(getattr(event, "device_type", "")).split(".")[-1] != "CUDA":
                continue
            busy = getattr(event, "self_device_time_total", None)
            busy = getattr(event, "self_cuda_time_total", 0) if busy is None else busy
        else:
            if not event.key.startswith("aten::"):
                continue
            busy = event.self_cpu_time_total
        if busy > 0:
            rows.append((event.key, busy / 1e6, event.count))
    total = sum(r[1] for r in rows)
    by_kind: dict[str, float] = {}
    for name, busy, _ in rows:
        by_kind[kernel_kind(name)] = by_kind.get(kernel_kind(name), 0.0) + busy
    top = sorted(rows, key=lambda r: -r[1])[:12]
    return {"wall_s": wall, "busy_s": total, "busy_share": total / wall if wall else None,
            "by_kind_s": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
            "top": [{"name": n[:90], "s": b, "calls": c} for n, b, c in top]}


# ---------------------------------------------------------------- report

def fmt(value, digits=1):
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if not math.isnan(value) else "nan"
    return str(value)


def print_table(args, results: dict) -> None:
    d, o, t = results.get("decode", {}), results.get("ours", {}), results.get("trl", {})
    print()
    print(f"GRPO step: {args.prompts} prompts x {args.samples} samples x {args.new_tokens} new tokens, "
          f"{'bf16 autocast' if args.device == 'cuda' else 'fp32'} on {args.device}; "
          f"ours: mean of steps 2..{args.steps} (step 1 = warm-up: graph capture, compilation); TRL: mean of steps "
          f"2..{args.trl_steps} ({fmt(t.get('step_s_min'), 2)} to {fmt(t.get('step_s_max'), 2)} s)")
    print(f"{'':28}{'samples/s':>11}{'step s':>9}{'generate s':>12}{'update s':>10}{'decode steps/s':>16}"
          f"{'update MFU*':>13}{'peak GiB':>9}")
    print(f"{'rftgym (fast decode)':28}{fmt(o.get('samples_per_s'), 2):>11}{fmt(o.get('step_s'), 2):>9}"
          f"{fmt(o.get('generate_s'), 2):>12}{fmt(o.get('update_s'), 3):>10}{fmt(o.get('decode_steps_per_s')):>16}"
          f"{fmt(100 * o['update_mfu'] if 'update_mfu' in o else None):>12}%{fmt(o.get('peak_gb'), 2):>9}")
    print(f"{'TRL GRPOTrainer':28}{fmt(t.get('samples_per_s'), 2):>11}{fmt(t.get('step_s'), 2):>9}"
          f"{fmt(t.get('generate_s'), 2):>12}{fmt(t.get('rest_s'), 3):>10}{fmt(t.get('decode_steps_per_s')):>16}"
          f"{'-':>12} {fmt(t.get('peak_gb'), 2):>9}")
    print("  TRL 'update s' = step - generate (scoring + loss + backward + optimizer); TRL runs with its defaults "
          f"(gradient_checkpointing={t.get('gradient_checkpointing')}); ours with speed.py {o.get('speed')}.")
    print(f"Decode steps/s at batch {d.get('batch')}: fast path {fmt(d.get('fast_steps_per_s'))} "
          f"(first call incl. capture {fmt(d.get('fast_first_call_s'), 2)} s), generic loop {fmt(d.get('generic_steps_per_s'))}, "
          f"plain HF generate {fmt(d.get('hf_generate_steps_per_s'))}  -> {fmt(d.get('fast_vs_hf_generate'), 2)}x "
          f"(fast path over {d.get('new_tokens')} steps, the others over {d.get('peer_steps')}, each after a warm-up call)")
    print(f"Update only ({args.update_batch} x {args.update_seq} tokens, optimise(); median of {args.update_repeats} after 1 warm-up):")
    print(f"  {'variant':22}{'update s':>10}{'TFLOP/s':>9}{'MFU*':>8}{'peak GiB':>9}  applied")
    for variant in args.update_variants:
        u = results.get(f"update:{variant}", {})
        if not u:
            print(f"  {variant:22}not run (stopped before it)")
            continue
        if "error" in u or "skipped" in u:
            print(f"  {variant:22}{u.get('error') or u.get('skipped')}")
            continue
        print(f"  {variant:22}{fmt(u.get('update_s'), 3):>10}{fmt(u.get('tflops')):>9}"
              f"{fmt(100 * u['mfu'] if 'mfu' in u else None):>7}%{fmt(u.get('peak_gb'), 2):>9}  {u.get('applied')}")
    print("* MFU = (6*(N-N_head-N_lookup)*tokens + 6*N_head*trained positions + 12*layers*heads*head_dim*sum(seq^2)) "
          f"/ update seconds / {PEAK_FLOPS[args.device] / 1e12:.0f} TFLOP/s (N = all parameters, tied counted once; "
          "N_head = vocab x hidden, run at trained positions only; N_lookup = an untied input embedding, 0 when tied; "
          "recompute not counted). Results before 2026-11-30's trained-positions change counted the head at every "
          "token.")
    for variant in args.update_variants:
        profiled = results.get(f"update:{variant}", {}).get("profile")
        if not profiled:
            continue
        unit = "kernel" if args.device == "cuda" else "op (CPU self time)"
        print(f"Profile of one update, {variant}: wall {profiled['wall_s']:.3f} s, {unit} time "
              f"{profiled['busy_s']:.3f} s (busy {100 * (profiled['busy_share'] or 0):.0f}% of the wall time)")
        print("  " + ", ".join(f"{kind} {busy:.3f} s" for kind, busy in profiled["by_kind_s"].items()))
        for row in profiled["top"]:
            print(f"  {row['s']:8.4f} s {row['calls']:6d}x  {row['name']}")
    for name, value in results.items():
        if isinstance(value, dict) and "error" in value:
            print(f"ERROR in {name}: {value['error']}")


def headline(args, results: dict) -> dict:
    d, o, t = results.get("decode", {}), results.get("ours", {}), results.get("trl", {})
    updates = {v: results.get(f"update:{v}", {}) for v in args.update_variants}
    return {
        "device": args.device, "torch": torch.__version__,
        "samples_per_s": {"rftgym": o.get("samples_per_s"), "trl": t.get("samples_per_s")},
        "speedup_vs_trl": (o["samples_per_s"] / t["samples_per_s"]) if "samples_per_s" in o and "samples_per_s" in t else None,
        "decode_steps_per_s": {"fast": d.get("fast_steps_per_s"), "generic": d.get("generic_steps_per_s"),
                               "hf_generate": d.get("hf_generate_steps_per_s"), "trl_generate": t.get("decode_steps_per_s"),
                               "in_grpo_step": o.get("decode_steps_per_s")},
        "fast_vs_hf_generate": d.get("fast_vs_hf_generate"),
        "grpo_update_mfu": o.get("update_mfu"), "grpo_peak_gb": {"rftgym": o.get("peak_gb"), "trl": t.get("peak_gb")},
        "update_only": {v: {"mfu": u.get("mfu"), "peak_gb": u.get("peak_gb"), "update_s": u.get("update_s")}
                        for v, u in updates.items()},
        "errors": {k: v["error"] for k, v in results.items() if isinstance(v, dict) and "error" in v},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--layers", type=int, default=0, help="override num_hidden_layers (0: the model's 30)")
    parser.add_argument("--peers", default="trl,hf", help="comma list of trl,hf, or none")
    parser.add_argument("--steps", type=int, default=3, help="our GRPO steps (the first is warm-up)")
    parser.add_argument("--trl-steps", type=int, default=4, help="TRL steps (the first is warm-up)")
    parser.add_argument("--generic-tokens", type=int, default=64, help="decode steps timed for the slow loops")
    parser.add_argument("--update-batch", type=int, default=None, help="update-only batch (default 64; cpu 2)")
    parser.add_argument("--update-seq", type=int, default=None, help="update-only tokens per sample (default 384; cpu 24)")
    parser.add_argument("--update-repeats", type=int, default=3)
    parser.add_argument("--update-variants", default=None,
                        help="comma list (default: all; the microbatch ones only where --update-batch exceeds "
                             "their microbatch size)")
    parser.add_argument("--profile-variants", default="",
                        help="comma list of update variants to profile once more (where the time goes)")
    parser.add_argument("--no-speed", dest="speed", action="store_false", help="our GRPO step without speed.py")
    parser.add_argument("--tokenizer", type=Path, default=None, help="dir with tokenizer files and config.json")
    parser.add_argument("--time-budget", type=float, default=330.0, help="skip update variants after this many s")
    args = parser.parse_args()
    check_device(parser, args.device)
    cpu = args.device == "cpu"
    args.update_batch = args.update_batch or (2 if cpu else 64)
    args.update_seq = args.update_seq or (24 if cpu else 384)
    if args.update_variants is None:  # a microbatch as large as the batch is no variant (and is refused)
        args.update_variants = ",".join(v for v in UPDATE_VARIANTS if MICROBATCH.get(v, 0) < args.update_batch)
    args.update_variants = [v for v in args.update_variants.split(",") if v]
    too_large = [v for v in args.update_variants if MICROBATCH.get(v, 0) >= args.update_batch]
    if too_large:
        parser.error(f"update variants {too_large} split the update batch into microbatches of "
                     f"{[MICROBATCH[v] for v in too_large]} samples: give --update-batch above that "
                     f"(it is {args.update_batch}) or leave them out")
    args.profile_variants = [v for v in args.profile_variants.split(",") if v]
    if set(args.profile_variants) - set(args.update_variants):
        parser.error("--profile-variants must be among --update-variants")
    unknown = set(args.update_variants) - set(UPDATE_VARIANTS)
    if unknown:
        parser.error(f"unknown update variants {sorted(unknown)}; choose from {list(UPDATE_VARIANTS)}")
    peers = set() if args.peers == "none" else set(args.peers.split(","))
    if peers - {"trl", "hf"}:
        parser.error(f"unknown peers {sorted(peers - {'trl', 'hf'})}; use trl,hf or none")
    args.peer_set = peers
    print(provenance_line(), flush=True)
    started = time.perf_counter()
    if args.device == "cuda":  # (the provenance line names the GPU and torch)
        torch.backends.cuda.matmul.allow_tf32 = True

    from transformers import AutoTokenizer

    tokenizer_dir = args.tokenizer or default_tokenizer_dir()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    results: dict = {}
    # A run stopped from outside (check.sh's timeout sends SIGTERM) still prints what it measured.
    signal.signal(signal.SIGTERM, _stop)
    try:
        guarded(results, "decode")(lambda: phase_decode(args, tokenizer, tokenizer_dir))
        reset_memory(args.device)
        guarded(results, "ours")(lambda: phase_ours(args, tokenizer, tokenizer_dir))
        reset_memory(args.device)
        if "trl" in peers:
            guarded(results, "trl")(lambda: phase_trl(args, tokenizer, tokenizer_dir))
            reset_memory(args.device)
        for variant in args.update_variants:
            if time.perf_counter() - started > args.time_budget:
                results[f"update:{variant}"] = {"skipped": f"time budget of {args.time_budget:.0f} s spent"}
                continue
            guarded(results, f"update:{variant}")(lambda v=variant: phase_update(args, tokenizer, tokenizer_dir, v))
            reset_memory(args.device)
    except Stopped:
        print("stopped from outside: the table holds the phases that finished", flush=True)
    print_table(args, results)
    print(f"total {time.perf_counter() - started:.0f} s")
    summary = headline(args, results)
    print(json.dumps(summary, default=str))
    if summary["errors"]:  # the table holds what was measured; the exit status says something was not
        sys.exit(f"trainer_gpu: {len(summary['errors'])} phase(s) failed: {', '.join(summary['errors'])}")


class Stopped(BaseException):
    """SIGTERM arrived (a timeout from outside); not an Exception, so no phase's guard takes it."""


def _stop(*_) -> None:
    raise Stopped


if __name__ == "__main__":
    main()
