"""What every env does alike with agent text: human mode prints whatever the agent wrote, never
raising; a reply cut at max_action_chars is reported, not silently shortened; and tags inside
<think> are reasoning, not acts."""

from __future__ import annotations

import gymnasium as gym
import pytest

import rftgym  # noqa: F401 (registers the envs)

ENV_IDS = ["rftgym/VerifiableQA-v0", "rftgym/SearchEvalQA-v0", "rftgym/MemoryQA-v0", "rftgym/CodeTCG-v0"]


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_human_rendering_escapes_text_the_terminal_cannot_encode(env_id, capsys):
    env = gym.make(env_id, render_mode="human")
    try:
        env.reset(seed=0)
        capsys.readouterr()
        env.step("\ud800 caf\u00e9 <answer>1</answer>")  # a lone surrogate: not encodable in UTF-8
        out = capsys.readouterr().out
        assert "[assistant] \\ud800 caf\u00e9 <answer>1</answer>" in out
    finally:
        env.close()


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_a_reply_cut_at_max_action_chars_says_so(env_id):
    env = gym.make(env_id, max_action_chars=50)
    try:
        env.reset(seed=0)
        context, reward, terminated, truncated, info = env.step("y" * 60 + "<answer>1</answer>")
        notice = "the reply was longer than 50 characters; only the first 50 were read"
        assert context[-2].content == "y" * 50  # what the env read is what the context shows
        assert notice in info["format_error"] and notice in context[-1].content
        assert not terminated  # the answer past the cut was never read
    finally:
        env.close()


@pytest.mark.parametrize("env_id", ["rftgym/VerifiableQA-v0", "rftgym/SearchEvalQA-v0", "rftgym/MemoryQA-v0"])
def test_an_answer_inside_think_is_reasoning_and_an_unclosed_think_encloses_nothing(env_id):
    def fresh():
        env = gym.make(env_id)
        env.reset(seed=0, options={"objectives": 1} if env_id.endswith("MemoryQA-v0") else None)
        return env, (env.unwrapped.task.answer if env_id.endswith("VerifiableQA-v0") else "x")

    env, answer = fresh()
    try:
        context, reward, terminated, _, info = env.step(f"<think>It could be <answer>{answer}</answer>.</think>")
        assert not terminated and reward == 0.0
        assert "inside <think>" in info["format_error"] and "inside <think>" in context[-1].content
        # After </think>, the same answer is graded.
        assert env.step(f"<think>So:</think> <answer>{answer}</answer>")[2]
    finally:
        env.close()
    env, answer = fresh()
    try:  # a <think> never closed is reported, and the answer after it is graded
        _, _, terminated, _, info = env.step(f"<think>Unclosed, so: <answer>{answer}</answer>")
        assert terminated and "<think> is never closed" in info["format_error"]
        assert "inside <think>" not in info["format_error"]
    finally:
        env.close()


def test_markup_is_stripped_from_a_tags_text_however_deep_it_nests():
    from rftgym.envs.common import without_elements, without_tool_markup

    tags = ("search", "answer")
    deep = "<search>" * 3000 + "q" + "</search>" * 3000
    assert without_elements("a" + deep + "b", tags) == "a b"
    assert without_tool_markup("x <ANSWER id=1>y <search>z</search></answer > w", tags) == "x w"
    # An element around a stray tag stays; one never closed runs to the end with `unclosed`.
    assert without_elements("<search>a</answer>b</search>c", tags) == "<search>a</answer>b</search>c"
    assert without_elements("a <search>b <answer>c</answer> d", tags, unclosed=True) == "a  "
    assert without_elements("<search q", tags, unclosed=True) == "<search q"


@pytest.mark.parametrize("env_id, tag", [("rftgym/MemoryQA-v0", "search"), ("rftgym/SearchEvalQA-v0", "answer")])
def test_a_reply_of_more_tags_than_a_turn_handles_says_the_rest_were_ignored(env_id, tag):
    env = gym.make(env_id)
    try:
        env.reset(seed=0)
        deep = f"<{tag}>" * 500 + "q" + f"</{tag}>" * 500  # (each tag's text read in turn was cubic time)
        _, _, _, _, info = env.step(deep)
        assert "the turn has more than 64 tags; those after the 64th were ignored" in info["format_error"]
    finally:
        env.close()


@pytest.mark.parametrize("env_id, call", [("rftgym/SearchEvalQA-v0", "<answer>Paris</answer>"),
                                          ("rftgym/MemoryQA-v0", "<search>Paris</search>")])
def test_a_call_inside_a_code_block_is_said_to_be_text(env_id, call):
    """Tags in a fenced code block are code, not calls (rftgym.core.tags): a turn whose only call
    is there is told why nothing was done, not only that nothing was."""
    env = gym.make(env_id)
    try:
        env.reset(seed=0)
        *_, info = env.step(f"```xml\n{call}\n```")
        tag = call[1:call.index(">")]
        assert "so nothing was done" in info["format_error"]
        assert f"the <{tag}> inside a ``` code block is text, not a call" in info["format_error"]
        *_, info = env.step("plain text")  # nothing fenced: the reason alone
        assert info["format_error"].endswith("so nothing was done")
    finally:
        env.close()


@pytest.mark.parametrize("env_id", ["rftgym/VerifiableQA-v0", "rftgym/SearchEvalQA-v0", "rftgym/MemoryQA-v0"])
def test_a_draft_answer_in_think_followed_by_the_answer_is_no_format_error(env_id):
    """Drafting in the reasoning is what reasoning models do: the answer after </think> is graded,
    and the draft is no complaint (nor, in VerifiableQA, a lost format reward)."""
    env = gym.make(env_id)
    try:
        env.reset(seed=0, options={"objectives": 1} if env_id.endswith("MemoryQA-v0") else None)
        answer = env.unwrapped.task.answer if env_id.endswith("VerifiableQA-v0") else "x"
        answer_tag = f'<answer{" id=1" if env_id.endswith("MemoryQA-v0") else ""}>{answer}</answer>'
        _, reward, terminated, _, info = env.step(f"<think>maybe {answer_tag.replace(answer, 'y')}? no.</think>"
                                                  + answer_tag)
        assert terminated and info["format_error"] is None
        if env_id.endswith("VerifiableQA-v0"):
            assert reward == 1.0
    finally:
        env.close()
