"""Episode records: segments (DESIGN.md section 2) and the JSONL round trip."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rftgym.core.messages import Context, Message
from rftgym.core.records import Episode, Segment, Turn, build_segments, read_episodes_jsonl, write_episodes_jsonl


def turn(index, prompt, sampled, logprobs=None, **kw) -> Turn:
    defaults = dict(context_ids=(), action="", reward=0.0, terminated=False, truncated=False)
    defaults.update(kw)
    return Turn(index=index, prompt_ids=prompt, sampled_ids=sampled, logprobs=logprobs, **defaults)


# ---------------------------------------------------------------- build_segments

def test_prefix_extending_turns_make_one_segment():
    turns = [
        turn(0, [1, 2, 3], [10, 11], [-0.1, -0.2]),
        # the next prompt: everything so far, then template / feedback tokens 4, 5
        turn(1, [1, 2, 3, 10, 11, 4, 5], [12], [-0.3]),
        turn(2, [1, 2, 3, 10, 11, 4, 5, 12, 6], [13, 14], [-0.4, -0.5]),
    ]
    (seg,) = build_segments(turns)
    assert seg.turn_indices == (0, 1, 2)
    assert seg.token_ids == [1, 2, 3, 10, 11, 4, 5, 12, 6, 13, 14]
    assert seg.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1, 0, 1, 1]
    assert seg.logprobs == [0.0, 0.0, 0.0, -0.1, -0.2, 0.0, 0.0, -0.3, 0.0, -0.4, -0.5]
    assert seg.prompt_length == 3
    assert seg.num_sampled == 5
    # mask 1 exactly on the sampled tokens, log-probs aligned with them
    sampled = [t for t, m in zip(seg.token_ids, seg.loss_mask) if m]
    assert sampled == [10, 11, 12, 13, 14]
    assert [lp for lp, m in zip(seg.logprobs, seg.loss_mask) if m] == [-0.1, -0.2, -0.3, -0.4, -0.5]
    assert all(lp == 0.0 for lp, m in zip(seg.logprobs, seg.loss_mask) if not m)
    assert len(seg.token_ids) == len(seg.loss_mask) == len(seg.logprobs)


def test_a_prompt_equal_to_everything_so_far_continues_the_segment():
    (seg,) = build_segments([turn(0, [1], [2], [-1.0]), turn(1, [1, 2], [3], [-2.0])])
    assert seg.token_ids == [1, 2, 3] and seg.loss_mask == [0, 1, 1]


def test_an_edited_context_starts_a_new_segment():
    turns = [
        turn(0, [1, 2], [10], [-0.1]),
        turn(1, [1, 2, 10, 3], [11], [-0.2]),
        # the memory env pruned token 10's message: the prompt no longer extends the segment
        turn(2, [1, 2, 7, 3, 11], [12, 13], [-0.3, -0.4]),
        turn(3, [1, 2, 7, 3, 11, 12, 13, 8], [14], [-0.5]),
    ]
    first, second = build_segments(turns)
    assert first.turn_indices == (0, 1)
    assert first.token_ids == [1, 2, 10, 3, 11] and first.loss_mask == [0, 0, 1, 0, 1]
    assert second.turn_indices == (2, 3)
    # the whole edited prompt is mask 0, including the old sampled token 11 it quotes
    assert second.token_ids == [1, 2, 7, 3, 11, 12, 13, 8, 14]
    assert second.loss_mask == [0, 0, 0, 0, 0, 1, 1, 0, 1]
    assert second.logprobs == [0.0] * 5 + [-0.3, -0.4, 0.0, -0.5]
    assert second.prompt_length == 5


def test_a_shorter_prompt_starts_a_new_segment():
    a, b = build_segments([turn(0, [1, 2, 3], [4]), turn(1, [1, 2], [5])])
    assert a.token_ids == [1, 2, 3, 4] and b.token_ids == [1, 2, 5]
    assert b.loss_mask == [0, 0, 1]


def test_turns_without_tokens_are_skipped():
    turns = [
        turn(0, None, None),                  # a text-only agent's turn
        turn(1, [1, 2], [3], [-1.0]),
        turn(2, [9], None),                   # half a record: still no tokens
        turn(3, [1, 2, 3, 4], [5], [-2.0]),
    ]
    (seg,) = build_segments(turns)
    assert seg.turn_indices == (1, 3)
    assert seg.token_ids == [1, 2, 3, 4, 5]
    assert build_segments([turn(0, None, None)]) == []
    assert build_segments([]) == []


def test_missing_logprobs_are_zero():
    (seg,) = build_segments([turn(0, [1], [2, 3], None)])
    assert seg.logprobs == [0.0, 0.0, 0.0] and seg.loss_mask == [0, 1, 1]


def test_empty_sampled_tokens_are_allowed():
    (seg,) = build_segments([turn(0, [1, 2], [], [])])
    assert seg.token_ids == [1, 2] and seg.num_sampled == 0


@pytest.mark.parametrize("logprobs", [[-0.1], [-0.1, -0.2, -0.3], []])
def test_mismatched_logprobs_raise(logprobs):
    with pytest.raises(ValueError, match="turn 5: .* log-probs for 2 sampled tokens"):
        build_segments([turn(4, [1], [2, 3], logprobs)])


def test_build_segments_does_not_mutate_the_turns():
    t0 = turn(0, [1], [2], [-1.0])
    t1 = turn(1, [1, 2, 3], [4], [-2.0])
    build_segments([t0, t1])
    assert t0.prompt_ids == [1] and t0.sampled_ids == [2] and t1.prompt_ids == [1, 2, 3]


# ---------------------------------------------------------------- Episode

def make_episode() -> Episode:
    msgs = [
        Message("system", "sys", "e-0"),
        Message("user", "What is 2+2?", "e-1"),
        Message("assistant", "hmm \ud800 lone surrogate \udfff and \U0001F600", "e-2"),
        Message("user", "Try again \x00", "e-3"),
        Message("assistant", "<answer>4</answer>", "e-4"),
    ]
    turns = [
        Turn(0, ("e-0", "e-1"), "hmm \ud800 lone surrogate \udfff and \U0001F600", 0.0, False, False,
             {"format_error": "no tag \udc80", "score": np.float32(0.5), "n": np.int64(3),
              "flags": np.array([True, False]), "ids": {"b", "a"}},
             prompt_ids=[1, 2], sampled_ids=[3, 4], logprobs=[-0.5, -0.25], finish_reason="stop"),
        Turn(1, ("e-0", "e-1", "e-2", "e-3"), "<answer>4</answer>", 1.0, True, False,
             {"success": True, "expected": "4"},
             prompt_ids=[1, 2, 3, 4, 5], sampled_ids=[6], logprobs=[-0.125], finish_reason="stop"),
    ]
    return Episode("rftgym/VerifiableQA-v0", 7, {m.id: m for m in msgs}, turns, tuple(m.id for m in msgs),
                   {"task_id": "t-1"})


def test_episode_summary_properties():
    ep = make_episode()
    assert ep.total_reward == 1.0
    assert ep.terminated and not ep.truncated and ep.success
    assert ep.num_sampled_tokens == 3
    assert ep.num_prompt_tokens == 7
    (seg,) = ep.segments
    assert seg.token_ids == [1, 2, 3, 4, 5, 6] and seg.loss_mask == [0, 0, 1, 1, 0, 1]


def test_empty_episode_properties():
    ep = Episode("x", None, {}, [], ())
    assert ep.total_reward == 0.0
    assert not ep.terminated and not ep.truncated and not ep.success
    assert ep.segments == [] and ep.context() == Context()


def test_episode_context_at_a_turn_and_at_the_end():
    ep = make_episode()
    assert ep.context(0).ids == ("e-0", "e-1")
    assert ep.context(1)[-1].content == "Try again \x00"
    assert ep.context().ids == ("e-0", "e-1", "e-2", "e-3", "e-4")


def test_to_json_is_plain_json_with_a_summary():
    data = make_episode().to_json()
    assert data["summary"] == {"total_reward": 1.0, "success": True, "turns": 2, "prompt_tokens": 7,
                               "sampled_tokens": 3, "segments": 1}
    assert list(data["turns"][1]["context_ids"]) == ["e-0", "e-1", "e-2", "e-3"]
    assert [m["id"] for m in data["messages"]] == ["e-0", "e-1", "e-2", "e-3", "e-4"]
    assert data["final_context_ids"] == ["e-0", "e-1", "e-2", "e-3", "e-4"]


def test_jsonl_round_trip_keeps_everything_including_lone_surrogates(tmp_path):
    path = tmp_path / "eps.jsonl"
    original = make_episode()
    assert write_episodes_jsonl(path, [original, original]) == 2
    raw = path.read_bytes()
    raw.decode("utf-8")  # the file is valid UTF-8 (lone surrogates are escaped)
    assert raw.count(b"\n") == 2
    loaded = list(read_episodes_jsonl(path))
    assert len(loaded) == 2
    ep = loaded[0]
    assert ep.env_id == original.env_id and ep.seed == 7 and ep.reset_info == {"task_id": "t-1"}
    assert ep.messages == original.messages
    assert ep.messages["e-2"].content == "hmm \ud800 lone surrogate \udfff and \U0001F600"
    assert ep.final_context_ids == original.final_context_ids
    assert ep.context() == original.context()
    t0, t1 = ep.turns
    assert t0.action == original.turns[0].action
    assert t0.context_ids == ("e-0", "e-1") and isinstance(t0.context_ids, tuple)
    assert (t0.prompt_ids, t0.sampled_ids, t0.logprobs) == ([1, 2], [3, 4], [-0.5, -0.25])
    # numpy values and sets in info become plain JSON values
    assert t0.info == {"format_error": "no tag \udc80", "score": 0.5, "n": 3, "flags": [True, False],
                       "ids": ["a", "b"]}
    assert (t1.reward, t1.terminated, t1.truncated, t1.finish_reason) == (1.0, True, False, "stop")
    assert ep.segments[0].token_ids == original.segments[0].token_ids
    assert ep.total_reward == original.total_reward and ep.success


def test_reader_skips_blank_lines_and_the_writer_accepts_a_generator(tmp_path):
    path = tmp_path / "eps.jsonl"
    write_episodes_jsonl(path, (make_episode() for _ in range(1)))
    path.write_text("\n" + path.read_text() + "\n  \n", encoding="utf-8")
    assert [e.seed for e in read_episodes_jsonl(path)] == [7]


def test_a_damaged_file_names_its_line_after_yielding_the_episodes_before_it(tmp_path):
    import gzip

    from rftgym.core.errors import DataFormatError

    path = tmp_path / "eps.jsonl"
    write_episodes_jsonl(path, [make_episode(), make_episode()])
    whole = path.read_text(encoding="utf-8")
    path.write_text(whole + whole.splitlines()[0][:300], encoding="utf-8")  # a run stopped mid-line
    read = []
    with pytest.raises(DataFormatError, match=r"eps.jsonl:3: not valid JSON \(.*, column \d+\); the text ends "
                                              r"before its JSON does \(cut short"):
        for episode in read_episodes_jsonl(path):
            read.append(episode)
    assert [e.seed for e in read] == [7, 7]
    path.write_text(whole + "[1, 2]\n", encoding="utf-8")
    with pytest.raises(DataFormatError, match="eps.jsonl:3: expected a JSON object, got list"):
        list(read_episodes_jsonl(path))
    path.write_text(whole + '{"env_id": "x"}\n', encoding="utf-8")
    with pytest.raises(DataFormatError, match=r"eps.jsonl:3: not an episode: the record has no 'messages'; expected "
                                              "one episode per line, as rftgym eval writes them"):
        list(read_episodes_jsonl(path))
    packed = tmp_path / "eps.jsonl.gz"  # gzipped, and with a byte-order mark
    packed.write_bytes(gzip.compress(("\ufeff" + whole).encode()))
    assert [e.seed for e in read_episodes_jsonl(packed)] == [7, 7]


def test_numbers_json_has_none_of_are_written_as_strings(tmp_path):
    import numpy as np

    episode = make_episode()
    episode.turns[0].info.update(nan=float("nan"), inf=float("inf"), scores=np.array([1.0, -np.inf]),
                                 deep={"x": [float("-inf")]}, half=np.float32("nan"))
    path = tmp_path / "eps.jsonl"
    write_episodes_jsonl(path, [episode])
    line = path.read_text(encoding="utf-8")
    record = json.loads(line, parse_constant=lambda name: pytest.fail(f"bare {name} in the JSON"))  # strict
    info = record["turns"][0]["info"]
    assert (info["nan"], info["inf"], info["scores"], info["deep"], info["half"]) == (
        "NaN", "Infinity", [1.0, "-Infinity"], {"x": ["-Infinity"]}, "NaN")


def test_each_line_is_one_json_object(tmp_path):
    path = tmp_path / "eps.jsonl"
    write_episodes_jsonl(path, [make_episode()])
    (line,) = path.read_text(encoding="utf-8").splitlines()
    assert json.loads(line)["env_id"] == "rftgym/VerifiableQA-v0"


def test_segment_num_sampled():
    assert Segment((0,), [1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], 1).num_sampled == 2


def test_unordered_and_unknown_info_values_are_written(tmp_path):
    path = tmp_path / "eps.jsonl"
    ep = Episode("x", None, {}, [Turn(0, (), "a", 0.0, True, False, {"mixed": {1, "a"}, "obj": object})], ())
    write_episodes_jsonl(path, [ep])
    (loaded,) = read_episodes_jsonl(path)
    assert loaded.turns[0].info == {"mixed": ["a", 1], "obj": repr(object)}  # ordered by repr


def test_info_values_no_copy_can_take_are_written_as_their_text(tmp_path):
    """The engine keeps such values as they are (a lock, a generator: its snapshot cannot copy
    them); writing the episode must not try to copy them either."""
    import threading

    lock = threading.Lock()
    path = tmp_path / "eps.jsonl"
    ep = Episode("x", None, {}, [Turn(0, (), "a", 0.0, True, False, {"lock": lock, "n": 1})], ())
    write_episodes_jsonl(path, [ep])
    (loaded,) = read_episodes_jsonl(path)
    assert loaded.turns[0].info == {"lock": repr(lock), "n": 1}


def test_an_info_value_that_holds_itself_is_written_with_a_note_where_it_recurs(tmp_path):
    # It was followed until Python's recursion limit: rftgym eval stopped with a bare RecursionError.
    loop: list = [1]
    loop.append(loop)
    table: dict = {"a": 1}
    table["self"] = table
    shared = [2]  # one list twice, side by side: no cycle, written twice
    path = tmp_path / "eps.jsonl"
    ep = Episode("x", None, {}, [Turn(0, (), "a", 0.0, True, False, {"loop": loop, "table": table,
                                                                      "twice": [shared, shared]})], ())
    write_episodes_jsonl(path, [ep])
    (loaded,) = read_episodes_jsonl(path)
    assert loaded.turns[0].info == {"loop": [1, "<the list that holds this one>"],
                                    "table": {"a": 1, "self": "<the dict that holds this one>"},
                                    "twice": [[2], [2]]}


def test_dataclasses_in_info_are_written_as_objects_of_their_fields(tmp_path):
    from dataclasses import dataclass

    @dataclass
    class Result:
        passed: int
        total: int

    path = tmp_path / "eps.jsonl"
    ep = Episode("x", None, {}, [Turn(0, (), "a", 0.0, True, False, {"result": Result(1, 2), "all": [Result(0, 1)]})],
                 ())
    write_episodes_jsonl(path, [ep])
    (loaded,) = read_episodes_jsonl(path)
    assert loaded.turns[0].info == {"result": {"passed": 1, "total": 2}, "all": [{"passed": 0, "total": 1}]}


def test_info_keys_json_cannot_write_are_written_as_their_text(tmp_path):
    import numpy as np

    path = tmp_path / "eps.jsonl"
    info = {"by_pair": {(1, 2): "a"}, "nested": [{np.int64(3): 1.5}], 7: "int keys are JSON's own"}
    ep = Episode("x", None, {}, [Turn(0, (), "a", 0.0, True, False, info)], ())
    write_episodes_jsonl(path, [ep])
    (loaded,) = read_episodes_jsonl(path)
    assert loaded.turns[0].info == {"by_pair": {"(1, 2)": "a"}, "nested": [{"3": 1.5}], "7": "int keys are JSON's own"}


def test_info_keys_with_the_same_text_keep_every_entry(tmp_path):
    path = tmp_path / "eps.jsonl"
    info = {"1": "string one", 1: "int one", "(1, 2)": "text", (1, 2): "tuple", None: "none", "null": "text null",
            "True": "text", 2.5: "float", "2.5": "text 2.5", "1 (int)": "taken"}
    ep = Episode("x", None, {}, [Turn(0, (), "a", 0.0, True, False, info)], ())
    write_episodes_jsonl(path, [ep])
    line = path.read_text()
    (loaded,) = read_episodes_jsonl(path)
    assert loaded.turns[0].info == {
        "1": "string one", "1 (int) #2": "int one", "(1, 2)": "text", "(1, 2) (tuple)": "tuple",
        "null (NoneType)": "none", "null": "text null", "True": "text", "2.5 (float)": "float", "2.5": "text 2.5",
        "1 (int)": "taken"}
    assert len(loaded.turns[0].info) == len(info)  # nothing overwritten
    assert line.count('"1"') == 1  # no duplicate key in the JSON text
