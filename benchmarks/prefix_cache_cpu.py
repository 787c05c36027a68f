"""Prefix KV reuse in multi-turn rollouts of the default model on CPU, side by side in one run:

- rftgym with prefix reuse (the default: each turn prefills only what its episode's last turn
  did not run),
- rftgym with ``prefix_cache_mb=0`` (every turn prefills its whole context),
- ``transformers.generate`` on the very prompts the second run fed the model, batch for batch
  (the generation alone: no env steps, no token records).

All three decode greedily, so the first two should produce the same episodes (up to the last
bits of the logits, which a batch's composition may change: see the README); the table says
whether they did, turn by turn.

    python benchmarks/prefix_cache_cpu.py [--envs rftgym/VerifiableQA-v0 rftgym/MemoryQA-v0]
        [--episodes 16] [--max-new-tokens 256]

Prints a table, then one JSON line with the headline figures of each env.
"""

from __future__ import annotations

import argparse
import json
import time

import gymnasium as gym
import torch

import rftgym  # noqa: F401  (registers the envs)
from rftgym.agents.hf_policy import HFPolicy, SamplingConfig
from rftgym.envs.common import env_metadata, with_policy_options
from rftgym.rollout import RolloutConfig, format_table, run_episodes
from provenance import provenance_line


def rollout(policy: HFPolicy, env_id: str, seeds: list[int]) -> tuple[list, float]:
    env_kwargs = with_policy_options(env_metadata(env_id), {}, policy)
    started = time.perf_counter()
    episodes = run_episodes(lambda: gym.make(env_id, **env_kwargs), policy, seeds,
                            config=RolloutConfig(num_envs=len(seeds)))
    return episodes, time.perf_counter() - started


def generate_replay(model, episodes, max_new_tokens: int, batch_size: int, pad_id: int, eos_ids) -> float:
    """Seconds ``model.generate`` takes over the episodes' prompts, turn after turn, in batches
    sorted by length as the policy batches them."""
    turns = max(len(e.turns) for e in episodes)
    started = time.perf_counter()
    for t in range(turns):
        prompts = sorted((list(e.turns[t].prompt_ids) for e in episodes if len(e.turns) > t), key=len)
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start:start + batch_size]
            width = max(len(p) for p in chunk)
            ids = torch.full((len(chunk), width), pad_id)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, prompt in enumerate(chunk):
                ids[row, width - len(prompt):] = torch.tensor(prompt)
                mask[row, width - len(prompt):] = 1
            with torch.inference_mode():
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                               pad_token_id=pad_id, eos_token_id=list(eos_ids))
    return time.perf_counter() - started


def as_copies_mb(cache) -> float:
    """What the cache's entries would hold with a copy of their states each (no shared blocks)."""
    return sum(block.nbytes * used / block.tokens for entry in cache.entries() for block, used in entry.blocks) / 2**20


def turn_tokens(episodes) -> list:
    return [(tuple(t.prompt_ids), tuple(t.sampled_ids)) for e in episodes for t in e.turns]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envs", nargs="+", default=["rftgym/VerifiableQA-v0", "rftgym/MemoryQA-v0"])
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    args = parser.parse_args()
    print(provenance_line(), flush=True)

    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=0.0, max_batch_size=args.episodes)
    reusing = HFPolicy.from_pretrained(sampling=sampling, device="cpu")
    plain = HFPolicy(reusing.model, reusing.tokenizer, sampling=sampling, name=reusing.name, prefix_cache_mb=0)
    seeds = list(range(args.episodes))
    rows, headlines = [], {}
    for env_id in args.envs:
        stats = reusing.prefix_cache.stats
        prompt_before, prefilled_before = stats.prompt_tokens, stats.prefilled_tokens
        reusing.clear_prefix_cache()
        ours, ours_s = rollout(reusing, env_id, seeds)
        asked, prefilled = stats.prompt_tokens - prompt_before, stats.prefilled_tokens - prefilled_before
        held_mb, copies_mb = reusing.prefix_cache.nbytes / 2**20, as_copies_mb(reusing.prefix_cache)
        base, base_s = rollout(plain, env_id, seeds)
        peer_s = generate_replay(reusing.model, base, args.max_new_tokens, args.episodes, plain.pad_id,
                                 plain.chat.stop_ids)
        same_turns = sum(a == b for a, b in zip(turn_tokens(ours), turn_tokens(base)))
        prompt_tokens = sum(len(t.prompt_ids) for e in base for t in e.turns)
        n_turns = sum(len(e.turns) for e in base)
        rows.append([env_id, "transformers generate (replay)", n_turns, prompt_tokens, prompt_tokens, 0.0, peer_s,
                     1.0, "-", "-"])
        rows.append([env_id, "rftgym, prefix_cache_mb=0", n_turns, prompt_tokens, prompt_tokens, 0.0, base_s,
                     peer_s / base_s, "-", "-"])
        rows.append([env_id, "rftgym, prefix reuse", sum(len(e.turns) for e in ours), asked, prefilled,
                     1 - prefilled / max(asked, 1), ours_s, peer_s / ours_s, f"{same_turns}/{n_turns}",
                     f"{held_mb:.1f} ({copies_mb:.1f})"])
        headlines[env_id] = {"generate_s": round(peer_s, 1), "no_reuse_s": round(base_s, 1),
                             "reuse_s": round(ours_s, 1), "saved_share": round(1 - prefilled / max(asked, 1), 3),
                             "same_turns": same_turns, "turns": n_turns, "states_held_mb": round(held_mb, 1),
                             "as_copies_mb": round(copies_mb, 1)}

    print(f"default model on CPU ({torch.get_num_threads()} threads), {args.episodes} episodes per env side by side, "
          f"greedy, max_new_tokens={args.max_new_tokens}")
    print(format_table(rows, ["env", "engine", "turns", "prompt tok", "prefilled tok", "saved share", "seconds",
                              "speedup vs generate", "same turns as no reuse", "states MB (as copies)"]))
    print("states MB: what the prefix cache held after the rollout, shared blocks counted once; in brackets, what "
          "its entries would hold with a copy each")
    print(json.dumps({"bench": "prefix_cache_cpu", "episodes": args.episodes, "envs": headlines}))  # one last line


if __name__ == "__main__":
    main()
