"""What a rollout that stops keeps, sample keys an agent cannot take, and arguments of the wrong kind."""

from __future__ import annotations

import warnings

import gymnasium as gym
import pytest

import rftgym  # noqa: F401
from rftgym.agents.base import Agent, AgentReply
from rftgym.agents.scripted import RandomTextAgent, ScriptedAgent
from rftgym.core.errors import AgentError, ConfigError, EnvError
from rftgym.rollout import RolloutConfig, run_episodes

ANSWER = "<answer>1</answer>"  # ends a VerifiableQA episode in one turn


def make_qa():
    return gym.make("rftgym/VerifiableQA-v0")


class FailsOnCall(Agent):
    """Answers at once, and raises on its ``fail_on``-th call."""

    def __init__(self, fail_on: int, error: BaseException):
        self.calls, self.fail_on, self.error = 0, fail_on, error

    def act(self, contexts):
        self.calls += 1
        if self.calls == self.fail_on:
            raise self.error
        return [AgentReply(ANSWER) for _ in contexts]


# ---------------------------------------------------------------- the episodes finished before an error

def test_an_agent_error_carries_the_episodes_finished_before_it():
    # Two envs side by side: calls 1 and 2 finish seeds 10-13, call 3 (seed 14) fails.
    with pytest.raises(AgentError, match="raised RuntimeError: boom") as info:
        run_episodes(make_qa, FailsOnCall(3, RuntimeError("boom")), seeds=[10, 11, 12, 13, 14],
                     config=RolloutConfig(num_envs=2))
    assert [e.seed for e in info.value.finished_episodes] == [10, 11, 12, 13]
    assert info.value.finished_indices == [0, 1, 2, 3]


def test_an_env_error_carries_the_episodes_finished_before_it_by_their_place_in_seeds():
    class BreaksOnItsSecondEpisode(gym.Wrapper):
        resets = 0

        def reset(self, **kwargs):
            self.resets += 1
            return self.env.reset(**kwargs)

        def step(self, action):
            if self.resets == 2:
                raise OSError("sandbox gone")
            return self.env.step(action)

    # One env per slot, two slots: each slot's second episode fails; the first two are kept.
    with pytest.raises(EnvError, match="raised OSError in step") as info:
        run_episodes(lambda: BreaksOnItsSecondEpisode(make_qa()), ScriptedAgent(ANSWER), seeds=[7, 7, 7, 7],
                     config=RolloutConfig(num_envs=2))
    assert info.value.finished_indices == [0, 1]  # a repeated seed is told apart by its place
    assert all(e.seed == 7 and e.terminated for e in info.value.finished_episodes)


def test_an_interrupt_keeps_its_type_and_carries_the_episode_being_handed_over():
    def on_episode(episode):
        if episode.seed == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as info:
        run_episodes(make_qa, ScriptedAgent(ANSWER), seeds=[0, 1, 2], config=RolloutConfig(num_envs=1),
                     on_episode=on_episode)
    assert [e.seed for e in info.value.finished_episodes] == [0, 1]


def test_a_close_that_fails_after_every_episode_carries_them_all():
    class FailingClose(gym.Wrapper):
        def close(self):
            raise OSError("disk gone")

    with pytest.raises(EnvError, match="in close: disk gone") as info:
        run_episodes(lambda: FailingClose(make_qa()), ScriptedAgent(ANSWER), seeds=[0, 1, 2])
    assert [e.seed for e in info.value.finished_episodes] == [0, 1, 2]


def test_an_error_before_any_episode_finished_carries_none():
    def make_env():
        raise RuntimeError("no env today")

    with pytest.raises(RuntimeError, match="no env today") as info:
        run_episodes(make_env, ScriptedAgent(ANSWER), seeds=[0])
    assert info.value.finished_episodes == [] and info.value.finished_indices == []


# ---------------------------------------------------------------- sample keys

class Unkeyed(Agent):
    """An agent whose replies draw nothing (and so take no sample keys)."""

    name = "unkeyed"

    def __init__(self, text: str = ANSWER):
        self.text = text

    def act(self, contexts):
        return [AgentReply(self.text, finish_reason="stop") for _ in contexts]


def test_sample_keys_an_agent_cannot_take_are_said_to_be_ignored():
    with pytest.warns(UserWarning, match=r"sample_keys are ignored: agent 'unkeyed' has no keyed sampling "
                                         r"\(keyed_sampling is False\)"):
        (episode,) = run_episodes(make_qa, Unkeyed(), seeds=[0], sample_keys=[(1, 2)])
    assert episode.terminated


def test_a_keyed_agents_subclass_that_overrides_act_without_keys_is_told_why_it_is_not_keyed():
    class Scripted(RandomTextAgent):
        def act(self, contexts):
            return [AgentReply(ANSWER) for _ in contexts]

    with pytest.warns(UserWarning, match=r"it subclasses the keyed RandomTextAgent, and its act\(\) has no "
                                         "sample_keys parameter"):
        run_episodes(make_qa, Scripted(), seeds=[0], sample_keys=[(1, 2)])


def test_an_unkeyed_agent_without_sample_keys_runs_without_a_warning():
    # What `rftgym eval` does for every agent: it passes no sample_keys.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_episodes(make_qa, Unkeyed(), seeds=[0, 1])


def test_a_keyed_agent_takes_given_keys_without_a_warning():
    class Keyed(Agent):
        keyed_sampling = True

        def __init__(self):
            self.keys = []

        def act(self, contexts, sample_keys=None):
            self.keys += sample_keys
            return [AgentReply(ANSWER) for _ in contexts]

    agent = Keyed()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_episodes(make_qa, agent, seeds=[0], sample_keys=[(4, 5)])
    assert agent.keys == [(4, 5, 0)]


def test_sample_keys_of_the_wrong_shape_are_refused_whatever_the_agent():
    with pytest.raises(ConfigError, match="sample_keys has 2 entries for 1 seeds"):
        run_episodes(make_qa, ScriptedAgent(ANSWER), seeds=[0], sample_keys=[(1,), (2,)])


# ---------------------------------------------------------------- arguments of the wrong kind

@pytest.mark.parametrize("arguments, message", [
    (dict(make_env="an env made"),
     r"make_env is a function that makes a new env each call, e.g. lambda: gym.make\(env_id\) .*got an env"),
    (dict(make_env="rftgym/VerifiableQA-v0"), r"e.g. lambda: gym.make\('rftgym/VerifiableQA-v0'\)"),
    (dict(make_env=lambda: "rftgym/VerifiableQA-v0"), "make_env returned str 'rftgym/VerifiableQA-v0'; it returns "
                                                      "a new gymnasium.Env"),
    (dict(agent=lambda context: ANSWER), "agent is an rftgym Agent .* got function .*ScriptedAgent\\(function\\)"),
    (dict(agent=ScriptedAgent), r"agent is an Agent instance, got the class ScriptedAgent; make one first"),
    (dict(seeds=3), r"seeds is a sequence with one seed .* got int 3"),
    (dict(seeds=(s for s in range(3))), "seeds is a sequence .* got generator"),
    (dict(config={"num_envs": 2}), r"config is a RolloutConfig .* got dict \{'num_envs': 2\}"),
    (dict(options={"hops": 2}), r"options is a sequence with one reset options dict .* got dict"),
    (dict(on_episode=[]), "on_episode is a function called with each finished episode .* got list"),
])
def test_an_argument_of_the_wrong_kind_is_named_before_the_rollout(arguments, message):
    env = make_qa() if arguments.get("make_env") == "an env made" else None  # where a function that makes one goes
    given = {"make_env": make_qa, "agent": ScriptedAgent(ANSWER), "seeds": [0, 1], **arguments,
             **({"make_env": env} if env is not None else {})}
    try:
        with pytest.raises(TypeError, match=message):
            run_episodes(given.pop("make_env"), given.pop("agent"), given.pop("seeds"), **given)
    finally:
        if env is not None:
            env.close()


def test_one_env_handed_to_every_slot_is_refused():
    env = make_qa()  # `lambda: env` would run both episodes in one env, each resetting the other
    with pytest.raises(ConfigError, match="make_env returned the same rftgym/VerifiableQA-v0 env twice; episodes run "
                                          "side by side each need an env of their own"):
        run_episodes(lambda: env, ScriptedAgent(ANSWER), seeds=[0, 1], config=RolloutConfig(num_envs=2))
    (episode,) = run_episodes(lambda: make_qa(), ScriptedAgent(ANSWER), seeds=[0])  # one slot: fine
    assert episode.terminated


@pytest.mark.parametrize("method", ["assistant_span", "on_assistant_message"])
def test_an_agent_whose_bookkeeping_raises_is_named_with_where_it_was(method):
    class Breaks(Agent):
        token_level = True

        def act(self, contexts):
            return [AgentReply("no tag", prompt_ids=[1], sampled_ids=[2], logprobs=[-0.5]) for _ in contexts]

        def assistant_span(self, message, reply):
            if method == "assistant_span":
                raise KeyError("no span")
            return (2,)

        def on_assistant_message(self, message, reply):
            if method == "on_assistant_message":
                raise ValueError("no room")

    with pytest.raises(AgentError, match=rf"agent 'agent' raised \w+ in {method}\(\): .* \(after its reply to "
                                         r"rftgym/VerifiableQA-v0 seed 4 turn 1\)") as info:
        run_episodes(make_qa, Breaks(), seeds=[4])
    assert isinstance(info.value.__cause__, (KeyError, ValueError))


# ---------------------------------------------------------------- where warnings point

def test_the_rollouts_warnings_point_at_the_call_of_run_episodes():
    class Tidies(gym.Wrapper):  # stores the reply otherwise than the agent wrote it
        def step(self, action):
            return self.env.step(action.strip())

    class Tokens(Agent):  # sampled tokens that nothing binds to their message
        def act(self, contexts):
            return [AgentReply(f" {ANSWER}", prompt_ids=[1], sampled_ids=[2], logprobs=[-0.5]) for _ in contexts]

    with pytest.warns(UserWarning) as caught:
        run_episodes(lambda: Tidies(make_qa()), Unkeyed(f" {ANSWER}"), seeds=[0], sample_keys=[(1,)])
        run_episodes(make_qa, Tokens(), seeds=[0])
    messages = [str(w.message) for w in caught]
    for warning in ("sample_keys are ignored", "stored a reply other than the agent's text",
                    "not bound to its message"):
        assert any(warning in message for message in messages), warning
    assert {w.filename for w in caught} == {__file__}  # not a frame of the engine, nor one above the call


def test_a_warning_met_under_rftgym_eval_names_the_line_that_called_into_rftgym(tmp_path, monkeypatch):
    """A fixed stacklevel named the engine's caller, which under `rftgym eval` is rftgym's own
    cli/evaluate.py: the warning points past every frame of rftgym, here at this test's call."""
    from rftgym.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.warns(UserWarning, match="stored a reply other than the agent's text") as caught:
        assert main(["eval", "rftgym/VerifiableQA-v0", "--agent", "random", "--episodes", "1",
                     "--env-arg", "max_action_chars=5"]) == 0  # the env cuts the reply: stored otherwise
    assert {w.filename for w in caught if "stored a reply" in str(w.message)} == {__file__}
