"""rftgym's environments, registered with Gymnasium under the ``rftgym/`` namespace."""

from __future__ import annotations

import gymnasium as gym

# id -> (entry point, one-line description). `rftgym envs` prints this table.
ENVS: dict[str, tuple[str, str]] = {
    "rftgym/CodeTCG-v0": (
        "rftgym.envs.code.env:CodeTCGEnv",
        "write a program from a spec; tests from a Test Case Generator, run in a sandbox (O1-CODER)",
    ),
    "rftgym/VerifiableQA-v0": (
        "rftgym.envs.verifiable.env:VerifiableQAEnv",
        "arithmetic and multiple-choice questions with one checkable answer in <answer> tags",
    ),
    "rftgym/SearchEvalQA-v0": (
        "rftgym.envs.search.env:SearchEvalQAEnv",
        "multi-hop QA over a corpus; every <search> must be followed at once by an <evaluate> score (EvalAct)",
    ),
    "rftgym/MemoryQA-v0": (
        "rftgym.envs.memory.env:MemoryQAEnv",
        "multi-objective QA over a context budget; <prune ids=...>note</prune> deletes old results (MemAct)",
    ),
}


def register_envs() -> None:
    for env_id, (entry_point, _) in ENVS.items():
        if env_id not in gym.registry:
            gym.register(id=env_id, entry_point=entry_point)


def env_ids() -> list[str]:
    return list(ENVS)
