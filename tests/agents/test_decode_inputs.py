"""Degenerate inputs to generation, and a per-call seed that makes a call reproducible."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rftgym.agents.fast_decode import DecodeSettings, FastDecoder
from rftgym.agents.hf_policy import HFPolicy, SamplingConfig
from rftgym.core.errors import ConfigError

PROMPTS = [[3, 4, 5, 6], [7, 8], [9, 10, 11]]
GREEDY = SamplingConfig(max_new_tokens=4, temperature=0.0)


def both_paths(make_char_policy):
    generic = make_char_policy()
    fast = HFPolicy(generic.model, generic.tokenizer, name="fast", fast_decode=True)
    generic.fast_decode = False
    return generic, fast


def test_an_empty_prompt_is_refused_saying_which(make_char_policy):
    for policy in both_paths(make_char_policy):
        with pytest.raises(ValueError, match=r"prompt 0 of 1 is empty \(no token ids\).*generation prompt"):
            policy.generate([[]], GREEDY)
        # also among others (it was generated for from padding alone, and gave noise)
        with pytest.raises(ValueError, match="prompt 1 of 2 is empty"):
            policy.generate([[3, 4], []], GREEDY)
    decoder = FastDecoder(make_char_policy().model)
    with pytest.raises(ValueError, match="prompt 0 of 1 is empty"):
        decoder.generate([[]], DecodeSettings(4, 0.0, 0, 1.0), stop_ids=[2], pad_id=0)


def test_a_token_id_without_an_embedding_and_a_lone_context_are_refused_saying_what_to_give(make_char_policy):
    import copy
    import pickle

    from rftgym.core.messages import Context

    for policy in both_paths(make_char_policy):  # the tiny model has 32 embeddings
        for bad in (32, -1):
            with pytest.raises(ValueError, match=f"prompt 1 of 2 holds the token id {bad}, which the model has no "
                                                 r"embedding for \(ids are ints in \[0, 32\)\)"):
                policy.generate([[3, 4], [5, bad, 6]], GREEDY)
        assert len(policy.generate([[0, 31]], GREEDY)) == 1
    policy = make_char_policy()
    with pytest.raises(TypeError, match=r"wrap one in a list: act\(\[context\]\)"):
        policy.act(Context(()))
    for copying in (copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match=r"an HFPolicy cannot be pickled or copied .* HFPolicy.from_pretrained"):
            copying(policy)


def test_scoring_after_an_empty_prompt_is_refused(make_char_policy):
    policy = make_char_policy()
    with pytest.raises(ValueError, match="score.. needs at least one prompt token"):
        policy.score([], [3, 4])
    assert policy.score([], []) == [] and len(policy.score([3], [4, 5])) == 2
    # What generate() refuses, score() refuses too, and it takes tensors as ids.
    import torch

    with pytest.raises(ValueError, match=r"holds the token id 10000000, which the model has no embedding for"):
        policy.score([3], [10**7])
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        policy.score([3], [4], temperature=-1)
    with pytest.raises(TypeError, match="completion_ids is a sequence of token ids .* got 4.5 among them"):
        policy.score([3], [4.5])
    assert policy.score(torch.tensor([3]), torch.tensor([4, 5])) == policy.score([3], [4, 5])


def test_no_prompts_give_no_replies(make_char_policy):
    for policy in both_paths(make_char_policy):
        assert policy.generate([], GREEDY) == []
        assert policy.generate([], SamplingConfig(max_new_tokens=4, seed=1)) == []
    sampled, logprobs, lengths, stopped = FastDecoder(make_char_policy().model).generate(
        [], DecodeSettings(4, 1.0, 0, 1.0), stop_ids=[2], pad_id=0, uniforms=torch.zeros((0, 4)))
    assert sampled.shape == logprobs.shape == (0, 4) and lengths.shape == stopped.shape == (0,)


def test_no_new_tokens_is_a_config_error():
    with pytest.raises(ConfigError, match="max_new_tokens must be an integer of at least 1"):
        SamplingConfig(max_new_tokens=0)
    with pytest.raises(ConfigError, match="max_new_tokens must be an integer of at least 1, got 0"):
        DecodeSettings(0, 0.0, 0, 1.0)  # it indexed an empty buffer
    for bad in (dict(temperature=-1.0), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ConfigError):
            DecodeSettings(**{**dict(max_new_tokens=4, temperature=1.0, top_k=0, top_p=1.0), **bad})


@pytest.mark.parametrize("path", [0, 1], ids=["generic", "fast"])
def test_a_seed_given_to_a_call_makes_it_reproducible(make_char_policy, path):
    policy = both_paths(make_char_policy)[path]
    hot = SamplingConfig(max_new_tokens=8, temperature=1.5)
    state = policy._generator.get_state()

    def run(seed):
        return [r.sampled_ids for r in policy.generate(PROMPTS, SamplingConfig(**{**hot.__dict__, "seed": seed}))]

    first = run(5)
    assert run(5) == first  # drawn from its own seed, not from the policy's stream
    assert run(6) != first
    assert len({tuple(ids) for ids in first}) > 1  # each row draws its own stream
    assert torch.equal(policy._generator.get_state(), state)  # and the policy's stream did not move
    # Without a seed, or with the policy's own settings, calls draw from the policy's stream.
    unseeded = [[r.sampled_ids for r in policy.generate(PROMPTS, hot)] for _ in range(2)]
    assert unseeded[0] != unseeded[1]


def test_a_config_made_from_the_policys_settings_samples_afresh_each_call(make_char_policy):
    # The policy's own seed is no seed of the call's: a loop of calls with
    # replace(policy.sampling, ...) (pass@k, a scorer) must not repeat one sample k times.
    base = make_char_policy()
    policy = HFPolicy(base.model, base.tokenizer, sampling=SamplingConfig(max_new_tokens=8, temperature=1.5, seed=3))
    again = dataclasses.replace(policy.sampling, max_new_tokens=6)
    draws = [[r.sampled_ids for r in policy.generate(PROMPTS, again)] for _ in range(2)]
    assert draws[0] != draws[1]
    # ... and it replays with the policy, as the policy's stream does
    replay = HFPolicy(base.model, base.tokenizer, sampling=policy.sampling)
    assert [[r.sampled_ids for r in replay.generate(PROMPTS, again)] for _ in range(2)] == draws


def test_a_seeded_call_does_not_replay_a_keyed_reply(make_char_policy):
    policy = make_char_policy()
    sampling = SamplingConfig(max_new_tokens=8, temperature=1.5, seed=5)
    unkeyed = policy.generate(PROMPTS[:1], sampling)[0].sampled_ids
    keyed = policy.generate(PROMPTS[:1], sampling, sample_keys=[(0,)])[0].sampled_ids
    assert unkeyed != keyed


def test_close_frees_what_generation_holds_and_the_policy_still_generates(make_char_policy):
    generic, fast = both_paths(make_char_policy)
    generic.set_prefix_cache_mb(16)
    prompts = [list(range(3, 23)), [5, 6, 7] * 8]  # (long enough for their prefixes to be kept)
    sampling = SamplingConfig(max_new_tokens=4, temperature=1.0, seed=5)
    before = {p.name: p.generate(prompts, sampling) for p in (generic, fast)}
    assert fast._fast[1]._graphs  # a decode state (its KV cache) kept for the next call
    assert generic.prefix_cache.entries()  # the replies' prefixes, for a next turn
    for policy in (generic, fast):
        policy.close()
    assert fast._fast is None and not generic.prefix_cache.entries() and generic.prefix_cache.nbytes == 0
    for policy in (generic, fast):
        assert policy.generate(prompts, sampling) == before[policy.name]
