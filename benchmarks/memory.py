"""Memory under a context budget: no memory vs heuristic pruning vs a given agent, side by side on
the same seeded rftgym/MemoryQA-v0 tasks, in one run.

* ``no-memory``: the env with ``allow_prune=False`` (prune hidden and refused), the agent as is.
* ``heuristic``: the agent wrapped in :class:`~rftgym.agents.memory_baselines.HeuristicPruner`
  (prune results older than ``--keep-turns`` turns, at least ``--min-stale`` at a time).
* ``agent``: the agent as is, with pruning allowed (its own, e.g. learned, memory policy).

The agent is ``oracle`` (default: a scripted searcher that reads the generated world; it never
prunes by itself, so its ``agent`` row shows the budget without memory help) or ``default`` (the
project's default model, SmolLM2-135M-Instruct; tokens are then counted with its tokenizer).

    python benchmarks/memory.py [--episodes 12] [--objectives 3] [--hops 2 3] [--budget 1024] [--agent oracle]

Prints a table, then one JSON line with the headline figures: success and tokens processed per
episode (the sum over turns of the context fed to the agent) of each configuration.
"""

from __future__ import annotations

import argparse
import json
import time

import rftgym  # noqa: F401  (registers the envs)
from rftgym.agents.memory_baselines import HeuristicPruner, WorldOracleAgent
from rftgym.envs.memory.budget import policy_token_counter
from rftgym.envs.memory.env import MemoryQAEnv
from rftgym.envs.search.world import World
from rftgym.rollout import RolloutConfig, format_table, run_episodes, summarize
from rftgym.rollout.metrics import EVAL_REDUCERS, env_metrics
from provenance import check_device, check_positive, provenance_line


def build_agent(args):
    if args.agent == "oracle":
        return WorldOracleAgent(World(args.world_seed, args.world_size)), None
    from rftgym.agents.hf_policy import HFPolicy, SamplingConfig

    policy = HFPolicy.from_pretrained(sampling=SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=0.0,
                                                              max_batch_size=args.num_envs), device=args.device)
    return policy, policy_token_counter(policy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=12)
    parser.add_argument("--objectives", type=int, default=3)
    parser.add_argument("--hops", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--budget", type=int, default=1024, help="max_context_tokens")
    parser.add_argument("--max-turns", type=int, default=24)
    parser.add_argument("--world-seed", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=60)
    parser.add_argument("--keep-turns", type=int, default=1)
    parser.add_argument("--min-stale", type=int, default=2)
    parser.add_argument("--agent", choices=("oracle", "default"), default="oracle")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--num-envs", type=int, default=8)
    parser.add_argument("--device", default=None)
    parser.add_argument("--seed", type=int, default=0, help="first episode seed")
    args = parser.parse_args()
    check_positive(parser, args, "episodes", "objectives", "budget", "max_turns", "world_size", "max_new_tokens",
                   "num_envs", "hops")
    if args.device is not None:
        check_device(parser, args.device)
    print(provenance_line(), flush=True)

    agent, counter = build_agent(args)
    seeds = [args.seed + i for i in range(args.episodes)]
    env_kwargs = dict(objectives=args.objectives, hops=tuple(args.hops), max_context_tokens=args.budget,
                      max_turns=args.max_turns, world_seed=args.world_seed, world_size=args.world_size,
                      count_tokens=counter)
    configurations = {
        "no-memory": (dict(allow_prune=False), agent),
        "heuristic": ({}, HeuristicPruner(agent, keep_turns=args.keep_turns, min_stale=args.min_stale)),
        "agent": ({}, agent),
    }
    headers = ["config", "agent", "episodes", "success", "score", "ctx_tok_mean", "ctx_tok_max", "total_tok/ep",
               "prunes/ep", "overflow_rate", "turns", "s"]
    rows, headline = [], {"bench": "memory", "agent": getattr(agent, "name", args.agent),
                          "episodes": args.episodes, "objectives": args.objectives, "budget": args.budget}
    for label, (extra, runner) in configurations.items():
        started = time.perf_counter()
        episodes = run_episodes(lambda: MemoryQAEnv(**env_kwargs, **extra), runner, seeds,
                                config=RolloutConfig(num_envs=args.num_envs, max_turns=args.max_turns + 1))
        elapsed = time.perf_counter() - started
        s = summarize(episodes)
        m = env_metrics(episodes, MemoryQAEnv.metadata["eval_metrics"])
        # as eval's columns read it: an episode whose model context filled has the env's last score
        score = EVAL_REDUCERS["final_mean"](episodes, "score")
        rows.append([label, getattr(runner, "name", args.agent), s["episodes"], s["success"], score,
                     m["ctx_tok_mean"], m["ctx_tok_max"], m["total_tok/ep"], m["prunes/ep"], m["overflow_rate"],
                     s["turns"], elapsed])
        key = label.replace("-", "_")
        headline[f"{key}_success"] = round(float(s["success"]), 4)
        headline[f"{key}_score"] = round(float(score), 4)
        headline[f"{key}_tokens"] = round(float(m["total_tok/ep"]), 1)
        headline[f"{key}_peak_tokens"] = m["ctx_tok_max"]
    agent.close()
    print(format_table(rows, headers))
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
