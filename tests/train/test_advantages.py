"""Advantage estimators against numbers computed by hand (the arithmetic is in the comments)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rftgym.core.errors import ConfigError
from rftgym.train.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    dcpo_segment_advantages,
    dr_grpo_advantages,
    grpo_advantages,
    overlong_mask,
    pcar_segment_advantages,
    rloo_advantages,
    sample_segments,
    zero_variance_groups,
)


def close(actual, expected, atol=1e-5):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.allclose(actual, expected, atol=atol, rtol=0), (actual, expected)


# --- GRPO ------------------------------------------------------------------------------------

def test_grpo_binary_group():
    # [1, 0, 0, 1]: mean 0.5, deviations +-0.5, sum of squares 4 * 0.25 = 1,
    # unbiased variance 1 / (4 - 1) = 1/3, std = 1/sqrt(3) = 0.57735.
    # A = +-0.5 * sqrt(3) = +-sqrt(3)/2 = +-0.866025
    a = math.sqrt(3) / 2
    close(grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]])), [[a, -a, -a, a]])


def test_grpo_two_groups_one_with_zero_variance():
    # [1, 2, 3]: mean 2, deviations -1, 0, 1, variance (1 + 0 + 1) / 2 = 1, std 1 -> A = [-1, 0, 1].
    # [5, 5, 5]: deviations 0 -> 0 / (0 + eps) = 0 (not NaN).
    out = grpo_advantages(torch.tensor([[1.0, 2.0, 3.0], [5.0, 5.0, 5.0]]))
    close(out, [[-1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])


@pytest.mark.parametrize("value, size", [(12.3, 8), (100.1, 8), (0.7, 8), (0.1, 7)])
@pytest.mark.parametrize("estimator", [grpo_advantages, dr_grpo_advantages, rloo_advantages])
def test_equal_rewards_that_float32_cannot_hold_give_exactly_zero(estimator, value, size):
    # float32's mean of eight 12.3s is a rounding step off 12.3; GRPO divided that step by the
    # equally tiny std and gave the whole group -0.472. Equal rewards mean no signal: exactly 0.
    out = estimator(torch.full((1, size), value, dtype=torch.float32))
    assert out.dtype == torch.float32 and torch.equal(out, torch.zeros(1, size)), out


def test_grpo_keeps_real_small_differences():
    # [12.3, 12.3, 12.4]: mean 12.3333, deviations -1/30, -1/30, 2/30, variance (1+1+4)/900/2 =
    # 1/300, std 0.057735 -> A = [-0.57735, -0.57735, 1.15470]
    close(grpo_advantages(torch.tensor([[12.3, 12.3, 12.4]])), [[-0.57735, -0.57735, 1.15470]], atol=1e-4)


@pytest.mark.parametrize("estimator", [grpo_advantages, dr_grpo_advantages, rloo_advantages, zero_variance_groups])
def test_non_finite_rewards_are_refused(estimator):
    with pytest.raises(ValueError, match=r"rewards must be finite; got \[nan\]"):
        estimator(torch.tensor([[1.0, float("nan")], [0.0, 1.0]]))


def test_grpo_group_size_one_is_zero_not_nan():
    out = grpo_advantages(torch.tensor([[3.0], [7.0]]))
    close(out, [[0.0], [0.0]])
    assert not out.isnan().any()


def test_grpo_integer_rewards_become_float():
    out = grpo_advantages(torch.tensor([[1, 2, 3]]))
    assert out.is_floating_point()
    close(out, [[-1.0, 0.0, 1.0]])


def test_rewards_must_be_2d():
    with pytest.raises(ValueError, match="num_groups, group_size"):
        grpo_advantages(torch.tensor([1.0, 0.0]))


# --- Dr.GRPO ---------------------------------------------------------------------------------

def test_dr_grpo_subtracts_the_mean_only():
    # [1, 2, 3] - 2 = [-1, 0, 1]; [1, 0, 0, 1] - 0.5 = [0.5, -0.5, -0.5, 0.5]; [2, 4] - 3 = [-1, 1]
    close(dr_grpo_advantages(torch.tensor([[1.0, 2.0, 3.0]])), [[-1.0, 0.0, 1.0]])
    close(dr_grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]])), [[0.5, -0.5, -0.5, 0.5]])
    # [2, 4] - 3 = [-1, 1] and [0, 10] - 5 = [-5, 5]: no division by the std (GRPO would give +-0.707 for both)
    close(dr_grpo_advantages(torch.tensor([[2.0, 4.0], [0.0, 10.0]])), [[-1.0, 1.0], [-5.0, 5.0]])


# --- RLOO ------------------------------------------------------------------------------------

def test_rloo_binary_group():
    # r_1 = 1, others (0, 0, 1), mean 1/3 -> 1 - 1/3 = 2/3
    # r_2 = 0, others (1, 0, 1), mean 2/3 -> 0 - 2/3 = -2/3 (same for r_3, and r_4 like r_1)
    t = 2 / 3
    close(rloo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]])), [[t, -t, -t, t]])


def test_rloo_three_rewards():
    # 1 - (2 + 3)/2 = -1.5;  2 - (1 + 3)/2 = 0;  3 - (1 + 2)/2 = 1.5
    close(rloo_advantages(torch.tensor([[1.0, 2.0, 3.0]])), [[-1.5, 0.0, 1.5]])


def test_rloo_group_size_one_is_zero():
    close(rloo_advantages(torch.tensor([[4.0]])), [[0.0]])


# --- table -----------------------------------------------------------------------------------

def test_compute_advantages_by_name():
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "dr_grpo", "rloo"}
    rewards = torch.tensor([[1.0, 2.0, 3.0]])
    close(compute_advantages("rloo", rewards), [[-1.5, 0.0, 1.5]])
    close(compute_advantages("dr_grpo", rewards), [[-1.0, 0.0, 1.0]])
    # eps is forwarded: (3 - 2) / (1 + 1) = 0.5
    close(compute_advantages("grpo", rewards, eps=1.0), [[-0.5, 0.0, 0.5]])


def test_compute_advantages_unknown_name_lists_choices():
    with pytest.raises(ConfigError, match="dr_grpo.*grpo.*rloo"):
        compute_advantages("ppo", torch.zeros(1, 2))


# --- DAPO helpers ----------------------------------------------------------------------------

def test_zero_variance_groups():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0], [0.5, 0.5, 0.5], [0.0, 0.0, 1e-3]])
    assert zero_variance_groups(rewards).tolist() == [True, False, True, False]
    # spread 1e-3 is within a looser tolerance
    assert zero_variance_groups(rewards, atol=1e-2).tolist() == [True, False, True, True]
    assert zero_variance_groups(torch.tensor([[2.0], [3.0]])).tolist() == [True, True]


def test_overlong_mask():
    truncated = torch.tensor([[True, False], [False, False]])
    mask = overlong_mask(truncated)
    assert mask.is_floating_point()
    close(mask, [[0.0, 1.0], [1.0, 1.0]])


# --- PCAR ------------------------------------------------------------------------------------

def test_pcar_worked_example():
    # scores of the group together: [8, 2, 5]; mean 15/3 = 5; deviations 3, -3, 0;
    # unbiased variance (9 + 9 + 0) / 2 = 9, std 3 -> z = [1, -1, 0].
    # lam = 0.5: factors 1 + 0.5 * z = [1.5, 0.5, 1.0] (all above delta = 0.1).
    # trajectory 0 (A = 1): [1.5, 0.5]; trajectory 1 (A = -1): [-1.0]
    out = pcar_segment_advantages(
        torch.tensor([1.0, -1.0]), [torch.tensor([8.0, 2.0]), torch.tensor([5.0])], lam=0.5, delta=0.1
    )
    assert len(out) == 2
    close(out[0], [1.5, 0.5])
    close(out[1], [-1.0])


def test_pcar_clamp_at_delta_bites():
    # same z = [1, -1, 0]; lam = 2: 1 + 2 * z = [3, -1, 1] -> clamp(min=0.1) -> [3, 0.1, 1]
    # A = [1, -1]: [[3, 0.1], [-1]]  (the low score shrinks A towards 0 but never flips its sign)
    out = pcar_segment_advantages(
        torch.tensor([1.0, -1.0]), [torch.tensor([8.0, 2.0]), torch.tensor([5.0])], lam=2.0, delta=0.1
    )
    close(out[0], [3.0, 0.1])
    close(out[1], [-1.0])


def test_pcar_trajectory_without_segments_gets_empty_tensor():
    # the empty trajectory adds no score: z is still [1, -1, 0] over [8, 2, 5];
    # lam = 0.5 -> factors [1.5, 0.5, 1.0]; trajectory 2 (A = 0.5): 0.5 * 1.0 = 0.5
    out = pcar_segment_advantages(
        torch.tensor([1.0, -1.0, 0.5]),
        [torch.tensor([8.0, 2.0]), torch.tensor([]), torch.tensor([5.0])],
        lam=0.5,
        delta=0.1,
    )
    close(out[0], [1.5, 0.5])
    assert out[1].shape == (0,)
    close(out[2], [0.5])


def test_pcar_degenerate_scores_leave_advantages_unchanged():
    # one score in the whole group -> z = 0 -> factor 1
    out = pcar_segment_advantages(torch.tensor([2.0, -3.0]), [torch.tensor([4.0]), torch.tensor([])], lam=1.0, delta=0.0)
    close(out[0], [2.0])
    assert out[1].numel() == 0
    # all scores equal (std 0) -> z = 0 -> factor 1
    out = pcar_segment_advantages(
        torch.tensor([2.0, -3.0]), [torch.tensor([3.0, 3.0]), torch.tensor([3.0])], lam=1.0, delta=0.0
    )
    close(out[0], [2.0, 2.0])
    close(out[1], [-3.0])
    # equal scores that float32 cannot hold (0.7): the std came out a rounding step above 0 -> 1.056
    out = pcar_segment_advantages(
        torch.tensor([2.0, -3.0]), [torch.full((3,), 0.7), torch.full((4,), 0.7)], lam=1.0, delta=0.1
    )
    assert torch.equal(out[0], torch.full((3,), 2.0)) and torch.equal(out[1], torch.full((4,), -3.0)), out


def test_pcar_lam_zero_is_plain_broadcast():
    # lam = 0: factor max(1 + 0, delta) = 1 for any delta <= 1
    out = pcar_segment_advantages(torch.tensor([0.7]), [torch.tensor([1.0, 9.0, 4.0])], lam=0.0, delta=0.5)
    close(out[0], [0.7, 0.7, 0.7])


def test_pcar_validation():
    scores = [torch.tensor([1.0])]
    with pytest.raises(ConfigError, match="lam"):
        pcar_segment_advantages(torch.tensor([1.0]), scores, lam=-0.1, delta=0.1)
    with pytest.raises(ConfigError, match="delta"):
        pcar_segment_advantages(torch.tensor([1.0]), scores, lam=0.5, delta=-1.0)
    with pytest.raises(ValueError, match="one entry per trajectory"):
        pcar_segment_advantages(torch.tensor([1.0, 2.0]), scores, lam=0.5, delta=0.1)


# --- DCPO ------------------------------------------------------------------------------------

def test_dcpo_broadcasts_trajectory_advantage():
    out = dcpo_segment_advantages(torch.tensor([0.5, -1.0, 2.0]), [2, 0, 3])
    close(out[0], [0.5, 0.5])
    assert out[1].shape == (0,)
    close(out[2], [2.0, 2.0, 2.0])


def test_dcpo_each_trajectory_counts_once():
    # trajectory rewards [1, 0]: mean 0.5, unbiased std sqrt(0.5) = 0.7071,
    # A = +-0.5 / 0.7071 = +-0.7071 whatever the segment counts (3 and 1) are.
    # (Counting per segment, rewards [1, 1, 1, 0] would give different numbers.)
    a = 0.5 / math.sqrt(0.5)
    out = dcpo_segment_advantages(grpo_advantages(torch.tensor([[1.0, 0.0]]))[0], [3, 1])
    close(out[0], [a, a, a])
    close(out[1], [-a])


def test_dcpo_validation():
    with pytest.raises(ValueError):
        dcpo_segment_advantages(torch.tensor([1.0]), [1, 2])
    with pytest.raises(ValueError):
        dcpo_segment_advantages(torch.tensor([1.0]), [-1])


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _check_valid(picks, counts):
    assert len(set(picks)) == len(picks), "no segment is picked twice"
    for traj, seg in picks:
        assert 0 <= seg < counts[traj]


def test_sample_segments_budget_smaller_than_group():
    counts = [3, 3, 3, 3]
    picks = sample_segments(counts, 2, _gen(0))
    assert len(picks) == 2
    _check_valid(picks, counts)
    assert len({t for t, _ in picks}) == 2  # a random subset of distinct trajectories


def test_sample_segments_budget_equal_to_group():
    counts = [3, 1, 2, 5]
    picks = sample_segments(counts, 4, _gen(1))
    _check_valid(picks, counts)
    assert sorted(t for t, _ in picks) == [0, 1, 2, 3]  # one segment of every trajectory


def test_sample_segments_budget_larger_than_group_round_robin():
    counts = [3, 3, 3, 3]
    picks = sample_segments(counts, 7, _gen(2))
    assert len(picks) == 7
    _check_valid(picks, counts)
    assert {t for t, _ in picks[:4]} == {0, 1, 2, 3}  # first G picks cover distinct trajectories
    per_traj = [sum(1 for t, _ in picks if t == i) for i in range(4)]
    assert sorted(per_traj) == [1, 2, 2, 2]  # round-robin: 4 + 3


def test_sample_segments_round_robin_skips_exhausted_trajectories():
    # [1, 3], budget 3: pass 1 takes one of each; trajectory 0 is then empty; pass 2 takes a
    # second segment of trajectory 1 -> 1 from trajectory 0 and 2 from trajectory 1.
    picks = sample_segments([1, 3], 3, _gen(3))
    assert {t for t, _ in picks[:2]} == {0, 1}
    assert sorted(t for t, _ in picks) == [0, 1, 1]


def test_sample_segments_zero_segment_trajectories_and_exhaustive():
    counts = [2, 0, 1, 0, 3]
    picks = sample_segments(counts, 10, _gen(4))
    # budget 10 >= total 6: every segment exactly once
    assert len(picks) == 6
    assert sorted(picks) == [(0, 0), (0, 1), (2, 0), (4, 0), (4, 1), (4, 2)]
    assert {t for t, _ in picks[:3]} == {0, 2, 4}  # trajectories with segments come first, once each
    assert sample_segments([0, 0], 5, _gen(4)) == []
    assert sample_segments([2, 2], 0, _gen(4)) == []


def test_sample_segments_deterministic_given_seed_and_random_across_seeds():
    counts = [4, 2, 5, 1, 3]
    assert sample_segments(counts, 6, _gen(123)) == sample_segments(counts, 6, _gen(123))
    results = {tuple(sample_segments(counts, 6, _gen(seed))) for seed in range(20)}
    assert len(results) > 1
    # budget 1 over [3, 3]: both trajectories and every segment index get picked over seeds
    singles = {sample_segments([3, 3], 1, _gen(seed))[0] for seed in range(200)}
    assert singles == {(t, s) for t in range(2) for s in range(3)}


def test_sample_segments_validation():
    with pytest.raises(ConfigError, match="budget"):
        sample_segments([1, 2], -1, _gen(0))
    with pytest.raises(ValueError):
        sample_segments([1, -2], 1, _gen(0))


@settings(max_examples=60, deadline=None)
@given(
    counts=st.lists(st.integers(0, 6), min_size=0, max_size=7),
    budget=st.integers(0, 30),
    seed=st.integers(0, 2**31 - 1),
)
def test_sample_segments_properties(counts, budget, seed):
    picks = sample_segments(counts, budget, _gen(seed))
    _check_valid(picks, counts)
    assert len(picks) == min(budget, sum(counts))
    nonempty = sum(1 for k in counts if k > 0)
    first = [t for t, _ in picks[: min(budget, nonempty)]]
    assert len(set(first)) == len(first)  # first picks are distinct trajectories
    # balance: a trajectory that still has segments left has at most one pick fewer than any other
    per_traj = [sum(1 for t, _ in picks if t == i) for i in range(len(counts))]
    unfinished = [per_traj[i] for i in range(len(counts)) if per_traj[i] < counts[i]]
    if unfinished:
        assert max(per_traj) - min(unfinished) <= 1


def test_advantage_settings_and_inputs_that_are_no_numbers_are_refused():
    rewards = torch.tensor([[1.0, 0.0, 0.5]])
    for eps in (-1.0, 0.0, math.nan):
        with pytest.raises(ConfigError, match="eps must be a finite number > 0"):
            grpo_advantages(rewards, eps=eps)
    adv = torch.tensor([1.0, -1.0])
    scores = [[3.0], [5.0]]
    for lam, delta, said in ((math.inf, 0.1, "lam must be a finite number >= 0"), (-1.0, 0.1, "lam must be"),
                             (0.5, 5.0, r"delta must be in \[0, 1\]"), (0.5, math.nan, "delta must be")):
        with pytest.raises(ConfigError, match=said):
            pcar_segment_advantages(adv, scores, lam=lam, delta=delta)
    with pytest.raises(ValueError, match="advantages must be finite"):
        pcar_segment_advantages(torch.tensor([1.0, math.nan]), scores, lam=0.5, delta=0.1)
    with pytest.raises(ValueError, match="advantages must be finite"):
        dcpo_segment_advantages(torch.tensor([math.inf, 0.0]), [1, 1])
    with pytest.raises(ValueError, match=r"segment counts must be ints >= 0, got \[1.5, 1\]"):
        dcpo_segment_advantages(adv, [1.5, 1])
    with pytest.raises(ConfigError, match="budget must be an int >= 0, got 2.5"):
        sample_segments([2, 2], budget=2.5)
