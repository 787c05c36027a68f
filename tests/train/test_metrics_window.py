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
