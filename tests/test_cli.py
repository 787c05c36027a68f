"""The `rftgym` command, run in-process (main([...])) and once as a real process.

Only the scripted agents (random, adversarial) are run; `default`/`hf` would load a model and
`api` runs against a fake chat-completions server on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import gymnasium as gym
import pytest
import torch
from loopback_http import serving

import rftgym  # noqa: F401
from rftgym.cli import main
from rftgym.core.errors import ChatAPIError
from rftgym.core.records import read_episodes_jsonl
from rftgym.envs import ENVS

ENV_ID = "rftgym/VerifiableQA-v0"
VALID_OPTIONS = "Valid options: kinds, difficulties, dataset_path, task_selection, max_attempts, max_turns, " \
                "format_weight, system_prompt, max_action_chars"


def exit_code(argv) -> int:
    with pytest.raises(SystemExit) as excinfo:
        main(argv)
    return excinfo.value.code


def answer_for_seed(seed: int, **env_kwargs) -> str:
    env = gym.make(ENV_ID, **env_kwargs)
    env.reset(seed=seed)
    return env.unwrapped.task.answer


# ---------------------------------------------------------------- envs

def test_envs_lists_every_environment(capsys):
    assert main(["envs"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["id", "description"]
    for env_id, (_, description) in ENVS.items():
        assert any(line.startswith(env_id) and line.rstrip().endswith(description) for line in lines[2:])
    assert len(lines) == 2 + len(ENVS)


def test_no_command_is_a_usage_error(capsys):
    assert exit_code([]) == 2
    assert "envs,play,eval" in capsys.readouterr().err


# ---------------------------------------------------------------- eval

@pytest.mark.parametrize("agent", ["random", "adversarial"])
def test_eval_writes_episodes_and_prints_a_table(agent, tmp_path, capsys):
    out = tmp_path / "nested" / "eps.jsonl"
    code = main(["eval", ENV_ID, "--agent", agent, "--episodes", "5", "--num-envs", "2", "--seed", "3",
                 "--env-arg", "max_turns=4", "--env-arg", "max_attempts=2", "--out", str(out)])
    assert code == 0
    episodes = list(read_episodes_jsonl(out))
    assert [e.seed for e in episodes] == [3, 4, 5, 6, 7]
    assert all(e.env_id == ENV_ID for e in episodes)
    assert all(1 <= len(e.turns) <= 4 for e in episodes)  # the env-arg reached the env
    assert all(e.terminated or e.truncated for e in episodes)
    assert all(set(e.context().ids) <= set(e.messages) for e in episodes)
    stdout = capsys.readouterr().out
    header, rule, row, written = stdout.strip().splitlines()
    assert header.split() == ["env", "agent", "episodes", "reward", "success", "turns", "format_err",
                              "sampled_tok", "prompt_tok", "ep/s"]
    assert set(rule) <= {"-", " "}
    cells = row.split()
    assert cells[:3] == [ENV_ID, agent, "5"]
    mean_reward = sum(e.total_reward for e in episodes) / 5
    assert float(cells[3]) == pytest.approx(mean_reward, abs=5e-4)
    assert written == f"episodes written to {out}"


def test_eval_default_output_path(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["eval", ENV_ID, "--agent", "random", "--episodes", "2", "--num-envs", "1"]) == 0
    (path,) = (tmp_path / "runs" / "eval").glob("VerifiableQA-v0-random-*.jsonl")
    assert len(list(read_episodes_jsonl(path))) == 2
    assert f"episodes written to {Path('runs') / 'eval' / path.name}" in capsys.readouterr().out


def test_a_sampled_episode_replays_alone_with_its_task_seed(tmp_path, capsys, make_char_policy):
    model = tmp_path / "model"
    policy = make_char_policy()
    policy.model.save_pretrained(model)
    policy.tokenizer.save_pretrained(model)
    common = ["eval", ENV_ID, "--agent", "hf", "--model", str(model), "--temperature", "1", "--max-new-tokens", "12",
              "--device", "cpu", "--sample-seed", "4"]
    assert main([*common, "--seed", "0", "--episodes", "6", "--num-envs", "4", "--out", str(tmp_path / "all.jsonl")]) == 0
    assert main([*common, "--seed", "5", "--episodes", "1", "--out", str(tmp_path / "one.jsonl")]) == 0
    assert main([*common, "--seed", "5", "--episodes", "1", "--sample-seed", "5", "--out",
                 str(tmp_path / "other.jsonl")]) == 0
    everything, (alone,), (other,) = (list(read_episodes_jsonl(tmp_path / f"{name}.jsonl"))
                                      for name in ("all", "one", "other"))
    assert [t.sampled_ids for t in alone.turns] == [t.sampled_ids for t in everything[5].turns]
    assert [t.sampled_ids for t in other.turns] != [t.sampled_ids for t in alone.turns]


def test_eval_is_deterministic_under_the_seed(tmp_path, capsys):
    paths = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    for path in paths:
        main(["eval", ENV_ID, "--agent", "random", "--episodes", "3", "--seed", "9", "--out", str(path)])
    a, b = (list(read_episodes_jsonl(p)) for p in paths)
    assert [[t.action for t in e.turns] for e in a] == [[t.action for t in e.turns] for e in b]
    assert [e.final_context_ids for e in a] == [e.final_context_ids for e in b]


def test_eval_with_a_dataset_env_arg(tmp_path, capsys):
    data = tmp_path / "qa.jsonl"
    data.write_text('{"question": "2+2?", "answer": "4", "id": "only"}\n', encoding="utf-8")
    out = tmp_path / "eps.jsonl"
    assert main(["eval", ENV_ID, "--agent", "random", "--episodes", "2", "--env-arg", f"dataset_path={data}",
                 "--out", str(out)]) == 0
    assert [e.reset_info["task_id"] for e in read_episodes_jsonl(out)] == ["only", "only"]


def test_unknown_env_id(capsys, tmp_path):
    assert exit_code(["eval", "rftgym/Nope-v0", "--agent", "random", "--out", str(tmp_path / "x.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "unknown environment 'rftgym/Nope-v0'" in err
    assert f"rftgym's environments: {', '.join(ENVS)}" in err
    assert not (tmp_path / "x.jsonl").exists()


def test_unknown_env_arg_key_lists_the_valid_options(capsys):
    assert exit_code(["eval", ENV_ID, "--agent", "random", "--env-arg", "max_turn=3"]) == 2
    err = capsys.readouterr().err
    assert "bad --env-arg for rftgym/VerifiableQA-v0" in err and "max_turn" in err
    assert VALID_OPTIONS in err


def test_env_arg_without_equals(capsys):
    assert exit_code(["play", ENV_ID, "--env-arg", "max_turns"]) == 2
    assert "--env-arg takes KEY=VALUE" in capsys.readouterr().err
    assert exit_code(["play", ENV_ID, "--env-arg", "=3"]) == 2
    assert "--env-arg '=3' has no KEY before '='" in capsys.readouterr().err


def test_a_key_with_a_tab_is_named_by_its_environment_variable(capsys, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-ab\tc")
    assert exit_code(["eval", ENV_ID, "--agent", "api", "--api-base", "http://127.0.0.1:9/v1", "--api-model", "m",
                      "--episodes", "1"]) == 2
    assert "api_key (on the command line, the OPENAI_API_KEY environment variable) must contain only printable ASCII" \
           in capsys.readouterr().err


def test_json_nested_too_deeply_to_read_is_a_usage_error(capsys):
    deep = "[" * 20000 + "]" * 20000
    assert exit_code(["eval", ENV_ID, "--agent", "random", "--env-arg", f"difficulties={deep}"]) == 2
    assert "--env-arg difficulties=...: its JSON value nests too deeply to read" in capsys.readouterr().err
    assert exit_code(["eval", ENV_ID, "--agent", "api", "--api-extra", f'{{"a": {deep}}}']) == 2
    assert "--api-extra: its JSON nests too deeply to read" in capsys.readouterr().err


def test_a_resume_follows_an_api_server_to_another_address_and_reads_its_options_as_json():
    import argparse

    from rftgym.cli.evaluate import _run_settings

    def settings(api_base, api_extra):
        args = argparse.Namespace(agent="api", model=None, api_base=api_base, api_model="m", api_extra=api_extra,
                                  max_new_tokens=64, temperature=0.0, top_p=None, sample_seed=0)
        return _run_settings(args, ENV_ID, "", {}, [0, 1])

    first = settings("http://127.0.0.1:8000/v1", '{"top_k": 20}')
    assert settings("http://localhost:8001/v1/", '{"top_k":20}') == first  # restarted elsewhere, respaced
    assert settings("http://127.0.0.1:8000/v1", '{"top_k": 21}') != first


def test_a_resume_follows_a_remote_retriever_to_another_address_and_timeout(tmp_path):
    """How a remote retriever is reached (its address, timeout, retries) is noted but is not what
    the episodes depend on: a resume after raising the timeout, as the timeout's error advises, or
    with the service restarted on another port, is allowed; another top_k is not."""
    import argparse
    import json

    from rftgym.cli.common import UsageError
    from rftgym.cli.eval_output import _finished_episodes, _partial, _partial_settings
    from rftgym.cli.evaluate import _run_settings
    from rftgym.envs.search.env import SearchEvalQAEnv

    env_id = "rftgym/SearchEvalQA-v0"

    def settings(**env_kwargs):
        args = argparse.Namespace(agent="random", model=None, api_base=None, api_model=None, api_extra=None,
                                  max_new_tokens=64, temperature=0.0, top_p=None, sample_seed=0)
        return _run_settings(args, env_id, "", {"retriever": "remote", **env_kwargs}, [0, 1])

    out = tmp_path / "out.jsonl"
    first = settings(retriever_url="http://127.0.0.1:8000/retrieve", retriever_timeout_s=1)
    assert first["env_args"]["retriever_url"] == "http://127.0.0.1:8000/retrieve"  # noted, for the record
    _partial_settings(out).write_text(json.dumps(first))
    _partial(out).write_text("")
    transport = SearchEvalQAEnv.metadata["transport_options"]
    later = settings(retriever_url="http://127.0.0.1:8001/retrieve", retriever_timeout_s=60, retriever_retries=5)
    assert _finished_episodes(out, env_id, [0, 1], later, transport) == []
    with pytest.raises(UsageError, match="top_k"):  # what it serves: compared
        _finished_episodes(out, env_id, [0, 1], settings(retriever_url="http://127.0.0.1:8000/retrieve",
                                                         retriever_timeout_s=1, top_k=5), transport)


def test_play_refuses_an_option_that_stands_for_a_policy(capsys):
    assert exit_code(["play", "rftgym/CodeTCG-v0", "--env-arg", "dataset=generated", "--env-arg", "pseudocode=true",
                      "--env-arg", "step_scorer=rollout"]) == 2
    assert ("--env-arg step_scorer=rollout stands for the policy acting in the env, and in rftgym play you are the "
            "assistant") in capsys.readouterr().err


def test_a_type_error_inside_an_env_is_not_blamed_on_an_option(capsys, monkeypatch):
    from rftgym.envs.verifiable import env as verifiable

    def broken(*args, **kwargs):
        raise TypeError("'int' object is not iterable")

    monkeypatch.setattr(verifiable.VerifiableQAEnv, "__init__", broken)
    assert exit_code(["eval", ENV_ID, "--agent", "random"]) == 2
    err = capsys.readouterr().err
    assert "rftgym/VerifiableQA-v0 could not be made: 'int' object is not iterable. Check the --env-arg values" in err
    assert "Valid options" not in err


@pytest.mark.parametrize("env_arg, message", [
    ("max_turns=0", "max_turns must be at least max_attempts (1): each attempt is a turn"),
    ("max_attempts=0", "max_attempts must be at least 1"),
    ("format_weight=1.5", "format_weight must be in [0, 1)"),
    ("kinds=poetry", "kinds must be a non-empty subset of ['arithmetic', 'comparison', 'sequence', 'weekday', 'word_problem']"),
    ("difficulties=[7]", "difficulties must be a non-empty subset of (1, 2, 3, 4, 5)"),
    ("dataset_path=/no/such/file.jsonl", "/no/such/file.jsonl: no such file"),
    ('kinds=[["arithmetic"]]', "kinds must be a list of kind names"),
])
def test_bad_env_arg_values_say_what_is_valid(env_arg, message, capsys):
    assert exit_code(["eval", ENV_ID, "--agent", "random", "--env-arg", env_arg]) == 2  # bad input
    err = capsys.readouterr().err
    assert err.startswith("rftgym eval: error: ") and message in err


def test_an_agents_own_crash_shows_where_it_happened(monkeypatch, capsys):
    from rftgym.agents.scripted import RandomTextAgent

    def crash(self, contexts, sample_keys=None):
        raise ZeroDivisionError("inside the agent")

    monkeypatch.setattr(RandomTextAgent, "act", crash)
    assert main(["eval", ENV_ID, "--agent", "random", "--episodes", "1"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "in crash" in err  # the agent's own frame, for its author
    assert f"raised ZeroDivisionError: inside the agent (replying to {ENV_ID} seed 0 turn 1)" in err


def test_an_empty_output_path_is_refused(capsys):
    assert exit_code(["eval", ENV_ID, "--agent", "random", "--out", " "]) == 2
    assert "--out is empty; give a path, or leave --out out" in capsys.readouterr().err
    assert exit_code(["train", ENV_ID, "--output-dir", ""]) == 2
    assert "--output-dir is empty" in capsys.readouterr().err


def test_an_output_path_the_shell_left_unexpanded_is_refused(capsys, tmp_path, monkeypatch):
    # --out=~/x: bash expands no '~' after '=', and the run would write into a folder named '~' here
    monkeypatch.chdir(tmp_path)
    assert exit_code(["eval", ENV_ID, "--agent", "random", "--out=~/episodes.jsonl"]) == 2
    assert "--out '~/episodes.jsonl' starts with '~', which nothing expanded" in capsys.readouterr().err
    assert exit_code(["train", ENV_ID, "--output-dir", "$HOME/run"]) == 2
    assert "--output-dir '$HOME/run' holds a '$' variable that nothing expanded" in capsys.readouterr().err
    assert exit_code(["eval", "rftgym/CodeTCG-v0", "--agent", "random", "--env-arg",
                      'tcg={"cache_dir": "~/tcg"}']) == 2
    assert "TCGConfig.cache_dir '~/tcg' starts with '~'" in capsys.readouterr().err
    # export expands OUT's '~' itself (OUT is its positional argument, not a --out)
    assert exit_code(["export", str(tmp_path / "no-run"), "~/exported"]) == 2
    err = capsys.readouterr().err
    assert "starts with '~'" not in err and "--out '" not in err, err
    assert exit_code(["export", str(tmp_path / "no-run"), "$HOME/exported"]) == 2
    assert "OUT '$HOME/exported' holds a '$' variable that nothing expanded" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_an_env_arg_given_twice_is_refused(capsys):
    assert exit_code(["eval", ENV_ID, "--agent", "random", "--env-arg", "max_turns=3", "--env-arg", "max_turns=5"]) == 2
    assert "--env-arg max_turns is given twice; give each option once" in capsys.readouterr().err


def test_a_single_kind_env_arg_works(tmp_path, capsys):
    out = tmp_path / "eps.jsonl"
    assert main(["eval", ENV_ID, "--agent", "random", "--episodes", "3", "--env-arg", "kinds=weekday",
                 "--out", str(out)]) == 0
    assert {e.reset_info["kind"] for e in read_episodes_jsonl(out)} == {"weekday"}


def test_api_agent_needs_a_base_url(capsys):
    assert exit_code(["eval", ENV_ID, "--agent", "api"]) == 2
    err = capsys.readouterr().err
    assert "--agent api needs --api-base URL" in err and "--api-model NAME" in err
    for timeout in ("0", "1e10"):  # (one far too large would overflow the timers)
        assert exit_code(["eval", ENV_ID, "--agent", "api", "--api-base", "http://127.0.0.1:9/v1", "--api-model", "m",
                          "--api-timeout", timeout]) == 2
        assert f"--api-timeout: ChatAPIConfig.timeout_s must be a number of seconds in (0, 86400] (a day at most), " \
               f"got {float(timeout)}" in capsys.readouterr().err


def test_hf_agent_needs_a_model(capsys):
    assert exit_code(["eval", ENV_ID, "--agent", "hf"]) == 2
    assert "--agent hf needs --model PATH" in capsys.readouterr().err


def test_unknown_agent(capsys):
    assert exit_code(["eval", ENV_ID, "--agent", "oracle"]) == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'oracle'" in err and "random" in err and "adversarial" in err


@pytest.mark.parametrize("flag, message", [("--episodes", "--episodes must be at least 1"),
                                           ("--num-envs", "--num-envs must be at least 1")])
def test_non_positive_counts(flag, message, capsys):
    assert exit_code(["eval", ENV_ID, "--agent", "random", flag, "0"]) == 2
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------- play

def feed(monkeypatch, lines):
    """Make input() return ``lines`` in turn, then raise EOFError (Ctrl-D)."""
    remaining = list(lines)
    prompts = []

    def fake_input(prompt=""):
        prompts.append(prompt)
        if not remaining:
            raise EOFError
        return remaining.pop(0)

    monkeypatch.setattr("builtins.input", fake_input)
    return prompts


def test_play_completes_an_episode(monkeypatch, capsys):
    answer = answer_for_seed(5)
    prompts = feed(monkeypatch, ["Let me think.\\", f"<answer>{answer}</answer>"])
    assert main(["play", ENV_ID, "--seed", "5"]) == 0
    out = capsys.readouterr().out
    env = gym.make(ENV_ID)
    context, _ = env.reset(seed=5)
    assert f"[user]\n{context[-1].content}\n" in out
    assert "[system]\n" in out
    assert "reward=1.000 terminated=True truncated=False" in out
    assert "'success': True" in out
    assert "bye" not in out
    assert prompts == ["assistant> ", "........> "]  # a trailing backslash continues the turn


def test_play_pays_a_time_limit_cut_as_eval_does(monkeypatch, capsys):
    env = gym.make(ENV_ID, max_attempts=2)
    env.reset(seed=5)
    task = env.unwrapped.task
    wrong = next(c for c in task.choices if c != task.answer) if task.choices else str(int(task.answer) + 1)
    feed(monkeypatch, [f"<answer>{wrong}</answer>"])
    assert main(["play", ENV_ID, "--seed", "5", "--env-arg", "max_attempts=2", "--env-arg", "max_episode_steps=1"]) == 0
    out = capsys.readouterr().out
    assert "reward=0.100 terminated=False truncated=True" in out  # the clean wrong answer's
    assert "reward_if_cut" not in out.split("truncated=True")[1]  # paid in the reward shown: not beside it


def test_play_takes_windows_line_ends_and_shows_info_briefly(monkeypatch, capsys):
    answer = answer_for_seed(5)
    prompts = feed(monkeypatch, ["Let me think.\\\r", f"<answer>{answer}</answer>\r"])  # piped CRLF text
    assert main(["play", ENV_ID, "--seed", "5"]) == 0
    assert prompts == ["assistant> ", "........> "]  # the continuation mark before the CR still continues
    from rftgym.cli.play import _brief

    assert _brief({"tests": [{"expected": "secret"}] * 3, "note": "x" * 300, "none": None, "ok": True}) == {
        "tests": "<3 items>", "note": "x" * 197 + "...", "ok": True}  # no expected outputs mid-episode
    # At the episode's end a short collection (SearchEvalQA's expected answers) is shown as it is.
    assert _brief({"expected": ["Paris"], "tests": [{"expected": "x" * 100}], "none": []}, final=True) == {
        "expected": ["Paris"], "tests": "<1 item>"}  # (an empty collection is left out, as None is)
    assert _brief({"expected": ["Paris"]}) == {"expected": "<1 item>"}


def test_play_shows_feedback_and_runs_several_episodes(monkeypatch, capsys):
    feed(monkeypatch, ["no idea", "still none", "nope", "hmm"])
    assert main(["play", ENV_ID, "--seed", "1", "--episodes", "2", "--env-arg", "max_turns=3"]) == 0
    out = capsys.readouterr().out
    first, second = out.split("reward=0.000 terminated=False truncated=True")
    assert first.count("Your reply was not understood") == 2  # none after the last turn
    assert second.count("Your reply was not understood") == 1  # "hmm" in the second episode
    second_question = gym.make(ENV_ID).reset(seed=2)[0][-1].content
    assert second_question in out
    assert out.rstrip().endswith("bye")  # EOF in the second episode


EDITING_MODULE = """
import gymnasium as gym
from rftgym.core.messages import Context, MessageIds
from rftgym.core.spaces import AssistantText, ContextSpace


class Forgets(gym.Env):
    metadata = {"render_modes": []}

    def __init__(self):
        self.observation_space, self.action_space = ContextSpace(), AssistantText()

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.ids = MessageIds.from_rng(self.np_random)
        self.context = Context((self.ids.message("user", "remember 42"), self.ids.message("user", "now reply")))
        return self.context, {}

    def step(self, action):
        kept = self.context.messages[1:]  # the first message is dropped
        self.context = Context(kept + (self.ids.message("assistant", action), self.ids.message("user", "what was it?")))
        return self.context, 0.0, False, False, {}


gym.register("mine/Forgets-v0", entry_point=Forgets)
"""


def test_play_says_which_messages_an_edit_removed(tmp_path, monkeypatch, capsys):
    (tmp_path / "forgets_env_mod.py").write_text(EDITING_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    feed(monkeypatch, ["ok"])
    assert main(["play", "forgets_env_mod:mine/Forgets-v0", "--seed", "0"]) == 0
    out = capsys.readouterr().out
    assert "[context edited: 1 earlier message(s) removed]" in out
    assert "(user): remember 42" in out.split("[context edited")[1]
    assert "[user]\nwhat was it?" in out


SCRIPTED_MODULE = """
import gymnasium as gym
from rftgym.core.messages import Context, MessageIds
from rftgym.core.spaces import AssistantText, ContextSpace


class Scripted(gym.Env):
    \"\"\"Every episode's ids are the same (unique within an episode is all the protocol asks); the
    env puts an example assistant message of its own first, and its last message says why it ended.\"\"\"
    metadata = {"render_modes": []}

    def __init__(self):
        self.observation_space, self.action_space = ContextSpace(), AssistantText()

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.ids = MessageIds("ep")
        self.context = Context((self.ids.message("user", "example question"),
                                self.ids.message("assistant", "example reply"),
                                self.ids.message("user", f"question of seed {seed}")))
        return self.context, {}

    def step(self, action):
        self.context = self.context.appended(self.ids.message("assistant", action),
                                             self.ids.message("user", "that was the last turn"))
        return self.context, 0.0, False, True, {}


gym.register("mine/Scripted-v0", entry_point=Scripted)
"""


def test_play_shows_every_episode_its_envs_own_messages_and_the_last_observation(tmp_path, monkeypatch, capsys):
    (tmp_path / "scripted_env_mod.py").write_text(SCRIPTED_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    feed(monkeypatch, ["first", "second"])
    assert main(["play", "scripted_env_mod:mine/Scripted-v0", "--seed", "0", "--episodes", "2"]) == 0
    out = capsys.readouterr().out
    first, second = out.split("question of seed 0")[1].split("question of seed 1")
    # The second episode, whose ids repeat the first's, is shown whole; the env's own assistant
    # message is shown, the user's turns are not repeated, and each episode's last message is shown.
    assert "[assistant]\nexample reply" in out.split("question of seed 0")[0]
    assert "[assistant]\nexample reply" in first and "question of seed 1" in out
    for episode in (first, second):
        assert episode.count("that was the last turn") == 1
        assert episode.index("reward=0.000") < episode.index("[user]\nthat was the last turn")
    assert "[assistant]\nfirst" not in out and "[assistant]\nsecond" not in out


def test_play_refuses_human_rendering_which_would_show_everything_twice(capsys):
    assert exit_code(["play", ENV_ID, "--env-arg", "render_mode=human"]) == 2
    assert "render_mode=human prints the whole context on every step" in capsys.readouterr().err


def test_play_with_stdin_closed_says_so(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", None)
    assert exit_code(["play", ENV_ID]) == 2
    assert "error: the assistant's turns are read from stdin, which is closed" in capsys.readouterr().err


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("command", [["envs"], ["play", ENV_ID, "--seed", "0"]])
def test_output_to_a_full_device_is_said_in_one_line(command):
    with open("/dev/full", "w") as full:
        # Buffered, as output to a file is unless PYTHONUNBUFFERED says otherwise.
        environment = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
        done = subprocess.run([sys.executable, "-m", "rftgym", *command], input="no idea\n", stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=120, env=environment)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().endswith("No space left on device; free some space, or write elsewhere, and run it "
                                        "again")


MISBEHAVING_MODULE = """
import gymnasium as gym
from rftgym.core.messages import Context, MessageIds
from rftgym.core.spaces import AssistantText, ContextSpace


class Misbehaves(gym.Env):
    metadata = {"render_modes": []}

    def __init__(self, how="nan"):
        self.how, self.observation_space, self.action_space = how, ContextSpace(), AssistantText()

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if self.how == "list":
            return [{"role": "user", "content": "hi"}], {}
        self.ids = MessageIds.from_rng(self.np_random)
        return Context((self.ids.message("user", "say something"),)), {}

    def step(self, action):
        if self.how == "raise":
            raise KeyError("lost track")
        context = Context((self.ids.message("user", "done"),))
        if self.how == "info_none":
            return context, 0.0, True, False, None
        if self.how == "four":  # the old gym API
            return context, 0.0, True, {}
        return context, {"nan": float("nan"), "text": "1.0"}[self.how], True, False, {}


gym.register("mine/Misbehaves-v0", entry_point=Misbehaves)
"""


@pytest.mark.parametrize("how, said", [
    ("nan", "mine/Misbehaves-v0 (seed 3, turn 1) returned the reward nan; a reward is a finite number"),
    ("text", "mine/Misbehaves-v0 (seed 3, turn 1) returned the reward '1.0'; a reward is a finite number"),
    ("raise", "mine/Misbehaves-v0 raised KeyError in step (seed 3, turn 1): 'lost track'"),
    ("list", "mine/Misbehaves-v0 (seed 3) reset to a list; an rftgym env's observation is the chat context"),
    # Met first by Gymnasium's own checker and wrappers (gym.make), on the first step: no traceback either.
    ("info_none", "mine/Misbehaves-v0 (seed 3, turn 1) broke Gymnasium's step API (Gymnasium, reading what it "
                  "returned: The `info` returned by `step()` must be a python dictionary"),
    ("four", "mine/Misbehaves-v0 (seed 3, turn 1) broke Gymnasium's step API (Gymnasium, reading what it returned: "
             "not enough values to unpack (expected 5, got 4)); step returns (observation, reward, terminated, "
             "truncated, info)"),
])
def test_play_holds_an_env_to_the_protocol_as_eval_does(how, said, tmp_path, monkeypatch, capsys):
    (tmp_path / "misbehaving_env_mod.py").write_text(MISBEHAVING_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    feed(monkeypatch, ["hello"])
    assert main(["play", "misbehaving_env_mod:mine/Misbehaves-v0", "--seed", "3", "--env-arg", f"how={how}"]) == 1
    err = capsys.readouterr().err
    assert f"rftgym play: error: {said}" in err
    assert ("Traceback" in err) == (how == "raise")  # the env's own crash shows where; a broken return need not


def test_play_handles_eof_at_once(monkeypatch, capsys):
    feed(monkeypatch, [])
    assert main(["play", ENV_ID]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("bye") and "reward=" not in out


class TerminalInput(io.StringIO):
    """Typed turns: a terminal shows them itself as they are typed."""

    def isatty(self):
        return True


def test_play_echoes_piped_turns_after_their_prompts(monkeypatch, capsys):
    # Piped turns never reached the transcript: it showed "assistant> ........> reward=...".
    answer = answer_for_seed(5)
    monkeypatch.setattr("sys.stdin", io.StringIO(f"Let me think.\\\r\n<answer>{answer}</answer>\nab\ufffd\\\n"))
    assert main(["play", ENV_ID, "--seed", "5", "--episodes", "2"]) == 0
    out = capsys.readouterr().out
    # Each line as it went into the turn: no continuation mark, no CR, U+FFFD for bad bytes.
    assert f"assistant> Let me think.\n........> <answer>{answer}</answer>\nreward=1.000 terminated=True" in out
    assert out.endswith("assistant> ab\ufffd\n........> \n(end of input: episode 2 of 2 stops unfinished after "
                        "0 turns; a turn begun with 1 line ending in '\\' was not sent, as no line came to finish it)\n"
                        "bye\n")


def test_play_echoes_nothing_a_terminal_already_shows(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", TerminalInput("Let me think.\\\nno idea\n"))
    assert main(["play", ENV_ID, "--seed", "5", "--env-arg", "max_turns=2"]) == 0
    out = capsys.readouterr().out
    assert "assistant> ........> reward=0.000" in out and "Let me think." not in out
    assert out.endswith("assistant> \nbye\n")  # Ctrl-D: the user knows what it left undone


def test_play_skips_a_piped_line_it_cannot_decode(monkeypatch, capsys):
    class StrictInput(io.StringIO):  # stdin that cannot take errors="surrogateescape"
        def readline(self, *args):
            line = super().readline(*args)
            if line.startswith("bad"):
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
            return line

    monkeypatch.setattr("sys.stdin", StrictInput("bad\nno idea\n"))
    assert main(["play", ENV_ID, "--seed", "5"]) == 0
    out, err = capsys.readouterr()
    assert "assistant> \nassistant> no idea\n" in out  # the prompt's line ended, the next line played
    assert "(that line was not valid utf-8; it was skipped)" in err
    assert "(end of input: episode 1 of 1 stops unfinished after 1 turn)\nbye" in out


def test_play_unknown_env(monkeypatch, capsys):
    feed(monkeypatch, [])
    assert exit_code(["play", "rftgym/Nope-v0"]) == 2
    assert "unknown environment" in capsys.readouterr().err


# ---------------------------------------------------------------- as a real process

def run_cli(*args, stdin: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    return subprocess.run([sys.executable, "-m", "rftgym", *args], input=stdin, capture_output=True, text=True,
                          timeout=120, env=env)


def test_subprocess_play_over_stdin():
    answer = answer_for_seed(0)
    proc = run_cli("play", ENV_ID, "--seed", "0", "--episodes", "2", stdin=f"<answer>{answer}</answer>\n")
    assert proc.returncode == 0, proc.stderr
    assert f"assistant> <answer>{answer}</answer>\nreward=1.000 terminated=True" in proc.stdout
    assert proc.stdout.endswith("assistant> \n(end of input: episode 2 of 2 stops unfinished after 0 turns)\nbye\n")


@pytest.mark.parametrize("environment", [{"PYTHONIOENCODING": "utf-8"}, {"LC_ALL": "C.UTF-8"}])
def test_subprocess_play_takes_bytes_that_are_not_utf8(environment):
    # Strict decoding (PYTHONIOENCODING=utf-8) used to crash on the line; a surrogateescape
    # locale passed lone surrogates on to the env. Now the bad bytes arrive as U+FFFD.
    answer = answer_for_seed(1)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONIOENCODING", "LC_ALL")}
    stdin = b"<answer>ab\xff\xfe</answer>\n<answer>" + answer.encode() + b"</answer>\n"
    proc = subprocess.run([sys.executable, "-m", "rftgym", "play", ENV_ID, "--seed", "0", "--episodes", "2"],
                          input=stdin, capture_output=True, timeout=120, env={**env, **environment})
    out = proc.stdout.decode("utf-8", "replace")
    assert proc.returncode == 0, proc.stderr.decode("utf-8", "replace")
    assert "assistant> <answer>ab\ufffd\ufffd</answer>\n" in out  # the line as the first episode got it
    assert "'answer': 'ab\ufffd\ufffd'" in out
    assert "reward=1.000 terminated=True" in out  # and the next line still reached the second


def test_subprocess_eval_says_a_warning_once_however_many_envs_meet_it(tmp_path):
    # The env made to check the options and the rollout's each warn that the corpus holds none of
    # the questions' evidence: the user reads it once.
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question": "Who?", "golden_answers": ["Ada"]}) + "\n")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": "1", "contents": '"Bob"\nBob was born.'}) + "\n")
    hotpot = tmp_path / "h.json"
    hotpot.write_text(json.dumps([{"_id": "1", "question": "Who?", "answer": "Ada", "type": "bridge",
                                   "supporting_facts": [["Ada", 0]], "context": [["Ada", ["Ada was born."]]]}]))
    proc = run_cli("eval", "rftgym/SearchEvalQA-v0", "--agent", "random", "--episodes", "2", "--env-arg",
                   f"dataset_path={hotpot}", "--env-arg", f"corpus_path={corpus}", "--out", str(tmp_path / "e.jsonl"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("holds none of the") == 1, proc.stderr


def test_console_script_lists_envs_and_reports_usage_errors():
    script = Path(sys.executable).with_name("rftgym")
    if not script.exists():
        pytest.skip("the rftgym console script is not installed next to this interpreter")
    proc = subprocess.run([str(script), "envs"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and ENV_ID in proc.stdout
    proc = subprocess.run([str(script), "eval", "rftgym/Nope-v0", "--agent", "random"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "unknown environment 'rftgym/Nope-v0'" in proc.stderr


def test_eval_adds_the_envs_own_columns(tmp_path, capsys):
    out = tmp_path / "search.jsonl"
    assert main(["eval", "rftgym/SearchEvalQA-v0", "--agent", "adversarial", "--episodes", "4", "--out", str(out)]) == 0
    header = capsys.readouterr().out.splitlines()[0].split()
    assert header[-4:] == ["em", "f1", "searches/ep", "violation_rate"]
    assert len(list(read_episodes_jsonl(out))) == 4


def test_serve_retriever_serves_the_generated_world(monkeypatch, capsys, tmp_path):
    from rftgym.envs.search import server
    from rftgym.envs.search.world import World

    served = []
    monkeypatch.setattr(server.RetrievalServer, "serve_forever",
                        lambda self, *a: served.append((self.document_count, self.connections.limit)))
    assert main(["serve-retriever", "--world-seed", "3", "--world-size", "20", "--port", "0"]) == 0
    assert served == [(len(World(3, 20).documents), server.DEFAULT_MAX_CONNECTIONS)]
    assert "serving" in capsys.readouterr().out
    assert main(["serve-retriever", "--world-seed", "3", "--port", "0", "--max-connections", "16"]) == 0
    assert served[-1][1] == 16
    for argv, message in [([], "give --corpus FILE (a corpus file) or --world-seed N"),
                          (["--corpus", str(tmp_path / "c.json"), "--world-seed", "1"], "one of them"),
                          (["--world-size", "20", "--corpus", str(tmp_path / "c.json")], "--world-size goes with"),
                          (["--world-seed", "-1"], "--world-seed must be >= 0"),
                          (["--world-seed", "0", "--world-size", "1"], "--world-size must be in [2, 2000]"),
                          (["--world-seed", "0", "--world-size", "100000"], "--world-size must be in [2, 2000]"),
                          (["--world-seed", "0", "--max-connections", "0"], "--max-connections must be >= 1")]:
        assert exit_code(["serve-retriever", *argv]) == 2, argv
        assert message in capsys.readouterr().err, argv


def test_serve_retriever_rejects_a_missing_corpus(capsys, tmp_path):
    assert exit_code(["serve-retriever", "--corpus", str(tmp_path / "none.json")]) == 2
    assert "supported formats" in capsys.readouterr().err


def test_env_metric_reducers():
    from rftgym.core.messages import Message
    from rftgym.core.records import Episode, Turn
    from rftgym.rollout.metrics import env_metrics

    def ep(values):
        turns = [Turn(i, (), "", 0.0, i == len(values) - 1, False, {"x": v}) for i, v in enumerate(values)]
        return Episode("e", 0, {"m": Message("user", "q", "m")}, turns, ("m",))

    episodes = [ep([1, 3]), ep([0, 0, 2]), ep([5])]
    got = env_metrics(episodes, [("fm", "x", "final_mean"), ("fr", "x", "final_rate"),
                                 ("tm", "x", "turn_mean"), ("tx", "x", "turn_max")])
    # finals 3, 2, 5 -> mean 10/3, all positive -> rate 1; turns 1,3,0,0,2,5 -> mean 11/6, max 5
    assert got == pytest.approx({"fm": 10 / 3, "fr": 1.0, "tm": 11 / 6, "tx": 5})
    # numpy numbers count like Python's; a final value not reported is not a success
    import numpy as np

    episodes = [ep([np.float32(1.0)]), ep([np.int64(0)]), ep([np.bool_(True)]), ep([None])]
    got = env_metrics(episodes, [("fm", "x", "final_mean"), ("fr", "x", "final_rate")])
    assert got == pytest.approx({"fm": 2 / 3, "fr": 2 / 4})
    # 0-d arrays are numbers; text and larger arrays are not, in every reducer (no traceback)
    episodes = [ep([np.array(0.5), np.array([1.0, 9.0])]), ep(["t3", np.array(2.0)]), ep([np.array([1, 2])])]
    got = env_metrics(episodes, [("fm", "x", "final_mean"), ("fr", "x", "final_rate"), ("tm", "x", "turn_mean"),
                                 ("tx", "x", "turn_max")])
    assert got == pytest.approx({"fm": 2.0, "fr": 1 / 3, "tm": 1.25, "tx": 2.0})


def test_an_episode_out_of_context_reports_what_its_env_last_said():
    from rftgym.core.messages import Message
    from rftgym.core.records import CONTEXT_FULL, Episode, Turn
    from rftgym.rollout.metrics import env_metrics

    def cut(infos):  # the env's turns with these infos, then the empty turn of a context that is full
        turns = [Turn(i, (), "a", 0.0, False, False, info) for i, info in enumerate(infos)]
        turns.append(Turn(len(infos), (), "", 0.0, False, True, {}, finish_reason=CONTEXT_FULL))
        return Episode("e", 0, {"m": Message("user", "q", "m")}, turns, ("m",))

    def answered(value):
        return Episode("e", 0, {"m": Message("user", "q", "m")}, [Turn(0, (), "a", 1.0, True, False, {"x": value})],
                       ("m",))

    columns = [("fm", "x", "final_mean")]
    # reported: its last value; never reported: 0 (nothing given scores nothing)
    assert env_metrics([answered(1.0), cut([{"x": 0.5}])], columns) == {"fm": 0.75}
    assert env_metrics([answered(1.0), cut([{}])], columns) == {"fm": 0.5}
    assert env_metrics([answered(1.0), cut([])], columns) == {"fm": 0.5}
    # reported as None (a metric that does not apply, as em to an unanswerable question): left out
    assert env_metrics([answered(1.0), cut([{"x": None}])], columns) == {"fm": 1.0}


def test_eval_baselines_run_side_by_side_on_the_same_seeds(tmp_path, capsys):
    out = tmp_path / "mem.jsonl"
    assert main(["eval", "rftgym/MemoryQA-v0", "--agent", "adversarial", "--episodes", "3", "--baselines",
                 "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines[2:5]] == ["adversarial", "no-memory", "heuristic-prune"]
    assert "prunes/ep" in lines[0] and "ctx_tok_max" in lines[0]
    files = [out, tmp_path / "mem-no-memory.jsonl", tmp_path / "mem-heuristic-prune.jsonl"]
    seeds = [[e.seed for e in read_episodes_jsonl(f)] for f in files]
    assert seeds == [[0, 1, 2]] * 3


@pytest.mark.parametrize("problem", ["directory", "unfinished"])
def test_a_baselines_output_that_cannot_be_written_is_refused_before_any_episode(tmp_path, capsys, problem):
    out = tmp_path / "mem.jsonl"
    blocked = tmp_path / "mem-heuristic-prune.jsonl"
    if problem == "directory":
        blocked.mkdir()
    else:  # an earlier evaluation's episodes, never to be overwritten
        (tmp_path / "mem-heuristic-prune.jsonl.partial").write_text('{"seed": 0}\n')
    assert exit_code(["eval", "rftgym/MemoryQA-v0", "--agent", "adversarial", "--episodes", "2", "--baselines",
                      "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "mem-heuristic-prune.jsonl" in err and ("is a directory" if problem == "directory" else "did not complete") in err
    # Nothing ran, and nothing was left behind (the earlier partial file is kept as it was).
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == (["mem-heuristic-prune.jsonl"] if problem == "directory" else ["mem-heuristic-prune.jsonl.partial"])


def test_an_evaluation_stopped_midway_leaves_no_empty_partial_files(tmp_path, monkeypatch):
    from rftgym.cli import evaluate as cli_evaluate

    evaluate = cli_evaluate._evaluate_env

    def second_fails(args, env_id, *rest):
        if env_id == "rftgym/MemoryQA-v0":
            raise RuntimeError("stopped")
        return evaluate(args, env_id, *rest)

    monkeypatch.setattr(cli_evaluate, "_evaluate_env", second_fails)
    with pytest.raises(RuntimeError, match="stopped"):
        main(["eval", ENV_ID, "rftgym/MemoryQA-v0", "rftgym/SearchEvalQA-v0", "--agent", "random", "--episodes", "1",
              "--out", str(tmp_path / "runs") + "/"])
    files = sorted(p.name for p in (tmp_path / "runs").iterdir())
    # the finished env's only: its episodes and its settings
    assert len(files) == 2 and files[0].startswith("VerifiableQA-v0-random-"), files
    assert files[1] == files[0] + ".settings.json"


def test_an_evaluation_writing_to_the_same_out_is_refused_and_its_partial_file_left_alone(tmp_path, capsys):
    import fcntl

    out = tmp_path / "eval.jsonl"
    partial = tmp_path / "eval.jsonl.partial"
    # Another evaluation with this --out is under way: it holds its (still empty) partial file.
    with open(partial, "a") as running:
        fcntl.flock(running.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert exit_code(["eval", ENV_ID, "--agent", "random", "--episodes", "2", "--out", str(out)]) == 2
        assert f"another evaluation running now writes its episodes to {partial} (it was given the same --out)" \
            in capsys.readouterr().err
        assert partial.is_file() and not out.exists()  # its file, empty, was not removed
        # Once it has written episodes, the refusal still says it is running (not "an earlier
        # evaluation that did not complete", whose advice, to move the file, would let both write).
        running.write('{"env_id": "x"}\n')
        running.flush()
        assert exit_code(["eval", ENV_ID, "--agent", "random", "--episodes", "2", "--out", str(out)]) == 2
        assert "another evaluation running now writes its episodes" in capsys.readouterr().err
    # Once it has ended (its lock goes with it), the same command runs.
    partial.unlink()
    assert main(["eval", ENV_ID, "--agent", "random", "--episodes", "2", "--out", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 2 and not partial.exists()


def test_an_evaluation_lets_go_of_each_runs_partial_file_as_that_run_completes(tmp_path, monkeypatch):
    # Held until the whole command ended, a finished run's name could be taken by another evaluation,
    # whose fresh partial file the first then removed as its own at the end.
    from rftgym.cli import evaluate as cli_evaluate
    from rftgym.cli.eval_output import holds_partial

    evaluate, started = cli_evaluate._evaluate, []

    def noting(args, env_id, agent, env_kwargs, seeds, label, path, settings):
        started.append((path, [holds_partial(p) for p, _ in started]))
        return evaluate(args, env_id, agent, env_kwargs, seeds, label, path, settings)

    monkeypatch.setattr(cli_evaluate, "_evaluate", noting)
    assert main(["eval", ENV_ID, "rftgym/MemoryQA-v0", "--agent", "random", "--episodes", "1",
                 "--out", str(tmp_path) + "/"]) == 0
    assert [held for _, held in started] == [[], [False]]


def test_baselines_flag_on_an_env_without_baselines(capsys):
    assert exit_code(["eval", "rftgym/VerifiableQA-v0", "--agent", "random", "--baselines"]) == 2
    assert "declares no evaluation baselines" in capsys.readouterr().err


def test_eval_covers_a_fixed_benchmark_once_by_default(tmp_path, capsys, monkeypatch):
    """Without --episodes, an env over a fixed dataset (CodeTCG on MBPP here) is evaluated on
    each of its tasks once: seeds 0..n-1 are tasks 0..n-1."""
    monkeypatch.setenv("RFTGYM_CACHE", str(tmp_path / "cache"))
    records = [
        {"task_id": i, "text": f"Write a function that adds {i}.", "code": f"def add_{i}(x):\n    return x + {i}",
         "test_list": [f"assert add_{i}(1) == {1 + i}", f"assert add_{i}(5) == {5 + i}"], "test_setup_code": "",
         "challenge_test_list": []}
        for i in range(3)
    ]
    data = tmp_path / "mini_mbpp.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")
    out = tmp_path / "code.jsonl"
    code = main(["eval", "rftgym/CodeTCG-v0", "--agent", "random", "--env-arg", "dataset=mbpp",
                 "--env-arg", f"dataset_path={data}", "--out", str(out)])
    assert code == 0
    episodes = list(read_episodes_jsonl(out))
    assert [e.seed for e in episodes] == [0, 1, 2]
    assert [e.turns[0].info["task_id"] for e in episodes] == ["mbpp/0", "mbpp/1", "mbpp/2"]
    assert "pass@1" in capsys.readouterr().out


def test_eval_on_several_envs_prints_one_table(tmp_path, capsys, monkeypatch):
    """`rftgym eval A B` runs the same agent on each env and prints one row per env (shared
    columns, then each env's own metrics as key=value); --out is then a directory."""
    monkeypatch.setenv("RFTGYM_CACHE", str(tmp_path / "cache"))
    out_dir = tmp_path / "evals"
    code = main(["eval", "rftgym/VerifiableQA-v0", "rftgym/SearchEvalQA-v0", "--agent", "random",
                 "--episodes", "3", "--out", str(out_dir)])
    assert code == 0
    printed = capsys.readouterr().out
    header, rule, *rows = [line for line in printed.splitlines() if line.strip()][:4]
    assert header.split()[-2:] == ["env", "metrics"] and header.split()[0] == "env"
    assert rows[0].startswith("rftgym/VerifiableQA-v0") and rows[1].startswith("rftgym/SearchEvalQA-v0")
    assert "em=" in rows[1] and "f1=" in rows[1]
    files = sorted(p.name.split("-random-")[0] for p in out_dir.glob("*.jsonl"))
    assert files == ["SearchEvalQA-v0", "VerifiableQA-v0"]
    assert all(len(list(read_episodes_jsonl(p))) == 3 for p in out_dir.glob("*.jsonl"))
    assert exit_code(["eval", "rftgym/VerifiableQA-v0", "rftgym/SearchEvalQA-v0", "--agent", "random",
                      "--out", str(tmp_path / "x.jsonl")]) == 2


def test_eval_gives_envs_of_the_same_name_their_own_files_and_refuses_a_repeated_env(tmp_path, capsys):
    # The same env under its module-qualified id: the same short name, so the same file name.
    out_dir = tmp_path / "evals"
    assert main(["eval", "rftgym/VerifiableQA-v0", "rftgym:rftgym/VerifiableQA-v0", "--agent", "random",
                 "--episodes", "2", "--out", str(out_dir)]) == 0
    files = sorted(out_dir.glob("*.jsonl"))
    assert len(files) == 2 and all(len(list(read_episodes_jsonl(p))) == 2 for p in files)
    assert str(files[0]) in capsys.readouterr().out
    assert exit_code(["eval", ENV_ID, ENV_ID, "--agent", "random", "--out", str(tmp_path / "d")]) == 2
    assert f"{ENV_ID} is given more than once" in capsys.readouterr().err and not (tmp_path / "d").exists()


# ---------------------------------------------------------------- bad input, found by fuzzing the CLI

@pytest.mark.parametrize("argv, message", [
    (["play", ENV_ID, "--episodes", "0"], "--episodes must be at least 1"),
    (["play", ENV_ID, "--seed", "-1"], "--seed must be in [0, 2^63)"),
    (["eval", ENV_ID, "--agent", "random", "--seed", "-3"], "--seed must be in [0, 2^63)"),
    (["eval", ENV_ID, "--agent", "random", "--sample-seed", "-3"], "--sample-seed must be in [0, 2^63)"),
    (["train", ENV_ID, "--seed", "99999999999999999999999"], "--seed must be in [0, 2^63)"),
    (["eval", ENV_ID, "--agent", "hf", "--model", "m", "--device", "foo"], "--device foo: not a torch device; use cpu, cuda or cuda:N"),
    # flags the run's agent would not read
    (["eval", ENV_ID, "--agent", "random", "--device", "cuda"], "--device is read by the local models (--agent "
                                                                 "default or hf) only, and this run's agent is random"),
    (["eval", ENV_ID, "--agent", "random", "--prefix-cache-mb", "8", "--device", "cpu"],
     "--device and --prefix-cache-mb are read by the local models (--agent default or hf) only"),
    (["eval", ENV_ID, "--prefix-cache-mb", "nan"], "--prefix-cache-mb must be a number of megabytes, 0 or more"),
    (["train", ENV_ID, "--prefix-cache-mb", "-1"], "--prefix-cache-mb must be a number of megabytes, 0 or more"),
    (["eval", ENV_ID, "--agent", "adversarial", "--temperature", "-3", "--top-p", "7"],
     "--temperature and --top-p are not read by --agent adversarial, which draws its text without a model"),
    (["eval", ENV_ID, "--agent", "random", "--max-new-tokens", "5", "--env-arg", "dataset_path=/nowhere/x.jsonl"],
     "--max-new-tokens is not read by --agent random"),  # before any env is made
    (["eval", ENV_ID, "--agent", "random", "--stop", "</answer>"], "--stop is not read by --agent random"),
    (["eval", ENV_ID, "--stop", ""], "--stop strings must be non-empty strings"),
    (["train", ENV_ID, "--stop", ""], "--stop strings must be non-empty strings"),
    (["train", ENV_ID, "--model", "/nonexistent/model"], "--model: '/nonexistent/model': no such directory"),
    (["eval", ENV_ID, "--agent", "hf", "--model", "/nonexistent/model"], "--model: '/nonexistent/model': no such"),
    # Without --agent, --model names the hf agent (and is checked as its model).
    (["eval", ENV_ID, "--model", "/nonexistent/model"], "--model: '/nonexistent/model': no such directory"),
    # Another agent's flag would be ignored, and another model evaluated than the one named.
    (["eval", ENV_ID, "--agent", "default", "--model", "/some/model"], "--model is for --agent hf, and this run's "
                                                                       "agent is default; add --agent hf"),
    (["eval", ENV_ID, "--model", "/some/model", "--api-base", "http://127.0.0.1:9/v1"],
     "--model is for --agent hf, and this run's agent is default"),
    (["eval", ENV_ID, "--agent", "random", "--api-base", "http://127.0.0.1:9/v1", "--api-timeout", "5"],
     "--api-base and --api-timeout are for --agent api, and this run's agent is random"),
    pytest.param(["train", ENV_ID, "--device", "mps"], "--device mps: this torch build or machine has no MPS device",
                 marks=pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has MPS")),
    pytest.param(["train", ENV_ID, "--device", "xpu"], "--device xpu: this torch build or machine has no XPU device",
                 marks=pytest.mark.skipif(hasattr(torch, "xpu") and torch.xpu.is_available(),
                                          reason="this machine has an XPU")),
    # A refused training setting is named by its flag, also where the field is spelled otherwise.
    (["train", ENV_ID, "--lr", "nan"], "--lr must be a finite number"),
    (["train", ENV_ID, "--lr", "inf"], "--lr must be a finite number"),
    (["train", ENV_ID, "--epochs", "0"], "--epochs must be a positive integer"),
    (["train", ENV_ID, "--weight-decay", "-1"], "--weight-decay must be >= 0"),
    (["train", ENV_ID, "--lora-alpha", "0"], "--lora-alpha must be positive"),
    (["train", ENV_ID, "--clip-high", "nan"], "--clip-high must be a finite number"),
    (["train", ENV_ID, "--clip-low", "1"], "--clip-low must be in [0, 1)"),
    (["train", ENV_ID, "--microbatch-size", "2", "--microbatch-tokens", "64"],
     "--microbatch-size=2 and --microbatch-tokens=64 are two ways"),
    # Settings of another mode would be ignored: refused, naming what they belong to.
    (["train", ENV_ID, "--pcar-lambda", "0.3"], "--pcar-lambda=0.3 is only read with algo='pcar', "
                                                "and this run has algo='grpo'"),
    (["train", ENV_ID, "--algo", "pcar", "--dcpo-segment-budget", "2"],
     "--dcpo-segment-budget=2 is only read with algo='dcpo'"),
    (["train", ENV_ID, "--lora-alpha", "32"], "--lora-alpha=32.0 is only read with LoRA (--lora-rank > 0), "
                                              "and this run has --lora-rank=0"),
    (["train", ENV_ID, "--compile", "off", "--compile-scope", "decoder"],
     "--compile-scope='decoder' is only read with compile on (or auto), and this run has compile=False"),
    (["train", ENV_ID, "--eval-episodes", "5"], "--eval-episodes=5 is only read with --eval-every > 0, "
                                                "and this run has --eval-every=0 (no evaluation)"),
    (["train", ENV_ID, "--eval-seed", "7"], "--eval-seed=7 is only read with --eval-every > 0"),
    (["train", ENV_ID, "--min-lr-ratio", "0.5"], "--min-lr-ratio=0.5 is only read with a linear or "
                                                 "cosine --lr-schedule, and this run has --lr-schedule='constant'"),
    (["train", ENV_ID, "--microbatch-size", "100", "--minibatch-size", "4"],
     "--microbatch-size=100 is larger than --minibatch-size=4"),
    # An algorithm whose signal the env declares it never gives would train as GRPO.
    (["train", ENV_ID, "--algo", "pcar"], f"--algo: pcar scales each search's advantage by the env's score of the "
                                          f"agent's evaluation of it; {ENV_ID} gives no evaluation scores "
                                          "(info['evaluation_score']), so pcar would train as plain GRPO there. Train "
                                          "with grpo, or on an env that gives them (rftgym/SearchEvalQA-v0)"),
    (["train", "rftgym/CodeTCG-v0", "--algo", "dcpo"], "rftgym/CodeTCG-v0 gives no context edits, so dcpo would "
                                                       "train as plain GRPO there"),
    # ... before the env is made (which would read its data files first)
    (["train", "rftgym/MemoryQA-v0", "--algo", "pcar", "--env-arg", "dataset_path=/nowhere/hotpot.json"],
     "--algo: pcar scales each search's advantage by the env's score of the agent's evaluation of it; "
     "rftgym/MemoryQA-v0 gives no evaluation scores"),
    (["eval", ENV_ID, "--agent", "random", "--seed", str(2**63 - 5)],
     f"--seed {2**63 - 5} with 32 episodes would run seeds past 2^63 - 1; give a --seed of at most {2**63 - 32}"),
])
def test_bad_arguments_are_refused_before_any_work(argv, message, capsys):
    assert exit_code(argv) == 2
    assert message in capsys.readouterr().err


def test_eval_out_that_is_a_directory_is_refused_before_running(tmp_path, capsys):
    (tmp_path / "existing").mkdir()
    assert exit_code(["eval", ENV_ID, "--agent", "random", "--episodes", "1", "--out", str(tmp_path / "existing")]) == 2
    assert "is a directory" in capsys.readouterr().err
    # A trailing slash names a directory to create, with the usual file name inside.
    assert main(["eval", ENV_ID, "--agent", "random", "--episodes", "1", "--out", str(tmp_path / "new") + "/"]) == 0
    assert len(list((tmp_path / "new").glob("VerifiableQA-v0-random-*.jsonl"))) == 1


def test_eval_default_names_never_overwrite(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("time.strftime", lambda *_: "20261130-000000")  # two runs in the same second
    for _ in range(2):
        assert main(["eval", ENV_ID, "--agent", "random", "--episodes", "1"]) == 0
    names = sorted(p.name for p in (tmp_path / "runs" / "eval").glob("*.jsonl"))
    assert names == ["VerifiableQA-v0-random-20261130-000000-2.jsonl", "VerifiableQA-v0-random-20261130-000000.jsonl"]


def test_an_interrupted_eval_keeps_its_finished_episodes(tmp_path, monkeypatch, capsys):
    import rftgym.rollout as rollout

    real = rollout.run_episodes

    def interrupted(make_env, agent, seeds, config=None, on_episode=None):
        real(make_env, agent, seeds[:2], config=config, on_episode=on_episode)
        raise KeyboardInterrupt

    monkeypatch.setattr(rollout, "run_episodes", interrupted)
    out = tmp_path / "eval.jsonl"
    earlier = '{"env_id": "an earlier evaluation"}\n'
    out.write_text(earlier)
    assert main(["eval", ENV_ID, "--agent", "random", "--episodes", "5", "--out", str(out)]) == 130
    partial = tmp_path / "eval.jsonl.partial"
    assert len(list(read_episodes_jsonl(partial))) == 2
    assert out.read_text() == earlier  # replaced only by a complete evaluation
    assert f"the 2 finished episodes are in {partial}; {out} is as it was" in capsys.readouterr().err


def test_an_interrupted_eval_is_finished_by_resume_as_if_it_had_run_through(tmp_path, monkeypatch, capsys):
    import rftgym.rollout as rollout

    real = rollout.run_episodes
    ran = []

    def interrupted(make_env, agent, seeds, config=None, on_episode=None):
        real(make_env, agent, seeds[:3], config=config, on_episode=on_episode)
        raise KeyboardInterrupt

    def counted(make_env, agent, seeds, config=None, on_episode=None):
        ran.extend(seeds)
        return real(make_env, agent, seeds, config=config, on_episode=on_episode)

    command = ["eval", ENV_ID, "--agent", "random", "--episodes", "8", "--seed", "4"]
    whole = tmp_path / "whole.jsonl"
    assert main(command + ["--out", str(whole)]) == 0
    out = tmp_path / "eval.jsonl"
    monkeypatch.setattr(rollout, "run_episodes", interrupted)
    assert main(command + ["--out", str(out)]) == 130
    assert f"the same command with --out {out} --resume runs the others" in capsys.readouterr().err
    monkeypatch.setattr(rollout, "run_episodes", counted)
    # Another setting than the episodes were run with is refused, naming it; so is a plain rerun.
    assert exit_code(command[:-1] + ["5", "--sample-seed", "3", "--out", str(out), "--resume"]) == 2
    assert "ran with other settings (seed 4 -> 5; sample_seed 0 -> 3)" in capsys.readouterr().err
    assert exit_code(command + ["--out", str(out)]) == 2
    assert "finish it with the same command and --resume" in capsys.readouterr().err
    # An episode twice is refused, naming it; a last line cut short by a kill while it was written is dropped.
    partial = tmp_path / "eval.jsonl.partial"
    lines = partial.read_bytes().splitlines(keepends=True)
    partial.write_bytes(b"".join(lines + lines[-1:]))
    assert exit_code(command + ["--out", str(out), "--resume"]) == 2
    assert f"--resume: {partial} holds two episodes of seed" in capsys.readouterr().err
    partial.write_bytes(b"".join(lines) + b'{"env_id": "rftgym/Verif')
    assert main(command + ["--out", str(out), "--resume"]) == 0
    err = capsys.readouterr().err
    assert "dropped the unfinished last line" in err and "3 of 8 episodes were finished" in err
    assert sorted(ran) == [7, 8, 9, 10, 11] and not partial.exists()
    assert out.read_text() == whole.read_text()  # the same episodes, in seed order
    assert not (tmp_path / "eval.jsonl.partial.json").exists()
    assert exit_code(command + ["--out", str(out), "--resume"]) == 2
    assert "nothing to resume" in capsys.readouterr().err
    assert exit_code(command + ["--resume"]) == 2
    assert "give that environment and that --out" in capsys.readouterr().err
    assert exit_code(command[:2] + ["rftgym/MemoryQA-v0"] + command[2:] + ["--out", str(tmp_path), "--resume"]) == 2
    assert "give that environment and that --out" in capsys.readouterr().err
    assert exit_code(["eval", "rftgym/MemoryQA-v0", "--agent", "random", "--baselines", "--out", str(out),
                      "--resume"]) == 2
    assert "without --baselines" in capsys.readouterr().err


def test_a_resume_with_other_stop_strings_is_refused(tmp_path, monkeypatch, capsys):
    """Replies that ended at a string are other episodes than replies that ran on; a partial file
    noted before --stop existed ran with none."""
    import rftgym.rollout as rollout

    real = rollout.run_episodes

    def interrupted(make_env, agent, seeds, config=None, on_episode=None):
        real(make_env, agent, seeds[:1], config=config, on_episode=on_episode)
        raise KeyboardInterrupt

    (tmp_path / "my_stop_agents.py").write_text(AGENT_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    command = ["eval", ENV_ID, "--agent", "my_stop_agents:Sampler", "--episodes", "3", "--out", str(tmp_path / "e.jsonl")]
    monkeypatch.setattr(rollout, "run_episodes", interrupted)
    assert main(command + ["--stop", "</a>"]) == 130
    monkeypatch.setattr(rollout, "run_episodes", real)
    capsys.readouterr()
    assert exit_code(command + ["--resume"]) == 2
    assert "ran with other settings (stop ['</a>'] -> [])" in capsys.readouterr().err
    noted = tmp_path / "e.jsonl.partial.json"
    settings = json.loads(noted.read_text())
    del settings["stop"]  # as an earlier version noted them
    noted.write_text(json.dumps(settings))
    assert exit_code(command + ["--resume", "--stop", "</a>"]) == 2
    assert "ran with other settings (stop [] -> ['</a>'])" in capsys.readouterr().err
    assert main(command + ["--resume"]) == 0


def test_a_resume_on_a_data_file_rewritten_since_is_refused(tmp_path, monkeypatch, capsys):
    """The partial file's episodes ran on what the data file held then: the same path rewritten is
    other data, the same file named from another directory is not."""
    import json

    import rftgym.rollout as rollout

    real = rollout.run_episodes

    def interrupted(make_env, agent, seeds, config=None, on_episode=None):
        real(make_env, agent, seeds[:2], config=config, on_episode=on_episode)
        raise KeyboardInterrupt

    data = tmp_path / "data"
    data.mkdir()
    tasks = data / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"question": f"{i}+4?", "answer": str(i + 4)}) + "\n" for i in range(6)))
    out = tmp_path / "eval.jsonl"
    monkeypatch.chdir(data)
    command = ["eval", ENV_ID, "--agent", "random", "--episodes", "6", "--out", str(out)]
    monkeypatch.setattr(rollout, "run_episodes", interrupted)
    assert main(command + ["--env-arg", "dataset_path=tasks.jsonl"]) == 130
    monkeypatch.setattr(rollout, "run_episodes", real)
    capsys.readouterr()
    tasks.write_text("".join(json.dumps({"question": f"{i}*100?", "answer": "0"}) + "\n" for i in range(6)))
    assert exit_code(command + ["--env-arg", "dataset_path=tasks.jsonl", "--resume"]) == 2
    assert f"--resume: the episodes in {out}.partial ran on other data: dataset_path ({tasks}) held something else " \
           "then (its sha256 differs)" in capsys.readouterr().err
    tasks.write_text("".join(json.dumps({"question": f"{i}+4?", "answer": str(i + 4)}) + "\n" for i in range(6)))
    monkeypatch.chdir(tmp_path)  # the same file, named from elsewhere
    assert main(command + ["--env-arg", "dataset_path=data/tasks.jsonl", "--resume"]) == 0
    assert "2 of 6 episodes were finished" in capsys.readouterr().err


def test_an_interrupted_eval_of_an_env_of_your_own_resumes(tmp_path, monkeypatch, capsys):
    from support import ECHO_MODULE

    import rftgym.rollout as rollout

    (tmp_path / "echo_resume_module.py").write_text(ECHO_MODULE.replace("mine/Echo-v0", "mine/EchoResume-v0"))
    monkeypatch.syspath_prepend(str(tmp_path))
    real = rollout.run_episodes

    def interrupted(make_env, agent, seeds, config=None, on_episode=None):
        real(make_env, agent, seeds[:2], config=config, on_episode=on_episode)
        raise KeyboardInterrupt

    out = tmp_path / "echo.jsonl"
    command = ["eval", "echo_resume_module:mine/EchoResume-v0", "--agent", "random", "--episodes", "4",
               "--env-arg", "word=x", "--out", str(out)]
    monkeypatch.setattr(rollout, "run_episodes", interrupted)
    assert main(command) == 130
    monkeypatch.setattr(rollout, "run_episodes", real)
    capsys.readouterr()
    # The episodes name their env mine/EchoResume-v0, as its spec does; the command names its module too.
    assert main(command + ["--resume"]) == 0
    assert "2 of 4 episodes were finished" in capsys.readouterr().err
    assert [e.seed for e in read_episodes_jsonl(out)] == [0, 1, 2, 3]


def test_a_resume_that_cannot_import_its_env_module_says_where_the_run_found_it(tmp_path, monkeypatch, capsys,
                                                                                 make_char_policy):
    from support import ECHO_MODULE, train_config

    from rftgym.train import train
    from rftgym.train.run_dir import saved_state

    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "echo_moved_module.py").write_text(ECHO_MODULE.replace("mine/Echo-v0", "mine/EchoMoved-v0"))
    monkeypatch.syspath_prepend(str(mods))
    env_id = "echo_moved_module:mine/EchoMoved-v0"
    config = train_config(tmp_path, env_id=env_id, steps=1, tasks_per_step=1, group_size=2, minibatch_size=2)
    train(config, policy=make_char_policy())
    assert saved_state(tmp_path / "run")["env_module_file"] == str(mods / "echo_moved_module.py")
    # Resumed where that module is not on the path (run from another directory).
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(mods)])
    sys.modules.pop("echo_moved_module", None)
    monkeypatch.chdir(tmp_path)
    assert exit_code(["train", env_id, "--output-dir", str(tmp_path / "run"), "--steps", "2", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "cannot import 'echo_moved_module'" in err
    assert (f"(the run in {tmp_path / 'run'} imported it from {mods / 'echo_moved_module.py'}: run this from {mods}, "
            f"or add {mods} to PYTHONPATH)") in err


def test_a_terminated_eval_says_where_its_finished_episodes_are(tmp_path, monkeypatch, capsys):
    import os
    import signal

    import rftgym.rollout as rollout

    real = rollout.run_episodes

    def terminated(make_env, agent, seeds, config=None, on_episode=None):
        real(make_env, agent, seeds[:2], config=config, on_episode=on_episode)
        os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's stop, delivered to this (main) thread
        real(make_env, agent, seeds[2:], config=config, on_episode=on_episode)

    monkeypatch.setattr(rollout, "run_episodes", terminated)
    before = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "eval.jsonl"
    assert main(["eval", ENV_ID, "--agent", "random", "--episodes", "5", "--out", str(out)]) == 143
    err = capsys.readouterr().err
    assert "terminated (SIGTERM): the 2 finished episodes are in" in err and not out.exists()
    assert err.count("terminated (SIGTERM)") == 1  # said once, with what was kept
    assert len(list(read_episodes_jsonl(tmp_path / "eval.jsonl.partial"))) == 2
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is the caller's again


def test_a_failed_eval_keeps_its_finished_episodes_and_the_earlier_output(tmp_path, monkeypatch, capsys):
    import rftgym.rollout as rollout

    real = rollout.run_episodes

    def failing(make_env, agent, seeds, config=None, on_episode=None):
        real(make_env, agent, seeds[:3], config=config, on_episode=on_episode)
        raise ChatAPIError("the server went away")

    out = tmp_path / "eval.jsonl"
    assert main(["eval", ENV_ID, "--agent", "random", "--episodes", "2", "--out", str(out)]) == 0
    earlier = out.read_text()
    monkeypatch.setattr(rollout, "run_episodes", failing)
    assert main(["eval", ENV_ID, "--agent", "random", "--episodes", "5", "--out", str(out)]) != 0
    assert out.read_text() == earlier
    assert len(list(read_episodes_jsonl(tmp_path / "eval.jsonl.partial"))) == 3
    assert "stopped by an error: the 3 finished episodes are in" in capsys.readouterr().err


def test_eval_refuses_more_episodes_than_it_can_hold(capsys):
    assert exit_code(["eval", ENV_ID, "--agent", "random", "--episodes", "100000000000"]) == 2
    assert "split it into runs with --seed S --episodes N" in capsys.readouterr().err


def test_eval_refuses_to_write_over_its_input_or_where_it_cannot_write(tmp_path, capsys):
    data = tmp_path / "tasks.jsonl"
    data.write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n")
    before = data.read_text()
    assert exit_code(["eval", ENV_ID, "--agent", "random", "--env-arg", f"dataset_path={data}",
                      "--out", str(data)]) == 2
    assert "is the file given as --env-arg dataset_path" in capsys.readouterr().err
    assert data.read_text() == before and not (tmp_path / "tasks.jsonl.partial").exists()
    # Also through a directory that does not exist yet.
    assert exit_code(["eval", ENV_ID, "--agent", "random", "--env-arg", f"dataset_path={data}",
                      "--out", str(tmp_path / "new" / ".." / "tasks.jsonl")]) == 2
    assert "is the file given as --env-arg dataset_path" in capsys.readouterr().err
    assert data.read_text() == before and not (tmp_path / "new").exists()
    assert exit_code(["eval", ENV_ID, "--agent", "random", "--out", str(tmp_path / ("x" * 300 + ".jsonl"))]) == 2
    assert "cannot be written: File name too long" in capsys.readouterr().err
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro" / "eval.jsonl.partial").mkdir()  # even as root, a file cannot be made there
    assert exit_code(["eval", ENV_ID, "--agent", "random", "--out", str(tmp_path / "ro" / "eval.jsonl")]) == 2
    assert "eval.jsonl cannot be written: Is a directory" in capsys.readouterr().err
    (tmp_path / "afile").write_text("x")
    assert exit_code(["eval", ENV_ID, "--agent", "random", "--out", str(tmp_path / "afile" / "x.jsonl")]) == 2
    assert f"x.jsonl cannot be written: {tmp_path / 'afile'} is a file, not a directory" in capsys.readouterr().err
    assert exit_code(["eval", ENV_ID, "rftgym/MemoryQA-v0", "--agent", "random", "--out", str(tmp_path / "afile")]) == 2
    assert "with several environments --out is a directory" in capsys.readouterr().err
    assert (tmp_path / "afile").read_text() == "x"
    # Never replaced by the finished file: a pipe, or a device (as root, --out /dev/null had turned
    # /dev/null into a plain file; a pipe stands in for it here, the same check refuses both).
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    assert exit_code(["eval", ENV_ID, "--agent", "random", "--episodes", "1", "--out", str(fifo)]) == 2
    assert "is not a regular file (a device, pipe or socket)" in capsys.readouterr().err
    assert fifo.is_fifo() and not (tmp_path / "pipe.jsonl.partial").exists()


def test_eval_out_replaces_only_an_earlier_evaluations_episodes(tmp_path, capsys):
    # A file of the user's (code, notes) is never overwritten; an earlier evaluation's episodes
    # (a rerun) and an empty file are.
    module = tmp_path / "myenvs.py"
    module.write_text("import gymnasium\n")
    assert exit_code(["eval", ENV_ID, "--agent", "random", "--episodes", "1", "--out", str(module)]) == 2
    err = capsys.readouterr().err
    assert f"--out {module} is a file that is not an earlier evaluation's episodes" in err
    assert "Give another --out, or move the file away" in err
    assert module.read_text() == "import gymnasium\n" and not (tmp_path / "myenvs.py.partial").exists()
    out = tmp_path / "eval.jsonl"
    assert main(["eval", ENV_ID, "--agent", "random", "--episodes", "1", "--out", str(out)]) == 0
    assert main(["eval", ENV_ID, "--agent", "random", "--episodes", "2", "--out", str(out)]) == 0
    assert len(list(read_episodes_jsonl(out))) == 2
    # Compressed where the name says so, and replaced as episodes again.
    packed = tmp_path / "eval.jsonl.gz"
    for episodes in (2, 3):
        assert main(["eval", ENV_ID, "--agent", "random", "--episodes", str(episodes), "--out", str(packed)]) == 0
        assert packed.read_bytes()[:2] == b"\x1f\x8b" and len(list(read_episodes_jsonl(packed))) == episodes
    empty = tmp_path / "empty.jsonl"
    empty.touch()
    assert main(["eval", ENV_ID, "--agent", "random", "--episodes", "1", "--out", str(empty)]) == 0
    assert len(list(read_episodes_jsonl(empty))) == 1


def test_train_resume_problems_say_what_to_do(tmp_path, capsys):
    base = ["train", ENV_ID, "--steps", "1", "--device", "cpu"]
    # --resume with nothing to resume: a directory that does not exist is told apart from one with no
    # checkpoint; neither is sent to "another output directory" (without --resume it is used as it is)
    assert exit_code(base + ["--resume", "--output-dir", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'missing'} does not exist; give the --output-dir of an earlier run" in err
    assert "another output directory" not in err
    (tmp_path / "empty").mkdir()
    assert exit_code(base + ["--resume", "--output-dir", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert "holds no complete checkpoint" in err and "drop --resume to start a new run" in err
    assert "another output directory" not in err
    # export of a run that does not exist says so
    assert exit_code(["export", str(tmp_path / "no-run"), str(tmp_path / "out")]) == 2
    assert f"'{tmp_path / 'no-run'}' does not exist; give the --output-dir" in capsys.readouterr().err
    # a partial checkpoint (state.json lost) is not overwritten by a new run
    partial = tmp_path / "partial"
    (partial / "checkpoint").mkdir(parents=True)
    (partial / "checkpoint" / "trainable.pt").write_bytes(b"weights")
    assert exit_code(base + ["--output-dir", str(partial)]) == 2
    assert "holds an incomplete checkpoint" in capsys.readouterr().err
    assert (partial / "checkpoint" / "trainable.pt").read_bytes() == b"weights"
    # an output directory that is a file
    (tmp_path / "afile").write_text("x")
    assert exit_code(base + ["--output-dir", str(tmp_path / "afile")]) == 2
    assert "is a file" in capsys.readouterr().err


def test_env_arg_messages_name_the_option(capsys):
    assert exit_code(["play", ENV_ID, "--env-arg", "foo=1"]) == 2
    assert "unknown option 'foo'" in capsys.readouterr().err
    assert exit_code(["play", ENV_ID, "--env-arg", "max_episode_steps=0"]) == 2
    assert "max_episode_steps must be a positive int" in capsys.readouterr().err


def test_generated_world_size_is_bounded(capsys):
    assert exit_code(["play", "rftgym/SearchEvalQA-v0", "--env-arg", "world_size=5000"]) == 2
    assert "world_size must be at most" in capsys.readouterr().err


def test_serve_retriever_on_a_busy_port_says_so_before_indexing(tmp_path, capsys, monkeypatch):
    import socket

    import rftgym.envs.search.server as server

    def no_indexing(*args, **kwargs):
        raise AssertionError("the corpus was loaded before the address was taken")

    monkeypatch.setattr(server, "load_corpus", no_indexing)
    corpus = tmp_path / "corpus.json"
    corpus.write_text(json.dumps({"Veloria": ["Veloria is a city on the river Tulen."]}))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert exit_code(["serve-retriever", "--corpus", str(corpus), "--port", str(port)]) == 2
    assert f"cannot serve on 127.0.0.1:{port}" in capsys.readouterr().err
    assert exit_code(["serve-retriever", "--corpus", str(corpus), "--host", ""]) == 2
    assert "the host is empty" in capsys.readouterr().err
    assert exit_code(["serve-retriever", "--corpus", str(corpus), "--host", "no-such-host.invalid"]) == 2
    assert "cannot serve on no-such-host.invalid" in capsys.readouterr().err


def test_eval_names_episodes_that_ran_out_of_context(tmp_path, monkeypatch, capsys):
    import rftgym.cli.evaluate as cli_evaluate
    from rftgym.agents.base import CONTEXT_FULL, Agent, AgentReply

    class NoRoom(Agent):
        name = "no-room"

        def act(self, contexts):
            return [AgentReply(text="", finish_reason=CONTEXT_FULL) for _ in contexts]

    monkeypatch.setattr(cli_evaluate, "_build_agent", lambda args: NoRoom())
    assert main(["eval", ENV_ID, "--agent", "random", "--episodes", "3", "--out", str(tmp_path / "e.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "note: 3 rftgym/VerifiableQA-v0 episode(s) ended because the context left no room" in out
    assert all(e.context_full for e in read_episodes_jsonl(tmp_path / "e.jsonl"))


def test_eval_says_how_many_replies_stopped_at_the_token_limit(tmp_path, monkeypatch, capsys):
    """An API model whose answers run past --max-new-tokens (256 by default; a HumanEval function
    with its docstring can take twice that) loses them silently otherwise: finish_reason "length"
    lives only in the episode files. An agent without token records shows no token columns."""
    import rftgym.cli.evaluate as cli_evaluate
    from rftgym.agents.base import Agent, AgentReply

    class Rambles(Agent):
        name = "rambles"

        def act(self, contexts):
            return [AgentReply(text="Let me think about this for a long", finish_reason="length") for _ in contexts]

    monkeypatch.setattr(cli_evaluate, "_build_agent", lambda args: Rambles())
    assert main(["eval", ENV_ID, "--agent", "random", "--episodes", "2", "--env-arg", "max_turns=2",
                 "--out", str(tmp_path / "e.jsonl")]) == 0
    out = capsys.readouterr().out
    assert ("note: 4 of 4 rftgym/VerifiableQA-v0 replies stopped at the token limit (--max-new-tokens 256, "
            "finish_reason 'length')") in out
    header, _, row = out.splitlines()[:3]
    cells = dict(zip(header.split(), row.split()))
    assert cells["sampled_tok"] == "-" and cells["prompt_tok"] == "-"  # none recorded: not a count of 0


def test_eval_never_starts_over_an_unfinished_evaluations_episodes(tmp_path, monkeypatch, capsys):
    import rftgym.rollout as rollout

    out = tmp_path / "eval.jsonl"
    (tmp_path / "eval.jsonl.partial").write_text('{"an": "episode"}\n')
    assert exit_code(["eval", ENV_ID, "--agent", "random", "--episodes", "2", "--out", str(out)]) == 2
    assert "eval.jsonl.partial holds the episodes of an earlier evaluation that did not complete" in \
        capsys.readouterr().err
    assert (tmp_path / "eval.jsonl.partial").read_text() == '{"an": "episode"}\n'
    (tmp_path / "eval.jsonl.partial").unlink()

    def interrupted_at_once(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(rollout, "run_episodes", interrupted_at_once)
    assert main(["eval", ENV_ID, "--agent", "random", "--episodes", "2", "--out", str(out)]) == 130
    assert "interrupted before any episode finished" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no empty partial file left behind


def test_eval_writes_through_a_symlinked_out(tmp_path):
    real = tmp_path / "results" / "eval.jsonl"
    real.parent.mkdir()
    real.write_text("{\"env_id\": \"an earlier run\"}\n")
    link = tmp_path / "latest.jsonl"
    link.symlink_to(real)
    assert main(["eval", ENV_ID, "--agent", "random", "--episodes", "2", "--out", str(link)]) == 0
    assert link.is_symlink() and len(list(read_episodes_jsonl(real))) == 2
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["eval.jsonl", "latest.jsonl", "latest.jsonl.settings.json",
                                                           "results"]




def test_eval_runs_an_env_of_your_own_as_module_colon_id(tmp_path, monkeypatch, capsys):
    from support import ECHO_MODULE

    (tmp_path / "echo_env_module.py").write_text(ECHO_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "echo.jsonl"
    assert main(["eval", "echo_env_module:mine/Echo-v0", "--agent", "random", "--episodes", "2",
                 "--env-arg", "word=x", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "mine/Echo-v0" in table.splitlines()[2] and "said" in table.splitlines()[0]  # its own column too
    assert [e.env_id for e in read_episodes_jsonl(out)] == ["mine/Echo-v0"] * 2
    # The installed `rftgym` command has no current directory on its path: a module there is found.
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "echo_cwd_module.py").write_text(ECHO_MODULE.replace("mine/Echo-v0", "mine/EchoCwd-v0"))
    monkeypatch.chdir(other)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(other))])
    assert main(["eval", "echo_cwd_module:mine/EchoCwd-v0", "--agent", "random", "--episodes", "1",
                 "--out", str(other / "e.jsonl")]) == 0
    assert exit_code(["eval", "no_such_module_here:mine/Echo-v0", "--agent", "random"]) == 2
    assert "cannot import 'no_such_module_here'" in capsys.readouterr().err
    # An env without a config dataclass: its options are its constructor's parameters.
    assert exit_code(["eval", "echo_env_module:mine/Echo-v0", "--agent", "random", "--env-arg", "bogus=1"]) == 2
    assert "unknown option 'bogus'. Valid options: word (and gymnasium's max_episode_steps)" in capsys.readouterr().err
    assert exit_code(["eval", "mine/Nope-v0", "--agent", "random"]) == 2
    assert "(your own: module:EnvId" in capsys.readouterr().err


def test_a_baselines_wrapper_is_loaded_only_when_the_baselines_run(tmp_path, monkeypatch, capsys):
    from support import ECHO_MODULE

    module = ECHO_MODULE.replace('"eval_metrics": (("said", "said", "final_mean"),)',
                                 '"eval_metrics": (), "eval_baselines": (("w", {}, "no_such_wrapper_mod:W"),)')
    (tmp_path / "echo_lazy_wrapper.py").write_text(module.replace("mine/Echo-v0", "mine/EchoLazy-v0"))
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["eval", "echo_lazy_wrapper:mine/EchoLazy-v0", "--agent", "random", "--episodes", "1",
            "--out", str(tmp_path / "e.jsonl")]
    assert main(argv) == 0  # without --baselines the wrapper never runs
    assert exit_code([*argv, "--baselines"]) == 2
    assert "'no_such_wrapper_mod:W' cannot be loaded" in capsys.readouterr().err


@pytest.mark.parametrize("metadata, message", [
    ('"eval_metrics": ["said"]', "metadata['eval_metrics'] is malformed: the entry 'said' is not a (column, info "
                                 "key, reducer) triple of strings"),
    ('"eval_metrics": (("said", "said", "median"),)', "names the reducer 'median'; choose from final_mean, "
                                                      "final_rate, turn_mean, turn_max"),
    ('"eval_metrics": "said"', "it is str, not a tuple of (column, info key, reducer) triples"),
    ('"eval_baselines": (("plain", None, None),)', "metadata['eval_baselines'] has the entry ('plain', None, None)"),
    ('"eval_baselines": (("a", {}, None), ("a", {"word": "x"}, None))', "has the label 'a' twice; labels are distinct"),
    ('"eval_baselines": (("a/b", {}, None),)', "has the label 'a/b'; labels are distinct, non-empty"),
    ('"eval_baselines": (("", {}, None),)', "has the label ''; labels are distinct, non-empty"),
    ('"eval_baselines": (("w", {}, "no_such_wrapper_mod:W"),)',
     "the baseline 'w''s agent wrapper 'no_such_wrapper_mod:W' cannot be loaded"),
    ('"eval_metrics": (("said", "said", "final_mean"), ("said", "said", "turn_max"))',
     "names the column(s) said twice or as one of the table's own"),
    ('"eval_metrics": (("reward", "said", "final_mean"),)', "names the column(s) reward twice or as one"),
])
def test_an_envs_malformed_eval_metadata_is_named_before_any_episode(tmp_path, monkeypatch, capsys, metadata, message):
    from support import ECHO_MODULE

    name = f"echo_meta_{abs(hash(metadata))}"
    module = ECHO_MODULE.replace('"eval_metrics": (("said", "said", "final_mean"),)', metadata)
    (tmp_path / f"{name}.py").write_text(module.replace("mine/Echo-v0", f"mine/{name}-v0"))
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "e.jsonl"
    assert exit_code(["eval", f"{name}:mine/{name}-v0", "--agent", "random", "--episodes", "2", "--baselines",
                      "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and f"mine/{name}-v0" in err
    assert not out.exists() and not (tmp_path / "e.jsonl.partial").exists()


AGENT_MODULE = """
from rftgym.agents.base import Agent, AgentReply


class Answers4(Agent):
    name = "answers-4"

    def act(self, contexts):
        return [AgentReply(text="<answer>4</answer>") for _ in contexts]


def make_it():
    return Answers4()


def broken():
    raise RuntimeError("no weights here")


NOT_AN_AGENT = 3
MADE = Answers4()


class Sampler(Agent):
    # answers with the sampling settings it was made with

    def __init__(self, temperature=0.7, seed=5, **others):
        self.settings = {"temperature": temperature, "seed": seed, **others}

    def act(self, contexts):
        return [AgentReply(text=f"<answer>{sorted(self.settings.items())}</answer>") for _ in contexts]


def sampler_without_seed(temperature):
    return Answers4()


class ClosesBadly(Answers4):
    name = "closes-badly"

    def close(self):
        raise RuntimeError("close failed")
"""


def test_a_module_of_your_own_named_like_the_standard_librarys_is_said_to_be_shadowed(tmp_path, monkeypatch, capsys):
    # ./code.py: the import finds the standard library's code module first (the current directory
    # is searched last, so that a file here never shadows an installed module)
    (tmp_path / "code.py").write_text(AGENT_MODULE)
    monkeypatch.chdir(tmp_path)
    assert exit_code(["eval", ENV_ID, "--episodes", "1", "--agent", "code:Answers4"]) == 2
    assert f"has no 'Answers4'; it is not {tmp_path / 'code.py'}, which an import finds only after " in \
        (err := capsys.readouterr().err) and "code.py: rename the file" in err
    assert exit_code(["eval", "code:mine/NoSuchEnv-v0", "--agent", "random", "--episodes", "1"]) == 2
    assert f"no registered environment's entry point is in code; it is not {tmp_path / 'code.py'}" in \
        capsys.readouterr().err


def test_eval_runs_an_agent_of_your_own_as_module_colon_name(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_agents_mod.py").write_text(AGENT_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    for target in ("my_agents_mod:Answers4", "my_agents_mod:make_it"):
        assert main(["eval", ENV_ID, "--agent", target, "--episodes", "2"]) == 0
        out = capsys.readouterr().out
        assert "answers-4" in out.splitlines()[2]
    files = sorted(p.name for p in (tmp_path / "runs" / "eval").glob("*.jsonl"))
    assert len(files) == 2 and all(name.startswith("VerifiableQA-v0-my_agents_mod-") for name in files)
    for argv, message, code in [
        (["--agent", "my_agents_mod:nothing"], "cannot load 'nothing' from 'my_agents_mod'", 2),
        (["--agent", "no_such_agents_mod:X"], "cannot load 'X' from 'no_such_agents_mod'", 2),
        (["--agent", "my_agents_mod:NOT_AN_AGENT"], "is an int; name an Agent", 2),
        (["--agent", "my_agents_mod:make_itt"], "my_agents_mod.py) has no 'make_itt' (did you mean 'make_it'?)", 2),
        (["--agent", "my_agents_mod:sampler_without_seed"], "needs 'temperature', which the command line does not "
                                                            "give; give --temperature, or give the parameter a default", 2),
        (["--agent", "my_agents_mod:broken"], "making the agent raised RuntimeError: no weights here", 1),
        (["--agent", "nonsense"], "invalid choice: 'nonsense'", 2),
        (["--agent", "my_agents_mod:Answers4", "--model", "x"], "--model is for --agent hf", 2),
    ]:
        argv = ["eval", ENV_ID, "--episodes", "1", *argv]
        assert (exit_code(argv) if code == 2 else main(argv)) == code, argv
        assert message in capsys.readouterr().err, argv
    # An agent whose close() fails: the results stay, with a warning naming it.
    assert main(["eval", ENV_ID, "--agent", "my_agents_mod:ClosesBadly", "--episodes", "1"]) == 0
    captured = capsys.readouterr()
    assert "closes-badly" in captured.out.splitlines()[2]
    assert "agent 'closes-badly': close() raised RuntimeError: close failed" in captured.err


def test_sampling_flags_reach_an_agent_of_your_own_or_are_refused(tmp_path, monkeypatch, capsys):
    """--temperature, --top-p, --max-new-tokens and --sample-seed given to an agent of your own
    become its factory's keyword arguments; one it cannot take is refused, not ignored."""
    (tmp_path / "my_sampling_agents.py").write_text(AGENT_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "e.jsonl"
    assert main(["eval", ENV_ID, "--agent", "my_sampling_agents:Sampler", "--episodes", "1", "--temperature", "0.7",
                 "--top-p", "0.9", "--sample-seed", "none", "--out", str(out)]) == 0
    action = json.loads(out.read_text().splitlines()[0])["turns"][0]["action"]
    assert action == "<answer>[('seed', None), ('temperature', 0.7), ('top_p', 0.9)]</answer>"
    # flags not given are not passed: the agent keeps its own defaults; a flag given at the CLI's
    # default value is passed all the same (--temperature 0 asks for greedy decoding)
    assert main(["eval", ENV_ID, "--agent", "my_sampling_agents:Sampler", "--episodes", "1", "--out", str(out)]) == 0
    assert json.loads(out.read_text().splitlines()[0])["turns"][0]["action"] == \
        "<answer>[('seed', 5), ('temperature', 0.7)]</answer>"
    assert main(["eval", ENV_ID, "--agent", "my_sampling_agents:Sampler", "--episodes", "1", "--temperature", "0",
                 "--sample-seed=0", "--out", str(out)]) == 0
    assert json.loads(out.read_text().splitlines()[0])["turns"][0]["action"] == \
        "<answer>[('seed', 0), ('temperature', 0.0)]</answer>"
    assert main(["eval", ENV_ID, "--agent", "my_sampling_agents:Sampler", "--episodes", "1", "--stop", "</a>",
                 "--stop", "\n\n", "--out", str(out)]) == 0
    assert json.loads(out.read_text().splitlines()[0])["turns"][0]["action"] == \
        "<answer>[('seed', 5), ('stop', ['</a>', '\\n\\n']), ('temperature', 0.7)]</answer>"
    capsys.readouterr()
    for target, flags, message in [
        ("Answers4", ["--temperature", "0.7"], "--temperature cannot reach --agent 'my_sampling_agents:Answers4': "
                                               "it takes no 'temperature' parameter"),
        ("sampler_without_seed", ["--temperature", "0.5", "--sample-seed", "3", "--max-new-tokens", "9"],
         "--max-new-tokens and --sample-seed cannot reach --agent 'my_sampling_agents:sampler_without_seed': it "
         "takes no 'max_new_tokens' or 'seed' parameter"),
        ("MADE", ["--top-p", "0.5"], "it is an Agent already made"),
    ]:
        assert exit_code(["eval", ENV_ID, "--agent", f"my_sampling_agents:{target}", "--episodes", "1", *flags]) == 2
        assert message in capsys.readouterr().err, target


def test_an_env_module_that_breaks_is_a_usage_error_naming_what_broke(tmp_path, monkeypatch, capsys):
    (tmp_path / "rft_probe_syntax.py").write_text("def broken(:\n")
    (tmp_path / "rft_probe_raises.py").write_text("raise RuntimeError('boom at import')\n")
    (tmp_path / "rft_probe_entry.py").write_text(
        "import gymnasium as gym\ngym.register('mine/BadEntry-v0', entry_point='rft_probe_entry:nothere')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "rft_probe_needs.py").write_text("import rft_no_such_dependency\n")
    (tmp_path / "rft_probe_init.py").write_text(
        "import gymnasium as gym\n\nclass Broken(gym.Env):\n    def __init__(self):\n        raise OSError('no disk')\n\n"
        "gym.register('mine/BrokenInit-v0', entry_point=Broken)\n")
    raises = tmp_path / "rft_probe_raises.py"
    for env_id, message in [("rft_probe_syntax:mine/X-v0", "cannot import 'rft_probe_syntax': SyntaxError: "),
                            ("rft_probe_raises:mine/X-v0", "cannot import 'rft_probe_raises': RuntimeError: boom at "
                                                           f"import, raised at {raises}:1; fix the module"),
                            ("rft_probe_needs:mine/X-v0", "cannot import 'rft_probe_needs': importing it needs "
                                                          "'rft_no_such_dependency', which is not installed (imported "
                                                          f"at {tmp_path}/rft_probe_needs.py:1); install it"),
                            ("rft_probe_nothere:mine/X-v0", "cannot import 'rft_probe_nothere': no module "
                                                            "'rft_probe_nothere' is on the Python path"),
                            ("rft_probe_entry:mine/BadEntry-v0", "its entry point 'rft_probe_entry:nothere' cannot be "
                                                                 f"loaded: 'rft_probe_entry' ({tmp_path}/rft_probe_entry.py) "
                                                                 "has no 'nothere'")]:
        assert exit_code(["eval", env_id, "--agent", "random", "--episodes", "1"]) == 2
        assert message in capsys.readouterr().err, env_id
    # An entry point that is no module:name is said to be one.
    from rftgym.cli.user_code import _load_object, load_failure

    with pytest.raises(ValueError) as refused:
        _load_object("rft_probe_entry.nothere")
    assert load_failure("rft_probe_entry.nothere", refused.value, form="module:Class") == \
        "'rft_probe_entry.nothere' is not of the form 'module:name'; give module:Class"
    # A file's path where the module's name goes: the name to give, and where to run.
    for given, said in [("../my_agents", "give the module's name, 'my_agents', as Python imports it, and run from"),
                        ("my_agents.py", "give it as Python imports it, 'my_agents', from the directory"),
                        ("pkg/sub", "give it as Python imports it, 'pkg.sub', from the directory"),
                        (".my_agents", "give it as Python imports it, 'my_agents', from the directory")]:
        assert exit_code(["eval", ENV_ID, "--agent", f"{given}:SayA", "--episodes", "1"]) == 2
        assert f"{given!r} is a file path, not a module name; {said}" in capsys.readouterr().err, given
    # An env whose constructor raises: an error naming it, and the constructor's traceback.
    assert main(["eval", "rft_probe_init:mine/BrokenInit-v0", "--agent", "random", "--episodes", "1"]) == 1
    err = capsys.readouterr().err
    assert "mine/BrokenInit-v0 could not be made: its constructor raised OSError: no disk" in err
    assert "raise OSError('no disk')" in err


def test_a_service_that_is_down_is_one_line_not_a_traceback(capsys):
    import socket

    with socket.socket() as probe:  # a port nothing listens on, on this machine
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert main(["eval", "rftgym/SearchEvalQA-v0", "--agent", "random", "--episodes", "1", "--env-arg",
                 "retriever=remote", "--env-arg", f"retriever_url=http://127.0.0.1:{port}/retrieve"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "error: the retrieval service at http://127.0.0.1:" in err
    assert exit_code(["eval", "rftgym/SearchEvalQA-v0", "--agent", "random", "--env-arg", "retriever=remote",
                      "--env-arg", "retriever_url=http://127.0.0.1:110647/retrieve"]) == 2


def test_a_reader_that_leaves_the_pipe_is_not_an_error():
    """`rftgym envs | head -1`: the pipe closes before the output is written."""
    process = subprocess.Popen([sys.executable, "-m", "rftgym.cli", "envs"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    process.stdout.close()  # before the command (still importing) writes anything
    _, err = process.communicate(timeout=120)
    assert process.returncode == 141 and b"Traceback" not in err, err.decode()


def test_eval_names_the_flag_when_new_tokens_do_not_fit_the_models_context(monkeypatch, capsys, tmp_path):
    from rftgym.agents.hf_policy import HFPolicy

    from support import make_char_policy

    def tiny(cls, model=None, sampling=None, **kwargs):
        policy = make_char_policy()
        policy.sampling = sampling
        return policy

    monkeypatch.setattr(HFPolicy, "from_pretrained", classmethod(tiny))
    context = make_char_policy().context_length
    assert exit_code(["eval", ENV_ID, "--episodes", "1", "--max-new-tokens", str(context + 5),
                      "--out", str(tmp_path / "x.jsonl")]) == 2
    assert f"--max-new-tokens={context + 5} does not fit the model's context" in capsys.readouterr().err


def test_eval_hands_the_prefix_cache_budget_to_the_local_model(monkeypatch, tmp_path, capsys):
    from rftgym.agents.hf_policy import HFPolicy

    from support import make_char_policy

    budgets = []

    def tiny(cls, model=None, sampling=None, prefix_cache_mb=1024, **kwargs):
        budgets.append(prefix_cache_mb)
        policy = make_char_policy()
        policy.sampling = sampling
        policy.set_prefix_cache_mb(prefix_cache_mb)
        return policy

    monkeypatch.setattr(HFPolicy, "from_pretrained", classmethod(tiny))
    for flags in ([], ["--prefix-cache-mb", "0"], ["--prefix-cache-mb", "64.5"]):
        assert main(["eval", ENV_ID, "--agent", "default", "--episodes", "1", "--max-new-tokens", "4", *flags,
                     "--out", str(tmp_path / "x.jsonl")]) == 0
        assert "changes nothing" not in capsys.readouterr().err  # the generic loop (CPU) reuses prefixes
    assert budgets == [1024, 0.0, 64.5]


def test_eval_says_when_the_fast_decoder_leaves_the_prefix_cache_budget_unused(monkeypatch, tmp_path, capsys):
    from rftgym.agents.hf_policy import HFPolicy

    from support import make_char_policy

    def fast(cls, model=None, sampling=None, prefix_cache_mb=1024, **kwargs):  # as on CUDA by default
        char = make_char_policy()
        return HFPolicy(char.model, char.tokenizer, sampling=sampling, fast_decode=True, prefix_cache_mb=prefix_cache_mb)

    monkeypatch.setattr(HFPolicy, "from_pretrained", classmethod(fast))
    for flags, noted in (([], False), (["--prefix-cache-mb", "0"], False), (["--prefix-cache-mb", "64"], True)):
        assert main(["eval", ENV_ID, "--agent", "default", "--episodes", "1", "--max-new-tokens", "4", *flags,
                     "--out", str(tmp_path / "x.jsonl")]) == 0
        assert ("--prefix-cache-mb changes nothing here: the fast decoder serves" in capsys.readouterr().err) == noted


def test_a_warning_on_the_command_line_is_one_line_without_library_source(tmp_path):
    import subprocess
    import sys

    # A reply cut by the env warns; the warning's own source line (library code) is left out.
    done = subprocess.run([sys.executable, "-m", "rftgym.cli", "eval", ENV_ID, "--agent", "random", "--episodes", "1",
                           "--env-arg", "max_action_chars=5", "--out", str(tmp_path / "e.jsonl")],
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stderr.replace("\r", "\n").splitlines() if "UserWarning" in line]
    # "UserWarning: ...", not "/path/to/rftgym/rollout/engine.py:123: UserWarning: ..." and its source line
    assert lines and lines[0].strip().startswith("UserWarning: ") and "stored a reply other than" in lines[0], \
        done.stderr


# ---------------------------------------------------------------- the API agent's flags

@contextlib.contextmanager
def chat_server(answer):
    """A chat-completions server on 127.0.0.1 that keeps every request body; ``answer(n)`` gives the
    n-th request's (status, JSON body)."""
    bodies, lock = [], threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                bodies.append(body)
                n = len(bodies)
            status, reply = answer(n)
            payload = json.dumps(reply).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

    with serving(Handler) as base:
        yield f"{base}/v1", bodies


API = ["--agent", "api", "--api-base", "http://127.0.0.1:9/v1", "--api-model", "m"]


def test_the_api_agents_flags_reach_its_config():
    from rftgym.cli import build_parser
    from rftgym.cli.agents import _build_agent

    agent = _build_agent(build_parser().parse_args(["eval", ENV_ID, *API, "--api-max-retries", "2", "--api-backoff",
                                                    "0.25", "--api-timeout", "7", "--sample-seed", "11", "--num-envs",
                                                    "3"]))
    config = agent.config
    assert (config.max_retries, config.backoff_s, config.timeout_s, config.seed, config.max_concurrency) == \
        (2, 0.25, 7.0, 11, 3)
    defaults = _build_agent(build_parser().parse_args(["eval", ENV_ID, *API])).config
    assert (defaults.max_retries, defaults.backoff_s, defaults.timeout_s, defaults.seed) == (5, 0.5, 60.0, 0)
    extra = build_parser().parse_args(["eval", ENV_ID, *API, "--api-extra", '{"top_k": 20, "chat_template_kwargs": {}}'])
    assert _build_agent(extra).config.extra_body == {"top_k": 20, "chat_template_kwargs": {}}
    # none: no seed (a server that refuses the field), fresh randomness for the local agents
    assert _build_agent(build_parser().parse_args(["eval", ENV_ID, *API, "--sample-seed", "none"])).config.seed is None


@pytest.mark.parametrize("argv, message", [
    ([*API, "--api-max-retries", "-1"], "--api-max-retries: ChatAPIConfig.max_retries must be an integer >= 0"),
    ([*API, "--api-backoff", "-1"], "--api-backoff: ChatAPIConfig.backoff_s must be a number of seconds in [0, 3600]"),
    ([*API, "--api-backoff", "1e308"], "--api-backoff: ChatAPIConfig.backoff_s must be a number of seconds in [0, 3600]"),
    (["--agent", "random", "--api-max-retries", "2", "--api-backoff", "1"],
     "--api-max-retries and --api-backoff are for --agent api, and this run's agent is random"),
    ([*API, "--api-extra", "{top_k: 20}"], "--api-extra: not valid JSON"),
    ([*API, "--api-extra", "[1, 2]"], "--api-extra: give a JSON object"),
    ([*API, "--api-extra", '{"model": "other"}'], "--api-extra: ChatAPIConfig.extra_body must not set ['model']"),
])
def test_bad_api_flags_are_named(argv, message, tmp_path, capsys):
    assert exit_code(["eval", ENV_ID, *argv, "--out", str(tmp_path / "e.jsonl")]) == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_eval_with_an_api_agent_retries_as_told_and_seeds_each_request(tmp_path):
    from rftgym.agents.sampling_keys import episode_keys, keyed_seed

    reply = {"choices": [{"message": {"role": "assistant", "content": "<answer>4</answer>"}, "finish_reason": "stop"}]}
    with chat_server(lambda n: (503, {"error": {"message": "loading"}}) if n == 1 else (200, reply)) as (url, bodies):
        with pytest.warns(UserWarning, match="attempt 1 of 2 failed: HTTP 503"):
            assert main(["eval", ENV_ID, "--agent", "api", "--api-base", url, "--api-model", "m", "--temperature",
                         "0.7", "--seed", "3", "--sample-seed", "8", "--episodes", "2", "--api-max-retries", "1",
                         "--api-backoff", "0.01", "--out", str(tmp_path / "e.jsonl")]) == 0
    # Each request's seed comes from the sample seed, its episode's key (task seed, repeat) and turn.
    keys = episode_keys([3, 4])
    assert {keyed_seed(8, (*key, 0)) for key in keys} <= {body["seed"] for body in bodies}
    assert {body["seed"] for body in bodies} <= {keyed_seed(8, (*key, turn)) for key in keys for turn in range(64)}
    assert len(list(read_episodes_jsonl(tmp_path / "e.jsonl"))) == 2


def test_a_failed_eval_shows_the_envs_it_completed(tmp_path, monkeypatch, capsys):
    import rftgym.rollout as rollout

    real = rollout.run_episodes
    calls = []

    def the_second_env_fails(make_env, agent, seeds, config=None, on_episode=None):
        calls.append(seeds)
        if len(calls) == 2:
            raise ChatAPIError("the server went away")
        return real(make_env, agent, seeds, config=config, on_episode=on_episode)

    monkeypatch.setattr(rollout, "run_episodes", the_second_env_fails)
    monkeypatch.setenv("RFTGYM_CACHE", str(tmp_path / "cache"))
    out_dir = tmp_path / "evals"
    assert main(["eval", "rftgym/VerifiableQA-v0", "rftgym/SearchEvalQA-v0", "--agent", "random", "--episodes", "2",
                 "--out", str(out_dir)]) == 1
    captured = capsys.readouterr()
    [done] = out_dir.glob("*.jsonl")
    assert done.name.startswith("VerifiableQA-v0") and len(list(read_episodes_jsonl(done))) == 2
    rows = [line for line in captured.out.splitlines() if line.startswith("rftgym/")]
    assert len(rows) == 1 and rows[0].startswith("rftgym/VerifiableQA-v0")  # the table a complete run prints
    assert f"episodes written to {done}" in captured.out
    assert "error: the server went away" in captured.err


def test_evaluations_started_in_the_same_second_never_share_a_default_file(tmp_path, monkeypatch, capsys):
    """Two evaluations started together (other seeds, the same env and agent) both named their file
    by the second and wrote one .partial and one file: the first's episodes were lost. Each claims
    its name by creating the partial file; one held by another evaluation is passed over."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("time.strftime", lambda *_: "20261130-000000")
    folder = tmp_path / "runs" / "eval"
    folder.mkdir(parents=True)
    held = folder / "VerifiableQA-v0-random-20261130-000000.jsonl.partial"
    held.write_text("")  # another evaluation, started this second, before its first episode finished
    assert main(["eval", ENV_ID, "--agent", "random", "--episodes", "2", "--seed", "100"]) == 0
    mine = folder / "VerifiableQA-v0-random-20261130-000000-2.jsonl"
    assert f"episodes written to {Path('runs') / 'eval' / mine.name}" in capsys.readouterr().out
    assert [e.seed for e in read_episodes_jsonl(mine)] == [100, 101]
    assert held.read_text() == "" and sorted(p.name for p in folder.iterdir()) == sorted(
        [held.name, mine.name, mine.name + ".settings.json"])
    # A refusal after the names were claimed (the model is checked when the agent is made) leaves no claim behind.
    assert exit_code(["eval", ENV_ID, "--agent", "hf", "--model", "nowhere", "--out", "evals/"]) == 2
    assert not (tmp_path / "evals").exists()


def test_an_out_that_is_a_directory_is_answered_with_the_forms_that_write_in_it(tmp_path, capsys):
    """The refusal said 'or a new directory with several environments', and not that the directory
    itself, given with a trailing slash, takes a file named for the run."""
    folder = tmp_path / "evals"
    folder.mkdir()
    assert exit_code(["eval", ENV_ID, "--agent", "random", "--episodes", "1", "--out", str(folder)]) == 2
    err = capsys.readouterr().err
    assert f"--out {folder} is a directory; give a file name ending in .jsonl (e.g. {folder / 'eval.jsonl'}), " \
           f"or {folder}/ with a trailing slash for a file named for the run in it" in err
    assert main(["eval", ENV_ID, "--agent", "random", "--episodes", "1", "--out", f"{folder}/"]) == 0
    assert len(list(folder.glob("VerifiableQA-v0-random-*.jsonl"))) == 1


@pytest.mark.parametrize("out", ["new/deeper/e.jsonl", "new/deeper/", None])
def test_an_eval_refused_after_its_out_was_checked_leaves_no_folder_behind(out, tmp_path, monkeypatch, capsys):
    """The --out checks made the folders --out needs; a refusal after them (a --model that is no
    model, checked when the agent is made) left them there, empty."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()  # an earlier run's: kept
    assert exit_code(["eval", ENV_ID, "--agent", "hf", "--model", "nowhere", *(["--out", out] if out else [])]) == 2
    assert "--model: 'nowhere': no such directory (rftgym never downloads from a hub" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"] and not any((tmp_path / "runs").iterdir())


def test_baseline_files_keep_the_outs_whole_suffix(tmp_path):
    from rftgym.cli.evaluate import _baseline_paths

    for name, expected in (("he.jsonl", "he-no-memory.jsonl"), ("he.jsonl.gz", "he-no-memory.jsonl.gz"),
                           ("he.JSONL.GZ", "he-no-memory.JSONL.GZ")):
        paths = _baseline_paths("rftgym/MemoryQA-v0", tmp_path / name, baselines=True)
        assert paths[""] == tmp_path / name and paths["no-memory"] == tmp_path / expected
