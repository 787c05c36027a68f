"""rftgym/SearchEvalQA-v0: the Search->Evaluate protocol, rewards, gating, segments, budgets,
datasets and fuzzing with arbitrary assistant text."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import given, settings
from hypothesis import strategies as st

import rftgym  # noqa: F401  (registers the envs)
from rftgym.agents.scripted import ADVERSARIAL_TEXTS, ScriptedAgent
from rftgym.core.errors import ConfigError
from rftgym.core.messages import Context
from rftgym.envs.search import env as env_module
from rftgym.envs.search.env import SearchEvalQAConfig, SearchEvalQAEnv
from rftgym.envs.search.protocol import confidence, parse_evaluation
from rftgym.envs.search.retrievers import CallableRetriever, Hit
from rftgym.envs.search.scoring import exact_match, is_refusal, normalize_answer, token_f1

ENV_ID = "rftgym/SearchEvalQA-v0"
QA_DIR = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "qa"
needs_qa_data = pytest.mark.skipif(not (QA_DIR / "hotpotqa_100.json").is_file(),
                                   reason=f"the shared QA data is not at {QA_DIR}")
INFO_KEYS = {"question_id", "hops", "answerable", "turn", "searches", "query", "doc_ids", "evaluation_score",
             "confidence", "evaluation_note", "evaluation_end", "protocol_violation", "protocol_violations", "segments",
             "answer", "em", "f1", "refused", "gated", "format_error", "success", "search_limit_reached"}


def run_episode(env, actions):
    """Step through ``actions``; return the list of (obs, reward, terminated, truncated, info)."""
    steps = []
    for action in actions:
        steps.append(env.step(action))
        if steps[-1][2] or steps[-1][3]:
            break
    return steps


def oracle_actions(question, answer=None):
    """A compliant trajectory: search each gold document by title, evaluate, then answer."""
    titles = question.gold_titles
    actions = [f"<search>{titles[0]}</search>"]
    for title in titles[1:]:
        actions.append(f"<evaluate>score: 5 one hop found</evaluate>\n<search>{title}</search>")
    actions.append(f"<evaluate>score: 9 enough</evaluate><answer>{answer or question.answers[0]}</answer>")
    return actions


def test_check_env_passes(capsys):
    for kwargs in ({}, {"unanswerable_rate": 0.5, "violation_gate": 0.5, "reward_metric": "em"}):
        env = gym.make(ENV_ID, **kwargs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            check_env(env.unwrapped)
        assert [str(w.message) for w in caught] == []


@pytest.mark.parametrize("hops", [1, 2, 3, 4])
def test_a_compliant_trajectory_gets_the_answers_f1(hops):
    env = SearchEvalQAEnv()
    context, info = env.reset(seed=hops, options={"hops": hops})
    assert set(info) == INFO_KEYS and info["hops"] == hops
    question = env.question
    gold = question.answers[0]
    # A partly right answer earns the F1, not all or nothing.
    partial = f"{gold} extra words"
    steps = run_episode(env, oracle_actions(question, partial))
    obs, reward, terminated, truncated, info = steps[-1]
    assert terminated and not truncated and len(steps) == hops + 1
    assert reward == pytest.approx(token_f1(partial, gold)) and 0 < reward < 1
    assert info["protocol_violations"] == 0 and not info["gated"] and info["expected"] == list(question.answers)
    # every gold document was returned by its search
    ids_by_title = {d.title: d.id for d in env.world.documents}
    assert all(ids_by_title[t] in s["doc_ids"] for s, t in zip(info["segments"], question.gold_titles))
    assert [s["score"] for s in info["segments"]] == [5] * (hops - 1) + [9]
    env.reset(seed=hops, options={"hops": hops})
    assert run_episode(env, oracle_actions(env.question))[-1][1] == 1.0


def test_scripted_agent_through_the_context_only():
    env = SearchEvalQAEnv(hops=(2,))
    context, _ = env.reset(seed=11)
    agent = ScriptedAgent(oracle_actions(env.question))
    done, reward = False, 0.0
    while not done:
        context, reward, terminated, truncated, info = env.step(agent.act_one(context).text)
        done = terminated or truncated
    assert reward == 1.0 and info["success"]


def test_search_results_carry_ids_titles_and_capped_text():
    env = SearchEvalQAEnv(top_k=2, max_doc_chars=40)
    env.reset(seed=0, options={"hops": 1})
    title = env.question.gold_titles[0]
    obs, reward, terminated, truncated, info = env.step(f"<think>look it up</think><search>{title}</search>")
    assert reward == 0.0 and not terminated and not truncated
    message = obs[-1].content
    assert obs[-1].role == "user" and message.startswith("<information>\n[1] id=")
    doc = next(d for d in env.world.documents if d.title == title)
    assert f"[1] id={doc.id} | {title}\n{doc.text[:39].rstrip()}…" in message
    assert len(info["doc_ids"]) <= 2 and info["doc_ids"][0] == doc.id and info["query"] == title
    assert "Begin your next reply with <evaluate>score: N" in message
    assert info["segments"] == [{"search_turn": 1, "query": title, "doc_ids": info["doc_ids"],
                                 "evaluate_turn": None, "score": None}]


def test_evaluation_score_lands_on_the_evaluate_turn_with_a_hint():
    env = SearchEvalQAEnv()
    env.reset(seed=3, options={"hops": 2})
    _, _, _, _, info = env.step("<search>anything</search>")
    assert info["evaluation_score"] is None
    obs, _, _, _, info = env.step("<evaluate>Score: 2/10 - off topic</evaluate> let me think")
    assert info["evaluation_score"] == 2 and info["confidence"] == "low" and info["evaluation_note"] == "off topic"
    assert info["segments"][0]["evaluate_turn"] == 2 and info["segments"][0]["score"] == 2
    assert obs[-1].content.startswith("Evaluation recorded: 2/10, low confidence")
    _, _, _, _, info = env.step("<answer>x</answer>")
    assert info["evaluation_score"] is None  # only the turn that closes a span carries it
    # PCAR's reading: the spans end exactly at turns whose info has a score
    assert info["protocol_violations"] == 0


@pytest.mark.parametrize("body, expected", [
    ("score: 7 names the birthplace", (7, "names the birthplace")), ("Score=3/10, off topic", (3, "off topic")),
    ("10 - exactly it", (10, "exactly it")), ("  score 0", (0, "")), ("seven", None), ("7.5 close", None),
    ("11 wow", None), ("-1", None), ("note first, score: 7", None), ("", None), ("1e400", None), ("10abc", None),
    ("score: 7/10.", (7, "")), ("8, relevant", (8, "relevant")), ("7 / 10 good", (7, "good")),
    ("score: 4/5", None), ("8/100", None), ("1 /2 useless", None),  # fractions of another whole
    ("3 of 5", None), ("3 of 10 good", (3, "good")), ("7 of the hits help", (7, "of the hits help")),
    ("\uff17 good", None), ("\u0667", None),  # a fullwidth or Arabic-Indic 7 is not an ASCII score
    ("5-6", None), ("score: 5 - 6 relevant", None), ("5\u20136", None), ("5 to 6", None),  # ranges
    ("50%", None), ("5 % sure", None), ("7 - 2 of 3 hits relevant", None),  # a percentage; a range-like note
    ("7 total hits", (7, "total hits")), ("6 -- partial", (6, "partial")), ("5\u22126", None), ("5~6", None),
    ("5 or 6", None), ("5 -- 6", None), ("8\u2012 9", None), ("8 \uff0d 9", None), ("5 or more agree", (5, "or more agree")), ("7/10 - 3 hits", (7, "3 hits")),
    ("5/10 to 6/10", None), ("5/10-6/10 useful", None), ("5 / 10 or 6", None), ("score: 5/10 \u2013 6/10", None),
    ("7/10 - 3/4 of the hits", (7, "3/4 of the hits")), ("7/10 to the point", (7, "to the point")),
    ("Score: 7,5/10 decent", None), ("7,5", None), ("score: 3 (out of 5)", None), ("3 out of 5", None),  # other wholes
    ("8, 5 hits relevant", (8, "5 hits relevant")), ("7 out of 10", (7, "")), ("7 (out of 10) ok", (7, "(out of 10) ok")),
    ("score: 7 out of 10, close", (7, "close")), ("7 out of 100", None), ("score: 7 out of 10x", None),
    # markdown emphasis around the label or the score is read past; not around a bad score
    ("**Score:** 7 names it", (7, "names it")), ("Score: **7** ok", (7, "ok")), ("**7/10** good", (7, "good")),
    ("__Score__: 3", (3, "")), ("**score: 7.5**", None), ("**11**", None), ("**5**-6", None),
    ("note **first**, score: 7", None), ("7 is **key**", (7, "is **key**")),
    # markup between digits is no score: taken out, "1_0" would read 10
    ("score: 1_0", None), ("score: 1*0", None), ("0_7", None), ("**1**0", None), ("score: 7_ good", (7, "good")),
])
def test_evaluation_format(body, expected):
    assert parse_evaluation(body) == expected


def test_confidence_levels():
    assert [confidence(s) for s in range(11)] == ["low"] * 4 + ["medium"] * 3 + ["high"] * 4


@pytest.mark.parametrize("second_turn, kind", [
    ("I think I know now.", "skipped_evaluation"),
    ("Some words first <evaluate>score: 5 ok</evaluate>", "skipped_evaluation"),
    ("<evaluate>useful</evaluate>", "malformed_evaluation"),
    ("<search>again</search>", "double_search"),
    ("<answer>{gold}</answer>", "answer_before_evaluation"),
])
@pytest.mark.parametrize("gate, factor", [("zero", 0.0), (0.5, 0.5)])
def test_each_violation_is_flagged_and_gates_the_reward(second_turn, kind, gate, factor):
    env = SearchEvalQAEnv(violation_gate=gate)
    env.reset(seed=5, options={"hops": 1})
    gold = env.question.answers[0]
    env.step(f"<search>{env.question.gold_titles[0]}</search>")
    obs, reward, terminated, _, info = env.step(second_turn.format(gold=gold))
    assert info["protocol_violation"] == kind and info["protocol_violations"] == 1
    if kind == "malformed_evaluation":  # the evaluation's format is wrong: a format error too
        assert "did not start with an integer score from 0 to 10" in info["format_error"]
    if not terminated:
        assert obs[-1].content.startswith("Protocol violation: ")
        assert "your very next reply must begin with <evaluate>score: N" in obs[-1].content
        # After a double search the new results are owed an evaluation; otherwise the stray
        # <evaluate> is ignored: the owed evaluation is not owed forever.
        obs, reward, terminated, _, info = env.step(f"<evaluate>score: 9 ok</evaluate><answer>{gold}</answer>")
        assert info["protocol_violation"] is None and info["protocol_violations"] == 1
    assert terminated and info["gated"] and info["f1"] == 1.0
    assert reward == pytest.approx(factor)
    # The answer matched, but not within the protocol: no success (RFT keeps successes).
    assert info["em"] == 1.0 and info["success"] is False


@pytest.mark.parametrize("second_turn", [
    "<think>The first result names it.</think><evaluate>score: 8 ok</evaluate><answer>{gold}</answer>",
    "<think>Weighing them <evaluate>score: 8 ok</evaluate></think><answer>{gold}</answer>",
    "  <think>a</think>\n<think>b</think> <evaluate>score: 8 ok</evaluate><answer>{gold}</answer>",
    "<THINK>a</THINK><evaluate>score: 8 ok</evaluate><answer>{gold}</answer>",
    '<think mode="deep">a<think>b</think>c</think><evaluate>score: 8 ok</evaluate><answer>{gold}</answer>',
    # thinking a template (or the turn before) opened, closed in this reply
    "Rating them.</think><evaluate>score: 8 ok</evaluate><answer>{gold}</answer>",
    "Now rate: <evaluate>score: 8 ok</evaluate></think><answer>{gold}</answer>",
])
def test_thinking_before_the_evaluation_keeps_the_protocol(second_turn):
    env = SearchEvalQAEnv()
    env.reset(seed=5, options={"hops": 1})
    gold = env.question.answers[0]
    env.step(f"<search>{env.question.gold_titles[0]}</search>")
    _, reward, terminated, _, info = env.step(second_turn.format(gold=gold))
    assert info["protocol_violation"] is None and info["evaluation_score"] == 8
    assert terminated and reward == 1.0 and info["success"] is True
    # Words outside a <think> before it still skip the evaluation.
    env.reset(seed=5, options={"hops": 1})
    env.step(f"<search>{env.question.gold_titles[0]}</search>")
    _, _, _, _, info = env.step("<think>a</think> So: <evaluate>score: 8 ok</evaluate>")
    assert info["protocol_violation"] == "skipped_evaluation"


def test_with_search_in_think_the_default_prompt_says_to_search_while_thinking():
    context, _ = SearchEvalQAEnv(search_in_think=True).reset(seed=0)
    assert "search from within your thinking" in context[0].content
    context, _ = SearchEvalQAEnv(search_in_think=True, system_prompt="mine").reset(seed=0)
    assert context[0].content == "mine"  # a prompt of the user's own is kept


def test_a_corpus_without_the_questions_evidence_is_warned_of(tmp_path):
    import json

    questions = [{"_id": "q1", "question": "Where was Alda born?", "answer": "Veloria",
                  "context": [["Alda Mertz", ["Alda Mertz was born in Veloria."]]],
                  "supporting_facts": [["Alda Mertz", 0]]}]
    (tmp_path / "qa.json").write_text(json.dumps(questions))
    (tmp_path / "other.json").write_text(json.dumps({"Bern": ["Bern is a city."]}))
    (tmp_path / "same.json").write_text(json.dumps({"Alda Mertz": ["Alda Mertz was born in Veloria."],
                                                    "Bern": ["Bern is a city."]}))
    with pytest.warns(UserWarning, match=r"holds none of the 1 documents the questions name as evidence") as caught:
        gym.make("rftgym/SearchEvalQA-v0", dataset_path=str(tmp_path / "qa.json"),
                 corpus_path=str(tmp_path / "other.json")).close()
    # It names this line, past rftgym's frames and gymnasium's make.
    assert {w.filename for w in caught if "holds none" in str(w.message)} == {__file__}
    (tmp_path / "cased.json").write_text(json.dumps({"alda  mertz": ["Alda Mertz was born in Veloria."]}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SearchEvalQAEnv(dataset_path=str(tmp_path / "qa.json"), corpus_path=str(tmp_path / "same.json"))
        # a title spelled in another case or spacing is still the document
        SearchEvalQAEnv(dataset_path=str(tmp_path / "qa.json"), corpus_path=str(tmp_path / "cased.json"))


def test_a_corpus_bm25_cannot_index_is_named(tmp_path):
    import json

    from rftgym.core.errors import ConfigError

    (tmp_path / "q.jsonl").write_text(json.dumps({"question": "Who?", "golden_answers": ["Ada"]}) + "\n")
    (tmp_path / "stop.jsonl").write_text(json.dumps({"id": "1", "contents": '"a"\nthe'}) + "\n")
    with pytest.raises(ConfigError, match=r"stop.jsonl: the corpus has no word BM25 can index"):
        SearchEvalQAEnv(dataset_path=str(tmp_path / "q.jsonl"), corpus_path=str(tmp_path / "stop.jsonl"))


def test_two_searches_in_one_turn_run_one_and_flag_it():
    env = SearchEvalQAEnv()
    env.reset(seed=1)
    _, _, _, _, info = env.step("<search>first</search><search>second</search>")
    assert info["protocol_violation"] == "double_search" and info["searches"] == 1 and info["query"] == "first"
    assert "only one search runs per turn" in info["format_error"]


def test_answer_in_the_same_turn_as_a_search_is_answer_before_evaluation():
    env = SearchEvalQAEnv()
    env.reset(seed=2, options={"hops": 1})
    gold = env.question.answers[0]
    _, reward, terminated, _, info = env.step(f"<search>q</search><answer>{gold}</answer>")
    assert terminated and info["protocol_violation"] == "answer_before_evaluation" and reward == 0.0


def test_answer_without_any_search_is_not_a_violation():
    env = SearchEvalQAEnv(reward_metric="em")
    env.reset(seed=2, options={"hops": 1})
    _, reward, terminated, _, info = env.step(f"<answer>The {env.question.answers[0]}.</answer>")
    assert terminated and reward == 1.0 and info["protocol_violation"] is None and info["em"] == 1.0


@pytest.mark.parametrize("reply, graded", [("<answer>wrong</answer> <answer>{gold}</answer>", "wrong"),
                                            ("<answer><answer>{gold}</answer></answer>", "{gold}")])
def test_more_than_one_answer_is_reported(reply, graded):
    env = SearchEvalQAEnv()
    env.reset(seed=2, options={"hops": 1})
    gold = env.question.answers[0]
    _, _, terminated, _, info = env.step(reply.format(gold=gold))
    assert terminated and info["answer"] == graded.format(gold=gold)
    assert "more than one <answer> (or one inside another); the first with text was graded" in info["format_error"]


@pytest.mark.parametrize("reply, problem", [
    ("hello", "the reply had no <search> and no <answer>, so nothing was done"),
    ("<think>maybe search later</think>", "the reply had no <search> and no <answer>, so nothing was done"),
    ("<answer>  </answer>", "an empty <answer> was not graded; put the answer inside <answer>…</answer>"),
])
def test_a_reply_that_does_nothing_is_reported_and_the_episode_goes_on(reply, problem):
    env = SearchEvalQAEnv()
    env.reset(seed=0)
    context, reward, terminated, truncated, info = env.step(reply)
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert info["format_error"] == problem and info["protocol_violation"] is None and info["answer"] is None
    assert f"Format problems: {problem}." in context[-1].content
    # The episode still ends on a real answer.
    _, _, terminated, _, info = env.step(f"<answer>{env.question.answers[0]}</answer>")
    assert terminated and info["answer"] == env.question.answers[0]


@pytest.mark.parametrize("reply, problem", [("<answer></answer>", "an empty <answer> was not graded"),
                                             ("<search>  </search>", "an empty <search> was not run")])
def test_an_empty_call_right_after_a_search_skipped_the_evaluation(reply, problem):
    env = SearchEvalQAEnv()
    env.reset(seed=0)
    env.step("<search>anything</search>")
    _, _, terminated, _, info = env.step(reply)
    assert not terminated and info["protocol_violation"] == "skipped_evaluation"
    assert problem in info["format_error"]


def test_search_budget_truncates():
    env = SearchEvalQAEnv(max_searches=2, max_turns=10)
    env.reset(seed=0)
    steps = run_episode(env, ["<search>a</search>", "<evaluate>score: 1 no</evaluate><search>b</search>",
                              "<evaluate>score: 1 no</evaluate><search>c</search>", "<answer>x</answer>"])
    assert len(steps) == 3
    _, reward, terminated, truncated, info = steps[-1]
    assert truncated and not terminated and reward == 0.0 and info["searches"] == 2 and "expected" in info
    assert info["search_limit_reached"] and not any(step[-1]["search_limit_reached"] for step in steps[:-1])
    # An answer after the search past the limit, in the same turn, is not played: the info says why.
    env.reset(seed=0)
    env.step("<search>a</search>")
    env.step("<evaluate>score: 1 no</evaluate><search>b</search>")
    _, _, terminated, truncated, info = env.step("<evaluate>score: 1 no</evaluate><search>c</search><answer>x</answer>")
    assert truncated and not terminated and info["answer"] is None and info["search_limit_reached"]


def test_search_limit_message_mode():
    env = SearchEvalQAEnv(max_searches=1, on_search_limit="message")
    env.reset(seed=0)
    env.step("<search>a</search>")
    obs, _, terminated, truncated, info = env.step("<evaluate>score: 1 no</evaluate><search>b</search>")
    assert not (terminated or truncated) and info["searches"] == 1 and info["search_limit_reached"]
    assert "Search limit reached (1 searches)" in obs[-1].content
    # no hint or prompt to search again once none is left
    assert "search again" not in obs[-1].content and "Continue: search" not in obs[-1].content
    assert "no searches are left: give your best answer" in obs[-1].content
    obs, *_ = env.step("hmm")
    assert obs[-1].content.endswith("No searches are left: give your final answer in <answer>…</answer>.")


def test_the_results_of_the_last_search_allowed_say_to_answer_next():
    env = SearchEvalQAEnv(max_searches=2)
    env.reset(seed=0)
    obs, *_ = env.step("<search>a</search>")
    assert "last search allowed" not in obs[-1].content
    obs, _, terminated, truncated, info = env.step("<evaluate>score: 1 no</evaluate><search>b</search>")
    assert not (terminated or truncated) and info["searches"] == 2
    assert obs[-1].content.endswith("That was the last search allowed: after the evaluation, give your final answer "
                                    "in <answer>…</answer>.")


def test_a_query_cut_to_its_limit_says_so():
    env = SearchEvalQAEnv()
    env.reset(seed=0)
    obs, *_, info = env.step(f"<search>{'capital ' * 100}</search>")
    assert len(info["query"]) == 500 and "only its first 500 were searched" in obs[-1].content


def test_turn_budget_truncates():
    env = SearchEvalQAEnv(max_turns=3)
    env.reset(seed=0)
    steps = run_episode(env, ["hmm"] * 5)
    assert len(steps) == 3 and steps[-1][3] and not steps[-1][2]
    assert steps[-1][0][-1].role == "assistant"  # no feedback after the end
    with pytest.raises(RuntimeError, match="episode has ended"):
        env.step("<answer>x</answer>")


def test_unanswerable_questions_reward_a_refusal():
    env = SearchEvalQAEnv(unanswerable_rate=1.0)
    _, info = env.reset(seed=4)
    assert not info["answerable"] and env.question.answers == ()
    _, reward, _, _, info = env.step("<answer>Unknown.</answer>")
    assert reward == 1.0 and info["success"] and info["refused"] is True
    # Answer metrics leave unanswerable questions out (MuSiQue's evaluation): a refusal is no exact match.
    assert info["em"] is None and info["f1"] is None
    env.reset(seed=4)
    _, reward, _, _, info = env.step("<answer>Paris</answer>")
    assert reward == 0.0 and info["refused"] is False and not info["success"] and info["em"] is None
    env = SearchEvalQAEnv()
    env.reset(seed=4, options={"answerable": True})
    _, reward, _, _, info = env.step("<answer>I don't know</answer>")
    assert reward == 0.0  # refusing an answerable question earns nothing
    assert info["em"] == 0.0 and info["refused"] is None
    assert sum(SearchEvalQAEnv(unanswerable_rate=0.5).reset(seed=s)[1]["answerable"] for s in range(40)) in range(10, 31)


def test_search_in_think_option():
    env = SearchEvalQAEnv(search_in_think=True)
    env.reset(seed=0)
    _, _, _, _, info = env.step("<search>outside</search>")
    assert info["searches"] == 0 and "inside <think>" in info["format_error"]
    _, _, _, _, info = env.step("<think>I need <search>inside</search></think>")
    assert info["searches"] == 1 and info["query"] == "inside"
    # A model searching while it thinks stops at </search>: its open <think> is no format error.
    env.reset(seed=0)
    _, _, _, _, info = env.step("<think>I need the birthplace <search>open think</search>")
    assert info["searches"] == 1 and info["query"] == "open think" and info["format_error"] is None
    # Without a search inside it, an open <think> is still reported.
    _, _, _, _, info = env.step("<evaluate>score: 3 weak</evaluate><think>hmm")
    assert "<think> is never closed" in info["format_error"]


def test_a_think_the_template_opens_holds_the_replys_searches_and_evaluations():
    # A reasoning model's template opens <think>; with search_in_think it searches there and stops
    # at </search>, so its reply holds no <think> tag at all.
    env = SearchEvalQAEnv(search_in_think=True, think_opened_by_template=True)
    env.reset(seed=5, options={"hops": 1})
    title = env.question.gold_titles[0]
    _, _, _, _, info = env.step(f"I need the page on it <search>{title}</search>")
    assert info["searches"] == 1 and info["query"] == title and info["format_error"] is None
    action = f"<evaluate>score: 8 found it</evaluate> so </think><answer>{env.question.answers[0]}</answer>"
    _, reward, terminated, _, info = env.step(action)
    assert terminated and reward == 1.0 and info["protocol_violation"] is None
    assert action[:info["evaluation_end"]].endswith("</evaluate>")  # an offset into the reply as written
    unset = SearchEvalQAEnv(search_in_think=True)
    unset.reset(seed=5, options={"hops": 1})
    assert unset.step(f"I need the page on it <search>{title}</search>")[4]["searches"] == 0
    with pytest.raises(ConfigError, match="think_opened_by_template must be true or false"):
        SearchEvalQAEnv(think_opened_by_template="yes")


def test_a_simulated_search_backend():
    written = CallableRetriever(lambda query, k: [Hit("sim-1", "Simulated", f"An LLM says: {query}", 1.0)])
    env = SearchEvalQAEnv(retriever=written)
    env.reset(seed=0)
    obs, *_ = env.step("<search>who</search>")
    assert "[1] id=sim-1 | Simulated\nAn LLM says: who" in obs[-1].content
    env.close()
    env.close()


def test_seeding_and_ids():
    a, b = SearchEvalQAEnv(), SearchEvalQAEnv()
    assert a.reset(seed=7) == b.reset(seed=7)
    assert a.step("<search>x</search>")[0] == b.step("<search>x</search>")[0]
    ids = {SearchEvalQAEnv().reset(seed=s)[0][0].id.split("-")[0] for s in range(10)}
    assert len(ids) == 10


@pytest.mark.parametrize("kwargs, message", [
    ({"hops": (0,)}, "hops must be a non-empty list"), ({"hops": ["x"]}, "hops must be a list of ints"),
    ({"top_k": 0}, "top_k must be an int of at least 1"), ({"max_turns": 0}, "max_turns must be an int"),
    ({"retriever": "tfidf"}, "retriever must be one of"), ({"retriever": "remote"}, "needs retriever_url"),
    ({"retriever_url": "http://127.0.0.1:9/retrieve"}, "only used with retriever=.remote."),
    ({"retriever": "remote", "retriever_url": "http://127.0.0.1:9/retrieve", "top_k": 1001},
     "top_k 1001 is more documents than a retrieval service returns for one query .1000 at most."),
    ({"violation_gate": 2}, "violation_gate must be 'zero' or a multiplier"),
    ({"violation_gate": "half"}, "violation_gate must be"), ({"reward_metric": "bleu"}, "reward_metric must be"),
    ({"on_search_limit": "stop"}, "on_search_limit must be"), ({"unanswerable_rate": 1.5}, "unanswerable_rate"),
    ({"corpus_path": "c.json"}, "corpus_path needs dataset_path"),
    ({"dataset_path": "q.json", "hops": 2}, "hops shapes generated tasks only, and dataset_path is given"),
    ({"dataset_path": "q.json", "corpus_path": " "}, "corpus_path is empty"),
    ({"hops": [2.7]}, "hops must be a list of ints"), ({"hops": True}, "hops must be a list of ints"),
])
def test_bad_config_raises_config_error(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SearchEvalQAConfig(**kwargs)


def test_scoring_follows_squad():
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert exact_match("the Seine", "Seine") == 1.0
    assert token_f1("river Seine in France", "the Seine river") == pytest.approx(2 * 0.5 * 1.0 / 1.5)
    assert token_f1("yes it is", "yes") == 0.0 and token_f1("no", "no") == 1.0
    assert is_refusal("It cannot be determined.") and not is_refusal("Paris")
    for refusal in ("unknown", "I don't know.", "The answer is unknown", "I cannot answer this question."):
        assert is_refusal(refusal), refusal
    # A guess hedged with a refusal phrase, or a word that only contains one, is no refusal.
    for guess in ("Tulen unknown", "unknownium", "engineer (cannot answer for sure)", "unknown: Veloria or Tulen"):
        assert not is_refusal(guess), guess


def test_generated_currencies_share_no_word():
    # A shared word ("... crown") would earn token-F1 credit on every currency question by itself.
    from rftgym.envs.search.world import World

    world = World(seed=3)
    currencies = [e.attributes["currency"] for e in world.entities.values() if e.kind == "country"]
    words = [w for c in currencies for w in normalize_answer(c).split()]
    assert len(currencies) >= 3 and len(words) == len(set(words))


@needs_qa_data
def test_hotpotqa_dataset(capsys):
    env = SearchEvalQAEnv(dataset_path=str(QA_DIR / "hotpotqa_100.json"), top_k=5)
    _, info = env.reset(seed=0, options={"task_index": 0})
    assert info["question_id"] == "5a77ec115542992a6e59dff7" and info["hops"] == 2
    obs, *_ = env.step(f"<search>{env.question.question}</search>")
    assert "Lilu (mythology)" in obs[-1].content
    _, reward, terminated, _, info = env.step("<evaluate>score: 8 Lilu is a spirit</evaluate><answer>a spirit</answer>")
    assert reward == 1.0 and terminated and info["segments"][0]["score"] == 8
    with pytest.raises(ValueError, match=r"task_index must be an int in \[0, 100\)"):
        env.reset(options={"task_index": 100})
    # seeds 0..99 cover the file once (rftgym eval's default episodes); "random" draws
    ids = [q.id for q in env.questions]
    assert [env.reset(seed=s)[1]["question_id"] for s in (0, 1, 99, 100)] == [ids[0], ids[1], ids[99], ids[0]]
    assert env.eval_episodes == 100 and SearchEvalQAEnv().eval_episodes is None
    drawn = SearchEvalQAEnv(dataset_path=str(QA_DIR / "hotpotqa_100.json"), task_selection="random")
    assert drawn.eval_episodes is None and [drawn.reset(seed=s)[1]["question_id"] for s in range(5)] != ids[:5]
    with pytest.raises(ValueError, match=r"\['answerable', 'hops'\] do not apply here: this env serves a dataset"):
        env.reset(options={"hops": 2, "answerable": False})


@needs_qa_data
def test_nq_questions_need_a_corpus():
    with pytest.raises(ConfigError, match="holds questions only; give corpus_path too: the documents to search, as FlashRAG JSONL"):
        SearchEvalQAEnv(dataset_path=str(QA_DIR / "nq_16.jsonl"))
    env = SearchEvalQAEnv(dataset_path=str(QA_DIR / "nq_16.jsonl"), corpus_path=str(QA_DIR / "wiki_1000.jsonl"))
    _, info = env.reset(seed=0, options={"task_index": 0})
    assert info["question_id"] == "test_0"


# ---------------------------------------------------------------- fuzzing


def test_info_keys_match_the_docstring():
    section = env_module.__doc__.split("Info keys", 1)[1].split("Options to", 1)[0]
    assert {key for key in INFO_KEYS | {"expected"} if f"``{key}``" in section} == INFO_KEYS | {"expected"}


def check_step(env, action: str) -> bool:
    obs, reward, terminated, truncated, info = env.step(action)
    assert isinstance(obs, Context) and env.observation_space.contains(obs)
    assert isinstance(reward, float) and 0.0 <= reward <= 1.0
    done = terminated or truncated
    assert set(info) == INFO_KEYS | ({"expected"} if done else set())
    score = info["evaluation_score"]
    assert score is None or (isinstance(score, int) and 0 <= score <= 10)
    if not done:
        assert reward == 0.0 and obs[-1].role == "user"
    return done


FRAGMENTS = ["<search>", "</search>", "<evaluate>", "</evaluate>", "score: 7", "<answer>", "</answer>", "<think>",
             "</think>", "```\n", "\n", "Paris", "unknown", "\ud800", " ", "10/10", "<search/>"]
actions = st.one_of(
    st.text(max_size=200),
    st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=6)), max_size=25).map("".join),
    st.sampled_from(ADVERSARIAL_TEXTS),
)
FUZZ_ENV = SearchEvalQAEnv(max_turns=5, max_searches=2, unanswerable_rate=0.2)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**16), turns=st.lists(actions, min_size=1, max_size=5))
def test_env_never_raises_on_arbitrary_text(seed, turns):
    obs, info = FUZZ_ENV.reset(seed=seed)
    assert FUZZ_ENV.observation_space.contains(obs) and set(info) == INFO_KEYS
    for action in turns:
        if check_step(FUZZ_ENV, action):
            break


def test_evaluation_end_marks_where_the_evaluation_stops():
    # PCAR splits a turn that evaluates and searches again at this offset: the query after it
    # belongs to the next Search->Evaluate span.
    env = gym.make(ENV_ID)
    env.reset(seed=0)
    *_, info = env.step("<search>first query</search>")
    assert info["evaluation_end"] is None
    action = "  <evaluate>score: 6 partly useful</evaluate> then <search>second query</search>"
    *_, info = env.step(action)
    assert info["evaluation_score"] == 6
    assert info["evaluation_end"] == action.index("</evaluate>") + len("</evaluate>")
    # Unreadable: no score, but still where the evaluation stops, so PCAR can cut a turn that
    # searches after it (the unscored span keeps the plain advantage).
    action = "<evaluate>no score here</evaluate><answer>x</answer>"
    *_, info = env.step(action)
    assert info["evaluation_score"] is None
    assert info["evaluation_end"] == action.index("</evaluate>") + len("</evaluate>")


def test_generator_reset_options_are_checked():
    env = SearchEvalQAEnv()
    with pytest.raises(ValueError, match="answerable must be True or False, got 'no'"):
        env.reset(seed=0, options={"answerable": "no"})
    with pytest.raises(ValueError, match=r"hops must be an int in \[1, 4\], got 9"):
        env.reset(seed=0, options={"hops": 9})
    _, info = env.reset(seed=0, options={"answerable": False})
    assert info["answerable"] is False


def test_nq_open_answers_load_and_a_bad_gold_answer_is_named(tmp_path):
    from rftgym.core.errors import DataFormatError
    from rftgym.envs.search.corpora import load_questions

    path = tmp_path / "nq_open.jsonl"
    path.write_text('{"question": "who wrote it?", "answer": ["Bob Ray", "Robert Ray"]}\n')
    (question,) = load_questions(str(path))
    assert question.answers == ("Bob Ray", "Robert Ray")
    path.write_text('{"question": "when?", "golden_answers": ["1999", 2000]}\n')
    with pytest.raises(DataFormatError, match=r"nq_open.jsonl:1: .*golden_answers\[1\] is 2000"):
        load_questions(str(path))


@pytest.mark.parametrize("inner", ["<search>more</search>", "<SEARCH>more</SEARCH >", "<search>more"])
def test_tool_markup_inside_an_answer_is_not_part_of_it(inner):
    env = SearchEvalQAEnv()
    env.reset(seed=5, options={"hops": 1})
    gold = env.question.answers[0]
    _, reward, terminated, _, info = env.step(f"<answer>{gold} {inner}</answer>")
    assert terminated and info["answer"] == gold and info["em"] == 1.0 and reward == 1.0
    # An answer that is only markup is an empty answer: not graded, and the episode goes on.
    env.reset(seed=5, options={"hops": 1})
    _, reward, terminated, _, info = env.step("<answer><think>hmm</think></answer>")
    assert not terminated and "an empty <answer> was not graded" in info["format_error"]
    # Text that only looks like markup stays.
    from rftgym.envs.common import without_tool_markup

    assert without_tool_markup("x < y and a<b>c", ("search", "answer")) == "x < y and a<b>c"


def test_text_after_a_think_block_and_before_a_stray_close_is_no_thinking():
    env = SearchEvalQAEnv()
    env.reset(seed=5, options={"hops": 1})
    env.step(f"<search>{env.question.gold_titles[0]}</search>")
    gold = env.question.answers[0]
    _, reward, _, _, info = env.step(f"<think>a</think> I skip rating and just talk. </think>"
                                     f"<evaluate>score: 8 ok</evaluate><answer>{gold}</answer>")
    assert info["protocol_violation"] == "skipped_evaluation" and reward == 0.0
    # thinking the template opened, closed before the evaluation, is thinking
    env.reset(seed=5, options={"hops": 1})
    env.step(f"<search>{env.question.gold_titles[0]}</search>")
    _, reward, _, _, info = env.step(f"these look right</think><evaluate>score: 8 ok</evaluate><answer>{gold}</answer>")
    assert info["protocol_violation"] is None and reward == 1.0


@pytest.mark.parametrize("tail", ["<answer>{gold}</answer></think>",  # a </think> that ends the reply
                                  "\n```\n</think>\n```\n<answer>{gold}</answer>"])  # one in a code block
def test_a_close_of_thinking_that_closes_nothing_does_not_hide_the_text_before_the_evaluation(tail):
    env = SearchEvalQAEnv()
    env.reset(seed=5, options={"hops": 1})
    env.step(f"<search>{env.question.gold_titles[0]}</search>")
    gold = env.question.answers[0]
    _, reward, terminated, _, info = env.step("Sure! <evaluate>score: 7 ok</evaluate>" + tail.format(gold=gold))
    assert terminated and info["protocol_violation"] == "skipped_evaluation" and reward == 0.0
    # A </think> with more of the reply after it closes thinking opened before the reply: kept.
    env.reset(seed=5, options={"hops": 1})
    env.step(f"<search>{env.question.gold_titles[0]}</search>")
    _, reward, _, _, info = env.step(f"Sure! <evaluate>score: 7 ok</evaluate> then</think><answer>{gold}</answer>")
    assert info["protocol_violation"] is None and reward == 1.0


def test_an_evaluation_drafted_in_thinking_gives_way_to_the_one_after_it():
    env = SearchEvalQAEnv()
    env.reset(seed=5, options={"hops": 2})
    env.step(f"<search>{env.question.gold_titles[0]}</search>")
    action = "<think>draft <evaluate>score: 3</evaluate> hmm</think><evaluate>score: 8 good</evaluate><search>y</search>"
    _, _, _, _, info = env.step(action)
    assert info["protocol_violation"] is None and info["evaluation_score"] == 8 and info["searches"] == 2
    assert action[:info["evaluation_end"]].endswith("score: 8 good</evaluate>")  # PCAR's split: after the real one
    assert info["format_error"] is None
    # A visible one after visible text does not open the turn: the draft, which does, stays the turn's.
    env.reset(seed=5, options={"hops": 2})
    env.step(f"<search>{env.question.gold_titles[0]}</search>")
    _, _, _, _, info = env.step("<think>draft <evaluate>score: 3</evaluate></think> So: <evaluate>score: 8</evaluate>")
    assert info["protocol_violation"] is None and info["evaluation_score"] == 3
    assert "does not open the turn" in info["format_error"]
    # Evaluating only while thinking (a search-in-think model) keeps that evaluation.
    env.reset(seed=5, options={"hops": 2})
    env.step(f"<search>{env.question.gold_titles[0]}</search>")
    _, _, _, _, info = env.step("<think>rating <evaluate>score: 4 partial</evaluate></think><search>y</search>")
    assert info["protocol_violation"] is None and info["evaluation_score"] == 4


def test_thinking_the_template_opened_and_the_reply_never_closed_holds_its_answer():
    env = SearchEvalQAEnv(think_opened_by_template=True)
    env.reset(seed=5, options={"hops": 1})
    env.step(f"I will look <search>{env.question.gold_titles[0]}</search></think>")
    gold = env.question.answers[0]
    _, reward, terminated, _, info = env.step(f"<evaluate>score: 9 ok</evaluate>I think it is <answer>{gold}</answer>")
    assert not terminated and reward == 0.0 and "inside <think> is reasoning" in info["format_error"]
    _, reward, terminated, _, info = env.step(f"so</think><answer>{gold}</answer>")
    assert terminated and reward == 1.0


def test_a_call_inside_another_calls_body_is_its_text_not_a_call():
    env = SearchEvalQAEnv()
    env.reset(seed=5, options={"hops": 1})
    title = env.question.gold_titles[0]
    # a search inside a query: one search, for the text around the inner tag, and no double search
    _, _, _, _, info = env.step(f"<search>{title} <search>other</search></search>")
    assert info["query"] == title and info["searches"] == 1 and info["protocol_violation"] is None
    assert "a <search> inside another tag's body was not run" in info["format_error"]
    # a guess in an evaluation's note is not an answer; the search after the evaluation runs
    _, _, terminated, _, info = env.step(f"<evaluate>score: 3 maybe <answer>pilot</answer>? need more</evaluate>"
                                         f"<search>more {title}</search>")
    assert not terminated and info["evaluation_score"] == 3 and info["searches"] == 2
    assert info["query"] == f"more {title}" and info["protocol_violation"] is None
    assert "a <answer> inside another tag's body was not run" in info["format_error"]


@pytest.mark.parametrize("returned, shown", [
    (None, "None"), ([{"doc_id": "1", "title": "t", "text": "x"}], "{'doc_id'"), ([Hit(1, "t", "x", 1.0)], "Hit(doc_id=1"),
    ([None], "None"), ("r1", "'r1'"),
])
def test_a_search_function_returning_no_hits_is_named_and_the_episode_ends(returned, shown):
    def write_results(query, k):
        return returned

    env = SearchEvalQAEnv(retriever=CallableRetriever(write_results))
    env.reset(seed=0)
    with pytest.raises(ConfigError, match=f"write_results returned {re.escape(shown)}.*must return a list of Hit"):
        env.step("<search>q</search>")
    with pytest.raises(RuntimeError, match="episode has ended"):   # a step that raised part way ends it
        env.step("<search>q</search>")


@pytest.mark.parametrize("evaluation, score, note", [
    ("<evaluate><think>hmm, is it?</think>score: 7 names it</evaluate>", 7, "names it"),
    ("<evaluate>score: 7 <think>or 3?</think>names it</evaluate>", 7, "names it"),
    ("<evaluate><think>only thinking</think></evaluate>", None, None),
])
def test_thinking_inside_an_evaluation_is_not_its_score_or_note(evaluation, score, note):
    env = SearchEvalQAEnv()
    env.reset(seed=3, options={"hops": 2})
    env.step("<search>anything</search>")
    *_, info = env.step(evaluation)
    assert (info["evaluation_score"], info["evaluation_note"]) == (score, note)
    assert (info["protocol_violations"] == 0) is (score is not None)


def test_a_score_before_a_long_run_of_spaces_is_read_in_linear_time():
    # "7" and 32,000 spaces took 18 s: two runs of white space side by side backtracked.
    assert parse_evaluation("7" + " " * 100_000 + "x") == (7, "x")
    assert parse_evaluation("3 (" + " " * 100_000 + "of 5") is None


def test_a_search_function_may_yield_its_hits():
    def write_results(query, k):
        yield Hit("d1", "Title", "text about q", 1.0)

    env = SearchEvalQAEnv(retriever=CallableRetriever(write_results))
    env.reset(seed=0)
    obs, *_ = env.step("<search>q</search>")
    assert any("text about q" in m.content for m in obs)
