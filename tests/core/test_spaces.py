"""AssistantText and ContextSpace: contains, seeded sampling, validation; random_text."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rftgym.core.messages import Context, Message
from rftgym.core.spaces import _TAG_FRAGMENTS, AssistantText, ContextSpace, random_text


# ---------------------------------------------------------------- random_text

@pytest.mark.parametrize("max_chars", [0, 1, 5, 50, 400])
def test_random_text_respects_the_length_limit(max_chars):
    rng = np.random.default_rng(0)
    texts = [random_text(rng, max_chars) for _ in range(200)]
    assert all(isinstance(t, str) and len(t) <= max_chars for t in texts)
    if max_chars >= 50:
        assert len(set(texts)) > 100  # it really is random, not a constant


def test_random_text_is_deterministic_under_the_rng_seed():
    a = [random_text(np.random.default_rng(3), 100) for _ in range(3)]
    b = [random_text(np.random.default_rng(3), 100) for _ in range(3)]
    assert a == b
    assert random_text(np.random.default_rng(3), 100) != random_text(np.random.default_rng(4), 100)


def test_random_text_mixes_in_protocol_tag_fragments():
    rng = np.random.default_rng(1)
    joined = "".join(random_text(rng, 200) for _ in range(300))
    assert "<answer>" in joined and "</answer>" in joined and "```" in joined
    assert sum(fragment in joined for fragment in _TAG_FRAGMENTS) >= len(_TAG_FRAGMENTS) - 2


# ---------------------------------------------------------------- AssistantText

def test_assistant_text_contains():
    space = AssistantText(max_chars=10)
    assert space.contains("")
    assert space.contains("0123456789")
    assert "abc" in space
    assert not space.contains("01234567890")
    assert not space.contains(b"bytes")
    assert not space.contains(None)
    assert not space.contains(["a"])


def test_assistant_text_samples_are_contained_and_seeded():
    space = AssistantText(max_chars=30, seed=7)
    samples = [space.sample() for _ in range(50)]
    assert all(space.contains(s) for s in samples)
    again = AssistantText(max_chars=30, seed=7)
    assert [again.sample() for _ in range(50)] == samples


@pytest.mark.parametrize("max_chars", [0, -1])
def test_assistant_text_rejects_non_positive_limits(max_chars):
    with pytest.raises(ValueError, match="max_chars must be positive"):
        AssistantText(max_chars=max_chars)


def test_assistant_text_sample_rejects_masks():
    with pytest.raises(NotImplementedError):
        AssistantText().sample(mask=1)
    with pytest.raises(NotImplementedError):
        AssistantText().sample(probability=1)


def test_assistant_text_equality_repr_and_flattening():
    assert AssistantText(5) == AssistantText(5)
    assert AssistantText(5) != AssistantText(6)
    assert AssistantText(5) != ContextSpace()
    assert repr(AssistantText(5)) == "AssistantText(max_chars=5)"
    assert AssistantText().is_np_flattenable is False


# ---------------------------------------------------------------- ContextSpace

def ctx(*roles: str, content: str = "x") -> Context:
    return Context(tuple(Message(r, content, f"i{k}") for k, r in enumerate(roles)))


def test_context_space_contains():
    space = ContextSpace(max_messages=3, max_message_chars=5, roles=("system", "user", "assistant"))
    assert space.contains(Context())
    assert space.contains(ctx("system", "user", "assistant"))
    assert not space.contains(ctx("system", "user", "assistant", "user"))  # too many
    assert not space.contains(ctx("user", content="123456"))  # too long
    assert not space.contains(ctx("tool"))  # role outside the space
    assert not space.contains([{"role": "user", "content": "x", "id": "a"}])
    assert not space.contains("not a context")


def test_context_space_samples_are_contained_valid_and_seeded():
    space = ContextSpace(max_messages=6, max_message_chars=40, roles=("system", "user"), seed=11)
    samples = [space.sample() for _ in range(100)]
    for sample in samples:
        assert isinstance(sample, Context)
        assert space.contains(sample)
        assert 1 <= len(sample) <= 6
        assert len(set(sample.ids)) == len(sample)
    assert {m.role for s in samples for m in s} == {"system", "user"}
    again = ContextSpace(max_messages=6, max_message_chars=40, roles=("system", "user"), seed=11)
    assert [again.sample() for _ in range(100)] == samples


def test_context_space_samples_round_trip_through_json():
    space = ContextSpace(seed=4)
    samples = [space.sample() for _ in range(50)]
    written = space.to_jsonable(samples)
    assert all(isinstance(c, list) and all(set(m) == {"role", "content", "id"} for m in c) for c in written)
    assert space.from_jsonable(json.loads(json.dumps(written))) == samples
    assert space.to_jsonable([Context()]) == [[]] and space.from_jsonable([[]]) == [Context()]
    with pytest.raises(TypeError, match=r"wrap one in a list: to_jsonable\(\[context\]\)"):
        space.to_jsonable(samples[0])


def test_context_space_from_jsonable_says_what_a_json_context_is():
    with pytest.raises(ValueError, match=r'a JSON context is a list of \{"role", "content", "id"\} objects'):
        ContextSpace().from_jsonable([[{"role": "user", "content": "hi"}]])


def test_context_space_from_jsonable_names_the_context_and_the_field():
    """The field Context.from_list names (context[0] has no 'id') comes with the sample it is in."""
    good = [{"role": "user", "content": "hi", "id": "m-1"}]
    with pytest.raises(ValueError, match=r"^sample_n\[1\]: context\[0\] has no 'id'"):
        ContextSpace().from_jsonable([good, [{"role": "user", "content": "hi"}]])


def test_context_space_from_jsonable_holds_a_context_to_the_spaces_roles():
    space = ContextSpace(roles=("system", "user", "assistant"))
    tool = [{"role": "user", "content": "hi", "id": "m-1"}, {"role": "tool", "content": "42", "id": "m-2"}]
    with pytest.raises(ValueError, match=r"^sample_n\[0\]: context\[1\].role is 'tool'; this space's roles are "
                                         r"system, user, assistant$"):
        space.from_jsonable([tool])
    assert ContextSpace().from_jsonable([tool])[0] in ContextSpace()
    # ... and to its sizes, which contains() checks too
    with pytest.raises(ValueError, match=r"^sample_n\[0\]: the context has 2 messages; this space holds at most 1$"):
        ContextSpace(max_messages=1).from_jsonable([tool])
    with pytest.raises(ValueError, match=r"^sample_n\[0\]: context\[0\].content has 2 characters; this space holds "
                                         r"at most 1 per message$"):
        ContextSpace(max_message_chars=1).from_jsonable([tool])


def test_context_space_single_role_samples():
    space = ContextSpace(max_messages=2, roles=("assistant",), seed=0)
    assert all(m.role == "assistant" for _ in range(20) for m in space.sample())


def test_context_space_rejects_unknown_roles():
    with pytest.raises(ValueError, match="Unknown roles \\['robot'\\]"):
        ContextSpace(roles=("user", "robot"))


def test_context_space_rejects_empty_roles():
    with pytest.raises(ValueError, match="at least one role"):
        ContextSpace(roles=())


@pytest.mark.parametrize("kwargs", [{"max_messages": 0}, {"max_message_chars": 0}, {"max_messages": -3}])
def test_context_space_rejects_non_positive_limits(kwargs):
    with pytest.raises(ValueError, match="must be positive"):
        ContextSpace(**kwargs)


def test_context_space_sample_rejects_masks():
    with pytest.raises(NotImplementedError):
        ContextSpace().sample(mask=1)


def test_context_space_equality_and_flattening():
    assert ContextSpace(roles=("user",)) == ContextSpace(roles=["user"])
    assert ContextSpace(max_messages=4) != ContextSpace(max_messages=5)
    assert ContextSpace(max_message_chars=4) != ContextSpace(max_message_chars=5)
    assert ContextSpace(roles=("user",)) != ContextSpace(roles=("user", "assistant"))
    assert ContextSpace().is_np_flattenable is False
    assert "max_messages=4" in repr(ContextSpace(max_messages=4))


@pytest.mark.parametrize("mode, kwargs", [("sync", {}), ("async", {"shared_memory": False})])
def test_envs_run_under_gymnasium_vector_envs(mode, kwargs):
    """``gym.make_vec`` batches contexts and texts as tuples; the async one needs shared_memory off
    (text has no fixed-size buffer), as the README says."""
    import gymnasium as gym

    import rftgym  # noqa: F401  (registers the envs)

    envs = gym.make_vec("rftgym/VerifiableQA-v0", num_envs=2, vectorization_mode=mode, vector_kwargs=kwargs)
    contexts, _ = envs.reset(seed=3)
    assert len(contexts) == 2 and all(isinstance(c, Context) for c in contexts)
    assert contexts[0] != contexts[1]  # seeds 3 and 4: two tasks
    assert all(envs.single_observation_space.contains(c) for c in contexts)
    _, rewards, terminated, _, _ = envs.step(("no answer here", "<answer>0</answer>"))
    assert rewards.shape == (2,) and terminated.shape == (2,)
    envs.close()
