"""The `rftgym` command under bad input: a message that says what was wrong and what to do
(exit 2 for bad input, 1 for a model that cannot be used), no traceback, and nothing the user
had (a model directory, a checkpoint) overwritten or changed."""

from __future__ import annotations

import json

import pytest

import rftgym  # noqa: F401
from rftgym.cli import main
from rftgym.core.records import read_episodes_jsonl
from rftgym.train.config import TrainConfig

ENV_ID = "rftgym/VerifiableQA-v0"


def exit_code(argv) -> int:
    with pytest.raises(SystemExit) as excinfo:
        main(argv)
    return excinfo.value.code


@pytest.fixture
def model_dir(tmp_path, make_char_policy):
    """A tiny model saved as a Hugging Face model directory."""
    folder = tmp_path / "model"
    policy = make_char_policy()
    policy.model.save_pretrained(folder)
    policy.tokenizer.save_pretrained(folder)
    return folder


def listing(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def fake_checkpoint(run, config: dict, files=("trainable.pt", "optimizer.pt", "rng.pt"), **state):
    """A checkpoint folder whose state.json holds ``config`` (and no checksums), with placeholder
    ``files``: whole files as torch.save writes them, of nothing."""
    import torch

    folder = run / "checkpoint"
    folder.mkdir(parents=True)
    (folder / "state.json").write_text(json.dumps({"step": 1, "config": config, **state}))
    for name in files:
        torch.save({}, folder / name)
    return folder


def test_an_evaluation_of_a_run_notes_the_env_options_it_trained_with_and_leaves_out(tmp_path, capsys):
    import argparse

    from rftgym.cli.agents import _say_which_run

    run = tmp_path / "run"
    fake_checkpoint(run, TrainConfig(env_id="rftgym/CodeTCG-v0", env_kwargs={"dataset": "generated",
                                                                             "difficulties": [1, 2]}).to_dict())

    def noted(*env_args):
        args = argparse.Namespace(model=str(run), env=["rftgym/CodeTCG-v0"], env_arg=list(env_args),
                                  max_new_tokens=128, flags_given=("max_new_tokens",))
        _say_which_run(args)
        return capsys.readouterr().err

    # (pairs a shell passes whole, each read back as the value it was)
    assert "note: the run trained with env options this evaluation does not give (dataset, difficulties); add " \
           "--env-arg dataset=generated --env-arg 'difficulties=[1,2]' to evaluate it on what it trained on" in noted()
    assert "note:" not in noted("dataset=generated", "difficulties=[1,2]")


# ---------------------------------------------------------------- names

@pytest.mark.parametrize("typed", ["rftgym/VerifiableQA-v1", "VerifiableQA-v0", "rftgym/verifiableqa-v0"])
def test_a_mistyped_env_id_names_the_registered_one(typed, capsys):
    assert exit_code(["eval", typed, "--agent", "random"]) == 2
    assert f"unknown environment {typed!r} (did you mean rftgym/VerifiableQA-v0?)" in capsys.readouterr().err
    assert exit_code(["eval", "rftgym/Nope-v0", "--agent", "random"]) == 2  # like no other: no guess
    assert "unknown environment 'rftgym/Nope-v0'; rftgym's environments" in capsys.readouterr().err


@pytest.mark.parametrize("typed, meant", [("max_turn", "max_turns"), ("max_episode_step", "max_episode_steps")])
def test_a_mistyped_env_arg_names_the_option(typed, meant, capsys):
    assert exit_code(["eval", ENV_ID, "--agent", "random", "--env-arg", f"{typed}=3"]) == 2
    assert f"unknown option {typed!r} (did you mean {meant!r}?). Valid options: kinds," in capsys.readouterr().err


def test_a_path_read_as_a_json_number_is_told_how_to_write_it_once(capsys):
    assert exit_code(["eval", ENV_ID, "--agent", "random", "--episodes", "1", "--env-arg", "dataset_path=123"]) == 2
    err = capsys.readouterr().err
    assert "dataset_path must be a path to a file (a string or a pathlib path), got 123 (--env-arg values are read as " \
           "JSON, so dataset_path=123 is not a string; for the string give --env-arg dataset_path='\"123\"')" in err
    assert err.count("JSON") == 1  # one hint, not the env's and the command line's


@pytest.mark.parametrize("pair, said", [
    ("system_prompt=42", "system_prompt must be a string or None, got int (--env-arg values are read as JSON, so "
                         "system_prompt=42 is not a string; for the string give --env-arg system_prompt='\"42\"')"),
    ("difficulties=1,2", "(--env-arg values are read as JSON; for a list give --env-arg difficulties='[1, 2]')"),
    ("kinds=arithmetic,sequence", "(--env-arg values are read as JSON; for a list give --env-arg "
                                  "kinds='[\"arithmetic\", \"sequence\"]')"),
    ("system_prompt=", "--env-arg system_prompt= has no value; give one, leave the option out for its default, or "
                       "give --env-arg system_prompt='\"\"' for an empty string"),
])
def test_an_env_arg_read_as_json_against_its_meaning_says_how_to_write_it(pair, said, tmp_path, capsys):
    out = tmp_path / "eval.jsonl"
    assert exit_code(["eval", ENV_ID, "--agent", "random", "--episodes", "1", "--env-arg", pair,
                      "--out", str(out)]) == 2
    assert said in capsys.readouterr().err
    assert not out.exists()
    # Written as the hint says, the option is taken.
    fixed = {"system_prompt=42": 'system_prompt="42"', "difficulties=1,2": "difficulties=[1, 2]",
             "kinds=arithmetic,sequence": 'kinds=["arithmetic", "sequence"]', "system_prompt=": 'system_prompt=""'}
    assert main(["eval", ENV_ID, "--agent", "random", "--episodes", "1", "--env-arg", fixed[pair],
                 "--out", str(out)]) == 0


@pytest.mark.parametrize("command", ["eval", "train", "play"])
def test_a_gymnasium_env_that_is_not_an_rftgym_env_is_refused_before_any_model_loads(command, tmp_path, capsys):
    argv = [command, "CartPole-v1"] + {"eval": ["--agent", "random", "--out", str(tmp_path / "e.jsonl")],
                                       "train": ["--output-dir", str(tmp_path / "run")], "play": []}[command]
    assert exit_code(argv) == 2
    said = capsys.readouterr().err
    assert "CartPole-v1 is not an rftgym environment: its observation space is a Box, where an rftgym env's " \
           "observation is the chat context" in said and "rftgym/VerifiableQA-v0" in said
    assert "Loading" not in said and list(tmp_path.iterdir()) == []


def test_eval_seeds_past_the_last_one_are_refused(capsys):
    assert exit_code(["eval", ENV_ID, "--agent", "random", "--episodes", "2", "--seed", str(2**63 - 1)]) == 2
    assert f"would run seeds past 2^63 - 1; give a --seed of at most {2**63 - 2}" in capsys.readouterr().err


def test_an_api_base_with_an_open_bracket_is_a_usage_error(capsys):
    assert exit_code(["eval", ENV_ID, "--agent", "api", "--api-model", "m", "--api-base", "http://[::1/v1"]) == 2
    err = capsys.readouterr().err
    assert "--api-base 'http://[::1/v1' is not a valid URL (Invalid IPv6 URL)" in err and "Traceback" not in err


# ---------------------------------------------------------------- what the user had

def test_train_refuses_to_write_its_run_into_the_model_directory(model_dir, capsys):
    before = listing(model_dir)
    assert exit_code(["train", ENV_ID, "--model", str(model_dir), "--output-dir", str(model_dir), "--steps", "1",
                      "--device", "cpu"]) == 2
    assert f"the output directory {model_dir} holds a model (config.json)" in capsys.readouterr().err
    assert listing(model_dir) == before  # no checkpoint, lock or logs: it is still only a model


def test_train_refuses_to_write_its_run_into_a_folder_of_lora_adapters(tmp_path, capsys):
    adapters = tmp_path / "adapters"  # as rftgym export --adapter-only (peft) writes them
    adapters.mkdir()
    (adapters / "adapter_config.json").write_text("{}")
    (adapters / "adapter_model.safetensors").write_bytes(b"")
    before = listing(adapters)
    assert exit_code(["train", ENV_ID, "--output-dir", str(adapters), "--steps", "1"]) == 2
    assert f"the output directory {adapters} holds LoRA adapters (adapter_config.json)" in capsys.readouterr().err
    assert listing(adapters) == before


def test_a_run_that_is_its_own_base_model_is_named_not_recursed_into(model_dir, capsys):
    # What a run with --output-dir in its --model directory left (before train refused that).
    fake_checkpoint(model_dir, TrainConfig(env_id=ENV_ID, model=str(model_dir)).to_dict(),
                    base_model_path=str(model_dir))
    assert main(["eval", ENV_ID, "--agent", "hf", "--model", str(model_dir), "--device", "cpu", "--episodes", "1",
                 "--out", str(model_dir.parent / "eval.jsonl")]) == 1
    err = capsys.readouterr().err
    assert f"the run in {model_dir} is its own base model ({model_dir} -> {model_dir})" in err
    assert "Traceback" not in err and "RecursionError" not in err
    assert main(["export", str(model_dir), str(model_dir.parent / "exported")]) == 1
    assert "is its own base model" in capsys.readouterr().err
    assert not (model_dir.parent / "exported").exists()


@pytest.mark.filterwarnings("ignore:a prompt is longer than the policy answers")
def test_eval_never_writes_its_episodes_over_a_file_of_the_model(model_dir, capsys):
    config = (model_dir / "config.json").read_text()
    assert exit_code(["eval", ENV_ID, "--agent", "hf", "--model", str(model_dir), "--device", "cpu",
                      "--out", str(model_dir / "config.json")]) == 2
    assert f"--out {model_dir / 'config.json'} is a file of the --model directory" in capsys.readouterr().err
    assert (model_dir / "config.json").read_text() == config
    assert not (model_dir / "config.json.partial").exists()
    # An earlier evaluation's episodes beside the model are replaced as anywhere else.
    out = model_dir / "eval.jsonl"
    for seed in ("0", "1"):
        assert main(["eval", ENV_ID, "--agent", "hf", "--model", str(model_dir), "--device", "cpu", "--episodes", "1",
                     "--max-new-tokens", "2", "--seed", seed, "--out", str(out)]) == 0
    assert [e.seed for e in read_episodes_jsonl(out)] == [1]


def test_a_resume_refuses_saved_settings_it_would_replace_by_defaults(tmp_path, model_dir, monkeypatch, capsys):
    from rftgym.agents.hf_policy import HFPolicy

    run = tmp_path / "run"
    saved = {**TrainConfig(env_id=ENV_ID, model=str(model_dir), group_size=2, tasks_per_step=1,
                           minibatch_size=2).to_dict(), "group_size": "two"}  # state.json edited by hand
    fake_checkpoint(run, saved, files=("trainable.pt", "rng.pt"))
    before = (run / "checkpoint" / "state.json").read_text()

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(HFPolicy, "from_pretrained", classmethod(no_model))
    assert exit_code(["train", ENV_ID, "--resume", "--output-dir", str(run), "--steps", "3"]) == 2
    err = capsys.readouterr().err
    assert f"the settings saved with the checkpoint in {run} (the 'config' of checkpoint/state.json) are refused: " \
           "group_size must be an integer, got 'two'" in err
    assert "give --group-size to set it for this run" in err
    # The flag mends it; the checkpoint's missing file is then refused, still before the model loads.
    assert exit_code(["train", ENV_ID, "--resume", "--output-dir", str(run), "--steps", "3", "--group-size", "2"]) == 2
    err = capsys.readouterr().err
    assert f"the checkpoint in {run} is incomplete: {run / 'checkpoint'} has no optimizer.pt" in err
    # A bad value given now is the flag's, not the checkpoint's, and said as a new run says it.
    for flags, said in ((["--group-size", "2", "--lr", "5"], "error: --lr must be positive and at most 1"),
                        (["--group-size", "1"], "error: --group-size must be at least 2 for grpo")):
        assert exit_code(["train", ENV_ID, "--resume", "--output-dir", str(run), *flags]) == 2
        err = capsys.readouterr().err
        assert said in err and "saved with the checkpoint" not in err, err
    assert (run / "checkpoint" / "state.json").read_text() == before


@pytest.mark.parametrize("damage, said, fix", [
    ("cut short", "checkpoint/trainable.pt is not the file its save wrote",
     "restore the file from a copy, or give another model directory"),
    ("deleted", "checkpoint has no trainable.pt (the trained weights: deleted, or a copy cut short)",
     "restore the file from a copy, or give another model directory"),
    ("cut short, saved without checksums", "checkpoint/trainable.pt is damaged: it is not a whole file as "
     "torch.save writes it", "restore the file from a copy, or give another model directory"),
    ("unreadable state", "checkpoint/state.json is unreadable",
     "restore state.json from a copy, or give another model directory"),
])
def test_a_damaged_run_given_as_model_is_bad_input_said_before_any_model_loads(tmp_path, model_dir, make_char_policy,
                                                                                 monkeypatch, capsys, damage, said, fix):
    from support import SayAEnv, train_config

    from rftgym.agents.hf_policy import HFPolicy
    from rftgym.train.loop import train

    run = tmp_path / "run"
    train(train_config(tmp_path, "run", steps=1, tasks_per_step=1, group_size=2, minibatch_size=2,
                       model=str(model_dir)), policy=make_char_policy(), make_env=SayAEnv)
    checkpoint = run / "checkpoint"
    if damage == "cut short, saved without checksums":  # (as before rftgym kept them)
        state = json.loads((checkpoint / "state.json").read_text())
        del state["files"]
        (checkpoint / "state.json").write_text(json.dumps(state))
    if damage.startswith("cut short"):
        weights = (checkpoint / "trainable.pt").read_bytes()
        (checkpoint / "trainable.pt").write_bytes(weights[: len(weights) // 2])
    elif damage == "deleted":
        (checkpoint / "trainable.pt").unlink()
    else:
        (checkpoint / "state.json").write_text('{"step": 1, "config": {')
    before = listing(run)

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(HFPolicy, "from_pretrained", classmethod(no_model))
    for command in (["eval", ENV_ID, "--agent", "hf", "--out", str(tmp_path / "eval.jsonl")],
                    ["train", ENV_ID, "--steps", "1", "--output-dir", str(tmp_path / "again")]):
        assert exit_code([*command, "--model", str(run), "--device", "cpu"]) == 2  # as a resume of it says
        err = capsys.readouterr().err
        assert f"rftgym {command[0]}: error: --model: " in err and said in err and fix in err
        assert "Traceback" not in err
    # Exporting the run refuses it the same way, before its base model loads.
    assert exit_code(["export", str(run), str(tmp_path / "exported")]) == 2
    err = capsys.readouterr().err
    assert "rftgym export: error: " in err and said in err and "Traceback" not in err
    assert listing(run) == before and not (tmp_path / "eval.jsonl").exists() and not (tmp_path / "again").exists()
    assert not (tmp_path / "exported").exists()


# ---------------------------------------------------------------- data files in another shape

def test_a_json_file_given_for_json_lines_is_named_as_one(tmp_path, capsys):
    pretty = tmp_path / "tasks.jsonl"
    pretty.write_text(json.dumps([{"question": "1+1?", "answer": "2"}], indent=2))
    assert exit_code(["eval", ENV_ID, "--agent", "random", "--env-arg", f"dataset_path={pretty}"]) == 2
    err = capsys.readouterr().err
    assert f"{pretty}:1: the JSON value goes on past the end of the line, and JSON lines holds each object whole " \
           "on one line (is this a JSON file" in err and "cut short" not in err
    listed = tmp_path / "listed.jsonl"
    listed.write_text(json.dumps([{"question": "1+1?", "answer": "2"}]) + "\n")
    assert exit_code(["eval", ENV_ID, "--agent", "random", "--env-arg", f"dataset_path={listed}"]) == 2
    assert "got list (a JSON list: JSON lines holds each object on a line of its own" in capsys.readouterr().err
    # A last line cut short is still named as such.
    cut = tmp_path / "cut.jsonl"
    cut.write_text('{"question": "1+1?", "answer": "2"}\n{"question": "2+2?", "ans\n\n')
    assert exit_code(["eval", ENV_ID, "--agent", "random", "--env-arg", f"dataset_path={cut}"]) == 2
    assert f"{cut}:2: not valid JSON" in capsys.readouterr().err
    # A record in the middle missing its closing brace: that line, and no talk of a JSON file.
    unclosed = tmp_path / "unclosed.jsonl"
    unclosed.write_text('{"question": "1+1?", "answer": "2"}\n{"question": "3+3?", "answer": "6"\n'
                        '{"question": "4+4?", "answer": "8"}\n')
    assert exit_code(["eval", ENV_ID, "--agent", "random", "--env-arg", f"dataset_path={unclosed}"]) == 2
    err = capsys.readouterr().err
    assert f"{unclosed}:2: not valid JSON (Expecting ',' delimiter); the line ends before its object does (a " \
           "missing closing '}'" in err and "JSON file" not in err


def test_a_corpus_and_a_question_file_given_in_each_others_place_say_so(tmp_path, capsys):
    corpus = tmp_path / "corpus.json"
    corpus.write_text(json.dumps({"Ada": ["Ada was born in 1815."], "Bob": ["Bob was born in 1900."]}))
    questions = tmp_path / "questions.jsonl"
    questions.write_text(json.dumps({"id": "q1", "question": "When was Ada born?", "golden_answers": ["1815"]}) + "\n")
    flashrag = tmp_path / "passages.jsonl"
    flashrag.write_text(json.dumps({"id": "1", "contents": '"Ada"\nAda was born in 1815.'}) + "\n")
    base = ["eval", "rftgym/SearchEvalQA-v0", "--agent", "random", "--env-arg"]
    assert exit_code([*base, f"dataset_path={corpus}"]) == 2
    assert "got a corpus of {title: [sentences]} (this is a corpus, not questions: an env reads a corpus from " \
           "corpus_path, its questions from dataset_path)" in capsys.readouterr().err
    assert exit_code([*base, f"dataset_path={flashrag}"]) == 2
    assert "(this is a corpus, not questions" in capsys.readouterr().err
    assert exit_code([*base, f"dataset_path={questions}", "--env-arg", f"corpus_path={questions}"]) == 2
    assert "needs 'id' and a string 'contents' (this holds questions, not documents" in capsys.readouterr().err


def test_another_datasets_file_given_as_mbpp_is_named(tmp_path, capsys):
    questions = tmp_path / "nq.jsonl"
    questions.write_text(json.dumps({"id": "q1", "question": "Who?", "golden_answers": ["Ada"]}) + "\n")
    humaneval = tmp_path / "humaneval.jsonl"
    humaneval.write_text(json.dumps({"task_id": "HumanEval/0", "prompt": "def f():\n", "entry_point": "f",
                                     "canonical_solution": "    return 1\n", "test": ""}) + "\n")
    base = ["eval", "rftgym/CodeTCG-v0", "--agent", "random", "--env-arg", "dataset=mbpp", "--env-arg"]
    assert exit_code([*base, f"dataset_path={questions}"]) == 2
    assert f"{questions}:1: not an MBPP task (its fields: 'id', 'question', 'golden_answers'); expected one " \
           "{task_id, text, code, test_list" in capsys.readouterr().err
    assert exit_code([*base, f"dataset_path={humaneval}"]) == 2
    assert "(a HumanEval record: dataset=humaneval reads a file of HumanEval's format)" in capsys.readouterr().err
    mbpp = tmp_path / "mbpp.jsonl"
    mbpp.write_text(json.dumps({"task_id": 1, "text": "t", "code": "def f():\n    return 1\n",
                                "test_list": ["assert f() == 1"]}) + "\n")
    assert exit_code(["eval", "rftgym/CodeTCG-v0", "--agent", "random", "--env-arg", f"dataset_path={mbpp}"]) == 2
    assert f"{mbpp}:1: not a HumanEval task (its fields: 'task_id', 'text', 'code', 'test_list') (an MBPP record: " \
           "add dataset=mbpp)" in capsys.readouterr().err


def test_export_of_a_run_whose_state_cannot_be_read_says_which_file(tmp_path, capsys):
    broken = tmp_path / "broken"
    fake_checkpoint(broken, {})
    (broken / "checkpoint" / "state.json").write_text('{"step": 1, "config": {')  # cut short
    assert exit_code(["export", str(broken), str(tmp_path / "out")]) == 2
    assert f"cannot export the checkpoint in {broken}: {broken / 'checkpoint' / 'state.json'} is unreadable" in \
        capsys.readouterr().err
    edited = tmp_path / "edited"
    fake_checkpoint(edited, {**TrainConfig(env_id=ENV_ID).to_dict(), "group_size": "two"})
    assert exit_code(["export", str(edited), str(tmp_path / "out")]) == 2
    assert f"the settings saved with the checkpoint in {edited} (the 'config' of checkpoint/state.json) are refused: " \
           "group_size must be an integer" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- refusals that leave nothing behind

def test_train_names_the_flag_of_a_setting_the_model_refuses_and_leaves_no_run_behind(tmp_path, model_dir, capsys):
    run = tmp_path / "runs" / "run"
    assert exit_code(["train", ENV_ID, "--model", str(model_dir), "--output-dir", str(run), "--steps", "1",
                      "--device", "cpu", "--max-new-tokens", "100000"]) == 2
    assert "rftgym train: error: --max-new-tokens=100000 does not fit the model's context of 512 " \
           "tokens" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # no empty tensorboard/, no .lock: the folders it made are gone too


def test_gymnasium_makes_own_id_is_refused_as_an_env_arg_and_render_mode_is_an_option(tmp_path, capsys):
    assert exit_code(["eval", ENV_ID, "--agent", "random", "--env-arg", "id=x"]) == 2
    err = capsys.readouterr().err
    assert "--env-arg id: 'id' is gymnasium.make's own parameter (the environment's id, which the ENV argument " \
           "gives), so no environment can take an option of that name" in err and "multiple values" not in err
    # render_mode reaches the env (its own modes), and is named when mistyped.
    assert main(["eval", ENV_ID, "--agent", "random", "--episodes", "1", "--env-arg", "render_mode=ansi",
                 "--out", str(tmp_path / "e.jsonl")]) == 0
    assert exit_code(["eval", ENV_ID, "--agent", "random", "--env-arg", "render_mod=ansi"]) == 2
    assert "unknown option 'render_mod' (did you mean 'render_mode'?)" in capsys.readouterr().err


AGENT_SOURCE = """
from rftgym.agents.base import Agent, AgentReply


class Answers4(Agent):
    def act(self, contexts):
        return [AgentReply(text="<answer>4</answer>") for _ in contexts]
"""


def test_eval_never_writes_its_episodes_over_the_code_of_an_agent_or_env_of_your_own(tmp_path, monkeypatch, capsys):
    from support import ECHO_MODULE

    (tmp_path / "agents_of_mine.py").write_text(AGENT_SOURCE)
    (tmp_path / "envs_of_mine.py").write_text(ECHO_MODULE.replace("mine/Echo-v0", "mine/EchoOfMine-v0"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for out, module, named_by in [
        ("agents_of_mine.py", "agents_of_mine", "--agent agents_of_mine:Answers4"),
        ("sub/../envs_of_mine.py", "envs_of_mine", "the environment envs_of_mine:mine/EchoOfMine-v0"),
    ]:
        before = (tmp_path / f"{module}.py").read_text()
        assert exit_code(["eval", "envs_of_mine:mine/EchoOfMine-v0", "--agent", "agents_of_mine:Answers4",
                          "--episodes", "1", "--out", out]) == 2
        assert f"--out {out} is the source of the Python module {module!r}, imported for {named_by}; the " \
               "evaluation would overwrite that code with its episodes" in capsys.readouterr().err
        assert (tmp_path / f"{module}.py").read_text() == before
    assert not list(tmp_path.glob("*.partial")) and not (tmp_path / "sub").exists()


def test_a_mistyped_id_of_your_own_is_suggested_with_its_module(tmp_path, monkeypatch, capsys):
    from support import ECHO_MODULE

    (tmp_path / "zebra_envs.py").write_text(ECHO_MODULE.replace("mine/Echo-v0", "mine/Zebrafish-v0"))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert exit_code(["eval", "zebra_envs:mine/Zebrafsh-v0", "--agent", "random", "--episodes", "1"]) == 2
    assert "unknown environment 'zebra_envs:mine/Zebrafsh-v0' (did you mean zebra_envs:mine/Zebrafish-v0?)" \
        in capsys.readouterr().err
    # the suggestion runs as it is written; rftgym's own ids need no module
    assert main(["eval", "zebra_envs:mine/Zebrafish-v0", "--agent", "random", "--episodes", "1",
                 "--out", str(tmp_path / "e.jsonl")]) == 0
    assert exit_code(["eval", "zebra_envs:rftgym/VerifiableQA-v1", "--agent", "random"]) == 2
    assert "(did you mean rftgym/VerifiableQA-v0?)" in capsys.readouterr().err
    # an id far from any: what the module registers is listed
    assert exit_code(["eval", "zebra_envs:mine/Other-v0", "--agent", "random"]) == 2
    assert "unknown environment 'zebra_envs:mine/Other-v0'; the environments of zebra_envs: " \
           "zebra_envs:mine/Zebrafish-v0; rftgym's " in capsys.readouterr().err
    (tmp_path / "no_envs.py").write_text("VALUE = 1\n")
    assert exit_code(["eval", "no_envs:mine/Other-v0", "--agent", "random"]) == 2
    assert "; no registered environment's entry point is in no_envs; rftgym's environments: " \
        in capsys.readouterr().err


NAMELESS_AGENTS = """
from rftgym.agents.base import Agent, AgentReply


class Answers4(Agent):
    def act(self, contexts):
        return [AgentReply(text="<answer>4</answer>") for _ in contexts]


class Crashes(Agent):
    def act(self, contexts):
        raise ZeroDivisionError("inside the agent")


class Named(Answers4):
    name = "my-named-agent"
"""


def test_an_agent_of_your_own_without_a_name_is_called_as_you_gave_it(tmp_path, monkeypatch, capsys):
    (tmp_path / "nameless_agents.py").write_text(NAMELESS_AGENTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    for agent, shown in [("nameless_agents:Answers4", "nameless_agents:Answers4"),
                         ("nameless_agents:Named", "my-named-agent")]:
        assert main(["eval", ENV_ID, "--agent", agent, "--episodes", "1", "--out", str(tmp_path / "e.jsonl")]) == 0
        assert capsys.readouterr().out.splitlines()[2].split()[1] == shown  # the table's agent column
    assert main(["eval", ENV_ID, "--agent", "nameless_agents:Crashes", "--episodes", "1",
                 "--out", str(tmp_path / "e.jsonl")]) == 1
    assert "agent 'nameless_agents:Crashes' raised ZeroDivisionError: inside the agent" in capsys.readouterr().err


@pytest.mark.parametrize("agent", [["--agent", "hf", "--model", "/nonexistent/model"],
                                   ["--agent", "api", "--api-base", "http://127.0.0.1:9/v1", "--api-model", "m"]])
def test_sampling_only_flags_at_temperature_0_are_refused(agent, tmp_path, capsys):
    for flags, named in [(["--top-p", "0.9"], "--top-p applies"),
                         (["--sample-seed", "3", "--temperature", "0"], "--sample-seed applies"),
                         (["--top-p", "0.9", "--sample-seed", "none"], "--top-p and --sample-seed apply")]:
        assert exit_code(["eval", ENV_ID, *agent, *flags, "--out", str(tmp_path / "e.jsonl")]) == 2
        err = capsys.readouterr().err
        assert f"{named} only to sampling, and --agent {agent[1]} decodes greedily at --temperature 0" in err
        assert "give --temperature above 0, or drop" in err
    assert list(tmp_path.iterdir()) == []


def test_a_server_that_samples_at_api_extras_temperature_takes_the_sampling_flags():
    from rftgym.cli import build_parser
    from rftgym.cli.agents import _check_agent_flags

    _check_agent_flags(build_parser().parse_args(["eval", ENV_ID, "--agent", "api", "--api-base", "http://h/v1",
                                                  "--api-model", "m", "--api-extra", '{"temperature": 0.7}',
                                                  "--top-p", "0.9", "--sample-seed", "3"]))


def test_an_unreachable_docker_engine_names_the_local_sandbox_flag(monkeypatch, capsys):
    pytest.importorskip("docker")
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/rftgym-docker.sock")
    assert main(["eval", "rftgym/CodeTCG-v0", "--agent", "random", "--episodes", "1",
                 "--env-arg", "sandbox=docker"]) == 1
    assert "no docker engine is reachable" in (err := capsys.readouterr().err)
    assert "(on the command line: --env-arg sandbox=local)" in err


@pytest.mark.parametrize("argv, usage, message", [
    (["train", ENV_ID, "--stepz", "1"], "usage: rftgym train",
     "rftgym train: error: unrecognized arguments: --stepz 1 (did you mean --steps?)"),
    (["eval", ENV_ID, "--agent", "random", "--episodez=3"], "usage: rftgym eval",
     "rftgym eval: error: unrecognized arguments: --episodez=3 (did you mean --episodes?)"),
    (["envs", "--all"], "usage: rftgym envs", "rftgym envs: error: unrecognized arguments: --all\n"),
])
def test_an_unknown_flag_is_reported_by_its_subcommand(argv, usage, message, capsys):
    assert exit_code(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(usage) and message in err and "{envs," not in err
    assert len(err.splitlines()) <= 6, err  # train's some 80 options are --help's to list, not the error's


@pytest.mark.parametrize("argv, said", [
    (["train", ENV_ID, "--steps", "0"], "rftgym train: error: --steps must be a positive integer, got 0\n"),
    (["eval", "rftgym/CodeTCG-v0", "--agent", "random", "--env-arg", "dataset=generatd"],
     "rftgym eval: error: --env-arg dataset: dataset must be one of ('humaneval', 'mbpp', 'generated'), got "
     "'generatd'\n"),
])
def test_a_refused_value_is_named_by_the_flag_that_gave_it_once(argv, said, capsys):
    assert exit_code(argv) == 2
    assert capsys.readouterr().err.endswith(said)


@pytest.mark.parametrize("argv, said", [
    (["train", ENV_ID, "--ste", "3"], "--ste 3 (did you mean --steps?)"),
    (["train", ENV_ID, "--max", "3"], "--max 3 (did you mean --max-new-tokens or --max-prompt-tokens or "
                                      "--max-grad-norm?)"),
    (["eval", ENV_ID, "--epi=3"], "--epi=3 (did you mean --episodes?)"),
    (["export", "RUN", "OUT", "--base", "DIR"], "--base DIR (did you mean --base-model?)"),
    (["serve-retriever", "--po", "8000"], "--po 8000 (did you mean --port?)"),
    (["play", ENV_ID, "--env", "k=v"], "--env k=v (did you mean --env-arg?)"),
])
def test_an_abbreviated_flag_is_refused_naming_the_flags_it_begins(argv, said, capsys):
    """argparse would take a prefix of a flag for the flag: a command that means another thing,
    or nothing, once a flag is added."""
    from rftgym.cli import build_parser

    for defaults in (True, False):  # (the parse of the flags given too)
        with pytest.raises(SystemExit) as refused:
            build_parser(defaults=defaults).parse_args(argv)
        assert refused.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(f"usage: rftgym {argv[0]}")
        assert f"rftgym {argv[0]}: error: unrecognized arguments: {said}" in err


@pytest.mark.parametrize("flag, value, said", [("--algo", "rft", "algo='grpo'"), ("--lora-rank", "4", "--lora-rank=0")])
def test_a_resume_that_changes_what_the_checkpoint_is_names_the_flag(tmp_path, flag, value, said, capsys):
    run = tmp_path / "run"
    fake_checkpoint(run, TrainConfig(env_id=ENV_ID, output_dir=str(run)).to_dict())
    assert exit_code(["train", ENV_ID, "--resume", "--output-dir", str(run), "--steps", "3", flag, value]) == 2
    assert f"rftgym train: error: {flag}: the checkpoint in {run} was written with {said}; this run has " \
           in capsys.readouterr().err


def test_export_into_a_place_that_cannot_be_written_is_refused_before_the_model_loads(tmp_path, model_dir,
                                                                                         make_char_policy, monkeypatch,
                                                                                         capsys):
    """An OUT where no folder can be made (read-only; /proc, even for root) failed with a
    traceback after the model had loaded, when the export made its folder beside OUT."""
    import os
    from pathlib import Path

    from support import SayAEnv, train_config

    import rftgym.train.export as export_module
    from rftgym.train.loop import train

    if os.geteuid() != 0:
        place = tmp_path / "read-only"
        place.mkdir()
        place.chmod(0o500)
    elif Path("/proc/self").is_dir():
        place = Path("/proc")
    else:
        pytest.skip("no place that root cannot write")
    train(train_config(tmp_path, "run", steps=1, tasks_per_step=1, group_size=2, minibatch_size=2,
                       model=str(model_dir)), policy=make_char_policy(), make_env=SayAEnv)

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(export_module, "_rebuild", no_model)
    out = place / "rftgym-exported" / "model"
    assert exit_code(["export", str(tmp_path / "run"), str(out)]) == 2
    err = capsys.readouterr().err
    assert f"rftgym export: error: {out} cannot be made: {place} cannot be written (" in err
    assert "Traceback" not in err and not out.parent.exists()


def test_a_refusal_names_the_fields_it_speaks_of_by_their_flags():
    from rftgym.cli.common import _flagged
    from rftgym.core.errors import ConfigError

    flags = {"lora_alpha": "--lora-alpha", "lora_rank": "--lora-rank", "steps": "--steps", "env_id": "ENV"}
    said = _flagged(ConfigError("lora_alpha=8.0 is only read with lora_rank > 0 (TrainConfig.lora_rank, "
                                "not my_lora_rank or --lora-rank-x); steps stay words; env_id too",
                                field="lora_alpha"), flags)
    assert str(said) == ("--lora-alpha=8.0 is only read with --lora-rank > 0 (TrainConfig.lora_rank, not my_lora_rank "
                         "or --lora-rank-x); steps stay words; env_id too")
    # A message that does not begin with its flag gets it in front.
    assert str(_flagged(ConfigError("the rate lora_alpha is too big", field="lora_alpha"), flags)) == \
        "--lora-alpha: the rate --lora-alpha is too big"
    assert _flagged(ConfigError("no field of a flag", field="other"), flags) is None
    # Not inside a path or a quoted value; a message that begins with a longer flag is prefixed.
    said = _flagged(ConfigError("the checkpoint in runs/lora_rank=16 has lora_rank=8, got 'lora_rank' and "
                                "{'lora_alpha': 3}", field="lora_rank"), flags)
    assert str(said) == ("--lora-rank: the checkpoint in runs/lora_rank=16 has --lora-rank=8, got 'lora_rank' and "
                         "{'lora_alpha': 3}")
    flags["lr"] = "--lr"
    assert str(_flagged(ConfigError("--lr-schedule is not read", field="lr"), flags)) == "--lr: --lr-schedule is not read"


def test_an_eval_resumed_on_other_weights_at_the_same_path_is_refused(tmp_path, model_dir, monkeypatch, capsys):
    """A run's directory (or a model written over) changes its weights; resuming an evaluation
    there mixed two models' episodes into one score without a word."""
    import torch
    from transformers import AutoModelForCausalLM

    import rftgym.rollout as rollout

    real = rollout.run_episodes

    def interrupted(make_env, agent, seeds, config=None, on_episode=None):
        real(make_env, agent, seeds[:1], config=config, on_episode=on_episode)
        raise KeyboardInterrupt

    monkeypatch.setattr(rollout, "run_episodes", interrupted)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "eval.jsonl"
    command = ["eval", ENV_ID, "--agent", "hf", "--device", "cpu", "--episodes", "4", "--max-new-tokens", "4",
               "--out", str(out)]
    assert main(command + ["--model", str(model_dir)]) == 130
    # The same folder named another way is the same model.
    assert main(command + ["--model", "model", "--resume"]) == 130
    assert "--resume: 1 of 4 episodes were finished" in capsys.readouterr().err
    # Another dtype (the same weights loaded in bfloat16 on CUDA): refused, naming it, not as other weights.
    noted = tmp_path / "eval.jsonl.partial.json"
    as_noted = noted.read_text()
    noted.write_text(json.dumps({**json.loads(as_noted), "dtype": "bfloat16", "weights": "0" * 16}))
    assert exit_code(command + ["--model", str(model_dir), "--resume"]) == 2
    assert "ran with other settings (" in (err := capsys.readouterr().err) and "dtype 'bfloat16' -> 'float32'" in err
    noted.write_text(as_noted)
    # The folder written over (a run trained on): refused, saying so.
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1.001)
    model.save_pretrained(model_dir)
    assert exit_code(command + ["--model", str(model_dir), "--resume"]) == 2
    assert "ran with other weights than" in capsys.readouterr().err
    assert len(list(read_episodes_jsonl(tmp_path / "eval.jsonl.partial"))) == 2  # kept as they were
    # Settings noted by an earlier version (no weights, the path as typed) still resume: they hold
    # nothing to check the weights against.
    older = json.loads(noted.read_text())
    for key in ("weights", "model_step", "dtype"):
        del older[key]
    noted.write_text(json.dumps({**older, "model": "model"}))
    assert main(command + ["--model", str(model_dir), "--resume"]) == 130
    assert "--resume: 2 of 4 episodes were finished" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:a prompt is longer than the policy answers")
def test_model_without_agent_evaluates_that_model(tmp_path, model_dir, monkeypatch, capsys):
    """``--model DIR`` alone was refused ("this run's agent is default"): it names the hf agent."""
    monkeypatch.chdir(tmp_path)
    assert main(["eval", ENV_ID, "--model", str(model_dir), "--device", "cpu", "--episodes", "1",
                 "--max-new-tokens", "2"]) == 0
    written = list((tmp_path / "runs" / "eval").glob("*.jsonl"))
    assert len(written) == 1 and "-hf-" in written[0].name
    assert str(model_dir) in capsys.readouterr().out  # the table's agent column names the model
