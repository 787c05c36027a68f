"""TrainConfig's validation of the parallelism choice, and its path from the CLI to the loop."""

from __future__ import annotations

import json

import pytest

from rftgym.cli import main
from rftgym.core.errors import ConfigError
from rftgym.train import TrainConfig


def test_parallelism_defaults_to_ddp_and_accepts_fsdp():
    assert TrainConfig().parallelism == "ddp"
    assert TrainConfig(parallelism="fsdp").parallelism == "fsdp"
    assert TrainConfig.from_dict(TrainConfig(parallelism="fsdp").to_dict()).parallelism == "fsdp"


def test_unknown_parallelism_says_what_is_allowed_and_what_fsdp_needs():
    with pytest.raises(ConfigError, match="'ddp'.*'fsdp'.*torchrun or accelerate launch.*'zero3'"):
        TrainConfig(parallelism="zero3")


def test_env_options_are_named_by_strings_and_relative_files_are_kept_absolute(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"env_kwargs must be a dict of environment options \(by name: string keys\), "
                                          r"got \{1: 2\}") as refused:
        TrainConfig(env_kwargs={1: 2})
    assert refused.value.fields == ("env_kwargs",)
    (tmp_path / "tasks.jsonl").touch()
    monkeypatch.chdir(tmp_path)
    options = {"dataset_path": "tasks.jsonl", "corpus_path": "missing.json", "tag_path_like": "tasks.jsonl",
               "max_turns": 3}
    assert TrainConfig(env_kwargs=options).env_kwargs == {**options, "dataset_path": str(tmp_path / "tasks.jsonl")}
    assert options["dataset_path"] == "tasks.jsonl"  # the caller's dict is left as it was
    paths = TrainConfig(output_dir=tmp_path / "run", model=tmp_path / "m")  # pathlib paths, kept as strings
    assert (paths.output_dir, paths.model) == (str(tmp_path / "run"), str(tmp_path / "m"))


def test_fsdp_refuses_compile_but_takes_mlp_recompute():
    with pytest.raises(ConfigError, match="compile is not supported with parallelism='fsdp'"):
        TrainConfig(parallelism="fsdp", compile=True)
    assert TrainConfig(parallelism="fsdp", checkpoint_mlp=True, compile=False).checkpoint_mlp


def test_fsdp_without_a_launcher_explains(tmp_path, monkeypatch, make_char_policy):
    from support import SayAEnv

    from rftgym.train.loop import train

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="needs a distributed launch, e.g. torchrun"):
        train(TrainConfig(parallelism="fsdp", output_dir=str(tmp_path)), policy=make_char_policy(), make_env=SayAEnv)


def test_cli_passes_parallelism_through(tmp_path, monkeypatch, capsys):
    from rftgym import cli

    seen = {}

    def fake_train(config, resume=False, on_step=None):
        seen["config"] = config
        return []

    monkeypatch.setattr("rftgym.train.loop.train", fake_train)
    assert cli.main(["train", "rftgym/VerifiableQA-v0", "--output-dir", str(tmp_path / "run"),
                     "--parallelism", "fsdp"]) == 0
    assert seen["config"].parallelism == "fsdp"
    assert cli.main(["train", "rftgym/VerifiableQA-v0", "--output-dir", str(tmp_path / "bf16"),
                     "--dtype", "bfloat16"]) == 0
    assert seen["config"].dtype == "bfloat16"
    assert cli.main(["train", "rftgym/VerifiableQA-v0", "--output-dir", str(tmp_path / "auto")]) == 0
    assert seen["config"].dtype is None
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "rftgym/VerifiableQA-v0", "--output-dir", str(tmp_path / "x"), "--parallelism", "zero3"])
    assert exit_info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_a_run_from_python_writes_where_the_cli_would(tmp_path, monkeypatch, make_char_policy):
    import dataclasses
    import os

    from support import SayAEnv

    from rftgym.train.config import default_output_dir
    from rftgym.train.loop import train

    assert default_output_dir("rftgym/MemoryQA-v0", "dcpo") == os.path.join("runs", "train", "MemoryQA-v0-dcpo")
    assert default_output_dir("my_envs:mine/X-v0", "rft") == os.path.join("runs", "train", "X-v0-rft")
    # Decided as the run starts: a config made from another by dataclasses.replace writes elsewhere.
    base = TrainConfig(steps=1, tasks_per_step=1, group_size=2, max_new_tokens=4)
    assert base.output_dir is None and TrainConfig(output_dir="here").output_dir == "here"
    monkeypatch.chdir(tmp_path)
    for algo in ("grpo", "rloo"):
        train(dataclasses.replace(base, algo=algo), policy=make_char_policy(), make_env=SayAEnv)
    assert sorted(p.name for p in (tmp_path / "runs" / "train").iterdir()) == ["VerifiableQA-v0-grpo",
                                                                              "VerifiableQA-v0-rloo"]
    # An env made by gymnasium.make has an id: with env_id left at its default, the run is named
    # after it (it was named, and recorded, as VerifiableQA).
    import gymnasium as gym

    gym.register("test/SayA-v0", entry_point=SayAEnv)
    try:
        train(base, policy=make_char_policy(), make_env=lambda: gym.make("test/SayA-v0"))
    finally:
        gym.registry.pop("test/SayA-v0")
    state = json.loads((tmp_path / "runs" / "train" / "SayA-v0-grpo" / "checkpoint" / "state.json").read_text())
    assert state["config"]["env_id"] == "test/SayA-v0"


def test_the_number_of_checkpoints_kept_is_checked_and_named_by_its_flag(capsys):
    with pytest.raises(ConfigError, match=r"keep_checkpoints must be an int >= 0 \(0 = every one\), got -1"):
        TrainConfig(keep_checkpoints=-1)
    with pytest.raises(SystemExit) as exited:
        main(["train", "rftgym/VerifiableQA-v0", "--keep-checkpoints", "-2"])
    assert exited.value.code == 2
    assert "--keep-checkpoints must be an int >= 0" in capsys.readouterr().err
