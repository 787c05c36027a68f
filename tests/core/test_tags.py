"""The tag parser: tolerant syntax, problems reported as data, code blocks, and fuzzing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rftgym.core.tags import CodeBlock, ParseResult, Tag, find_code_blocks, parse_tags

KNOWN = ["answer", "think", "search", "evaluate", "prune"]


# ---------------------------------------------------------------- well-formed input

def test_a_single_answer():
    text = "I think so. <answer>42</answer>"
    r = parse_tags(text, ["answer"])
    assert r.ok and r.problems == ()
    tag = r.first("answer")
    assert tag.body == "42" and tag.closed and tag.parent is None
    assert text[tag.start:tag.end] == "<answer>42</answer>"
    assert r.names() == ["answer"]


@pytest.mark.parametrize("text", [
    "<ANSWER>7</ANSWER>", "< answer >7</ answer >", "<Answer>7< /answer>", "<answer\n>7</answer\t>",
    "<answer>7< / ANSWER >",
])
def test_tag_names_are_case_insensitive_and_may_carry_whitespace(text):
    r = parse_tags(text, ["Answer"])
    assert r.ok
    assert r.first("answer").body == "7"
    assert r.first("ANSWER") is r.first("answer")


def test_body_keeps_whitespace_and_text_strips_it():
    r = parse_tags("<answer>\n  x = 12 \n</answer>", ["answer"])
    tag = r.first("answer")
    assert tag.body == "\n  x = 12 \n"
    assert tag.text == "x = 12"


def test_several_tags_in_order_of_opening():
    r = parse_tags("<think>hmm</think> then <search>q1</search><answer>a</answer><search>q2</search>", KNOWN)
    assert r.ok
    assert r.names() == ["think", "search", "answer", "search"]
    assert [t.body for t in r.find("search")] == ["q1", "q2"]
    assert r.find("prune") == [] and r.first("prune") is None


@pytest.mark.parametrize("text, ids", [
    ('<prune ids="a,b">note</prune>', "a,b"),
    ("<prune ids='a,b'>note</prune>", "a,b"),
    ("<prune ids=a,b>note</prune>", "a,b"),
    ('<prune IDS = "x y" >note</prune>', "x y"),
    ("<prune ids=\u201ca, b\u201d>note</prune>", "a, b"),  # typographic quotes, as text is often "smartened"
    ("<prune ids=\u2018a\u2019>note</prune>", "a"),
])
def test_attributes_in_every_quoting_style(text, ids):
    tag = parse_tags(text, KNOWN).first("prune")
    assert tag.attr("ids") == ids and tag.attr("IDS") == ids
    assert tag.body == "note"
    assert tag.attr("missing") is None and tag.attr("missing", "d") == "d"


def test_nested_tags_know_their_parent():
    r = parse_tags("<think>a <search>q</search> b</think>", KNOWN)
    assert r.ok
    think, search = r.tags
    assert (think.name, think.parent, think.body) == ("think", None, "a <search>q</search> b")
    assert (search.name, search.parent, search.body) == ("search", "think", "q")


def test_unknown_tags_are_listed_once_and_not_parsed():
    r = parse_tags("<b>x</b> <foo>y</foo> <B>z</B> <answer>1</answer>", ["answer"])
    assert r.ok
    assert r.unknown_tags == ("b", "foo")
    assert [t.name for t in r.tags] == ["answer"]


def test_known_may_be_a_single_name():
    r = parse_tags("<answer>1</answer><think>x</think>", "answer")
    assert [t.name for t in r.tags] == ["answer"] and r.unknown_tags == ("think",)


@pytest.mark.parametrize("text", ["a < b and c > d", "x<5", "<<>>", "<>", "1 < 2", "<3 hearts", "</>"])
def test_comparison_signs_are_not_tags(text):
    r = parse_tags(text, KNOWN)
    assert r.tags == () and r.ok


# ---------------------------------------------------------------- malformed input is data

def test_unclosed_tag_runs_to_the_end_and_is_reported():
    text = "<answer>42"
    r = parse_tags(text, ["answer"])
    assert not r.ok
    assert r.problems == ("<answer> is never closed; end it with </answer>",)
    tag = r.first("answer")
    assert (tag.body, tag.closed, tag.start, tag.end) == ("42", False, 0, len(text))
    assert r.names() == []


def test_stray_closing_tag_is_reported():
    r = parse_tags("42</answer>", ["answer"])
    assert r.tags == ()
    assert r.problems == ("</answer> closes a tag that was never opened",)


def test_self_closing_tag_is_reported_as_empty():
    for text in ("<answer/>", "<answer />", "<answer / >"):
        r = parse_tags(text, ["answer"])
        assert r.problems == ("<answer/> is empty; write <answer>…</answer>",), text
        assert r.first("answer").body == "" and r.first("answer").closed


def test_a_tag_that_may_be_empty_is_not_reported_when_self_closing():
    r = parse_tags('<prune ids="r1"/><answer/>', ["prune", "answer"], may_be_empty=["PRUNE"])
    assert r.problems == ("<answer/> is empty; write <answer>…</answer>",)
    assert r.first("prune").attrs == (("ids", "r1"),) and r.first("prune").closed


def test_self_closing_tag_keeps_its_attributes():
    r = parse_tags('<prune ids="a,b"/>', ["prune"])
    assert r.first("prune").attr("ids") == "a,b" and len(r.problems) == 1
    r = parse_tags("<prune ids=a/>", ["prune"])
    assert r.first("prune").attr("ids") == "a"


@pytest.mark.parametrize("text, attrs", [
    ("<prune ids=r1, r6>n</prune>", (("ids", "r1, r6"),)),  # a bare comma list, spaces after its commas
    ("<prune ids=r1 ,r6/>", (("ids", "r1 ,r6"),)),
    ("<prune ids=r1, id=2>n</prune>", (("ids", "r1,"), ("id", "2"))),  # up to a word naming an attribute
    ("<prune ids=r1 r6>n</prune>", (("ids", "r1"),)),  # no comma: the value ends at the space
])
def test_a_bare_value_is_read_with_its_comma_list(text, attrs):
    assert parse_tags(text, ["prune"]).first("prune").attrs == attrs


def test_a_slash_inside_attributes_is_not_self_closing():
    r = parse_tags('<prune ids="a/b">note</prune>', ["prune"])
    assert r.ok and r.first("prune").attr("ids") == "a/b" and r.first("prune").body == "note"


def test_interleaved_tags_close_the_inner_one_and_report_it():
    text = "<think><answer>1</think></answer>"
    r = parse_tags(text, ["answer", "think"])
    assert "<answer> is never closed (before </think>)" in r.problems
    assert "</answer> closes a tag that was never opened" in r.problems
    answer = r.first("answer")
    assert (answer.closed, answer.body, answer.parent) == (False, "1", "think")
    assert r.first("think").closed and r.first("think").body == "<answer>1"


def test_unclosed_inner_tag_parent_is_the_tag_around_it():
    r = parse_tags("<think><search><answer>1</think>", ["answer", "think", "search"])
    by_name = {t.name: t for t in r.tags}
    assert by_name["answer"].parent == "search"
    assert by_name["search"].parent == "think"
    assert by_name["think"].closed and not by_name["answer"].closed and not by_name["search"].closed


def test_nested_same_name_pairs_innermost_first():
    r = parse_tags("<answer><answer>1</answer></answer>", ["answer"])
    assert r.ok
    outer, inner = r.tags
    assert outer.body == "<answer>1</answer>" and inner.body == "1"
    assert inner.parent == "answer" and outer.parent is None


def test_non_string_text_is_a_problem_not_an_exception():
    r = parse_tags(None, ["answer"])  # type: ignore[arg-type]
    assert r.problems == ("expected text, got NoneType",)
    assert parse_tags(b"<answer>1</answer>", ["answer"]).tags == ()  # type: ignore[arg-type]


def test_parse_result_defaults():
    r = ParseResult()
    assert r.ok and r.names() == [] and r.first("answer") is None


# ---------------------------------------------------------------- code blocks

def test_tags_inside_code_blocks_are_ignored():
    text = "```python\nprint('<answer>3</answer>')\n```\n<answer>4</answer>"
    r = parse_tags(text, ["answer"])
    assert r.ok
    assert [t.body for t in r.tags] == ["4"]
    (block,) = r.code_blocks
    assert block == CodeBlock("python", "print('<answer>3</answer>')\n", 0, text.index("```\n<answer>") + 3)


def test_unclosed_fence_runs_to_the_end_and_hides_tags():
    text = "```\nunclosed fence <answer>3</answer>"
    r = parse_tags(text, ["answer"])
    assert r.tags == ()
    assert r.problems == ("a code block opened with ``` is never closed; end it with ``` on its own line",)
    (block,) = r.code_blocks
    assert (block.closed, block.code, block.end) == (False, "unclosed fence <answer>3</answer>", len(text))


def test_code_block_languages_and_fence_kinds():
    text = "```Python\na\n```\n~~~js\nb\n~~~\n````\n```\nc\n````\n"
    blocks, problems = find_code_blocks(text)
    assert problems == []
    assert [(b.language, b.code) for b in blocks] == [("python", "a\n"), ("js", "b\n"), ("", "```\nc\n")]


def test_a_fence_with_an_info_string_does_not_close_a_block():
    blocks, problems = find_code_blocks("```\na\n```python\nb\n```\n")
    assert problems == []
    assert [b.code for b in blocks] == ["a\n```python\nb\n"]


def test_a_shorter_or_other_fence_does_not_close_a_block():
    blocks, _ = find_code_blocks("````\na\n```\n~~~~\nb\n````")
    assert [b.code for b in blocks] == ["a\n```\n~~~~\nb\n"]
    assert blocks[0].closed


def test_a_think_the_template_opened_is_closed_in_the_reply():
    # A reasoning model's generation prompt ends in <think>: its reply closes a tag it never opened.
    r = parse_tags("plan: 6*7 <answer>41?</answer>\n</think>\n<answer>42</answer>", ["think", "answer"])
    assert r.ok, r.problems
    think, early, final = r.find("think")[0], *r.find("answer")
    assert (think.start, think.body) == (0, "plan: 6*7 <answer>41?</answer>\n")
    assert r.inside_closed(early, "think") and not r.inside_closed(final, "think")
    assert not r.inside_closed(think, "think")  # not inside itself
    assert early.parent == "think" and final.parent is None
    # only its first closing, before any opening, with more after it, and only for the names given
    assert parse_tags("a</think>b</think>", ["think"]).problems == ("</think> closes a tag that was never opened",)
    stray = parse_tags("<answer>9</answer></think>\n", ["think", "answer"])  # a model that never thinks
    assert stray.problems == ("</think> closes a tag that was never opened",) and not stray.find("think")
    assert not stray.inside_closed(stray.first("answer"), "think")
    assert not parse_tags("<think>a</think>b</think>", ["think"]).ok
    assert not parse_tags("a</answer>", ["answer"]).ok
    assert not parse_tags("a</think>", ["think"], opened_before=()).ok
    at_start = parse_tags("<answer>1</answer></think>.", ["think", "answer"])
    assert at_start.inside_closed(at_start.first("answer"), "think")  # a tag at the very start is inside too
    # a tag opened inside that thinking and closed after it is never closed, as with an explicit <think>
    for reply in ("<answer>1963</think></answer> ok", "<think><answer>1963</think></answer>"):
        r = parse_tags(reply, ["think", "answer"])
        answer = r.first("answer")
        assert not answer.closed and "<answer> is never closed (before </think>)" in r.problems, reply
        assert "</answer> closes a tag that was never opened" in r.problems


def test_an_indented_fence_takes_its_indentation_off_the_code():
    # a fence in a Markdown list item: graded with its indentation, the code did not even parse
    text = "1. The solution:\n\n   ```python\n   def f(x):\n       return x\n   ```\n"
    (block,), problems = find_code_blocks(text)
    assert problems == [] and block.code == "def f(x):\n    return x\n"
    (block,), _ = find_code_blocks("  ```\n a\n    b\n")  # at most as much as the fence's, unclosed too
    assert block.code == "a\n  b\n" and not block.closed


def test_an_inline_triple_backtick_is_not_a_fence():
    r = parse_tags("use ```code``` here <answer>1</answer>", ["answer"])
    assert r.code_blocks == () and r.first("answer").body == "1"


def test_empty_fence_at_end_of_text():
    blocks, problems = find_code_blocks("```")
    assert blocks == [CodeBlock("", "", 0, 3, closed=False)] and len(problems) == 1


# ---------------------------------------------------------------- pathological input stays fast

@pytest.mark.timeout(20)
@pytest.mark.parametrize("text", [
    "<a" + " " * 30_000,                   # was cubic backtracking: minutes for 1,000 spaces
    "<answer" + " \t\n" * 10_000,
    "< / a" + " " * 30_000 + "/ /",
    "<" * 30_000,
    "```\n```\n<answer>" * 2_500,          # many code blocks and many tags
    "".join(f"<t{i}>" for i in range(5_000)),  # many distinct unknown tags
    "<think>" * 4_000 + "</answer>" * 3_000,
    "<answer " + "a" * 30_000 + ">1</answer>",  # attribute parsing was quadratic: 14 s at 32,000 chars
    "<answer " + 'a="' * 10_000 + ">",
])
def test_pathological_inputs_parse(text):
    r = parse_tags(text, ["answer", "think"])
    assert all(0 <= t.start <= t.end <= len(text) for t in r.tags)


# ---------------------------------------------------------------- fuzzing

FRAGMENTS = [
    "<answer>", "</answer>", "</ANSWER >", "< Answer>", "<answer/>", "<think>", "</think>", "<search>",
    "</search>", '<prune ids="a">', "<prune ids='a,b'>", "</prune>", "```python\n", "```", "~~~", "\n",
    " ", "<", ">", "/", '"', "'", "=", "x", "42", "<<", ">>", "<evaluate>", "</evaluate >", "\ud800",
    "\u4e2d", "<b>", "</b>",
]
fragment_text = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=5)), max_size=40).map("".join)
any_text = st.one_of(st.text(max_size=300), fragment_text)


@settings(max_examples=300, deadline=None)
@given(any_text, st.lists(st.sampled_from(KNOWN + ["b", "x"]), max_size=4))
def test_parse_never_raises_and_spans_lie_inside_the_text(text, known):
    r = parse_tags(text, known)
    assert isinstance(r, ParseResult)
    known_lower = {k.lower() for k in known}
    for tag in r.tags:
        assert isinstance(tag, Tag)
        assert 0 <= tag.start <= tag.end <= len(text)
        assert tag.name in known_lower
        assert tag.body in text[tag.start:tag.end]
        assert text[tag.start] == "<" or (tag.start == tag.body_start == 0)  # or opened before the text
        if tag.closed:
            assert text[tag.end - 1] == ">"
    for block in r.code_blocks:
        assert 0 <= block.start <= block.end <= len(text)
        assert block.code in text[block.start:block.end]
    assert [t.start for t in r.tags] == sorted(t.start for t in r.tags)
    assert r.ok == (r.problems == ())
    assert all(isinstance(p, str) and p for p in r.problems)
    assert not set(r.unknown_tags) & known_lower


body_text = st.text(max_size=200).filter(lambda s: "<" not in s and "`" not in s and "~" not in s)


@settings(max_examples=200, deadline=None)
@given(body_text)
def test_round_trip_of_any_body(body):
    r = parse_tags(f"<answer>{body}</answer>", ["answer"])
    assert r.ok
    assert r.first("answer").body == body
    assert r.first("answer").text == body.strip()


@settings(max_examples=200, deadline=None)
@given(body_text, body_text, st.sampled_from(["answer", "ANSWER", " Answer ", "answer\n"]))
def test_round_trip_with_surrounding_prose_and_variant_spelling(before, body, spelled):
    text = f"{before}<{spelled}>{body}</{spelled}>{before}"
    r = parse_tags(text, ["answer", "think"])
    assert r.ok
    assert [t.body for t in r.tags] == [body]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["answer", "think", "search"]), body_text), max_size=6))
def test_sequences_of_well_formed_tags_round_trip(pairs):
    text = "".join(f"<{name}>{body}</{name}>" for name, body in pairs)
    r = parse_tags(text, KNOWN)
    assert r.ok
    assert [(t.name, t.body) for t in r.tags] == pairs


@settings(max_examples=100, deadline=None)
@given(body_text.filter(lambda s: '"' not in s and ">" not in s))
def test_attribute_values_round_trip(value):
    tag = parse_tags(f'<prune ids="{value}">n</prune>', ["prune"]).first("prune")
    assert tag.attr("ids") == value and tag.body == "n"


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=100).filter(lambda s: "```" not in s and "~~~" not in s))
def test_tags_in_a_fenced_block_are_always_code(code):
    r = parse_tags(f"```python\n{code}\n```\n", KNOWN)
    assert r.tags == () and r.ok
    assert [b.code for b in r.code_blocks] == [code + "\n"]


def test_inside_closed_counts_only_a_closed_enclosing_tag():
    parsed = parse_tags("<think>a <answer>1</answer> <x><search>q</search></x></think> <answer>2</answer>",
                        ("think", "answer", "search", "x"))
    inner, outer = parsed.find("answer")
    assert parsed.inside_closed(inner, "think") and not parsed.inside_closed(outer, "think")
    assert parsed.inside_closed(parsed.first("search"), "think")  # nested deeper than one level
    assert not parsed.inside_closed(parsed.first("think"), "think")
    unclosed = parse_tags("<think>a <answer>1</answer>", ("think", "answer"))
    assert not unclosed.inside_closed(unclosed.first("answer"), "think")


def test_inside_closed_with_nested_and_many_spans():
    text = "<think>a <think>b</think> <answer>1</answer></think>" + "<answer>2</answer><think>c</think>" * 500
    parsed = parse_tags(text, ("think", "answer"))
    answers = parsed.find("answer")
    # The first answer sits in the outer think after the inner one closed; the others are outside.
    assert [parsed.inside_closed(a, "think") for a in answers] == [True] + [False] * 500
    inner = parsed.find("think")[1]
    assert parsed.inside_closed(inner, "think") and not parsed.inside_closed(parsed.find("think")[0], "think")


def test_unclosed_tags_share_the_text_rather_than_copy_it():
    import tracemalloc

    text = "<think>" * 20_000  # 140k characters: 20,000 unclosed tags, each running to the end
    tracemalloc.start()
    parsed = parse_tags(text, ("think",))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(parsed.tags) == 20_000 and parsed.tags[-1].body == ""
    assert parsed.tags[0].body == text[len("<think>"):]
    # Copies of each body would take about 1.4 GB; what is parsed takes a few megabytes per 1,000 tags.
    assert peak < 100 * 2**20, f"{peak / 2**20:.0f} MiB"
