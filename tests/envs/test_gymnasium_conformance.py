"""What a Gymnasium user's mistakes get back from every rftgym env: a keyword the env does not take
(through ``gym.make`` too), reset options that are not a dict, and options that would be ignored."""

from __future__ import annotations

import gymnasium as gym
import pytest

import rftgym  # noqa: F401  (registers the envs)
from rftgym.core.errors import ConfigError
from rftgym.envs.code.env import CodeTCGEnv
from rftgym.envs.code.tcg import TCGConfig
from rftgym.envs.memory.env import MemoryQAConfig
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


# ---------------------------------------------------------------- messages that show the value given

def test_a_format_weight_given_as_text_is_shown_as_text():
    with pytest.raises(ConfigError, match=r"format_weight must be in \[0, 1\), got '0.1'"):
        VerifiableQAConfig(format_weight="0.1")


def test_feedback_tests_says_that_zero_is_allowed():
    with pytest.raises(ConfigError, match="feedback_tests must be an int of at least 0, got -1"):
        CodeTCGEnv(dataset="generated", feedback_tests=-1)
