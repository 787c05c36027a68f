"""Message, Context and MessageIds: validation, immutability, prefix logic, id determinism."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from rftgym.core.errors import DataFormatError
from rftgym.core.messages import ROLES, Context, Message, MessageIds


def msg(i: int, role: str = "user", content: str | None = None) -> Message:
    return Message(role, f"m{i}" if content is None else content, f"id{i}")


# ---------------------------------------------------------------- Message

@pytest.mark.parametrize("role", ROLES)
def test_message_accepts_every_role(role):
    m = Message(role, "hi", "x-0")
    assert (m.role, m.content, m.id) == (role, "hi", "x-0")


@pytest.mark.parametrize("role", ["bot", "", "System", None])
def test_message_rejects_unknown_role_and_names_the_allowed_ones(role):
    with pytest.raises(ValueError, match="role must be one of"):
        Message(role, "hi", "x")


@pytest.mark.parametrize("content", [None, 3, b"bytes", ["a"]])
def test_message_rejects_non_string_content(content):
    with pytest.raises(TypeError, match="content must be str"):
        Message("user", content, "x")


@pytest.mark.parametrize("bad_id", ["", None, 7])
def test_message_rejects_empty_or_non_string_id(bad_id):
    with pytest.raises(ValueError, match="id must be a non-empty string"):
        Message("user", "hi", bad_id)


def test_message_is_frozen():
    m = Message("user", "hi", "x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.content = "changed"  # type: ignore[misc]
    assert m.content == "hi"


def test_message_dict_round_trip_keeps_unusual_text():
    m = Message("assistant", "<answer>\u4e2d \ud800</answer>\n", "ab-3")
    d = m.to_dict()
    assert d == {"role": "assistant", "content": "<answer>\u4e2d \ud800</answer>\n", "id": "ab-3"}
    assert Message.from_dict(d) == m


@pytest.mark.parametrize("data, said", [
    ({"role": "user", "content": "hi"}, """message has no 'id'; a message is a {"role", "content", "id"} object"""),
    (["user", "hi", "x"], """message is ['user', 'hi', 'x'] (list); a message is a {"role", "content", "id"} object"""),
    ({"role": "bot", "content": "hi", "id": "x"},
     "message.role is 'bot' (str); it is one of system, user, assistant, tool"),
    ({"role": ["user"], "content": "hi", "id": "x"}, "message.role is ['user'] (list); it is one of system, user,"),
    ({"role": "user", "content": None, "id": "x"}, "message.content is None (NoneType); it is a string"),
    ({"role": "user", "content": "hi", "id": 7}, "message.id is 7 (int); it is a non-empty string"),
    ({"role": "user", "content": "hi", "id": ""}, "message.id is '' (str); it is a non-empty string"),
])
def test_a_message_dict_of_another_shape_is_refused_naming_the_field(data, said):
    with pytest.raises(DataFormatError, match=re.escape(said)):
        Message.from_dict(data)


def test_empty_content_is_allowed():
    assert Message("assistant", "", "x").content == ""


# ---------------------------------------------------------------- Context

def test_context_rejects_duplicate_ids():
    with pytest.raises(ValueError, match="Duplicate message id 'id1'"):
        Context((msg(1), msg(2), Message("assistant", "other", "id1")))


def test_context_rejects_non_messages():
    with pytest.raises(TypeError, match="Context holds Message objects, got dict"):
        Context(({"role": "user", "content": "x", "id": "a"},))


def test_context_converts_a_list_to_a_tuple():
    ctx = Context([msg(1), msg(2)])
    assert isinstance(ctx.messages, tuple)
    assert ctx.ids == ("id1", "id2")


def test_context_sequence_protocol():
    ctx = Context((msg(1), msg(2, "assistant"), msg(3)))
    assert len(ctx) == 3
    assert [m.id for m in ctx] == ["id1", "id2", "id3"]
    assert ctx[1] == msg(2, "assistant")
    assert ctx[-1].id == "id3"
    sliced = ctx[1:]
    assert isinstance(sliced, Context)
    assert sliced.ids == ("id2", "id3")
    assert len(Context()) == 0 and Context().ids == ()


def test_appended_returns_a_new_context_and_leaves_the_old_one_alone():
    ctx = Context((msg(1),))
    longer = ctx.appended(msg(2), msg(3))
    assert ctx.ids == ("id1",)
    assert longer.ids == ("id1", "id2", "id3")
    with pytest.raises(ValueError, match="Duplicate"):
        longer.appended(msg(2))


def test_without_drops_the_given_ids_only():
    ctx = Context((msg(1), msg(2), msg(3)))
    assert ctx.without(["id2"]).ids == ("id1", "id3")
    assert ctx.without({"id1", "id3", "not-there"}).ids == ("id2",)
    assert ctx.without([]) == ctx


def test_is_prefix_of():
    a = Context((msg(1), msg(2)))
    b = a.appended(msg(3))
    assert a.is_prefix_of(b)
    assert a.is_prefix_of(a)
    assert Context().is_prefix_of(a)
    assert not b.is_prefix_of(a)
    # same ids, edited content: not a prefix (the memory env's replacement case)
    edited = Context((msg(1), msg(2, content="summary"), msg(3)))
    assert not a.is_prefix_of(edited)
    # a deletion in the middle
    assert not a.is_prefix_of(b.without(["id2"]))


def test_to_chat_has_role_and_content_only():
    ctx = Context((msg(1, "system", "sys"), msg(2, "user", "q")))
    assert ctx.to_chat() == [{"role": "system", "content": "sys"}, {"role": "user", "content": "q"}]


def test_to_list_from_list_round_trip():
    ctx = Context((msg(1, "system"), msg(2, "user"), msg(3, "assistant"), msg(4, "tool")))
    data = ctx.to_list()
    assert data[2] == {"role": "assistant", "content": "m3", "id": "id3"}
    assert Context.from_list(data) == ctx


JSON_CONTEXT = 'a JSON context is a list of {"role", "content", "id"} objects, one per message'


@pytest.mark.parametrize("data, said", [
    ({"role": "user", "content": "hi", "id": "a"},
     f"the context is {{'role': 'user', 'content': 'hi', 'id': 'a'}} (dict); {JSON_CONTEXT}"),
    ([{"role": "user", "content": "hi", "id": "a"}, {"role": "user", "content": "hi"}],
     f"context[1] has no 'id'; {JSON_CONTEXT}"),
    ([{"role": "user", "content": "hi", "id": "a"}, "hi"], f"context[1] is 'hi' (str); {JSON_CONTEXT}"),
    ([{"role": "user", "content": 3, "id": "a"}], "context[0].content is 3 (int); it is a string"),
    ([{"role": "user", "content": "hi", "id": "a"}, {"role": "assistant", "content": "yo", "id": "a"}],
     "context[1].id 'a' is the id of an earlier message too; message ids are unique in a context"),
])
def test_a_context_list_of_another_shape_is_refused_naming_the_message_and_field(data, said):
    with pytest.raises(DataFormatError, match=re.escape(said)):
        Context.from_list(data)


def test_contexts_compare_and_hash_by_value():
    a = Context((msg(1), msg(2)))
    b = Context([msg(1), msg(2)])
    assert a == b and hash(a) == hash(b)
    assert a != Context((msg(2), msg(1)))


# ---------------------------------------------------------------- MessageIds

def test_message_ids_count_up_with_the_tag():
    ids = MessageIds("abc")
    assert [ids.new() for _ in range(3)] == ["abc-0", "abc-1", "abc-2"]
    m = ids.message("assistant", "hello")
    assert m == Message("assistant", "hello", "abc-3")


def test_message_ids_from_rng_are_deterministic_under_the_seed():
    a = MessageIds.from_rng(np.random.default_rng(5))
    b = MessageIds.from_rng(np.random.default_rng(5))
    c = MessageIds.from_rng(np.random.default_rng(6))
    assert a.tag == b.tag
    assert a.tag != c.tag
    assert len(a.tag) == 8 and int(a.tag, 16) >= 0
    assert [a.new(), a.new()] == [b.new(), b.new()]
