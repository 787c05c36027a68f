"""How far keyed sampling is from batch-invariant on CPU: the same seeded, keyed VerifiableQA-v0
episodes of the default model (temperature 1), run with the batch of a reference run, with
another batch size, and with prefix reuse, side by side in one process.

Each episode draws the same uniforms in every run (rftgym.agents.sampling_keys); its tokens
differ only where the logits' last bits, which a batch's shapes change, move a cumulative
probability across a draw. For each run against the reference, the table counts the sampled
tokens compared (up to each episode's first differing token), the episodes that diverged, and
the largest log-prob difference on the tokens both runs sampled, and at each divergence how
likely the tokens sampled there were (the lower log-prob of the two).

    python benchmarks/sampling_invariance.py [--episodes 32] [--max-new-tokens 64]

Prints a table, then one JSON line with the headline figures.
"""

from __future__ import annotations

import argparse
import json

import gymnasium as gym
import torch

import rftgym  # noqa: F401  (registers the envs)
from rftgym.agents.hf_policy import HFPolicy, SamplingConfig
from rftgym.rollout import RolloutConfig, format_table, run_episodes
from provenance import check_positive, provenance_line

ENV_ID = "rftgym/VerifiableQA-v0"


def compare(reference, other) -> tuple[int, int, float, list[float]]:
    """Tokens compared, episodes that diverged, the largest |log-prob difference| on the tokens
    both sampled (turn by turn up to an episode's first differing token), and at each divergence
    the lower log-prob of the two tokens sampled there."""
    compared, diverged, largest, at_divergence = 0, 0, 0.0, []
    for a, b in zip(reference, other):
        for turn_a, turn_b in zip(a.turns, b.turns):
            same = 0
            limit = min(len(turn_a.sampled_ids), len(turn_b.sampled_ids))
            while same < limit and turn_a.sampled_ids[same] == turn_b.sampled_ids[same]:
                same += 1
            compared += same
            if same:
                largest = max(largest, max(abs(x - y) for x, y in zip(turn_a.logprobs[:same], turn_b.logprobs[:same])))
            if same < max(len(turn_a.sampled_ids), len(turn_b.sampled_ids)):
                diverged += 1
                if same < limit:  # both sampled a token there (else one reply ended)
                    at_divergence.append(min(turn_a.logprobs[same], turn_b.logprobs[same]))
                break
    return compared, diverged, largest, at_divergence


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--other-batch", type=int, default=3)
    args = parser.parse_args()
    check_positive(parser, args, "episodes", "max_new_tokens", "batch", "other_batch")
    if args.episodes % 4:  # (groups of 4 samples of a task, as GRPO draws them)
        parser.error(f"--episodes must be a multiple of 4 (groups of 4 samples of a task), got {args.episodes}")
    print(provenance_line(), flush=True)

    def sampling(batch):
        return SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=11, max_batch_size=batch)

    reference = HFPolicy.from_pretrained(sampling=sampling(args.batch), device="cpu", prefix_cache_mb=0)
    policies = {
        f"batch {args.other_batch}, no reuse": HFPolicy(reference.model, reference.tokenizer,
                                                        sampling=sampling(args.other_batch), prefix_cache_mb=0),
        f"batch {args.batch}, prefix reuse": HFPolicy(reference.model, reference.tokenizer,
                                                      sampling=sampling(args.batch)),
    }
    seeds = [task for task in range(args.episodes // 4) for _ in range(4)]  # groups of 4, as GRPO samples
    keys = [[0, i] for i in range(len(seeds))]

    def rollout(policy):
        batch = policy.sampling.max_batch_size
        return run_episodes(lambda: gym.make(ENV_ID), policy, seeds, sample_keys=keys,
                            config=RolloutConfig(num_envs=batch))

    base = rollout(reference)
    rows, headline = [], {"bench": "sampling_invariance", "episodes": len(seeds)}
    for name, policy in policies.items():
        compared, diverged, largest, at_divergence = compare(base, rollout(policy))
        rows.append([f"batch {args.batch}, no reuse", name, compared, diverged, f"{largest:.1e}",
                     " ".join(f"{x:.1f}" for x in sorted(at_divergence)) or "-"])
        headline[name] = {"tokens": compared, "diverged": diverged, "max_logprob_diff": largest,
                          "logprob_at_divergence": at_divergence}
    print(f"default model on CPU ({torch.get_num_threads()} threads), {len(seeds)} keyed {ENV_ID} episodes, "
          f"temperature 1, max_new_tokens={args.max_new_tokens}")
    print(format_table(rows, ["reference", "run", "tokens compared", "episodes diverged", "max |logprob diff|",
                              "lower log-prob of the tokens at each divergence"]))
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
