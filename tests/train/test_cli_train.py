"""`rftgym train` with the real default model on CPU (small settings) writes metrics and a PNG."""

from __future__ import annotations

import json

import pytest

from rftgym.cli import main


def test_train_default_model_writes_metrics_png_and_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", "rftgym/VerifiableQA-v0", "--algo", "grpo", "--steps", "1", "--tasks-per-step", "1",
                 "--group-size", "2", "--max-new-tokens", "16", "--rollout-batch-size", "2",
                 "--env-arg", "difficulties=[1]", "--output-dir", str(out), "--device", "cpu"])
    assert code == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and 0.0 <= rows[0]["reward_mean"] <= 1.0
    assert rows[0]["sampled_tokens_mean"] > 0
    assert (out / "learning_curve.png").stat().st_size > 1000
    assert (out / "checkpoint" / "trainable.pt").is_file()
    assert "reward" in capsys.readouterr().out


def test_train_refuses_to_overwrite_and_explains(tmp_path, capsys):
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "state.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "rftgym/VerifiableQA-v0", "--output-dir", str(tmp_path), "--steps", "1"])
    assert exit_info.value.code == 2
    assert "--resume" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--algo", "ppo"], "invalid choice"),
    (["--group-size", "1"], "group_size must be at least 2"),
    (["--lr", "0"], "learning_rate must be positive"),
])
def test_train_bad_arguments_say_what_is_valid(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "rftgym/VerifiableQA-v0", "--output-dir", str(tmp_path / "x"), *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
