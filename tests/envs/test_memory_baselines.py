"""MemoryQA baselines: the heuristic pruning wrapper, the world oracle, and no-memory vs pruning."""

from __future__ import annotations

from statistics import mean

import pytest

import rftgym  # noqa: F401
from rftgym.agents.base import AgentReply
from rftgym.agents.memory_baselines import HeuristicPruner, WorldOracleAgent, solve_world_question
from rftgym.agents.scripted import ScriptedAgent
from rftgym.core.messages import Context, Message
from rftgym.envs.memory.env import MemoryQAEnv
from rftgym.envs.search.world import World
from rftgym.rollout import run_episodes


def ctx(*pairs):
    return Context(tuple(Message(role, content, f"m{i}") for i, (role, content) in enumerate(pairs)))


BATCH_A = "[search results for: a]\n[r1] Alpha: Alpha is a city. It is old.\n[r2] Beta: Beta is a person."
BATCH_B = "[search results for: b]\n[r3] (no documents matched)"
BATCH_C = "[search results for: c]\n[r4] Gamma: Gamma is a river."


def test_heuristic_prunes_results_older_than_n_turns_with_a_short_note():
    context = ctx(("user", "Task: answer all 1 questions below.\n1. q?"), ("assistant", "<search>a</search>"),
                  ("user", BATCH_A), ("assistant", "<search>b</search>"), ("user", BATCH_B),
                  ("assistant", "<search>c</search>"), ("user", BATCH_C))
    assert HeuristicPruner(ScriptedAgent("x"), keep_turns=1, min_stale=1).prune_action(context) == \
        '<prune ids="r1,r3">Alpha: Alpha is a city.</prune>'
    assert HeuristicPruner(ScriptedAgent("x"), keep_turns=2, min_stale=1).prune_action(context) == \
        '<prune ids="r1">Alpha: Alpha is a city.</prune>'
    assert HeuristicPruner(ScriptedAgent("x"), keep_turns=1, min_stale=3).prune_action(context) is None
    assert HeuristicPruner(ScriptedAgent("x"), keep_turns=1, min_stale=1, note_chars=5).prune_action(context) == \
        '<prune ids="r1,r3">Alpha</prune>'
    # Right after its own prune it delegates, so a refused prune cannot loop.
    after = Context(context.messages + (Message("assistant", '<prune ids="r1,r3">n</prune>', "p"),))
    assert HeuristicPruner(ScriptedAgent("x"), keep_turns=0, min_stale=1).prune_action(after) is None


class Recorder(ScriptedAgent):
    def __init__(self):
        super().__init__(["<search>q</search>"])
        self.bound = []

    def on_assistant_message(self, message, reply):
        self.bound.append(message.id)


def test_heuristic_delegates_and_forwards_only_the_inner_agents_turns():
    inner = Recorder()
    wrapper = HeuristicPruner(inner, keep_turns=0, min_stale=1)
    stale = ctx(("user", "Task"), ("assistant", "<search>a</search>"), ("user", BATCH_A))
    fresh = ctx(("user", "Task"))
    replies = wrapper.act([stale, fresh])
    assert replies[0].text.startswith('<prune ids="r1">') and replies[1].text == "<search>q</search>"
    wrapper.on_assistant_message(Message("assistant", replies[0].text, "own"), replies[0])
    wrapper.on_assistant_message(Message("assistant", replies[1].text, "inner"), replies[1])
    assert inner.bound == ["inner"]


def test_world_oracle_solves_generated_questions():
    world = World(0, 30)
    import numpy as np
    rng = np.random.default_rng(0)
    for hops in (1, 2, 3, 4):
        question = world.question(rng, hops)
        names, answer = solve_world_question(world, question.question)
        assert tuple(names) == question.gold_titles and answer == question.answers[0]
    assert solve_world_question(world, "Who is Nobody?") is None


def summary(episodes):
    finals = [e.turns[-1].info for e in episodes]
    return (mean(f["score"] for f in finals), mean(f["peak_context_tokens"] for f in finals),
            mean(f["prunes"] for f in finals))


def test_heuristic_pruning_beats_no_memory_under_the_budget():
    world = World(0, 30)
    oracle = WorldOracleAgent(world)
    seeds = list(range(6))
    options = [{"objectives": 3, "hops": 3}] * len(seeds)
    no_memory = run_episodes(lambda: MemoryQAEnv(world_size=30, allow_prune=False), oracle, seeds, options=options)
    pruning = run_episodes(lambda: MemoryQAEnv(world_size=30), HeuristicPruner(oracle), seeds, options=options)
    unlimited = run_episodes(lambda: MemoryQAEnv(world_size=30, max_context_tokens=None), oracle, seeds,
                             options=options)
    assert summary(unlimited)[0] == 1.0 and summary(unlimited)[1] > 1024  # the evidence overflows the budget
    score_none, peak_none, prunes_none = summary(no_memory)
    score_prune, peak_prune, prunes_prune = summary(pruning)
    assert prunes_none == 0 and prunes_prune >= 2
    assert score_prune == 1.0 > score_none
    assert any(e.truncated for e in no_memory) and not any(e.truncated for e in pruning)
    assert all(f.info["budget_tokens"] <= 1024 for e in pruning for f in e.turns)


@pytest.mark.parametrize("pruner", [{}, {"note_chars": 0}, {"keep_turns": 0, "min_stale": 1}])
def test_the_oracle_searches_each_name_of_its_chains_once_however_its_turns_are_pruned(pruner):
    """A prune deletes the turns that searched with their results, and a note need not name them
    (note_chars=0 keeps none): the oracle remembers its own searches, so it neither searches a
    name again (it looped until max_turns) nor skips one a note merely mentions."""
    world = World(0, 30)
    seeds = list(range(6))
    episodes = run_episodes(lambda: MemoryQAEnv(world_size=30), HeuristicPruner(WorldOracleAgent(world), **pruner),
                            seeds, options=[{"objectives": 3, "hops": 3}] * len(seeds))
    for episode in episodes:
        queries = [q for turn in episode.turns for q in turn.info["queries"]]
        chains = {name for line in episode.messages.values() if line.content.startswith("Task:")
                  for question in line.content.splitlines()[1:]
                  for name in solve_world_question(world, question.partition(". ")[2])[0]}
        assert episode.success and sorted(queries) == sorted(chains), (queries, chains)
        assert sum(turn.info["turns_deleted"] for turn in episode.turns) > 0


def test_wrapper_replies_have_no_tokens_so_they_are_not_trained():
    reply = HeuristicPruner(ScriptedAgent("x"), keep_turns=0, min_stale=1).act(
        [ctx(("user", "T"), ("assistant", "a"), ("user", BATCH_A))])[0]
    assert isinstance(reply, AgentReply) and reply.sampled_ids is None


def test_the_pruning_wrapper_passes_its_episodes_keys_to_a_keyed_agent():
    from rftgym.agents.base import Agent

    class Keyed(Agent):
        keyed_sampling = True

        def __init__(self):
            self.keys = []

        def act(self, contexts, *, sample_keys=None):
            self.keys.append(sample_keys)
            return [AgentReply(text="x") for _ in contexts]

    stale = ctx(("user", "Task: answer all 1 questions below.\n1. q?"), ("assistant", "<search>a</search>"),
                ("user", BATCH_A), ("assistant", "<search>b</search>"), ("user", BATCH_B),
                ("assistant", "<search>c</search>"), ("user", BATCH_C))
    fresh = ctx(("user", "Task: answer all 1 questions below.\n1. q?"))
    inner = Keyed()
    wrapper = HeuristicPruner(inner, keep_turns=1, min_stale=1)
    class Unkeyed(Agent):
        def act(self, contexts):
            return [AgentReply(text="x") for _ in contexts]

    assert wrapper.keyed_sampling and not HeuristicPruner(Unkeyed()).keyed_sampling
    replies = wrapper.act([fresh, stale, fresh], sample_keys=[(1, 0, 0, 0), (1, 1, 0, 3), (1, 2, 0, 0)])
    assert replies[1].text.startswith("<prune")  # the wrapper's own turn: no key spent
    assert inner.keys == [[(1, 0, 0, 0), (1, 2, 0, 0)]]
    wrapper.act([fresh])
    assert inner.keys[-1] is None  # no keys given, none passed


def test_a_refused_prune_is_not_sent_again_every_other_turn():
    # With its tool calls spent the env refuses every prune; the wrapper sent the same one on every
    # other turn, so the oracle ran out of turns (score 2/3) where it needs no prune at all.
    env = lambda: MemoryQAEnv(max_tool_calls=3, max_context_tokens=4000, max_turns=12)   # noqa: E731
    (episode,) = run_episodes(env, HeuristicPruner(WorldOracleAgent(World(0, 60))), seeds=[0])
    prunes = [t.action for t in episode.turns if t.action.startswith("<prune")]
    assert len(prunes) == 1 and episode.turns[3].info["prunes"] == 0   # refused: no tool call left
    assert episode.success and episode.total_reward == 1.0


@pytest.mark.parametrize("kwargs", [{"keep_turns": -1}, {"note_chars": -1}, {"min_stale": 0}, {"min_stale": -2},
                                    {"keep_turns": 1.5}, {"min_stale": True}])
def test_pruner_settings_out_of_range_or_not_ints_are_refused(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=f"{name} must be an int of at least"):
        HeuristicPruner(ScriptedAgent(["<answer id=\"1\">x</answer>"]), **kwargs)
