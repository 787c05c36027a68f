"""A stopped run keeps the steps it finished: Ctrl-C (or SIGTERM, SIGHUP through the CLI) before a
step's update saves the steps before it, one during the update is held until the step is saved,
and a second one stops at once. Each resume then reproduces the uninterrupted run."""

from __future__ import annotations

import json
import os
import signal

import pytest
from support import SayAEnv, train_config

from rftgym.train import loop
from rftgym.train.loop import train
from rftgym.train.metrics_log import read_metrics


def config(tmp_path, name, **overrides):
    return train_config(tmp_path, name, **{"steps": 5, "save_every": 100, **overrides})


def saved_step(run) -> int:
    return json.loads((run / "checkpoint" / "state.json").read_text())["step"]


def assert_resume_reproduces(straight, resumed, first_step):
    """``resumed``, from a checkpoint at step ``first_step``, has the rest of ``straight``'s rows."""
    assert [h["step"] for h in resumed] == list(range(first_step + 1, len(straight) + 1))
    assert_same_rows(straight[first_step:], resumed)


def assert_same_rows(expected, rows):
    assert [r["step"] for r in rows] == [r["step"] for r in expected]
    for a, b in zip(expected, rows, strict=True):
        assert b["reward_mean"] == a["reward_mean"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)


def test_a_stop_during_a_rollout_saves_the_steps_before_it(tmp_path, make_char_policy, monkeypatch, capsys):
    straight = train(config(tmp_path, "straight"), policy=make_char_policy(), make_env=SayAEnv)
    real_run_episodes, calls = loop.run_episodes, []

    def stopped_in_step_3(*args, **kwargs):
        episodes = real_run_episodes(*args, **kwargs)  # its sampling is done: the random states moved on
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return episodes

    monkeypatch.setattr(loop, "run_episodes", stopped_in_step_3)
    run = tmp_path / "stopped"
    # log_every=2 logs steps 2 and 4 (and a run's last): the stop writes its last step's row, step 3's.
    with pytest.raises(KeyboardInterrupt):
        train(config(tmp_path, "stopped", log_every=2), policy=make_char_policy(), make_env=SayAEnv)
    assert "stopping; saving the checkpoint after step 3 first" in capsys.readouterr().err  # said at once
    assert saved_step(run) == 3
    assert [row["step"] for row in read_metrics(run / "metrics.jsonl")] == [2, 3]
    assert (run / "learning_curve.png").stat().st_size > 1000
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    monkeypatch.setattr(loop, "run_episodes", real_run_episodes)
    resumed = train(config(tmp_path, "stopped", log_every=2), policy=make_char_policy(), make_env=SayAEnv,
                    resume=True)
    assert_resume_reproduces(straight, resumed, 3)
    # The resumed run logs steps 4 and 5 after those the checkpoint kept, none twice.
    assert [row["step"] for row in read_metrics(run / "metrics.jsonl")] == [2, 3, 4, 5]


def test_a_stop_during_an_update_is_held_until_the_step_is_saved(tmp_path, make_char_policy, monkeypatch, capsys):
    straight = train(config(tmp_path, "straight"), policy=make_char_policy(), make_env=SayAEnv)
    real_optimise, calls = loop.optimise, []

    def stopped_in_update_2(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, as the weights change
        return real_optimise(*args, **kwargs)

    monkeypatch.setattr(loop, "optimise", stopped_in_update_2)
    run = tmp_path / "stopped"
    shown = []
    with pytest.raises(KeyboardInterrupt):
        train(config(tmp_path, "stopped"), policy=make_char_policy(), make_env=SayAEnv, on_step=shown.append)
    # The notice says what a second stop would lose: every step since the last checkpoint (none yet).
    assert "stopping once this step is done and saved (its update, metrics and checkpoint); interrupt again to " \
           "stop now without saving, losing steps 1 to 2 (no checkpoint yet)" in capsys.readouterr().err
    assert [h["step"] for h in shown] == [1, 2] and len(calls) == 2  # step 2 finished; step 3 never began
    assert saved_step(run) == 2
    assert [row["step"] for row in read_metrics(run / "metrics.jsonl")] == [1, 2]

    monkeypatch.setattr(loop, "optimise", real_optimise)
    resumed = train(config(tmp_path, "stopped"), policy=make_char_policy(), make_env=SayAEnv, resume=True)
    assert_resume_reproduces(straight, resumed, 2)
    # Its metrics.jsonl: steps 1 to 5 once each, as the uninterrupted run's.
    assert_same_rows(read_metrics(tmp_path / "straight" / "metrics.jsonl"), read_metrics(run / "metrics.jsonl"))


def test_a_second_stop_during_an_update_stops_at_once_without_the_step(tmp_path, make_char_policy, monkeypatch,
                                                                        capsys):
    real_optimise, calls = loop.optimise, []

    def stopped_twice_in_update_2(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)  # and again: do not wait
            raise AssertionError("the second interrupt did not stop the run")
        return real_optimise(*args, **kwargs)

    monkeypatch.setattr(loop, "optimise", stopped_twice_in_update_2)
    run = tmp_path / "stopped"
    with pytest.raises(KeyboardInterrupt):
        train(config(tmp_path, "stopped", save_every=1), policy=make_char_policy(), make_env=SayAEnv)
    assert "losing step 2 (the last checkpoint is at step 1)" in capsys.readouterr().err
    assert saved_step(run) == 1  # the last checkpoint it wrote, not a half-updated step
    assert [row["step"] for row in read_metrics(run / "metrics.jsonl")] == [1]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_stop_during_a_step_end_checkpoint_says_only_that_it_finishes_the_checkpoint(tmp_path, make_char_policy,
                                                                                         monkeypatch, capsys):
    from rftgym.train import checkpoint

    real_save, saves = checkpoint._save_checkpoint, []

    def stopped_while_writing(*args, **kwargs):
        saves.append(kwargs["step"])
        if len(saves) == 2:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C as step 2's checkpoint is written
        return real_save(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "_save_checkpoint", stopped_while_writing)
    run = tmp_path / "stopped"
    with pytest.raises(KeyboardInterrupt):
        train(config(tmp_path, "stopped", save_every=1), policy=make_char_policy(), make_env=SayAEnv)
    err = capsys.readouterr().err
    assert "finishing the checkpoint being written, then stopping" in err
    # Step 2 is done and saved: no notice that it is still to finish, or that a second stop loses it.
    assert "stopping once this step is done" not in err and "losing" not in err
    assert saves == [1, 2] and saved_step(run) == 2
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_stop_before_any_step_finished_leaves_nothing(tmp_path, make_char_policy, monkeypatch):
    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "run_episodes", stopped)
    with pytest.raises(KeyboardInterrupt):
        train(config(tmp_path, "stopped"), policy=make_char_policy(), make_env=SayAEnv)
    assert not (tmp_path / "stopped").exists()  # so that the same command simply starts again


def test_cli_sighup_saves_and_names_the_checkpoint(tmp_path, monkeypatch, make_char_policy, capsys):
    """The terminal closed: the run stops as after Ctrl-C, with its finished steps saved."""
    from rftgym import cli
    from rftgym.cli import train as cli_train

    calls = []
    real_optimise = loop.optimise

    def hung_up_in_update_2(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGHUP)
        return real_optimise(*args, **kwargs)

    real_train = loop.train
    monkeypatch.setattr(loop, "optimise", hung_up_in_update_2)
    monkeypatch.setattr(loop, "train", lambda config, **kw: real_train(config, policy=make_char_policy(),
                                                                       make_env=SayAEnv, **kw))
    monkeypatch.setattr(cli_train, "_make_env", lambda *a: SayAEnv())
    # SIGHUP as a terminal leaves it: the tests may run under nohup, which ignores it, and the CLI
    # leaves an ignored SIGHUP ignored (test_sighup_that_nohup_ignores_stays_ignored).
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        out = tmp_path / "run"
        code = cli.main(["train", "rftgym/VerifiableQA-v0", "--output-dir", str(out), "--steps", "4",
                         "--tasks-per-step", "2", "--group-size", "8", "--max-new-tokens", "8", "--save-every", "100"])
        assert code == 128 + signal.SIGHUP
        assert f"hung up (SIGHUP): the checkpoint in {out}/checkpoint is at step 2; run the same command with " \
               "--resume" in capsys.readouterr().err
        assert saved_step(out) == 2
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL  # the CLI's handler is gone again
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_sighup_that_nohup_ignores_stays_ignored():
    from rftgym.cli.sigterm import _restore_handlers, _stop_on_sigterm

    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        replaced = _stop_on_sigterm()
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN and signal.SIGHUP not in replaced
        assert callable(signal.getsignal(signal.SIGTERM))
        _restore_handlers(replaced)
    finally:
        signal.signal(signal.SIGHUP, before)


# Under a launch of several ranks (LaunchStops): a stop is noted where it arrives and acted on
# where every rank is. The ranks here are a stand-in that answers the one collective alone.
class TwoRanks:
    is_main = True

    def __init__(self, peer_signal: int = 0):
        self.peer_signal, self.asked = peer_signal, []

    def max_int(self, value: int) -> int:
        self.asked.append(value)
        return max(value, self.peer_signal)


class Stopped(KeyboardInterrupt):
    pass


def stopping_on_sigterm():
    """A SIGTERM handler as the CLI's: it raises, naming the signal."""
    def terminated(signum, frame):
        raise Stopped(signum)

    return signal.signal(signal.SIGTERM, terminated)


def test_a_launch_notes_a_stop_and_stops_every_rank_where_they_meet(capsys):
    from rftgym.train.stopping import LaunchStops

    before, kept = stopping_on_sigterm(), []
    try:
        stops = LaunchStops(TwoRanks(), enabled=True)
        with stops.noting():
            stops.stop_if_asked(lambda: kept.append("nothing to keep"))  # no stop yet: goes on
            os.kill(os.getpid(), signal.SIGTERM)  # noted, not raised, wherever this rank is
            os.kill(os.getpid(), signal.SIGTERM)  # a launcher forwarding the same stop: no second one
            assert kept == [] and stops.ranks.asked == [0]
            with pytest.raises(Stopped) as raised:
                stops.stop_if_asked(lambda: kept.append("finished steps"))
        assert kept == ["finished steps"] and raised.value.args == (signal.SIGTERM,)
        assert stops.ranks.asked == [0, signal.SIGTERM]
        assert "stopping every rank once they reach the end of this step's rollout" in capsys.readouterr().err
    finally:
        signal.signal(signal.SIGTERM, before)
    assert signal.getsignal(signal.SIGTERM) is before  # restored by the block


def test_a_stop_on_another_rank_stops_this_one_as_its_own_handler_would():
    from rftgym.train.stopping import LaunchStops

    before, kept = stopping_on_sigterm(), []
    try:
        stops = LaunchStops(TwoRanks(peer_signal=signal.SIGTERM), enabled=True)
        with stops.noting(), pytest.raises(Stopped):
            stops.stop_if_asked(lambda: kept.append("finished steps"))
        assert kept == ["finished steps"]
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_second_stop_later_than_the_first_ends_a_rank_at_once(monkeypatch, capsys):
    """Its process ends there: an exception would go through the process group's goodbyes, which
    waited on a peer inside a collective with this rank for the group's timeout (30 min on CPU)."""
    from rftgym.train import stopping

    class Exited(BaseException):
        pass

    def exit_now(status):
        raise Exited(status)

    before, now = stopping_on_sigterm(), [100.0]
    monkeypatch.setattr(stopping.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(stopping.os, "_exit", exit_now)
    try:
        stops = stopping.LaunchStops(TwoRanks(), enabled=True)
        with stops.noting():
            os.kill(os.getpid(), signal.SIGTERM)
            now[0] += stopping.SAME_STOP_S + 1  # the user asks again, past the launcher's forwarding
            with pytest.raises(Exited) as exited:
                os.kill(os.getpid(), signal.SIGTERM)
        assert exited.value.args == (128 + signal.SIGTERM,)
        assert "rftgym train: rank 0: stopped at once (a second stop)" in capsys.readouterr().err
    finally:
        signal.signal(signal.SIGTERM, before)


def test_one_process_leaves_stops_to_the_step_itself():
    from rftgym.train.stopping import LaunchStops

    before = stopping_on_sigterm()
    handler = signal.getsignal(signal.SIGTERM)
    try:
        stops = LaunchStops(TwoRanks(peer_signal=signal.SIGTERM), enabled=False)
        with stops.noting():
            assert signal.getsignal(signal.SIGTERM) is handler  # a stop raises where it arrives
            stops.stop_if_asked(lambda: pytest.fail("one process keeps its steps where it stops"))
        assert stops.ranks.asked == []
    finally:
        signal.signal(signal.SIGTERM, before)
