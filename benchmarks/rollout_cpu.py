"""Rollout throughput of the default model on CPU: rftgym's batched engine against a plain
one-context-at-a-time ``transformers.generate`` loop, side by side in one run.

Both run the same seeded VerifiableQA-v0 episodes with greedy decoding and the same token
budget. Ours also records exact tokens and log-probs; the plain loop records text only. One
untimed episode warms both up first, and each batch size starts with an empty prefix cache: a row
reuses only the prompts of its own episodes, never the states an earlier row computed.

    python benchmarks/rollout_cpu.py [--episodes 32] [--max-new-tokens 64] [--batch-sizes 1 8 32]

Prints a table, then one JSON line with the headline figures.
"""

from __future__ import annotations

import argparse
import json
import time

import gymnasium as gym
import torch

import rftgym  # noqa: F401  (registers the envs)
from rftgym.agents.hf_policy import HFPolicy, SamplingConfig
from rftgym.rollout import RolloutConfig, format_table, run_episodes
from provenance import check_positive, provenance_line

ENV_ID = "rftgym/VerifiableQA-v0"


def plain_generate_loop(model, tokenizer, seeds, max_new_tokens):
    """The baseline: one env, one context at a time, ``model.generate`` on the rendered chat."""
    env = gym.make(ENV_ID)
    rewards, generated = [], 0
    for seed in seeds:
        context, _ = env.reset(seed=seed)
        total, done = 0.0, False
        while not done:
            text = tokenizer.apply_chat_template(context.to_chat(), tokenize=False, add_generation_prompt=True)
            inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
            with torch.inference_mode():
                out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                     pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            new = out[0, inputs["input_ids"].shape[1]:]
            generated += int(new.numel())
            reply = tokenizer.decode(new, skip_special_tokens=True)
            context, reward, terminated, truncated, _ = env.step(reply)
            total += reward
            done = terminated or truncated
        rewards.append(total)
    env.close()
    return rewards, generated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    args = parser.parse_args()
    check_positive(parser, args, "episodes", "max_new_tokens", "batch_sizes")
    print(provenance_line(), flush=True)

    seeds = list(range(args.episodes))
    policy = HFPolicy.from_pretrained(device="cpu")
    rows, results = [], {}

    # Warm-up (first calls allocate and pick kernels), untimed, for both engines.
    plain_generate_loop(policy.model, policy.tokenizer, seeds[:1], args.max_new_tokens)
    policy.sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=0.0)
    run_episodes(lambda: gym.make(ENV_ID), policy, seeds[:1])

    started = time.perf_counter()
    rewards, generated = plain_generate_loop(policy.model, policy.tokenizer, seeds, args.max_new_tokens)
    elapsed = time.perf_counter() - started
    plain = {"eps": args.episodes / elapsed, "tok_s": generated / elapsed, "reward": sum(rewards) / len(rewards)}
    rows.append(["plain generate loop", 1, args.episodes, elapsed, plain["eps"], plain["tok_s"], plain["reward"], 1.0])

    for batch in args.batch_sizes:
        sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=0.0, max_batch_size=batch)
        policy.sampling = sampling
        policy.clear_prefix_cache()  # the row's own episodes only (the same seeds ran in the row before)
        started = time.perf_counter()
        episodes = run_episodes(lambda: gym.make(ENV_ID), policy, seeds, config=RolloutConfig(num_envs=batch))
        elapsed = time.perf_counter() - started
        tokens = sum(e.num_sampled_tokens for e in episodes)
        ours = {"eps": args.episodes / elapsed, "tok_s": tokens / elapsed,
                "reward": sum(e.total_reward for e in episodes) / len(episodes)}
        results[batch] = ours
        rows.append(["rftgym run_episodes", batch, args.episodes, elapsed, ours["eps"], ours["tok_s"], ours["reward"],
                     ours["eps"] / plain["eps"]])

    print(f"default model on CPU ({torch.get_num_threads()} threads), {ENV_ID}, greedy, "
          f"max_new_tokens={args.max_new_tokens}")
    print(format_table(rows, ["engine", "batch", "episodes", "seconds", "episodes/s", "gen tokens/s",
                              "mean reward", "speedup"]))
    headline = {"bench": "rollout_cpu", "plain_episodes_per_s": round(plain["eps"], 4),
                "plain_tokens_per_s": round(plain["tok_s"], 2)}
    for batch, ours in results.items():
        headline[f"ours_b{batch}_episodes_per_s"] = round(ours["eps"], 4)
        headline[f"ours_b{batch}_tokens_per_s"] = round(ours["tok_s"], 2)
    best = max(results.values(), key=lambda r: r["eps"])
    headline["best_speedup"] = round(best["eps"] / plain["eps"], 2)
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
