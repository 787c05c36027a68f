"""The fast decode path against the Hugging Face forward and the generic decode loop.

On CPU the fast path runs eagerly (the same step function that CUDA captures as a graph); the
CUDA tests at the end run only where a GPU is present and check the captured graphs.
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

from rftgym.agents.fast_decode import (
    DecodeSettings,
    DecodeState,
    FastDecodeOptions,
    FastDecoder,
    batch_bucket,
    unsupported_reason,
)
from rftgym.agents.hf_policy import HFPolicy, SamplingConfig

PROMPTS = [[3, 4, 5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17], [18]]


def tiny_model(kind: str = "llama", seed: int = 0, **overrides):
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True, pad_token_id=0)
    common.update(overrides)
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[kind]
    model = model_class(config_class(**common)).eval()
    # Random init leaves biases at zero; make them matter where the architecture has them.
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.5)
    return model


def left_pad(prompts, pad=0):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        attention[row, width - len(p):] = 1
    return ids, attention


def hf_logits(model, ids, attention):
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=attention, position_ids=positions).logits


def fast_state(decoder, batch, max_len, new_tokens=4):
    settings = DecodeSettings(new_tokens, 0.0, 0, 1.0)
    return DecodeState(decoder, batch, max_len, settings, stop_ids=[1], pad_id=0,
                       cache_dtype=decoder.lm_head.weight.dtype)


@pytest.mark.parametrize("kind,overrides", [
    ("llama", {}),
    ("llama", {"rope_theta": 500000.0}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    ("llama", {"attention_bias": True, "num_key_value_heads": 4}),
    ("mistral", {"sliding_window": None}),
    ("qwen2", {}),
])
def test_prefill_logits_equal_hf_forward_for_left_padded_batches(kind, overrides):
    model = tiny_model(kind, **overrides)
    assert unsupported_reason(model) is None
    decoder = FastDecoder(model)
    ids, attention = left_pad(PROMPTS)
    state = fast_state(decoder, len(PROMPTS), ids.shape[1] + 4)
    with torch.no_grad():
        ours = decoder.prefill(state, ids, attention, all_logits=True)
    theirs = hf_logits(model, ids, attention)
    real = attention.bool()
    torch.testing.assert_close(ours[real], theirs[real], atol=1e-4, rtol=1e-4)


def test_decode_step_logits_equal_hf_forward_on_the_whole_sequence():
    model = tiny_model()
    decoder = FastDecoder(model)
    continuation = torch.tensor([[20, 21, 22], [23, 24, 25], [26, 27, 28], [29, 30, 31]])
    ids, attention = left_pad(PROMPTS)
    state = fast_state(decoder, len(PROMPTS), ids.shape[1] + 3)
    steps = []
    with torch.no_grad():
        steps.append(decoder.prefill(state, ids, attention))
        for column in range(continuation.shape[1]):
            state.token.copy_(continuation[:, column])
            state.position.add_(1)
            state.slot.add_(1)
            steps.append(decoder.decode_logits(state))
    full_ids = torch.cat([ids, continuation], dim=1)
    full_attention = torch.cat([attention, torch.ones_like(continuation)], dim=1)
    theirs = hf_logits(model, full_ids, full_attention)[:, ids.shape[1] - 1:]
    torch.testing.assert_close(torch.stack(steps, dim=1), theirs, atol=1e-4, rtol=1e-4)


def policy_pair(make_char_policy, fast_options=None, seed=0):
    slow = make_char_policy(seed)
    fast = HFPolicy(slow.model, slow.tokenizer, name="fast", fast_decode=True)
    if fast_options is not None:
        fast._fast = (fast.model, FastDecoder(fast.model, fast_options), None)
    slow.fast_decode = False
    return slow, fast


def assert_same_replies(ours, theirs, atol=1e-4):
    for a, b in zip(ours, theirs, strict=True):
        assert a.sampled_ids == b.sampled_ids
        assert a.finish_reason == b.finish_reason
        assert a.prompt_ids == b.prompt_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=atol, rtol=0)


@pytest.mark.parametrize("options", [None, FastDecodeOptions(bucket=True, length_bucket=16, sync_every=3)])
def test_greedy_generation_equals_the_generic_loop(make_char_policy, options):
    slow, fast = policy_pair(make_char_policy, options)
    sampling = SamplingConfig(max_new_tokens=10, temperature=0.0)
    prompts = PROMPTS + [[5, 6]]  # 5 rows: a bucket of 8 has 3 filler rows
    assert_same_replies(fast.generate(prompts, sampling), slow.generate(prompts, sampling))
    assert fast.fast_decode_reason is None


def test_stop_tokens_end_rows_like_the_generic_loop(make_char_policy):
    slow, fast = policy_pair(make_char_policy)
    sampling = SamplingConfig(max_new_tokens=8, temperature=0.0)
    free = slow.generate(PROMPTS, sampling)
    stop = free[0].sampled_ids[2]  # a token that row 0 produces at its third step
    for policy in (slow, fast):
        policy.chat.stop_ids = (stop,)
    ours, theirs = fast.generate(PROMPTS, sampling), slow.generate(PROMPTS, sampling)
    assert_same_replies(ours, theirs)
    assert ours[0].finish_reason == "stop" and ours[0].sampled_ids[-1] == stop and len(ours[0].sampled_ids) <= 3
    assert any(r.finish_reason == "length" for r in ours) or all(stop in r.sampled_ids for r in ours)


def test_all_rows_stopping_early_ends_generation(make_char_policy):
    slow, fast = policy_pair(make_char_policy)
    sampling = SamplingConfig(max_new_tokens=12, temperature=0.0)
    first = slow.generate(PROMPTS, sampling)
    for policy in (slow, fast):
        policy.chat.stop_ids = tuple({r.sampled_ids[0] for r in first})  # every row stops at once
    ours = fast.generate(PROMPTS, sampling)
    assert all(r.finish_reason == "stop" and len(r.sampled_ids) == 1 for r in ours)
    assert_same_replies(ours, slow.generate(PROMPTS, sampling))


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 1.0), (0, 0.7)])
def test_seeded_sampling_is_reproducible(make_char_policy, top_k, top_p):
    _, fast = policy_pair(make_char_policy)
    sampling = SamplingConfig(max_new_tokens=16, temperature=1.0, top_k=top_k, top_p=top_p)
    runs = []
    for seed in (7, 7, 8):
        fast._generator.manual_seed(seed)
        runs.append([r.sampled_ids for r in fast.generate(PROMPTS, sampling)])
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_sampled_logprobs_match_teacher_forced_scoring(make_char_policy):
    slow, fast = policy_pair(make_char_policy)
    fast._generator.manual_seed(3)
    replies = fast.generate(PROMPTS, SamplingConfig(max_new_tokens=8, temperature=0.7, top_k=10))
    for prompt, reply in zip(PROMPTS, replies):
        scored = slow.score(prompt, reply.sampled_ids, temperature=0.7)
        torch.testing.assert_close(torch.tensor(reply.logprobs), torch.tensor(scored), atol=1e-4, rtol=0)


def test_top_k_1_sampling_is_greedy(make_char_policy):
    _, fast = policy_pair(make_char_policy)
    greedy = fast.generate(PROMPTS, SamplingConfig(max_new_tokens=6, temperature=0.0))
    top1 = fast.generate(PROMPTS, SamplingConfig(max_new_tokens=6, temperature=1.0, top_k=1))
    assert [r.sampled_ids for r in greedy] == [r.sampled_ids for r in top1]


def test_sampling_distribution_follows_the_softmax():
    # Inverting the cumulative distribution draws from softmax(logits): check frequencies over many rows.
    from rftgym.agents.fast_decode import sample_tokens

    torch.manual_seed(0)
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])).repeat(20000, 1)
    tokens, logprobs = sample_tokens(logits, DecodeSettings(1, 1.0, 0, 1.0), torch.rand(20000, dtype=torch.float64))
    frequencies = torch.bincount(tokens, minlength=4).float() / len(tokens)
    torch.testing.assert_close(frequencies, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.015, rtol=0)
    torch.testing.assert_close(logprobs.exp(), torch.tensor([0.5, 0.3, 0.15, 0.05])[tokens])


def test_lora_wrapped_model_decodes_with_its_adapters(make_char_policy):
    peft = pytest.importorskip("peft")
    slow, _ = policy_pair(make_char_policy)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    slow.model = peft.get_peft_model(slow.model, lora)
    fast = HFPolicy(slow.model, slow.tokenizer, fast_decode=True)
    sampling = SamplingConfig(max_new_tokens=8, temperature=0.0)
    with_adapters = fast.generate(PROMPTS, sampling)
    assert fast.fast_decode_reason is None
    assert_same_replies(with_adapters, slow.generate(PROMPTS, sampling))
    with slow.model.disable_adapter():
        assert_same_replies(fast.generate(PROMPTS, sampling), slow.generate(PROMPTS, sampling))


def test_non_llama_models_fall_back_to_the_generic_loop(make_char_policy):
    import transformers

    tokenizer = make_char_policy().tokenizer
    config = transformers.GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=256)
    model = transformers.GPT2LMHeadModel(config).eval()
    assert "model_type 'gpt2'" in unsupported_reason(model)
    with pytest.raises(Exception, match="fast_decode=False"):
        FastDecoder(model)
    policy = HFPolicy(model, tokenizer, fast_decode=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        replies = policy.generate(PROMPTS, SamplingConfig(max_new_tokens=4, temperature=0.0))
    assert any("generic decode loop" in str(w.message) for w in caught)
    assert all(len(r.sampled_ids) == 4 for r in replies)
    generic = HFPolicy(model, tokenizer, fast_decode=False)
    assert_same_replies(replies, generic.generate(PROMPTS, SamplingConfig(max_new_tokens=4, temperature=0.0)))


def test_length_dependent_rope_is_refused():
    model = tiny_model(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert "depends on the sequence length" in unsupported_reason(model)


def test_default_is_generic_on_cpu(make_char_policy):
    policy = make_char_policy()
    assert policy.fast_decode is None and policy._fast_decoder(16) is None


def test_batch_buckets():
    assert [batch_bucket(b) for b in (1, 2, 3, 5, 8, 33, 64, 65, 130)] == [1, 2, 4, 8, 8, 64, 64, 128, 192]


# ---------------------------------------------------------------- CUDA: captured graphs

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_cuda_graph_greedy_equals_the_generic_loop(make_char_policy, monkeypatch):
    slow, fast = policy_pair(make_char_policy)
    slow.model.to("cuda")
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    sampling = SamplingConfig(max_new_tokens=24, temperature=0.0)
    prompts = PROMPTS + [[5, 6]]
    ours = fast.generate(prompts, sampling)
    assert fast._fast[1]._graphs and next(iter(fast._fast[1]._graphs.values()))["graph"] is not None
    assert_same_replies(ours, slow.generate(prompts, sampling), atol=1e-3)
    assert_same_replies(fast.generate(prompts, sampling), ours, atol=0)  # replay of the cached graph


@cuda
def test_cuda_graph_sampling_is_seeded_and_bf16_autocast_runs(make_char_policy):
    _, fast = policy_pair(make_char_policy)
    fast.model.to("cuda")
    sampling = SamplingConfig(max_new_tokens=32, temperature=1.0, top_p=0.9)
    runs = []
    for seed in (1, 1, 2):
        fast._generator = torch.Generator(device="cuda").manual_seed(seed)
        runs.append([r.sampled_ids for r in fast.generate(PROMPTS, sampling)])
    assert runs[0] == runs[1] != runs[2]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        replies = fast.generate(PROMPTS, sampling)
    assert all(len(r.sampled_ids) == len(r.logprobs) > 0 for r in replies)
    assert all(torch.isfinite(torch.tensor(r.logprobs)).all() for r in replies)


@cuda
def test_cuda_graph_top_k_top_p_sampling_equals_eager_on_the_same_draws(make_char_policy, monkeypatch):
    slow, graphed = policy_pair(make_char_policy)
    slow.model.to("cuda")
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    eager = HFPolicy(slow.model, slow.tokenizer, fast_decode=True)
    eager._fast = (eager.model, FastDecoder(eager.model, FastDecodeOptions(graphs=False, bucket=True)), None)
    sampling = SamplingConfig(max_new_tokens=24, temperature=1.2, top_k=6, top_p=0.7, seed=4)  # the call's own draws
    ours = graphed.generate(PROMPTS, sampling)
    assert next(iter(graphed._fast[1]._graphs.values()))["graph"] is not None
    assert_same_replies(ours, eager.generate(PROMPTS, sampling), atol=1e-3)


@cuda
def test_cuda_graph_capture_survives_cuda_work_on_another_thread(make_char_policy):
    """Another thread's synchronizing CUDA calls (a retriever embedding queries, a second
    policy) while a decode step is captured fail neither that thread nor the capture."""
    _, fast = policy_pair(make_char_policy)
    fast.model.to("cuda")
    stop, started, errors = threading.Event(), threading.Event(), []

    def other_work():
        try:
            while not stop.is_set():
                (torch.ones(256, device="cuda") * 2).sum().item()  # a copy to the host: synchronizes
                started.set()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            started.set()

    worker = threading.Thread(target=other_work)
    worker.start()
    try:
        started.wait(30)
        replies = fast.generate(PROMPTS, SamplingConfig(max_new_tokens=8, temperature=0.0))
    finally:
        stop.set()
        worker.join(30)
    assert not errors, errors
    assert next(iter(fast._fast[1]._graphs.values()))["graph"] is not None
    assert all(r.sampled_ids for r in replies)


@cuda
def test_cuda_graphs_two_policies_capture_on_two_threads_are_each_their_own(make_char_policy, monkeypatch):
    """Two decoders capturing at once (two threads, two models) must not record into each
    other's graphs: each replays what it replays alone."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    pairs = [policy_pair(make_char_policy, seed=seed) for seed in (0, 1)]
    for slow, _ in pairs:
        slow.model.to("cuda")
    sampling = SamplingConfig(max_new_tokens=16, temperature=0.0)
    alone = [slow.generate(PROMPTS, sampling) for slow, _ in pairs]
    start, results, errors = threading.Barrier(2), [None, None], []

    def generate(index):
        try:
            start.wait(30)
            results[index] = pairs[index][1].generate(PROMPTS, sampling)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=generate, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    for (_, fast), ours, theirs in zip(pairs, results, alone):
        assert next(iter(fast._fast[1]._graphs.values()))["graph"] is not None
        assert_same_replies(ours, theirs, atol=1e-3)
        assert_same_replies(fast.generate(PROMPTS, sampling), theirs, atol=1e-3)  # the cached graph's replay


@cuda
def test_cuda_graph_sees_in_place_weight_updates(make_char_policy, monkeypatch):
    slow, fast = policy_pair(make_char_policy)
    slow.model.to("cuda")
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    sampling = SamplingConfig(max_new_tokens=12, temperature=0.0)
    fast.generate(PROMPTS, sampling)
    with torch.no_grad():
        for p in slow.model.parameters():
            p.mul_(1.5)  # like an optimizer step: same storage, new values
    assert_same_replies(fast.generate(PROMPTS, sampling), slow.generate(PROMPTS, sampling), atol=1e-3)


def test_sampling_generator_follows_the_model_and_keeps_its_stream(make_char_policy):
    """A policy built on one device and moved keeps drawing from its seeded stream; a generator
    made for "cuda" and a model on "cuda:0" count as the same device (no reseeding)."""
    from rftgym.agents.hf_policy import _same_device

    assert _same_device(torch.device("cuda"), torch.device("cuda:0"))
    assert not _same_device(torch.device("cuda:1"), torch.device("cuda:0"))
    assert not _same_device(torch.device("cpu"), torch.device("cuda:0"))
    policy = make_char_policy()
    policy._generator = torch.Generator(device="cpu").manual_seed(5)
    first = policy._sampling_generator()
    assert first is policy._generator  # same device: the very same generator


def test_decoding_and_the_update_read_the_window_alike():
    from types import SimpleNamespace as Config

    from rftgym.agents.fast_decode import active_window
    from rftgym.train.speed import full_causal_attention

    cases = [
        (Config(sliding_window=4), 4),                                   # Mistral
        (Config(sliding_window=4096, use_sliding_window=False), None),   # Qwen2/Qwen3 default
        (Config(sliding_window=4096, use_sliding_window=True), 4096),
        (Config(sliding_window=None), None),
        (Config(sliding_window=0), None),
        (Config(), None),
    ]
    for config, window in cases:
        assert active_window(config) == window, config
        assert full_causal_attention(config) is (window is None), config
