"""A metrics row that stands for several steps (--log-every above 1): numbers computed by hand."""

from __future__ import annotations

import json

import pytest
from support import SayAEnv, train_config

from rftgym.train.loop import train
from rftgym.train.metrics_log import window_row


def test_one_step_is_its_own_row_without_its_number():
    assert window_row([{"step": 7, "reward_mean": 0.25, "format_error_rate": None}]) == {
        "reward_mean": 0.25, "format_error_rate": None}


def test_numbers_are_averaged_extremes_kept_and_the_state_is_the_last_steps():
    rows = [
        {"step": 3, "reward_mean": 0.5, "sampled_tokens_min": 4, "sampled_tokens_max": 9, "learning_rate": 1e-3,
         "epoch": 0.5, "samples": 8, "format_error_rate": None, "advantage_min": None},
        {"step": 4, "reward_mean": 0.0, "sampled_tokens_min": 2, "sampled_tokens_max": 12, "learning_rate": 5e-4,
         "epoch": 0.75, "samples": 3, "format_error_rate": 0.25, "advantage_min": -1.5},
        {"step": 5, "reward_mean": 1.0, "sampled_tokens_min": 6, "sampled_tokens_max": 7, "learning_rate": 2.5e-4,
         "epoch": 1.0, "samples": 4, "format_error_rate": 0.75, "advantage_min": -0.5,
         "eval_reward_mean": 0.4},
    ]
    row = window_row(rows)
    assert row["reward_mean"] == pytest.approx(0.5)            # (0.5 + 0 + 1) / 3
    assert row["samples"] == pytest.approx(5.0)                # (8 + 3 + 4) / 3
    assert row["sampled_tokens_min"] == 2 and row["sampled_tokens_max"] == 12
    assert row["learning_rate"] == 2.5e-4 and row["epoch"] == 1.0
    assert row["format_error_rate"] == pytest.approx(0.5)      # over the steps that had a rate: (0.25 + 0.75) / 2
    assert row["advantage_min"] == -1.5
    assert row["eval_reward_mean"] == 0.4                      # only the last step evaluated
    assert "step" not in row
    assert list(row) == ["reward_mean", "sampled_tokens_min", "sampled_tokens_max", "learning_rate", "epoch",
                         "samples", "format_error_rate", "advantage_min", "eval_reward_mean"]


def test_a_metric_no_step_has_a_number_for_stays_none_and_text_is_the_last_steps():
    row = window_row([{"step": 1, "cut_reply_rate": None, "note": "a", "flag": True},
                      {"step": 2, "cut_reply_rate": None, "note": "b", "flag": False}])
    assert row == {"cut_reply_rate": None, "note": "b", "flag": False}


def test_a_run_logging_every_second_step_writes_the_mean_of_each_pair(tmp_path, make_char_policy):
    history = train(train_config(tmp_path, "run", steps=3, log_every=2), policy=make_char_policy(),
                    make_env=SayAEnv)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 3]
    first, second, third = history
    assert rows[0]["reward_mean"] == pytest.approx((first["reward_mean"] + second["reward_mean"]) / 2)
    assert rows[0]["loss"] == pytest.approx((first["loss"] + second["loss"]) / 2)
    assert rows[0]["learning_rate"] == second["learning_rate"]
    assert rows[0]["sampled_tokens_max"] == max(first["sampled_tokens_max"], second["sampled_tokens_max"])
    assert rows[1]["reward_mean"] == pytest.approx(third["reward_mean"])  # a window of one step


KILLED_AT_STEP_3 = """
import os, signal, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from support import SayAEnv, make_char_policy, train_config
from rftgym.train.loop import train

def killed(row):  # a hard stop (an OOM kill, a preemption): nothing of the run's own runs after it
    if row["step"] == 3:
        os.kill(os.getpid(), signal.SIGKILL)

train(train_config(Path(sys.argv[1]), "run", steps=6, save_every=2, log_every=3), policy=make_char_policy(),
      make_env=SayAEnv, on_step=killed)
"""


def test_a_run_killed_between_rows_resumes_with_rows_for_every_step(tmp_path, make_char_policy):
    """The row of step 3 (steps 1 to 3) was written, the checkpoint was of step 2, and the run was
    killed: the resume dropped the row, and its own row of step 3 stood for step 3 alone, so steps 1
    and 2 were in no row."""
    import subprocess
    import sys
    from pathlib import Path

    straight = train(train_config(tmp_path, "straight", steps=6, save_every=2, log_every=3),
                     policy=make_char_policy(), make_env=SayAEnv)
    tests = Path(__file__).resolve().parents[1]
    killed = subprocess.run([sys.executable, "-c", KILLED_AT_STEP_3, str(tmp_path), str(tests)], capture_output=True,
                            text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    state = json.loads((tmp_path / "run" / "checkpoint" / "state.json").read_text())
    assert state["step"] == 2 and [row["step"] for row in state["unlogged_metrics"]] == [1, 2]
    train(train_config(tmp_path, "run", steps=6, save_every=2, log_every=3), policy=make_char_policy(),
          make_env=SayAEnv, resume=True)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    expected = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [r["step"] for r in expected] == [3, 6]
    for row, want in zip(rows, expected):
        assert row["reward_mean"] == pytest.approx(want["reward_mean"])
        assert row["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)
    assert rows[0]["reward_mean"] == pytest.approx(sum(h["reward_mean"] for h in straight[:3]) / 3)


def test_a_stop_right_after_a_checkpoint_counts_each_step_in_one_row(tmp_path, make_char_policy):
    """The stop at step 2 (a checkpoint step, not a row's) wrote its row of steps 1 and 2, and the
    checkpoint still listed them as unlogged: the resumed run's row of step 3 counted them again."""
    straight = train(train_config(tmp_path, "straight", steps=6, save_every=2, log_every=3),
                     policy=make_char_policy(), make_env=SayAEnv)

    def stopped(row):
        if row["step"] == 2:
            raise RuntimeError("enough")  # early stopping, after the checkpoint of step 2

    with pytest.raises(RuntimeError, match="enough"):
        train(train_config(tmp_path, "run", steps=6, save_every=2, log_every=3), policy=make_char_policy(),
              make_env=SayAEnv, on_step=stopped)
    train(train_config(tmp_path, "run", steps=6, save_every=2, log_every=3), policy=make_char_policy(),
          make_env=SayAEnv, resume=True)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 3, 6]
    rewards = [h["reward_mean"] for h in straight]
    assert [r["reward_mean"] for r in rows] == pytest.approx(
        [sum(rewards[:2]) / 2, rewards[2], sum(rewards[3:]) / 3])
