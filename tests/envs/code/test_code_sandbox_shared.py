"""Code envs in one process share one sandbox per backend, each with its own limits."""

from __future__ import annotations

import os
import shutil
import threading
import time

import gymnasium as gym
import pytest

import rftgym  # noqa: F401  (registers the envs)
from rftgym.core.errors import ConfigError
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


def test_bad_limits_take_no_share():
    with pytest.raises(ConfigError, match="limits must be a SandboxLimits"):
        shared_sandbox("local", limits={"wall_seconds": 1})
    assert open_shares("local") == 0


def test_a_dropped_view_gives_its_share_back():
    import gc

    view = shared_sandbox("local")
    inner = view.inner
    assert open_shares("local") == 1
    del view
    gc.collect()
    assert open_shares("local") == 0 and inner._closed


def test_a_child_forked_while_a_sandbox_starts_can_make_its_own(monkeypatch):
    # Another thread holds the registry's lock (starting a sandbox) when this one forks.
    started, release = threading.Event(), threading.Event()
    real = sandbox_shared.make_sandbox

    def slow(backend):
        started.set()
        release.wait(10)
        return real(backend)

    monkeypatch.setattr(sandbox_shared, "make_sandbox", slow)
    thread = threading.Thread(target=lambda: shared_sandbox("local").close())
    thread.start()
    try:
        assert started.wait(10)
        pid = os.fork()
        if pid == 0:  # the child: a fresh registry and lock, so this returns instead of hanging
            code = 1
            try:
                monkeypatch.undo()
                view = shared_sandbox("local")
                code = 0 if view.run(Program(files={"main.py": "print(2)"})).ok else 2
                view.close()
            finally:
                os._exit(code)
        deadline = time.monotonic() + 60
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if done[0] == 0:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung on the registry's lock")
        assert os.waitstatus_to_exitcode(done[1]) == 0
    finally:
        release.set()
        thread.join(30)


def _without_bubblewrap(monkeypatch):
    """This process's local sandbox made as where bubblewrap is missing (rlimits only)."""
    from rftgym.envs.code.sandbox import make_sandbox

    monkeypatch.setattr(sandbox_shared.os, "getpid", lambda: -54321)  # a fresh entry, not the session's
    monkeypatch.setattr(sandbox_shared, "make_sandbox", lambda backend: make_sandbox(backend, use_bwrap=False))


@pytest.mark.filterwarnings("ignore:rftgym local sandbox")
def test_require_isolation_refuses_a_sandbox_without_bubblewrap(monkeypatch):
    _without_bubblewrap(monkeypatch)
    loose = shared_sandbox("local")
    try:
        assert not loose.isolated and "NO network or filesystem isolation" in loose.isolation
        with pytest.raises(SandboxError, match=r"require_isolation=True, but the local sandbox has none .*"
                                               r"install bubblewrap.*sandbox='docker'"):
            shared_sandbox("local", require_isolation=True)
        assert open_shares("local") == 1  # the refused share was released
        with pytest.raises(SandboxError, match="require_isolation=True"):
            gym.make("rftgym/CodeTCG-v0", dataset="generated", require_isolation=True)
    finally:
        loose.close()


def test_training_requires_isolation_unless_told_otherwise():
    from rftgym.envs.common import env_metadata, with_training_defaults

    code, verifiable = env_metadata("rftgym/CodeTCG-v0"), env_metadata("rftgym/VerifiableQA-v0")
    assert with_training_defaults(code, {"dataset": "generated"}) == {"dataset": "generated", "require_isolation": True}
    assert with_training_defaults(code, {"require_isolation": False}) == {"require_isolation": False}
    assert with_training_defaults(verifiable, {"max_attempts": 2}) == {"max_attempts": 2}
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    isolated = shared_sandbox("local", require_isolation=True)
    try:
        assert isolated.isolated
    finally:
        isolated.close()


def test_a_share_tells_the_shared_sandboxs_isolation_as_it_is_now():
    """A local sandbox's isolation line changes once a retried inode-cap probe runs; a share made
    before that tells the new one, not a copy."""
    view = shared_sandbox("local")
    try:
        before = view.isolation
        assert before == view.inner.isolation
        view.inner.isolation = before + " (changed)"
        assert view.isolation == before + " (changed)"
    finally:
        view.inner.isolation = before
        view.close()
