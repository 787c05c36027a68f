"""Code envs in one process share one sandbox per backend, each with its own limits."""

from __future__ import annotations

import gymnasium as gym
import pytest

import rftgym  # noqa: F401  (registers the envs)
from rftgym.envs.code import sandbox_shared
from rftgym.envs.code.sandbox import Program, SandboxError, SandboxLimits
from rftgym.envs.code.sandbox_shared import open_shares, shared_sandbox

SLEEP = Program(files={"main.py": "import time\ntime.sleep(1.5)\nprint('woke')\n"})


def test_views_share_one_sandbox_with_their_own_limits():
    short = shared_sandbox("local", limits=SandboxLimits(wall_seconds=0.5, cpu_seconds=0.5))
    long = shared_sandbox("local", limits=SandboxLimits(wall_seconds=10, cpu_seconds=10))
    try:
        assert short.inner is long.inner and open_shares("local") == 2
        assert short.run(SLEEP).timed_out
        done = long.run(SLEEP)
        assert done.ok and done.stdout.strip() == "woke"
        # A program's own limits win over the view's.
        assert not short.run_many([Program(files=SLEEP.files, limits=long.limits)])[0].timed_out
    finally:
        short.close()
    # One share closed: the sandbox stays for the other.
    assert not long.inner._closed and open_shares("local") == 1
    with pytest.raises(SandboxError, match="closed"):
        short.run(SLEEP)
    short.close()  # twice is harmless and does not release another share
    assert open_shares("local") == 1
    inner = long.inner
    long.close()
    assert inner._closed and open_shares("local") == 0
    # The next share makes a fresh sandbox.
    fresh = shared_sandbox("local")
    try:
        assert fresh.inner is not inner and fresh.run(Program(files={"main.py": "print(1)"})).ok
    finally:
        fresh.close()


def test_a_forked_child_does_not_use_the_parents_sandbox(monkeypatch):
    parent = shared_sandbox("local")
    try:
        monkeypatch.setattr(sandbox_shared.os, "getpid", lambda: -12345)  # as if in a forked child
        child = shared_sandbox("local")
        try:
            assert child.inner is not parent.inner
        finally:
            child.close()
    finally:
        monkeypatch.undo()
        parent.close()


def test_code_envs_share_one_sandbox(monkeypatch):
    made = []
    real = sandbox_shared.make_sandbox
    monkeypatch.setattr(sandbox_shared, "make_sandbox", lambda backend: made.append(backend) or real(backend))
    envs = [gym.make("rftgym/CodeTCG-v0", dataset="generated", timeout_seconds=t) for t in (2, 3, 4)]
    try:
        assert made == ["local"]
        sandboxes = [env.unwrapped.sandbox for env in envs]
        assert len({id(s.inner) for s in sandboxes}) == 1
        assert [s.limits.wall_seconds for s in sandboxes] == [2.0, 3.0, 4.0]
        for env in envs:  # each grades through the shared sandbox: the reference passes every test
            env.reset(seed=0)
            _, reward, _, _, info = env.step(f"```python\n{env.unwrapped.task.reference}\n```")
            assert info["status"] == "ok" and info["pass_rate"] == 1.0 and reward == pytest.approx(1.0)
    finally:
        for env in envs:
            env.close()
    assert open_shares("local") == 0
