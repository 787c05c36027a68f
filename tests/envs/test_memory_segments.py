"""MemoryQA episodes through the rollout recorder: k prunes give k + 1 segments, each opening with
exactly the edited context the model saw (mask 0), its generated tokens mask 1."""

from __future__ import annotations

from typing import Sequence

import pytest

import rftgym  # noqa: F401
from rftgym.agents.base import Agent, AgentReply
from rftgym.agents.memory_baselines import HeuristicPruner, WorldOracleAgent
from rftgym.core.messages import Context
from rftgym.envs.memory.budget import policy_token_counter
from rftgym.envs.memory.env import MemoryQAEnv
from rftgym.envs.search.world import World
from rftgym.rollout import run_episodes


class TeacherForcedAgent(Agent):
    """A scripted agent that speaks in tokens: the script's text, tokenized with the policy's chat
    tokenizer plus the stop token, as if the policy had sampled it."""

    token_level = True

    def __init__(self, script: Agent, chat):
        self.script, self.chat = script, chat
        self.name = f"forced-{script.name}"

    def act(self, contexts: Sequence[Context]) -> list[AgentReply]:
        return self.act_tokens(contexts, [{}] * len(contexts))

    def act_tokens(self, contexts, sampled_spans) -> list[AgentReply]:
        out = []
        for context, spans, reply in zip(contexts, sampled_spans, self.script.act(contexts)):
            sampled = self.chat._encode(reply.text) + [self.chat.stop_ids[0]]
            out.append(AgentReply(reply.text, self.chat.prompt_ids(context, spans), sampled,
                                  [-0.5] * len(sampled), "stop"))
        return out

    def assistant_span(self, message, reply):
        return self.chat.assistant_span(message, reply.sampled_ids)


def episode_spans(chat, episode):
    """The exact assistant spans the engine kept for the episode (as in tests/rollout)."""
    return {t.message_id: chat.assistant_span(episode.messages[t.message_id], t.sampled_ids)
            for t in episode.turns if t.message_id is not None}


@pytest.mark.parametrize("seed", [0, 1])
def test_k_prunes_make_k_plus_one_segments_with_exact_prompts(tiny_policy, seed):
    world = World(0, 30)
    script = HeuristicPruner(WorldOracleAgent(world), keep_turns=1, min_stale=2)
    agent = TeacherForcedAgent(script, tiny_policy.chat)
    counter = policy_token_counter(tiny_policy)

    def make_env():
        return MemoryQAEnv(world_size=30, objectives=3, hops=(2, 3), count_tokens=counter, max_context_tokens=None)

    episode = run_episodes(make_env, agent, seeds=[seed])[0]
    final = episode.turns[-1].info
    k = final["prunes"]
    assert k >= 2 and final["success"] and episode.terminated
    prune_turns = [t.index for t in episode.turns if t.info["pruned"]]
    assert len(prune_turns) == k
    segments = episode.segments
    spans = episode_spans(tiny_policy.chat, episode)
    assert len(segments) == k + 1
    # A new segment starts on the turn right after each prune: its context is the edited one.
    assert [s.turn_indices[0] for s in segments] == [0] + [i + 1 for i in prune_turns]
    assert sorted(i for s in segments for i in s.turn_indices) == list(range(len(episode.turns)))
    for segment in segments:
        first = episode.turns[segment.turn_indices[0]]
        context = episode.context(first.index)
        prompt = tiny_policy.chat.prompt_ids(context, spans)
        assert segment.token_ids[: segment.prompt_length] == prompt == first.prompt_ids
        assert segment.loss_mask[: segment.prompt_length] == [0] * len(prompt)
        # Mask 1 is exactly the generated tokens of the segment's turns, in order.
        sampled = [t for t, m in zip(segment.token_ids, segment.loss_mask) if m]
        assert sampled == [x for i in segment.turn_indices for x in episode.turns[i].sampled_ids]
        assert segment.num_sampled == sum(len(episode.turns[i].sampled_ids) for i in segment.turn_indices)
    for turn in episode.turns:
        # The env's own count, with the policy's tokenizer, is the prompt the policy was fed (its
        # turns here are canonical tokenizations, so counting them by text is exact).
        assert turn.info["context_tokens"] == len(turn.prompt_ids)
    # The edited context really lacks the pruned results (and holds the note).
    after = episode.context(prune_turns[0] + 1)
    pruned = episode.turns[prune_turns[0]].info["pruned"][0]
    assert not set(pruned["message_ids"]) & set(after.ids)
    assert after[-1].content.startswith(f"[memory {pruned['note_id']}]") or any(
        m.content.startswith(f"[memory {pruned['note_id']}]") for m in after)


def test_tiny_policy_rollout_runs_and_records(tiny_policy):
    """The real (tiny, random) policy on the env, also wrapped by the heuristic pruner: never
    crashes, tokens recorded for the policy's own turns, the budget counted with its tokenizer."""
    counter = policy_token_counter(tiny_policy)
    for agent in (tiny_policy, HeuristicPruner(tiny_policy, keep_turns=0, min_stale=1)):
        episodes = run_episodes(lambda: MemoryQAEnv(world_size=30, max_turns=3, count_tokens=counter),
                                agent, seeds=[0, 1])
        for episode in episodes:
            assert episode.segments
            assert all(t.has_tokens == (t.finish_reason != "heuristic_prune") for t in episode.turns)
            # Counted by text, earlier sampled turns may count differently from what was fed (a
            # random model's 12 sampled newlines retokenize as fewer tokens), by at most their length.
            for t in episode.turns:
                if t.has_tokens:
                    slack = sum(len(u.sampled_ids or ()) + 2 for u in episode.turns[: t.index])
                    assert abs(t.info["context_tokens"] - len(t.prompt_ids)) <= slack
            assert episode.turns[0].info["context_tokens"] == len(episode.turns[0].prompt_ids)


def test_an_env_counting_the_policys_tokens_can_be_pickled(tiny_policy):
    import pickle

    env = MemoryQAEnv(world_size=30, count_tokens=policy_token_counter(tiny_policy))
    obs, info = env.reset(seed=3)
    copy = pickle.loads(pickle.dumps(env))
    assert copy.count_tokens(obs) == env.count_tokens(obs) == info["observation_tokens"]
