"""Top-k then top-p: the nucleus is taken over the top-k survivors renormalised, as Hugging
Face's TopKLogitsWarper + TopPLogitsWarper and vLLM do, in every decode path."""

from __future__ import annotations

import pytest
import torch

from rftgym.agents.fast_decode import DecodeSettings, filter_logprobs, sample_tokens
from rftgym.agents.hf_policy import HFPolicy, SamplingConfig

# Probabilities 0.4, 0.25, 0.15, 0.12, 0.08. Top-3 keeps 0.4, 0.25, 0.15 (mass 0.8), renormalised
# 0.5, 0.3125, 0.1875: the mass before token 2 is 0.8125 >= 0.8, so top-p 0.8 keeps tokens 0 and 1.
# (Over the whole vocabulary the mass before token 2 is 0.65 < 0.8, which kept it too.)
HAND = torch.tensor([[0.4, 0.25, 0.15, 0.12, 0.08]]).log()


def kept(filtered: torch.Tensor) -> list[list[int]]:
    return [torch.isfinite(row).nonzero().flatten().tolist() for row in filtered]


def test_top_p_after_top_k_by_hand():
    assert kept(filter_logprobs(HAND, 3, 0.8)) == [[0, 1]]
    assert kept(filter_logprobs(HAND, 3, 1.0)) == [[0, 1, 2]]
    assert kept(filter_logprobs(HAND, 0, 0.8)) == [[0, 1, 2]]  # no top-k: 0.65 before token 2
    # Sampling inverts the renormalised 0.5 / 0.3125 of tokens 0 and 1: token 0 below 0.5 / 0.8125.
    draws = torch.tensor([0.0, 0.61, 0.62, 0.999], dtype=torch.float64)
    tokens, logprobs = sample_tokens(HAND.repeat(4, 1), DecodeSettings(1, 1.0, 3, 0.8), draws)
    assert tokens.tolist() == [0, 0, 1, 1]
    # The recorded log-probs are the untruncated ones, not the renormalised distribution's.
    torch.testing.assert_close(logprobs, HAND[0, tokens])


@pytest.mark.parametrize("top_k,top_p", [(5, 0.9), (20, 0.5), (40, 0.95), (3, 0.3), (50, 0.7), (1, 0.9)])
def test_filters_keep_what_hugging_face_warpers_keep(top_k, top_p):
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    generator = torch.Generator().manual_seed(top_k)
    logits = torch.randn((64, 50), generator=generator) * 3
    temperature = 0.8
    logp = torch.log_softmax(logits / temperature, dim=-1)
    ours = filter_logprobs(logp, top_k, top_p)
    scores = TopPLogitsWarper(top_p)(None, TopKLogitsWarper(top_k)(None, logits / temperature))
    assert kept(ours) == kept(scores)


def test_both_decode_paths_sample_the_same_under_top_k_and_top_p(make_char_policy):
    generic = make_char_policy()
    fast = HFPolicy(generic.model, generic.tokenizer, name="fast", fast_decode=True)
    generic.fast_decode = False
    sampling = SamplingConfig(max_new_tokens=12, temperature=1.2, top_k=6, top_p=0.7, seed=3)
    prompts = [[3, 4, 5, 6], [7, 8], [9, 10, 11]]
    ours, theirs = fast.generate(prompts, sampling), generic.generate(prompts, sampling)
    assert fast._fast[1] is not None  # the fast path ran
    assert [r.sampled_ids for r in ours] == [r.sampled_ids for r in theirs]
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)
