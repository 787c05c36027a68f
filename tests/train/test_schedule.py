"""The learning-rate schedule, by hand, and the loop applying it step by step (resume included)."""

from __future__ import annotations

import json
import math

import pytest

import rftgym.train.loop as loop
from rftgym.core.errors import ConfigError
from rftgym.train import TrainConfig
from rftgym.train.schedule import learning_rate_at
from support import SayAEnv


def rates(**options):
    return [learning_rate_at(step, base=1.0, **options) for step in range(options["total_steps"])]


def test_constant_with_warmup_by_hand():
    # W = 2: (0 + 1) / 2, (1 + 1) / 2, then the base.
    assert rates(total_steps=4, warmup_steps=2) == [0.5, 1.0, 1.0, 1.0]
    assert rates(total_steps=3) == [1.0, 1.0, 1.0]


def test_linear_decay_by_hand():
    # W = 1, total 5: p = (step - 1) / 4 -> 0, 1/4, 1/2, 3/4; min_ratio 0.2: 0.2 + 0.8 * (1 - p)
    assert rates(total_steps=5, schedule="linear", warmup_steps=1, min_ratio=0.2) == pytest.approx(
        [1.0, 1.0, 0.8, 0.6, 0.4])
    assert rates(total_steps=4, schedule="linear") == pytest.approx([1.0, 0.75, 0.5, 0.25])


def test_cosine_decay_by_hand():
    # No warm-up, total 4: p = 0, 1/4, 1/2, 3/4 -> (1 + cos(pi p)) / 2 = 1, 0.853553, 0.5, 0.146447
    assert rates(total_steps=4, schedule="cosine") == pytest.approx([1.0, 0.8535534, 0.5, 0.1464466], abs=1e-7)
    # min_ratio 0.1 raises the floor: 0.1 + 0.9 * share
    got = rates(total_steps=4, schedule="cosine", min_ratio=0.1)
    assert got == pytest.approx([1.0, 0.1 + 0.9 * 0.8535534, 0.55, 0.1 + 0.9 * 0.1464466], abs=1e-7)
    assert learning_rate_at(3, base=2e-5, total_steps=4, schedule="cosine") == pytest.approx(
        2e-5 * (1 + math.cos(math.pi * 0.75)) / 2)


def test_bad_schedules_are_refused():
    with pytest.raises(ConfigError, match="lr schedule"):
        learning_rate_at(0, base=1.0, total_steps=2, schedule="step")
    with pytest.raises(ConfigError, match="warmup_steps"):
        learning_rate_at(0, base=1.0, total_steps=2, warmup_steps=3)
    with pytest.raises(ConfigError, match="min_lr_ratio"):
        learning_rate_at(0, base=1.0, total_steps=2, schedule="linear", min_ratio=1.5)
    with pytest.raises(ConfigError, match="lr_schedule"):
        TrainConfig(lr_schedule="exponential")
    with pytest.raises(ConfigError, match="warmup_steps"):
        TrainConfig(steps=4, warmup_steps=5)
    with pytest.raises(ConfigError, match="min_lr_ratio"):
        TrainConfig(min_lr_ratio=-0.1)


def test_the_loop_steps_at_the_scheduled_rate_and_resumes_on_it(tmp_path, make_char_policy, monkeypatch):
    seen = []
    real_optimise = loop.optimise

    def recording(model, reference, optimizer, *args, **kwargs):
        seen.append({group["lr"] for group in optimizer.param_groups})
        return real_optimise(model, reference, optimizer, *args, **kwargs)

    monkeypatch.setattr(loop, "optimise", recording)

    def config(steps, **overrides):
        return TrainConfig(steps=steps, tasks_per_step=2, group_size=4, max_new_tokens=4, learning_rate=1e-2,
                           minibatch_size=8, output_dir=str(tmp_path / "run"), save_every=100, lr_schedule="cosine",
                           warmup_steps=1, min_lr_ratio=0.1, log_every=2, **overrides)

    # Three steps of a run, stopped there (its checkpoint says step 3)...
    first = loop.train(config(3), policy=make_char_policy(), make_env=SayAEnv)
    # ...then continued as a 5-step run: steps 4 and 5 (indices 3 and 4) follow the 5-step schedule.
    second = loop.train(config(5), policy=make_char_policy(), make_env=SayAEnv, resume=True)
    expected_first = [learning_rate_at(s, base=1e-2, total_steps=3, schedule="cosine", warmup_steps=1, min_ratio=0.1)
                      for s in range(3)]
    expected_second = [learning_rate_at(s, base=1e-2, total_steps=5, schedule="cosine", warmup_steps=1,
                                        min_ratio=0.1) for s in (3, 4)]
    assert seen == [{rate} for rate in expected_first + expected_second]
    assert [h["learning_rate"] for h in first + second] == expected_first + expected_second
    # log_every=2: the metrics file has every second step and each run's last, by number.
    rows = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows == [2, 3, 4, 5]
