"""Gradient accumulation (``microbatch_size``): the same update as one pass over the minibatch."""

from __future__ import annotations

import copy

import pytest
import torch

from rftgym.core.errors import ConfigError
from rftgym.train.batching import TrainSample
from rftgym.train.config import TrainConfig
from rftgym.train.loop import microbatch_sizes, microbatch_weights, optimise
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
    assert microbatch_weights(data, [2, 2, 1], "token_mean") == pytest.approx([8 / 19, 4 / 19, 7 / 19])
    assert microbatch_weights(data, [2, 2, 1], "sequence_mean") == pytest.approx([2 / 4, 1 / 4, 1 / 4])
    assert microbatch_weights(data, [2, 2, 1], "constant_normalizer") == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("algo, aggregation", [("grpo", "token_mean"), ("grpo", "sequence_mean"),
                                               ("dr_grpo", "constant_normalizer"), ("rft", "token_mean")])
def test_microbatches_give_the_same_update_as_one_pass(algo, aggregation):
    base = tiny_llama()
    results = []
    for micro in (0, 2):
        model = copy.deepcopy(base)
        config = TrainConfig(algo=algo, aggregation=aggregation, minibatch_size=5, microbatch_size=micro,
                             max_new_tokens=8, kl_coef=0.0, group_size=2, learning_rate=1e-2)
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
    TrainConfig(parallelism="fsdp", minibatch_size=16, microbatch_size=4)  # supported (tests/train/test_distributed.py)


def test_microbatch_sizes():
    assert microbatch_sizes(0, 4) == []
    assert microbatch_sizes(3, 0) == [3]  # 0: the whole minibatch in one pass
    assert microbatch_sizes(4, 4) == [4]
    assert microbatch_sizes(10, 4) == [4, 4, 2]


def test_microbatches_group_samples_of_like_length(monkeypatch):
    from rftgym.train import loop

    seen = []
    real = loop.collate
    monkeypatch.setattr(loop, "collate", lambda part, pad: seen.append([len(s.token_ids) for s in part])
                        or real(part, pad))
    config = TrainConfig(minibatch_size=5, microbatch_size=2, max_new_tokens=8, group_size=2, learning_rate=1e-2)
    model = tiny_llama()
    optimise(model, None, torch.optim.SGD(model.parameters(), lr=1e-2), samples(), config, 0,
             torch.Generator().manual_seed(0))
    assert seen == [[4, 5], [7, 8], [9]]  # 35 padded positions, against up to 45 in draw order
