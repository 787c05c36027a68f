"""Policy-gradient losses: pure tensor functions.

Token tensors are ``[batch, seq]`` with a float ``mask`` (1 = a token the policy sampled, which is
trained; 0 = prompt, tool output, template or padding). Every reduction goes through a masked
aggregation chosen by name from :data:`AGGREGATIONS`, so masked positions never reach the loss,
even when they hold garbage (a masked ``inf`` or ``nan`` is dropped, not multiplied by 0).

Log-ratios are clamped to ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]`` before ``exp`` (as verl does),
so one wild token cannot produce ``inf`` ratios, or ``nan`` gradients through ``inf * 0``.

The log-probabilities these losses take come from
:func:`rftgym.train.token_logprobs.chunked_token_logprobs`.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..core.errors import ConfigError
from ..core.values import is_finite_real
from .config import RATIO_LEVELS

LOG_RATIO_CLAMP = 20.0


def _log_ratio(logp: torch.Tensor, other_logp: torch.Tensor) -> torch.Tensor:
    return torch.clamp(logp - other_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def truncated_importance_weights(train_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling (TIS, Yao et al. 2025): per token, ``min(exp(train_logp -
    rollout_logp), cap)``, the ratio of the probability the training forward pass gives a sampled
    token to the one the sampler gave it, capped so that a token the sampler under-drew cannot
    dominate the loss. The sampler (a KV cache, CUDA graphs, another engine) and the training
    pass differ by numerics; weighting a token's loss by this makes its gradient an estimate
    under the policy the update computes, not under the sampler.

    A positive weight scales both arms of the PPO min alike, so it can be folded into the
    token's advantage (see ``update.recompute_old_logprobs``)."""
    if not cap >= 1:
        raise ConfigError(f"the importance weights' cap must be at least 1, got {cap}")
    return torch.exp(_log_ratio(train_logp, rollout_logp)).clamp(max=cap)


def _per_sequence(advantages: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    # A 1-D advantage vector is one value per sequence; plain broadcasting would instead read it
    # as one value per position, silently, whenever batch == seq.
    if advantages.dim() == 1 and logp.dim() == 2:
        return advantages.unsqueeze(-1)
    return advantages


def sequence_mean_per_position(values: torch.Tensor, mask: torch.Tensor,
                               sequence_ids: torch.Tensor | None = None) -> torch.Tensor:
    """At every position, the mean of ``values`` over the trained positions (``mask``) of its
    sequence: a row, or with ``sequence_ids`` (packed rows) the positions sharing an id. A
    sequence with no trained position gets 0 (its positions are masked wherever it is used)."""
    sums, counts, slots = _per_sequence_sums(values, mask, sequence_ids)
    means = _safe_divide(sums, counts)
    if slots is None:
        return means.unsqueeze(-1).expand_as(values)
    return means[slots].reshape(values.shape)


def ppo_clip_token_losses(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    *,
    ratio_level: str = "token",
    mask: torch.Tensor | None = None,
    sequence_ids: torch.Tensor | None = None,
    clip_ratio_c: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level PPO-clip loss.

    ::

        ratio = exp(logp - old_logp)
        loss  = -min(ratio * A, clamp(ratio, 1 - clip_low, 1 + clip_high) * A)

    ``advantages`` broadcasts against ``logp``: ``[batch, 1]``, ``[batch, seq]``, or ``[batch]``
    (read as one advantage per sequence). ``clip_high > clip_low`` is DAPO's clip-higher, which
    lets low-probability tokens with positive advantage grow further.

    ``ratio_level="sequence"`` is GSPO (Zheng et al. 2025), in its token form: every token of a
    sequence takes the sequence's ratio ``s = exp(mean over its trained tokens (mask) of
    (logp - old_logp))``, the geometric mean of its token ratios, so one token far off-policy
    cannot clip or swing its sequence alone; its gradient is ``s * grad(logp)`` at each token
    (``sg[s] * exp(logp - sg[logp])``), which with one advantage per sequence is the gradient of
    GSPO's sequence objective under the same aggregation (the paper's is ``sequence_mean``;
    ``token_mean`` weighs a sequence by its length), and also takes per-token advantages (PCAR). A sequence is a
    row, or with ``sequence_ids`` (packed rows) the positions sharing an id. GSPO's clip range is
    narrow (its paper: ``clip_low=3e-4``, ``clip_high=4e-4``), since the ratio is a mean.

    ``clip_ratio_c > 1`` is dual-clip PPO (Ye et al. 2020; verl's ``clip_ratio_c``): with ``A < 0``
    the loss ``-ratio * A`` grows without bound as the ratio does (a token the sampler gave far less
    probability than the policy now does), so past ``ratio > clip_ratio_c`` it is held at
    ``-clip_ratio_c * A``, with no gradient. 0: off.

    Returns ``(per_token_loss, clipped_mask)``, both of the broadcast shape; ``clipped_mask`` is
    True where a clipped term is taken, i.e. where the token gets no gradient:
    ``ratio > 1 + clip_high`` with ``A > 0``, or with ``A < 0`` ``ratio < 1 - clip_low`` (or
    ``ratio > clip_ratio_c``).
    """
    if not 0 <= clip_low <= 1:
        raise ConfigError(f"clip_low must be in [0, 1] (the ratio is clipped at 1 - clip_low), got {clip_low}")
    if not clip_high >= 0:
        raise ConfigError(f"clip_high must be >= 0 (the ratio is clipped at 1 + clip_high), got {clip_high}")
    if not (clip_ratio_c == 0 or clip_ratio_c > 1):
        raise ConfigError(f"clip_ratio_c must be 0 (off) or above 1 (the ratio past which a negative advantage's "
                          f"loss stops growing), got {clip_ratio_c}")
    advantages = _per_sequence(advantages, logp)
    ratio = torch.exp(ppo_log_ratio(logp, old_logp, ratio_level=ratio_level, mask=mask, sequence_ids=sequence_ids))
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    clipped_mask = ((ratio > 1.0 + clip_high) & (advantages > 0)) | ((ratio < 1.0 - clip_low) & (advantages < 0))
    if clip_ratio_c:
        capped = (ratio.detach() > clip_ratio_c) & (advantages < 0)
        loss = torch.where(capped, -clip_ratio_c * advantages, loss)
        clipped_mask = clipped_mask | capped
    return loss, clipped_mask.expand_as(loss)


def ppo_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, *, ratio_level: str = "token",
                  mask: torch.Tensor | None = None, sequence_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The PPO ratio's log per position: ``logp - old_logp`` (clamped), or with
    ``ratio_level="sequence"`` its mean over each sequence's trained tokens, in GSPO's token form
    (see :func:`ppo_clip_token_losses`)."""
    if ratio_level not in RATIO_LEVELS:
        raise ConfigError(f"ratio_level must be one of {RATIO_LEVELS}, got {ratio_level!r}")
    log_ratio = _log_ratio(logp, old_logp)
    if ratio_level == "sequence":
        if mask is None:
            raise ConfigError("ratio_level='sequence' needs the loss mask: a sequence's ratio is a mean over its "
                              "trained tokens")
        # (logp - sg[logp]) first: exactly 0, so every token of a sequence holds exactly its ratio
        # (the other order rounds to an ulp of |logp|, enough to split a sequence at the clip edge).
        log_ratio = sequence_mean_per_position(log_ratio.detach(), mask, sequence_ids) + (logp - logp.detach())
    return log_ratio


def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    values, mask = torch.broadcast_tensors(values, mask.to(values.dtype))
    return torch.where(mask != 0, values * mask, torch.zeros_like(values))


def _safe_divide(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    # An empty mask gives 0 / 1 = 0 (and zero gradients), never 0 / 0.
    return numerator / torch.where(denominator > 0, denominator, torch.ones_like(denominator))


def token_mean(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum(loss * mask) / sum(mask)``: every trained token of the batch weighs the same
    (DAPO's token-level loss). An all-zero mask gives 0. A mask that broadcasts to ``loss``'s
    shape (e.g. ``[B, 1]``, one weight per row) counts once per position it covers, as in the
    numerator and in the other aggregations."""
    weights = torch.broadcast_to(mask, loss.shape)
    return _safe_divide(_masked(loss, mask).sum(), weights.sum().to(loss.dtype))


def sequence_mean(loss: torch.Tensor, mask: torch.Tensor, sequence_ids: torch.Tensor | None = None) -> torch.Tensor:
    """``mean over sequences b with n_b > 0 of (sum_t loss_bt * mask_bt / n_b)``, ``n_b = sum_t mask_bt``.

    Each sequence weighs the same whatever its length (the original GRPO aggregation). Sequences
    with no trained token are skipped; if there are none, the result is 0. A sequence is a row,
    or, with ``sequence_ids`` (packed rows, :mod:`rftgym.train.packing`), the positions sharing an
    id >= 0 (-1: padding, which must be masked).
    """
    sums, counts, slots = _per_sequence_sums(loss, mask, sequence_ids)
    if slots is not None:  # the last slot gathers the padding
        sums, counts = sums[:-1], counts[:-1]
    return _safe_divide(_safe_divide(sums, counts).sum(), (counts > 0).sum().to(loss.dtype))


def _per_sequence_sums(values: torch.Tensor, mask: torch.Tensor, sequence_ids: torch.Tensor | None):
    """``(sums, counts, slots)``: per sequence, the sum of ``values`` over its trained positions and
    their number. A sequence is a row (``slots`` None), or with ``sequence_ids`` the positions
    sharing an id: ``slots`` then maps each position to its sequence's entry, padding (-1) to an
    extra last one. There are at most as many sequences as positions, so that many entries need no
    read of the largest id from the device."""
    masked = _masked(values, mask)
    weights = torch.broadcast_to(mask, values.shape).to(values.dtype)
    if sequence_ids is None:
        return masked.sum(dim=-1), weights.sum(dim=-1), None
    slots = torch.where(sequence_ids >= 0, sequence_ids, sequence_ids.numel()).reshape(-1)
    sums = values.new_zeros(sequence_ids.numel() + 1).index_add(0, slots, masked.reshape(-1))
    counts = weights.new_zeros(sequence_ids.numel() + 1).index_add(0, slots, weights.reshape(-1))
    return sums, counts, slots


def constant_normalizer(loss: torch.Tensor, mask: torch.Tensor, normalizer: float) -> torch.Tensor:
    """``sum(loss * mask) / normalizer`` with a constant normalizer (Dr.GRPO: e.g. max response
    length * number of sequences), so a token's weight does not depend on the lengths of the
    other responses in the batch."""
    if not normalizer > 0:
        raise ConfigError(f"the loss normalizer must be > 0 (e.g. max_response_length * batch_size), got {normalizer}")
    return _masked(loss, mask).sum() / normalizer


AGGREGATIONS: dict[str, Callable[..., torch.Tensor]] = {
    "token_mean": token_mean,
    "sequence_mean": sequence_mean,
    "constant_normalizer": constant_normalizer,
}


def aggregate(name: str, loss: torch.Tensor, mask: torch.Tensor, normalizer: float | None = None,
              sequence_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Reduce a per-token loss to a scalar with ``AGGREGATIONS[name]``.

    ``normalizer`` is required by (and only used by) ``"constant_normalizer"``; ``sequence_ids``
    (packed rows) by ``"sequence_mean"``, the only aggregation that depends on where sequences are.
    """
    if name not in AGGREGATIONS:
        raise ConfigError(f"unknown loss aggregation {name!r}; choose one of {sorted(AGGREGATIONS)}")
    if name == "constant_normalizer":
        if normalizer is None:
            raise ConfigError(
                "loss aggregation 'constant_normalizer' needs a normalizer "
                "(e.g. max_response_length * batch_size); set one or choose 'token_mean'"
            )
        return constant_normalizer(loss, mask, normalizer)
    if name == "sequence_mean":
        return sequence_mean(loss, mask, sequence_ids)
    return AGGREGATIONS[name](loss, mask)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(policy || reference) on tokens sampled from the policy::

        d  = ref_logp - logp        (clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP])
        k3 = exp(d) - d - 1         (>= 0, since exp(d) >= 1 + d)

    Unbiased (``E_policy[exp(d) - 1] = 0``) with low variance (Schulman, "Approximating KL
    divergence"), as used by GRPO.
    """
    d = _log_ratio(ref_logp, logp)
    return torch.exp(d) - d - 1.0


def _check_shapes(logp: torch.Tensor, **others: torch.Tensor | None) -> None:
    """A ValueError naming a tensor whose shape is not ``logp``'s ([batch, seq]): broadcasting would
    otherwise train on a loss of mismatched rows without a word."""
    if logp.dim() != 2:
        raise ValueError(f"logp must be [batch, seq] (one log-prob per position), got shape {tuple(logp.shape)}")
    for name, tensor in others.items():
        if tensor is not None and tensor.shape != logp.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, logp {tuple(logp.shape)}: give one value per "
                             "position of logp")


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    aggregation: str = "token_mean",
    normalizer: float | None = None,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    entropy: torch.Tensor | None = None,
    sequence_ids: torch.Tensor | None = None,
    ratio_level: str = "token",
    clip_ratio_c: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The scalar policy-gradient loss and its diagnostics.

    ::

        loss = aggregate(ppo_clip_token_losses(logp, old_logp, A)) + kl_coef * aggregate(kl_k3(logp, ref_logp))

    both aggregated with the same ``aggregation`` over ``mask`` (``sequence_ids``: packed rows,
    see :func:`sequence_mean`); ``ratio_level="sequence"``: GSPO's ratio, ``clip_ratio_c``: dual
    clip (see :func:`ppo_clip_token_losses`). The KL term needs ``ref_logp``
    when ``kl_coef > 0``; with ``kl_coef == 0`` a given ``ref_logp`` is only reported.

    Stats (detached 0-dim tensors on the loss's device, so that computing them never waits for
    the device: the training loop reads all of an update's stats back at once; means are token
    means over ``mask`` whatever the aggregation):
    ``pg_loss`` (the aggregated clipped loss), ``clip_fraction`` (share of clipped tokens), split
    into ``clip_fraction_high`` (ratio above ``1 + clip_high`` with a positive advantage: the
    policy moved too far towards a good token) and ``clip_fraction_low`` (below ``1 - clip_low``,
    negative advantage: too far from a bad one) and, with ``clip_ratio_c``, ``clip_fraction_dual``
    (above ``clip_ratio_c`` with a negative advantage),
    ``approx_kl`` (k3 estimate of KL(old || current) from ``r = exp(logp - old_logp)``:
    ``r - 1 - log r``), ``ratio_mean``, ``kl_ref`` (if ``ref_logp``), ``entropy`` (if given;
    ``entropy`` is only reported, it is not a bonus in the loss).
    """
    if not (is_finite_real(kl_coef) and kl_coef >= 0):
        raise ConfigError(f"kl_coef must be a finite number >= 0, got {kl_coef!r}")
    _check_shapes(logp, old_logp=old_logp, mask=mask, ref_logp=ref_logp, entropy=entropy, sequence_ids=sequence_ids)
    if advantages.shape not in (logp.shape[:1], (*logp.shape[:1], 1), logp.shape):
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}; with logp of shape {tuple(logp.shape)} it is "
                         f"one per sequence ({tuple(logp.shape[:1])} or {(*logp.shape[:1], 1)}) or one per token "
                         f"({tuple(logp.shape)})")
    if kl_coef > 0 and ref_logp is None:
        raise ConfigError(f"kl_coef={kl_coef} needs reference log-probs (ref_logp); pass them or set kl_coef=0")
    per_token, clipped = ppo_clip_token_losses(logp, old_logp, advantages, clip_low, clip_high, ratio_level=ratio_level,
                                               mask=mask, sequence_ids=sequence_ids, clip_ratio_c=clip_ratio_c)
    pg_loss = aggregate(aggregation, per_token, mask, normalizer, sequence_ids)
    loss = pg_loss
    kl = None
    if ref_logp is not None:
        kl = kl_k3(logp, ref_logp)
        if kl_coef > 0:
            loss = loss + kl_coef * aggregate(aggregation, kl, mask, normalizer, sequence_ids)

    with torch.no_grad():
        def masked_mean(values: torch.Tensor) -> torch.Tensor:
            return token_mean(values.detach().to(torch.float32), mask)

        log_ratio = _log_ratio(logp.detach(), old_logp)
        # A token is clipped above only with a positive advantage and below only with a negative one.
        positive = (advantages if advantages.dim() == logp.dim() else advantages.reshape(-1, 1)) > 0
        capped = torch.zeros_like(clipped)
        if clip_ratio_c:  # (the ratio the loss took, per sequence under GSPO)
            ratio = torch.exp(ppo_log_ratio(logp.detach(), old_logp, ratio_level=ratio_level, mask=mask,
                                            sequence_ids=sequence_ids))
            capped = clipped & ~positive & (ratio > 1)
        stats = {
            "pg_loss": pg_loss.detach(),
            "clip_fraction": masked_mean(clipped),
            "clip_fraction_high": masked_mean(clipped & positive),
            "clip_fraction_low": masked_mean(clipped & ~positive & ~capped),
            "approx_kl": masked_mean(kl_k3(old_logp, logp.detach())),
            "ratio_mean": masked_mean(torch.exp(log_ratio)),
        }
        if clip_ratio_c:
            stats["clip_fraction_dual"] = masked_mean(capped)
        if kl is not None:
            stats["kl_ref"] = masked_mean(kl)
        if entropy is not None:
            stats["entropy"] = masked_mean(entropy)
    return loss, stats
