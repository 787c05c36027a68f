"""The README's "Your own env and agent" recipe, run as it is written there: a researcher copies
it first, so it must work verbatim (and say success, which the trainer's rft reads)."""

from __future__ import annotations

import re
from pathlib import Path

import gymnasium as gym

from rftgym.agents.scripted import ScriptedAgent
from rftgym.rollout import run_episodes

README = Path(__file__).resolve().parents[1] / "README.md"


def recipe_source() -> str:
    section = README.read_text(encoding="utf-8").split("### Your own env and agent", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_env_recipe_runs_as_written():
    source = recipe_source()
    assert 'gym.register("mine/Echo-v0"' in source
    namespace: dict = {}
    exec(compile(source.replace("mine/Echo-v0", "readme/Echo-v0"), str(README), "exec"), namespace)
    try:
        [said] = run_episodes(lambda: gym.make("readme/Echo-v0"), ScriptedAgent("hi there"), seeds=[0])
        [silent] = run_episodes(lambda: gym.make("readme/Echo-v0"), ScriptedAgent("hello"), seeds=[0])
        assert said.total_reward == 1.0 and said.success and said.turns[-1].info["said"] == 1.0
        assert silent.total_reward == 0.0 and not silent.success
    finally:
        gym.registry.pop("readme/Echo-v0", None)
