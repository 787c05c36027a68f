"""Episodes -> training samples: the documented numbers for GRPO, PCAR and DCPO on synthetic records."""

from __future__ import annotations

import math

import pytest
import torch

from rftgym.core.messages import Message
from rftgym.core.records import CONTEXT_FULL, Episode, Turn
from rftgym.train import TrainConfig
from rftgym.train.batching import (build_samples, collate, first_varied_tasks, tokens_covering, turn_spans,
                                   varied_groups)

SQRT_HALF = 1 / math.sqrt(2)  # GRPO advantage of rewards [1, 0]: (1 - 0.5) / std_unbiased(=0.7071)


def episode(turn_specs, *, edit_before=(), success=False) -> Episode:
    """Turns with prefix-consistent token prompts. ``turn_specs``: (sampled length, reward, info).
    A turn listed in ``edit_before`` gets a fresh prompt (a context edit), starting a segment."""
    turns, prompt, token = [], [900, 901], 1
    for index, (length, reward, info) in enumerate(turn_specs):
        if index in edit_before:
            prompt = [950 + index, 951]
        sampled = list(range(token, token + length))
        token += length
        last = index == len(turn_specs) - 1
        turns.append(Turn(index=index, context_ids=(), action="", reward=reward, terminated=last, truncated=False,
                          info={**info, **({"success": success} if last else {})}, prompt_ids=list(prompt),
                          sampled_ids=sampled, logprobs=[-0.5] * length, finish_reason="stop"))
        prompt = prompt + sampled + [902, 903]  # template + tool output before the next turn
    return Episode("test", 0, {"m": Message("user", "q", "m")}, turns, ("m",))


def advantages_by_turn(sample, ep):
    out = {}
    for segment in ep.segments:
        if segment.token_ids == sample.token_ids:
            for turn, start, end in turn_spans(ep, segment):
                values = set(sample.advantages[start:end])
                assert len(values) == 1
                out[turn] = values.pop()
    return out


def test_grpo_gives_every_sampled_token_the_episode_advantage():
    good, bad = episode([(2, 1.0, {})]), episode([(3, 0.0, {})])
    samples, stats = build_samples([[good, bad]], TrainConfig(algo="grpo"))
    assert stats.groups_kept == 1 and len(samples) == 2
    assert samples[0].advantages == pytest.approx([0, 0, SQRT_HALF, SQRT_HALF], abs=1e-5)
    assert samples[1].advantages == pytest.approx([0, 0, -SQRT_HALF, -SQRT_HALF, -SQRT_HALF], abs=1e-5)
    assert samples[0].old_logprobs == [0.0, 0.0, -0.5, -0.5]


def test_batch_stats_count_uniform_groups_and_the_trained_tokens_advantages():
    # Group 1: rewards 1, 0 (advantages +-1/sqrt(2) on 2 and 3 sampled tokens); group 2: 1, 1 (uniform).
    groups = [[episode([(2, 1.0, {})]), episode([(3, 0.0, {})])], [episode([(1, 1.0, {})]), episode([(1, 1.0, {})])]]
    _, stats = build_samples(groups, TrainConfig(algo="grpo"))
    assert (stats.groups, stats.groups_uniform, stats.groups_kept, stats.trained_tokens) == (2, 1, 1, 5)
    assert stats.advantage_sum == pytest.approx(2 * SQRT_HALF - 3 * SQRT_HALF, abs=1e-5)
    assert (stats.advantage_min, stats.advantage_max) == pytest.approx((-SQRT_HALF, SQRT_HALF), abs=1e-5)
    # Kept, the uniform group's two tokens train with advantage 0: in the sum's count, not its value.
    _, kept = build_samples(groups, TrainConfig(algo="grpo", filter_zero_variance=False))
    assert (kept.groups_uniform, kept.trained_tokens, kept.advantage_sum) == (1, 7, pytest.approx(-SQRT_HALF, abs=1e-5))


def test_zero_variance_groups_are_dropped_or_kept_with_zero_advantage():
    group = [episode([(2, 1.0, {})]), episode([(2, 1.0, {})])]
    samples, stats = build_samples([group], TrainConfig(algo="grpo"))
    assert samples == [] and stats.groups_kept == 0
    samples, _ = build_samples([group], TrainConfig(algo="grpo", filter_zero_variance=False))
    assert all(a == 0 for s in samples for a in s.advantages)


def test_varied_groups_are_those_the_zero_variance_filter_keeps():
    groups = [[episode([(2, 1.0, {})]), episode([(2, 1.0, {})])], [episode([(2, 1.0, {})]), episode([(2, 0.0, {})])],
              [episode([(2, 2.0 ** 24, {})]), episode([(2, 2.0 ** 24 + 1, {})])]]
    assert varied_groups(groups) == [False, True, True]
    assert varied_groups([]) == []


def test_the_refill_trains_the_first_varied_tasks_in_the_order_they_were_drawn():
    # Tasks 0-3 in the first rollout, 4-7 in the second, dealt to 2 ranks in turn (rank 0: 0, 2, 4, 6).
    # Tasks 1, 4, 5 and 6 vary, gathered rank by rank ([4, 6] from rank 0, then [1, 5] from rank 1
    # after the second rollout): the first 3 are 1, 4 and 5, as one process drawing them in order trains.
    assert first_varied_tasks([4, 6, 1, 5], 3) == {1, 4, 5}
    assert first_varied_tasks([4, 6, 1, 5], 9) == {1, 4, 5, 6}  # short of the target: all there were
    assert first_varied_tasks([], 2) == set()


def test_rewards_that_differ_only_beyond_float32_are_a_group_with_signal():
    # 2^24 and 2^24 + 1 are one float32 number; in float64 they are a spread of 1: GRPO gives +-1/sqrt(2).
    group = [episode([(2, 2.0 ** 24, {})]), episode([(2, 2.0 ** 24 + 1, {})])]
    samples, stats = build_samples([group], TrainConfig(algo="grpo"))
    assert stats.groups_kept == 1
    assert [s.advantages[-1] for s in samples] == pytest.approx([-SQRT_HALF, SQRT_HALF], abs=1e-5)


def test_overlong_episodes_are_masked_when_asked():
    cut = episode([(2, 0.0, {})])
    cut.turns[-1].finish_reason = "length"
    group = [episode([(2, 1.0, {})]), cut]
    assert len(build_samples([group], TrainConfig(algo="grpo"))[0]) == 2
    samples, stats = build_samples([group], TrainConfig(algo="grpo", filter_overlong=True))
    assert len(samples) == 1 and samples[0].episode == 0 and stats.episodes_masked_overlong == 1


def test_an_episode_that_ran_out_of_context_is_masked_as_overlong_and_its_last_turn_trains_nothing():
    full = episode([(2, 0.0, {})])
    full.turns.append(Turn(index=1, context_ids=(), action="", reward=0.0, terminated=False, truncated=True,
                           info={"context_full": True}, finish_reason=CONTEXT_FULL))  # as the engine records it
    assert full.context_full and full.truncated and len(full.segments) == 1
    group = [episode([(2, 1.0, {})]), full]
    samples, _ = build_samples([group], TrainConfig(algo="grpo"))
    assert [len(s.token_ids) for s in samples] == [4, 4]  # the empty turn adds no tokens
    samples, stats = build_samples([group], TrainConfig(algo="grpo", filter_overlong=True))
    assert len(samples) == 1 and samples[0].episode == 0 and stats.episodes_masked_overlong == 1


@pytest.mark.parametrize("score", [float("nan"), float("inf"), "8", True])
def test_a_process_score_that_is_not_a_finite_number_is_an_env_error(score):
    from rftgym.core.errors import EnvContractError

    good = episode([(2, 0, {"evaluation_score": 8}), (1, 1.0, {})])
    bad = episode([(2, 0, {"evaluation_score": score}), (1, 0.0, {})])
    with pytest.raises(EnvContractError, match=r"test \(seed 0, turn 1\): info\['evaluation_score'\] is"):
        build_samples([[good, bad]], TrainConfig(algo="pcar"))


def test_a_bad_evaluation_end_names_the_episode_and_turn_it_came_from(make_char_policy):
    from rftgym.core.errors import EnvContractError
    from rftgym.train.batching import evaluation_split

    good = episode([(2, 0, {"evaluation_score": 8, "evaluation_end": 1}), (1, 1.0, {})])
    bad = episode([(2, 0, {}), (2, 0.0, {"evaluation_score": 3, "evaluation_end": 9})])
    for turn in good.turns + bad.turns:
        turn.action = "ab"
    with pytest.raises(EnvContractError, match=r"^test \(seed 0, turn 2\): info\['evaluation_end'\] is 9; it is a "
                                               r"character offset into the turn's action, an int in \[0, 2\]$"):
        build_samples([[good, bad]], TrainConfig(algo="pcar"), split_tokens=evaluation_split(make_char_policy()))


def test_a_policy_that_recorded_no_logprobs_is_refused_unless_they_are_recomputed():
    from rftgym.core.errors import AgentError

    blind = episode([(2, 0.0, {})])
    blind.turns[0].logprobs = None
    group = [episode([(2, 1.0, {})], success=True), blind]
    with pytest.raises(AgentError, match=r"recorded no log-probs .* or train with --old-logprobs recompute"):
        build_samples([group], TrainConfig(algo="grpo"))
    assert len(build_samples([group], TrainConfig(algo="grpo", old_logprobs="recompute"))[0]) == 2
    assert len(build_samples([group], TrainConfig(algo="rft"))[0]) == 1  # supervised: no ratio
    # Truncated importance sampling weighs the sampler's log-probs: without them every weight would
    # read the missing ones as 0 and shrink each advantage to the token's probability.
    with pytest.raises(AgentError, match=r"recorded no log-probs .* --rollout-is-cap 2.0 weighs .* drop --rollout-is-cap"):
        build_samples([group], TrainConfig(algo="grpo", old_logprobs="recompute", rollout_is_cap=2.0))


def test_pcar_rescales_each_search_evaluate_span_by_its_standardized_score():
    # Episode 0: search, evaluate(8), search, evaluate(2), answer (reward 1).
    # Episode 1: search, evaluate(5), answer (reward 0).
    # Group scores [8, 2, 5]: mean 5, unbiased std 3, z = [1, -1, 0].
    # lambda 0.5, delta 0.1: factors [1.5, 0.5, 1.0]; A = [+0.7071, -0.7071].
    s = {"evaluation_score": None}  # an explicit None is "no score", like a missing key
    ep0 = episode([(2, 0, {}), (1, 0, {"evaluation_score": 8}), (2, 0, {}), (1, 0, {"evaluation_score": 2}), (1, 1.0, {})])
    ep1 = episode([(2, 0, s), (1, 0, {"evaluation_score": 5}), (1, 0.0, {})])
    samples, _ = build_samples([[ep0, ep1]], TrainConfig(algo="pcar", pcar_lambda=0.5, pcar_delta=0.1))
    assert len(samples) == 2
    by_turn0 = advantages_by_turn(samples[0], ep0)
    assert by_turn0 == pytest.approx({0: 1.5 * SQRT_HALF, 1: 1.5 * SQRT_HALF, 2: 0.5 * SQRT_HALF,
                                      3: 0.5 * SQRT_HALF, 4: SQRT_HALF}, abs=1e-5)
    by_turn1 = advantages_by_turn(samples[1], ep1)
    assert by_turn1 == pytest.approx({0: -SQRT_HALF, 1: -SQRT_HALF, 2: -SQRT_HALF}, abs=1e-5)


def test_pcar_reports_its_spans_and_factors():
    from rftgym.train.step_metrics import pcar_metrics

    # the example above: factors [1.5, 0.5, 1.0] over 3 spans of 2 episodes
    ep0 = episode([(2, 0, {}), (1, 0, {"evaluation_score": 8}), (2, 0, {}), (1, 0, {"evaluation_score": 2}), (1, 1.0, {})])
    ep1 = episode([(2, 0, {}), (1, 0, {"evaluation_score": 5}), (1, 0.0, {})])
    _, stats = build_samples([[ep0, ep1]], TrainConfig(algo="pcar", pcar_lambda=0.5, pcar_delta=0.1))
    assert stats.pcar_spans == 3 and stats.pcar_factor_sum == pytest.approx(3.0)
    assert stats.pcar_factor_sq_sum == pytest.approx(1.5 ** 2 + 0.5 ** 2 + 1.0)
    metrics = pcar_metrics([stats.pcar_spans, stats.pcar_factor_sum, stats.pcar_factor_sq_sum], 2)
    assert metrics == pytest.approx({"pcar_scores_per_episode": 1.5, "pcar_factor_mean": 1.0,
                                     "pcar_factor_std": (1 / 6) ** 0.5})  # population std of [1.5, 0.5, 1]
    assert pcar_metrics([0, 0.0, 0.0], 4) == {"pcar_scores_per_episode": 0.0, "pcar_factor_mean": 1.0,
                                              "pcar_factor_std": 0.0}
    # no group kept: nothing trained, so nothing to report (not the numbers of a step trained as GRPO)
    assert pcar_metrics([0, 0.0, 0.0], 0) == {"pcar_scores_per_episode": None, "pcar_factor_mean": None,
                                              "pcar_factor_std": None}
    _, grpo = build_samples([[ep0, ep1]], TrainConfig(algo="grpo"))
    assert grpo.pcar_spans == 0


def test_pcar_standardizes_over_the_whole_group_even_when_an_episode_is_masked_overlong():
    # As DAPO masks a truncated sample's loss but keeps its reward in the group's baseline, an
    # overlong-masked episode's evaluation scores stay in the group's standardization: episode 0
    # gets the factors of scores [8, 2, 5] (z = [1, -1, 0]) whether or not episode 1 is trained.
    ep0 = episode([(2, 0, {}), (1, 0, {"evaluation_score": 8}), (2, 0, {}), (1, 0, {"evaluation_score": 2}), (1, 1.0, {})])
    ep1 = episode([(2, 0, {}), (1, 0, {"evaluation_score": 5}), (1, 0.0, {})])
    ep1.turns[-1].finish_reason = "length"
    samples, stats = build_samples([[ep0, ep1]], TrainConfig(algo="pcar", pcar_lambda=0.5, pcar_delta=0.1,
                                                             filter_overlong=True))
    assert len(samples) == 1 and stats.episodes_masked_overlong == 1
    assert advantages_by_turn(samples[0], ep0) == pytest.approx(
        {0: 1.5 * SQRT_HALF, 1: 1.5 * SQRT_HALF, 2: 0.5 * SQRT_HALF, 3: 0.5 * SQRT_HALF, 4: SQRT_HALF}, abs=1e-5)


def test_pcar_clamps_the_factor_at_delta():
    # Scores [10, 0, 5]: z = [1, -1, 0] again (std 5); lambda 2 -> factors [3, clamp(-1, 0.1) = 0.1, 1].
    ep0 = episode([(1, 0, {"evaluation_score": 10}), (1, 0, {"evaluation_score": 0}), (1, 1.0, {})])
    ep1 = episode([(1, 0, {"evaluation_score": 5}), (1, 0.0, {})])
    samples, _ = build_samples([[ep0, ep1]], TrainConfig(algo="pcar", pcar_lambda=2.0, pcar_delta=0.1))
    assert advantages_by_turn(samples[0], ep0) == pytest.approx({0: 3 * SQRT_HALF, 1: 0.1 * SQRT_HALF, 2: SQRT_HALF}, abs=1e-5)


def test_tokens_covering_by_hand():
    pieces = {1: "<evaluate>", 2: "score: 8", 3: "</evalu", 4: "ate>", 5: "<search>", 6: "x", 7: "</search>"}
    decode = lambda ids: "".join(pieces[i] for i in ids)  # noqa: E731
    text = decode(list(pieces))
    end = text.index("</evaluate>") + len("</evaluate>")  # 29 characters: tokens 1-4
    assert tokens_covering(decode, list(pieces), end) == 4
    assert tokens_covering(decode, list(pieces), end - 1) == 4  # inside token 4
    assert tokens_covering(decode, list(pieces), 0) == 0
    assert tokens_covering(decode, list(pieces), len(text) + 5) == 7


def test_pcar_splits_a_turn_that_evaluates_then_searches():
    # Episode 0: t0 search (2 tokens); t1 = evaluate(8) [2 tokens] + search [2 tokens];
    #            t2 = evaluate(2) [1 token] + answer [2 tokens] (reward 1).
    # Episode 1: t0 search; t1 evaluate(5) + answer (reward 0), split after 1 of its 2 tokens.
    # Scores [8, 2, 5] -> z [1, -1, 0] -> factors (lambda 0.5) [1.5, 0.5, 1.0]; A = +-0.7071.
    # Span 1 of episode 0 is t0 and t1's first 2 tokens; span 2 is t1's last 2 tokens (the query
    # the next evaluation rates) and t2's first token; t2's answer comes after every span: plain A.
    a = SQRT_HALF
    ep0 = episode([(2, 0, {}), (4, 0, {"evaluation_score": 8, "split": 2}),
                   (3, 1.0, {"evaluation_score": 2, "split": 1})])
    ep1 = episode([(2, 0, {}), (2, 0.0, {"evaluation_score": 5, "split": 1})])
    config = TrainConfig(algo="pcar", pcar_lambda=0.5, pcar_delta=0.1)
    samples, _ = build_samples([[ep0, ep1]], config, split_tokens=lambda turn: turn.info.get("split"))
    sampled0 = [v for v, m in zip(samples[0].advantages, samples[0].loss_mask) if m]
    assert sampled0 == pytest.approx([1.5 * a, 1.5 * a, 1.5 * a, 1.5 * a, 0.5 * a, 0.5 * a, 0.5 * a, a, a], abs=1e-5)
    sampled1 = [v for v, m in zip(samples[1].advantages, samples[1].loss_mask) if m]
    assert sampled1 == pytest.approx([-a, -a, -a, -a], abs=1e-5)  # factor 1.0 everywhere
    # Without a split function (or with a split at 0 or at the end) a scored turn closes its span whole.
    whole, _ = build_samples([[ep0, ep1]], config)
    assert advantages_by_turn(whole[0], ep0) == pytest.approx({0: 1.5 * a, 1: 1.5 * a, 2: 0.5 * a}, abs=1e-5)
    edge, _ = build_samples([[ep0, ep1]], config, split_tokens=lambda turn: len(turn.sampled_ids))
    assert advantages_by_turn(edge[0], ep0) == pytest.approx({0: 1.5 * a, 1: 1.5 * a, 2: 0.5 * a}, abs=1e-5)


def test_dcpo_broadcasts_the_trajectory_advantage_to_each_segment():
    edited = episode([(2, 0, {}), (2, 0, {}), (1, 1.0, {})], edit_before={2})  # segments: turns (0, 1) and (2,)
    plain = episode([(2, 0.0, {})])
    assert [s.turn_indices for s in edited.segments] == [(0, 1), (2,)]
    samples, _ = build_samples([[edited, plain]], TrainConfig(algo="dcpo"))
    assert [(s.episode, sum(s.loss_mask)) for s in samples] == [(0, 4), (0, 1), (1, 2)]
    for sample, expected in zip(samples, [SQRT_HALF, SQRT_HALF, -SQRT_HALF]):
        trained = [a for a, m in zip(sample.advantages, sample.loss_mask) if m]
        assert trained == pytest.approx([expected] * len(trained), abs=1e-5)
    # Each trajectory counts once: the advantage is the same as if the edited one had one segment.
    unedited = episode([(2, 0, {}), (2, 0, {}), (1, 1.0, {})])
    same, _ = build_samples([[unedited, plain]], TrainConfig(algo="dcpo"))
    assert max(same[0].advantages) == pytest.approx(SQRT_HALF, abs=1e-5)
    # The second segment's prompt (mask 0) holds no earlier sampled turn that would be trained again.
    second = samples[1]
    assert second.loss_mask[: len(edited.turns[2].prompt_ids)] == [0] * len(edited.turns[2].prompt_ids)


def test_dcpo_budget_takes_one_segment_per_trajectory_first():
    edited = episode([(2, 0, {}), (2, 0, {}), (1, 1.0, {})], edit_before={1, 2})  # three segments
    plain = episode([(2, 0.0, {})])
    samples, _ = build_samples([[edited, plain]], TrainConfig(algo="dcpo", dcpo_segment_budget=2),
                               torch.Generator().manual_seed(0))
    assert sorted(s.episode for s in samples) == [0, 1]


def test_dcpo_budget_goes_to_segments_with_sampled_tokens():
    # Episode 0's first segment sampled nothing (a custom token-level agent may return an empty
    # reply); with a budget of 1 per trajectory's coverage it must not take a slot: the picks
    # are episode 0's second segment and episode 1's only one, whatever the draw.
    empty_first = episode([(0, 0, {}), (2, 1.0, {})], edit_before={1})
    plain = episode([(2, 0.0, {})])
    assert [s.num_sampled for s in empty_first.segments] == [0, 2]
    for seed in range(8):
        samples, _ = build_samples([[empty_first, plain]], TrainConfig(algo="dcpo", dcpo_segment_budget=2),
                                   torch.Generator().manual_seed(seed))
        assert sorted((s.episode, sum(s.loss_mask)) for s in samples) == [(0, 2), (1, 2)]


def test_rft_keeps_only_successful_episodes():
    win = episode([(2, 1.0, {})], success=True)
    loss = episode([(2, 0.0, {})])
    samples, _ = build_samples([[win, loss]], TrainConfig(algo="rft"))
    assert [s.episode for s in samples] == [0] and samples[0].advantages == [0, 0, 1.0, 1.0]


def test_collate_shifts_targets_and_masks_by_one():
    good, bad = episode([(2, 1.0, {})]), episode([(3, 0.0, {})])
    samples, _ = build_samples([[good, bad]], TrainConfig(algo="grpo"))
    batch = collate(samples, pad_id=0)
    assert batch["input_ids"][0].tolist() == [900, 901, 1, 2, 0]
    assert batch["targets"][0].tolist() == [901, 1, 2, 0]
    assert batch["loss_mask"][0].tolist() == [0, 1, 1, 0]
    # Flat positions with loss_mask 1, over [2 rows, 4 positions]: the update computes only these.
    assert batch["trained_index"].tolist() == [i for i, m in enumerate(batch["loss_mask"].reshape(-1)) if m]
    assert batch["trained_index"].tolist() == [1, 2, 5, 6, 7]
    assert batch["attention_mask"][0].tolist() == [1, 1, 1, 1, 0]
    assert batch["advantages"][1].tolist() == pytest.approx([0, -SQRT_HALF, -SQRT_HALF, -SQRT_HALF], abs=1e-5)
