"""PCAR's Search->Evaluate spans when an evaluation is missing, and its factors on odd scores.

A span whose search was never evaluated (skipped, unreadable) keeps the plain advantage (factor
1), stays apart from the spans around it, and takes no part in the group's standardization.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import gymnasium as gym
import pytest
import torch

import rftgym  # noqa: F401 (registers the envs)
from rftgym.agents.base import AgentReply
from rftgym.agents.scripted import ScriptedAgent
from rftgym.core.messages import Message
from rftgym.core.records import Episode, Turn
from rftgym.rollout.engine import run_episodes
from rftgym.train import TrainConfig
from rftgym.train.advantages import pcar_factors, pcar_segment_advantages
from rftgym.train.batching import build_samples, turn_spans

A = 1 / math.sqrt(2)  # GRPO advantage of rewards [1, 0] (or [0, 1]): 0.5 / 0.7071


def episode(turn_specs) -> Episode:
    """Prefix-consistent token turns from (sampled length, reward, info) specs."""
    turns, prompt, token = [], [900, 901], 1
    for index, (length, reward, info) in enumerate(turn_specs):
        sampled = list(range(token, token + length))
        token += length
        last = index == len(turn_specs) - 1
        turns.append(Turn(index=index, context_ids=(), action="", reward=reward, terminated=last, truncated=False,
                          info=dict(info), prompt_ids=list(prompt), sampled_ids=sampled, logprobs=[-0.5] * length,
                          finish_reason="stop"))
        prompt = prompt + sampled + [902, 903]
    return Episode("test", 0, {"m": Message("user", "q", "m")}, turns, ("m",))


def factor_by_turn(sample, ep: Episode, advantage: float) -> dict[int, float]:
    """Each turn's advantage over the episode's plain one (every token of a turn alike)."""
    (segment,) = ep.segments
    out = {}
    for turn, start, end in turn_spans(ep, segment):
        values = {round(v / advantage, 4) for v in sample.advantages[start:end]}
        assert len(values) == 1, (turn, values)
        out[turn] = values.pop()
    return out


def rounded(tensors) -> list[list[float]]:
    return [[round(x, 5) for x in t.tolist()] for t in tensors]


def test_pcar_factors_give_an_unscored_segment_1_and_leave_it_out_of_the_statistics():
    # Scored: [8, 2, 5] -> mean 5, unbiased std 3, z = [1, -1, 0]; lambda 0.5 -> [1.5, 0.5, 1.0].
    # The None segment between 8 and 2 gets exactly 1 (were it counted as 0, the scores [8, 0, 2, 5]
    # would have mean 3.75 and every factor would move).
    factors = pcar_factors([[8, None, 2], [5], [None]], lam=0.5, delta=0.1)
    assert rounded(factors) == [[1.5, 1.0, 0.5], [1.0], [1.0]]
    out = pcar_segment_advantages(torch.tensor([1.0, -1.0, 0.5]), [[8, None, 2], [5], [None]], lam=0.5, delta=0.1)
    assert rounded(out) == [[1.5, 1.0, 0.5], [-1.0], [0.5]]
    # Only one scored segment in the group: nothing to compare it with, z = 0, every factor 1.
    assert rounded(pcar_factors([[None, 9], [None]], lam=2.0, delta=0.1)) == [[1.0, 1.0], [1.0]]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "8", True, 10 ** 400])
def test_pcar_factors_refuse_a_score_that_is_not_a_finite_number(bad):
    # Before: NaN made the group's max/min comparison false, so PCAR silently gave every factor 1;
    # a string was read as a number.
    with pytest.raises(ValueError, match="segment scores must be finite numbers"):
        pcar_factors([[8.0, bad], [5.0]], lam=0.5, delta=0.1)
    with pytest.raises(ValueError, match="segment scores must be finite numbers"):
        pcar_factors([torch.tensor([8.0, float("nan")])], lam=0.5, delta=0.1)


def test_pcar_factors_do_not_overflow_on_huge_scores_and_ignore_scale_and_sign():
    # z is the same for [8, 2, 5], [-2, -8, -5] (shifted) and [8e300, 2e300, 5e300] (scaled):
    # [1, -1, 0], factors [1.5, 0.5, 1.0]. In float32, 8e300 was inf and every factor NaN.
    for scores in ([[8.0, 2.0], [5.0]], [[-2.0, -8.0], [-5.0]], [[8e300, 2e300], [5e300]], [[8e38, 2e38], [5e38]]):
        factors = pcar_factors(scores, lam=0.5, delta=0.1)
        assert rounded(factors) == [[1.5, 0.5], [1.0]], scores


def test_a_skipped_evaluation_keeps_its_span_apart_with_the_plain_advantage():
    # Episode 0 (reward 1): t0 searches q1; t1 searches q2 without evaluating q1 (double search);
    #   t2 evaluates q2 (8); t3 searches q3; t4 evaluates it (2); t5 answers.
    # Episode 1 (reward 0): t0 searches; t1 evaluates (5); t2 answers.
    # Scores of the group: [8, 2, 5] (q1 has none) -> z [1, -1, 0] -> factors (lambda 0.5) [1.5, 0.5, 1].
    # Spans of episode 0: {t0} unscored -> 1; {t1, t2} -> 1.5; {t3, t4} -> 0.5; {t5} after the last -> 1.
    # Before, t0 joined the next scored span and took its 1.5.
    ep0 = episode([(2, 0, {"query": "q1"}), (3, 0, {"query": "q2"}), (1, 0, {"evaluation_score": 8}),
                   (2, 0, {"query": "q3"}), (1, 0, {"evaluation_score": 2}), (1, 1.0, {})])
    ep1 = episode([(2, 0, {"query": "q"}), (1, 0, {"evaluation_score": 5}), (1, 0.0, {})])
    samples, stats = build_samples([[ep0, ep1]], TrainConfig(algo="pcar", pcar_lambda=0.5, pcar_delta=0.1))
    assert factor_by_turn(samples[0], ep0, A) == {0: 1.0, 1: 1.5, 2: 1.5, 3: 0.5, 4: 0.5, 5: 1.0}
    assert factor_by_turn(samples[1], ep1, -A) == {0: 1.0, 1: 1.0, 2: 1.0}
    # The step's statistics count the three scored spans only: factors [1.5, 0.5, 1].
    assert stats.pcar_spans == 3 and stats.pcar_factor_sum == pytest.approx(3.0)
    assert stats.pcar_factor_sq_sum == pytest.approx(1.5 ** 2 + 0.5 ** 2 + 1.0)


def test_an_evaluation_skipped_without_a_new_search_ends_its_span_at_the_next_search():
    # t0 searches q1; t1 neither evaluates nor searches (q1's evaluation is skipped: the env takes
    # one only right after the search); t2 searches q2; t3 evaluates q2 (9). Episode 1: t0
    # searches, t1 evaluates (3).
    # Scores [9, 3]: mean 6, unbiased std 4.2426, z [+0.7071, -0.7071]; lambda 1 -> [1.7071, 0.2929].
    # Episode 0's spans: {t0, t1} unscored -> 1; {t2, t3} -> 1.7071. Rewards [1, 0]: A = +-0.7071.
    ep0 = episode([(2, 0, {"query": "q1"}), (1, 0, {}), (2, 0, {"query": "q2"}), (1, 1.0, {"evaluation_score": 9})])
    ep1 = episode([(2, 0, {"query": "q"}), (1, 0.0, {"evaluation_score": 3})])
    samples, _ = build_samples([[ep0, ep1]], TrainConfig(algo="pcar", pcar_lambda=1.0, pcar_delta=0.1))
    assert factor_by_turn(samples[0], ep0, A) == {0: 1.0, 1: 1.0, 2: round(1 + A, 4), 3: round(1 + A, 4)}
    assert factor_by_turn(samples[1], ep1, -A) == {0: round(1 - A, 4), 1: round(1 - A, 4)}


def test_an_unreadable_evaluation_before_a_new_search_is_cut_where_the_evaluation_ends():
    # t0 searches q1; t1 = a malformed evaluation of q1 [2 tokens] + a search for q2 [2 tokens];
    # t2 evaluates q2 (8) and answers. Episode 1: t0 searches, t1 evaluates (2) and answers.
    # Scores [8, 2]: z [0.7071, -0.7071]; lambda 1 -> [1.7071, 0.2929]. A = +-0.7071.
    # With the evaluation's end (2 tokens): q1's span {t0, t1[:2]} is unscored -> 1; q2's span
    # {t1[2:], t2} -> 1.7071. Without it, t1 opens q2's span whole.
    ep0 = episode([(2, 0, {"query": "q1"}), (4, 0, {"query": "q2", "split": 2}), (2, 1.0, {"evaluation_score": 8})])
    ep1 = episode([(2, 0, {"query": "q"}), (2, 0.0, {"evaluation_score": 2})])
    config = TrainConfig(algo="pcar", pcar_lambda=1.0, pcar_delta=0.1)
    samples, _ = build_samples([[ep0, ep1]], config, split_tokens=lambda turn: turn.info.get("split"))
    trained = [round(v / A, 4) for v, m in zip(samples[0].advantages, samples[0].loss_mask) if m]
    assert trained == [1.0, 1.0, 1.0, 1.0] + [round(1 + A, 4)] * 4
    whole, _ = build_samples([[ep0, ep1]], config)
    assert factor_by_turn(whole[0], ep0, A) == {0: 1.0, 1: round(1 + A, 4), 2: round(1 + A, 4)}


def test_a_group_of_one_episode_or_of_equal_scores_trains_without_nan():
    # A group of one episode (the config asks for 2 or more; a caller may still hand one over):
    # GRPO's advantage is 0 (no spread to compare against), so every token gets 0.
    single = episode([(2, 0, {"query": "q"}), (1, 1.0, {"evaluation_score": 7})])
    samples, _ = build_samples([[single]], TrainConfig(algo="pcar", filter_zero_variance=False))
    assert all(a == 0.0 for a in samples[0].advantages)
    # Equal scores (with an unscored span beside them): z = 0, every factor 1, plain GRPO.
    ep0 = episode([(2, 0, {"query": "q1"}), (1, 0, {"query": "q2"}), (1, 1.0, {"evaluation_score": 4})])
    ep1 = episode([(2, 0, {"query": "q"}), (1, 0.0, {"evaluation_score": 4})])
    samples, stats = build_samples([[ep0, ep1]], TrainConfig(algo="pcar", pcar_lambda=1.0))
    assert factor_by_turn(samples[0], ep0, A) == {0: 1.0, 1: 1.0, 2: 1.0}
    assert stats.pcar_spans == 2 and stats.pcar_factor_sum == 2.0


# ------------------------------------------------------------------ a real SearchEvalQA episode

BOS, SEP, EOT = 1, 2, 3  # message start, role/content separator, end of turn


def encode(text: str) -> list[int]:
    return [ord(c) + 10 for c in text]


def decode_reply(ids: list[int]) -> str:
    return "".join(chr(i - 10) for i in ids if i != EOT)


def render(context) -> list[int]:
    """A context's prompt: each message as BOS role SEP content EOT, then BOS assistant SEP."""
    ids = []
    for message in context:
        ids += [BOS, *encode(message.role), SEP, *encode(message.content), EOT]
    return ids + [BOS, *encode("assistant"), SEP]


class CharTokenAgent(ScriptedAgent):
    """Scripted replies, recorded as a token-level policy would: one token per character, the
    reply closed by its end-of-turn token, prompts that extend each other by prefix."""

    token_level = True

    def act(self, contexts):
        replies = super().act(contexts)
        return [AgentReply(r.text, prompt_ids=render(c), sampled_ids=encode(r.text) + [EOT],
                           logprobs=[-1.0] * (len(r.text) + 1), finish_reason="stop")
                for r, c in zip(replies, contexts)]

    def assistant_span(self, message, reply):
        return tuple(reply.sampled_ids)


def test_a_real_searchevalqa_episode_with_a_skipped_evaluation_gets_the_right_factor_per_token():
    from rftgym.train.batching import evaluation_split

    make_env = lambda: gym.make("rftgym/SearchEvalQA-v0")  # noqa: E731
    probe = make_env()
    probe.reset(seed=0)
    gold = probe.unwrapped.question.answers[0]
    probe.close()
    skipping = ["<search>alpha</search>",                                            # q1
                "<search>beta</search>",                                             # q2: q1 never evaluated
                "<evaluate>score: 8 found it</evaluate><search>gamma</search>",     # rates q2, searches q3
                f"<evaluate>score: 2 nothing new</evaluate><answer>{gold}</answer>"]  # rates q3, answers
    keeping = ["<search>delta</search>", f"<evaluate>score: 5 partial</evaluate><answer>{gold}</answer>"]
    (ep0,) = run_episodes(make_env, CharTokenAgent(skipping), [0])
    (ep1,) = run_episodes(make_env, CharTokenAgent(keeping), [0])
    assert [t.info["protocol_violation"] for t in ep0.turns] == [None, "double_search", None, None]
    assert (ep0.total_reward, ep1.total_reward) == (0.0, 1.0)  # the violation gates episode 0's reward
    assert len(ep0.segments) == len(ep1.segments) == 1

    # Scores [8, 2] and [5]: z [1, -1, 0], factors (lambda 0.5) [1.5, 0.5, 1]; A = [-0.7071, +0.7071].
    policy = SimpleNamespace(chat=SimpleNamespace(decode_reply=decode_reply))
    samples, stats = build_samples([[ep0, ep1]], TrainConfig(algo="pcar", pcar_lambda=0.5, pcar_delta=0.1),
                                   split_tokens=evaluation_split(policy))
    assert stats.pcar_spans == 3

    def factors_of(sample, ep, advantage):
        """Per turn, the action's text cut where the factor changes, with each piece's factor."""
        (segment,) = ep.segments
        pieces = []
        for (index, start, end), turn in zip(turn_spans(ep, segment), ep.turns):
            values = [round(v / advantage, 4) for v in sample.advantages[start:end]]
            text = turn.action + "$"  # the end-of-turn token
            runs, first = [], 0
            for i in range(1, len(values) + 1):
                if i == len(values) or values[i] != values[first]:
                    runs.append((text[first:i], values[first]))
                    first = i
            pieces.append(runs)
        return pieces

    assert factors_of(samples[0], ep0, -A) == [
        [("<search>alpha</search>$", 1.0)],  # q1's span, never evaluated: plain (before: 1.5)
        [("<search>beta</search>$", 1.5)],  # q2's span ...
        [("<evaluate>score: 8 found it</evaluate>", 1.5), ("<search>gamma</search>$", 0.5)],  # ... and q3's
        [("<evaluate>score: 2 nothing new</evaluate>", 0.5), (f"<answer>{gold}</answer>$", 1.0)],
    ]
    assert factors_of(samples[1], ep1, A) == [
        [("<search>delta</search>$", 1.0)],
        [(f"<evaluate>score: 5 partial</evaluate><answer>{gold}</answer>$", 1.0)],  # 5 is the mean: z = 0
    ]
