"""The fast decoder shared by threads: concurrent generations must not write each other's state."""

from __future__ import annotations

import copy
import pickle
import threading

import torch

from rftgym.agents.fast_decode import FastDecoder
from rftgym.agents.hf_policy import HFPolicy, SamplingConfig

GREEDY = SamplingConfig(max_new_tokens=8, temperature=0.0)
# Same batch size and lengths, hence the same cached state and (on CUDA) graph; other tokens.
FIRST = [[3, 4, 5, 6, 7], [8, 9, 10]]
SECOND = [[20, 21, 22, 23, 24], [25, 26, 27]]


def fast_policy(make_char_policy) -> HFPolicy:
    generic = make_char_policy()
    return HFPolicy(generic.model, generic.tokenizer, name="fast", fast_decode=True)


def sampled(replies):
    return [r.sampled_ids for r in replies]


def test_two_threads_generating_at_once_get_their_own_tokens(make_char_policy):
    policy = fast_policy(make_char_policy)
    expected = {"first": sampled(policy.generate(FIRST, GREEDY)), "second": sampled(policy.generate(SECOND, GREEDY))}
    assert expected["first"] != expected["second"]
    decoder = policy._fast[1]
    # Hold the first generation just after its prefill until the second has done its own prefill
    # (or, when the second must wait its turn, for a moment): without a lock or per-call state the
    # second overwrites the KV cache and buffers the first goes on decoding from.
    first_waiting, second_prefilled = threading.Event(), threading.Event()
    prefill = decoder.prefill

    def interleaved_prefill(*args, **kwargs):
        logits = prefill(*args, **kwargs)
        if threading.current_thread().name == "first":
            first_waiting.set()
            second_prefilled.wait(timeout=0.5)
        else:
            second_prefilled.set()
        return logits

    decoder.prefill = interleaved_prefill
    results, errors = {}, []

    def run(name, prompts):
        try:
            results[name] = sampled(policy.generate(prompts, GREEDY))
        except Exception as exc:  # reported below, not lost in the thread
            errors.append(exc)

    first = threading.Thread(target=run, args=("first", FIRST), name="first")
    second = threading.Thread(target=run, args=("second", SECOND), name="second")
    first.start()
    assert first_waiting.wait(timeout=30)
    second.start()
    first.join(timeout=60)
    second.join(timeout=60)
    assert not errors and results == expected


def test_results_are_copies_the_next_call_does_not_overwrite(make_char_policy):
    from rftgym.agents.fast_decode import DecodeSettings

    policy = fast_policy(make_char_policy)
    decoder, settings = FastDecoder(policy.model), DecodeSettings(8, 0.0, 0, 1.0)
    with torch.inference_mode():  # as the policy calls it
        first = decoder.generate(FIRST, settings, stop_ids=policy.chat.stop_ids, pad_id=policy.pad_id)
        kept = [t.clone() for t in first]
        decoder.generate(SECOND, settings, stop_ids=policy.chat.stop_ids, pad_id=policy.pad_id)  # same state
    for got, want in zip(first, kept):
        assert torch.equal(got, want)


def test_a_decoder_the_policy_used_runs_outside_inference_mode(make_char_policy):
    from rftgym.agents.fast_decode import DecodeSettings

    policy = fast_policy(make_char_policy)
    replies = sampled(policy.generate(FIRST, GREEDY))  # its state is made under inference_mode
    got = policy._fast[1].generate(FIRST, DecodeSettings(8, 0.0, 0, 1.0), stop_ids=policy.chat.stop_ids,
                                   pad_id=policy.pad_id)
    assert [row[:n].tolist() for row, n in zip(got[0], got[2])] == replies
    for tensor in got:  # plain tensors, as the generic loop gives: a caller may change them in place
        assert not tensor.is_inference()
        tensor.zero_()


def test_a_decoder_copies_and_pickles(make_char_policy):
    policy = fast_policy(make_char_policy)
    replies = sampled(policy.generate(FIRST, GREEDY))
    for clone in (copy.deepcopy(policy._fast[1]), pickle.loads(pickle.dumps(policy._fast[1]))):
        twin = HFPolicy(clone.model, policy.tokenizer, fast_decode=True)
        twin._fast = (clone.model, clone, None)
        assert sampled(twin.generate(FIRST, GREEDY)) == replies


def test_threads_meeting_at_a_fresh_policy_build_one_decoder(make_char_policy, monkeypatch):
    import rftgym.agents.fast_decode as fast_decode

    built = []

    class SlowFastDecoder(FastDecoder):  # slow to build, so that the threads all meet while it builds
        def __init__(self, model, options=None):
            built.append(self)
            threading.Event().wait(0.05)
            super().__init__(model, options)

    monkeypatch.setattr(fast_decode, "FastDecoder", SlowFastDecoder)
    policy = fast_policy(make_char_policy)
    start = threading.Barrier(4)
    got, errors = [], []

    def first_call():
        try:
            start.wait(timeout=30)
            got.append(policy._fast_decoder(16))
        except Exception as exc:  # reported below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=first_call) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors and len(built) == 1
    assert len(got) == 4 and all(decoder is built[0] for decoder in got)


def test_a_model_in_train_mode_samples_in_eval_mode_until_the_last_thread_is_done(make_char_policy):
    """The first generation to start finds the model in train mode (as between updates) and puts
    it in eval mode; one that ends while another still generates must not give train mode back."""
    policy = make_char_policy()
    policy.fast_decode = False
    policy.model.train()
    seen = {"A": [], "B": []}
    a_in, b_in, a_done = threading.Event(), threading.Event(), threading.Event()

    def hold(module, args, kwargs):
        who = threading.current_thread().name
        seen[who].append(module.training)
        if who == "A" and len(seen["A"]) == 1:
            a_in.set()
            b_in.wait(10)  # A (which began first) waits for B to be generating
        if who == "B" and len(seen["B"]) == 2:
            b_in.set()
            a_done.wait(10)  # B waits, mid-generation, until A has finished

    handle = policy.model.register_forward_pre_hook(hold, with_kwargs=True)

    def first():
        policy.generate([[3, 4, 5]], GREEDY)
        a_done.set()

    def second():
        a_in.wait(10)
        policy.generate([[6, 7, 8]], GREEDY)

    threads = [threading.Thread(target=first, name="A"), threading.Thread(target=second, name="B")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    handle.remove()
    assert len(seen["B"]) > 2 and not any(seen["A"] + seen["B"])  # every forward in eval mode
    assert policy.model.training  # given back once both were done
