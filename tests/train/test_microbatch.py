"""Gradient accumulation (``microbatch_size``, ``microbatch_tokens``): the same update as one pass over the
minibatch."""

from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch

from rftgym.core.errors import ConfigError
from rftgym.train.batching import TrainSample
from rftgym.train.config import TrainConfig
from rftgym.train.update import microbatch_weights, optimise
from rftgym.train.microbatches import pass_tokens, plan_passes
from support import tiny_llama


def samples():
    """Five sequences of different lengths and trained-token counts (one with none)."""
    rng = torch.Generator().manual_seed(1)
    out = []
    for index, (n, prompt) in enumerate([(9, 2), (5, 4), (7, 3), (4, 4), (8, 1)]):
        ids = torch.randint(3, 40, (n,), generator=rng).tolist()
        mask = [0] * prompt + [1] * (n - prompt)
        old = (-torch.rand(n, generator=rng) * 3).tolist()
        adv = [0.0] * prompt + [float(torch.randn(1, generator=rng))] * (n - prompt)
        out.append(TrainSample(ids, mask, old, adv, index // 2, index))
    return out


def test_weights_by_aggregation():
    data = samples()  # trained tokens per sample: 7, 1, 4, 0, 7; sequences with tokens: 4
    parts = [data[:2], data[2:4], data[4:]]
    assert microbatch_weights(parts, "token_mean") == pytest.approx([8 / 19, 4 / 19, 7 / 19])
    assert microbatch_weights(parts, "sequence_mean") == pytest.approx([2 / 4, 1 / 4, 1 / 4])
    assert microbatch_weights(parts, "constant_normalizer") == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("split", [{"microbatch_size": 2}, {"microbatch_tokens": 16},
                                   {"microbatch_tokens": 16, "pack_sequences": True}],
                         ids=["samples", "tokens", "tokens-packed"])
@pytest.mark.parametrize("algo, aggregation", [("grpo", "token_mean"), ("grpo", "sequence_mean"),
                                               ("dr_grpo", "constant_normalizer"), ("rft", "token_mean")])
def test_microbatches_give_the_same_update_as_one_pass(algo, aggregation, split):
    base = tiny_llama()
    results = []
    for options in ({}, split):
        model = copy.deepcopy(base)
        config = TrainConfig(algo=algo, aggregation=aggregation, minibatch_size=5, max_new_tokens=8, kl_coef=0.0,
                             group_size=2, learning_rate=1e-2, **options)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        stats = optimise(model, None, optimizer, samples(), config, 0, torch.Generator().manual_seed(0))
        results.append((stats, {n: p.detach().clone() for n, p in model.named_parameters()}))
    (full_stats, full), (micro_stats, micro) = results
    assert full_stats["updates"] == micro_stats["updates"] == 1
    assert micro_stats["loss"] == pytest.approx(full_stats["loss"], rel=1e-4, abs=1e-6)
    assert micro_stats["grad_norm"] == pytest.approx(full_stats["grad_norm"], rel=1e-4)
    # The reported means are the minibatch's too (they were summed under constant_normalizer).
    for key in ("pg_loss", "entropy", "clip_fraction", "approx_kl", "ratio_mean"):
        if key in full_stats:
            assert micro_stats[key] == pytest.approx(full_stats[key], rel=1e-4, abs=1e-6), key
    moved = max((full[n] - base.state_dict()[n]).abs().max() for n in full)
    assert moved > 0  # the update did something, so the comparison below means something
    for name in full:
        torch.testing.assert_close(micro[name], full[name], rtol=1e-4, atol=1e-6)


def test_config_checks():
    with pytest.raises(ConfigError, match="microbatch_size"):
        TrainConfig(microbatch_size=-1)
    with pytest.raises(ConfigError, match="microbatch_tokens must be an int >= 0"):
        TrainConfig(microbatch_tokens=-5)
    with pytest.raises(ConfigError, match="two ways to size a forward/backward pass; set one"):
        TrainConfig(microbatch_size=4, microbatch_tokens=4096)
    TrainConfig(parallelism="fsdp", minibatch_size=16, microbatch_size=4)  # supported (tests/train/test_distributed.py)


def test_pass_tokens_by_hand():
    assert pass_tokens([], packed=False) == 0
    assert pass_tokens([4, 9, 5], packed=False) == 27  # 3 rows of 9
    assert pass_tokens([4, 9, 5], packed=True) == 18  # rows of 9: [9], [5, 4]
    assert pass_tokens([9, 9, 2], packed=True) == 27  # rows of 9: [9], [9], [2]; no row has room for 2


def test_plan_passes_by_hand():
    lengths = [9, 5, 7, 4, 8]  # shortest first: indices 3 (4), 1 (5), 2 (7), 4 (8), 0 (9)
    assert plan_passes([]) == []
    assert plan_passes(lengths) == [[0, 1, 2, 3, 4]]  # no limit: one pass, as given
    assert plan_passes(lengths, samples_per_pass=5) == [[0, 1, 2, 3, 4]]
    assert plan_passes(lengths, samples_per_pass=2) == [[3, 1], [2, 4], [0]]
    # Padded, a pass costs rows x longest: [4, 5] = 10, + 7 -> 21 > 16; [7, 8] = 16, + 9 -> 27.
    assert plan_passes(lengths, tokens_per_pass=16) == [[3, 1], [2, 4], [0]]
    assert plan_passes(lengths, tokens_per_pass=21) == [[3, 1, 2], [4, 0]]
    # Packed into rows as wide as the longest: [4, 5] is 2 rows x 5 = 10; + 7: rows 7 | 5 | 4 = 21.
    assert plan_passes(lengths, tokens_per_pass=16, packed=True) == [[3, 1], [2, 4], [0]]
    # [4, 5, 7, 8]: rows 8 | 7 | 5 | 4 = 32; + 9: rows 9 | 8 | 7 | 5+4 = 36, all in one pass.
    assert plan_passes(lengths, tokens_per_pass=36, packed=True) == [[3, 1, 2, 4, 0]]
    assert plan_passes(lengths, tokens_per_pass=36, packed=False) == [[3, 1, 2, 4], [0]]  # 4 x 8 = 32; 5 x 9 = 45
    # A sample longer than the budget has a pass of its own.
    assert plan_passes([3, 50, 4], tokens_per_pass=10) == [[0, 2], [1]]
    with pytest.raises(ValueError, match="not both"):
        plan_passes(lengths, samples_per_pass=2, tokens_per_pass=16)


def test_microbatches_group_samples_of_like_length(monkeypatch):
    from rftgym.train import update

    seen = []
    real = update.collate
    monkeypatch.setattr(update, "collate", lambda part, pad: seen.append([len(s.token_ids) for s in part])
                        or real(part, pad))
    config = TrainConfig(minibatch_size=5, microbatch_size=2, max_new_tokens=8, group_size=2, learning_rate=1e-2)
    model = tiny_llama()
    optimise(model, None, torch.optim.SGD(model.parameters(), lr=1e-2), samples(), config, 0,
             torch.Generator().manual_seed(0))
    assert seen == [[4, 5], [7, 8], [9]]  # 35 padded positions, against up to 45 in draw order


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "constant_normalizer"])
def test_rft_loss_follows_the_aggregation(aggregation):
    from rftgym.train.batching import collate
    from rftgym.train.update import _batch_loss, batch_logprobs

    model, data = tiny_llama(), samples()
    config = TrainConfig(algo="rft", group_size=1, aggregation=aggregation, minibatch_size=5, max_new_tokens=8)
    batch = collate(data, 0)
    loss, _, _ = _batch_loss(model, None, batch, config, autocast=nullcontext)
    with torch.no_grad():
        logp, _ = batch_logprobs(model, batch, config)
    nll = [(-logp[row] * batch["loss_mask"][row]).sum() for row in range(len(data))]
    tokens = [batch["loss_mask"][row].sum() for row in range(len(data))]
    want = {"token_mean": sum(nll) / sum(tokens),  # trained tokens: 7 + 1 + 4 + 0 + 7
            "sequence_mean": sum(n / t for n, t in zip(nll, tokens) if t > 0) / 4,  # 4 sequences have tokens
            "constant_normalizer": sum(nll) / (5 * 8)}[aggregation]
    assert float(loss) == pytest.approx(float(want), rel=1e-5)
