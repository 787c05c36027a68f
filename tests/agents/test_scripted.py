"""Scripted agents: ScriptedAgent, RandomTextAgent, AdversarialAgent."""

from __future__ import annotations

from functools import lru_cache

import pytest

from rftgym.agents import Agent, AgentReply
from rftgym.agents.scripted import (
    ADVERSARIAL_TEXTS, AdversarialAgent, RandomTextAgent, ScriptedAgent, assistant_turns,
)
from rftgym.core.messages import Context, Message
from rftgym.envs.verifiable import VerifiableQAEnv


def context_with(assistant_turns_count: int) -> Context:
    messages = [Message("system", "s", "m0"), Message("user", "q", "m1")]
    for i in range(assistant_turns_count):
        messages += [Message("assistant", f"a{i}", f"a{i}"), Message("user", f"f{i}", f"f{i}")]
    return Context(tuple(messages))


def test_assistant_turns_counts_assistant_messages_only():
    assert assistant_turns(Context()) == 0
    assert assistant_turns(context_with(0)) == 0
    assert assistant_turns(context_with(3)) == 3


# ---------------------------------------------------------------- ScriptedAgent

def test_scripted_replies_follow_the_turn_and_the_last_one_repeats():
    agent = ScriptedAgent(["first", "second", "last"])
    replies = agent.act([context_with(n) for n in range(5)])
    assert [r.text for r in replies] == ["first", "second", "last", "last", "last"]
    assert all(isinstance(r, AgentReply) and r.finish_reason == "stop" for r in replies)
    assert all(r.prompt_ids is None and r.sampled_ids is None and r.logprobs is None for r in replies)


def test_in_a_rollout_the_script_follows_the_engines_turn_also_where_the_env_deletes_replies():
    # MemoryQA's prune deletes spent assistant turns, so counting the context's replies went back a
    # step and replayed the prune (refused: its ids were gone).
    import gymnasium as gym

    from rftgym.rollout import RolloutConfig, run_episodes

    script = ["<search>currency</search>", '<prune ids="r1">noted</prune>', "<search>birthplace</search>",
              '<answer id="1">x</answer>']
    (episode,) = run_episodes(lambda: gym.make("rftgym/MemoryQA-v0"), ScriptedAgent(script), [0],
                              config=RolloutConfig(max_turns=5))
    assert [turn.action for turn in episode.turns][:4] == script
    assert episode.turns[1].info["prune_error"] is None
    assert ScriptedAgent(script).act([Context()], sample_keys=[(0, 2)])[0].text == script[2]


def test_a_single_string_is_one_reply_not_one_per_character():
    agent = ScriptedAgent("<answer>4</answer>")
    assert [r.text for r in agent.act([context_with(0), context_with(2)])] == ["<answer>4</answer>"] * 2


def test_scripted_replies_from_a_function_of_the_context():
    agent = ScriptedAgent(lambda ctx: f"{len(ctx)} messages, last {ctx[-1].id}")
    assert agent.act_one(context_with(1)).text == "4 messages, last f0"


@pytest.mark.parametrize("replies", [[], ()])
def test_scripted_agent_needs_a_reply(replies):
    with pytest.raises(ValueError, match="at least one reply"):
        ScriptedAgent(replies)


def test_scripted_agent_drives_the_env():
    env = VerifiableQAEnv(max_attempts=2)
    context, _ = env.reset(seed=0)
    agent = ScriptedAgent(["thinking...", "<answer>-1</answer>"])
    context, _, terminated, _, info = env.step(agent.act_one(context).text)
    assert not terminated and info["format_error"] == "no <answer>…</answer> tag"
    context, _, _, _, info = env.step(agent.act_one(context).text)
    assert info["answer"] == "-1" and info["attempts"] == 1
    assert [m.content for m in context if m.role == "assistant"] == ["thinking...", "<answer>-1</answer>"]


def test_act_returns_one_reply_per_context_in_order():
    agent = ScriptedAgent(lambda ctx: ctx[-1].id)
    contexts = [context_with(n) for n in (2, 0, 1)]
    assert [r.text for r in agent.act(contexts)] == ["f1", "m1", "f0"]
    assert agent.act([]) == []


def test_agent_base_hooks_are_no_ops():
    agent = ScriptedAgent(["x"])
    assert agent.on_assistant_message(Message("assistant", "x", "i"), AgentReply("x")) is None
    assert agent.close() is None
    assert isinstance(agent, Agent) and agent.name == "scripted"
    with pytest.raises(TypeError):
        Agent()  # abstract


# ---------------------------------------------------------------- RandomTextAgent

def test_random_agent_is_seeded_and_bounded():
    a, b, c = RandomTextAgent(seed=1, max_chars=40), RandomTextAgent(seed=1, max_chars=40), RandomTextAgent(seed=2, max_chars=40)
    batch = [context_with(0)] * 20
    texts_a = [r.text for r in a.act(batch)]
    assert texts_a == [r.text for r in b.act(batch)]
    assert texts_a != [r.text for r in c.act(batch)]
    assert all(len(t) <= 40 for t in texts_a)
    assert len(set(texts_a)) > 10
    assert a.name == "random"
    assert all(r.finish_reason == "stop" for r in a.act(batch))


# ---------------------------------------------------------------- AdversarialAgent

@lru_cache(maxsize=None)
def splits_into(text: str, parts: int) -> bool:
    """Whether ``text`` is a concatenation of exactly ``parts`` entries of ADVERSARIAL_TEXTS."""
    if parts == 0:
        return text == ""
    return any(text.startswith(t) and splits_into(text[len(t):], parts - 1) for t in ADVERSARIAL_TEXTS)


def test_adversarial_replies_splice_one_to_three_adversarial_texts():
    agent = AdversarialAgent(seed=0)
    texts = [r.text for r in agent.act([context_with(0)] * 60)]
    for text in texts:
        assert any(splits_into(text, k) for k in (1, 2, 3)), text[:80]
    assert len(set(texts)) > 20
    assert agent.name == "adversarial"


def test_adversarial_agent_is_seeded():
    batch = [context_with(0)] * 10
    assert [r.text for r in AdversarialAgent(seed=5).act(batch)] == [r.text for r in AdversarialAgent(seed=5).act(batch)]
    assert [r.text for r in AdversarialAgent(seed=5).act(batch)] != [r.text for r in AdversarialAgent(seed=6).act(batch)]


def test_adversarial_texts_cover_the_nasty_cases():
    assert "" in ADVERSARIAL_TEXTS
    assert any("\ud800" in t for t in ADVERSARIAL_TEXTS)  # a lone surrogate
    assert max(map(len, ADVERSARIAL_TEXTS)) > 32_000  # longer than the default action limit
    assert any("```" in t and "<answer>" in t for t in ADVERSARIAL_TEXTS)
    assert all(isinstance(t, str) for t in ADVERSARIAL_TEXTS)


# ---------------------------------------------------------------- keyed replies

@pytest.mark.filterwarnings("ignore:VerifiableQAEnv stored a reply other")  # adversarial text is cut
@pytest.mark.parametrize("agent_cls", [RandomTextAgent, AdversarialAgent])
def test_text_agents_give_an_episode_the_same_replies_in_any_batch(agent_cls):
    """Keyed by the engine, an episode's replies depend on its seed, not on --num-envs or on
    which episodes share its batch; ``rftgym eval --seed 5 --episodes 1`` replays episode 5."""
    from rftgym.rollout.engine import RolloutConfig, run_episodes

    def replies(seeds, num_envs):
        episodes = run_episodes(lambda: VerifiableQAEnv(max_turns=3), agent_cls(seed=7), seeds,
                                config=RolloutConfig(num_envs=num_envs))
        return {episode.seed: [turn.action for turn in episode.turns] for episode in episodes}

    one_by_one = replies(list(range(6)), 1)
    side_by_side = replies(list(range(6)), 4)
    assert one_by_one == side_by_side
    assert replies([5], 1)[5] == one_by_one[5]
    assert len({tuple(actions) for actions in one_by_one.values()}) == 6  # episodes differ
    other_seed = run_episodes(lambda: VerifiableQAEnv(max_turns=3), agent_cls(seed=8), [5])[0]
    assert [turn.action for turn in other_seed.turns] != one_by_one[5]


def test_text_agents_refuse_keys_that_do_not_match_the_contexts():
    with pytest.raises(ValueError, match="2 sample keys for 1 contexts"):
        RandomTextAgent(seed=0).act([context_with(0)], sample_keys=[(1, 0, 0, 0), (1, 1, 0, 0)])


def test_text_agents_without_a_seed_draw_fresh_replies():
    batch = [context_with(0)] * 8
    keys = [(1, i, 0, 0) for i in range(8)]
    first = [r.text for r in AdversarialAgent(seed=None).act(batch, sample_keys=keys)]
    second = [r.text for r in AdversarialAgent(seed=None).act(batch, sample_keys=keys)]
    assert first != second
