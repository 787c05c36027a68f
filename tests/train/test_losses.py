"""Losses against numbers computed by hand (the arithmetic is in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from rftgym.core.errors import ConfigError
from rftgym.train.losses import (
    AGGREGATIONS,
    aggregate,
    constant_normalizer,
    kl_k3,
    policy_loss,
    ppo_clip_token_losses,
    sequence_mean,
    token_mean,
    truncated_importance_weights,
)

LN = math.log


def close(actual, expected, atol=1e-5):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.allclose(actual, expected, atol=atol, rtol=0), (actual, expected)


def logps_for_ratios(ratios):
    """(logp, old_logp) with exp(logp - old_logp) = ratios, old_logp = -1."""
    old = torch.full((1, len(ratios)), -1.0, dtype=torch.float64)
    return old + torch.log(torch.tensor([ratios], dtype=torch.float64)), old


# --- PPO clip --------------------------------------------------------------------------------

def test_ppo_clip_positive_advantage():
    # A = +1, clip range [0.8, 1.2]; loss = -min(r * A, clip(r) * A)
    # r = 1.1 (inside):  -min(1.1, 1.1) = -1.1, not clipped
    # r = 1.5 (above):   -min(1.5, 1.2) = -1.2, clipped (no gradient)
    # r = 0.5 (below):   -min(0.5, 0.8) = -0.5, NOT clipped (the pessimistic term is the unclipped one)
    logp, old = logps_for_ratios([1.1, 1.5, 0.5])
    loss, clipped = ppo_clip_token_losses(logp, old, torch.tensor([[1.0]], dtype=torch.float64))
    close(loss, [[-1.1, -1.2, -0.5]])
    assert clipped.tolist() == [[False, True, False]]


def test_ppo_clip_negative_advantage():
    # A = -1:
    # r = 1.5: -min(-1.5, -1.2) = 1.5, not clipped
    # r = 0.5: -min(-0.5, -0.8) = 0.8, clipped
    # r = 0.9: -min(-0.9, -0.9) = 0.9, not clipped
    logp, old = logps_for_ratios([1.5, 0.5, 0.9])
    loss, clipped = ppo_clip_token_losses(logp, old, torch.tensor([[-1.0]], dtype=torch.float64))
    close(loss, [[1.5, 0.8, 0.9]])
    assert clipped.tolist() == [[False, True, False]]


def test_ppo_clip_higher_is_asymmetric():
    # clip_low = 0.2, clip_high = 0.28: range [0.8, 1.28]
    # A = +1, r = 1.25: symmetric 0.2 would give -1.2 (clipped); clip-higher gives -1.25 (free)
    # A = +1, r = 1.5: -min(1.5, 1.28) = -1.28, clipped
    # A = -1, r = 0.75: the low side is still 0.8: -min(-0.75, -0.8) = 0.8, clipped
    logp, old = logps_for_ratios([1.25, 1.5, 0.75])
    adv = torch.tensor([[1.0, 1.0, -1.0]], dtype=torch.float64)
    loss, clipped = ppo_clip_token_losses(logp, old, adv, clip_low=0.2, clip_high=0.28)
    close(loss, [[-1.25, -1.28, 0.8]])
    assert clipped.tolist() == [[False, True, True]]
    sym_loss, sym_clipped = ppo_clip_token_losses(logp, old, adv, clip_low=0.2, clip_high=0.2)
    close(sym_loss, [[-1.2, -1.2, 0.8]])
    assert sym_clipped.tolist() == [[True, True, True]]


def test_ppo_clip_gradients():
    # d loss / d logp = -A * r where not clipped (d r / d logp = r), 0 where clipped.
    # A = 2: r = 1.1 -> -2.2; r = 1.5 -> clipped -> 0; r = 0.5 -> -1.0
    logp, old = logps_for_ratios([1.1, 1.5, 0.5])
    logp.requires_grad_(True)
    loss, _ = ppo_clip_token_losses(logp, old, torch.tensor([[2.0]], dtype=torch.float64))
    loss.sum().backward()
    close(logp.grad, [[-2.2, 0.0, -1.0]])


def test_ppo_clip_advantage_shapes():
    # [batch] advantages are one per sequence (here batch == seq == 2, where plain broadcasting
    # would silently read them per position). r = 1 everywhere -> loss = -A
    logp = torch.zeros(2, 2)
    loss, _ = ppo_clip_token_losses(logp, logp, torch.tensor([1.0, -3.0]))
    close(loss, [[-1.0, -1.0], [3.0, 3.0]])
    loss, _ = ppo_clip_token_losses(logp, logp, torch.tensor([[1.0], [-3.0]]))
    close(loss, [[-1.0, -1.0], [3.0, 3.0]])
    loss, _ = ppo_clip_token_losses(logp, logp, torch.tensor([[1.0, 2.0], [-3.0, 4.0]]))
    close(loss, [[-1.0, -2.0], [3.0, -4.0]])


def test_ppo_clip_extreme_log_ratio_stays_finite():
    logp = torch.tensor([[0.0, -1e4]], requires_grad=True)
    old = torch.tensor([[-1e4, 0.0]])
    loss, _ = ppo_clip_token_losses(logp, old, torch.tensor([[-1.0]]))
    token_mean(loss, torch.tensor([[0.0, 1.0]])).backward()
    assert torch.isfinite(loss).all() and torch.isfinite(logp.grad).all()


def test_ppo_clip_validation():
    z = torch.zeros(1, 1)
    with pytest.raises(ConfigError, match="clip_low"):
        ppo_clip_token_losses(z, z, z, clip_low=1.5)
    with pytest.raises(ConfigError, match="clip_high"):
        ppo_clip_token_losses(z, z, z, clip_high=-0.1)
    with pytest.raises(ConfigError, match="clip_ratio_c must be 0 .off. or above 1"):
        ppo_clip_token_losses(z, z, z, clip_ratio_c=0.5)


def test_dual_clip_caps_a_negative_advantages_loss():
    # clip range [0.8, 1.2], clip_ratio_c = 3:
    # A = -2, r = 5:   PPO -min(-10, -2.4) = 10; dual min(10, 3 * 2) = 6, capped (no gradient)
    # A = -2, r = 2:   PPO -min(-4, -2.4) = 4 < 6, kept, with its gradient
    # A = -2, r = 0.5: PPO -min(-1, -1.6) = 1.6, clipped below as usual
    # A = +1, r = 5:   -min(5, 1.2) = -1.2, clipped above (dual clip leaves positive advantages alone)
    logp, old = logps_for_ratios([5.0, 2.0, 0.5, 5.0])
    logp.requires_grad_(True)
    adv = torch.tensor([[-2.0, -2.0, -2.0, 1.0]], dtype=torch.float64)
    loss, clipped = ppo_clip_token_losses(logp, old, adv, clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0)
    close(loss.detach(), [[6.0, 4.0, 1.6, -1.2]])
    assert clipped.tolist() == [[True, False, True, True]]
    loss.sum().backward()
    # d/dlogp of -r * A = -A * r: only the second token's (2 * 2 = 4)
    close(logp.grad, [[0.0, 4.0, 0.0, 0.0]])
    plain, _ = ppo_clip_token_losses(logp.detach(), old, adv, clip_low=0.2, clip_high=0.2)
    close(plain, [[10.0, 4.0, 1.6, -1.2]])


def test_policy_loss_reports_the_dual_clip_fraction():
    # The four tokens above: clipped [dual, -, low, high] -> 3/4 clipped, 1/4 each way
    logp, old = logps_for_ratios([5.0, 2.0, 0.5, 5.0])
    adv = torch.tensor([[-2.0, -2.0, -2.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.float64)
    loss, stats = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0)
    close(loss, (6.0 + 4.0 + 1.6 - 1.2) / 4)
    stats = {key: float(value) for key, value in stats.items()}
    assert stats["clip_fraction"] == pytest.approx(0.75)
    assert (stats["clip_fraction_high"], stats["clip_fraction_low"], stats["clip_fraction_dual"]) == \
        pytest.approx((0.25, 0.25, 0.25))
    _, plain = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert "clip_fraction_dual" not in plain and float(plain["clip_fraction_low"]) == pytest.approx(0.25)


# --- aggregation -----------------------------------------------------------------------------

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def test_token_mean():
    # (1 + 2 + 4) / 3 = 7/3
    close(token_mean(LOSS, MASK), 7 / 3)


def test_a_mask_of_one_weight_per_row_counts_every_position_it_covers():
    # mask [[1], [0]] broadcast over 3 positions: row 0 trains 3 tokens, row 1 none.
    row_mask = torch.tensor([[1.0], [0.0]])
    close(token_mean(LOSS, row_mask), (1 + 2 + 3) / 3)  # 2, not 6 / 1
    close(sequence_mean(LOSS, row_mask), 2.0)  # the one sequence with tokens: the same mean
    close(aggregate("token_mean", LOSS, row_mask), 2.0)


def test_sequence_mean():
    # ((1 + 2) / 2 + 4 / 1) / 2 = (1.5 + 4) / 2 = 2.75
    close(sequence_mean(LOSS, MASK), 2.75)


def test_sequence_mean_skips_sequences_without_tokens():
    loss = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 1.0]])
    # row 2 has no tokens: ((1 + 2) / 2 + 6 / 1) / 2 = (1.5 + 6) / 2 = 3.75
    close(sequence_mean(loss, mask), 3.75)
    # token mean of the same: (1 + 2 + 6) / 3 = 3
    close(token_mean(loss, mask), 3.0)


def test_sequence_mean_of_packed_rows_by_hand():
    # One row holding three sequences: ids [0, 0, 1, 1, -1, 2] (-1: padding), mask [1, 1, 0, 1, 0, 1]
    # seq 0: (1 + 2) / 2 = 1.5; seq 1: 4 / 1 = 4; seq 2: 6 / 1 = 6  ->  (1.5 + 4 + 6) / 3 = 23/6
    loss = torch.tensor([[1.0, 2.0, 3.0, 4.0, 99.0, 6.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0, 0.0, 1.0]])
    ids = torch.tensor([[0, 0, 1, 1, -1, 2]])
    value = sequence_mean(loss, mask, ids)
    close(value, 23 / 6)
    value.backward()
    # d/d loss_t = 1 / (n_b * sequences): seq 0 tokens 1/6 each, seq 1 and 2 tokens 1/3
    close(loss.grad, [[1 / 6, 1 / 6, 0.0, 1 / 3, 0.0, 1 / 3]])
    # The same sequences laid out one per row give the same number.
    rows = torch.tensor([[1.0, 2.0], [3.0, 4.0], [6.0, 0.0]])
    close(sequence_mean(rows, torch.tensor([[1.0, 1.0], [0.0, 1.0], [1.0, 0.0]])), 23 / 6)
    # Ids spread over two rows, one sequence without trained tokens (id 3): skipped.
    two_rows = sequence_mean(torch.tensor([[1.0, 2.0, 5.0], [4.0, 6.0, 7.0]]),
                             torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]]), torch.tensor([[0, 0, 3], [1, 2, -1]]))
    close(two_rows, 23 / 6)
    close(aggregate("sequence_mean", loss.detach(), mask, sequence_ids=ids), 23 / 6)
    close(sequence_mean(loss.detach(), torch.zeros(1, 6), ids), 0.0)


def test_constant_normalizer():
    # (1 + 2 + 4) / 6 = 7/6  (e.g. max length 3 * 2 sequences)
    close(constant_normalizer(LOSS, MASK, 6), 7 / 6)


def test_aggregate_by_name():
    assert set(AGGREGATIONS) == {"token_mean", "sequence_mean", "constant_normalizer"}
    close(aggregate("token_mean", LOSS, MASK), 7 / 3)
    close(aggregate("sequence_mean", LOSS, MASK), 2.75)
    close(aggregate("constant_normalizer", LOSS, MASK, normalizer=14), 0.5)  # 7 / 14
    with pytest.raises(ConfigError, match="sequence_mean"):
        aggregate("mean", LOSS, MASK)
    with pytest.raises(ConfigError, match="normalizer"):
        aggregate("constant_normalizer", LOSS, MASK)
    with pytest.raises(ConfigError, match="normalizer"):
        aggregate("constant_normalizer", LOSS, MASK, normalizer=0)


def test_aggregations_ignore_masked_garbage_and_empty_masks():
    loss = torch.tensor([[1.0, float("inf")], [float("nan"), 3.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    close(token_mean(loss, mask), 2.0)  # (1 + 3) / 2
    close(sequence_mean(loss, mask), 2.0)  # (1/1 + 3/1) / 2
    empty = torch.zeros(2, 2)
    for name in ("token_mean", "sequence_mean"):
        x = torch.ones(2, 2, requires_grad=True)
        out = aggregate(name, x, empty)
        out.backward()
        assert out.item() == 0.0 and torch.equal(x.grad, torch.zeros(2, 2))


# --- KL --------------------------------------------------------------------------------------

def test_kl_k3_by_hand():
    # d = ref - logp
    # logp = -1, ref = -2: d = -1 -> e^-1 + 1 - 1 = e^-1 = 0.367879
    # logp = -2, ref = -1: d = +1 -> e - 1 - 1 = 0.718282
    # logp = ref: d = 0 -> 1 - 0 - 1 = 0
    out = kl_k3(torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-2.0, -1.0, -0.5]))
    close(out, [0.367879, 0.718282, 0.0])
    assert (kl_k3(torch.randn(100), torch.randn(100)) >= 0).all()


# --- policy_loss -----------------------------------------------------------------------------

def test_policy_loss_by_hand():
    # ratios [1.1, 1.5, 1.0], A = 1, mask [1, 1, 0], clip 0.2:
    # per-token [-1.1, -1.2, -1.0]; token mean over mask (-1.1 - 1.2) / 2 = -1.15
    # clip_fraction 1/2; ratio_mean (1.1 + 1.5) / 2 = 1.3
    # approx_kl = mean of r - 1 - ln r: (0.1 - ln 1.1 + 0.5 - ln 1.5) / 2
    #   = (0.0046898 + 0.0945349) / 2 = 0.0496124
    # ref - logp = [-1, 0, 5] -> k3 [e^-1, 0, masked] -> kl_ref = e^-1 / 2 = 0.183940
    # loss = -1.15 + 0.1 * 0.183940 = -1.131606
    logp, old = logps_for_ratios([1.1, 1.5, 1.0])
    ref = logp + torch.tensor([[-1.0, 0.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    entropy = torch.tensor([[2.0, 4.0, 100.0]])
    loss, stats = policy_loss(
        logp, old, torch.tensor([[1.0]], dtype=torch.float64), mask,
        clip_low=0.2, clip_high=0.2, ref_logp=ref, kl_coef=0.1, entropy=entropy,
    )
    # Stats stay on the device (0-dim tensors, no gradient): reading them would wait for it.
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad for v in stats.values())
    stats = {key: float(value) for key, value in stats.items()}
    assert loss.dim() == 0
    close(loss, -1.15 + 0.1 * math.exp(-1) / 2)
    assert stats["pg_loss"] == pytest.approx(-1.15)
    assert stats["clip_fraction"] == pytest.approx(0.5)
    assert (stats["clip_fraction_high"], stats["clip_fraction_low"]) == pytest.approx((0.5, 0.0))   # A > 0: above
    assert stats["ratio_mean"] == pytest.approx(1.3)
    assert stats["approx_kl"] == pytest.approx((0.1 - LN(1.1) + 0.5 - LN(1.5)) / 2, rel=1e-5)
    assert stats["approx_kl"] == pytest.approx(0.0496124, abs=1e-6)
    assert stats["kl_ref"] == pytest.approx(math.exp(-1) / 2, rel=1e-5)
    assert stats["entropy"] == pytest.approx(3.0)  # (2 + 4) / 2


def test_policy_loss_without_ref_and_with_other_aggregations():
    # r = 1 everywhere, A = [[1], [-2]], mask [[1, 1, 0], [1, 0, 0]] -> per-token -A:
    # token_mean: (-1 - 1 + 2) / 3 = 0; sequence_mean: (-1 + 2) / 2 = 0.5; constant 4: 0 / 4 = 0
    logp = torch.zeros(2, 3)
    adv = torch.tensor([[1.0], [-2.0]])
    loss, stats = policy_loss(logp, logp, adv, MASK, clip_low=0.2, clip_high=0.2)
    close(loss, 0.0)
    assert set(stats) == {"pg_loss", "clip_fraction", "clip_fraction_high", "clip_fraction_low", "approx_kl",
                          "ratio_mean"}
    assert float(stats["approx_kl"]) == 0.0 and float(stats["ratio_mean"]) == 1.0
    loss, _ = policy_loss(logp, logp, adv, MASK, clip_low=0.2, clip_high=0.2, aggregation="sequence_mean")
    close(loss, 0.5)
    loss, _ = policy_loss(logp, logp, adv, MASK, clip_low=0.2, clip_high=0.2,
                          aggregation="constant_normalizer", normalizer=4.0)
    close(loss, 0.0)


def test_policy_loss_ref_reported_but_unused_at_zero_coef():
    logp = torch.zeros(1, 2)
    ref = torch.tensor([[-1.0, -1.0]])  # k3 = e^-1 per token
    loss, stats = policy_loss(logp, logp, torch.tensor([[1.0]]), torch.ones(1, 2),
                              clip_low=0.2, clip_high=0.2, ref_logp=ref)
    close(loss, -1.0)  # -r * A = -1, no KL term
    assert float(stats["kl_ref"]) == pytest.approx(math.exp(-1), rel=1e-5)


def test_policy_loss_kl_needs_ref():
    z = torch.zeros(1, 2)
    with pytest.raises(ConfigError, match="ref_logp"):
        policy_loss(z, z, z, torch.ones(1, 2), clip_low=0.2, clip_high=0.2, kl_coef=0.1)


def test_truncated_importance_weights_by_hand():
    # min(exp(train - rollout), cap) with cap 2: exp(0) = 1; exp(1) = 2.718 -> 2 (capped);
    # exp(-1.5) = 0.22313; exp(ln 1.5) = 1.5.
    train = torch.tensor([-1.0, -0.5, -2.0, LN(0.3)])
    rollout = torch.tensor([-1.0, -1.5, -0.5, LN(0.2)])
    close(truncated_importance_weights(train, rollout, 2.0), [1.0, 2.0, math.exp(-1.5), 1.5])
    # A weight folded into the advantage scales both arms of the PPO min alike: the clipped loss
    # with advantage w*A is w times the loss with A (w > 0).
    logp, old = torch.tensor([-0.2, -3.0]), torch.tensor([-0.5, -1.0])
    adv, w = torch.tensor([1.0, -2.0]), torch.tensor([0.25, 2.0])
    scaled, _ = ppo_clip_token_losses(logp, old, adv * w, 0.2, 0.28)
    plain, _ = ppo_clip_token_losses(logp, old, adv, 0.2, 0.28)
    close(scaled, plain * w)
    with pytest.raises(ConfigError, match="cap must be at least 1"):
        truncated_importance_weights(train, rollout, 0.5)


def test_sequence_ratio_gspo_by_hand():
    """Row 0: token log-ratios ln 2 and -ln 2 (probabilities .5 over .25, .25 over .5), mean 0,
    so s = 1 and each token's loss is -A = -1, gradient -s*A = -1 per token. Row 1: one trained token, .5 over .4: s = 1.25 > 1 + 0.2, A = 1:
    clipped at 1.2, loss -1.2 and no gradient; its masked position takes the row's ratio too."""
    logp = torch.tensor([[LN(0.5), LN(0.25)], [LN(0.5), LN(0.9)]], requires_grad=True)
    old = torch.tensor([[LN(0.25), LN(0.5)], [LN(0.4), LN(0.1)]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([1.0, 1.0])
    loss, clipped = ppo_clip_token_losses(logp, old, adv, 0.2, 0.2, ratio_level="sequence", mask=mask)
    close(loss.detach(), [[-1.0, -1.0], [-1.2, -1.2]])
    assert clipped.tolist() == [[False, False], [True, True]]
    (loss * mask).sum().backward()
    close(logp.grad, [[-1.0, -1.0], [0.0, 0.0]])
    # Per token, the same row gives ratios 2 (clipped at 1.2) and 0.5: losses -1.2 and -0.5.
    token_loss, _ = ppo_clip_token_losses(logp.detach(), old, adv, 0.2, 0.2)
    close(token_loss[0], [-1.2, -0.5])


def test_sequence_ratio_over_packed_rows_is_the_padded_one():
    # Two sequences packed in one row (ids 0 and 1, -1 for padding) against the same two padded.
    logp = torch.tensor([[-0.1, -0.7, -1.3, -0.2, -2.0], ])
    old = torch.tensor([[-0.3, -0.5, -1.0, -0.9, -2.0]])
    ids = torch.tensor([[0, 0, 1, 1, -1]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    adv = torch.tensor([[0.5, 0.5, -2.0, -2.0, 0.0]])
    packed, _ = ppo_clip_token_losses(logp, old, adv, 0.2, 0.3, ratio_level="sequence", mask=mask, sequence_ids=ids)
    padded, _ = ppo_clip_token_losses(logp[0, :4].reshape(2, 2), old[0, :4].reshape(2, 2), torch.tensor([0.5, -2.0]),
                                      0.2, 0.3, ratio_level="sequence", mask=torch.ones(2, 2))
    close(packed[0, :4], padded.reshape(-1))
    # By hand: s0 = exp((0.2 - 0.2) / 2) = 1, loss -0.5; s1 = exp((-0.3 + 0.7) / 2) = exp(0.2) = 1.2214,
    # with A = -2 the min is max(1.2214, clamp) * 2 -> loss 2 * 1.2214 = 2.4428 (not clipped above for A < 0).
    close(padded, [[-0.5, -0.5], [2 * math.exp(0.2), 2 * math.exp(0.2)]])
    with pytest.raises(ConfigError, match="needs the loss mask"):
        ppo_clip_token_losses(logp, old, adv, ratio_level="sequence")
    with pytest.raises(ConfigError, match="ratio_level must be one of"):
        ppo_clip_token_losses(logp, old, adv, ratio_level="segment")


def test_sequence_ratio_is_the_same_at_every_token_of_a_sequence():
    # Log-probs of very different sizes in one sequence: every token holds exactly the sequence's
    # ratio (the tokens of a sequence are clipped together or not at all), in float32.
    logp = torch.tensor([[-25.9, -0.001, -7.3, -13.37]], requires_grad=True)
    old = torch.tensor([[-25.8999, -0.0012, -7.3003, -13.3698]])
    mask = torch.ones(1, 4)
    losses, _ = ppo_clip_token_losses(logp, old, torch.tensor([1.0]), ratio_level="sequence", mask=mask)
    assert torch.unique(losses.detach()).numel() == 1


def test_policy_loss_refuses_tensors_that_would_only_broadcast_and_a_kl_coef_that_is_no_number():
    logp, mask = torch.zeros(4, 5), torch.ones(4, 5)
    adv = torch.ones(4)
    settings = dict(clip_low=0.2, clip_high=0.2)
    for name, bad in (("old_logp", torch.zeros(1, 5)), ("mask", torch.ones(5)), ("mask", torch.ones(4, 1))):
        tensors = {"old_logp": logp, "mask": mask, name: bad}
        with pytest.raises(ValueError, match=rf"{name} has shape \({', '.join(map(str, bad.shape))},?\), logp \(4, 5\)"):
            policy_loss(logp, tensors["old_logp"], adv, tensors["mask"], **settings)
    with pytest.raises(ValueError, match=r"advantages has shape \(2, 1, 1\); with logp of shape \(4, 5\) it is one per "
                                         r"sequence \(\(4,\) or \(4, 1\)\) or one per token \(\(4, 5\)\)"):
        policy_loss(logp, logp, torch.ones(2, 1, 1), mask, **settings)
    with pytest.raises(ValueError, match=r"logp must be \[batch, seq\]"):
        policy_loss(logp.view(-1), logp.view(-1), adv, mask.view(-1), **settings)
    with pytest.raises(ConfigError, match="kl_coef must be a finite number >= 0, got nan"):
        policy_loss(logp, logp, adv, mask, kl_coef=math.nan, ref_logp=logp, **settings)
    for good in (adv, adv.view(4, 1), torch.ones(4, 5)):  # one per sequence, or per token
        loss, _ = policy_loss(logp, logp, good, mask, **settings)
        assert loss.item() == pytest.approx(-1.0)


def test_clip_fractions_split_by_the_side_the_ratio_left_the_range_on():
    # Ratios [1.5, 0.5, 0.5, 1.5] with A [+1, -1, +1, -1], clip 0.2: token 1 clipped above (A > 0),
    # token 2 below (A < 0); tokens 3 and 4 left the range on the side that keeps the gradient.
    logp, old = logps_for_ratios([1.5, 0.5, 0.5, 1.5])
    advantages = torch.tensor([[1.0, -1.0, 1.0, -1.0]], dtype=torch.float64)
    _, stats = policy_loss(logp, old, advantages, torch.ones(1, 4, dtype=torch.float64), clip_low=0.2, clip_high=0.2)
    assert [float(stats[k]) for k in ("clip_fraction", "clip_fraction_high", "clip_fraction_low")] == \
        pytest.approx([0.5, 0.25, 0.25])
