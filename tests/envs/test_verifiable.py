"""rftgym/VerifiableQA-v0 (and every registered env): the Gymnasium contract, rewards, budgets,
seeding, options, rendering, and fuzzing with arbitrary assistant text."""

from __future__ import annotations

import json
import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import given, settings
from hypothesis import strategies as st

import rftgym  # noqa: F401  (registers the envs)
from rftgym.agents.scripted import ADVERSARIAL_TEXTS, AdversarialAgent, RandomTextAgent
from rftgym.core.errors import ConfigError, DataFormatError
from rftgym.core.messages import Context
from rftgym.envs import ENVS, env_ids
from rftgym.envs.verifiable import VerifiableQAConfig, VerifiableQAEnv
from rftgym.envs.verifiable import env as env_module
from rftgym.envs.verifiable.env import DEFAULT_SYSTEM_PROMPT
from rftgym.envs.verifiable.tasks import DIFFICULTIES, GENERATORS

ENV_ID = "rftgym/VerifiableQA-v0"
INFO_KEYS = {"task_id", "kind", "difficulty", "turn", "attempts", "answer", "correct", "format_ok",
             "format_error", "success", "reward_if_cut"}


def make(**kwargs) -> gym.Env:
    return gym.make(ENV_ID, **kwargs)


def answer_for(env) -> str:
    return env.unwrapped.task.answer


def wrong_answer_for(env) -> str:
    task = env.unwrapped.task
    if task.choices:
        return next(c for c in task.choices if c != task.answer)
    return str(int(task.answer) + 1)


@pytest.fixture
def dataset(tmp_path):
    path = tmp_path / "qa.jsonl"
    rows = [
        {"question": "What is 6 times 7?", "answer": "42", "id": "mul"},
        {"question": "Capital of France?", "choices": ["Lyon", "Paris", "Nice"], "answer": "B", "id": "cap"},
        {"question": "Largest?", "choices": ["0.5", "4/5", "4.5"], "answer": "4.5", "id": "big"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return str(path)


# ---------------------------------------------------------------- the Gymnasium contract

def run_check_env(env: gym.Env) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env.unwrapped)
    assert [str(w.message) for w in caught] == []


@pytest.mark.parametrize("env_id", env_ids())
def test_check_env_passes_for_every_registered_env(env_id, capsys):
    env = gym.make(env_id)
    run_check_env(env)
    env.close()


def test_check_env_passes_with_a_dataset(dataset, capsys):
    env = make(dataset_path=dataset, max_attempts=2)
    run_check_env(env)
    assert env.unwrapped.dataset is not None and len(env.unwrapped.dataset) == 3


def test_registry_matches_envs_table():
    assert env_ids() == list(ENVS)
    for env_id in ENVS:
        assert env_id in gym.registry and env_id.startswith("rftgym/")


def test_spaces():
    env = make(max_action_chars=100)
    assert env.action_space.max_chars == 100
    assert env.observation_space.roles == ("system", "user", "assistant")


# ---------------------------------------------------------------- rewards against the hidden task

@pytest.mark.parametrize("seed", range(12))
def test_correct_clean_answer(seed):
    env = make()
    context, info = env.reset(seed=seed)
    assert set(info) == INFO_KEYS  # no "expected" before the end
    assert info["turn"] == 0 and info["attempts"] == 0 and info["task_id"] == env.unwrapped.task.id
    action = f"Let me think.\n<answer>{answer_for(env)}</answer>"
    obs, reward, terminated, truncated, info = env.step(action)
    assert reward == 1.0 and terminated and not truncated
    assert info["success"] and info["correct"] and info["format_ok"] and info["format_error"] is None
    assert info["answer"] == answer_for(env) and info["expected"] == answer_for(env)
    assert (info["turn"], info["attempts"]) == (1, 1)
    # the assistant turn is appended verbatim and nothing else
    assert obs.ids[:-1] == context.ids
    assert obs[-1].role == "assistant" and obs[-1].content == action


def test_correct_letter_answer_to_multiple_choice():
    env = make(kinds=("weekday",))
    env.reset(seed=3)
    task = env.unwrapped.task
    _, reward, terminated, _, info = env.step(f"<think>counting</think><answer>({task.answer_letter})</answer>")
    assert reward == 1.0 and terminated and info["success"]


def test_correct_answer_with_two_answer_tags_gets_0_9():
    env = make()
    env.reset(seed=1)
    _, reward, terminated, truncated, info = env.step(f"<answer>{wrong_answer_for(env)}</answer> no wait "
                                                      f"<answer>{answer_for(env)}</answer>")
    assert reward == pytest.approx(0.9) and terminated and not truncated
    assert info["success"] and not info["format_ok"]
    assert "more than one <answer> tag" in info["format_error"]


def test_correct_answer_with_an_unclosed_think_tag_gets_0_9():
    env = make()
    env.reset(seed=2)
    _, reward, terminated, _, info = env.step(f"<think>hmm <answer>{answer_for(env)}</answer>")
    # the unclosed <think> swallows nothing: <answer> inside it is still closed
    assert terminated and info["success"]
    assert reward == pytest.approx(0.9)
    assert "<think> is never closed" in info["format_error"]


def test_wrong_but_clean_answer_gets_0_1():
    env = make()
    env.reset(seed=4)
    _, reward, terminated, truncated, info = env.step(f"<answer>{wrong_answer_for(env)}</answer>")
    assert reward == pytest.approx(0.1) and terminated and not truncated
    assert not info["success"] and not info["correct"] and info["format_ok"]
    assert info["expected"] == answer_for(env)


def test_wrong_and_sloppy_answer_gets_0():
    env = make()
    env.reset(seed=4)
    _, reward, terminated, _, info = env.step(f"<answer>{wrong_answer_for(env)}</answer></answer>")
    assert reward == 0.0 and terminated and not info["format_ok"]


def test_a_think_opened_by_the_template_closes_in_the_reply():
    # A reasoning model's generation prompt ends in <think>; its reply closes it, then answers.
    env = make()
    env.reset(seed=4)
    _, reward, terminated, _, info = env.step(f"Let me work it out.\n</think>\n<answer>{answer_for(env)}</answer>")
    assert reward == 1.0 and terminated and info["format_ok"]
    # a tentative answer in that thinking is reasoning, not the reply's answer
    env.reset(seed=4)
    _, reward, terminated, _, info = env.step(f"<answer>{wrong_answer_for(env)}</answer></think> On reflection...")
    assert not terminated and info["answer"] is None
    # a stray </think> that ends a reply (a model that never thinks) leaves its answer graded
    env.reset(seed=4)
    _, reward, terminated, _, info = env.step(f"<answer>{answer_for(env)}</answer></think>")
    assert terminated and info["correct"] and reward == pytest.approx(0.9) and not info["format_ok"]


def test_format_weight_scales_the_rewards():
    rewards = []
    for action in ("{a}", "{a}<answer>{a}</answer>", "{w}"):
        env = make(format_weight=0.3)
        env.reset(seed=5)
        text = "<answer>" + action.format(a=answer_for(env), w=wrong_answer_for(env)) + "</answer>"
        rewards.append(env.step(text)[1])
    assert rewards == pytest.approx([1.0, 0.7, 0.3])


@pytest.mark.parametrize("empty", ["<answer></answer>", "<answer>  \n </answer>", "<answer>4</answer><answer></answer>"])
def test_an_empty_answer_is_no_answer(empty):
    # It used to be graded (wrong) and paid the format reward: 0.1 for answering nothing.
    env = make(max_turns=2)
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(empty)
    assert reward == 0.0 and not terminated and not truncated
    said = "the <answer> tag is empty" if empty.count("<answer>") == 1 else \
        "the last of several <answer> tags (the one that counts) is empty, so none was graded"
    assert info["format_error"].startswith(said) and info["answer"] is None
    assert "the last one was graded" not in info["format_error"]  # nothing was
    assert info["attempts"] == 0 and not info["format_ok"]
    assert obs[-1].content.startswith(f"Your reply was not understood: {said}")
    _, reward, terminated, truncated, info = env.step(empty)
    assert reward == 0.0 and truncated and not terminated


def test_no_tag_gets_a_format_reminder_then_truncation():
    env = make(max_turns=3)
    context, _ = env.reset(seed=0)
    for turn in (1, 2):
        obs, reward, terminated, truncated, info = env.step("I believe it is 42.")
        assert reward == 0.0 and not terminated and not truncated
        assert info["format_error"] == "no <answer>…</answer> tag"
        assert info["answer"] is None and not info["format_ok"] and info["attempts"] == 0
        assert info["turn"] == turn and "expected" not in info
        assert [m.role for m in obs][-2:] == ["assistant", "user"]
        assert obs[-1].content.startswith("Your reply was not understood: no <answer>…</answer> tag.")
        assert "<answer></answer>" in obs[-1].content
        assert context.is_prefix_of(obs)
        context = obs
    obs, reward, terminated, truncated, info = env.step("still no tag")
    assert reward == 0.0 and not terminated and truncated
    assert info["expected"] == answer_for(env) and info["turn"] == 3
    assert obs[-1].role == "assistant" and obs[-1].content == "still no tag"  # no reminder after the end
    with pytest.raises(RuntimeError, match="episode has ended"):
        env.unwrapped.step("<answer>1</answer>")


def test_the_format_reminder_names_the_parse_problems():
    env = make()
    env.reset(seed=0)
    _, _, terminated, _, info = env.step("<answer>42")
    assert not terminated
    assert info["format_error"] == "no <answer>…</answer> tag (<answer> is never closed; end it with </answer>)"
    # An answer inside a code block is code: the reminder says where it sat.
    _, _, terminated, _, info = env.step("```\n<answer>42</answer>\n```")
    assert not terminated and info["format_error"] == (
        "no <answer>…</answer> tag (an <answer> inside a ``` code block is code, not the answer; write it outside "
        "the block)")


def test_max_attempts_retry_flow():
    env = make(max_attempts=2, max_turns=4)
    env.reset(seed=6)
    obs, reward, terminated, truncated, info = env.step(f"<answer>{wrong_answer_for(env)}</answer>")
    assert reward == 0.0 and not terminated and not truncated
    assert info["attempts"] == 1 and not info["correct"] and info["format_ok"]
    assert obs[-1].role == "user"
    assert obs[-1].content == "That answer is not correct. Try again (1 attempt left)."
    obs, reward, terminated, truncated, info = env.step(f"<answer>{answer_for(env)}</answer>")
    assert reward == 1.0 and terminated and info["attempts"] == 2 and info["success"]


def test_max_attempts_used_up_ends_with_the_format_reward():
    env = make(max_attempts=3, max_turns=5)
    env.reset(seed=7)
    wrong = f"<answer>{wrong_answer_for(env)}</answer>"
    _, _, _, _, _ = env.step(wrong)
    obs, _, terminated, _, _ = env.step("no tag this time")  # does not use an attempt
    assert not terminated and "not understood" in obs[-1].content
    obs, _, terminated, _, info = env.step(wrong)
    assert not terminated and obs[-1].content.endswith("(1 attempt left).") and info["attempts"] == 2
    _, reward, terminated, truncated, info = env.step(wrong)
    assert terminated and not truncated and reward == pytest.approx(0.1) and info["attempts"] == 3


def test_plural_attempts_left():
    env = make(max_attempts=3)
    env.reset(seed=7)
    obs, *_ = env.step(f"<answer>{wrong_answer_for(env)}</answer>")
    assert obs[-1].content.endswith("(2 attempts left).")


def test_truncation_on_a_graded_answer_pays_the_documented_reward():
    # The turn budget, not the attempts, ends the episode: the answer is still graded and paid.
    env = make(max_attempts=2, max_turns=2)
    env.reset(seed=8)
    env.step("nothing")
    _, reward, terminated, truncated, info = env.step(f"<answer>{wrong_answer_for(env)}</answer>")
    assert truncated and not terminated and reward == pytest.approx(0.1) and "expected" in info
    env.reset(seed=8)
    env.step("nothing")
    _, reward, _, truncated, _ = env.step(f"<answer>{wrong_answer_for(env)}</answer></think>")
    assert truncated and reward == 0.0


# ---------------------------------------------------------------- seeding and message ids

def test_same_seed_same_context_and_ids():
    a, b = make(), make()
    ctx_a, info_a = a.reset(seed=42)
    ctx_b, info_b = b.reset(seed=42)
    assert ctx_a == ctx_b and info_a == info_b
    assert a.unwrapped.task == b.unwrapped.task
    assert a.step("hmm")[0] == b.step("hmm")[0]  # the feedback message's id too


def test_different_seeds_give_different_ids():
    tags = set()
    for seed in range(20):
        ctx, _ = make().reset(seed=seed)
        tags.add(ctx[0].id.split("-")[0])
    assert len(tags) == 20


def test_unseeded_resets_continue_the_rng():
    env = make()
    first, _ = env.reset(seed=0)
    second, _ = env.reset()
    assert set(first.ids).isdisjoint(second.ids)
    again, _ = env.reset(seed=0)
    assert again == first


def test_message_ids_are_unique_within_an_episode_and_stable():
    env = make(max_turns=6, max_attempts=3)
    context, _ = env.reset(seed=9)
    seen = {m.id: m for m in context}
    for action in ["a", "<answer>zz</answer>", "b", "<answer>yy</answer>", "c", "d"]:
        context, _, terminated, truncated, _ = env.step(action)
        for m in context:
            assert seen.setdefault(m.id, m) == m  # an id always names the same message
        if terminated or truncated:
            break
    assert len(context.ids) == len(set(context.ids)) == len(seen)
    tag = context[0].id.split("-")[0]
    assert list(context.ids) == [f"{tag}-{i}" for i in range(len(context))]


# ---------------------------------------------------------------- options and config

@pytest.mark.parametrize("kind", sorted(GENERATORS))
@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_kind_and_difficulty_options(kind, difficulty):
    env = make()
    _, info = env.reset(seed=0, options={"kind": kind, "difficulty": difficulty})
    assert (info["kind"], info["difficulty"]) == (kind, difficulty)
    assert env.unwrapped.task.kind == kind
    _, reward, terminated, _, _ = env.step(f"<answer>{answer_for(env)}</answer>")
    assert reward == 1.0 and terminated


def test_config_kinds_and_difficulties_restrict_the_draw():
    env = make(kinds=("sequence", "weekday"), difficulties=(4,))
    drawn = {(env.reset(seed=s)[1]["kind"], env.unwrapped.task.difficulty) for s in range(40)}
    assert drawn == {("sequence", 4), ("weekday", 4)}


def test_single_kind_and_difficulty_are_accepted():
    config = VerifiableQAConfig(kinds="arithmetic", difficulties=3)
    assert config.kinds == ("arithmetic",) and config.difficulties == (3,)


@pytest.mark.parametrize("options, message", [
    ({"kind": "poetry"}, "unknown task kind 'poetry'"),
    ({"kind": ["weekday"]}, r"kind must be one task kind, .* got \['weekday'\]; to draw from several, make the env "
                            r"with kinds=\[...\]"),
    ({"difficulty": 0}, "difficulty must be one of"),
    ({"difficulty": 9}, "difficulty must be one of"),
    ({"difficulty": "3"}, "difficulty must be one of"),
])
def test_bad_options_raise(options, message):
    with pytest.raises(ValueError, match=message):
        make().reset(seed=0, options=options)


def test_options_that_do_not_apply_or_do_not_exist_are_refused(dataset):
    # Silently ignored before: a generator's kind/difficulty with a dataset, task_index without one, typos.
    with pytest.raises(ValueError, match=r"\['difficulty', 'kind'\] do not apply here: this env serves a dataset, "
                                         r"so it reads \['task_index'\]"):
        make(dataset_path=dataset).reset(seed=0, options={"kind": "arithmetic", "difficulty": 2})
    with pytest.raises(ValueError, match=r"\['task_index'\] do not apply here: this env generates its tasks"):
        make().reset(seed=0, options={"task_index": 0})
    with pytest.raises(ValueError, match=r"unknown reset option\(s\) \['difficuly'\]; this env reads "
                                         r"\['difficulty', 'kind'\]$"):
        make().reset(seed=0, options={"difficuly": 3})
    with pytest.raises(ValueError, match=r"\['difficuly'\]; this env reads \['task_index'\]$"):  # what it reads now
        make(dataset_path=dataset).reset(seed=0, options={"difficuly": 3})
    # None means "draw it", as before
    assert make(dataset_path=dataset).reset(seed=0, options={"kind": None, "difficulty": None})[1]["task_id"]


def test_task_index_option_with_a_dataset(dataset):
    env = make(dataset_path=dataset)
    for index, task_id in enumerate(["mul", "cap", "big"]):
        _, info = env.reset(seed=0, options={"task_index": index})
        assert info["task_id"] == task_id
    _, info = env.reset(seed=0, options={"task_index": np.int64(1)})
    assert info["task_id"] == "cap"
    # seeds 0..N-1 cover the dataset once (rftgym eval's default episodes), then it repeats
    assert [env.reset(seed=s)[1]["task_id"] for s in range(5)] == ["mul", "cap", "big", "mul", "cap"]
    assert env.unwrapped.eval_episodes == 3 and make().unwrapped.eval_episodes is None
    drawn = make(dataset_path=dataset, task_selection="random")
    assert drawn.unwrapped.eval_episodes is None
    assert {drawn.reset(seed=s)[1]["task_id"] for s in range(30)} == {"mul", "cap", "big"}
    with pytest.raises(ConfigError, match="task_selection must be 'seed' .* or 'random'"):
        make(dataset_path=dataset, task_selection="shuffle")
    for bad in (3, -1, "0", 1.0, True):
        with pytest.raises(ValueError, match=r"task_index must be an int in \[0, 3\)"):
            env.reset(seed=0, options={"task_index": bad})


def test_dataset_tasks_are_graded(dataset):
    env = make(dataset_path=dataset)
    ctx, _ = env.reset(seed=0, options={"task_index": 1})
    assert ctx[-1].content == "Capital of France?\n\n(A) Lyon\n(B) Paris\n(C) Nice"
    assert env.step("<answer>B</answer>")[1] == 1.0
    env.reset(seed=0, options={"task_index": 2})
    assert env.step("<answer>4/5</answer>")[1] == pytest.approx(0.1)
    env.reset(seed=0, options={"task_index": 0})
    assert env.step("<answer>x = 42</answer>")[1] == 1.0


def test_a_bad_dataset_fails_at_construction(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "q"}\n', encoding="utf-8")
    with pytest.raises(DataFormatError, match=f"{path}:1: 'answer'"):
        make(dataset_path=str(path))


@pytest.mark.parametrize("kwargs, message", [
    ({"kinds": ()}, "kinds must be a non-empty subset"),
    ({"kinds": ("arithmetic", "poetry")}, "kinds must be a non-empty subset"),
    ({"difficulties": ()}, "difficulties must be a non-empty subset"),
    ({"difficulties": (0,)}, "difficulties must be a non-empty subset"),
    ({"difficulties": ["x"]}, "difficulties a list of ints"),
    ({"kinds": 5}, "kinds must be a list of kind names"),
    ({"max_attempts": 0}, "max_attempts must be at least 1"),
    ({"max_turns": 0}, r"max_turns must be at least max_attempts \(1\): each attempt is a turn; got 0"),
    ({"max_attempts": 3, "max_turns": 2}, r"at least max_attempts \(3\)"),
    ({"max_turns": 2.5}, "max_turns must be an int"),
    ({"format_weight": 1.0}, r"format_weight must be in \[0, 1\)"),
    ({"format_weight": -0.1}, r"format_weight must be in \[0, 1\)"),
    ({"format_weight": float("nan")}, r"format_weight must be in \[0, 1\)"),
    ({"format_weight": "0.1"}, r"format_weight must be"),
    ({"max_action_chars": 0}, "max_action_chars must be at least 1"),
    ({"system_prompt": 3}, "system_prompt must be a string or None"),
    ({"dataset_path": 3}, "dataset_path must be a path"),
    ({"dataset_path": ""}, "dataset_path is empty; give the path of a file, or leave dataset_path out"),
    ({"difficulties": [1.5]}, "difficulties a list of ints"),  # not quietly 1
    ({"difficulties": True}, "difficulties a list of ints"),
    ({"dataset_path": "t.jsonl", "kinds": "arithmetic"}, "kinds shapes generated tasks only, and dataset_path is given"),
    ({"dataset_path": "t.jsonl", "difficulties": 3, "kinds": "weekday"},
     "kinds, difficulties shape generated tasks only, and dataset_path is given: drop kinds and difficulties"),
])
def test_bad_config_raises_config_error(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        VerifiableQAConfig(**kwargs)
    with pytest.raises(ConfigError, match=message):
        make(**kwargs)


def test_unknown_config_key_is_a_type_error():
    with pytest.raises(TypeError, match="max_turn"):
        make(max_turn=3)


def test_config_object_or_keywords_not_both():
    env = VerifiableQAEnv(config=VerifiableQAConfig(max_turns=5))
    assert env.config.max_turns == 5
    with pytest.raises(ConfigError, match=r"either config=.* not both \(got config= and max_turns\)"):
        VerifiableQAEnv(config=VerifiableQAConfig(), max_turns=5)
    assert VerifiableQAEnv(config={"max_turns": 5}).config == VerifiableQAConfig(max_turns=5)
    with pytest.raises(ConfigError, match="config must be a VerifiableQAConfig or a dict of its fields, got int"):
        VerifiableQAEnv(config=5)


def test_tags_is_not_a_constructor_field():
    with pytest.raises(TypeError):
        VerifiableQAConfig(tags=("answer",))


def test_system_prompt():
    ctx, _ = make().reset(seed=0)
    assert ctx[0].role == "system" and ctx[0].content == DEFAULT_SYSTEM_PROMPT
    ctx, _ = make(system_prompt=None).reset(seed=0)
    assert [m.role for m in ctx] == ["user"]
    ctx, _ = make(system_prompt="Be brief.").reset(seed=0)
    assert ctx[0].content == "Be brief." and len(ctx) == 2


# ---------------------------------------------------------------- actions at the limits

def test_oversized_actions_are_cut_to_max_action_chars():
    env = make(max_action_chars=50)
    env.reset(seed=0)
    obs, *_ = env.step("x" * 80 + "<answer>1</answer>")
    assert obs[-2].content == "x" * 50
    assert env.observation_space.contains(obs)


def test_thousands_of_tag_problems_make_a_short_reminder():
    env = make()
    env.reset(seed=0)
    obs, _, _, _, info = env.step("<think>" * 4500)
    assert env.observation_space.contains(obs)
    assert info["format_error"] == ("no <answer>…</answer> tag (<think> is never closed; end it with </think>)")
    obs, _, _, _, info = env.step("</answer></think><think/>" * 50 + "<think><answer>")
    assert info["format_error"].startswith("no <answer>…</answer> tag (</answer> closes a tag that was never opened; ")
    assert info["format_error"].endswith("; and 2 more)")  # 5 distinct problems, however many times
    assert len(obs[-1].content) < 400


@pytest.mark.timeout(60)
@pytest.mark.parametrize("body", [
    "1," * 15_000, "9" * 31_000, "(" + " " * 31_000 + "BB", "B" + " " * 31_000 + "x", "a " * 15_000,
    "1/" * 15_000, "-." * 15_000, "the " * 7_000,
])
def test_pathological_answers_are_graded(body):
    for kind in ("arithmetic", "weekday", "comparison"):
        env = VerifiableQAEnv()
        env.reset(seed=0, options={"kind": kind, "difficulty": 3})
        _, reward, terminated, _, info = env.step(f"<answer {'x' * 500}>{body}</answer>")
        assert terminated and not info["correct"] and reward == pytest.approx(0.1)


def test_long_episodes_stay_inside_the_observation_space():
    env = make(max_turns=300)
    env.reset(seed=0)
    for _ in range(300):
        obs, _, terminated, truncated, _ = env.step("no answer")
    assert truncated and not terminated
    assert len(obs) == 2 + 2 * 300 - 1
    assert env.observation_space.contains(obs)


def test_step_before_reset_and_bad_action_types():
    env = VerifiableQAEnv()
    with pytest.raises(RuntimeError, match="call reset"):
        env.step("<answer>1</answer>")
    env.reset(seed=0)
    with pytest.raises(TypeError, match="assistant's text"):
        env.step(42)  # type: ignore[arg-type]


# ---------------------------------------------------------------- render and close

def test_render_modes(capsys):
    env = make(render_mode="ansi")
    ctx, _ = env.reset(seed=0)
    text = env.render()
    assert text == "\n".join(f"[{m.role}] {m.content}" for m in ctx)
    assert capsys.readouterr().out == ""

    human = make(render_mode="human")
    human.reset(seed=0)
    assert capsys.readouterr().out == text + "\n"  # the question is shown at reset
    human.step("hello there")
    out = capsys.readouterr().out
    assert "[assistant] hello there" in out and "[user] Your reply was not understood" in out
    assert human.render() is None
    assert capsys.readouterr().out == out

    plain = make()
    plain.reset(seed=0)
    assert plain.render() is None
    assert capsys.readouterr().out == ""


def test_bad_render_mode():
    with pytest.raises(ConfigError, match="render_mode must be one of"):
        VerifiableQAEnv(render_mode="rgb_array")


def test_close_twice_and_reset_after_close():
    env = make()
    env.reset(seed=0)
    env.close()
    env.close()
    # as in every rftgym env (see test_gymnasium_conformance): a closed env is not used again
    with pytest.raises(RuntimeError, match=r"reset\(\) after close\(\): this env was closed; make a new one"):
        env.reset(seed=0)


# ---------------------------------------------------------------- fuzzing

def documented_info_keys() -> set[str]:
    section = env_module.__doc__.split("Info keys", 1)[1].split("Options to", 1)[0]
    return {key for key in INFO_KEYS | {"expected"} if f"``{key}``" in section}


def test_info_keys_match_the_docstring():
    assert documented_info_keys() == INFO_KEYS | {"expected"}


def check_step(env, action: str) -> tuple[Context, bool]:
    obs, reward, terminated, truncated, info = env.step(action)
    assert isinstance(obs, Context)
    assert env.observation_space.contains(obs)
    assert isinstance(reward, float) and 0.0 <= reward <= 1.0
    assert isinstance(terminated, bool) and isinstance(truncated, bool)
    done = terminated or truncated
    assert set(info) == INFO_KEYS | ({"expected"} if done else set())
    assert info["format_ok"] == (info["format_error"] is None)
    assert info["success"] == info["correct"]
    assert info["answer"] is None or isinstance(info["answer"], str)
    if not done:
        assert reward == 0.0 and obs[-1].role == "user"
    if info["correct"]:
        assert terminated
    return obs, done


FRAGMENTS = ["<answer>", "</answer>", "</ANSWER >", "< Answer>", "<answer/>", "<think>", "</think>",
             "```python\n", "```", "\n", '<prune ids="a">', "42", "(B)", "B", "-3.5", "1,234", "\ud800", " "]
actions = st.one_of(
    st.text(max_size=300),
    st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=6)), max_size=30).map("".join),
    st.sampled_from(ADVERSARIAL_TEXTS),
)


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**16), turns=st.lists(actions, min_size=1, max_size=4),
       max_attempts=st.integers(1, 2))
def test_env_never_raises_on_arbitrary_text(seed, turns, max_attempts):
    env = VerifiableQAEnv(max_attempts=max_attempts)
    obs, info = env.reset(seed=seed)
    assert env.observation_space.contains(obs) and set(info) == INFO_KEYS
    for action in turns:
        obs, done = check_step(env, action)
        if done:
            break


@pytest.mark.parametrize("agent_cls", [RandomTextAgent, AdversarialAgent])
def test_env_never_raises_on_scripted_agent_texts(agent_cls):
    agent = agent_cls(seed=0)
    env = VerifiableQAEnv(max_attempts=2, max_turns=4)
    steps = 0
    for seed in range(40):
        context, _ = env.reset(seed=seed)
        done = False
        while not done:
            context, done = check_step(env, agent.act_one(context).text)
            steps += 1
    assert steps >= 40


def test_every_adversarial_text_alone():
    env = VerifiableQAEnv()
    for text in ADVERSARIAL_TEXTS:
        env.reset(seed=0)
        check_step(env, text)


def test_adversarial_answers_are_graded_sensibly():
    env = VerifiableQAEnv()
    env.reset(seed=0, options={"kind": "arithmetic", "difficulty": 1})
    for text in ("<answer>1e309</answer>", "<answer>NaN</answer>", "<answer>99999999999999999999999999999999/0</answer>",
                 "```python\n<answer>3</answer>\n```", "<answer>" + "9" * 5000 + "</answer>"):
        env.reset(seed=0, options={"kind": "arithmetic", "difficulty": 1})
        _, reward, _, _, info = env.step(text)
        assert not info["correct"] and reward <= 0.1


def test_one_turn_is_a_single_reply_episode():
    """max_turns=1: standard one-reply RLVR; a reply without an answer ends the episode, cut."""
    import gymnasium as gym

    env = gym.make("rftgym/VerifiableQA-v0", max_turns=1)
    env.reset(seed=0)
    _, _, terminated, truncated, info = env.step("no tags at all")
    assert truncated and not terminated and "answer" in info["format_error"]
    env.reset(seed=0)
    _, reward, terminated, truncated, _ = env.step(f"<answer>{env.unwrapped.task.answer}</answer>")
    assert terminated and not truncated and reward > 0.9


@pytest.mark.parametrize("kwargs, message", [
    ({"format_weight": "0.1"}, r"format_weight must be a number, got the text '0.1'; give the value itself, not text "
                               r"\(e.g. format_weight=0.1\)"),
    ({"max_turns": "two"}, r"max_turns must be a number, got the text 'two'; give the value itself, not text$"),
])
def test_text_for_a_number_is_refused_as_text(kwargs, message):
    """A quoted YAML value or a string built in Python read as out of range ("must be in [0, 1),
    got '0.1'"), where what is wrong is its type."""
    with pytest.raises(ConfigError, match=message):
        make(**kwargs)
    with pytest.raises(ConfigError, match=message):
        make(config=kwargs)  # a spec's config dict, as gymnasium writes it
