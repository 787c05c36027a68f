"""An update queues all of its work before it reads anything back from the device.

On a GPU every read of a device value (``float(t)``, ``t.item()``, ``bool(t)``, a copy from
pageable memory) makes the host wait until the device has finished everything queued, so the host
cannot prepare the next kernels while the device runs: the update then costs host time plus
device time instead of the larger of the two. On the CPU the same reads are visible as
``aten._local_scalar_dense`` calls, which these tests count.
"""

from __future__ import annotations

import copy
import traceback
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rftgym.train.batching import TrainSample, collate
from rftgym.train.config import TrainConfig
from rftgym.train.update import optimise, read_back, to_device
from rftgym.train.speed import SpeedConfig, apply_training_speedups, tag_right_padding
from support import tiny_llama


# With packed rows (position ids given), transformers itself reads the position ids back once per
# decoder forward (a check for packed sequences, in its mask preprocessing).
OUTSIDE_RFTGYM = ("transformers/masking_utils.py",)


class ScalarReads(TorchDispatchMode):
    """Counts the reads of a tensor's value into a Python number (but transformers' own when
    ``except_transformers``)."""

    def __init__(self, except_transformers: bool = False):
        super().__init__()
        self.count = 0
        self.except_transformers = except_transformers

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            callers = [frame.filename for frame in traceback.extract_stack()]
            if not (self.except_transformers and any(name.endswith(OUTSIDE_RFTGYM) for name in callers)):
                self.count += 1
        return func(*args, **(kwargs or {}))


def samples(count: int = 8):
    rng = torch.Generator().manual_seed(3)
    out = []
    for index in range(count):
        n, prompt = 5 + index % 4, 2
        ids = torch.randint(3, 40, (n,), generator=rng).tolist()
        out.append(TrainSample(ids, [0] * prompt + [1] * (n - prompt), (-torch.rand(n, generator=rng)).tolist(),
                               [0.0] * prompt + [float(torch.randn(1, generator=rng))] * (n - prompt),
                               index // 2, index % 2))
    return out


@pytest.mark.parametrize("algo, kl_coef", [("grpo", 0.0), ("grpo", 0.05), ("rft", 0.0)])
def test_an_update_reads_nothing_back_until_its_stats(algo, kl_coef):
    model = tiny_llama()
    apply_training_speedups(model, SpeedConfig(compile_layers=False))  # the mask hook included
    reference = copy.deepcopy(model).requires_grad_(False) if kl_coef else None
    # Two minibatches of two microbatches each, two epochs: every boundary of the update.
    config = TrainConfig(algo=algo, kl_coef=kl_coef, minibatch_size=4, microbatch_size=2, epochs_per_step=2,
                         max_new_tokens=8, group_size=2, learning_rate=1e-3)
    # (CPU AdamW reads its step counts; on CUDA rftgym's fused AdamW keeps them on the device.)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    data = samples()
    with ScalarReads() as reads:
        stats = optimise(model, reference, optimizer, data, config, 0, torch.Generator().manual_seed(0))
    assert reads.count == 0
    # ...and the update still happened and reports its numbers as Python floats.
    assert stats["updates"] == 4
    assert all(isinstance(v, float) for k, v in stats.items() if k != "updates")
    assert {"loss", "grad_norm", "pg_loss", "entropy"} <= set(stats)
    assert any((p.detach() - before[n]).abs().max() > 0 for n, p in model.named_parameters())


def test_the_causal_attention_switch_gives_the_masked_numbers_and_is_undone_after_every_forward():
    from rftgym.train.speed import CAUSAL_SDPA

    model = tiny_llama()
    masked = tiny_llama()
    for m in (model, masked):
        m.config._attn_implementation = "sdpa"
    apply_training_speedups(model, SpeedConfig(compile_layers=False))
    decoder = model.get_decoder()
    seen = []
    decoder.layers[0].self_attn.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(module.config._attn_implementation), with_kwargs=True)
    batch = to_device(collate(samples(3), pad_id=0), "cpu")
    with torch.no_grad(), ScalarReads() as reads:  # the tag is trusted without grad too (recompute, reference)
        fast = decoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       use_cache=False).last_hidden_state
    assert reads.count == 0 and seen == [CAUSAL_SDPA] and decoder.config._attn_implementation == "sdpa"
    with torch.no_grad():
        slow = masked.get_decoder()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"].clone(),
                                    use_cache=False).last_hidden_state
    for row, length in enumerate(batch["attention_mask"].sum(1).tolist()):
        torch.testing.assert_close(fast[row, :length], slow[row, :length], rtol=1e-4, atol=1e-5)
    # Packed rows (position ids) and decoding (a cache) keep the model's own attention and masks.
    decoder(input_ids=batch["input_ids"][:1], position_ids=torch.arange(7)[None], use_cache=False)
    with torch.no_grad():
        model(input_ids=batch["input_ids"][:1, :3], use_cache=True)
    assert seen[-2:] == ["sdpa", "sdpa"]
    # A forward that raises leaves the model's own attention behind too.
    with pytest.raises(IndexError):
        decoder(input_ids=torch.full((1, 3), 10_000), attention_mask=tag_right_padding(torch.ones(1, 3), True),
                use_cache=False)
    assert decoder.config._attn_implementation == "sdpa"
    # A later choice of attention is respected, and eager attention is never switched.
    model.set_attn_implementation("eager")
    decoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    assert seen[-1] == "eager" and decoder.config._attn_implementation == "eager"


def test_the_mask_hook_trusts_the_hosts_check():
    model = tiny_llama()
    apply_training_speedups(model, SpeedConfig(compile_layers=False))
    decoder = model.get_decoder()
    seen = []
    decoder.layers[0].register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs.get("attention_mask") is None), with_kwargs=True)
    batch = collate(samples(3), pad_id=0)  # rows of 5, 6 and 7 tokens: right padding
    with ScalarReads() as reads:
        moved = to_device(batch, "cpu")
        decoder(input_ids=moved["input_ids"], attention_mask=moved["attention_mask"], use_cache=False)
    assert reads.count == 0 and seen == [True]  # the padding mask was dropped (SDPA's causal path)
    # The hook acts on the tag, not on the values: a mask tagged "not right-padded" is kept...
    tagged = tag_right_padding(batch["attention_mask"].clone(), False)
    decoder(input_ids=batch["input_ids"], attention_mask=tagged, use_cache=False)
    assert seen[-1] is False
    # ...and an untagged one (not from to_device) is checked where it is.
    decoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"].clone(), use_cache=False)
    assert seen[-1] is True


def test_to_device_tags_left_padding_as_not_right_padded():
    left = {"attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]), "input_ids": torch.ones(2, 3, dtype=torch.long)}
    assert to_device(left, "cpu")["attention_mask"]._rftgym_right_padded is False
    right = {"attention_mask": torch.tensor([[1, 1, 0], [1, 1, 1]])}
    assert to_device(right, "cpu")["attention_mask"]._rftgym_right_padded is True


def test_left_padding_keeps_its_mask_through_the_hook():
    # The tag must not drop a mask that matters: a left-padded row's real tokens would otherwise
    # attend to its padding.
    model = tiny_llama().eval()
    apply_training_speedups(model, SpeedConfig(compile_layers=False))
    ids = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.enable_grad():
        tagged = model.get_decoder()(input_ids=ids, attention_mask=to_device({"attention_mask": mask}, "cpu")[
            "attention_mask"], use_cache=False).last_hidden_state
        alone = model.get_decoder()(input_ids=ids[:1, 2:], use_cache=False).last_hidden_state
    torch.testing.assert_close(tagged[0, 2:], alone[0], rtol=1e-4, atol=1e-5)


def test_read_back_divides_and_keeps_float64():
    values = {"a": torch.tensor(3.0, dtype=torch.float64) / 7, "b": torch.tensor(2.0), "c": 4.0}
    out = read_back(values, divisor=2)
    assert out == {"a": pytest.approx(3 / 14, rel=1e-15), "b": 1.0, "c": 2.0}
    assert all(isinstance(v, float) for v in out.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("scope", ["layers", "decoder"])
@pytest.mark.parametrize("pack", [False, True])
def test_cuda_update_never_synchronizes_before_its_stats(pack, scope):
    # The CUDA defaults of `rftgym train`: bf16 weights with float32 masters, compiled layers (or
    # the whole decoder), MLP recomputation.
    from rftgym.train.speed import make_optimizer

    model = tiny_llama().cuda().to(torch.bfloat16)
    model.config._attn_implementation = "sdpa"
    apply_training_speedups(model, SpeedConfig(checkpoint_mlp=True, compile_scope=scope))
    config = TrainConfig(minibatch_size=4, microbatch_size=2, max_new_tokens=8, group_size=2, kl_coef=0.0,
                         pack_sequences=pack)
    optimizer = make_optimizer(model.parameters(), lr=1e-3)
    autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731
    optimise(model, None, optimizer, samples(), config, 0, torch.Generator().manual_seed(0), None, autocast)
    torch.cuda.synchronize()
    # "warn": every synchronizing call warns. read_back's one transfer is the update's only wait,
    # so read_back is deferred here and the stats are read after the mode is reset.
    import rftgym.train.update as update

    real_read_back = update.read_back
    pending = {}

    def deferred(values, divisor=1):
        pending.update(values=values, divisor=divisor)
        return {}

    update.read_back = deferred
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optimise(model, None, optimizer, samples(), config, 0, torch.Generator().manual_seed(0), None, autocast)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        update.read_back = real_read_back
    syncs = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if "synchroniz" in str(w.message)]
    # Packed rows leave transformers its packed-sequence check; padded rows leave nothing.
    assert [s for s in syncs if not (pack and s.split(":")[0].endswith(OUTSIDE_RFTGYM))] == []
    stats = real_read_back(pending["values"], pending["divisor"])
    assert stats["grad_norm"] > 0


def test_batches_reach_to_device_contiguous():
    # A pinned strided view (e.g. targets = input_ids[:, 1:]) is copied to a GPU through a pageable
    # temporary, which waits for the device: every tensor of a batch must be contiguous.
    from rftgym.train.packing import collate_packed

    for batch in (collate(samples(5), pad_id=0), collate_packed(samples(5), pad_id=0)):
        assert {k for k, v in batch.items() if not v.is_contiguous()} == set()
