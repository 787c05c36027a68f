"""Episode.from_json checks the links and types of a record: a hand-edited or damaged episodes
file is refused with a DataFormatError naming the field (and, read from a file, its line), and
every record the rollout engine and Episode.to_json make still reads back exactly."""

from __future__ import annotations

import copy
import json
import re

import gymnasium as gym
import pytest

import rftgym  # noqa: F401
from rftgym.agents.base import Agent, AgentReply
from rftgym.agents.memory_baselines import HeuristicPruner, WorldOracleAgent
from rftgym.agents.scripted import ScriptedAgent, assistant_turns
from rftgym.core.errors import DataFormatError
from rftgym.core.messages import Message
from rftgym.core.records import (CONTEXT_FULL, Episode, Turn, episode_json_line, read_episodes_jsonl,
                                 write_episodes_jsonl)
from rftgym.envs.memory.env import MemoryQAEnv
from rftgym.envs.search.world import World
from rftgym.rollout import run_episodes


class CountingTokenAgent(Agent):
    """Replies with made-up token records (a prompt as long as the context, two sampled tokens),
    and on the third turn finds no room left (an empty CONTEXT_FULL reply, as HFPolicy gives)."""

    def act(self, contexts):
        replies = []
        for context in contexts:
            if assistant_turns(context) == 2:
                replies.append(AgentReply(text="", finish_reason=CONTEXT_FULL))
                continue
            replies.append(AgentReply(text="no tag here", prompt_ids=list(range(3 * len(context))),
                                      sampled_ids=[7, 8], logprobs=[-0.5, -0.25], finish_reason="stop"))
        return replies


def engine_episodes() -> list[Episode]:
    """Episodes as the rollout engine makes them: text turns, token turns ending for want of
    context, and a memory env's pruned contexts (messages no longer in the final context)."""
    text = run_episodes(lambda: gym.make("rftgym/VerifiableQA-v0", max_turns=3),
                        ScriptedAgent(["no tag", "<answer>x</answer>"]), seeds=[0, 1])
    with pytest.warns(UserWarning, match="not bound to its message"):
        tokens = run_episodes(lambda: gym.make("rftgym/VerifiableQA-v0", max_turns=5), CountingTokenAgent(),
                              seeds=[2])
    pruner = HeuristicPruner(WorldOracleAgent(World(0, 30)), keep_turns=1, min_stale=2)
    memory = run_episodes(lambda: MemoryQAEnv(world_size=30, objectives=3, hops=(2, 3), max_context_tokens=None),
                          pruner, seeds=[0])
    return text + tokens + memory


def test_records_the_engine_makes_read_back_exactly(tmp_path):
    episodes = engine_episodes()
    assert episodes[2].context_full and episodes[2].turns[0].has_tokens
    assert set(episodes[3].messages) - set(episodes[3].final_context_ids)  # pruned messages are kept
    path = tmp_path / "eps.jsonl"
    write_episodes_jsonl(path, episodes)
    loaded = list(read_episodes_jsonl(path))
    assert [episode_json_line(e) for e in loaded] == path.read_text(encoding="utf-8").splitlines()
    assert loaded == episodes
    assert [len(e.segments) for e in loaded] == [len(e.segments) for e in episodes]


def test_optional_fields_may_be_left_out_and_json_integers_are_log_probs():
    record = base_record()
    for key in ("seed", "reset_info", "summary"):
        del record[key]
    for key in ("info", "prompt_ids", "sampled_ids", "logprobs", "finish_reason", "message_id"):
        del record["turns"][1][key]
    record["turns"][0]["logprobs"] = [0, -1]
    episode = Episode.from_json(record)
    assert episode.seed is None and episode.reset_info == {} and not episode.turns[1].has_tokens
    assert episode.turns[0].logprobs == [0, -1]
    record["turns"][0]["logprobs"] = [-1e308, -1e308]  # finite, though their sum is not
    assert Episode.from_json(record).turns[0].logprobs == [-1e308, -1e308]


def base_record() -> dict:
    messages = [Message("system", "sys", "m-0"), Message("user", "2+2?", "m-1"),
                Message("assistant", "hm", "m-2"), Message("user", "again", "m-3"),
                Message("assistant", "<answer>4</answer>", "m-4")]
    turns = [Turn(0, ("m-0", "m-1"), "hm", 0.0, False, False, {"format_error": "no tag"},
                  prompt_ids=[1, 2], sampled_ids=[3, 4], logprobs=[-0.5, -0.25], finish_reason="stop",
                  message_id="m-2"),
             Turn(1, ("m-0", "m-1", "m-2", "m-3"), "<answer>4</answer>", 1.0, True, False, {"success": True},
                  prompt_ids=[1, 2, 3, 4, 5], sampled_ids=[6], logprobs=[-0.125], finish_reason="stop",
                  message_id="m-4")]
    episode = Episode("rftgym/VerifiableQA-v0", 7, {m.id: m for m in messages}, turns,
                      tuple(m.id for m in messages), {"task_id": "t-1"})
    return json.loads(episode_json_line(episode))


def _set(path: str, value):
    """A change to a record: the value at ``path`` ("turns.0.reward") set, or deleted for DELETE."""
    def change(record):
        *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        target = record
        for key in parents:
            target = target[key]
        if value is DELETE:
            del target[last]
        else:
            target[last] = value
    return change


DELETE = object()

# (change, what the error says): one case for each link and type a written record keeps.
DAMAGE = [
    (_set("env_id", DELETE), r"the record has no 'env_id'"),
    (_set("env_id", 3), r"env_id is 3 \(int\); it is a string"),
    (_set("seed", "7"), r"seed is '7' \(str\); it is an integer, or null"),
    (_set("seed", True), r"seed is True \(bool\); it is an integer, or null"),
    (_set("messages", {"m-0": {}}), r"messages is \{'m-0': \{\}\} \(dict\); it is a list"),
    (_set("messages.1", "m-1"), r"messages\[1\] is 'm-1' \(str\); a message is a \{\"role\", \"content\", \"id\"\} object"),
    (_set("messages.1.role", DELETE), r"messages\[1\] has no 'role'"),
    (_set("messages.1.role", "robot"), r"messages\[1\].role is 'robot' \(str\); it is one of system, user, assistant, tool"),
    (_set("messages.1.content", None), r"messages\[1\].content is None \(NoneType\); it is a string"),
    (_set("messages.1.id", ""), r"messages\[1\].id is '' \(str\); it is a non-empty string"),
    (_set("messages.3.id", "m-1"), r"messages\[3\].id 'm-1' is the id of an earlier message too"),
    (_set("turns", None), r"turns is None \(NoneType\); it is a list"),
    (_set("turns.1", []), r"turns\[1\] is \[\] \(list\); it is an object"),
    (_set("turns.1.mask", [1]), r"turns\[1\] has the key 'mask', which no turn has; a turn's keys are index, "),
    (_set("turns.1.reward", DELETE), r"turns\[1\] has no 'reward'"),
    (_set("turns.1.index", 0), r"turns\[1\].index is 0 \(int\); a turn's index is its place in turns \(1\)"),
    (_set("turns.1.index", "1"), r"turns\[1\].index is '1' \(str\)"),
    (_set("turns.1.context_ids", "m-0"), r"turns\[1\].context_ids is 'm-0' \(str\); it is a list"),
    (_set("turns.1.context_ids.2", "m-9"), r"turns\[1\].context_ids\[2\] is 'm-9' \(str\), which is the id of "
                                           r"none of the episode's messages"),
    (_set("turns.1.context_ids.2", 2), r"turns\[1\].context_ids\[2\] is 2 \(int\), which is the id of none"),
    (_set("turns.1.context_ids.2", "m-0"), r"turns\[1\].context_ids\[2\] is 'm-0' again; a context holds each "
                                           "message once"),
    (_set("turns.1.action", None), r"turns\[1\].action is None \(NoneType\); it is a string"),
    (_set("turns.1.reward", "1.0"), r"turns\[1\].reward is '1.0' \(str\); a reward is a finite number"),
    (_set("turns.1.reward", True), r"turns\[1\].reward is True \(bool\)"),
    (_set("turns.1.reward", float("nan")), r"turns\[1\].reward is nan \(float\); a reward is a finite number"),
    (_set("turns.1.reward", 10 ** 400), r"turns\[1\].reward is 1000000000.* \(int\); a reward is a finite number"),
    (_set("turns.1.terminated", 1), r"turns\[1\].terminated is 1 \(int\); it is true or false"),
    (_set("turns.1.truncated", None), r"turns\[1\].truncated is None \(NoneType\); it is true or false"),
    (_set("turns.1.info", []), r"turns\[1\].info is \[\] \(list\); it is an object"),
    (_set("turns.1.prompt_ids", "12345"), r"turns\[1\].prompt_ids is '12345' \(str\); it is a list"),
    (_set("turns.1.prompt_ids.3", 4.0), r"turns\[1\].prompt_ids\[3\] is 4.0 \(float\); token ids are integers >= 0 "),
    (_set("turns.1.prompt_ids.3", None), r"turns\[1\].prompt_ids\[3\] is None \(NoneType\)"),
    (_set("turns.1.prompt_ids.3", [4]), r"turns\[1\].prompt_ids\[3\] is \[4\] \(list\)"),
    (_set("turns.1.prompt_ids.3", 1 << 64), r"turns\[1\].prompt_ids\[3\] is 18446744073709551616 \(int\); token ids "
                                            r"are integers >= 0 \(that fit in 64 bits\)"),
    (_set("turns.1.sampled_ids.0", -6), r"turns\[1\].sampled_ids\[0\] is -6 \(int\); token ids are integers >= 0"),
    (_set("turns.1.sampled_ids", None), r"turns\[1\].prompt_ids is given but sampled_ids is null; a turn records "
                                        "both token lists, or neither"),
    (_set("turns.1.prompt_ids", None), r"turns\[1\].sampled_ids is given but prompt_ids is null"),
    (_set("turns.1.logprobs", [-0.1, -0.2]), r"turns\[1\].logprobs has 2 entries for the 1 tokens of sampled_ids; "
                                             "a turn has one log-prob per sampled token"),
    (_set("turns.1.logprobs", []), r"turns\[1\].logprobs has 0 entries for the 1 tokens"),
    (_set("turns.1.logprobs", {"0": -0.1}), r"turns\[1\].logprobs is \{'0': -0.1\} \(dict\); it is a list"),
    (_set("turns.1.logprobs.0", "-0.1"), r"turns\[1\].logprobs\[0\] is '-0.1' \(str\); a log-prob is a finite "
                                         "number"),
    (_set("turns.1.logprobs.0", float("-inf")), r"turns\[1\].logprobs\[0\] is -inf \(float\)"),
    (_set("turns.1.logprobs.0", float("nan")), r"turns\[1\].logprobs\[0\] is nan \(float\)"),
    (_set("turns.1.logprobs.0", None), r"turns\[1\].logprobs\[0\] is None \(NoneType\)"),
    (_set("turns.1.logprobs.0", 5.0), r"turns\[1\].logprobs\[0\] is 5.0 \(float\); a log-prob is a finite number "
                                      "at most 0"),
    (_set("turns.1.logprobs.0", True), r"turns\[1\].logprobs\[0\] is True \(bool\)"),
    (_set("turns.1.logprobs.0", False), r"turns\[1\].logprobs\[0\] is False \(bool\)"),
    (_set("turns.1.finish_reason", 0), r"turns\[1\].finish_reason is 0 \(int\); it is a string"),
    (_set("turns.1.message_id", "m-9"), r"turns\[1\].message_id is 'm-9', which is the id of none of the "
                                        "episode's messages"),
    (_set("turns.1.message_id", 4), r"turns\[1\].message_id is 4 \(int\); it is a string"),
    (_set("final_context_ids", DELETE), r"the record has no 'final_context_ids'"),
    (_set("final_context_ids.4", "m-5"), r"final_context_ids\[4\] is 'm-5' \(str\), which is the id of none"),
    (_set("reset_info", "t-1"), r"reset_info is 't-1' \(str\); it is an object"),
]


@pytest.mark.parametrize("change, message", DAMAGE, ids=[m[:40] for _, m in DAMAGE])
def test_a_damaged_record_is_refused_naming_its_field(change, message):
    record = copy.deepcopy(base_record())
    change(record)
    with pytest.raises(DataFormatError, match=f"^{message}"):
        Episode.from_json(record)


def test_logprobs_without_sampled_tokens_are_refused():
    record = base_record()
    record["turns"][1].update(prompt_ids=None, sampled_ids=None)
    with pytest.raises(DataFormatError, match=r"^turns\[1\].logprobs is given but sampled_ids is null"):
        Episode.from_json(record)


@pytest.mark.parametrize("record", [None, [], "episode"])
def test_a_record_that_is_not_an_object_is_refused(record):
    with pytest.raises(DataFormatError, match=r"^the record is .*; it is an object"):
        Episode.from_json(record)


def test_a_damaged_line_of_a_file_names_the_file_the_line_and_the_field(tmp_path):
    good = json.dumps(base_record())
    bad = base_record()
    bad["turns"][0]["context_ids"].append("m-7")
    path = tmp_path / "eps.jsonl"
    path.write_text(f"{good}\n\n{json.dumps(bad)}\n{good}\n", encoding="utf-8")
    read = []
    expected = (f"{re.escape(str(path))}:3: not an episode: turns\\[0\\].context_ids\\[2\\] is 'm-7' \\(str\\), "
                "which is the id of none of the episode's messages; expected one episode per line")
    with pytest.raises(DataFormatError, match=expected):
        for episode in read_episodes_jsonl(path):
            read.append(episode)
    assert [e.seed for e in read] == [7]


def test_a_long_value_is_shown_cut_short():
    record = base_record()
    record["turns"][0]["action"] = list(range(1000))
    with pytest.raises(DataFormatError, match=r"^turns\[0\].action is \[0, 1, 2, .{30,60}\.\.\. \(list\); it is"):
        Episode.from_json(record)
