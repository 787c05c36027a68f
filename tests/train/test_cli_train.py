"""`rftgym train` with the real default model on CPU (small settings) writes metrics and a PNG."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rftgym.cli import TRAIN_FLAGS, UsageError, build_parser, given_train_flags, main, train_config_from_args
from rftgym.core.errors import ConfigError
from rftgym.train import TrainConfig


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
    printed = capsys.readouterr()
    assert "reward" in printed.out
    # Each step says it is done as it ends (the table comes at the end of the run).
    assert re.search(rf"^step 1/1: reward {rows[0]['reward_mean']:.3f}  success [0-9.]+  loss \S+  [0-9.]+ s$",
                     printed.err, re.M), printed.err


def test_a_steps_number_is_the_same_on_stderr_in_the_rows_metrics_and_table(tmp_path, capsys, monkeypatch,
                                                                              make_char_policy):
    """Step N is the Nth step wherever the run shows it: 1 and 2 for a 2-step run."""
    from support import SayAEnv

    from rftgym.train import loop

    real_train, returned = loop.train, []

    def on_the_tiny_model(config, resume=False, on_step=None):  # the CLI's run, quick on CPU
        returned.extend(real_train(config, policy=make_char_policy(), make_env=SayAEnv, resume=resume,
                                   on_step=on_step))
        return returned

    monkeypatch.setattr(loop, "train", on_the_tiny_model)
    out = tmp_path / "run"
    assert main(["train", "rftgym/VerifiableQA-v0", "--steps", "2", "--tasks-per-step", "1", "--group-size", "2",
                 "--max-new-tokens", "4", "--output-dir", str(out), "--device", "cpu"]) == 0
    printed = capsys.readouterr()
    shown = [int(n) for n in re.findall(r"^step (\d+)/2: reward", printed.err, re.M)]
    logged = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    header, _rule, *body = printed.out.split("\nmetrics: ")[0].splitlines()
    assert header.split()[0] == "step"
    tabled = [int(line.split()[0]) for line in body if not line.startswith("note:")]
    assert shown == [h["step"] for h in returned] == logged == tabled == [1, 2]
    # The loss to 3 significant digits, so a tiny one (GSPO's narrow clip) does not read as 0.000.
    losses = [line.split()[3] for line in body if not line.startswith("note:")]
    assert losses == ["-" if h["loss"] is None else f"{h['loss']:.3g}" for h in returned]


def test_train_says_when_episodes_ran_out_of_context(tmp_path, capsys):
    out = tmp_path / "run"
    with pytest.warns(UserWarning, match="max_prompt_tokens=10"):
        code = main(["train", "rftgym/VerifiableQA-v0", "--steps", "1", "--tasks-per-step", "1", "--group-size", "2",
                     "--max-new-tokens", "8", "--max-prompt-tokens", "10", "--output-dir", str(out), "--device", "cpu"])
    assert code == 0
    assert json.loads((out / "metrics.jsonl").read_text())["context_full_rate"] == 1.0
    assert "note: in 1 of 1 steps some episodes ended because the context left no room" in capsys.readouterr().out


def test_train_refuses_to_overwrite_and_explains(tmp_path, capsys):
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "state.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "rftgym/VerifiableQA-v0", "--output-dir", str(tmp_path), "--steps", "1"])
    assert exit_info.value.code == 2
    assert "--resume" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--algo", "ppo"], "invalid choice"),
    (["--group-size", "1"], "--group-size must be at least 2"),
    (["--lr", "0"], "--lr must be positive"),
    (["--steps", "4", "--warmup-steps", "5"], "--warmup-steps must be an int in [0, steps]"),
    (["--lr-schedule", "step"], "invalid choice"),
    (["--aggregation", "mean"], "invalid choice"),
    (["--min-lr-ratio", "2"], "--min-lr-ratio must be in [0, 1]"),
])
def test_train_bad_arguments_say_what_is_valid(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "rftgym/VerifiableQA-v0", "--output-dir", str(tmp_path / "x"), *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_every_train_config_field_has_a_flag():
    covered = {field_name for _, field_name, _ in TRAIN_FLAGS} | {"env_id", "env_kwargs", "seed"}
    assert covered == set(TrainConfig.__dataclass_fields__)


def test_train_defaults_are_the_configs():
    args = build_parser().parse_args(["train", "rftgym/VerifiableQA-v0"])
    assert train_config_from_args(args) == TrainConfig(env_id="rftgym/VerifiableQA-v0",
                                                       output_dir="runs/train/VerifiableQA-v0-grpo")


def test_train_flags_reach_the_config():
    args = build_parser().parse_args([
        "train", "rftgym/SearchEvalQA-v0", "--algo", "pcar", "--lr", "3e-6", "--lr-schedule", "cosine",
        "--warmup-steps", "2", "--min-lr-ratio", "0.1", "--weight-decay", "0.01", "--clip-low", "0.1",
        "--clip-high", "0.3", "--aggregation", "sequence_mean", "--no-filter-zero-variance", "--filter-overlong",
        "--pcar-lambda", "0.7", "--pcar-delta", "0.2", "--lora-rank", "8",
        "--lora-alpha", "32", "--compile", "on", "--compile-scope", "decoder",
        "--checkpoint-mlp", "on", "--dtype", "bfloat16", "--log-every", "3",
        "--top-p", "0.9", "--max-grad-norm", "0.5", "--logprob-chunk-size", "256", "--env-arg", "max_searches=2",
        "--seed", "5", "--epochs", "2", "--microbatch-size", "4", "--gradient-checkpointing"])
    config = train_config_from_args(args)
    expected = dict(algo="pcar", learning_rate=3e-6, lr_schedule="cosine", warmup_steps=2, min_lr_ratio=0.1,
                    weight_decay=0.01, clip_low=0.1, clip_high=0.3, aggregation="sequence_mean",
                    filter_zero_variance=False, filter_overlong=True, pcar_lambda=0.7, pcar_delta=0.2,
                    lora_rank=8, lora_alpha=32.0, compile=True,
                    compile_scope="decoder", checkpoint_mlp=True,
                    dtype="bfloat16", log_every=3, top_p=0.9, max_grad_norm=0.5, logprob_chunk_size=256,
                    env_kwargs={"max_searches": 2}, seed=5, epochs_per_step=2, microbatch_size=4,
                    gradient_checkpointing=True, output_dir="runs/train/SearchEvalQA-v0-pcar")
    assert {name: getattr(config, name) for name in expected} == expected
    args = build_parser().parse_args(["train", "rftgym/MemoryQA-v0", "--algo", "dcpo", "--dcpo-segment-budget", "3"])
    assert train_config_from_args(args).dcpo_segment_budget == 3
    args = build_parser().parse_args(["train", "rftgym/VerifiableQA-v0", "--old-logprobs", "recompute",
                                      "--rollout-is-cap", "2"])
    assert (train_config_from_args(args).old_logprobs, train_config_from_args(args).rollout_is_cap) == ("recompute", 2.0)


def test_stop_strings_come_from_repeated_flags_a_config_file_or_the_checkpoint(tmp_path):
    out = tmp_path / "run"
    first = _config_of(["train", "rftgym/SearchEvalQA-v0", "--stop", "</search>", "--stop", "</answer>",
                        "--output-dir", str(out)])
    assert first.stop == ("</search>", "</answer>")
    assert _config_of(["train", "rftgym/SearchEvalQA-v0"]).stop == ()
    _fake_checkpoint(out, first)  # saved as a JSON list, read back as the tuple
    assert _config_of(["train", "rftgym/SearchEvalQA-v0", "--resume", "--output-dir", str(out)]).stop == first.stop
    assert _config_of(["train", "rftgym/SearchEvalQA-v0", "--resume", "--stop", "</search>", "--output-dir",
                       str(out)]).stop == ("</search>",)
    file = tmp_path / "c.json"
    file.write_text(json.dumps({"stop": "</search>"}))  # one string, not its characters
    assert _config_of(["train", "rftgym/SearchEvalQA-v0", "--config", str(file)]).stop == ("</search>",)
    file.write_text(json.dumps({"stop": [3]}))
    with pytest.raises(UsageError, match=r"--config .*c\.json: stop strings must be non-empty strings .*got \[3\]"):
        _config_of(["train", "rftgym/SearchEvalQA-v0", "--config", str(file)])


def _config_of(argv: list[str]) -> TrainConfig:
    args = build_parser().parse_args(argv)
    args.given = given_train_flags(argv)
    return train_config_from_args(args)


def test_a_resume_takes_the_flags_it_does_not_give_from_the_checkpoint(tmp_path):
    out = tmp_path / "run"
    first = _config_of(["train", "rftgym/MemoryQA-v0", "--algo", "dcpo", "--group-size", "2", "--max-new-tokens",
                        "16", "--lr", "3e-6", "--compile", "off", "--seed", "7", "--env-arg", "max_turns=2",
                        "--env-arg", "budget_tokens=900", "--output-dir", str(out)])
    (out / "checkpoint").mkdir(parents=True)
    (out / "checkpoint" / "state.json").write_text(json.dumps({"step": 2, "config": first.to_dict()}))
    resumed = _config_of(["train", "rftgym/MemoryQA-v0", "--resume", "--steps", "40", "--lr", "1e-6",
                          "--env-arg", "max_turns=3", "--output-dir", str(out)])
    # given: steps, lr, one env option; the rest is the checkpoint's, not TrainConfig's defaults
    assert (resumed.steps, resumed.learning_rate) == (40, 1e-6)
    assert (resumed.algo, resumed.group_size, resumed.max_new_tokens, resumed.compile, resumed.seed) == \
        ("dcpo", 2, 16, False, 7)
    assert resumed.env_kwargs == {"max_turns": 3, "budget_tokens": 900}
    # a flag given with its default value is still given
    again = _config_of(["train", "rftgym/MemoryQA-v0", "--resume", "--group-size", "8", "--seed", "0",
                        "--output-dir", str(out)])
    assert (again.group_size, again.seed) == (8, 0)
    # without --resume, or with nothing to resume, the defaults stand
    assert _config_of(["train", "rftgym/MemoryQA-v0", "--output-dir", str(out)]).group_size == TrainConfig.group_size
    assert _config_of(["train", "rftgym/MemoryQA-v0", "--resume", "--output-dir",
                       str(tmp_path / "none")]).algo == TrainConfig.algo


def test_a_resume_of_another_envs_run_is_refused_for_its_env_not_for_options_it_never_gave(
        tmp_path, capsys, monkeypatch, make_char_policy):
    from rftgym.train import loop

    real_train = loop.train
    # The env the command names, with its options (the tiny model's context is too short for its
    # prompts: the step runs out of context, and still checkpoints).
    monkeypatch.setattr(loop, "train", lambda config, resume=False, on_step=None: real_train(
        config, policy=make_char_policy(), resume=resume, on_step=on_step))
    out = tmp_path / "run"
    assert main(["train", "rftgym/VerifiableQA-v0", "--steps", "1", "--tasks-per-step", "1", "--group-size", "2",
                 "--max-new-tokens", "4", "--env-arg", "difficulties=[1]", "--output-dir", str(out),
                 "--device", "cpu"]) == 0
    capsys.readouterr()
    # VerifiableQA's difficulties is not SearchEvalQA's to take: the resume is refused for its env.
    assert _config_of(["train", "rftgym/SearchEvalQA-v0", "--resume", "--output-dir", str(out)]).env_kwargs == {}
    with pytest.raises(SystemExit) as stopped:
        main(["train", "rftgym/SearchEvalQA-v0", "--resume", "--output-dir", str(out)])
    assert stopped.value.code == 2
    said = capsys.readouterr().err
    assert "was written with env_id='rftgym/VerifiableQA-v0'" in said and "difficulties" not in said, said


def test_a_resume_finds_a_model_given_by_a_relative_path_from_another_directory(tmp_path, monkeypatch):
    model = tmp_path / "models" / "m"
    model.mkdir(parents=True)
    out = tmp_path / "run"
    first = _config_of(["train", "rftgym/VerifiableQA-v0", "--model", "models/m", "--output-dir", str(out)])
    (out / "checkpoint").mkdir(parents=True)
    (out / "checkpoint" / "state.json").write_text(json.dumps({"step": 1, "config": first.to_dict(),
                                                               "base_model_path": str(model)}))
    monkeypatch.chdir(out)  # not where models/m is
    assert _config_of(["train", "rftgym/VerifiableQA-v0", "--resume", "--output-dir", str(out)]).model == str(model)
    # given on the command line, it is taken as given
    assert _config_of(["train", "rftgym/VerifiableQA-v0", "--resume", "--model", "models/m", "--output-dir",
                       str(out)]).model == "models/m"
    # moved away: said, with where it was and what to give
    model.rename(tmp_path / "models" / "moved")
    with pytest.raises(ConfigError, match=f"base model was loaded from {model}, which is no directory now"):
        _config_of(["train", "rftgym/VerifiableQA-v0", "--resume", "--output-dir", str(out)])
    assert _config_of(["train", "rftgym/VerifiableQA-v0", "--resume", "--model", str(tmp_path / "models" / "moved"),
                       "--output-dir", str(out)]).model == str(tmp_path / "models" / "moved")


def test_a_resume_finds_an_env_file_given_by_a_relative_path_from_another_directory(tmp_path, monkeypatch):
    (tmp_path / "ds.jsonl").write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    first = _config_of(["train", "rftgym/VerifiableQA-v0", "--env-arg", "dataset_path=ds.jsonl", "--output-dir",
                        str(out)])
    assert first.env_kwargs == {"dataset_path": str(tmp_path / "ds.jsonl")}
    _fake_checkpoint(out, first)
    monkeypatch.chdir(out)  # not where ds.jsonl is
    resumed = _config_of(["train", "rftgym/VerifiableQA-v0", "--resume", "--output-dir", str(out)])
    assert resumed.env_kwargs == {"dataset_path": str(tmp_path / "ds.jsonl")}
    # A path naming no file here is the env's to refuse, as given; other options are untouched.
    options = _config_of(["train", "rftgym/VerifiableQA-v0", "--env-arg", "dataset_path=missing.jsonl",
                          "--env-arg", "difficulties=[1]"]).env_kwargs
    assert options == {"dataset_path": "missing.jsonl", "difficulties": [1]}


def _fake_checkpoint(out: Path, config) -> None:
    (out / "checkpoint").mkdir(parents=True)
    (out / "checkpoint" / "state.json").write_text(json.dumps({"step": 1, "config": config.to_dict()}))


def test_a_resume_without_output_dir_or_algo_finds_the_envs_one_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    pcar = _config_of(["train", "rftgym/SearchEvalQA-v0", "--algo", "pcar", "--group-size", "3"])
    assert pcar.output_dir == str(Path("runs/train/SearchEvalQA-v0-pcar"))
    _fake_checkpoint(tmp_path / pcar.output_dir, pcar)
    resumed = _config_of(["train", "rftgym/SearchEvalQA-v0", "--resume"])
    assert (resumed.output_dir, resumed.algo, resumed.group_size) == (pcar.output_dir, "pcar", 3)
    # --algo names the folder, as without --resume
    assert _config_of(["train", "rftgym/SearchEvalQA-v0", "--resume", "--algo", "grpo"]).output_dir == \
        str(Path("runs/train/SearchEvalQA-v0-grpo"))
    # two runs with checkpoints: which one is the user's to say
    grpo = _config_of(["train", "rftgym/SearchEvalQA-v0", "--algo", "grpo"])
    _fake_checkpoint(tmp_path / grpo.output_dir, grpo)
    with pytest.raises(UsageError, match=r"2 runs of rftgym/SearchEvalQA-v0 have a checkpoint .*--output-dir"):
        _config_of(["train", "rftgym/SearchEvalQA-v0", "--resume"])


def test_gradient_checkpointing_can_be_turned_off_on_resume(tmp_path):
    out = tmp_path / "run"
    first = _config_of(["train", "rftgym/VerifiableQA-v0", "--gradient-checkpointing", "--output-dir", str(out)])
    assert first.gradient_checkpointing
    _fake_checkpoint(out, first)
    assert _config_of(["train", "rftgym/VerifiableQA-v0", "--resume", "--output-dir", str(out)]).gradient_checkpointing
    assert not _config_of(["train", "rftgym/VerifiableQA-v0", "--resume", "--no-gradient-checkpointing",
                           "--output-dir", str(out)]).gradient_checkpointing


def test_the_evaluation_takes_env_options_of_its_own(tmp_path, capsys):
    argv = ["train", "rftgym/VerifiableQA-v0", "--env-arg", "difficulties=[1]", "--eval-every", "2",
            "--eval-env-arg", "difficulties=[5]", "--eval-env-arg", "kinds=[\"weekday\"]"]
    config = _config_of(argv)
    assert config.env_kwargs == {"difficulties": [1]}
    assert config.eval_env_kwargs == {"difficulties": [5], "kinds": ["weekday"]}
    with pytest.raises(UsageError, match="--eval-env-arg takes KEY=VALUE"):
        _config_of(argv + ["--eval-env-arg", "oops"])
    with pytest.raises(UsageError, match=r"^--eval-env-arg=.* is only read with --eval-every > 0"):
        _config_of(["train", "rftgym/VerifiableQA-v0", "--eval-env-arg", "difficulties=[5]"])
    # A resume's --eval-env-arg pairs update the checkpoint's evaluation options, as --env-arg's do its env's.
    out = tmp_path / "resumed"
    _fake_checkpoint(out, _config_of(argv + ["--output-dir", str(out)]))
    resumed = _config_of(["train", "rftgym/VerifiableQA-v0", "--resume", "--output-dir", str(out), "--eval-env-arg",
                          "max_attempts=2"])
    assert resumed.eval_env_kwargs == {"difficulties": [5], "kinds": ["weekday"], "max_attempts": 2}
    assert _config_of(["train", "rftgym/VerifiableQA-v0", "--resume", "--output-dir", str(out)]).eval_env_kwargs == \
        {"difficulties": [5], "kinds": ["weekday"]}
    # a resume that turns evaluation off leaves the saved evaluation options unread, not refused
    assert _config_of(["train", "rftgym/VerifiableQA-v0", "--resume", "--output-dir", str(out), "--eval-every",
                       "0"]).eval_env_kwargs == {}
    # a bad one is named by its flag before any model loads
    with pytest.raises(SystemExit) as refused:
        main(["train", "rftgym/VerifiableQA-v0", "--eval-every", "1", "--eval-env-arg", "difficultys=[5]",
              "--output-dir", str(tmp_path / "run")])
    assert refused.value.code == 2
    assert "bad --eval-env-arg for rftgym/VerifiableQA-v0: unknown option 'difficultys' (did you mean " \
           "'difficulties'?)" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_config_file_sets_what_no_flag_gives_json_or_yaml(tmp_path):
    settings = {"algo": "dr_grpo", "learning_rate": 3e-6, "tasks_per_step": 2, "compile": False, "dtype": "float32",
                "env_kwargs": {"difficulties": [1, 2], "max_turns": 2}, "seed": 4, "steps": 7}
    json_file = tmp_path / "run.json"
    json_file.write_text(json.dumps(settings))
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("algo: dr_grpo\nlearning_rate: 3.0e-6\ntasks_per_step: 2\ncompile: false\ndtype: float32\n"
                         "env_kwargs:\n  difficulties: [1, 2]\n  max_turns: 2\nseed: 4\nsteps: 7\n")
    for file in (json_file, yaml_file):
        config = _config_of(["train", "rftgym/VerifiableQA-v0", "--config", str(file), "--steps", "9",
                             "--env-arg", "max_turns=3"])
        assert (config.algo, config.learning_rate, config.tasks_per_step, config.compile, config.dtype,
                config.seed) == ("dr_grpo", 3e-6, 2, False, "float32", 4)
        assert config.steps == 9   # the flag given wins
        assert config.env_kwargs == {"difficulties": [1, 2], "max_turns": 3}   # the flag's pair over the file's
        assert config.output_dir == "runs/train/VerifiableQA-v0-dr_grpo"   # the file's algorithm names it


@pytest.mark.parametrize("content, message", [
    ('{"lr": 1e-6}', r"has keys that are no TrainConfig field: 'lr'.*\(learning_rate, not --lr\)"),
    ('{"learnig_rate": 1e-6}', r"'learnig_rate' \(did you mean 'learning_rate'\?\)"),
    ("[1, 2]", "must hold a mapping of TrainConfig settings"),
    ("{not json", "is not valid JSON"),
    ('{"steps": 0}', r"--config .*run.json: .*steps"),
    ('{"compile": "yes"}', "compile must be true, false or null"),
    ('{"env_kwargs": [1]}', "env_kwargs must be a mapping of env options"),
    ('{"env_id": "rftgym/MemoryQA-v0"}', "is not the ENV given"),
])
def test_a_bad_config_file_is_a_usage_error_that_says_what_is_wrong(tmp_path, content, message):
    file = tmp_path / "run.json"
    file.write_text(content)
    with pytest.raises(UsageError, match=message):
        _config_of(["train", "rftgym/VerifiableQA-v0", "--config", str(file)])


def test_an_unknown_env_option_is_named_by_where_it_came_from(tmp_path, capsys):
    file = tmp_path / "run.yaml"
    file.write_text("env_kwargs: {datset: generated}\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("env_kwargs: {dataset: mbpp, dataset_path: 5}\n")
    base = ["train", "rftgym/CodeTCG-v0", "--output-dir", str(tmp_path / "out")]
    for flags, said in ((["--config", str(file)], f"bad --config {file}'s env_kwargs for rftgym/CodeTCG-v0: unknown "
                                                  "option 'datset' (did you mean 'dataset'?)"),
                        (["--env-arg", "datset=generated"], "bad --env-arg for rftgym/CodeTCG-v0: unknown option"),
                        # a file's value is JSON's own: no advice on how a flag's value is read
                        (["--config", str(bad)], f"--config {bad}'s env_kwargs dataset_path: dataset_path must be a "
                                                 "path to a file (a string or a pathlib path), got 5\n")):
        with pytest.raises(SystemExit) as refused:
            main([*base, *flags])
        assert refused.value.code == 2 and said in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_missing_config_file_is_named(tmp_path):
    with pytest.raises(UsageError, match=r"--config: cannot read .*nope.json"):
        _config_of(["train", "rftgym/VerifiableQA-v0", "--config", str(tmp_path / "nope.json")])


def test_a_yaml_exponent_is_a_number_and_a_namespace_without_main_keeps_its_flags(tmp_path):
    file = tmp_path / "run.yaml"
    file.write_text("learning_rate: 1e-6\nsteps: 7\nenv_id: rftgym/VerifiableQA-v0\n")   # YAML 1.1: '1e-6' is text
    assert _config_of(["train", "rftgym/VerifiableQA-v0", "--config", str(file)]).learning_rate == 1e-6
    # train_config_from_args on a namespace main() did not make: a flag off its default still wins.
    args = build_parser().parse_args(["train", "rftgym/VerifiableQA-v0", "--config", str(file), "--steps", "9"])
    assert train_config_from_args(args).steps == 9
