"""Rendering shared by every env: human mode prints whatever the agent wrote, never raising."""

from __future__ import annotations

import gymnasium as gym
import pytest

import rftgym  # noqa: F401 (registers the envs)

ENV_IDS = ["rftgym/VerifiableQA-v0", "rftgym/SearchEvalQA-v0", "rftgym/MemoryQA-v0", "rftgym/CodeTCG-v0"]


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_human_rendering_escapes_text_the_terminal_cannot_encode(env_id, capsys):
    env = gym.make(env_id, render_mode="human")
    try:
        env.reset(seed=0)
        capsys.readouterr()
        env.step("\ud800 caf\u00e9 <answer>1</answer>")  # a lone surrogate: not encodable in UTF-8
        out = capsys.readouterr().out
        assert "[assistant] \\ud800 caf\u00e9 <answer>1</answer>" in out
    finally:
        env.close()
