"""Prefix KV reuse: the cache's bookkeeping, and replies that are the same with and without it."""

from __future__ import annotations

import pickle

import gymnasium as gym
import pytest
import torch

from rftgym.agents.hf_policy import HFPolicy, SamplingConfig
from rftgym.agents.prefix_cache import PrefixEntry, PrefixKVCache, StateBlock, shared_prefixes, weights_fingerprint
from rftgym.core.errors import ConfigError
from rftgym.rollout.engine import RolloutConfig, run_episodes


def entry(ids, heads=2, dim=4, layers=1):
    """An entry of ``ids`` with made-up states (the bookkeeping reads only their sizes)."""
    n = len(ids)
    states = torch.arange(n, dtype=torch.float32)[None, :, None].expand(heads, n, dim)
    return PrefixEntry.of_states(torch.tensor(ids), tuple(states.clone() for _ in range(layers)),
                                 tuple(states.clone() for _ in range(layers)))


# ---------------------------------------------------------------------------- the cache


def test_lookup_finds_the_longest_common_prefix_and_leaves_the_last_token_to_run():
    cache = PrefixKVCache(budget_bytes=10**6, min_reuse=3)
    short, long = entry([1, 2, 3, 4]), entry([1, 2, 3, 4, 5, 6, 7, 8])
    cache.store(short, None)  # dropped when the longer one (which it begins) is stored
    cache.store(long, None)
    other = entry([9, 9, 9, 9, 9])
    cache.store(other, None)
    assert len(cache) == 2
    assert cache.lookup([1, 2, 3, 4, 5, 0, 0]) == (long, 5)  # shares 5 tokens, then differs
    # The whole entry matches, but the prompt's last token must run to give the next logits.
    assert cache.lookup([1, 2, 3, 4, 5, 6]) == (long, 5)
    assert cache.lookup([9, 9, 9, 9, 9, 9, 1]) == (other, 5)
    assert cache.lookup([1, 2, 7, 7, 7]) == (None, 0)  # 2 shared tokens: fewer than min_reuse
    assert cache.lookup([1, 2, 3]) == (None, 0)


def test_of_entries_sharing_as_much_the_newest_is_found():
    cache = PrefixKVCache(budget_bytes=10**6, min_reuse=2)
    older, newer = entry([1, 2, 3, 4, 9]), entry([1, 2, 3, 4, 8])
    cache.store(older, None)
    cache.store(newer, None)
    assert cache.lookup([1, 2, 3, 4, 7, 7]) == (newer, 4)
    assert cache.lookup([1, 2, 3, 4, 9, 7]) == (older, 5)


def test_an_entry_already_covered_is_not_stored_twice():
    cache = PrefixKVCache(budget_bytes=10**6, min_reuse=2)
    long = entry([1, 2, 3, 4, 5])
    cache.store(long, None)
    cache.store(entry([1, 2, 3]), None)
    assert len(cache) == 1 and cache.nbytes == long.nbytes
    cache.store(entry([1, 2, 3, 4, 5]), None)  # the same ids again
    assert len(cache) == 1


def test_the_least_recently_used_entries_go_past_the_budget():
    one = entry([1] * 10)
    cache = PrefixKVCache(budget_bytes=2 * one.nbytes, min_reuse=2)
    cache.store(entry([1] * 10), None)
    cache.store(entry([2] * 10), None)
    assert cache.lookup([1] * 11)[1] == 10  # [1]*10 is now the most recently used
    cache.store(entry([3] * 10), None)  # over the budget: [2]*10 goes
    assert len(cache) == 2 and cache.nbytes == 2 * one.nbytes
    assert cache.lookup([2] * 11) == (None, 0)
    assert cache.lookup([1] * 11)[1] == 10 and cache.lookup([3] * 11)[1] == 10
    cache.store(entry([4] * 30), None)  # larger than the whole budget: not kept, nothing dropped for it
    assert len(cache) == 2
    assert sorted(cache._by_start) == [(1, 1), (3, 3)]  # the index holds what is kept, no more
    cache.clear()
    assert cache._by_start == {} and cache.nbytes == 0 and cache.lookup([1] * 11) == (None, 0)


def block(first, n, heads=2, dim=4):
    """A block of ``n`` tokens whose every state is its token's number, counting from ``first``."""
    states = torch.arange(first, first + n, dtype=torch.float32)[None, :, None].expand(heads, n, dim).clone()
    return StateBlock((states,), (states.clone(),))


def test_entries_going_on_from_one_share_its_block_and_the_budget_counts_it_once():
    base = PrefixEntry(torch.tensor([1, 2, 3, 4, 5, 6]), ((block(0, 6), 6),))
    token = base.nbytes // 6
    a = base.extended(4, torch.tensor([1, 2, 3, 4, 7, 7, 7]), block(100, 3))
    b = base.extended(6, torch.tensor([1, 2, 3, 4, 5, 6, 8, 8]), block(200, 2))
    assert [float(x) for x in torch.cat(a.pieces("keys", 0, 7), dim=1)[0, :, 0]] == [0, 1, 2, 3, 100, 101, 102]
    assert [float(x) for x in torch.cat(b.pieces("values", 0, 7), dim=1)[1, :, 3]] == [0, 1, 2, 3, 4, 5, 200]
    assert a.nbytes == 9 * token  # base's block whole, though a uses 4 of its 6 tokens
    # Using less than half of a block copies that part: held whole, the rest would outlive base.
    c = base.extended(2, torch.tensor([1, 2, 9]), block(300, 1))
    assert c.nbytes == 3 * token and c.blocks[0][0] is not base.blocks[0][0]
    assert [float(x) for x in torch.cat(c.pieces("keys", 0, 3), dim=1)[0, :, 2]] == [0, 1, 300]
    cache = PrefixKVCache(budget_bytes=12 * token, min_reuse=2)
    cache.store(a, None)
    cache.store(b, None)
    assert len(cache) == 2 and cache.nbytes == (6 + 3 + 2) * token  # as copies: 9 + 8
    cache.store(entry([9, 9, 9, 9]), None)  # 15 tokens: a, the least recently used, goes; base stays for b
    assert len(cache) == 2 and cache.nbytes == (6 + 2 + 4) * token and cache.stats.evicted_bytes == 3 * token
    assert cache.lookup([1, 2, 3, 4, 7, 7, 7, 7]) == (b, 4)
    # 22 tokens: [9]*4 goes (b was just looked up), then b, and base's block with it.
    cache.store(entry([6] * 10), None)
    assert len(cache) == 1 and cache.nbytes == 10 * token and cache.stats.evicted_bytes == (3 + 4 + 6 + 2) * token
    cache.clear()
    assert cache.nbytes == 0 and cache._blocks == {}


def test_shared_prefixes_are_the_longest_each_prompt_shares_with_another():
    group = [1, 2, 3, 4, 5, 6]
    system = [1, 2, 3, 9, 9]
    prompts = [group, group, system, [7, 7, 7, 7]]
    # The group's samples share all but the last token; the other task shares [1, 2, 3] with
    # them, which begins the group's prefix and so is not run apart; [7, 7, 7, 7] shares nothing.
    assert shared_prefixes(prompts, covered=[0, 0, 0, 0], min_reuse=2) == [[1, 2, 3, 4, 5]]
    assert shared_prefixes([group, system], covered=[0, 0], min_reuse=2) == [[1, 2, 3]]
    # Not worth it when the cache already covers all but fewer than min_reuse of them.
    assert shared_prefixes(prompts, covered=[4, 4, 0, 0], min_reuse=2) == [[1, 2, 3]]
    assert shared_prefixes(prompts, covered=[0, 0, 0, 0], min_reuse=6) == []
    assert shared_prefixes([group], covered=[0], min_reuse=1) == []


def test_new_weights_empty_the_cache_and_a_pickled_cache_is_empty():
    cache = PrefixKVCache(budget_bytes=10**6, min_reuse=2)
    cache.check_weights("weights a")
    cache.store(entry([1, 2, 3]), "weights a")
    cache.check_weights("weights a")
    assert len(cache) == 1
    assert len(pickle.loads(pickle.dumps(cache))) == 0
    cache.check_weights("weights b")
    assert len(cache) == 0 and cache.nbytes == 0


def test_the_fingerprint_changes_with_an_optimizer_step_and_not_with_a_forward(make_char_policy):
    model = make_char_policy(seed=0).model
    before = weights_fingerprint(model)
    with torch.inference_mode():
        model(input_ids=torch.tensor([[3, 4, 5]]))
    assert weights_fingerprint(model) == before
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.tensor([[3, 4, 5]])).logits.sum().backward()
    optimizer.step()
    assert weights_fingerprint(model) != before


# ---------------------------------------------------------------------------- the policy


def twins(make_char_policy, **sampling):
    """A policy with prefix reuse and one without, over the same weights."""
    config = SamplingConfig(**{"max_new_tokens": 10, "temperature": 0.0, **sampling})
    reusing = make_char_policy(seed=0)
    reusing.sampling = config
    plain = HFPolicy(reusing.model, reusing.tokenizer, sampling=config, prefix_cache_mb=0)
    return reusing, plain


def saved(policy) -> int:
    """Prompt tokens the policy did not run through the model."""
    return policy.prefix_cache.stats.prompt_tokens - policy.prefix_cache.stats.prefilled_tokens


def same_replies(a, b):
    assert [r.sampled_ids for r in a] == [r.sampled_ids for r in b]
    for x, y in zip(a, b):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)


def test_a_next_turn_reuses_its_last_turn_and_replies_as_without(make_char_policy):
    reusing, plain = twins(make_char_policy)
    first = [list(range(3, 23)), list(range(4, 32)) * 2, [5, 6, 7] * 8]
    same_replies(reusing.generate(first), plain.generate(first))
    assert saved(reusing) == 0 and len(reusing.prefix_cache) == 3
    replies = reusing.generate(first)  # answered again from the cache: the same replies
    same_replies(replies, plain.generate(first))
    assert saved(reusing) == sum(len(p) - 1 for p in first)
    # Each next prompt: the last one, its reply and an observation; one shares only a start with
    # an entry, one nothing (it is prefilled whole beside the others in one batch).
    nxt = [p + r.sampled_ids + [10, 11, 12] for p, r in zip(first, replies)]
    nxt[2] = first[2][:17] + [20, 21, 22, 23]
    nxt.append([30, 29, 28, 27, 26, 25] * 3)
    before = saved(reusing)
    same_replies(reusing.generate(nxt), plain.generate(nxt))
    fed = [len(p) + len(r.sampled_ids) - 1 for p, r in zip(first[:2], replies[:2])]  # the last token never ran
    assert saved(reusing) - before == sum(fed) + 17
    assert plain.prefix_cache.stats.prompt_tokens == 0 and plain.prefix_cache_reason == "prefix_cache_mb is 0"


def test_a_group_of_samples_runs_its_shared_prompt_once(make_char_policy):
    reusing, plain = twins(make_char_policy, temperature=1.0, seed=3)
    task = list(range(3, 31))
    other = task[:20] + [5, 5, 5, 5, 5]
    prompts = [task] * 4 + [other]
    keys = [(0, k) for k in range(5)]
    same_replies(reusing.generate(prompts, sample_keys=keys), plain.generate(prompts, sample_keys=keys))
    # The group's prompt but its last token runs once, then each row runs what is its own.
    assert reusing.prefix_cache.stats.prefilled_tokens == (len(task) - 1) + 4 * 1 + (len(other) - 20)
    assert saved(reusing) == sum(map(len, prompts)) - reusing.prefix_cache.stats.prefilled_tokens


def test_a_group_keeps_its_shared_prompt_once_and_a_next_turn_keeps_only_its_new_states(make_char_policy):
    reusing, plain = twins(make_char_policy, temperature=1.0, seed=5)
    config = reusing.model.config
    token = config.num_hidden_layers * 2 * config.num_key_value_heads * (
        config.hidden_size // config.num_attention_heads) * 4  # float32 keys and values
    task = list(range(3, 31))
    other = task[:20] + [5, 5, 5, 5, 5]
    prompts = [task] * 4 + [other]
    keys = [(0, k) for k in range(5)]
    replies = reusing.generate(prompts, sample_keys=keys)
    same_replies(replies, plain.generate(prompts, sample_keys=keys))
    fed = [len(r.sampled_ids) - 1 for r in replies]
    assert len(reusing.prefix_cache) == 5
    # task[:27] (run once for the batch) is held once; each reply holds what it ran after the
    # part it reused: the group's rows their prompt's last token, `other` its 5 tokens after 20.
    own = [1 + f for f in fed[:4]] + [5 + fed[4]]
    assert reusing.prefix_cache.nbytes == (27 + sum(own)) * token
    assert sum(e.nbytes for e in reusing.prefix_cache.entries()) == (5 * 27 + sum(own)) * token
    # A next turn: each reply's entry, then 3 new ids, then its reply. The entry it went on from
    # is a prefix of its own, so it is dropped, and its blocks are held by the new one.
    nxt = [p + r.sampled_ids + [10, 11, 12] for p, r in zip(prompts, replies)]
    more = reusing.generate(nxt, sample_keys=[(1, k) for k in range(5)])
    same_replies(more, plain.generate(nxt, sample_keys=[(1, k) for k in range(5)]))
    fed_next = [len(r.sampled_ids) - 1 for r in more]
    assert len(reusing.prefix_cache) == 5
    assert reusing.prefix_cache.nbytes == (27 + sum(own) + sum(1 + 3 + f for f in fed_next)) * token


def test_a_shared_prompt_partly_cached_runs_only_the_rest_once(make_char_policy):
    reusing, plain = twins(make_char_policy)
    task = list(range(3, 31)) * 2
    start = task[:20] + [5, 5, 5]
    reusing.generate([start])
    prefilled = reusing.prefix_cache.stats.prefilled_tokens
    prompts = [task] * 4
    same_replies(reusing.generate(prompts), plain.generate(prompts))
    # 20 tokens come from the cache; the rest of the group's prompt but its last token runs once.
    assert reusing.prefix_cache.stats.prefilled_tokens - prefilled == (len(task) - 1 - 20) + 4


def test_a_budget_too_small_to_keep_anything_still_runs_a_group_prompt_once(make_char_policy):
    reusing, plain = twins(make_char_policy)
    tight = HFPolicy(reusing.model, reusing.tokenizer, sampling=reusing.sampling, prefix_cache_mb=0.001)
    task = list(range(3, 31))
    prompts = [task] * 4
    same_replies(tight.generate(prompts), plain.generate(prompts))
    assert len(tight.prefix_cache) == 0
    assert tight.prefix_cache.stats.prefilled_tokens == (len(task) - 1) + 4


def test_sampled_replies_draw_the_same_tokens_with_reuse(make_char_policy):
    reusing, plain = twins(make_char_policy, temperature=1.0, seed=7)
    prompts = [list(range(3, 25)), list(range(6, 30)) * 2]
    keys = [(1, 0), (2, 0)]
    reusing.generate(prompts, sample_keys=keys)  # fills the cache
    same_replies(reusing.generate(prompts, sample_keys=keys), plain.generate(prompts, sample_keys=keys))
    assert saved(reusing) > 0


def test_changed_weights_are_not_served_states_of_the_old_ones(make_char_policy):
    reusing, plain = twins(make_char_policy)
    prompts = [list(range(3, 25))]
    reusing.generate(prompts)
    with torch.no_grad():
        for parameter in reusing.model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.5)
    before = saved(reusing)
    same_replies(reusing.generate(prompts), plain.generate(prompts))
    assert saved(reusing) == before


def test_states_computed_under_autocast_are_not_served_to_a_pass_without_it(make_char_policy):
    # bfloat16 states reused in a float32 pass moved its log-probs by ~2e-2 (and the other way round)
    reusing, plain = twins(make_char_policy)
    prompts = [list(range(3, 25))]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reusing.generate(prompts)
    before = saved(reusing)
    same_replies(reusing.generate(prompts), plain.generate(prompts))
    assert saved(reusing) == before
    outside = weights_fingerprint(reusing.model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert weights_fingerprint(reusing.model) != outside


def test_a_sliding_window_model_is_not_served_and_says_why(make_char_policy):
    from transformers import MistralConfig, MistralForCausalLM

    policy = make_char_policy(seed=0, model_class=MistralForCausalLM, config_class=MistralConfig, sliding_window=8)
    policy.sampling = SamplingConfig(max_new_tokens=4, temperature=0.0)
    prompts = [list(range(3, 25))]
    policy.generate(prompts)
    policy.generate(prompts)
    assert policy.prefix_cache.stats.prompt_tokens == 0
    assert "sliding window" in policy.prefix_cache_reason


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "1024", True])
def test_a_bad_budget_is_refused_with_its_name(make_char_policy, bad):
    policy = make_char_policy(seed=0)
    with pytest.raises(ConfigError, match="prefix_cache_mb"):
        HFPolicy(policy.model, policy.tokenizer, prefix_cache_mb=bad)


def test_multi_turn_episodes_are_the_same_with_reuse(tiny_policy):
    """VerifiableQA's feedback turns extend the episode's last prompt: reused, same episodes."""
    config = SamplingConfig(max_new_tokens=12, temperature=0.0)
    reusing = HFPolicy(tiny_policy.model, tiny_policy.tokenizer, sampling=config)
    plain = HFPolicy(tiny_policy.model, tiny_policy.tokenizer, sampling=config, prefix_cache_mb=0)
    runs = [run_episodes(lambda: gym.make("rftgym/VerifiableQA-v0"), agent, seeds=[0, 1, 2],
                         config=RolloutConfig(num_envs=3)) for agent in (reusing, plain)]
    turns = [[(t.prompt_ids, t.sampled_ids) for e in episodes for t in e.turns] for episodes in runs]
    assert turns[0] == turns[1] and len(turns[0]) > 3
    assert reusing.prefix_cache.stats.saved_share > 0.5  # later turns ran only their new tokens


def test_replies_that_stop_early_keep_the_states_of_what_ran(make_char_policy):
    """Rows stop at different steps (the stop token is the one the model picks at some step): each
    keeps its prompt and the sampled tokens fed after it, and the next turn replies as without."""
    reusing, plain = twins(make_char_policy, max_new_tokens=12)
    first = [list(range(3, 23)), list(range(4, 32)), [5, 6, 7] * 8]
    replies = plain.generate(first)
    stop = replies[0].sampled_ids[3]  # a token the first reply samples at its 4th step
    for policy in (reusing, plain):
        policy.chat.stop_ids = (stop,)
    replies = reusing.generate(first)
    same_replies(replies, plain.generate(first))
    assert any(r.finish_reason == "stop" for r in replies) and len({len(r.sampled_ids) for r in replies}) > 1
    nxt = [p + r.sampled_ids + [10, 11, 12] for p, r in zip(first, replies)]
    before = saved(reusing)
    same_replies(reusing.generate(nxt), plain.generate(nxt))
    assert saved(reusing) - before == sum(len(p) + len(r.sampled_ids) - 1 for p, r in zip(first, replies))


def test_states_computed_before_the_weights_changed_are_not_kept():
    cache = PrefixKVCache(budget_bytes=10**6, min_reuse=2)
    cache.check_weights("old")
    cache.check_weights("new")  # another thread loaded weights while "old" states were computed
    cache.store(entry([1, 2, 3]), "old")
    assert len(cache) == 0
    cache.store(entry([1, 2, 3]), "new")
    assert len(cache) == 1


def test_a_model_whose_cache_cannot_be_read_back_is_not_served(make_char_policy, monkeypatch):
    import rftgym.agents.prefix_cache as prefix_cache

    reusing, plain = twins(make_char_policy)
    monkeypatch.setattr(prefix_cache, "layer_states", lambda cache, batch: None)
    prompts = [list(range(3, 25))]
    same_replies(reusing.generate(prompts), plain.generate(prompts))
    assert len(reusing.prefix_cache) == 0 and "DynamicCache" in reusing.prefix_cache_reason
    same_replies(reusing.generate(prompts), plain.generate(prompts))


def test_rotary_frequencies_that_follow_the_length_are_not_served(make_char_policy):
    policy = make_char_policy(seed=0, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert "dynamic" in policy.prefix_cache_reason


def test_training_leaves_no_stale_prefix_states(tmp_path, make_char_policy):
    from support import SayAEnv, train_config

    from rftgym.train import train

    policy = make_char_policy()
    train(train_config(tmp_path, steps=2), policy=policy, make_env=SayAEnv)
    assert policy.prefix_cache.stats.prompt_tokens > 0  # the rollouts went through the cache
    assert len(policy.prefix_cache) == 0


def test_a_run_sets_the_policy_budget_and_reports_what_reuse_saved(tmp_path, make_char_policy):
    import json

    from support import SayAEnv, train_config

    from rftgym.train import train

    policy = make_char_policy()
    train(train_config(tmp_path, steps=1, prefix_cache_mb=2.0), policy=policy, make_env=SayAEnv)
    assert policy.prefix_cache.budget_bytes == 2 * 2**20
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # Each group's 8 samples share their prompt: all but one run of it (and one token each) is saved.
    assert 0.5 < rows[0]["prefill_saved_share"] < 1.0 and rows[0]["prefix_evicted_mb"] == 0.0
    assert 0 < rows[0]["prefix_held_mb"] < 0.1  # 2 tasks x 8 replies of about 24 + 8 tokens, 256 bytes each
    # 10 KB hold a group's prompt and about two replies' states (256 bytes a token): the rest are dropped.
    tight = make_char_policy()
    train(train_config(tmp_path, "tight", steps=1, prefix_cache_mb=0.01), policy=tight, make_env=SayAEnv)
    rows = [json.loads(line) for line in (tmp_path / "tight" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["prefix_evicted_mb"] > 0 and 0 < rows[0]["prefix_held_mb"] <= 0.01
    off = make_char_policy()
    train(train_config(tmp_path, "off", steps=1, prefix_cache_mb=0), policy=off, make_env=SayAEnv)
    rows = [json.loads(line) for line in (tmp_path / "off" / "metrics.jsonl").read_text().splitlines()]
    assert not {"prefill_saved_share", "prefix_evicted_mb", "prefix_held_mb"} & set(rows[0])
    assert off.prefix_cache_reason == "prefix_cache_mb is 0"


def test_a_run_warns_that_its_budget_changes_nothing_where_the_fast_decoder_serves(tmp_path, make_char_policy):
    from support import SayAEnv, train_config

    from rftgym.train import train

    char = make_char_policy()
    fast = HFPolicy(char.model, char.tokenizer, fast_decode=True)
    assert fast.prefix_cache_unused.startswith("the fast decoder serves") and char.prefix_cache_unused is None
    with pytest.warns(UserWarning, match=r"prefix_cache_mb=2 \(--prefix-cache-mb\) changes nothing in this run: the fast decoder serves"):
        train(train_config(tmp_path, steps=1, prefix_cache_mb=2.0), policy=fast, make_env=SayAEnv)


def test_a_bad_run_budget_is_refused_with_its_name(tmp_path):
    from support import train_config

    for bad in (-1, float("nan"), "1024"):
        with pytest.raises(ConfigError, match="prefix_cache_mb"):
            train_config(tmp_path, prefix_cache_mb=bad)
