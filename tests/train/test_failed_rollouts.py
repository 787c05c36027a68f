"""A training step whose rollout fails keeps the episodes it had finished in the output directory
(failed-step-N.episodes.jsonl, as rftgym eval writes episodes), says where on stderr, and the
error goes on as it was. A stop writes nothing, and a write that fails hides nothing."""

from __future__ import annotations

import errno
import json

import pytest
from support import SayAEnv, train_config

from rftgym.core.errors import EnvContractError, EnvError
from rftgym.core.records import episode_json_line, read_episodes_jsonl
from rftgym.train import failed_rollouts, loop
from rftgym.train.distributed import Distributed
from rftgym.train.failed_rollouts import failed_episodes_path, keeping_finished_episodes
from rftgym.train.loop import train

EPISODES_PER_STEP = 16  # train_config: 2 tasks x 8 samples, one turn each


def env_breaking_at(call: int, error: BaseException):
    """SayAEnv whose ``call``-th step over all its instances (1-based) raises ``error``: with one
    turn per episode, the episodes finished before it in that rollout are the ones to keep."""
    calls = []

    class BreakingEnv(SayAEnv):
        def step(self, action):
            calls.append(action)
            if len(calls) == call:
                raise error
            return super().step(action)

    return BreakingEnv


def recording_rollouts(monkeypatch) -> list[BaseException]:
    """The errors the trainer's rollouts raise (each carrying finished_episodes), as they escape
    run_episodes, before the trainer sees them."""
    seen, real = [], loop.run_episodes

    def recorded(*args, **kwargs):
        try:
            return real(*args, **kwargs)
        except BaseException as exc:
            seen.append(exc)
            raise

    monkeypatch.setattr(loop, "run_episodes", recorded)
    return seen


def lines(episodes) -> list[str]:
    return [episode_json_line(e) for e in episodes]


def test_a_failed_rollout_keeps_its_finished_episodes(tmp_path, make_char_policy, monkeypatch, capsys):
    seen = recording_rollouts(monkeypatch)
    # Step 2's sixth episode breaks its env: five of its 16 had finished.
    broken = env_breaking_at(EPISODES_PER_STEP + 6, RuntimeError("the sandbox is gone"))
    with pytest.raises(EnvError, match="raised RuntimeError in step .*: the sandbox is gone") as raised:
        train(train_config(tmp_path, "run", steps=3), policy=make_char_policy(), make_env=broken)
    assert raised.value is seen[-1]  # the rollout's own error, as it was
    kept = tmp_path / "run" / "failed-step-2.episodes.jsonl"
    episodes = list(read_episodes_jsonl(kept))
    assert len(episodes) == 5 and lines(episodes) == lines(raised.value.finished_episodes)
    assert f"rftgym train: step 2's rollout failed after 5 of 16 episodes; they are in {kept}\n" \
        in capsys.readouterr().err
    assert (tmp_path / "run" / "metrics.jsonl").is_file()  # step 1's result, kept as before


def test_a_failed_rollout_saves_the_steps_before_it_and_the_run_resumes_as_the_uninterrupted_one(
        tmp_path, make_char_policy, capsys):
    # The weights were still step 1's: the run no longer loses that step (its directory had its
    # metrics and no checkpoint, so it could neither resume nor start again).
    broken = env_breaking_at(EPISODES_PER_STEP + 6, RuntimeError("the sandbox is gone"))
    with pytest.raises(EnvError):
        train(train_config(tmp_path, "run", steps=3), policy=make_char_policy(), make_env=broken)
    assert "rftgym train: stopping; saving the checkpoint after step 1 first" in capsys.readouterr().err
    assert json.loads((tmp_path / "run" / "checkpoint" / "state.json").read_text())["step"] == 1
    resumed = train(train_config(tmp_path, "run", steps=3), policy=make_char_policy(), make_env=SayAEnv, resume=True)
    straight = train(train_config(tmp_path, "straight", steps=3), policy=make_char_policy(), make_env=SayAEnv)
    assert [h["step"] for h in resumed] == [2, 3]
    for a, b in zip(straight[1:], resumed, strict=True):
        assert b["reward_mean"] == a["reward_mean"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)


def test_a_run_failing_in_its_first_step_leaves_only_that_file(tmp_path, make_char_policy, capsys):
    run = tmp_path / "new" / "run"  # folders the run makes, and would remove with nothing in them
    broken = env_breaking_at(4, RuntimeError("the sandbox is gone"))
    with pytest.raises(EnvError):
        train(train_config(tmp_path, "new/run", steps=2), policy=make_char_policy(), make_env=broken)
    # The run's own files are gone, as for any run that wrote no result; the file it named stays.
    assert [p.name for p in run.iterdir()] == ["failed-step-1.episodes.jsonl"]
    assert len(list(read_episodes_jsonl(run / "failed-step-1.episodes.jsonl"))) == 3
    assert "step 1's rollout failed after 3 of 16 episodes" in capsys.readouterr().err
    # and it does not stand in the way of the same run started again
    history = train(train_config(tmp_path, "new/run", steps=1), policy=make_char_policy(), make_env=SayAEnv)
    assert [h["step"] for h in history] == [1]


def test_a_failed_evaluation_keeps_its_finished_episodes(tmp_path, make_char_policy, capsys):
    # Step 1's 16 episodes, then the evaluation's third breaks: the first two (seeds 0 and 1) had finished.
    broken = env_breaking_at(EPISODES_PER_STEP + 3, RuntimeError("the retriever went away"))
    with pytest.raises(EnvError, match="the retriever went away"):
        train(train_config(tmp_path, "run", steps=1, eval_every=1, eval_episodes=4), policy=make_char_policy(),
              make_env=broken)
    kept = tmp_path / "run" / "failed-eval-step-1.episodes.jsonl"
    assert [e.seed for e in read_episodes_jsonl(kept)] == [0, 1]
    assert f"step 1's evaluation failed after 2 of 4 episodes; they are in {kept}" in capsys.readouterr().err


def test_a_stop_during_a_rollout_keeps_no_episodes(tmp_path, make_char_policy):
    # Ctrl-C in step 2's rollout after five episodes: the stop saves step 1, and the resumed
    # run redoes step 2 (with the same random states), so its five episodes are not written.
    stopped = env_breaking_at(EPISODES_PER_STEP + 6, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        train(train_config(tmp_path, "run", steps=3), policy=make_char_policy(), make_env=stopped)
    run = tmp_path / "run"
    assert json.loads((run / "checkpoint" / "state.json").read_text())["step"] == 1
    assert not list(run.glob("failed-*"))


def test_a_write_that_fails_hides_nothing(tmp_path, make_char_policy, monkeypatch, capsys):
    def full_disk(path, episodes):
        with open(path, "w", encoding="utf-8") as handle:
            handle.write('{"env_id": ')  # cut short
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(failed_rollouts, "write_episodes_jsonl", full_disk)
    broken = env_breaking_at(EPISODES_PER_STEP + 3, RuntimeError("the sandbox is gone"))
    with pytest.raises(EnvError, match="the sandbox is gone"):
        train(train_config(tmp_path, "run", steps=2), policy=make_char_policy(), make_env=broken)
    kept = tmp_path / "run" / "failed-step-2.episodes.jsonl"
    assert not kept.exists()  # no file that looks like the episodes and is not
    assert (f"rftgym train: step 2's rollout failed after 2 of 16 episodes; they could not be kept: cannot write "
            f"{kept} (No space left on device)\n") in capsys.readouterr().err


def test_each_rank_keeps_its_own_episodes(tmp_path, make_char_policy, capsys):
    from rftgym.rollout import run_episodes

    policy = make_char_policy()
    error = RuntimeError("an env of rank 1 broke")
    error.finished_episodes = run_episodes(SayAEnv, policy, [7, 8])
    rank_1 = Distributed(rank=1, world_size=2)
    with pytest.raises(RuntimeError) as raised, keeping_finished_episodes(tmp_path / "out", 3, 6, rank_1):
        raise error
    assert raised.value is error
    kept = tmp_path / "out" / "failed-step-3.rank-1.episodes.jsonl"  # made where this rank had none
    assert kept == failed_episodes_path(tmp_path / "out", 3, rank_1)
    assert [e.seed for e in read_episodes_jsonl(kept)] == [7, 8]
    assert f"rftgym train: rank 1: step 3's rollout failed after 2 of 6 episodes; they are in {kept}" \
        in capsys.readouterr().err
    assert failed_episodes_path(tmp_path, 3, Distributed()).name == "failed-step-3.episodes.jsonl"


@pytest.mark.parametrize("finished", [None, []])
def test_an_error_with_no_finished_episodes_writes_nothing(tmp_path, capsys, finished):
    error = RuntimeError("the policy's server went away")
    if finished is not None:
        error.finished_episodes = finished
    with pytest.raises(RuntimeError) as raised, keeping_finished_episodes(tmp_path, 1, 16, Distributed()):
        raise error
    assert raised.value is error and not list(tmp_path.iterdir()) and capsys.readouterr().err == ""


class NaNScoreEnv(SayAEnv):
    """SayAEnv whose turns report a process score of NaN: the rollout finishes, and PCAR's
    samples cannot be built from it (an env breaking its contract in a turn's info)."""

    def step(self, action):
        observation, reward, terminated, truncated, info = super().step(action)
        return observation, reward, terminated, truncated, {**info, "evaluation_score": float("nan")}


def test_samples_that_cannot_be_built_keep_the_whole_rollout(tmp_path, make_char_policy, capsys):
    with pytest.raises(EnvContractError, match=r"info\['evaluation_score'\] is nan") as raised:
        train(train_config(tmp_path, "run", steps=2, algo="pcar"), policy=make_char_policy(), make_env=NaNScoreEnv)
    assert getattr(raised.value, "finished_episodes", None) is None  # not a rollout's error
    kept = tmp_path / "run" / "failed-step-1.episodes.jsonl"
    episodes = list(read_episodes_jsonl(kept))
    assert len(episodes) == EPISODES_PER_STEP and all(e.turns[0].info["evaluation_score"] != 0 for e in episodes)
    assert (f"rftgym train: step 1's training samples could not be built from its {EPISODES_PER_STEP} episodes; "
            f"they are in {kept}\n") in capsys.readouterr().err


def test_a_failure_after_the_samples_keeps_no_episodes(tmp_path, make_char_policy, monkeypatch):
    # An update that breaks (here: step 2's) is no rollout's fault: its episodes are not written.
    real, calls = loop.optimise, []

    def breaking_at_step_2(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("CUDA error: an illegal memory access")
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "optimise", breaking_at_step_2)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        train(train_config(tmp_path, "run", steps=2), policy=make_char_policy(), make_env=SayAEnv)
    assert (tmp_path / "run" / "metrics.jsonl").is_file()  # step 1's result: the folder is kept
    assert not list((tmp_path / "run").glob("failed-*"))


def test_a_save_that_fails_after_a_failed_rollout_leaves_the_rollouts_error_to_report(tmp_path, make_char_policy,
                                                                                      monkeypatch, capsys):
    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    broken = env_breaking_at(EPISODES_PER_STEP + 6, RuntimeError("the sandbox is gone"))
    monkeypatch.setattr(loop, "save_checkpoint", full_disk)
    with pytest.raises(EnvError, match="the sandbox is gone"):
        train(train_config(tmp_path, "run", steps=3, save_every=100), policy=make_char_policy(), make_env=broken)
    assert "the finished steps could not be saved after this step's error" in capsys.readouterr().err
