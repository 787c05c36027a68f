"""What a Gymnasium user's mistakes get back from every rftgym env: a keyword the env does not take
(through ``gym.make`` too), reset options that are not a dict, options that would be ignored, and
an env used after close()."""

from __future__ import annotations

import copy
import pickle

import gymnasium as gym
import pytest

import rftgym  # noqa: F401  (registers the envs)
from rftgym.agents.scripted import ScriptedAgent
from rftgym.core.errors import ConfigError
from rftgym.envs.code.env import CodeTCGConfig, CodeTCGEnv
from rftgym.envs.code.process import PolicyRollouts
from rftgym.envs.code.tcg import TCGConfig
from rftgym.envs.memory.env import MemoryQAConfig, MemoryQAEnv
from rftgym.envs.search.env import SearchEvalQAConfig
from rftgym.envs.verifiable.env import VerifiableQAConfig

VERIFIABLE, CODE = "rftgym/VerifiableQA-v0", "rftgym/CodeTCG-v0"
SEARCH, MEMORY = "rftgym/SearchEvalQA-v0", "rftgym/MemoryQA-v0"
ENV_IDS = [VERIFIABLE, CODE, SEARCH, MEMORY]


def make(env_id: str, tmp_path, **kwargs) -> gym.Env:
    if env_id == CODE:
        kwargs = {"dataset": "generated", "tcg": TCGConfig(cache_dir=str(tmp_path), n_random=2, n_edge=0), **kwargs}
    return gym.make(env_id, **kwargs)


# ---------------------------------------------------------------- keywords an env does not take

@pytest.mark.parametrize("env_id", ENV_IDS)
def test_a_mistyped_keyword_is_named_with_the_one_meant_and_the_valid_ones(env_id, tmp_path):
    with pytest.raises(ConfigError) as caught:
        make(env_id, tmp_path, max_turn=3)
    message = str(caught.value)
    assert "unexpected keyword argument 'max_turn' (did you mean 'max_turns'?)" in message
    assert "the env's options are " in message and "max_turns" in message.split("options are ")[1]
    # gymnasium re-raises it with the env id added; its own error, with the field, is the cause
    assert caught.value.__cause__.fields == ("max_turn",)


def test_an_unknown_keyword_is_still_the_type_error_gymnasium_and_front_ends_catch():
    # gymnasium's make re-raises a TypeError of the env's with the env id added; the CLI reads the
    # keyword's name from Python's own wording, "unexpected keyword argument 'NAME'".
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'bogus';.*was raised from the environment "
                                        r"creator for rftgym/VerifiableQA-v0"):
        gym.make(VERIFIABLE, bogus=1)


def test_a_keyword_the_config_sets_itself_says_to_leave_it_out():
    with pytest.raises(ConfigError, match=r"unexpected keyword argument 'tags' \(tags is set by VerifiableQAConfig "
                                          r"itself; leave it out\)"):
        gym.make(VERIFIABLE, tags=("answer",))


def test_every_unknown_keyword_is_named():
    with pytest.raises(ConfigError, match=r"'zzz' \(and 'yyy'\)") as caught:
        gym.make(SEARCH, zzz=1, yyy=2)
    assert caught.value.__cause__.fields == ("zzz", "yyy")


def test_the_config_classes_themselves_are_unchanged():
    # Only the env's keywords are checked here; a config dataclass keeps Python's own error.
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        VerifiableQAConfig(max_turn=3)


# ---------------------------------------------------------------- reset options that are not a dict

@pytest.mark.parametrize("options", ["task_index", 5, [("kind", "arithmetic")]], ids=["str", "int", "pairs"])
@pytest.mark.parametrize("env_id", ENV_IDS)
def test_reset_options_that_are_not_a_dict_are_refused_as_such(env_id, options, tmp_path):
    env = make(env_id, tmp_path)
    try:
        with pytest.raises(TypeError, match=rf"options must be a dict of reset options or None, got "
                                            rf"{type(options).__name__}"):
            env.reset(seed=0, options=options)
        with pytest.raises(RuntimeError, match=r"call reset\(\) before step\(\)"):  # a failed reset starts nothing
            env.step("hello")
        context, _ = env.reset(seed=0, options={})
        assert env.observation_space.contains(context)
    finally:
        env.close()


# ---------------------------------------------------------------- options that would be ignored

def test_memory_max_distractors_without_a_distractor_corpus_is_refused():
    with pytest.raises(ConfigError, match="max_distractors=5 limits the distractor corpus, and no corpus_path is "
                                          "given; add corpus_path") as caught:
        MemoryQAConfig(max_distractors=5)
    assert caught.value.fields == ("max_distractors",)


UNREAD_OPTIONS = [  # (config class, options, the option the others leave unread, why, what to do)
    (CodeTCGConfig, dict(dataset="generated", process_weight=0.5), "process_weight",
     "process_weight=0.5 weighs the step_scorer's scores of the pseudocode turn, and no step_scorer is given",
     "add a step_scorer, with pseudocode=True (on the command line: --env-arg step_scorer=rollout --env-arg "
     "pseudocode=true; from Python: step_scorer=RolloutStepScorer(agent)), or drop process_weight"),
    (CodeTCGConfig, dict(dataset="generated", pseudocode=True, process_weight=0.0), "process_weight",
     "process_weight=0.0 weighs", ", or drop process_weight"),
    (CodeTCGConfig, dict(dataset="generated", feedback_tests=5), "feedback_tests",
     "feedback_tests=5 is how many failing tests the feedback after a failed attempt shows, and with "
     "max_attempts=1 the episode ends on the first graded submission", "raise max_attempts (e.g. max_attempts=3), "
                                                                        "or drop feedback_tests"),
    (MemoryQAConfig, dict(allow_prune=False, max_note_chars=200), "max_note_chars",
     "max_note_chars=200 caps the notes that prunes keep, and allow_prune=False refuses every prune",
     "drop max_note_chars, or set allow_prune=True"),
    (MemoryQAConfig, dict(answer_metric="em", f1_threshold=0.5), "f1_threshold",
     "f1_threshold=0.5 is the token F1 an answer needs, and answer_metric='em' scores answers by exact match",
     "drop f1_threshold, or set answer_metric='f1'"),
    (MemoryQAConfig, dict(max_context_tokens=None, overflow_penalty=0.5), "overflow_penalty",
     "overflow_penalty=0.5 acts on a context past max_context_tokens, and max_context_tokens=None sets no budget",
     "drop overflow_penalty, or give max_context_tokens"),
    (MemoryQAConfig, dict(max_context_tokens=None, on_context_overflow="penalize"), "on_context_overflow",
     "on_context_overflow='penalize' acts on", "drop on_context_overflow, or give max_context_tokens"),
    (VerifiableQAConfig, dict(task_selection="random"), "task_selection",
     "task_selection='random' picks a dataset item at each reset, and this env generates its tasks from the reset's "
     "seed", "drop task_selection, or give dataset_path"),
    (SearchEvalQAConfig, dict(task_selection="random"), "task_selection", "task_selection='random' picks",
     "drop task_selection, or give dataset_path"),
    (CodeTCGConfig, dict(dataset="generated", task_selection="random"), "task_selection",
     "task_selection='random' picks", "drop task_selection, or read a dataset (dataset=humaneval or mbpp)"),
]


@pytest.mark.parametrize("config_class, options, name, why, fix", UNREAD_OPTIONS,
                         ids=["process_weight", "process_weight_0", "feedback_tests", "max_note_chars", "f1_threshold",
                              "overflow_penalty", "on_context_overflow", "task_selection_verifiable",
                              "task_selection_search", "task_selection_code"])
def test_an_option_the_others_leave_unread_is_refused_with_what_to_do(config_class, options, name, why, fix):
    with pytest.raises(ConfigError) as caught:
        config_class(**options)
    message = str(caught.value)
    assert message.startswith(why) and message.endswith(fix), message
    assert caught.value.fields == (name,)


@pytest.mark.parametrize("config_class, options", [
    (CodeTCGConfig, dict(dataset="generated", process_weight=1)),  # its default, given: nothing is ignored
    (CodeTCGConfig, dict(dataset="generated", pseudocode=True, step_scorer=lambda task, steps: [1.0],
                         process_weight=0.5)),
    (CodeTCGConfig, dict(dataset="generated", pseudocode=True, process_weight=0.5,  # --env-arg step_scorer=rollout
                         step_scorer=PolicyRollouts("rollout", ScriptedAgent("x")))),
    (CodeTCGConfig, dict(dataset="generated", feedback_tests=3)),
    (CodeTCGConfig, dict(dataset="generated", max_attempts=2, feedback_tests=0)),
    (MemoryQAConfig, dict(allow_prune=False, max_note_chars=500)),
    (MemoryQAConfig, dict(max_note_chars=200)),
    (MemoryQAConfig, dict(answer_metric="em", f1_threshold=0.8)),
    (MemoryQAConfig, dict(max_context_tokens=None, on_context_overflow="truncate", overflow_penalty=0.1)),
    (CodeTCGConfig, dict(dataset="humaneval", task_selection="random")),
], ids=["process_weight_default", "process_weight_read", "process_weight_read_bound", "feedback_tests_default",
        "feedback_tests_read", "max_note_chars_default", "max_note_chars_read", "f1_threshold_default",
        "overflow_default", "task_selection_read"])
def test_an_option_that_is_read_or_left_at_its_default_is_taken(config_class, options):
    config = config_class(**options)
    assert all(getattr(config, name) == value for name, value in options.items())


def test_the_no_memory_baseline_takes_a_note_cap_given_for_the_agents_run(tmp_path, capsys):
    from rftgym.cli import main

    # rftgym eval --baselines runs the no-memory baseline (allow_prune=False) with the user's options too.
    out = tmp_path / "mem.jsonl"
    assert main(["eval", MEMORY, "--agent", "adversarial", "--episodes", "1", "--baselines",
                 "--env-arg", "max_note_chars=200", "--out", str(out)]) == 0
    assert "no-memory" in capsys.readouterr().out
    assert not MemoryQAConfig(**{"max_note_chars": 200, **MemoryQAEnv.metadata["eval_baselines"][0][1]}).allow_prune


# ---------------------------------------------------------------- an env used after close()

STEPS = {VERIFIABLE: "<answer>1</answer>", CODE: "```python\ndef solve():\n    return 0\n```",
         SEARCH: "<search>capital</search>", MEMORY: "<search>birthplace</search>"}


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_an_env_used_after_close_says_it_was_closed_in_every_env_alike(env_id, tmp_path):
    env = make(env_id, tmp_path)
    env.reset(seed=0)
    env.close()
    env.close()  # twice is safe, and so is the env's own close
    env.unwrapped.close()
    closed = rf"this env was closed; make a new one with gym.make\('{env_id}', ...\)"
    with pytest.raises(RuntimeError, match=rf"^step\(\) after close\(\): {closed}"):
        env.unwrapped.step(STEPS[env_id])  # mid-episode
    with pytest.raises(RuntimeError, match=rf"^reset\(\) after close\(\): {closed}"):
        env.reset(seed=1)
    with pytest.raises(RuntimeError, match=rf"^step\(\) after close\(\): {closed}"):
        env.unwrapped.step(STEPS[env_id])
    with pytest.raises(RuntimeError, match=rf"^render\(\) after close\(\): {closed}"):
        env.unwrapped.render()  # not the empty context a closed env is left with
    assert env.unwrapped.closed


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_a_closed_env_is_neither_copied_nor_pickled(env_id, tmp_path):
    env = make(env_id, tmp_path)
    env.reset(seed=0)
    env.close()
    for copied in (copy.deepcopy, lambda e: pickle.loads(pickle.dumps(e))):
        with pytest.raises(RuntimeError, match=r"this env was closed, so it cannot be copied or pickled; copy it "
                                               r"before closing it, or make a new one with gym.make"):
            copied(env.unwrapped)


def test_an_env_made_without_gym_make_names_its_class_after_close(tmp_path):
    env = CodeTCGEnv(dataset="generated", tcg=TCGConfig(cache_dir=str(tmp_path), n_random=2, n_edge=0))
    env.close()
    with pytest.raises(RuntimeError, match=r"reset\(\) after close\(\): this env was closed; make a new one with "
                                           r"CodeTCGEnv\(...\)"):
        env.reset(seed=0)
    with pytest.raises(RuntimeError, match=r"prepare\(\) after close\(\)"):  # it too runs in the sandbox
        env.prepare()


# ---------------------------------------------------------------- messages that show the value given

def test_a_format_weight_given_as_text_is_shown_as_text():
    with pytest.raises(ConfigError, match=r"format_weight must be in \[0, 1\), got '0.1'"):
        VerifiableQAConfig(format_weight="0.1")


def test_feedback_tests_says_that_zero_is_allowed():
    with pytest.raises(ConfigError, match="feedback_tests must be an int of at least 0, got -1"):
        CodeTCGEnv(dataset="generated", feedback_tests=-1)


def test_the_pruning_baseline_prunes_beside_an_agents_run_without_pruning(tmp_path, capsys):
    from rftgym.cli import main
    from rftgym.core.records import read_episodes_jsonl

    out = tmp_path / "mem.jsonl"
    assert main(["eval", MEMORY, "--agent", "adversarial", "--episodes", "2", "--baselines",
                 "--env-arg", "allow_prune=false", "--out", str(out)]) == 0
    capsys.readouterr()
    def system_prompt(name: str) -> str:
        episode = next(iter(read_episodes_jsonl(tmp_path / name)))
        return episode.context(0)[0].content

    # The agent's run and the no-memory one are told there is no pruning; the pruning baseline's
    # env allows it (it refused every prune of the baseline before).
    assert "<prune" not in system_prompt("mem.jsonl") and "<prune" not in system_prompt("mem-no-memory.jsonl")
    assert "<prune" in system_prompt("mem-heuristic-prune.jsonl")
