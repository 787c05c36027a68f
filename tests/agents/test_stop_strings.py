"""Stop strings: a local policy's reply ends at the token that completes one, on either decode path."""

from __future__ import annotations

import pytest

from rftgym.agents.fast_decode import FastDecodeOptions
from rftgym.agents.hf_policy import HFPolicy, SamplingConfig
from rftgym.agents.stop_strings import StopStrings, checked_stop_strings
from rftgym.core.errors import ConfigError
from rftgym.core.messages import Context, Message

PIECES = {0: "I will ", 1: "<sea", 2: "rch>", 3: "Veloria", 4: "</", 5: "search>\n", 6: "<information>", 7: "é"}


def decode(ids):
    return "".join(PIECES[i] for i in ids)


def test_a_reply_keeps_the_token_that_completes_the_string_and_nothing_after():
    stops = StopStrings(["</search>"], decode)
    assert stops.cut([0, 1, 2, 3, 4, 5, 6]) == 6  # "</" + "search>\n": the string spans two tokens
    assert stops.cut([0, 1, 2, 3, 4, 6]) is None  # never completed
    assert stops.cut([0, 4, 5, 4, 5]) == 3  # the first one
    assert stops.cut([]) is None
    # Of several strings, whichever is completed first; one held in a single token stops there.
    assert StopStrings(["<information>", "</search>"], decode).cut([0, 1, 2, 3, 4, 5, 6]) == 6
    assert StopStrings(["rch>V"], decode).cut([0, 1, 2, 3, 4, 5]) == 4
    assert StopStrings(["é"], decode).cut([3, 7, 7]) == 2  # a string of two bytes: its window has room


BYTES = {100: b"\xe2", 101: b"\x86", 102: b"\x92", 103: b"\xc3", 104: b"\xa9", 105: b"s", 106: b"e", 107: b"\xff"}


def byte_fallback_decode(ids):
    """As a byte-fallback tokenizer (Llama 2, Mistral, Gemma) decodes: text tokens as they are, and
    each run of byte tokens as its UTF-8 text, or one U+FFFD per byte where the run is not valid."""
    out, run = [], b""
    for i in list(ids) + [None]:
        if i in BYTES:
            run += BYTES[i]
            continue
        if run:
            try:
                out.append(run.decode("utf-8"))
            except UnicodeDecodeError:
                out.append("\ufffd" * len(run))
            run = b""
        if i is not None:
            out.append(PIECES[i])
    return "".join(out)


def test_a_string_of_byte_tokens_is_found_at_the_token_that_completes_it():
    stops = StopStrings(["é"], byte_fallback_decode)
    # "I will " + "→" (3 byte tokens) + "é" (2) + " world": the stop ends at the 6th token, the
    # whole run of byte tokens read once its characters are whole (a window of bytes read '���').
    assert stops.cut([0, 100, 101, 102, 103, 104, 3]) == 6
    assert stops.cut([0, 100, 101, 102, 3]) is None
    # "se" spelled in byte tokens, then an invalid byte: the text read so far held "se" at the 3rd
    # token, though the whole reply's text, its run of bytes invalid, does not.
    assert "se" not in byte_fallback_decode([0, 105, 106, 107])
    assert StopStrings(["se"], byte_fallback_decode).cut([0, 105, 106, 107]) == 3
    reader = StopStrings(["se"], byte_fallback_decode).reader()  # as the generic loop reads a row
    assert [reader.completes_stop([0, 105, 106, 107][:n]) for n in (1, 2, 3)] == [False, False, True]


BYTE_LEVEL = {1: b"Answer", 2: b":", 3: b" \xe6", 4: b"\x9d", 5: b"\xb1", 6: "\ufffd".encode(), 7: b"x"}


def byte_level_decode(ids):
    """As a byte-level BPE tokenizer (GPT-2, SmolLM2) decodes: the tokens' bytes as UTF-8, an
    unfinished character as U+FFFD."""
    return b"".join(BYTE_LEVEL[i] for i in ids).decode("utf-8", errors="replace")


def test_a_string_ending_in_a_token_that_also_begins_a_character_stops_there():
    # ' \xe6' holds the stop string's last space and the first byte of 東: the string is whole at
    # the 3rd token, though the character is not (it was found two tokens late, or, cut there, never).
    stops = StopStrings(["Answer: "], byte_level_decode)
    assert stops.cut([1, 2, 3, 4, 5, 7]) == 3 and stops.cut([1, 2, 3]) == 3


def test_a_reply_of_real_replacement_characters_is_read_in_linear_work():
    """A U+FFFD that is text, not an unfinished character, is read as it stands after a few tokens
    (the window of held tokens grew with the reply, and was decoded twice a token)."""
    decoded = []

    def counting_decode(ids):
        decoded.append(len(ids))
        return byte_level_decode(ids)

    ids = [6] * 400 + [7]
    assert StopStrings(["x"], counting_decode).cut(ids) == 401
    assert sum(decoded) < 20 * len(ids)
    decoded.clear()  # a reply with no stop string and clean text: one decode of the whole settles it
    assert StopStrings(["Answer: "], counting_decode).cut([7] * 300) is None and decoded == [300]


def test_checked_stop_strings_takes_one_string_or_none_and_refuses_empty_ones():
    assert checked_stop_strings("</search>") == ("</search>",)
    assert checked_stop_strings(None) == ()
    assert checked_stop_strings(["a", "b"]) == ("a", "b")
    for bad in ([""], ("a", 3), 5, {"a"}):
        with pytest.raises(ConfigError, match=r"stop strings must be non-empty strings .*, got "):
            checked_stop_strings(bad)
    assert SamplingConfig(stop="</search>").stop == ("</search>",)
    with pytest.raises(ConfigError, match="stop strings must be"):
        SamplingConfig(stop=("",))


def _policies(make_char_policy):
    """The generic decode loop and the fast path (run eagerly on CPU) over the same tiny model."""
    generic = make_char_policy(0)
    generic.fast_decode = False
    fast = HFPolicy(generic.model, generic.tokenizer, name="fast", fast_decode=True)
    return generic, fast


PROMPTS = [[3, 4, 5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17], [18]]
KEYS = [(0, i, 0, 0) for i in range(len(PROMPTS))]


@pytest.mark.parametrize("fast_path", [False, True])
def test_replies_are_the_free_replies_cut_at_their_first_stop_string(make_char_policy, fast_path):
    generic, fast = _policies(make_char_policy)
    policy = fast if fast_path else generic
    free_sampling = SamplingConfig(max_new_tokens=24, temperature=1.0, seed=0)
    free = policy.generate(PROMPTS, free_sampling, sample_keys=KEYS)
    stop = free[0].text[3:5]  # two characters (tokens) row 0 writes at its 4th and 5th steps
    assert len(stop) == 2 and stop not in free[0].text[:4]
    replies = policy.generate(PROMPTS, SamplingConfig(max_new_tokens=24, temperature=1.0, seed=0, stop=(stop,)),
                              sample_keys=KEYS)
    cut_rows = 0
    for whole, reply in zip(free, replies, strict=True):
        # the fewest tokens whose text holds the string (some tokens here are special: several characters)
        keep = next((n for n in range(1, len(whole.sampled_ids) + 1)
                     if stop in policy.chat.decode_reply(whole.sampled_ids[:n])), None)
        if keep is None:
            assert reply == whole
            continue
        cut_rows += 1
        assert reply.sampled_ids == whole.sampled_ids[:keep]
        assert reply.text == policy.chat.decode_reply(whole.sampled_ids[:keep])
        assert reply.logprobs == pytest.approx(whole.logprobs[:keep], abs=1e-5)
        assert reply.finish_reason == "stop" and reply.prompt_ids == whole.prompt_ids
    assert cut_rows >= 1 and len(replies[0].sampled_ids) == 5


def test_both_decode_paths_stop_at_the_same_token(make_char_policy):
    generic, fast = _policies(make_char_policy)
    for stop in ("a", "e", "ab", " "):
        sampling = SamplingConfig(max_new_tokens=16, temperature=1.0, seed=9, stop=(stop, "zz"))
        ours = fast.generate(PROMPTS, sampling, sample_keys=KEYS)
        theirs = generic.generate(PROMPTS, sampling, sample_keys=KEYS)
        assert [r.sampled_ids for r in ours] == [r.sampled_ids for r in theirs]
        assert [r.finish_reason for r in ours] == [r.finish_reason for r in theirs]


def test_bucketed_fast_path_cuts_too(make_char_policy):
    from rftgym.agents.fast_decode import FastDecoder

    generic, fast = _policies(make_char_policy)
    fast._fast = (fast.model, FastDecoder(fast.model, FastDecodeOptions(bucket=True, length_bucket=16)), None)
    sampling = SamplingConfig(max_new_tokens=12, temperature=0.0, stop=("g", "o"))  # rows 0 and 2 write only g and o
    ours, theirs = fast.generate(PROMPTS, sampling), generic.generate(PROMPTS, sampling)
    assert [r.sampled_ids for r in ours] == [r.sampled_ids for r in theirs]
    assert [r.finish_reason for r in ours] == ["stop", "length", "stop", "length"]
    assert len(ours[0].sampled_ids) == len(ours[2].sampled_ids) == 1


def test_the_next_prompt_closes_a_reply_that_stopped_at_a_string(make_char_policy):
    """Such a reply ends without the end-of-turn token: the template's closing follows its exact
    tokens in the next prompt, as after a reply cut at the token limit."""
    policy = make_char_policy(0)
    first = Context((Message("user", "say hi", "m0"),))
    policy.sampling = SamplingConfig(max_new_tokens=8, temperature=0.0)
    free = policy.act([first])[0]
    stop = free.text[:2]
    policy.sampling = SamplingConfig(max_new_tokens=8, temperature=0.0, stop=(stop,))
    reply = policy.act([first])[0]
    assert free.finish_reason == "length" and reply.finish_reason == "stop" and reply.text == stop
    assert reply.sampled_ids == free.sampled_ids[:2]
    message = Message("assistant", reply.text, "m1")
    span = policy.assistant_span(message, reply)
    closing = policy.chat._encode(policy.chat.closing)
    assert span == tuple(policy.chat.generation_prompt_ids) + tuple(reply.sampled_ids) + tuple(closing)
