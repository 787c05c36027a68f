"""Advantage estimators: pure tensor functions over groups of samples of the same task.

Rewards come as ``rewards[num_groups, group_size]``: row g holds the G rewards of G samples
(episodes) drawn for the same task. Each estimator is its own function, chosen by name from
:data:`ADVANTAGE_ESTIMATORS` (see :func:`compute_advantages`).

Trajectory-level estimators (GRPO, Dr.GRPO, RLOO) give one advantage per episode. Two segment-level
schemes turn those into one advantage per segment (DESIGN.md section 2):

- PCAR (EvalAct's Process-Calibrated Advantage Rescaling) rescales each segment's advantage by its
  evaluation score standardized over the group (a segment without a score keeps the advantage and
  stays out of the group's statistics), :func:`pcar_segment_advantages`;
- DCPO (Memory-as-Action's Dynamic Context Policy Optimization) broadcasts the trajectory advantage
  to every segment, :func:`dcpo_segment_advantages`, and trains on a per-group sample of segments,
  :func:`sample_segments`.

DAPO's filters are helpers here too: :func:`zero_variance_groups` (DAPO's dynamic sampling drops
groups whose rewards are all equal, as every advantage is 0 and they carry no gradient, and samples
more until the batch is full; the trainer drops them only) and
:func:`overlong_mask` (overlong filtering: samples cut by the length budget are not trained on).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch

from ..core.errors import ConfigError
from ..core.values import is_finite_real, is_int


def _as_reward_matrix(rewards: torch.Tensor) -> torch.Tensor:
    rewards = torch.as_tensor(rewards)
    if rewards.dim() != 2:
        raise ValueError(
            f"rewards must be a 2-D tensor [num_groups, group_size], got shape {tuple(rewards.shape)}; "
            "reshape a flat batch with rewards.view(num_groups, group_size)"
        )
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    if not torch.isfinite(rewards).all():
        # one NaN would make its whole group's advantages NaN, and NaN groups are never "flat"
        raise ValueError(f"rewards must be finite; got {rewards[~torch.isfinite(rewards)][:4].tolist()} "
                         "among them: fix the reward function (rollouts already refuse such rewards)")
    return rewards


def grpo_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: ``A_gi = (r_gi - mean_g) / (std_g + eps)``.

    ``mean_g`` and ``std_g`` are over the G rewards of group g; ``std_g`` is the unbiased sample
    standard deviation, ``sqrt(sum_i (r_gi - mean_g)^2 / (G - 1))`` (``torch.std``'s default, as in
    TRL and verl). A group of size 1 has no spread to compare against: its advantages are 0.
    A group whose rewards are all equal gets 0 (the numerator is 0; ``eps`` avoids 0/0).
    """
    if not (is_finite_real(eps) and eps > 0):
        raise ConfigError(f"eps must be a finite number > 0 (it keeps a flat group's 0 / 0 away), got {eps!r}")
    rewards = _as_reward_matrix(rewards)
    if rewards.shape[1] < 2:
        return torch.zeros_like(rewards)
    wide = _wide(rewards)
    advantages = (wide - wide.mean(dim=1, keepdim=True)) / (wide.std(dim=1, keepdim=True) + eps)
    return _zero_where_flat(wide, advantages).to(rewards.dtype)


def _wide(rewards: torch.Tensor) -> torch.Tensor:
    """Rewards in float64 for the group statistics (float32 where the device has no float64)."""
    return rewards if rewards.device.type == "mps" else rewards.double()


def _zero_where_flat(rewards: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """Exactly 0 for every sample of a group whose rewards are all equal. Without it a float mean
    of equal rewards (12.3 eight times) can sit one rounding step off them, and GRPO's division by
    the equally tiny std turns that step into advantages near +-1 for the whole group."""
    flat = rewards.amax(dim=1, keepdim=True) == rewards.amin(dim=1, keepdim=True)
    return torch.where(flat, torch.zeros_like(advantages), advantages)


def dr_grpo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO: ``A_gi = r_gi - mean_g`` (no division by the group std, which biases GRPO
    towards groups with little spread)."""
    rewards = _as_reward_matrix(rewards)
    if rewards.shape[1] == 0:
        return rewards.clone()
    wide = _wide(rewards)
    return _zero_where_flat(wide, wide - wide.mean(dim=1, keepdim=True)).to(rewards.dtype)


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """RLOO (leave-one-out): ``A_gi = r_gi - (sum_j r_gj - r_gi) / (G - 1)``.

    The baseline of sample i is the mean of the other G-1 rewards of its group, so it does not
    depend on r_gi. Equivalently ``A_gi = G / (G - 1) * (r_gi - mean_g)``. Group size 1 -> 0.
    """
    rewards = _as_reward_matrix(rewards)
    group_size = rewards.shape[1]
    if group_size < 2:
        return torch.zeros_like(rewards)
    wide = _wide(rewards)
    others_mean = (wide.sum(dim=1, keepdim=True) - wide) / (group_size - 1)
    return _zero_where_flat(wide, wide - others_mean).to(rewards.dtype)


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., torch.Tensor]] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
}


def compute_advantages(name: str, rewards: torch.Tensor, **kwargs) -> torch.Tensor:
    """``ADVANTAGE_ESTIMATORS[name](rewards, **kwargs)``; an unknown name is a :class:`ConfigError`."""
    try:
        estimator = ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        raise ConfigError(
            f"unknown advantage estimator {name!r}; choose one of {sorted(ADVANTAGE_ESTIMATORS)}"
        ) from None
    return estimator(rewards, **kwargs)


def zero_variance_groups(rewards: torch.Tensor, atol: float = 1e-8) -> torch.Tensor:
    """``bool[num_groups]``: True where ``max_i r_gi - min_i r_gi <= atol`` (all rewards equal).

    Such groups carry no gradient worth its cost: equal rewards give every advantage exactly 0
    under GRPO, Dr.GRPO and RLOO, and a spread within ``atol`` gives advantages of at most about
    that size (Dr.GRPO, RLOO; GRPO's division by std + eps keeps them below ``atol / eps``). DAPO's
    dynamic sampling drops them and samples more groups instead. A group of size 1 is zero-variance.
    """
    rewards = _as_reward_matrix(rewards)
    if rewards.shape[1] == 0:
        return torch.ones(rewards.shape[0], dtype=torch.bool, device=rewards.device)
    spread = rewards.amax(dim=1) - rewards.amin(dim=1)
    return spread <= atol


def overlong_mask(truncated: torch.Tensor) -> torch.Tensor:
    """Float mask, same shape as ``truncated``: ``0.0`` where a sample was cut by the length budget,
    ``1.0`` otherwise (DAPO overlong filtering: a truncated answer's reward says little about it).

    Multiply it into the loss mask (per sample, broadcast over tokens) to drop those samples.
    """
    truncated = torch.as_tensor(truncated)
    return (~truncated.bool()).to(torch.get_default_dtype())


def _check_group_lengths(advantages: torch.Tensor, count: int, what: str) -> torch.Tensor:
    advantages = torch.as_tensor(advantages)
    if advantages.dim() != 1 or advantages.shape[0] != count:
        raise ValueError(
            f"advantages must be a 1-D tensor with one entry per trajectory of the group: "
            f"got shape {tuple(advantages.shape)} for {count} {what}"
        )
    if not advantages.is_floating_point():
        advantages = advantages.to(torch.get_default_dtype())
    if not torch.isfinite(advantages).all():
        raise ValueError(f"advantages must be finite, got {advantages.tolist()[:8]}: they come from the group's rewards "
                         "(grpo_advantages refuses rewards that are not)")
    return advantages


# One trajectory's segment scores, in order; None for a segment without a score.
ScoreRow = Union[torch.Tensor, Sequence[Optional[float]]]


def pcar_factors(segment_scores: list[ScoreRow], lam: float, delta: float, eps: float = 1e-6,
                 dtype: torch.dtype = torch.float32, device=None) -> list[torch.Tensor]:
    """PCAR's rescaling factors for ONE group: ``max(1 + lam * z_ik, delta)`` per scored segment,
    with ``z`` the scores standardized over the whole group, and exactly 1 per segment whose score is
    None (see :func:`pcar_segment_advantages`). Returns one tensor of k_i factors per trajectory."""
    if not (is_finite_real(lam) and lam >= 0):
        raise ConfigError(f"PCAR lam must be a finite number >= 0 (it scales the standardized score), got {lam!r}")
    if not (is_finite_real(delta) and 0 <= delta <= 1):
        raise ConfigError(f"PCAR delta must be in [0, 1] (the floor of the rescaling factor, which is 1 for an average "
                          f"score), got {delta!r}")
    if not (is_finite_real(eps) and eps > 0):
        raise ConfigError(f"eps must be a finite number > 0, got {eps!r}")
    rows = [_score_list(s) for s in segment_scores]
    scored = [s for row in rows for s in row if s is not None]
    factors = iter(_scored_factors(scored, lam, delta, eps).tolist())
    return [torch.tensor([1.0 if s is None else next(factors) for s in row], dtype=dtype, device=device)
            for row in rows]


def _score_list(scores: ScoreRow) -> list[float | None]:
    """One trajectory's scores as floats (None kept); anything but a finite real number is a
    ValueError: one NaN would make its group's spread NaN and silently switch PCAR off there."""
    values = scores.reshape(-1).tolist() if isinstance(scores, torch.Tensor) else list(scores)
    for value in values:
        if value is not None and not is_finite_real(value):
            raise ValueError(f"segment scores must be finite numbers (or None for a segment without a score); got "
                             f"{value!r}: fix the record or the env that scored it")
    return [None if value is None else float(value) for value in values]


def _scored_factors(scores: list[float], lam: float, delta: float, eps: float) -> torch.Tensor:
    """``max(1 + lam * z, delta)`` over the scored segments of a group, in float64 on the host (a
    handful of numbers; float32 would overflow on scores past 3.4e38 and make every factor NaN)."""
    wide = torch.tensor(scores, dtype=torch.float64)
    z = torch.zeros_like(wide)
    # Equal scores standardize to 0: tested as max > min, since the std of equal floats (0.7 seven
    # times) can come out a rounding step above 0 and would blow that step up to z near +-1.
    if wide.numel() >= 2 and wide.amax() > wide.amin():
        # Standardization ignores scale: scores divided by their largest magnitude first cannot
        # overflow the mean or the std, whatever their size.
        scale = wide.abs().amax()
        scaled = wide / scale
        z = (scaled - scaled.mean()) / (scaled.std() + eps / scale)
    return torch.clamp(1.0 + lam * z, min=delta)


def pcar_segment_advantages(
    advantages: torch.Tensor,
    segment_scores: list[ScoreRow],
    lam: float,
    delta: float,
    eps: float = 1e-6,
) -> list[torch.Tensor]:
    """PCAR (EvalAct): rescale each segment's advantage by its standardized evaluation score.

    For ONE group of G trajectories, with ``advantages[i] = A_i`` and ``segment_scores[i]`` the
    k_i scores ``s_ik`` of trajectory i's segments (None for a segment without a score: a search
    whose evaluation was skipped or unreadable)::

        s          = every score of the group that is not None, together
        z_ik       = (s_ik - mean(s)) / (std(s) + eps)       (std unbiased)
        z_ik       = 0 for all ik  if len(s) < 2 or all s are equal
        A_ik       = A_i * max(1 + lam * z_ik, delta)
        A_ik       = A_i                                      where s_ik is None

    ``delta >= 0`` floors the factor, so a low score shrinks an advantage towards 0 but never flips
    its sign. A segment without a score neither enters the group's mean and std nor is rescaled. A
    trajectory with no segments gets an empty tensor. Returns G tensors of k_i entries. Scores must
    be finite (a ValueError otherwise); their scale and sign do not matter.
    """
    advantages = _check_group_lengths(advantages, len(segment_scores), "segment score lists")
    factors = pcar_factors(segment_scores, lam, delta, eps, advantages.dtype, advantages.device)
    return [advantages[i] * f for i, f in enumerate(factors)]


def dcpo_segment_advantages(
    advantages: torch.Tensor, segments_per_trajectory: list[int]
) -> list[torch.Tensor]:
    """DCPO (Memory-as-Action): every segment of trajectory i gets ``A_ik = A_i``.

    ``advantages`` are trajectory advantages already computed from trajectory rewards (one reward
    per trajectory, e.g. with :func:`grpo_advantages`), so each trajectory counts once in the group
    mean and std whatever its number of segments: a trajectory fractured into many segments by
    context edits does not weigh more in the baseline. Returns G tensors of k_i entries (empty for a
    trajectory with no segments).
    """
    advantages = _check_group_lengths(advantages, len(segments_per_trajectory), "trajectories")
    _check_segment_counts(segments_per_trajectory)
    return [advantages[i].expand(k).clone() for i, k in enumerate(segments_per_trajectory)]


def _check_segment_counts(counts: list[int]) -> None:
    if not all(is_int(k) and k >= 0 for k in counts):
        raise ValueError(f"segment counts must be ints >= 0, got {counts}")


def sample_segments(
    segments_per_trajectory: list[int],
    budget: int,
    generator: torch.Generator | None = None,
) -> list[tuple[int, int]]:
    """DCPO's per-group segment sampling: up to ``budget`` distinct ``(trajectory, segment)`` pairs.

    Trajectories with at least one segment are visited in a random order. The first pass takes one
    random segment of each (if ``budget`` is smaller than the number of such trajectories, this is a
    random subset of trajectories); later passes go round-robin over the same order, each taking a
    further not-yet-chosen random segment from every trajectory that has one left, until the budget
    or the supply runs out. So coverage of trajectories comes first, and segment counts per
    trajectory differ by at most one among trajectories that are not exhausted.

    The pairs come in pick order. All randomness comes from ``generator`` (the global torch RNG if
    None): the same seed gives the same picks.
    """
    if not (is_int(budget) and budget >= 0):
        raise ConfigError(f"segment sampling budget must be an int >= 0, got {budget!r}")
    _check_segment_counts(segments_per_trajectory)
    with_segments = [i for i, k in enumerate(segments_per_trajectory) if k > 0]
    order = [with_segments[j] for j in torch.randperm(len(with_segments), generator=generator).tolist()]
    # One random permutation of segment indices per trajectory; pass r takes its r-th entry.
    segment_orders = {
        i: torch.randperm(segments_per_trajectory[i], generator=generator).tolist() for i in order
    }
    picks: list[tuple[int, int]] = []
    depth = 0
    while len(picks) < budget:
        taken_this_pass = False
        for i in order:
            if depth < len(segment_orders[i]):
                picks.append((i, segment_orders[i][depth]))
                taken_this_pass = True
                if len(picks) == budget:
                    break
        if not taken_this_pass:
            break
        depth += 1
    return picks
