"""rftgym/MemoryQA-v0: prunes edit the context exactly as documented, bad prunes are observations,
budgets, rewards, datasets and fuzzing with arbitrary assistant text."""

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
from rftgym.agents.memory_baselines import WorldOracleAgent
from rftgym.core.errors import ConfigError, EnvError
from rftgym.envs.memory import env as env_module
from rftgym.envs.memory.budget import estimate_tokens
from rftgym.envs.memory.env import MemoryQAEnv
from rftgym.envs.search.retrievers import BM25Retriever, Retriever
from rftgym.envs.search.world import World

ENV_ID = "rftgym/MemoryQA-v0"
QA_DIR = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "qa"
needs_qa_data = pytest.mark.skipif(
    not (QA_DIR / "hotpotqa_100.json").is_file() or not (QA_DIR / "2wiki_corpus_6119.json").is_file(),
    reason=f"the shared QA data is not at {QA_DIR}")
INFO_KEYS = {"task_id", "objectives", "hops", "turn", "context_tokens", "observation_tokens", "peak_context_tokens",
             "total_tokens", "context_budget", "budget_tokens", "over_budget", "overflows", "searches",
             "tool_calls", "queries", "result_ids", "prunes", "pruned", "pruned_ids", "turns_deleted",
             "memory_notes", "prune_error", "format_error", "answers", "answered", "correct", "score", "success"}


def small_env(**kwargs):
    kwargs.setdefault("world_size", 30)
    return MemoryQAEnv(**kwargs)


def two_searches(env):
    """Reset, then two searches in two turns; return the observation and the two batches' ids."""
    env.reset(seed=0, options={"objectives": 2, "hops": 2})
    q = env.task.objectives[0]
    env.step(f"<search>{q.gold_titles[0]}</search>")
    obs, _, _, _, info = env.step(f"<search>{q.gold_titles[1]}</search>")
    first = [m for m in obs if m.content.startswith("[search results")][0]
    return obs, re.findall(r"^\[(r\d+)\]", first.content, re.M), info


def test_check_env_passes():
    for kwargs in ({}, {"allow_prune": False, "on_context_overflow": "penalize", "reward_mode": "all_or_nothing"}):
        env = gym.make(ENV_ID, world_size=30, **kwargs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            check_env(env.unwrapped)
        assert [str(w.message) for w in caught] == []


def test_info_keys_match_the_docstring():
    env = small_env()
    _, info = env.reset(seed=1)
    assert set(info) == INFO_KEYS
    documented = set(re.findall(r"``(\w+)``", env_module.__doc__.split("Info keys")[1].split("Options to")[0]))
    assert INFO_KEYS | {"expected"} <= documented
    *_, info = env.step("<answer id='1'>x</answer>" + "".join(f"<answer id='{k}'>x</answer>" for k in range(2, 9)))
    assert set(info) == INFO_KEYS | {"expected"}


def test_results_carry_unique_ids_and_each_batch_is_one_message():
    env = small_env()
    obs, batch_ids, info = two_searches(env)
    batches = [m for m in obs if m.content.startswith("[search results for: ")]
    assert len(batches) == 2
    all_ids = [rid for m in batches for rid in re.findall(r"^\[(r\d+)\]", m.content, re.M)]
    assert len(all_ids) == len(set(all_ids)) and batch_ids == all_ids[: len(batch_ids)]
    assert info["result_ids"] == all_ids[len(batch_ids):] and info["searches"] == info["tool_calls"] == 2


def test_context_after_a_prune_is_exactly_the_documented_edit():
    env = small_env()
    obs, batch_ids, _ = two_searches(env)
    batch = next(m for m in obs if f"[{batch_ids[0]}]" in m.content)
    searcher = obs.messages[obs.messages.index(batch) - 1]  # the turn that brought the batch in
    assert searcher.role == "assistant" and searcher.content.startswith("<search>")
    # Naming ONE id of a batch deletes the whole batch message, and the turn that searched for it
    # (none of its results is left); the note is appended after the turn.
    action = f'<think>old</think><prune ids="{batch_ids[-1]}">Alda was born in Veloria</prune>'
    new, reward, terminated, truncated, info = env.step(action)
    expected_prefix = [m for m in obs if m.id not in (batch.id, searcher.id)]
    assert list(new.messages[: len(expected_prefix)]) == expected_prefix
    tail = new.messages[len(expected_prefix):]
    assert [m.role for m in tail[:2]] == ["assistant", "user"]
    assert tail[0].content == action
    assert tail[1].content == "[memory m1] Alda was born in Veloria"
    assert len(tail) == 2 or tail[2].content.startswith("[env] ")  # a status only near the budget
    assert not terminated and not truncated and reward == 0.0
    assert info["prunes"] == 1 and info["memory_notes"] == 1 and info["prune_error"] is None
    assert info["pruned"] == [{"named": [batch_ids[-1]], "removed_ids": batch_ids, "message_ids": [batch.id],
                               "note_id": "m1", "note": "Alda was born in Veloria"}]
    assert info["pruned_ids"] == batch_ids and info["turns_deleted"] == 1
    # The note is prunable too, and the turn that wrote it (it searched nothing) goes with it: no copy
    # of the note is left. A prune without a note keeps no memory message and says so.
    new2, *_, info2 = env.step('<prune ids="M1"></prune>')
    assert not any("Alda was born in Veloria" in m.content for m in new2)
    assert "no note was kept" in new2[-1].content and info2["memory_notes"] == 0 and info2["prunes"] == 2
    assert info2["format_error"] is None and info2["turns_deleted"] == 1
    # The second search's turn and batch are still there: its results were not pruned.
    assert [m.content for m in new2 if m.role == "assistant"] == [f"<search>{env.task.objectives[0].gold_titles[1]}"
                                                                  "</search>", '<prune ids="M1"></prune>']


def test_a_self_closing_prune_is_a_prune_without_a_note():
    env = small_env()
    obs, batch_ids, _ = two_searches(env)
    new, *_, info = env.step(f'<prune ids="{batch_ids[0]}"/>')
    assert info["prunes"] == 1 and info["pruned_ids"] == batch_ids and info["memory_notes"] == 0
    assert info["format_error"] is None and info["prune_error"] is None
    # Only prune may be self-closing: an answer may not.
    _, *_, info = env.step('<answer id="1"/>')
    assert "<answer/> is empty" in info["format_error"]


def test_tool_tags_inside_a_note_run_as_tags_and_are_not_kept_in_it():
    env = small_env()
    obs, batch_ids, _ = two_searches(env)
    new, *_, info = env.step(f'<prune ids="{batch_ids[0]}">kept <answer id="1">mining</answer> this</prune>')
    assert info["answers"] == {"1": "mining"}  # the answer ran
    assert info["pruned"][0]["note"] == "kept this" and "[memory m1] kept this" in [m.content for m in new]


@pytest.mark.parametrize("written", ["ids={a}, {b}", "ids={a} ,{b}", "ids={a},{b}", "IDS = {a}, {b}/"])
def test_a_bare_list_of_ids_with_spaces_prunes_every_id_it_names(written):
    env = small_env()
    obs, first_ids, _ = two_searches(env)
    batches = [m for m in obs if m.content.startswith("[search results")]
    second_ids = re.findall(r"^\[(r\d+)\]", batches[1].content, re.M)
    opening = "<prune " + written.format(a=first_ids[0], b=second_ids[0])
    action = opening + ">" if opening.endswith("/") else opening + ">both batches read</prune>"
    new, *_, info = env.step(action)
    assert info["prune_error"] is None and info["pruned"][0]["named"] == [first_ids[0], second_ids[0]]
    assert info["pruned_ids"] == first_ids + second_ids
    assert not any(m.content.startswith("[search results") for m in new)


def test_a_prune_with_two_ids_attributes_is_refused_not_half_run():
    env = small_env()
    obs, batch_ids, _ = two_searches(env)
    new, *_, info = env.step(f'<prune ids="{batch_ids[0]}" ids="m1">x</prune>')
    assert info["prunes"] == 0 and "more than one ids attribute" in info["prune_error"]
    # The same refusal twice in one turn is said once, as format_error says it.
    two = f'<prune ids="{batch_ids[0]}" ids="m1">x</prune><prune ids="{batch_ids[0]}" ids="m2">y</prune>'
    *_, info = env.step(two)
    assert info["prune_error"].count("more than one ids attribute") == 1


@pytest.mark.parametrize("make_action, message", [
    (lambda ids, task_id: '<prune ids="r99">x</prune>', "not a search result or memory id"),
    (lambda ids, task_id: '<prune ids="task">x</prune>', "'task' is the task"),
    (lambda ids, task_id: f'<prune ids="{task_id}">x</prune>', "is the task"),
    (lambda ids, task_id: '<prune ids="{system_id}">x</prune>', "is the system message"),
    (lambda ids, task_id: '<prune ids="2">x</prune>', "objective 2 of the task"),
    (lambda ids, task_id: f'<prune ids="{ids[0]},r99">x</prune>', "nothing was pruned"),
    (lambda ids, task_id: '<prune ids="">x</prune>', "needs ids="),
    (lambda ids, task_id: '<prune>x</prune>', "needs ids="),
    (lambda ids, task_id: '<prune ids=" , ">x</prune>', "needs ids="),
    # a bare value stops at a space: r6 was dropped without a word, and only the first id pruned
    (lambda ids, task_id: f'<prune ids={ids[0]} r7>x</prune>', 'holds "r7" outside its ids attribute'),
    # an attribute it does not read: the note in note= was dropped without a word
    (lambda ids, task_id: f'<prune ids="{ids[0]}" note="keep this">x</prune>', "has an attribute note=, which it "
                                                                              "does not read"),
])
def test_bad_prunes_change_nothing_and_say_why(make_action, message):
    env = small_env()
    obs, ids, _ = two_searches(env)
    task_id = obs[1].id
    action = make_action(ids, task_id).replace("{system_id}", obs[0].id)
    assert obs[0].role == "system"
    new, reward, terminated, truncated, info = env.step(action)
    assert list(new.messages[: len(obs)]) == list(obs.messages)  # nothing deleted
    assert [m.role for m in new.messages[len(obs):]] == ["assistant", "user"]
    assert message in new[-1].content and message in info["prune_error"]
    assert info["prunes"] == 0 and info["pruned"] == [] and info["memory_notes"] == 0


def test_unclosed_prune_and_prune_inside_think_are_not_run():
    env = small_env()
    obs, ids, _ = two_searches(env)
    for action in (f'<prune ids="{ids[0]}">note', f'<think><prune ids="{ids[0]}">n</prune></think>'):
        new, *_, info = env.step(action)
        assert set(obs.ids) <= set(new.ids) and info["prunes"] == 0 and info["format_error"]
        obs = new
    # an open prune is most often a note cut at the reply's length limit: the status says so
    assert "keep the note shorter" in env.step(f'<prune ids="{ids[0]}">a long note')[4]["format_error"]


@pytest.mark.parametrize("written", ['"[memory m1]"', '"memory m1"', "\u201cm1\u201d", '"[M1]"'])
def test_a_prune_may_name_a_note_as_the_context_shows_it(written):
    env = small_env()
    obs, ids, _ = two_searches(env)
    env.step(f'<prune ids="{ids[0]}">Alda was born in Veloria</prune>')
    new, *_, info = env.step(f"<prune ids={written}></prune>")
    assert info["prune_error"] is None and info["prunes"] == 2 and info["pruned"][-1]["named"] == ["m1"]
    assert all(not m.content.startswith("[memory") for m in new)


def test_parse_prune_ids_reads_brackets_quotes_and_the_word_memory():
    from rftgym.envs.memory.context_ops import parse_prune_ids

    assert parse_prune_ids("[R4], [memory m1]; r4") == ["r4", "m1"]
    from rftgym.core.tags import parse_tags  # typographic quotes are the attribute parser's to read

    (prune,) = parse_tags('<prune ids=\u201cr3, r5\u201d>n</prune>', ("prune",)).tags
    assert parse_prune_ids(prune.attr("ids")) == ["r3", "r5"]
    assert parse_prune_ids("memory") == [] and parse_prune_ids("memories") == ["memories"]  # unknown: refused later


def test_an_answer_id_in_typographic_quotes_is_read():
    env = small_env()
    env.reset(seed=0, options={"objectives": 2, "hops": 2})
    *_, info = env.step("<answer id=\u201c2\u201d>x</answer>")
    assert info["answers"] == {"2": "x"}


def test_the_prompt_and_task_read_well_without_a_budget_and_with_one_question():
    env = small_env(max_context_tokens=None)
    obs, _ = env.reset(seed=0, options={"objectives": 1})
    assert "unlimited" not in obs[0].content and "no token limit" in obs[0].content
    assert obs[1].content.startswith("Task: answer the question below.\n1. ")
    obs, _ = small_env(max_context_tokens=900).reset(seed=0, options={"objectives": 2})
    assert "at most about 900 tokens" in obs[0].content and obs[1].content.startswith("Task: answer all 2 questions")


@pytest.mark.parametrize("action", ["", "   ", "just thinking", "<think>what to search next</think>"])
def test_a_turn_that_does_nothing_is_told_so(action):
    env = small_env()
    obs, _ = env.reset(seed=0)
    new, reward, terminated, truncated, info = env.step(action)
    problem = "the turn had no <search>, <prune> or <answer>, so nothing was done"
    assert info["format_error"] == problem and (reward, terminated, truncated) == (0.0, False, False)
    # The assistant turn, then the status message that says so (never two assistant turns in a row).
    assert [m.role for m in new.messages[len(obs):]] == ["assistant", "user"] and problem in new[-1].content


def test_a_prune_cannot_name_a_result_of_the_same_turn_or_one_already_pruned():
    env = small_env()
    obs, ids, _ = two_searches(env)
    *_, info = env.step(f'<search>Veloria</search><prune ids="r{int(ids[-1][1:]) + 100}">x</prune>')
    assert info["prune_error"]
    new_ids = info["result_ids"]
    *_, info = env.step(f'<search>zzz</search><prune ids="{new_ids[0]}">a</prune><prune ids="{new_ids[0]}">b</prune>')
    assert info["prunes"] == 1 and "already pruned" in info["prune_error"]


def test_no_memory_configuration_hides_and_refuses_prune():
    env = small_env(allow_prune=False)
    obs, ids, _ = two_searches(env)
    assert "prune" not in obs[0].content
    new, *_, info = env.step(f'<prune ids="{ids[0]}">x</prune>')
    assert set(obs.ids) <= set(new.ids) and "turned off" in info["prune_error"] and info["tool_calls"] == 2


def test_rewards_fraction_all_or_nothing_and_answer_rules():
    env = small_env()
    env.reset(seed=3, options={"objectives": 3, "hops": 1})
    golds = [q.answers[0] for q in env.task.objectives]
    _, reward, terminated, _, info = env.step(f'<answer id="1">{golds[0]}</answer><answer>{golds[1]}</answer>'
                                              f'<answer id="1">wrong</answer>')
    # a correct answer is paid when given: a third of the score
    assert not terminated and reward == 1 / 3 and info["answers"] == {"1": golds[0]} and info["answered"] == 1
    assert "needs id=" in info["format_error"] and "already answered" in info["format_error"]
    # A digit int() cannot read ("²") is a bad id, an observation like any other.
    _, reward, terminated, _, info = env.step(f'<answer id="²">{golds[1]}</answer>')
    assert not terminated and info["answered"] == 1 and "needs id=" in info["format_error"] and reward == 0.0
    _, reward, terminated, _, info = env.step(f'<answer id="q2">{golds[1]} extra words here</answer>'
                                              f'<answer id="3">{golds[2]}</answer>')
    # F1 of "gold + 3 words" is below 0.8: objective 2 is wrong; objective 3 adds its third.
    assert terminated and reward == pytest.approx(1 / 3) and info["correct"] == 2 and not info["success"]
    assert info["score"] == pytest.approx(2 / 3)
    assert info["expected"] == {str(k): [g] for k, g in enumerate(golds, start=1)}

    env = small_env(reward_mode="all_or_nothing", answer_metric="em")
    env.reset(seed=3, options={"objectives": 2, "hops": 1})
    golds = [q.answers[0] for q in env.task.objectives]
    _, reward, *_ = env.step(f'<answer id="1">{golds[0]}.</answer>')
    assert reward == 0.0  # all or nothing: paid once all are right
    _, reward, terminated, _, info = env.step(f'<answer id="2">The {golds[1]}</answer>')
    assert terminated and reward == 1.0 and info["success"]
    env.reset(seed=3, options={"objectives": 1, "hops": 1})
    _, reward, terminated, *_ = env.step("<answer>nope</answer>")  # one objective: the id may be left out
    assert terminated and reward == 0.0


def oracle_run(env, seed, objectives=3, hops=3):
    context, _ = env.reset(seed=seed, options={"objectives": objectives, "hops": hops})
    agent = WorldOracleAgent(env.world)
    steps = []
    while True:
        steps.append(env.step(agent.reply(context)))
        context = steps[-1][0]
        if steps[-1][2] or steps[-1][3]:
            return steps


def test_context_budget_truncates_and_penalizes():
    env = small_env(max_context_tokens=600, overflow_penalty=0.25)
    steps = oracle_run(env, seed=0)
    obs, reward, terminated, truncated, info = steps[-1]
    assert truncated and not terminated and info["over_budget"] and info["overflows"] == 1
    assert info["budget_tokens"] > 600 == info["context_budget"]
    assert estimate_tokens(obs) == info["observation_tokens"]
    statuses = [m.id for m in obs if m.content.startswith("[env] ")]
    assert statuses and estimate_tokens(obs.without(statuses)) == info["budget_tokens"]  # the env's own text aside
    assert sum(s[1] for s in steps) == pytest.approx(info["score"] - 0.25)  # the score, paid as earned
    assert all(s[4]["budget_tokens"] <= 600 for s in steps[:-1])

    env = small_env(max_context_tokens=600, overflow_penalty=0.25, on_context_overflow="penalize")
    steps = oracle_run(env, seed=0)
    rewards = [s[1] for s in steps]
    overflowing = [s for s in steps if s[4]["over_budget"]]
    assert steps[-1][2] and len(overflowing) == steps[-1][4]["overflows"] >= 2
    scores = [0.0] + [s[4]["score"] for s in steps]  # each turn: what its answers earned, less its penalty
    assert rewards == pytest.approx([now - before - 0.25 * s[4]["over_budget"]
                                     for before, now, s in zip(scores, scores[1:], steps)])
    assert sum(rewards) == pytest.approx(steps[-1][4]["score"] - 0.25 * len(overflowing))
    assert "over its budget" in overflowing[0][0][-1].content


def test_the_envs_status_messages_never_push_the_context_over_its_budget():
    """The status the env adds (it must answer a recorded answer) is not the agent's to prune, so
    it is not budgeted: a context that fits stays in budget, and the status says its count."""
    probe = small_env(max_context_tokens=999)  # the prompt states the budget: as many digits as below
    probe.reset(seed=0, options={"objectives": 1, "hops": 1})
    objective = probe.task.objectives[0]
    answer = f'<answer id="1">{objective.answers[0]}</answer>'
    _, _, terminated, _, info = probe.step(answer)
    fits = info["budget_tokens"]
    assert terminated and info["success"] and info["observation_tokens"] > fits  # a status was added
    env = small_env(max_context_tokens=fits, overflow_penalty=0.1)
    env.reset(seed=0, options={"objectives": 1, "hops": 1})
    obs, reward, terminated, _, info = env.step(answer)
    assert reward == 1.0 and not info["over_budget"] and info["overflows"] == 0
    assert f"Context: {fits} of {fits} tokens" in obs[-1].content and "over its budget" not in obs[-1].content
    env = small_env(max_context_tokens=fits - 1, overflow_penalty=0.1)
    env.reset(seed=0, options={"objectives": 1, "hops": 1})
    obs, reward, _, _, info = env.step(answer)
    assert reward == pytest.approx(0.9) and info["over_budget"] and info["budget_tokens"] == fits


def test_a_budget_below_the_first_observation_is_warned_of_and_reported():
    env = gym.make("rftgym/MemoryQA-v0", world_size=30, max_context_tokens=20)
    with pytest.warns(UserWarning,
                      match="its first observation is [0-9]+ tokens, over max_context_tokens=20") as caught:
        _, info = env.reset(seed=0)
    assert info["over_budget"] and info["budget_tokens"] > 20
    # It names this line, past rftgym's frames and gymnasium's wrappers around reset.
    assert {w.filename for w in caught if "first observation" in str(w.message)} == {__file__}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per env
        env.reset(seed=1)
    env.close()


def test_tokens_are_counted_with_the_given_counter_and_summed():
    env = small_env(count_tokens=lambda context: 10 * len(context), max_context_tokens=None)
    obs, _ = env.reset(seed=0, options={"objectives": 2, "hops": 2})
    seen = []
    steps = oracle_run(env, seed=0, objectives=2, hops=2)
    context, _ = env.reset(seed=0, options={"objectives": 2, "hops": 2})
    for _, _, _, _, info in steps:
        seen.append(info["context_tokens"])
    assert seen[0] == 10 * len(obs) and steps[-1][4]["total_tokens"] == sum(seen)
    assert steps[-1][4]["peak_context_tokens"] == max(seen)
    assert steps[-1][2] and steps[-1][4]["success"]


@pytest.mark.parametrize("count", ["x", -5, 2.5, None])
def test_a_counter_that_returns_no_token_count_is_named(count):
    env = small_env(count_tokens=lambda context: count)
    with pytest.raises(ValueError, match=f"count_tokens returned {count!r} for a context of 2 messages; it must return "
                                         "the context's number of tokens"):
        env.reset(seed=0)
    env.close()


def test_turn_and_tool_call_budgets():
    env = small_env(max_turns=2)
    env.reset(seed=0)
    assert not env.step("hello")[3]
    assert env.step("hello")[3]
    env = small_env(max_tool_calls=1)
    env.reset(seed=0)
    *_, info = env.step("<search>a</search><search>b</search>")
    assert info["searches"] == 1 and "Tool call limit reached (1)" in env._context[-1].content


def test_seeding_and_ids_are_deterministic():
    a, b = small_env(), small_env()
    assert a.reset(seed=5)[0] == b.reset(seed=5)[0]
    assert a.step("<search>x</search>")[0] == b.step("<search>x</search>")[0]
    assert a.reset(seed=6)[0].ids != b.reset(seed=5)[0].ids


@pytest.mark.parametrize("kwargs, message", [
    ({"objectives": 0}, "objectives"), ({"hops": 9}, "hops"), ({"on_context_overflow": "x"}, "on_context_overflow"),
    ({"count_tokens": 3}, "count_tokens"), ({"corpus_path": "x.json"}, "dataset_path"),
    ({"reward_mode": "sum"}, "reward_mode"), ({"max_context_tokens": 0}, "max_context_tokens"),
    ({"allow_prune": "no"}, "allow_prune"), ({"f1_threshold": 2}, "f1_threshold"),
    ({"f1_threshold": float("nan")}, r"f1_threshold must be a number in \[0, 1\], got nan"),
    ({"overflow_penalty": float("inf")}, r"overflow_penalty must be a number in \[0, 1000\], got inf"),
    ({"overflow_penalty": float("nan")}, r"overflow_penalty must be a number in \[0, 1000\]"),
    ({"overflow_penalty": 1e308}, r"overflow_penalty must be a number in \[0, 1000\], got 1e\+308"),
    ({"dataset_path": "q.json", "hops": [4]}, "hops shapes generated tasks only, and dataset_path is given"),
    ({"dataset_path": ""}, "dataset_path is empty"),
    ({"hops": [2.7]}, "hops must be a list of ints"), ({"objectives": 1.5}, "objectives must be a list of ints"),
])
def test_bad_config_raises_config_error(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        MemoryQAEnv(**kwargs)


@pytest.mark.skipif(not (QA_DIR / "nq_16.jsonl").is_file(), reason=f"the shared QA data is not at {QA_DIR}")
def test_questions_without_their_own_paragraphs_are_refused_with_what_to_give():
    with pytest.raises(ConfigError, match=r"nq_16\.jsonl holds questions without their own paragraphs \(NQ-style\); "
                                          r"MemoryQA builds its corpus from them, so give a HotpotQA"):
        MemoryQAEnv(dataset_path=str(QA_DIR / "nq_16.jsonl"))


@needs_qa_data
def test_a_remote_service_that_is_down_is_told_what_corpus_to_serve():
    import socket

    from rftgym.envs.search.client import RetrievalServiceError

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}/retrieve"
    # The dataset's paragraphs and then corpus_path's: no one file holds that corpus.
    with pytest.raises(RetrievalServiceError, match="Start one with: rftgym serve-retriever --corpus FILE, FILE holding "
                                                    "the dataset's paragraphs and the first max_distractors documents"):
        MemoryQAEnv(dataset_path=str(QA_DIR / "hotpotqa_100.json"), corpus_path=str(QA_DIR / "2wiki_corpus_6119.json"),
                    retriever="remote", retriever_url=url)
    with pytest.raises(RetrievalServiceError, match=f"Start one with: rftgym serve-retriever --corpus "
                                                    f"{re.escape(str(QA_DIR / 'hotpotqa_100.json'))} --index bm25 "
                                                    rf"--port {url.split(':')[2].split('/')[0]}$"):
        MemoryQAEnv(dataset_path=str(QA_DIR / "hotpotqa_100.json"), retriever="remote", retriever_url=url)


@needs_qa_data
def test_a_distractor_corpus_made_from_the_dataset_adds_no_document_twice():
    # HotpotQA's corpus file is the union of its questions' own contexts: every paragraph is both
    dataset = str(QA_DIR / "hotpotqa_100.json")
    alone = MemoryQAEnv(dataset_path=dataset, max_context_tokens=None).retriever.documents
    both = MemoryQAEnv(dataset_path=dataset, corpus_path=str(QA_DIR / "hotpotqa_100_corpus.json"),
                       max_context_tokens=None).retriever.documents
    assert len({(d.title, d.text) for d in both}) == len(both) == len(alone)


@needs_qa_data
def test_hotpotqa_tasks_over_a_distractor_corpus():
    env = MemoryQAEnv(dataset_path=str(QA_DIR / "hotpotqa_100.json"), corpus_path=str(QA_DIR / "2wiki_corpus_6119.json"),
                      max_distractors=1000, objectives=3, max_context_tokens=None)
    assert len(env.retriever.documents) > 1000
    context, info = env.reset(seed=0)
    assert info["objectives"] == 3 and context[1].content.count("\n") == 3
    objectives = env.task.objectives
    for question in objectives:
        obs, *_, info = env.step("".join(f"<search>{t}</search>" for t in question.gold_titles))
        assert len(info["result_ids"]) >= len(question.gold_titles)
        titles = [m.content for m in obs if m.content.startswith("[search results")]
        assert all(any(f"] {t}:" in c for c in titles) for t in question.gold_titles)
    answers = "".join(f'<answer id="{k}">{q.answers[0]}</answer>' for k, q in enumerate(objectives, start=1))
    _, reward, terminated, _, info = env.step(answers)
    assert terminated and reward == 1.0 and info["success"]
    fixed, _ = env.reset(seed=1, options={"question_indices": [4, 7]})
    assert env.task.objectives == (env.pool[4], env.pool[7])
    with pytest.raises(ValueError, match=r"\['hops'\] do not apply here: this env serves a dataset"):
        env.reset(seed=1, options={"hops": 2})  # a generated world's option
    with pytest.raises(ValueError, match="question_indices .* or objectives .*, not both"):
        env.reset(seed=1, options={"question_indices": [4, 7], "objectives": 3})
    assert env.reset(seed=1, options={"question_indices": "12"}) and env.task.objectives == (env.pool[12],)
    for bad in ([1.9], [True, 2], [4, 4], [], 5.0):  # never quietly another question
        with pytest.raises(ValueError, match="question_indices must be distinct ints"):
            env.reset(seed=1, options={"question_indices": bad})


action_text = st.one_of(
    st.text(max_size=200),
    st.lists(st.sampled_from(['<search>', '</search>', '<prune ids="', 'r1', 'r2,r3', 'm1', '">', '</prune>',
                              '<answer id="1">', '<answer id="9">', '</answer>', '<think>', '</think>', 'Alda',
                              '<prune>', "ids='task'", ' ', '\n', '<answer>']), max_size=25).map("".join),
)
FUZZ_ENV = small_env(max_turns=5, max_tool_calls=4, max_context_tokens=400, on_context_overflow="penalize")


@settings(max_examples=120, deadline=None)
@given(seed=st.integers(0, 2**16), turns=st.lists(action_text, min_size=1, max_size=5))
def test_env_never_raises_on_arbitrary_text(seed, turns):
    obs, info = FUZZ_ENV.reset(seed=seed)
    assert FUZZ_ENV.observation_space.contains(obs)
    for action in turns:
        obs, reward, terminated, truncated, info = FUZZ_ENV.step(action)
        assert FUZZ_ENV.observation_space.contains(obs) and set(info) <= INFO_KEYS | {"expected"}
        assert -FUZZ_ENV.config.overflow_penalty <= reward <= 1.0
        assert obs[0].role == "system" and obs[1].content.startswith("Task:")  # never pruned
        if terminated or truncated:
            break


def test_a_huge_bad_id_gives_a_short_refusal():
    env = small_env()
    two_searches(env)
    *_, info = env.step(f'<prune ids="{"x" * 5000}">n</prune>')
    assert "nothing was pruned" in info["prune_error"] and len(info["prune_error"]) < 300


@pytest.mark.parametrize("hops", [1.5, True, "x", [2, 2.5], []])
def test_reset_hops_must_be_integers(hops):
    env = gym.make("rftgym/MemoryQA-v0").unwrapped
    with pytest.raises(ValueError, match=r"hops must be an int \(or ints\) in \[1, "):
        env.reset(seed=0, options={"objectives": 1, "hops": hops})
    _, info = env.reset(seed=0, options={"objectives": 2, "hops": ["2", 1]})  # as --env-arg may give them
    assert len(info["hops"]) == 2 and set(info["hops"]) <= {1, 2}


def test_tool_markup_inside_an_answer_is_not_part_of_it():
    env = small_env()
    env.reset(seed=3, options={"objectives": 1, "hops": 1})
    gold = env.task.objectives[0].answers[0]
    _, reward, terminated, _, info = env.step(f'<answer id="1">{gold} <search>more</search></answer>')
    assert terminated and reward == 1.0 and info["answers"] == {"1": gold}
    env.reset(seed=3, options={"objectives": 1, "hops": 1})
    _, _, terminated, _, info = env.step('<answer id="1"><search>only markup</search></answer>')
    assert not terminated and "the answer to objective 1 is empty" in info["format_error"]


def test_an_episode_cut_short_from_outside_keeps_what_its_answers_earned():
    """A model whose context is full ends the episode without a step of the env: the answers it
    gave before were paid as they were given, so the episode's return holds them."""
    from rftgym.agents.base import CONTEXT_FULL, Agent, AgentReply
    from rftgym.rollout.engine import run_episodes

    probe = small_env()
    probe.reset(seed=4, options={"objectives": 3, "hops": 1})
    first_gold = probe.task.objectives[0].answers[0]

    class AnswersOnceThenFull(Agent):
        def act(self, contexts):
            return [AgentReply(text="", finish_reason=CONTEXT_FULL) if any(m.role == "assistant" for m in c)
                    else AgentReply(text=f'<answer id="1">{first_gold}</answer>', finish_reason="stop")
                    for c in contexts]

    (episode,) = run_episodes(lambda: small_env(), AnswersOnceThenFull(), [4],
                              options=[{"objectives": 3, "hops": 1}])
    assert episode.context_full and len(episode.turns) == 2
    assert episode.total_reward == pytest.approx(1 / 3) == episode.turns[0].info["score"]


def test_the_last_status_says_the_task_is_over_and_a_query_holds_no_markup():
    env = small_env(max_turns=2)
    env.reset(seed=0, options={"objectives": 2, "hops": 1})
    title = env.task.objectives[0].gold_titles[0]
    obs, *_, info = env.step(f'<search>{title} <answer id="1">x</answer></search>')
    assert info["queries"] == [title]  # the tags inside a query are not searched for
    obs, _, terminated, truncated, _ = env.step("<search>more</search>")
    assert truncated and not terminated and obs[-1].content.endswith("That was the last turn; the task is over.")
    env = small_env(max_context_tokens=600)
    steps = oracle_run(env, seed=0)
    obs, _, _, truncated, info = steps[-1]
    assert truncated and info["over_budget"] and "over its budget, so the task ends here" in obs[-1].content
    assert "prune results you no longer need" not in obs[-1].content  # no advice for a task that is over


def test_a_prune_also_deletes_the_envs_earlier_status_messages():
    """Statuses report the state at their own turn; a turn that edits the context anyway (a
    prune) takes the stale ones with it, so they do not pile up in a long episode. A turn with
    no prune keeps the context an extension of the last one (no segment break for a status)."""
    env = small_env()
    obs, ids, _ = two_searches(env)
    second = [m for m in obs if m.content.startswith("[search results")][1]
    second_ids = re.findall(r"^\[(r\d+)\]", second.content, re.M)
    obs, _, _, _, _ = env.step(f'<prune ids="{ids[0]}"></prune>')  # no note: a status says so
    first_status = [m.id for m in obs if m.content.startswith("[env] ")]
    assert len(first_status) == 1 and "no note was kept" in obs[-1].content
    after_answer, _, _, _, _ = env.step('<answer id="1">nothing</answer>')  # a status, no prune
    statuses = [m.id for m in after_answer if m.content.startswith("[env] ")]
    assert len(statuses) == 2 and [m.id for m in after_answer][:len(obs)] == [m.id for m in obs]
    pruned, _, _, _, info = env.step(f'<prune ids="{second_ids[0]}">kept</prune>')
    assert not {m.id for m in pruned} & set(statuses)  # both stale statuses went with the prune
    # With the second batch, two earlier turns are spent: its search, and the first prune (it searched
    # nothing); the turn that recorded an answer stays.
    answer_turn = [m.id for m in after_answer if m.content == '<answer id="1">nothing</answer>']
    expected = [m.id for m in after_answer if m.id not in statuses and m.id != second.id
                and (m.role != "assistant" or m.id in answer_turn)]
    assert [m.id for m in pruned][:len(expected)] == expected and info["turns_deleted"] == 2 and answer_turn
    assert info["budget_tokens"] == estimate_tokens(pruned.without(
        [m.id for m in pruned if m.content.startswith("[env] ")]))


class FlakyRetriever(Retriever):
    """The world's BM25 index, raising while ``failing`` (a remote service that is down)."""

    def __init__(self, world: World):
        self.inner, self.failing = BM25Retriever(world.documents), False

    def search(self, queries, k):
        if self.failing:
            raise EnvError("the retrieval service is down")
        return self.inner.search(queries, k)


def test_a_step_that_raises_part_way_ends_the_episode_rather_than_leave_half_a_turn():
    retriever = FlakyRetriever(World(0, 30))
    env = small_env(retriever=retriever)
    env.reset(seed=0)
    *_, info = env.step("<search>currency</search>")
    retriever.failing = True
    with pytest.raises(EnvError, match="down"):   # the prune had run; the search raised
        env.step(f'<prune ids="{info["result_ids"][0]}">note</prune><search>river</search>')
    retriever.failing = False
    with pytest.raises(RuntimeError, match="episode has ended; call reset"):
        env.step('<prune ids="r1">note</prune>')
    _, info = env.reset(seed=0)
    assert info["turn"] == 0 and info["tool_calls"] == 0


def test_a_reset_that_raises_after_drawing_its_task_leaves_nothing_to_step():
    counts = iter([10, 10.5])   # the second reset's first count is no token count

    env = small_env(count_tokens=lambda context: next(counts, 10))
    env.reset(seed=0)
    with pytest.raises(ValueError):
        env.reset(seed=1)
    with pytest.raises(RuntimeError, match="call reset"):
        env.step("<search>x</search>")


def test_an_f1_threshold_of_zero_is_refused_it_would_count_any_answer_correct():
    with pytest.raises(ConfigError, match="f1_threshold must be above 0"):
        small_env(f1_threshold=0.0)
    assert small_env(f1_threshold=1e-9).config.f1_threshold == 1e-9


@pytest.mark.parametrize("hops", [{2: 1}, b"\x02", {2}, bytearray(b"\x02")])
def test_hops_that_only_iterate_like_ints_are_refused(hops):
    with pytest.raises(ConfigError, match="hops"):
        small_env(hops=hops)
    env = small_env()
    with pytest.raises(ValueError, match="hops"):
        env.reset(seed=0, options={"hops": hops})


def test_an_agent_that_reasons_and_prunes_each_turn_keeps_its_context_bounded():
    """Each turn thinks at length, searches, and prunes the last turn's results: the turns that
    searched go with their results, so the context stays the size of one turn and one batch,
    not growing by a turn's reasoning each step (the budget counts the agent's turns)."""
    env = small_env(max_context_tokens=None)
    env.reset(seed=0, options={"objectives": 3, "hops": 2})
    names = [title for q in env.task.objectives for title in q.gold_titles]
    thinking = "<think>" + "I should look this up and keep what matters. " * 15 + "</think>"
    obs, *_ = env.step(f"{thinking}<search>{names[0]}</search>")
    sizes = []
    for name in names[1:]:
        shown = re.findall(r"^\[(r\d+)\]", next(m.content for m in obs if m.content.startswith("[search")), re.M)
        obs, _, _, _, info = env.step(f'{thinking}<search>{name}</search><prune ids="{shown[0]}"></prune>')
        assert info["prune_error"] is None and info["turns_deleted"] == 1
        assert sum(m.role == "assistant" for m in obs) == 1  # the turn just played only
        sizes.append(info["budget_tokens"])
    # One turn's reasoning alone is some 170 tokens; result batches differ by up to about 120.
    assert len(sizes) >= 4 and max(sizes) - min(sizes) < 150


@pytest.mark.parametrize("noun", ["river", "industry", "company"])
def test_a_river_or_an_industry_named_as_the_documents_name_it_is_correct(noun):
    """The world's documents say "The Brican river flows through ..." and "X is a mining company",
    and the question asks "Which industry ...?": an answer in those words is right (token F1 of the
    bare name's gold alone would be 0.67, under 0.8)."""
    env = small_env()
    asked = "Which river" if noun == "river" else "Which industry"
    for seed in range(40):
        env.reset(seed=seed, options={"objectives": 1, "hops": 2})
        objective = env.task.objectives[0]
        if objective.question.startswith(asked):
            break
    else:
        pytest.fail(f"no question starts with {asked!r}")
    _, reward, terminated, _, info = env.step(f'<answer id="1">the {objective.answers[0]} {noun}</answer>')
    assert terminated and info["correct"] == 1 and reward == 1.0


def test_a_draft_in_think_is_no_problem_only_when_the_same_call_follows_it():
    env = small_env()
    env.reset(seed=0, options={"objectives": 2, "hops": 1})
    # A draft of objective 1's answer, then objective 2's: objective 1 was never answered, so it is said.
    *_, info = env.step('<think>1 is <answer id="1">Foo</answer></think><answer id="2">Bar</answer>')
    assert "inside <think> was not run" in info["format_error"] and info["answers"] == {"2": "Bar"}
    env.reset(seed=0, options={"objectives": 2, "hops": 1})
    *_, info = env.step('<answer id="1">Foo</answer><think>or <answer id="1">Baz</answer></think>')  # after: said
    assert "inside <think> was not run" in info["format_error"]
    env.reset(seed=0, options={"objectives": 2, "hops": 1})
    *_, info = env.step('<think>maybe <search>Foo</search></think><search>Bar</search>')
    assert info["format_error"] is None and info["queries"] == ["Bar"]
