"""What Gymnasium's own machinery does to every rftgym env: pickling (async vector envs), JSON
(spaces and specs), TimeLimit, a failed reset, and copy.copy."""

from __future__ import annotations

import copy
import hashlib
import json
import pickle
import random

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.envs.registration import EnvSpec

import rftgym  # noqa: F401  (registers the envs)
from rftgym.core.errors import ConfigError
from rftgym.envs.code.env import CodeTCGConfig, CodeTCGEnv
from rftgym.envs.code.generator import DIFFICULTIES, TEMPLATES, generate_task
from rftgym.envs.code.tcg import TCGConfig
from rftgym.envs.memory.env import MemoryQAConfig
from rftgym.envs.search.env import SearchEvalQAConfig
from rftgym.envs.verifiable.env import VerifiableQAConfig, VerifiableQAEnv

VERIFIABLE, CODE = "rftgym/VerifiableQA-v0", "rftgym/CodeTCG-v0"
SEARCH, MEMORY = "rftgym/SearchEvalQA-v0", "rftgym/MemoryQA-v0"
PROGRAM = "```python\ndef solve(*args):\n    return 0\n```"  # graded: no entry point of the task's, but clean
NO_CODE = "I am still thinking."


def small_tcg(tmp_path) -> TCGConfig:
    return TCGConfig(cache_dir=str(tmp_path), n_random=2, n_edge=0)


def make(env_id: str, tmp_path, **kwargs) -> gym.Env:
    if env_id == CODE:
        kwargs = {"dataset": "generated", "tcg": small_tcg(tmp_path), **kwargs}
    return gym.make(env_id, **kwargs)


def transcript(context) -> list[tuple[str, str, str]]:
    return [(m.id, m.role, m.content) for m in context]


def stepped(env, action):
    context, reward, terminated, truncated, _ = env.step(action)
    return transcript(context), reward, terminated, truncated


def wrong_answer_for(env) -> str:
    task = env.unwrapped.task
    if task.choices:
        return next(c for c in task.choices if c != task.answer)
    return str(int(task.answer) + 1)


# ---------------------------------------------------------------- pickling generated code tasks

@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_every_generated_task_pickles_and_its_copy_samples_the_same_inputs(difficulty):
    rng = np.random.default_rng(difficulty)
    for kind in sorted(TEMPLATES):
        task = generate_task(rng, kind, difficulty)
        clone = pickle.loads(pickle.dumps(task))
        assert clone == task
        ours, theirs = random.Random(5), random.Random(5)
        assert [clone.input_sampler(theirs) for _ in range(20)] == [task.input_sampler(ours) for _ in range(20)]


def test_generated_tasks_and_their_test_inputs_stay_as_they_were():
    """A cached TCG suite is keyed by its task's prompt, reference and examples, not by every input
    the sampler draws for it: a change to what a seed generates must bump tcg.CACHE_VERSION (and
    this digest), or cached suites go stale without a word."""
    digest = hashlib.sha256()
    for difficulty in DIFFICULTIES:
        rng = np.random.default_rng(difficulty)
        for kind in sorted(TEMPLATES) * 2:
            task = generate_task(rng, kind, difficulty)
            draws = random.Random(difficulty)
            digest.update(json.dumps([task.task_id, task.prompt, task.reference,
                                      [(t.input, t.expected) for t in task.examples],
                                      [task.input_sampler(draws) for _ in range(10)]]).encode())
    assert digest.hexdigest() == "63b10123ba49f4904ecb10550a7858bc5718adc6375b72b2544461a9b448ff46"


def test_a_generated_code_env_pickles_mid_episode(tmp_path):
    env = make(CODE, tmp_path, max_attempts=3)
    try:
        env.reset(seed=0)
        clone = pickle.loads(pickle.dumps(env.unwrapped))
        try:
            assert clone.task == env.unwrapped.task
            assert stepped(clone, PROGRAM) == stepped(env, PROGRAM)
        finally:
            clone.close()
    finally:
        env.close()


def test_an_async_vector_env_hands_back_its_generated_tasks(tmp_path):
    envs = gym.make_vec(CODE, num_envs=1, vectorization_mode="async", vector_kwargs={"shared_memory": False},
                        dataset="generated", tcg=small_tcg(tmp_path))
    try:
        envs.reset(seed=0)
        (task,) = envs.get_attr("task")
        assert task.task_id.startswith("gen-") and task.input_sampler(random.Random(0))
    finally:
        envs.close()


# ---------------------------------------------------------------- observations as JSON

FIRST_ACTIONS = {VERIFIABLE: "no answer yet", CODE: NO_CODE, SEARCH: "<search>capital city</search>",
                 MEMORY: "<search>birthplace</search>"}


@pytest.mark.parametrize("env_id", list(FIRST_ACTIONS))
def test_an_envs_observations_and_actions_round_trip_through_json(env_id, tmp_path):
    env = make(env_id, tmp_path)
    try:
        first, _ = env.reset(seed=1)
        action = FIRST_ACTIONS[env_id]
        second, *_ = env.step(action)
        space = env.observation_space
        assert space.from_jsonable(json.loads(json.dumps(space.to_jsonable([first, second])))) == [first, second]
        actions = env.action_space
        assert actions.from_jsonable(json.loads(json.dumps(actions.to_jsonable([action])))) == [action]
    finally:
        env.close()


# ---------------------------------------------------------------- TimeLimit and deferred rewards

def test_a_time_limit_cut_of_a_verifiable_answer_is_owed_in_its_info():
    env = gym.make(VERIFIABLE, max_attempts=2, max_turns=3, max_episode_steps=1)
    env.reset(seed=8)
    # The env's own budget ending here would pay the clean wrong answer its format reward (0.1).
    _, reward, terminated, truncated, info = env.step(f"<answer>{wrong_answer_for(env)}</answer>")
    assert truncated and not terminated and reward == 0.0 and info["reward_if_cut"] == pytest.approx(0.1)


def test_a_time_limit_cut_of_a_graded_submission_is_owed_in_its_info(tmp_path):
    env = make(CODE, tmp_path, max_attempts=2, max_episode_steps=2)
    try:
        _, info = env.reset(seed=0)
        assert info["reward_if_cut"] == 0.0  # nothing graded yet
        _, reward, _, truncated, info = env.step(PROGRAM)
        assert not truncated and reward == 0.0 and info["reward_if_cut"] == pytest.approx(0.1)  # format only
        _, reward, terminated, truncated, info = env.step(NO_CODE)  # the TimeLimit cuts: the env pays nothing
        assert truncated and not terminated and reward == 0.0 and info["reward_if_cut"] == pytest.approx(0.1)
    finally:
        env.close()


@pytest.mark.parametrize("cut", ["own budget", "rollout cap", "time limit", "full context"])
def test_a_cut_code_episode_is_paid_and_reported_as_its_own_budget_would(tmp_path, cut):
    from rftgym.agents.base import CONTEXT_FULL, Agent, AgentReply
    from rftgym.agents.scripted import ScriptedAgent
    from rftgym.rollout import RolloutConfig, run_episodes
    from rftgym.rollout.metrics import env_metrics

    probe = make(CODE, tmp_path)
    try:
        probe.reset(seed=1)  # a function task; the program below gets every other test right
        task = probe.unwrapped.task
    finally:
        probe.close()
    half_right = (f"```python\n{task.reference}\n_right, _calls = {task.entry_point}, [0]\n"
                  f"def {task.entry_point}(*args):\n    _calls[0] += 1\n"
                  "    return _right(*args) if _calls[0] % 2 else None\n```")

    class ProgramThenFull(Agent):
        def act(self, contexts):
            return [AgentReply(text="", finish_reason=CONTEXT_FULL) if any(m.role == "assistant" for m in c)
                    else AgentReply(text=half_right) for c in contexts]

    kwargs, agent, config = {"max_attempts": 2, "max_turns": 3}, ScriptedAgent([half_right, NO_CODE]), None
    if cut == "own budget":
        kwargs["max_turns"] = 2
    elif cut == "rollout cap":
        config = RolloutConfig(max_turns=2)
    elif cut == "time limit":
        kwargs["max_episode_steps"] = 2
    else:
        agent = ProgramThenFull()
    episode = run_episodes(lambda: make(CODE, tmp_path, **kwargs), agent, seeds=[1], config=config)[0]
    graded = episode.turns[0].info
    assert graded["status"] == "ok" and 0 < graded["pass_rate"] < 1 and graded["info_if_cut"]["status"] == "ok"
    last = episode.turns[-1]
    assert episode.truncated and last.reward == pytest.approx(0.9 * graded["pass_rate"] + 0.1)
    assert (last.info["status"], last.info["pass_rate"], last.info["format_ok"]) == ("ok", graded["pass_rate"], True)
    columns = env_metrics([episode], CodeTCGEnv.metadata["eval_metrics"])  # as rftgym eval prints them
    assert columns["test_pass_rate"] == graded["pass_rate"] and columns["syntax_err"] == 0.0


def test_an_episode_ended_by_the_envs_own_budget_owes_nothing_more(tmp_path):
    code = make(CODE, tmp_path, max_attempts=2, max_turns=2)
    try:
        code.reset(seed=0)
        code.step(PROGRAM)
        _, reward, _, truncated, info = code.step(NO_CODE)  # the env's own budget: the graded reward is paid
        assert truncated and reward == pytest.approx(0.1) and info["reward_if_cut"] == 0.0
    finally:
        code.close()
    verifiable = gym.make(VERIFIABLE, max_attempts=2)
    verifiable.reset(seed=0)
    _, _, _, _, info = verifiable.step(f"<answer>{wrong_answer_for(verifiable)}</answer>")
    assert info["reward_if_cut"] == pytest.approx(0.1)
    _, _, _, _, info = verifiable.step("no answer this time")  # the budget ending now would pay nothing
    assert info["reward_if_cut"] == 0.0


# ---------------------------------------------------------------- configs through a JSON spec

ROUND_TRIPS = [
    (VERIFIABLE, VerifiableQAConfig, {"max_attempts": 2, "kinds": ("arithmetic", "weekday"), "difficulties": (1, 3)}),
    (CODE, CodeTCGConfig, {"dataset": "generated", "difficulties": (2,), "max_attempts": 2,
                           "tcg": TCGConfig(n_random=3, sources=("example", "random"))}),
    (SEARCH, SearchEvalQAConfig, {"hops": (1, 2), "world_size": 10, "top_k": 2}),
    (MEMORY, MemoryQAConfig, {"objectives": (2,), "hops": (2,), "world_size": 20}),
]


@pytest.mark.parametrize("given", ["config", "keywords"])
@pytest.mark.parametrize("env_id, config_class, fields", ROUND_TRIPS, ids=[r[0] for r in ROUND_TRIPS])
def test_an_env_made_again_from_its_json_spec_has_the_same_config(env_id, config_class, fields, given):
    env = gym.make(env_id, **({"config": config_class(**fields)} if given == "config" else fields))
    again = gym.make(EnvSpec.from_json(env.spec.to_json()))
    try:
        assert again.unwrapped.config == env.unwrapped.config == config_class(**fields)
    finally:
        again.close()
        env.close()


def test_a_pathlib_option_is_kept_in_the_spec_as_text(tmp_path):
    # gymnasium's to_json writes only JSON values: a Path given for a file option is kept as its text,
    # by every env (gym.make sets the spec after making the env).
    import dataclasses

    from rftgym.envs.memory.env import MemoryQAEnv
    from rftgym.envs.search.env import SearchEvalQAEnv

    for env_class in (VerifiableQAEnv, CodeTCGEnv, SearchEvalQAEnv, MemoryQAEnv):
        env = object.__new__(env_class)
        spec = dataclasses.replace(gym.spec(VERIFIABLE), kwargs={"dataset_path": tmp_path / "d.jsonl", "top_k": 2})
        env.spec = spec
        assert env.spec.kwargs == {"dataset_path": str(tmp_path / "d.jsonl"), "top_k": 2}, env_class
        assert spec.kwargs["dataset_path"] == tmp_path / "d.jsonl"  # the given spec is left as it was


def test_a_verifiable_dataset_given_as_a_path_makes_a_json_spec(tmp_path):
    data = tmp_path / "questions.jsonl"
    data.write_text('{"question": "1 + 1?", "answer": "2"}\n')
    env = gym.make(VERIFIABLE, dataset_path=data)
    again = gym.make(EnvSpec.from_json(env.spec.to_json()))
    try:
        assert again.unwrapped.config == env.unwrapped.config and env.spec.kwargs == {"dataset_path": str(data)}
    finally:
        again.close()
        env.close()


def test_a_config_dict_takes_lists_for_tuples():
    env = VerifiableQAEnv(config={"kinds": ["arithmetic"], "difficulties": [1, 3], "max_turns": 4})
    assert env.config == VerifiableQAConfig(kinds=("arithmetic",), difficulties=(1, 3), max_turns=4)


def test_a_config_dict_names_its_unknown_fields_and_the_valid_ones():
    with pytest.raises(ConfigError, match=r"unknown field\(s\) \['max_turn'\]; VerifiableQAConfig's fields are "
                                          r"\[.*'max_turns'.*\]"):
        VerifiableQAEnv(config={"max_turn": 3})
    with pytest.raises(ConfigError, match=r"unknown field\(s\) \['n_randoms'\]; TCGConfig's fields are"):
        CodeTCGConfig(dataset="generated", tcg={"n_randoms": 3})


def test_a_config_dict_may_repeat_a_field_the_config_sets_itself_only_as_it_is():
    assert VerifiableQAEnv(config={"tags": ["answer", "think"]}).config == VerifiableQAConfig()
    with pytest.raises(ConfigError, match="config field tags is set by VerifiableQAConfig itself"):
        VerifiableQAEnv(config={"tags": ["answer"]})


def test_config_is_a_config_object_or_a_dict():
    with pytest.raises(ConfigError, match="config must be a VerifiableQAConfig or a dict of its fields, got int"):
        VerifiableQAEnv(config=5)
    assert CodeTCGConfig(dataset="generated", tcg={"n_random": 3}).tcg == TCGConfig(n_random=3)


# ---------------------------------------------------------------- a reset that fails

BAD_OPTIONS = {VERIFIABLE: {"task_index": 0}, CODE: {"task_index": 0}, SEARCH: {"hops": 99},
               MEMORY: {"bogus": 1}}
DRAWS = {VERIFIABLE: "_draw_task", CODE: "_draw_task", SEARCH: "_draw_question", MEMORY: "_draw_task"}


def _broken_draw(*args, **kwargs):
    raise OSError("the dataset could not be read")


@pytest.mark.parametrize("failure", ["bad options", "data error"])
@pytest.mark.parametrize("env_id", list(BAD_OPTIONS))
def test_after_a_failed_reset_step_refuses_as_before_the_first_reset(env_id, failure, tmp_path, monkeypatch):
    env = make(env_id, tmp_path).unwrapped
    try:
        env.reset(seed=0)
        env.step(FIRST_ACTIONS[env_id])
        if failure == "data error":
            monkeypatch.setattr(env, DRAWS[env_id], _broken_draw)
        with pytest.raises((ValueError, OSError)):
            env.reset(seed=1, options=BAD_OPTIONS[env_id] if failure == "bad options" else None)
        with pytest.raises(RuntimeError, match=r"call reset\(\) before step\(\)"):
            env.step(FIRST_ACTIONS[env_id])
        monkeypatch.undo()
        context, _ = env.reset(seed=0)  # and a good reset starts an episode again
        assert env.observation_space.contains(context)
    finally:
        env.close()


# ---------------------------------------------------------------- copy.copy

# (env id, options, first action, then: the copy's action, the original's)
EPISODES = {
    VERIFIABLE: ({"max_attempts": 3}, "<answer>1</answer>", ("<answer>2</answer>", "<answer>3</answer>")),
    CODE: ({"max_attempts": 3}, PROGRAM, (PROGRAM.replace("0", "1"), NO_CODE)),
    SEARCH: ({}, "<search>capital city</search>",
             ("<evaluate>score: 7 good</evaluate><answer>Paris</answer>",
              "<evaluate>score: 1 bad</evaluate><search>mountain</search>")),
    MEMORY: ({}, "<search>birthplace</search>",
             ('<prune ids="r1">nothing useful</prune><search>currency</search>', "<search>language</search>")),
}


@pytest.mark.parametrize("env_id", list(EPISODES))
def test_a_shallow_copy_is_a_branch_that_leaves_the_original_alone(env_id, tmp_path):
    options, first, (mine, theirs) = EPISODES[env_id]
    original, reference = (make(env_id, tmp_path, **options).unwrapped for _ in range(2))
    try:
        for env in (original, reference):
            env.reset(seed=3)
            env.step(first)
        clone = copy.copy(original)
        clone.step(mine)
        clone.close()  # gives back the copy's own share of a retriever or sandbox, not the original's
        assert stepped(original, theirs) == stepped(reference, theirs)
    finally:
        original.close()
        reference.close()
