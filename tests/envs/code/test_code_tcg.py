"""The Test Case Generator: sources, drop-on-reference-error, dedup, cap, cache, LLM proposals,
and the full HumanEval / an MBPP subset (reference passes, a wrong solution fails)."""

from __future__ import annotations

import collections
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rftgym.agents.base import Agent, AgentReply
from rftgym.core.errors import ConfigError
from rftgym.envs.code.codec import decode
from rftgym.envs.code.datasets import load_humaneval, load_mbpp
from rftgym.envs.code.harness import grade_many
from rftgym.envs.code.sandbox import make_sandbox
from rftgym.envs.code.generator import generate_tasks
from rftgym.envs.code.tasks import CodeTask, TestCase
from rftgym.envs.code.tcg import TCGConfig, build_tests, build_tests_many, cache_key, candidate_inputs
from rftgym.envs.code.tcg_llm import parse_proposals, propose_tests, with_llm_tests


@pytest.fixture(scope="module")
def sandbox():
    with make_sandbox() as box:
        yield box


@pytest.fixture
def config(tmp_path):
    return TCGConfig(cache_dir=str(tmp_path), n_random=15, n_edge=6, max_tests=25)


# Raises for negative n: such inputs must be dropped, never become tests.
SQRT = CodeTask("t-isqrt", "unit", "function", "isqrt", "isqrt",
                "def isqrt(n: int) -> int:\n    if n < 0:\n        raise ValueError(n)\n    return int(n ** 0.5)\n",
                examples=(TestCase("(9,)", None, "example"),),
                tests=(TestCase("(9,)", None, "example"), TestCase("(-4,)", None, "dataset"), TestCase("(16,)", None, "dataset"),
                       TestCase("(16,)", None, "dataset")))


def test_config_errors_say_what_is_allowed():
    with pytest.raises(ConfigError, match="sources"):
        TCGConfig(sources=("random", "magic"))
    with pytest.raises(ConfigError, match="max_tests"):
        TCGConfig(max_tests=0)
    with pytest.raises(ConfigError, match="per_test_seconds"):
        TCGConfig(per_test_seconds=-1)


def test_build_drops_reference_errors_dedups_and_orders(sandbox, config):
    built = build_tests(SQRT, config, sandbox)
    inputs = [t.input for t in built.tests]
    assert "(-4,)" not in inputs and len(inputs) == len(set(inputs))
    assert inputs[:2] == ["(9,)", "(16,)"] and [t.origin for t in built.tests[:2]] == ["example", "dataset"]
    assert {"edge", "random"} <= {t.origin for t in built.tests}
    for test in built.tests:  # expected output is the reference's
        n = eval(test.input)[0]
        assert decode(test.expected) == int(n ** 0.5)
    assert grade_many([(built, built.reference)], sandbox)[0].pass_rate == 1.0


def test_cap_and_sources(sandbox, tmp_path):
    capped = build_tests(SQRT, TCGConfig(cache_dir=str(tmp_path), max_tests=3), sandbox)
    assert [t.origin for t in capped.tests] == ["example", "dataset", "edge"]
    only = build_tests(SQRT, TCGConfig(cache_dir=str(tmp_path), sources=("example",)), sandbox)
    assert [t.input for t in only.tests] == ["(9,)"]


def test_random_inputs_stay_near_the_examples(config):
    task = CodeTask("t-len", "unit", "function", "", "f", "def f(xs, s):\n    return len(xs)\n",
                    examples=(TestCase("([3, 5, 8], 'ab')", None, "example"),))
    for source, origin in candidate_inputs(task, config):
        if origin == "random":
            xs, s = eval(source)
            assert all(isinstance(x, int) and x >= 0 for x in xs) and set(s) <= {"a", "b"}


def test_inputs_stay_in_the_domain_the_examples_show(config):
    # "1 <= k <= len(nums)": with k = 0 the reference's sorted(nums)[-k] answers the largest, and a
    # correct heapq.nlargest(k, nums)[-1] fails that test, so it could never pass its whole suite.
    task = CodeTask("t-kth", "unit", "function", "", "kth", "def kth(nums, k):\n    return sorted(nums)[-k]\n",
                    examples=(TestCase("([3, 1, 2], 1)", None, "example"), TestCase("([5, 4, 9, 7], 3)", None, "example")))
    inputs = [eval(source) for source, _ in candidate_inputs(task, config)]
    assert inputs and all(len(nums) >= 1 and k >= 1 for nums, k in inputs), inputs
    from rftgym.envs.code.inputs import ValueModel, neighbour_inputs

    model = ValueModel()
    for value in (0, 4):
        model.observe(value)
    assert 0 in model.edges()  # an observed 0 is in the domain
    assert [eval(s)[0] for s in neighbour_inputs([(1,)], random.Random(0), 20)] and all(
        eval(s)[0] >= 1 for s in neighbour_inputs([(1,)], random.Random(0), 20))


def test_nondeterministic_reference_outputs_are_dropped(sandbox, config):
    task = CodeTask("t-obj", "unit", "function", "", "f", "def f(x):\n    return object() if x else 1\n",
                    examples=(TestCase("(0,)", None, "example"), TestCase("(1,)", None, "example")))
    built = build_tests(task, TCGConfig(cache_dir=config.cache_dir, sources=("example",)), sandbox)
    assert [t.input for t in built.tests] == ["(0,)"]


@pytest.mark.parametrize("warm", [True, False], ids=["warm-jails", "jail-per-run"])
def test_outputs_that_depend_on_string_hashing_are_dropped(config, warm):
    """The second reference run is under another hash seed, also in a warm jail (whose zygote
    gives every run it forks its own seed): a set's order cannot become an expected output."""
    task = CodeTask("t-letters", "unit", "function", "letters", "letters",
                    "def letters(word: str) -> list:\n    return list(set(word))\n",
                    tests=(TestCase("('abcdefgh',)", None, "dataset"), TestCase("('a',)", None, "dataset")))
    orders = {subprocess.run([sys.executable, "-c", "print(list(set('abcdefgh')))"], env={"PYTHONHASHSEED": seed},
                             capture_output=True, text=True, check=True).stdout for seed in ("0", "1")}
    assert len(orders) == 2  # the premise: the two seeds order these eight letters differently
    with make_sandbox(warm_jails=warm, workers=1) as box:
        built = build_tests(task, TCGConfig(cache_dir=config.cache_dir, sources=("dataset",)), box)
    assert [t.input for t in built.tests] == ["('a',)"]  # one letter has one order


def test_cache_is_used_and_keyed_by_config(sandbox, config):
    first = build_tests(SQRT, config, sandbox)
    assert len(list(__import__("pathlib").Path(config.cache_dir, "tcg").glob("*.json"))) == 1
    class NoSandbox:
        limits = sandbox.limits
        def run_many(self, programs):
            assert not programs, "a cached suite must not run anything"
            return []
    assert build_tests(SQRT, config, NoSandbox()).tests == first.tests
    assert cache_key(SQRT, config) != cache_key(SQRT, TCGConfig(cache_dir=config.cache_dir, seed=1))


def test_generated_tasks_use_their_samplers(sandbox, config):
    tasks = generate_tasks(15, seed=3, difficulty=2)
    built = build_tests_many(tasks, config, sandbox)
    assert all(len(t.tests) >= 5 for t in built)
    results = grade_many([(t, t.reference) for t in built], sandbox)
    assert all(r.pass_rate == 1.0 for r in results)


class FakeTCGAgent(Agent):
    """Replies with a fixed test-proposal text, and records the prompts it saw."""

    def __init__(self, text):
        self.text, self.prompts = text, []

    def act(self, contexts):
        self.prompts += [c[-1].content for c in contexts]
        return [AgentReply(self.text) for _ in contexts]


def test_llm_proposals_are_validated_by_the_reference(sandbox, config):
    reply = ("Here you go:\n```python\nisqrt(25)\nisqrt(-1)\nisqrt(25)\nisqrt(n)\nisqrt(9)\nisqrt(10**2)\n"
             "isqrt('x')\n```")
    agent = FakeTCGAgent(reply)
    tests = propose_tests(agent, SQRT, 5, sandbox, config)
    assert "write 5 diverse test inputs" in agent.prompts[0].lower() and "isqrt" in agent.prompts[0]
    assert [t.input for t in tests] == ["(25,)"]  # -1 and 'x' raise, duplicates, names and 9 (known) dropped
    assert tests[0].origin == "llm" and decode(tests[0].expected) == 5
    merged = with_llm_tests(build_tests(SQRT, config, sandbox), tests)
    assert "(25,)" in [t.input for t in merged.tests]


def test_a_proposer_without_room_for_the_prompt_is_an_error(sandbox, config):
    from rftgym.agents.base import CONTEXT_FULL
    from rftgym.core.errors import ConfigError

    class NoRoom(FakeTCGAgent):
        def act(self, contexts):
            return [AgentReply("", finish_reason=CONTEXT_FULL) for _ in contexts]

    with pytest.raises(ConfigError, match="proposing tests: the prompt does not fit the agent's context"):
        propose_tests(NoRoom(""), SQRT, 5, sandbox, config)


def test_llm_stdio_proposals(sandbox, config):
    echo = CodeTask("t-echo", "unit", "stdio", "double n", None, "print(2 * int(input()))\n")
    assert parse_proposals(echo, "```text\n3\n```\n```\n4\n```\n```text\n3\n```") == ["3\n", "4\n"]
    tests = propose_tests(FakeTCGAgent("```text\n3\n```\n```text\nabc\n```"), echo, 2, sandbox, config)
    assert [(t.input, t.expected) for t in tests] == [("3\n", "6\n")]


def _check_dataset(tasks, sandbox, config):
    built = build_tests_many(tasks, config, sandbox)
    testable = [t for t in built if t.tests]
    refs = grade_many([(t, t.reference) for t in testable], sandbox)
    wrong = grade_many([(t, f"def {t.entry_point}(*args, **kwargs):\n    return None\n") for t in testable], sandbox)
    return built, testable, refs, wrong


def test_all_humaneval_references_pass_and_wrong_solutions_fail(sandbox, tmp_path):
    start = time.perf_counter()
    built, testable, refs, wrong = _check_dataset(load_humaneval(), sandbox, TCGConfig(cache_dir=str(tmp_path)))
    assert len(testable) == 164
    assert [t.task_id for t, r in zip(testable, refs) if r.pass_rate < 1.0] == []
    assert [t.task_id for t, r in zip(testable, wrong) if r.pass_rate == 1.0] == []
    origins = collections.Counter(x.origin for t in built for x in t.tests)
    assert origins["random"] > 0 and origins["edge"] > 0 and origins["dataset"] > 0
    print(f"HumanEval check: {time.perf_counter() - start:.1f} s")


def test_mbpp_subset_references_pass_and_wrong_solutions_fail(sandbox, tmp_path):
    tasks = load_mbpp(Path(__file__).resolve().parents[3] / ".." / "shared" / "data" / "code" / "mbpp.jsonl")[:120]
    built, testable, refs, wrong = _check_dataset(tasks, sandbox, TCGConfig(cache_dir=str(tmp_path)))
    assert len(testable) == 120
    assert [t.task_id for t, r in zip(testable, refs) if r.pass_rate < 1.0] == []
    assert [t.task_id for t, r in zip(testable, wrong) if r.pass_rate == 1.0] == []


def test_inputs_the_reference_barely_finishes_in_time_are_dropped(sandbox, tmp_path):
    """A test the reference needs most of the time limit for would fail correct candidates on a
    busy machine; the TCG keeps only inputs with headroom (at most a quarter of the limit)."""
    slow = CodeTask("t-slow", "unit", "function", "wait", "wait",
                    "import time\n\ndef wait(s: float) -> float:\n    time.sleep(s)\n    return s\n",
                    tests=(TestCase("(0.0,)", None, "dataset"), TestCase("(0.7,)", None, "dataset")))
    config = TCGConfig(cache_dir=str(tmp_path), sources=("dataset",), per_test_seconds=1.0)
    built = build_tests(slow, config, sandbox)
    assert [t.input for t in built.tests] == ["(0.0,)"]


def test_neighbours_of_rare_outputs_are_added_when_one_output_dominates(sandbox, tmp_path, monkeypatch):
    # Random lists near the examples almost never hold a pair summing to zero, so nearly every
    # random test expects False and "return False" would pass most of the suite. The second round
    # mutates the True inputs (reorder, repeat or drop an element) and keeps mutants still True.
    from rftgym.envs.code import tcg

    task = CodeTask("t-pairs", "unit", "function", "", "f",
                    "def f(xs):\n    return any(a + b == 0 for i, a in enumerate(xs) for b in xs[i + 1:])\n",
                    examples=(TestCase("([3, -3, 7],)", None, "example"), TestCase("([1, 2, 9],)", None, "example"),
                              TestCase("([5, 8, 1, 4],)", None, "example")))

    def suite(cache):
        built = build_tests(task, TCGConfig(cache_dir=str(tmp_path / cache), n_random=12, n_edge=0), sandbox)
        return built, collections.Counter(decode(t.expected) for t in built.tests)

    monkeypatch.setattr(tcg, "MAJORITY_SHARE", 1.0)  # no second round
    _, before = suite("without")
    monkeypatch.undo()
    built, after = suite("with")
    assert before[False] / sum(before.values()) > 0.75, before  # the skew the second round is for
    assert after[True] >= before[True] + 3 and after[False] / sum(after.values()) <= 0.75, (before, after)
    # Every added test is a real one: the reference passes them; "return False" no longer passes most.
    reference, constant = grade_many([(built, task.reference), (built, "def f(xs):\n    return False\n")], sandbox)
    assert reference.pass_rate == 1.0 and constant.pass_rate <= 0.75


def test_random_tests_of_a_dominant_output_are_dropped_down_to_the_majority_share():
    """12 tests, 10 expecting False (2 of them from the dataset, 8 random) and 2 True: random False
    tests go, the last first, until False holds at most 60%: 3 False of 5 (the dataset's 2 and the
    first random one), 0.6 for a constant where it was 10/12."""
    from rftgym.envs.code.tcg import _rebalanced

    task = CodeTask("t-skew", "unit", "function", "", "f", "def f(x):\n    return x == 7\n")
    false, true = '["b",false]', '["b",true]'
    tests = (TestCase("(1,)", false, "dataset"), TestCase("(7,)", true, "dataset"), TestCase("(2,)", false, "dataset"),
             *(TestCase(f"({n},)", false, "random") for n in range(10, 18)), TestCase("(7.0,)", true, "random"))
    kept = _rebalanced(task, tests)
    assert [t.input for t in kept] == ["(1,)", "(7,)", "(2,)", "(10,)", "(7.0,)"]
    balanced = tests[:3] + (tests[-1],)  # already at most 60% False (2 of 4): kept as it is
    assert _rebalanced(task, balanced) == balanced
    only_dataset = tuple(TestCase(f"({n},)", false, "dataset") for n in range(5)) + (TestCase("(7,)", true, "edge"),)
    assert _rebalanced(task, only_dataset) == only_dataset  # nothing random to drop


def test_the_cache_key_follows_the_sandbox_limits_the_reference_ran_under():
    from rftgym.envs.code.sandbox import SandboxLimits

    config = TCGConfig()
    small, large = SandboxLimits(memory_mb=128), SandboxLimits(memory_mb=1024)
    assert cache_key(SQRT, config, large) != cache_key(SQRT, config, small)
    assert cache_key(SQRT, config) == cache_key(SQRT, config, SandboxLimits())


def test_generated_tasks_leave_no_cache_files(tmp_path):
    import gymnasium as gym

    env = gym.make("rftgym/CodeTCG-v0", dataset="generated", tcg=TCGConfig(cache_dir=str(tmp_path), n_random=4))
    try:
        for seed in range(3):
            env.reset(seed=seed)
    finally:
        env.close()
    assert not list(tmp_path.rglob("*.json"))  # each is new: a file per reset would only grow the cache


def test_sources_that_cannot_give_an_input_are_refused():
    with pytest.raises(ConfigError, match=r"cannot hold 'llm': a model's proposed inputs come from "
                                          r"rftgym.envs.code.tcg_llm"):
        TCGConfig(sources=("llm",))
    with pytest.raises(ConfigError, match=r"TCGConfig.sources is empty, so no input is generated"):
        TCGConfig(sources=())
    with pytest.raises(ConfigError, match=r"sources=\('random',\) with n_random=0 generate no input"):
        TCGConfig(sources=("random",), n_random=0)
    assert TCGConfig(sources=("example", "random"), n_random=0).n_random == 0  # the examples give some
