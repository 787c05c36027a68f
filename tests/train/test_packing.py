"""Sequence packing: layouts by hand, and the same update as padded rows."""

from __future__ import annotations

import copy

import pytest
import torch
from support import SayAEnv, tiny_llama

from rftgym.core.errors import ConfigError
from rftgym.train import TrainConfig
from rftgym.train.batching import TrainSample
from rftgym.train.loop import train
from rftgym.train.model_setup import check_packed_attention
from rftgym.train.update import optimise
from rftgym.train.packing import collate_packed, pack_rows


def sample(ids, mask, index=0):
    n = len(ids)
    return TrainSample(list(ids), list(mask), [-0.5 - 0.1 * i for i in range(n)], [1.0 + index] * n, index, 0)


def test_first_fit_decreasing_by_hand():
    # Longest first: 5 -> row 0 (room 1); 4 -> row 1 (room 2); 3 -> row 2 (room 3); 2 -> row 1 (room 0).
    assert pack_rows([5, 3, 2, 4], 6) == [[0], [3, 2], [1]]
    assert pack_rows([2, 2, 2], 6) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="7 tokens"):
        pack_rows([7, 1], 6)


def test_packed_layout_by_hand():
    first = sample([10, 11, 12], [0, 1, 1], 0)
    second = sample([20, 21], [0, 1], 1)
    batch = collate_packed([first, second], pad_id=0, row_length=6)
    assert batch["input_ids"].tolist() == [[10, 11, 12, 20, 21, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2]]  # padding continues the last sample
    assert batch["targets"].tolist() == [[11, 12, 20, 21, 0]]
    # Position 2 (the first sample's last token) would predict the second's first: masked.
    assert batch["loss_mask"].tolist() == [[1.0, 1.0, 0.0, 1.0, 0.0]]
    assert batch["sequence_ids"].tolist() == [[0, 0, -1, 1, -1]]
    assert batch["old_logprobs"][0].tolist() == pytest.approx([-0.6, -0.7, 0.0, -0.6, 0.0])
    assert batch["advantages"].tolist() == [[1.0, 1.0, 0.0, 2.0, 0.0]]
    assert "attention_mask" not in batch
    # Default row length: the longest sample's, so here one sample per row.
    assert collate_packed([first, second], pad_id=0)["input_ids"].tolist() == [[10, 11, 12], [20, 21, 0]]


def varied_samples():
    """Ten samples of 3..14 tokens: packing puts several short ones in one row."""
    rng = torch.Generator().manual_seed(7)
    out = []
    for index, (n, prompt) in enumerate([(14, 4), (3, 1), (5, 2), (9, 3), (4, 4), (12, 5), (6, 2), (3, 2), (8, 1),
                                         (7, 3)]):
        ids = torch.randint(3, 40, (n,), generator=rng).tolist()
        out.append(TrainSample(ids, [0] * prompt + [1] * (n - prompt), (-torch.rand(n, generator=rng) * 3).tolist(),
                               [0.0] * prompt + [float(torch.randn(1, generator=rng))] * (n - prompt),
                               index // 2, index % 2))
    return out


@pytest.mark.parametrize("algo, aggregation, micro", [
    ("grpo", "token_mean", 0), ("grpo", "sequence_mean", 0), ("dr_grpo", "constant_normalizer", 0),
    ("rft", "token_mean", 0), ("grpo", "sequence_mean", 4)])
def test_packing_gives_the_same_update(algo, aggregation, micro):
    base = tiny_llama()
    results = []
    for pack in (False, True):
        model = copy.deepcopy(base)
        config = TrainConfig(algo=algo, aggregation=aggregation, minibatch_size=10, microbatch_size=micro,
                             max_new_tokens=16, group_size=2, kl_coef=0.0, pack_sequences=pack)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        stats = optimise(model, None, optimizer, varied_samples(), config, 0, torch.Generator().manual_seed(0))
        results.append((stats, {n: p.detach().clone() for n, p in model.named_parameters()}))
    (padded_stats, padded), (packed_stats, packed) = results
    for key in ("loss", "grad_norm", "pg_loss", "entropy", "clip_fraction", "approx_kl", "ratio_mean"):
        if key in padded_stats:
            assert packed_stats[key] == pytest.approx(padded_stats[key], rel=1e-4, abs=1e-6), key
    assert max((padded[n] - base.state_dict()[n]).abs().max() for n in padded) > 0
    for name in padded:
        torch.testing.assert_close(packed[name], padded[name], rtol=1e-4, atol=1e-6)


def test_packing_computes_fewer_rows():
    batch = collate_packed(varied_samples(), pad_id=0)
    # 71 tokens in rows of 14: 6 rows, against 10 padded rows (140 positions).
    assert batch["input_ids"].shape == (6, 14)


def test_a_model_that_attends_across_samples_is_refused():
    model = tiny_llama()
    check_packed_attention(model)  # a Hugging Face Llama keeps packed samples apart

    def drop_positions(module, args, kwargs):
        return args, {k: v for k, v in kwargs.items() if k != "position_ids"}

    model.get_decoder().register_forward_pre_hook(drop_positions, with_kwargs=True)
    with pytest.raises(ConfigError, match="attends across packed samples"):
        check_packed_attention(model)


def test_training_with_packing_matches_padded_training(tmp_path, make_char_policy):
    def run(name, pack):
        config = TrainConfig(steps=2, tasks_per_step=2, group_size=4, max_new_tokens=6, learning_rate=1e-2,
                             minibatch_size=8, output_dir=str(tmp_path / name), save_every=100, pack_sequences=pack)
        return train(config, policy=make_char_policy(), make_env=SayAEnv)

    padded, packed = run("padded", False), run("packed", True)
    for a, b in zip(padded, packed):
        assert b["reward_mean"] == a["reward_mean"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
