"""Speed switches must not change the numbers: log-probs and gradients stay those of the plain model."""

from __future__ import annotations

import pytest
import torch

from rftgym.core.errors import ConfigError
from rftgym.train.batching import TrainSample, collate
from rftgym.train.config import TrainConfig
from rftgym.train.update import batch_logprobs
from rftgym.train.speed import (
    SpeedConfig,
    _ones_then_zeros,
    apply_training_speedups,
    flop_parameters,
    is_right_padded,
    make_optimizer,
    parameter_count,
    update_flops,
)
from support import tiny_llama


def batch():
    lengths = [9, 5, 7]
    samples = [TrainSample(list(range(3, 3 + n)), [0, 0] + [1] * (n - 2), [0.0] * n, [0.0] * n, 0, i)
               for i, n in enumerate(lengths)]
    return collate(samples, pad_id=0)


def longer_batch():
    return collate([TrainSample(list(range(3, 3 + n)), [0] + [1] * (n - 1), [0.0] * n, [0.0] * n, 0, 0)
                    for n in (12, 10)], pad_id=0)


def logprobs_and_grads(model, data):
    model.zero_grad()
    logp, _ = batch_logprobs(model, data, TrainConfig())
    (logp * data["loss_mask"]).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), grads


def assert_matches_plain(fast, plain, data):
    """The sped-up model's log-probs and gradients on real tokens are the plain model's."""
    expected_logp, expected_grads = logprobs_and_grads(plain, data)
    logp, grads = logprobs_and_grads(fast, data)
    real = data["loss_mask"].bool()
    torch.testing.assert_close(logp[real], expected_logp[real], atol=1e-5, rtol=1e-5)
    assert grads.keys() == expected_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], expected_grads[name], atol=1e-5, rtol=1e-4)


def decode_with_a_cache(model):
    """A prefill and one decode step through a KV cache, as the generic decode loop runs them."""
    from rftgym.agents.hf_policy import _cache_kwarg, _output_cache

    with torch.no_grad():
        cache = _output_cache(model(input_ids=torch.tensor([[3, 4, 5]]), use_cache=True))
        model(input_ids=torch.tensor([[6]]), use_cache=True, **{_cache_kwarg(model): cache})


def test_right_padding_check():
    assert is_right_padded(torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]]))
    assert is_right_padded(torch.tensor([[1.0, 0.0]], dtype=torch.bfloat16))
    assert not is_right_padded(torch.tensor([[1, 1, 1], [0, 1, 1]]))  # left padding
    assert not is_right_padded(torch.tensor([[1, 0, 1]]))
    assert not is_right_padded(torch.ones(1, 1, 2, 2))
    # The tensor form (used for a mask on an accelerator) agrees with the host's.
    for rows, expected in [([[1, 1, 0], [1, 0, 0]], True), ([[0, 1, 1]], False), ([[1, 0, 1]], False)]:
        assert bool(_ones_then_zeros(torch.tensor(rows).ne(0))) is expected


@pytest.mark.parametrize("speed", [SpeedConfig(compile_layers=False),
                                   SpeedConfig(compile_layers=False, checkpoint_mlp=True)])
def test_speedups_keep_logprobs_and_gradients_on_real_tokens(speed):
    plain, fast = tiny_llama(), tiny_llama()
    assert apply_training_speedups(fast, speed)["causal_without_mask"] == "on"
    assert_matches_plain(fast, plain, batch())


def test_compiled_layers_keep_the_numbers_share_one_graph_and_leave_decoding_eager():
    from torch._dynamo.utils import counters

    from rftgym.train.speed import compile_works

    if compile_works("cpu"):
        pytest.skip(f"torch.compile does not work here: {compile_works('cpu')}")
    plain, fast = tiny_llama(), tiny_llama()
    assert apply_training_speedups(fast, SpeedConfig(checkpoint_mlp=True))["compile_layers"] == "on"
    before = counters["stats"]["unique_graphs"]
    assert_matches_plain(fast, plain, batch())
    assert counters["stats"]["unique_graphs"] - before == 1  # both layers, one graph
    logprobs_and_grads(fast, longer_batch())  # other lengths: the same dynamic-shape graph
    decode_with_a_cache(fast)  # runs the layers eagerly
    assert counters["stats"]["unique_graphs"] - before == 1


def test_a_compiled_decoder_keeps_the_numbers_in_one_graph_and_leaves_decoding_eager():
    from torch._dynamo.utils import counters

    from rftgym.train.packing import collate_packed
    from rftgym.train.speed import compile_works

    if compile_works("cpu"):
        pytest.skip(f"torch.compile does not work here: {compile_works('cpu')}")
    plain, fast = tiny_llama(), tiny_llama()
    report = apply_training_speedups(fast, SpeedConfig(compile_scope="decoder", checkpoint_mlp=True))
    assert report["compile_decoder"] == "on" and "compile_layers" not in report
    decoder = fast.get_decoder()
    assert "forward" in decoder.__dict__ and all("forward" not in layer.__dict__ for layer in decoder.layers)
    before = counters["stats"]["unique_graphs"]
    assert_matches_plain(fast, plain, batch())
    assert counters["stats"]["unique_graphs"] - before == 1  # embedding, both layers and the norm
    assert not counters["graph_break"]
    logprobs_and_grads(fast, longer_batch())  # other lengths: the same dynamic-shape graph
    decode_with_a_cache(fast)  # the model's own forward, with a KV cache, runs eagerly
    assert counters["stats"]["unique_graphs"] - before == 1
    # Packed rows (restarting position ids, no mask): transformers builds their per-sample mask
    # inside the graph (compiled, it always looks for packed rows), so they keep the plain numbers.
    samples = [TrainSample(list(range(3, 3 + n)), [0, 0] + [1] * (n - 2), [0.0] * n, [0.0] * n, 0, i)
               for i, n in enumerate([4, 3, 9, 2])]
    packed = collate_packed(samples, pad_id=0)
    assert packed["input_ids"].shape[0] < len(samples)  # at least two samples share a row
    with torch.no_grad():
        fast_logp, _ = batch_logprobs(fast, packed, TrainConfig(pack_sequences=True))
        plain_logp, _ = batch_logprobs(plain, packed, TrainConfig(pack_sequences=True))
    assert counters["stats"]["unique_graphs"] - before == 2  # compiled (a graph with position ids)
    trained = packed["loss_mask"].bool()
    torch.testing.assert_close(fast_logp[trained], plain_logp[trained], atol=1e-5, rtol=1e-5)
    # Back to compiled layers: the decoder's routing is undone.
    assert apply_training_speedups(fast, SpeedConfig())["compile_layers"] == "on"
    assert "forward" not in decoder.__dict__ and all("forward" in layer.__dict__ for layer in decoder.layers)
    # Set up again without compiling: nothing is routed through a compiled forward any more.
    assert "compile_layers" not in apply_training_speedups(fast, SpeedConfig(compile_layers=False))
    assert all("forward" not in module.__dict__ for module in [decoder, *decoder.layers])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("scope", ["layers", "decoder"])
def test_cuda_compiled_update_keeps_the_numbers_under_autocast(scope):
    plain, fast = tiny_llama().cuda(), tiny_llama().cuda()
    for model in (plain, fast):
        model.config._attn_implementation = "sdpa"
    assert apply_training_speedups(fast, SpeedConfig(compile_scope=scope, checkpoint_mlp=True))[
        "compile_decoder" if scope == "decoder" else "compile_layers"] == "on"
    data = {k: v.cuda() for k, v in batch().items()}
    with torch.autocast("cuda", dtype=torch.bfloat16):
        expected_logp, expected_grads = logprobs_and_grads(plain, data)
        logp, grads = logprobs_and_grads(fast, data)
    real = data["loss_mask"].bool()
    # bf16 matmuls in another order (fused kernels): bf16's precision, not float32's.
    torch.testing.assert_close(logp[real], expected_logp[real], atol=3e-2, rtol=3e-2)
    for name in grads:
        torch.testing.assert_close(grads[name], expected_grads[name], atol=3e-2, rtol=5e-2)


@pytest.mark.parametrize("scope", ["layers", "decoder"])
def test_the_compile_mode_reaches_the_compiler(scope, monkeypatch):
    from rftgym.train import speed

    modes = []

    def recording_compile(function, **options):
        modes.append(options.get("mode"))
        return function  # eager: only the routing is under test

    monkeypatch.setattr(speed.torch, "compile", recording_compile)
    speed._compiled_forward.cache_clear()
    try:
        plain, fast = tiny_llama(), tiny_llama()
        apply_training_speedups(fast, SpeedConfig(compile_scope=scope, compile_mode="max-autotune-no-cudagraphs"))
        assert_matches_plain(fast, plain, batch())
        assert set(modes) - {None} == {"max-autotune-no-cudagraphs"}  # None: compile_works' probe, if it ran
    finally:
        speed._compiled_forward.cache_clear()  # no later test gets the eager stand-in
    with pytest.raises(ConfigError, match="compile_mode must be one of default, reduce-overhead"):
        SpeedConfig(compile_mode="fast")


def test_compile_scope_is_checked():
    with pytest.raises(ConfigError, match="compile_scope must be one of layers, decoder"):
        SpeedConfig(compile_scope="model")
    with pytest.raises(ConfigError, match="compile_scope must be one of layers, decoder"):
        TrainConfig(compile_scope="everything")


def test_a_sliding_window_model_keeps_its_window_in_the_update():
    from transformers import MistralConfig, MistralForCausalLM

    from rftgym.train.speed import full_causal_attention

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=4, pad_token_id=0,
                           attn_implementation="sdpa")
    plain = MistralForCausalLM(config)
    fast = MistralForCausalLM(config)
    fast.load_state_dict(plain.state_dict())
    assert not full_causal_attention(fast.config) and full_causal_attention(tiny_llama().config)
    apply_training_speedups(fast, SpeedConfig(compile_layers=False))
    data = batch()  # rows of 9, 5 and 7 tokens: longer than the window
    expected_logp, _ = logprobs_and_grads(plain, data)
    logp, _ = logprobs_and_grads(fast, data)
    real = data["loss_mask"].bool()
    torch.testing.assert_close(logp[real], expected_logp[real], atol=1e-5, rtol=1e-5)


def test_a_model_with_speedups_pickles_and_copies_with_them():
    import copy
    import pickle

    model = tiny_llama()
    apply_training_speedups(model, SpeedConfig(compile_layers=False, checkpoint_mlp=True))
    data = batch()
    expected, _ = logprobs_and_grads(model, data)
    for twin in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert all(layer.mlp._rftgym_checkpointed for layer in twin.get_decoder().layers)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)  # the twin must not read the original's weights
        logp, _ = logprobs_and_grads(twin, data)
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.5)
        torch.testing.assert_close(logp, expected, atol=1e-5, rtol=1e-5)


def test_left_padded_calls_keep_their_mask():
    model = tiny_llama()
    apply_training_speedups(model, SpeedConfig(compile_layers=False))
    ids = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]])
    attention = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    seen = {}

    def record(module, args, kwargs):
        seen["mask"] = kwargs.get("attention_mask")

    model.model.register_forward_pre_hook(record, with_kwargs=True)
    model(input_ids=ids, attention_mask=attention)
    assert seen["mask"] is attention


def test_optimizer_and_flops():
    model = tiny_llama()
    optimizer = make_optimizer(model.parameters(), lr=1e-3)
    assert isinstance(optimizer, torch.optim.AdamW) and not optimizer.defaults["fused"]  # CPU: not fused
    n = parameter_count(model)
    assert n == sum(p.numel() for p in model.parameters())  # parameters() already yields tied ones once
    assert update_flops(n, [4, 2], layers=2, attention_width=32) == 6 * n * 6 + 12 * 2 * 32 * (16 + 4)
    # An output layer of 1000 parameters run at 3 of the 6 positions: 6 * (n - 1000) * 6 + 6 * 1000 * 3 + ...
    assert update_flops(n, [4, 2], layers=2, attention_width=32, head_parameters=1000, head_positions=3) == \
        6 * (n - 1000) * 6 + 6 * 1000 * 3 + 12 * 2 * 32 * (16 + 4)
    with pytest.raises(ConfigError, match="memory_budget"):
        SpeedConfig(memory_budget=1.5)


@pytest.mark.parametrize("tied", [True, False])
def test_flops_count_the_multiplications_an_untied_input_embedding_is_a_lookup(tied):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    model = LlamaForCausalLM(config)
    counts = flop_parameters(model)
    # Weights that multiply: each layer's 7 projections (q 32x32, k and v 32x16 under 2 kv heads,
    # o 32x32, gate/up/down 32x64), and the 40x32 output layer; norms add a few, counted as N does.
    projections = 2 * (32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 64)
    norms = 2 * 2 * 32 + 32
    assert counts == {"parameters": projections + norms + 40 * 32 * (1 if tied else 2), "head_parameters": 40 * 32,
                      "lookup_parameters": 0 if tied else 40 * 32}
    flops = update_flops(counts.pop("parameters"), [4, 2], layers=2, attention_width=32, **counts)
    assert flops == 6 * (projections + norms) * 6 + 6 * 40 * 32 * 6 + 12 * 2 * 32 * (16 + 4)


def test_logprobs_only_at_trained_positions_equal_the_full_computation():
    # Only loss-masked positions go through the vocabulary projection; their values and the
    # gradients of a loss over them equal the all-positions computation's, the rest are 0.
    model = tiny_llama()
    data = batch()
    full = {k: v for k, v in data.items() if k != "trained_index"}
    selected_logp, selected_grads = logprobs_and_grads(model, data)
    full_logp, full_grads = logprobs_and_grads(model, full)
    mask = data["loss_mask"].bool()
    torch.testing.assert_close(selected_logp[mask], full_logp[mask])
    assert (selected_logp[~mask] == 0).all() and (full_logp[~mask] != 0).all()
    assert selected_grads.keys() == full_grads.keys()
    for name in full_grads:
        torch.testing.assert_close(selected_grads[name], full_grads[name], rtol=1e-5, atol=1e-7)
    # With entropy, and a batch that trains nothing (every position is computed then).
    _, entropy = batch_logprobs(model, data, TrainConfig(), with_entropy=True)
    _, full_entropy = batch_logprobs(model, full, TrainConfig(), with_entropy=True)
    torch.testing.assert_close(entropy[mask], full_entropy[mask])
    nothing = {**data, "loss_mask": torch.zeros_like(data["loss_mask"]), "trained_index": data["trained_index"][:0]}
    logp, _ = batch_logprobs(model, nothing, TrainConfig())
    torch.testing.assert_close(logp, full_logp)
