"""One optimisation pass over a step's training samples (:func:`optimise`): minibatches, each
split into forward/backward passes (gradient accumulation), the loss of each pass, one optimizer
step per minibatch; and :func:`recompute_old_logprobs`, the PPO ratio's old log-probs taken from
the training forward pass.

The loss math is :mod:`rftgym.train.losses`' (pure functions); what is here moves batches to the
device, computes their log-probs (the decoder, then :mod:`~rftgym.train.token_logprobs`' chunked
vocabulary projection, on trained positions only) and combines the passes, minibatches and ranks
so that the result is the one mean a single process would compute over all samples.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace

import torch

from .batching import TrainSample, collate
from .config import TrainConfig
from .distributed import Distributed, ShardedModel, full_tensor
from .losses import aggregate, policy_loss, token_mean, truncated_importance_weights
from .master_weights import gradient_tensors
from .microbatches import plan_passes
from .packing import collate_packed
from .speed import is_right_padded, tag_right_padding
from .token_logprobs import chunked_token_logprobs, logit_transform


def optimise(model, reference, optimizer, samples: list[TrainSample], config: TrainConfig, pad_id: int,
             generator: torch.Generator, ranks: Distributed | None = None, autocast=nullcontext) -> dict[str, float]:
    """``epochs_per_step`` passes of minibatch updates over ``samples``; mean stats.

    With several ranks, every rank runs the largest rank's number of minibatches (a rank that
    has run out contributes zero gradients), and each minibatch's loss is the aggregation over
    all ranks' samples together (a token mean weighs every token of every rank alike), as one
    process would compute it over the union; gradients are averaged before each step. Under FSDP
    (``model`` a :class:`ShardedModel`) the forward and backward passes hold the collectives, so
    every rank runs the largest rank's number of passes
    (zero-weighted padding passes where it has fewer microbatches, or none), and FSDP's
    reduce-scatter does the averaging.

    Nothing is read back from the device until every minibatch has been queued (the stats stay
    0-dim device tensors until then), so on a GPU the host prepares the next kernels while the
    device runs the previous ones; the stats are read back at once at the end.
    """
    ranks = ranks or Distributed()
    sharded = isinstance(model, ShardedModel)
    device = next(model.parameters()).device
    # The gradients to average and clip (float32 masters hold them for a 16-bit model).
    trainable = gradient_tensors(optimizer, [p for p in model.parameters() if p.requires_grad])
    size, aggregation = config.minibatch_size, config.aggregation
    orders = [torch.randperm(len(samples), generator=generator).tolist() for _ in range(config.epochs_per_step)]
    # Each epoch's minibatches, each split into its forward/backward passes.
    planned = [[microbatches([samples[i] for i in order[k:k + size]], config) for k in range(0, len(samples), size)]
               for order in orders]
    # Every rank's sample count and, per minibatch, what its loss is a mean over (trained tokens or
    # sequences) and its number of passes: a minibatch's loss is one mean over all ranks' samples,
    # as in one process, so each rank weighs its share by its own count over the total; under FSDP
    # every rank runs the most passes any rank has.
    own = (len(samples), [[(normalizer_count(flat := [s for part in parts for s in part], aggregation), len(parts),
                            normalizer_count(flat, "token_mean")) for parts in epoch] for epoch in planned])
    per_rank = ranks.gather_objects(own)
    minibatches = max(-(-n // size) for n, _ in per_rank)
    if minibatches == 0:
        return {"loss": None, "grad_norm": None, "updates": 0}
    totals: dict[str, torch.Tensor] = {}
    grad_norms: torch.Tensor | float = 0.0
    updates = 0
    for epoch in range(len(orders)):
        for index in range(minibatches):
            parts = planned[epoch][index] if index < len(planned[epoch]) else []
            optimizer.zero_grad(set_to_none=True)
            chunk_sizes = [min(size, max(0, n - index * size)) for n, _ in per_rank]
            contributors = sum(n > 0 for n in chunk_sizes)
            if aggregation == "constant_normalizer":  # a sum over a fixed normalizer of world x minibatch
                share = 1.0 / ranks.world_size
            else:
                counts = [c[epoch][index][0] if index < len(c[epoch]) else 0 for _, c in per_rank]
                share = counts[ranks.rank] / sum(counts) if sum(counts) else 0.0
            # The token-mean statistics (entropy, clip fraction, ...) combine by trained tokens.
            tokens = [c[epoch][index][2] if index < len(c[epoch]) else 0 for _, c in per_rank]
            token_share = tokens[ranks.rank] / sum(tokens) if sum(tokens) else 0.0
            # The gradients are then divided by the contributing ranks (DDP) or by all of them
            # (FSDP's reduce-scatter); scaled by that divisor, this rank's loss enters as its share.
            scale = share * (ranks.world_size if sharded else contributors)
            if sharded:
                passes = max(c[epoch][index][1] if index < len(c[epoch]) else 0 for _, c in per_rank)
                loss, stats = _accumulate(model, reference, parts, config, pad_id, device, autocast,
                                          passes=passes, scale=scale)
            else:
                loss, stats = _accumulate(model, reference, parts, config, pad_id, device, autocast, scale=scale)
                # A rank that has run out still joins the average (with zero gradients).
                ranks.average_gradients(trainable, contributed=bool(parts))
            # Sharded gradients: the norm is a DTensor over all shards, so every rank clips alike.
            grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(trainable, config.max_grad_norm))
            optimizer.step()
            updates += 1
            # The gradient (and its norm) is every rank's. The loss and its stats are this rank's
            # own, weighed by its share as in the gradient: summed over the ranks below, they make
            # the minibatch's loss as one process would compute it.
            grad_norms = grad_norms + grad_norm.detach()
            if loss is None:
                continue
            for key, value in {"loss": loss, **stats}.items():
                totals[key] = totals.get(key, 0.0) + value * (share if key in ("loss", "pg_loss") else token_share)
    if not updates:
        return {"loss": None, "grad_norm": None, "updates": 0}
    sums = read_back({**totals, "grad_norm": grad_norms})  # one wait for the device, at the end
    grad_norm = sums.pop("grad_norm") / updates
    merged: dict[str, float] = {}
    for rank_sums in ranks.gather_objects(sums):  # every rank reports every rank's loss, not its own
        for key, value in rank_sums.items():
            merged[key] = merged.get(key, 0.0) + value
    if not merged:
        return {"loss": None, "grad_norm": grad_norm, "updates": updates}
    return {**{key: value / updates for key, value in merged.items()}, "grad_norm": grad_norm, "updates": updates}


def recompute_old_logprobs(model, samples: list[TrainSample], config: TrainConfig, pad_id: int,
                           ranks: Distributed | None = None, autocast=nullcontext) -> tuple[list[TrainSample], dict]:
    """``samples`` with the PPO ratio's old log-probs recomputed by the model as the update computes
    them (``old_logprobs="recompute"``, as verl does), and how far the rollout's were from them.

    The rollout's log-probs come from the decode kernels (a KV cache, CUDA graphs, bf16 in another
    order); the update's from the training forward pass. Their gap makes the first ratio differ
    from 1 by noise alone, which the clip then treats as a policy change. The recomputed ones are
    the update's own numbers before its first step. Reported, over every rank's trained tokens:
    ``old_logprob_gap`` (mean absolute difference) and ``old_logprob_gap_max``.

    With ``rollout_is_cap > 0`` each trained token's advantage is also multiplied by its truncated
    importance weight (:func:`~.losses.truncated_importance_weights` of the recomputed and the
    rollout log-probs): the same as weighting its PPO loss, which a positive factor passes through.
    Reported: ``rollout_is_weight_mean`` and ``rollout_is_capped`` (the share of tokens at the cap).
    """
    ranks = ranks or Distributed()
    device = next(model.parameters()).device
    sharded = isinstance(model, ShardedModel)
    plan = _pass_plan(samples, config, no_grad=True)
    # FSDP's forward holds collectives: every rank runs the largest rank's number of passes.
    passes = max(ranks.gather_objects(len(plan))) if sharded else len(plan)
    values, owners = [], []
    with torch.no_grad():
        for index in range(passes):
            part = [samples[i] for i in plan[index]] if index < len(plan) else None
            host = (collate_packed(part, pad_id) if config.pack_sequences else collate(part, pad_id)) if part \
                else padding_batch(pad_id)
            with autocast():
                logp, _ = batch_logprobs(model, to_device(host, device), config)
            if part:
                values.append(logp.float())
                owners.append((host.get("sequence_ids"), len(part)))
    if sharded:
        # A forward without gradients leaves the root's parameters gathered (no backward pass
        # reshards them), and the update's backward would then reduce the wrong tensors.
        model.reshard()
    # The first .cpu() waits for the device, once.
    predicted = [lp for part, owner in zip(values, owners) for lp in _per_sample(part.cpu(), *owner)]
    row_of = dict(zip((i for indices in plan for i in indices), predicted))
    out, gaps, weights = [], [], []
    cap = config.rollout_is_cap
    for index, sample in enumerate(samples):
        row = row_of[index]
        # row[t - 1] is the log-prob of token t (position p predicts token p + 1).
        trained = [t for t in range(1, len(sample.token_ids)) if sample.loss_mask[t]]
        old = list(sample.old_logprobs)
        recomputed = [row[t - 1] for t in trained]
        gaps += [abs(new - old[t]) for t, new in zip(trained, recomputed)]
        advantages = sample.advantages
        if cap and trained:
            weight = truncated_importance_weights(torch.tensor(recomputed, dtype=torch.float64),
                                                  torch.tensor([old[t] for t in trained], dtype=torch.float64), cap)
            weights += weight.tolist()
            advantages = list(advantages)
            for t, w in zip(trained, weight.tolist()):
                advantages[t] *= w
        for t, new in zip(trained, recomputed):
            old[t] = new
        out.append(replace(sample, old_logprobs=old, advantages=advantages))
    # Over every rank's trained tokens, as the update's own statistics are (every rank calls this,
    # with or without samples, so the collectives match).
    gap_sum, gap_count, weight_sum, capped = ranks.sum_floats(
        [sum(gaps), len(gaps), sum(weights), sum(w >= cap for w in weights)])
    gap_max = max((g for g in ranks.gather_objects(max(gaps, default=None)) if g is not None), default=None)
    if not gap_count:
        return out, {}
    stats = {"old_logprob_gap": gap_sum / gap_count, "old_logprob_gap_max": gap_max}
    if cap:
        stats.update(rollout_is_weight_mean=weight_sum / gap_count, rollout_is_capped=capped / gap_count)
    return out, stats


def microbatches(samples: list[TrainSample], config: TrainConfig) -> list[list[TrainSample]]:
    """``samples`` split into forward/backward passes by ``microbatch_size`` or ``microbatch_tokens``
    (:func:`~rftgym.train.microbatches.plan_passes`)."""
    return [[samples[i] for i in indices] for indices in _pass_plan(samples, config)]


def _pass_plan(samples: list[TrainSample], config: TrainConfig, *, no_grad: bool = False) -> list[list[int]]:
    # Without gradients (old_logprobs="recompute") and without a limit, a pass takes a minibatch.
    per_pass = config.microbatch_size or (config.minibatch_size if no_grad and not config.microbatch_tokens else 0)
    return plan_passes([len(s.token_ids) for s in samples], samples_per_pass=per_pass,
                       tokens_per_pass=config.microbatch_tokens, packed=config.pack_sequences)


def normalizer_count(samples: list[TrainSample], aggregation: str) -> int:
    """What ``aggregation``'s mean divides by over ``samples``: trained tokens (token_mean), sequences
    with a trained token (sequence_mean), or the sample count (constant_normalizer). A sample's
    first token is never predicted, so its mask counts from the second token."""
    if aggregation == "token_mean":
        return sum(sum(s.loss_mask[1:]) for s in samples)
    if aggregation == "sequence_mean":
        return sum(1 for s in samples if any(s.loss_mask[1:]))
    return len(samples)


def microbatch_weights(parts: list[list[TrainSample]], aggregation: str) -> list[float]:
    """How much each microbatch's own aggregated loss weighs in the minibatch's: its share of the
    trained tokens (token_mean), of the sequences with trained tokens (sequence_mean), or 1
    (constant_normalizer, a plain sum over a fixed normalizer)."""
    if aggregation == "constant_normalizer":
        return [1.0] * len(parts)
    counts = [normalizer_count(part, aggregation) for part in parts]
    total = sum(counts)
    return [c / total if total else 0.0 for c in counts]


def _accumulate(model, reference, parts: list[list[TrainSample]], config: TrainConfig, pad_id: int, device,
                autocast, *, passes: int = 0, scale: float = 1.0):
    """Backward over a minibatch split into forward/backward passes (``parts``, from
    :func:`microbatches`: gradient accumulation, the same gradient as one pass with one part's
    activations at a time), each loss times ``scale``; then zero-weighted padding passes up to
    ``passes`` in all (FSDP: every rank must run as many forward/backward passes, since those hold
    the collectives). Returns the minibatch's loss and stats (stats weighted like the loss; 0-dim
    tensors, nothing is read back from the device), or ``(None, {})`` for no parts."""
    # The loss (and pg_loss) combine as the aggregation does; the other stats are token means.
    loss_weights = microbatch_weights(parts, config.aggregation)
    token_weights = microbatch_weights(parts, "token_mean")
    total_loss, stats = 0.0, {}
    for part, weight, token_weight in zip(parts, loss_weights, token_weights):
        batch = to_device(collate_packed(part, pad_id) if config.pack_sequences else collate(part, pad_id), device)
        loss, part_stats, _ = _batch_loss(model, reference, batch, config, autocast)
        (loss * (weight * scale)).backward()
        total_loss = total_loss + loss.detach() * weight
        for key, value in part_stats.items():
            share = weight if key == "pg_loss" else token_weight
            stats[key] = stats.get(key, 0.0) + value * share
    for _ in range(len(parts), passes):
        batch = to_device(padding_batch(pad_id), device)
        _, _, logp = _batch_loss(model, reference, batch, config, autocast)
        # logp times zero, not the loss: the loss of a fully masked batch need not be finite.
        (logp * 0.0).sum().backward()
    return (total_loss, stats) if parts else (None, {})


def _batch_loss(model, reference, batch, config: TrainConfig, autocast):
    """The minibatch's loss (aggregated over its own tokens), its stats (0-dim tensors, still on
    the device), and the log-probs."""
    with autocast():
        logp, entropy = batch_logprobs(model, batch, config, with_entropy=True)
        ref_logp = reference_logprobs(model, reference, batch, config)
    mask = batch["loss_mask"]
    normalizer = config.minibatch_size * config.max_new_tokens if config.aggregation == "constant_normalizer" else None
    if config.algo == "rft":  # supervised: the negative log-likelihood of the sampled tokens
        loss = aggregate(config.aggregation, -logp, mask, normalizer=normalizer, sequence_ids=batch.get("sequence_ids"))
        return loss, {"pg_loss": loss.detach(), "entropy": token_mean(entropy.detach(), mask)}, logp
    loss, stats = policy_loss(
        logp, batch["old_logprobs"], batch["advantages"], mask,
        clip_low=config.clip_low, clip_high=config.clip_high, aggregation=config.aggregation,
        normalizer=normalizer, ref_logp=ref_logp, kl_coef=config.kl_coef, entropy=entropy.detach(),
        sequence_ids=batch.get("sequence_ids"), ratio_level=config.ratio_level, clip_ratio_c=config.clip_ratio_c,
    )
    return loss, stats, logp


def batch_logprobs(model, batch: dict[str, torch.Tensor], config: TrainConfig, with_entropy: bool = False):
    """Log-probs of each next token, computed from the final hidden states in vocabulary chunks."""
    if isinstance(model, ShardedModel):  # FSDP: through the root's forward, whose hooks gather parameters
        return model(batch, config, with_entropy)
    return decoder_logprobs(model, batch, config, with_entropy)


def decoder_logprobs(model, batch: dict[str, torch.Tensor], config: TrainConfig, with_entropy: bool = False):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    # Packed rows (rftgym.train.packing) carry position ids that restart at each sample, and no
    # padding mask; the decoder then attends within each sample only.
    hidden = base.get_decoder()(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                                position_ids=batch.get("position_ids"), use_cache=False).last_hidden_state
    weight = base.get_output_embeddings().weight
    options = dict(temperature=config.temperature, chunk_size=config.logprob_chunk_size, with_entropy=with_entropy,
                   transform=logit_transform(base.config))
    targets, index = batch["targets"], batch.get("trained_index")
    if index is None or index.numel() == 0:  # every position (e.g. a padding pass that trains nothing)
        return chunked_token_logprobs(hidden[:, :-1], weight, targets, **options)
    # The loss, the KL term and the reported entropy are all taken over the loss mask, so only
    # trained positions need the vocabulary projection: prompts, tool output and padding skip it.
    # Position t of row b is index b * (T - 1) + t of the targets and b * T + t of the hidden states.
    width = targets.shape[1]
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index + index // width)
    logp, entropy = chunked_token_logprobs(rows.unsqueeze(0), weight, targets.reshape(-1)[index].unsqueeze(0),
                                           **options)
    return _spread(logp, index, targets.shape), (None if entropy is None else _spread(entropy, index, targets.shape))


def _spread(values: torch.Tensor, index: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``values`` ``[1, K]`` placed at the flat positions ``index`` of a zero tensor of ``shape``."""
    return values.new_zeros(shape.numel()).index_copy(0, index, values[0]).view(shape)


def reference_logprobs(model, reference, batch, config: TrainConfig):
    if reference is None:
        return None
    context = model.disable_adapter() if reference == "adapters-off" else nullcontext()
    with torch.no_grad(), context:
        logp, _ = batch_logprobs(model if reference == "adapters-off" else reference, batch, config)
    return logp


def to_device(batch: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    """A collated (host) batch on ``device``, copied without waiting for the device.

    A plain copy from pageable memory to a GPU waits until the device has finished all work
    queued before it (the previous microbatch's backward pass), and then the host has nothing
    queued while it prepares the next pass. From pinned memory the copy is queued like a kernel.
    The attention mask is checked for right padding here, on the host, and tagged
    (:func:`~rftgym.train.speed.tag_right_padding`), so the decoder's mask hook need not read
    the mask back from the device.
    """
    device = torch.device(device)
    pin = device.type == "cuda"
    # Only a contiguous pinned tensor is copied asynchronously: for a strided view (e.g. a slice)
    # PyTorch first makes a pageable contiguous copy, and the transfer from it waits for the device.
    moved = {key: (value.contiguous().pin_memory() if pin else value).to(device, non_blocking=pin)
             for key, value in batch.items()}
    if "attention_mask" in moved:
        tag_right_padding(moved["attention_mask"], is_right_padded(batch["attention_mask"]))
    return moved


def padding_batch(pad_id: int) -> dict[str, torch.Tensor]:
    """A two-token batch that trains nothing (its loss mask is zero): FSDP's stand-in minibatch."""
    return collate([TrainSample(token_ids=[pad_id, pad_id], loss_mask=[0, 0], old_logprobs=[0.0, 0.0],
                                advantages=[0.0, 0.0], group=-1, episode=-1)], pad_id)


def _per_sample(logp: torch.Tensor, sequence_ids: torch.Tensor | None, count: int) -> list[list[float]]:
    """Each sample's log-probs, in order, from a padded batch (one sample per row) or a packed one
    (``sequence_ids`` names the sample of each position; a sample's positions come in order)."""
    if sequence_ids is None:
        return logp.tolist()
    owner = sequence_ids.reshape(-1)
    order = torch.argsort(owner, stable=True)  # by sample, each sample's positions in order
    lengths = torch.bincount(owner + 1, minlength=count + 1).tolist()  # padding (-1) first
    return [part.tolist() for part in torch.split(logp.reshape(-1)[order], lengths)[1:]]


def read_back(values: dict[str, torch.Tensor | float], divisor: int = 1) -> dict[str, float]:
    """``values / divisor`` as Python floats, read from the device in one transfer (one wait)."""
    keys = list(values)
    tensors = [torch.as_tensor(values[key]).detach() for key in keys]
    device = next((t.device for t in tensors if t.device.type != "cpu"), torch.device("cpu"))
    # float64 where the device has it, so that float64 runs report their full precision.
    dtype = torch.float32 if device.type == "mps" else torch.float64
    stacked = torch.stack([t.reshape(()).to(device=device, dtype=dtype) for t in tensors])
    return dict(zip(keys, (stacked / divisor).tolist()))
