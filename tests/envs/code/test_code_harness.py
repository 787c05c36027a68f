"""Codec, comparison and grading in the real sandbox (hand-checked values)."""

from __future__ import annotations

import math

import pytest

from rftgym.envs.code.codec import decode, display, encode, encoded_equal, normalize_stdout, stdout_equal, values_equal
from rftgym.envs.code.harness import check_syntax, grade, grade_many, run_dataset_tests
from rftgym.envs.code.sandbox import Program, make_sandbox
from rftgym.envs.code.tasks import CodeTask, TestCase


@pytest.fixture(scope="module")
def sandbox():
    with make_sandbox() as box:
        yield box


def test_encoding_is_type_tagged():
    assert encode(3) == '["i",3]'
    assert encode(True) == '["b",true]'
    assert encode(None) == '["n"]'
    assert encode((1, "a")) == '["t",[["i",1],["s","a"]]]'
    assert encode([1.5]) == '["l",[["f",1.5]]]'
    assert encode(float("nan")) == '["f","nan"]' and encode(float("-inf")) == '["f","-inf"]'
    assert encode({"k": [1]}) == '["d",[[["s","k"],["l",[["i",1]]]]]]'
    assert encode(object.__new__(type("Weird", (), {"__repr__": lambda self: "W"}))) == '["r","W"]'


@pytest.mark.parametrize("value", [0, -7, 10**30, 2.5, "x\ny", True, None, [1, [2, (3,)]], (1, 2),
                                   {"a": 1, 2: (3,)}, {1, 2}, frozenset({"a"}), {(1, 2): [3]}])
def test_round_trip(value):
    assert decode(encode(value)) == value
    assert type(decode(encode(value))) is type(value)


def test_comparison_follows_python_eq_with_float_tolerance():
    assert values_equal(0.1 + 0.2, 0.3)
    assert values_equal(1e9, 1e9 + 1e-4)            # relative tolerance
    assert not values_equal(1.0, 1.001)
    assert values_equal(float("nan"), float("nan"))
    assert values_equal(2, 2.0) and values_equal(True, 1)   # as Python's ==
    assert not values_equal([1, 2], (1, 2))                 # list != tuple, as Python's ==
    assert not values_equal("1", 1)
    assert values_equal({1, 2}, frozenset({2, 1}))
    assert not values_equal({"a": 1}, {"a": 1, "b": 2})
    assert values_equal({"a": [1.0]}, {"a": [1.0000000001]})
    assert encoded_equal(encode([1, 2]), encode([1, 2])) and not encoded_equal(encode([1]), None)
    assert not encoded_equal(encode(1), "not json")


def test_an_expected_int_is_matched_exactly_and_an_expected_float_within_tolerance():
    """HumanEval's checks compare an int result with ``==``: a float near a big int answer (fib(n)
    times 1 + 5e-7) is wrong, though it is within the float tolerance."""
    assert values_equal(55, 55.0) and values_equal(10**20, 1e20)
    assert not values_equal(55, 55.0000275) and not values_equal(12586269025, 12586269025 * (1 + 5e-7))
    assert values_equal(55.0, 55.0000000275)  # an expected float keeps its tolerance
    assert not values_equal(1, float("nan")) and not values_equal(True, 1.0000001)


def test_values_too_big_for_a_float_are_a_failed_match_not_an_error():
    huge = 10**400
    assert not values_equal(0.5, huge) and not values_equal(huge, 0.5)
    assert not encoded_equal(encode(0.5), encode(huge))
    forged = '["f", ' + str(huge) + ']'  # a record the code under test printed itself
    assert not encoded_equal(encode(0.5), forged) and display(forged).startswith('["f", 1000')


def test_members_that_share_hashes_are_refused_before_a_quadratic_set_is_built():
    """Ints that are multiples of 2**61 - 1 all hash to 0: a reported set of 20,000 of them would
    take the host minutes to rebuild. Such a report matches nothing, and is shown raw."""
    modulus = 2**61 - 1
    members = ",".join(f'["i",{modulus * k}]' for k in range(1, 20_001))  # written out: a set takes minutes
    colliding = f'["set",[{members}]]'
    with pytest.raises(ValueError, match="of which over 64 share hashes"):
        decode(colliding)
    assert not encoded_equal(colliding, colliding)
    assert display(colliding, 40).startswith('["set",[["i",')
    with pytest.raises(ValueError, match="share hashes"):
        decode('["d",[' + ",".join(f'[["i",{modulus * k}],["n"]]' for k in range(1, 5_001)) + "]]")  # dict keys too
    few = {-1, -2, modulus, 2 * modulus}  # honest outputs may share a few hashes
    assert encoded_equal(encode(few), encode(set(few)))


def test_shown_values_and_errors_are_valid_utf8():
    assert display(encode("a\udc80b")) == "'a\\udc80b'"  # repr escapes it
    assert display('["r","a\\udc80b"]') == "a\ufffdb"  # an object's own repr, reported as it was


def test_stdout_normalization():
    assert normalize_stdout("a  \r\nb\n\n\n") == "a\nb"
    assert stdout_equal("1 2\n", "1 2   \n\n") and not stdout_equal("1 2\n", "1  2\n")
    assert display(encode((1, "a"))) == "(1, 'a')"


def test_syntax_error_is_found_on_host():
    assert check_syntax("def f(:\n") is not None
    assert check_syntax("x = 1\n") is None


def test_the_compilers_warnings_about_candidate_code_are_not_shown():
    """`x is 1` and an invalid escape compile with warnings; they are the policy's code's, and are
    not printed into the run's output (nor do they change the caller's warning filters)."""
    import warnings

    code = "def f(x):\n    return x is 1 or '\\d' in str(x)\n"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert check_syntax(code) is None
        filters = list(warnings.filters)
    assert caught == [] and filters[0][0] == "always"
    with warnings.catch_warnings(record=True) as caught:  # the same code, compiled plainly, warns
        warnings.simplefilter("always")
        compile(code, "solution.py", "exec", dont_inherit=True)
    assert caught and all(issubclass(w.category, (SyntaxWarning, DeprecationWarning)) for w in caught)


ADD = CodeTask("t-add", "unit", "function", "add", "add", "def add(a, b):\n    return a + b\n",
               tests=(TestCase("(1, 2)", encode(3), "example"), TestCase("([1], [2])", encode([1, 2]), "random"),
                      TestCase("(0.1, 0.2)", encode(0.30000000000000004), "edge")))
ECHO = CodeTask("t-echo", "unit", "stdio", "echo doubled", None,
                "n = int(input())\nprint(n * 2)\n",
                tests=(TestCase("2\n", "4\n", "example"), TestCase("5\n", "10\n", "random")))


def test_grading_function_style(sandbox):
    good = grade(ADD, ADD.reference, sandbox)
    assert (good.status, good.passed, good.total, good.pass_rate) == ("ok", 3, 3, 1.0)
    half = grade(ADD, "def add(a, b):\n    if a == 1:\n        return 3\n    raise ValueError('no')\n", sandbox)
    assert half.status == "ok" and half.passed == 1
    assert half.results[1].error.startswith("ValueError") and not half.results[1].passed
    tupled = grade(ADD, "def add(a, b):\n    r = a + b\n    return tuple(r) if isinstance(r, list) else r\n", sandbox)
    assert [r.passed for r in tupled.results] == [True, False, True]


def test_grading_statuses(sandbox):
    assert grade(ADD, "def add(a, b:\n", sandbox).status == "syntax_error"
    assert grade(ADD, "def plus(a, b):\n    return a + b\n", sandbox).status == "missing_entry_point"
    assert grade(ADD, "import no_such_module_xyz\n", sandbox).status == "import_error"
    looping = grade(ADD, "def add(a, b):\n    while a == 1:\n        pass\n    return a + b\n", sandbox,
                    per_test_seconds=0.3)
    assert looping.status == "ok" and looping.results[0].error.startswith("Timeout") and looping.passed == 2
    dying = grade(ADD, "import os\ndef add(a, b):\n    if a == 0.1:\n        os._exit(3)\n    return a + b\n", sandbox)
    assert dying.status == "crashed" and dying.passed == 2 and "exit code 3" in dying.results[2].error


STUBBORN = {  # code that does not let a test's time limit stop it
    "catches it": "import time\ndef add(a, b):\n    while a == [1]:\n        try:\n            time.sleep(0.2)\n"
                  "        except BaseException:\n            continue\n    return a + b\n",
    "ignores it": "import signal, time\ndef add(a, b):\n    if a == [1]:\n"
                  "        signal.signal(signal.SIGALRM, signal.SIG_IGN)\n        while True:\n"
                  "            time.sleep(0.2)\n    return a + b\n",
}


@pytest.mark.parametrize("how", sorted(STUBBORN))
def test_a_test_that_will_not_stop_at_its_limit_ends_the_run_not_the_sandbox(sandbox, how):
    graded = grade(ADD, STUBBORN[how], sandbox, per_test_seconds=0.3)
    # The supervisor stops the test half a second past its limit, and the next test runs in a new
    # process: the sandbox's own (whole-run) limit is not hit.
    assert graded.status == "ok", graded
    assert [r.passed for r in graded.results] == [True, False, True]
    assert "did not stop at its time limit" in graded.results[1].error


# Code that lets the limit pass, then gives the right answer within the grace the supervisor allows.
LATE_BUT_RIGHT = {
    "catches it": "import time\ndef add(a, b):\n    if a == [1]:\n        try:\n            while True:\n"
                  "                time.sleep(0.05)\n        except BaseException:\n            pass\n"
                  "    return a + b\n",
    "catches it, then fails": "import time\ndef add(a, b):\n    if a == [1]:\n        try:\n            while True:\n"
                              "                time.sleep(0.05)\n        except BaseException:\n"
                              "            raise ValueError('late')\n    return a + b\n",
    "ignores it": "import signal, time\ndef add(a, b):\n    if a == [1]:\n"
                  "        signal.signal(signal.SIGALRM, signal.SIG_IGN)\n        time.sleep(0.5)\n    return a + b\n",
}


@pytest.mark.parametrize("how", sorted(LATE_BUT_RIGHT))
def test_a_result_that_comes_past_the_limit_is_a_timeout(sandbox, how):
    graded = grade(ADD, LATE_BUT_RIGHT[how], sandbox, per_test_seconds=0.3)
    assert graded.status == "ok" and [r.passed for r in graded.results] == [True, False, True], graded
    assert graded.results[1].error.startswith("Timeout"), graded


def test_an_input_that_fails_after_a_timeout_is_its_own_error_not_another_timeout(sandbox):
    # The alarm's flag is the last test's until the next call begins.
    task = CodeTask("t-inputs", "unit", "function", "add", "add", ADD.reference,
                    tests=(TestCase("(1, 2)", encode(3), "example"), TestCase("(nosuchname, 2)", encode(0), "random"),
                           TestCase("(2, 2)", encode(4), "random")))
    looping = "def add(a, b):\n    while a == 1:\n        pass\n    return a + b\n"
    graded = grade(task, looping, sandbox, per_test_seconds=0.3)
    assert [r.error.split(":")[0] if r.error else None for r in graded.results] == ["Timeout", "NameError", None]


def test_a_stdio_program_that_ignores_its_limit_and_then_answers_is_a_timeout(sandbox):
    late = "import signal, time\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\nn = int(input())\n" \
           "time.sleep(0.5 if n == 5 else 0)\nprint(n * 2)\n"
    graded = grade(ECHO, late, sandbox, per_test_seconds=0.3)
    assert [r.passed for r in graded.results] == [True, False] and graded.results[1].error.startswith("Timeout"), graded


def test_a_result_whose_repr_never_ends_is_stopped(sandbox):
    looping = ("class Forever:\n    def __repr__(self):\n        while True:\n            pass\n"
               "def add(a, b):\n    return Forever() if a == [1] else a + b\n")
    graded = grade(ADD, looping, sandbox, per_test_seconds=0.3)
    assert graded.status == "ok" and [r.passed for r in graded.results] == [True, False, True], graded
    assert "did not stop at its time limit" in graded.results[1].error


# Code that stops its own time limit from working: the runner's alarm switched off from inside
# (the candidate shares the process the alarm lives in), or a loop in C, where no handler runs.
OUTSIDE_THE_ALARM = {
    "switches it off": "import __main__, time\n__main__._arm = lambda seconds, report: None\n"
                       "def add(a, b):\n    if a == [1]:\n        time.sleep(1.5)\n    return a + b\n",
    "loops in C": "def add(a, b):\n    if a == [1]:\n        any(iter(int, 1))\n    return a + b\n",
}


@pytest.mark.parametrize("how", sorted(OUTSIDE_THE_ALARM))
def test_a_test_is_stopped_at_its_limit_whatever_its_code_does_to_the_alarm(sandbox, how):
    graded = grade(ADD, OUTSIDE_THE_ALARM[how], sandbox, per_test_seconds=0.3)
    assert graded.status == "ok" and [r.passed for r in graded.results] == [True, False, True], graded
    assert graded.results[1].error.startswith("Timeout") and graded.results[1].seconds < 1.5


def test_stopping_the_supervisor_to_run_on_unwatched_gains_nothing(sandbox):
    # The supervisor runs as the same user: the child can stop it (SIGSTOP) while a slow test runs
    # on, then continue it. What the child sent meanwhile cannot be timed, so it does not count.
    stopper = ("import __main__, os, signal, time\n__main__._arm = lambda seconds, report: None\n"
               "def add(a, b):\n    if a == [1]:\n        os.kill(os.getppid(), signal.SIGSTOP)\n"
               "        time.sleep(1.5)\n        os.kill(os.getppid(), signal.SIGCONT)\n    return a + b\n")
    graded = grade(ADD, stopper, sandbox, per_test_seconds=0.3)
    # Only the stopped test is sure to fail: on a busy machine the child may stop the supervisor
    # before it has read the earlier records, which are then dropped too (they cannot be told from
    # records sent while it was stopped), and the test after it may be cut by the run's wall limit.
    assert not graded.results[1].passed, graded


def test_a_run_whose_supervisor_stays_stopped_ends_when_it_goes_quiet():
    from rftgym.envs.code.harness import parse_run, run_limits
    from rftgym.envs.code.sandbox import ExecResult, SandboxLimits

    # 60 tests of 1 s: 65 s of wall time in all, but never over 11 s between two reports
    limits = run_limits(SandboxLimits(), 60, 1.0)
    assert limits.wall_seconds == 65.0 and limits.quiet_seconds == 3.0 + 2 * (2.0 + 1.0 + 1.0)
    marker = "@@M@@"
    reported = marker + '{"i":0,"got":"1","error":null,"message":null,"s":0.1}' + marker + "\n"
    quiet = ExecResult(exit_code=None, signal=9, stdout=reported, stderr="", timed_out=True, output_truncated=False,
                       wall_seconds=11.0, limit_hit="quiet")
    outcome = parse_run(quiet, marker, 3)
    assert outcome.status == "timeout" and outcome.records[0].got == "1"
    assert outcome.records[2].error == "the runner sent no report for too long (its supervisor was stopped)"


def test_a_stdio_exit_handler_past_the_limit_is_a_timeout(sandbox):
    slow = "import atexit, time\nn = int(input())\natexit.register(lambda: (time.sleep(1.5 if n == 5 else 0), print(n * 2)))\n"
    graded = grade(ECHO, slow, sandbox, per_test_seconds=0.3)
    assert [r.passed for r in graded.results] == [True, False] and graded.results[1].error.startswith("Timeout"), graded


def test_a_candidate_killed_by_a_signal_is_reported_as_that(sandbox):
    graded = grade(ADD, "import os, signal\ndef add(a, b):\n    if a == [1]:\n        os.kill(os.getpid(), signal.SIGKILL)\n"
                        "    return a + b\n", sandbox)
    assert graded.status == "crashed" and graded.passed == 1, graded
    assert "signal 9" in graded.results[1].error and "OSError" not in graded.results[1].error


def test_a_stdio_program_cannot_switch_its_limit_off(sandbox):
    slow = ("import __main__, time\n__main__._arm = lambda seconds, report: None\nn = int(input())\n"
            "time.sleep(1.5 if n == 5 else 0)\nprint(n * 2)\n")
    graded = grade(ECHO, slow, sandbox, per_test_seconds=0.3)
    assert [r.passed for r in graded.results] == [True, False] and graded.results[1].error.startswith("Timeout")


def test_after_max_timeouts_the_rest_is_skipped_also_when_the_code_defeats_the_alarm(sandbox):
    looping = "def add(a, b):\n    any(iter(int, 1))\n"
    graded = grade(ADD, looping, sandbox, per_test_seconds=0.2, max_timeouts=2)
    errors = [r.error.split(":")[0] for r in graded.results]
    assert errors == ["Timeout", "Timeout", "Skipped"], graded


def test_the_candidate_cannot_write_records_the_host_accepts(sandbox):
    # At its last test, records for the earlier ones with the right answers, through the runner's
    # own functions (the candidate shares the child's process): the host keeps the last record of
    # a test, but the supervisor passes on each test's first record only, in order.
    forger = ("import __main__, json\n"
              "def add(a, b):\n"
              "    if a == 0.1:\n"
              "        for i, got in enumerate(['[\"i\",3]', '[\"l\",[[\"i\",1],[\"i\",2]]]']):\n"
              "            __main__._emit({'i': i, 'got': got, 'error': None, 'message': None, 's': 0.0})\n"
              "    return None\n")
    graded = grade(ADD, forger, sandbox)
    assert graded.status == "ok" and graded.passed == 0, graded


def test_the_watchdog_needs_no_room_for_a_thread():
    from dataclasses import replace

    from rftgym.envs.code.harness import execute_many

    with make_sandbox() as box:  # one process allowed: the watchdog's thread cannot start, the alarms still work
        limits = replace(box.limits, processes=1)
        with make_sandbox(limits=limits, workers=1) as single:
            outcome = execute_many([(ADD, ADD.reference, [t.input for t in ADD.tests])], single)[0]
    assert outcome.status == "ok" and all(r.error is None for r in outcome.records), outcome


def test_module_code_that_will_not_stop_at_its_limit_is_an_import_timeout(sandbox):
    stubborn = "import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\nwhile True:\n    pass\n"
    graded = grade(ADD, stubborn, sandbox, per_test_seconds=0.3)
    assert graded.status == "import_error" and "did not stop at its time limit" in graded.results[0].error, graded


def test_candidate_prints_do_not_break_reports_and_cannot_fake_eq(sandbox):
    noisy = "import sys\ndef add(a, b):\n    print('@@', a)\n    sys.stderr.write('x' * 10)\n    return a + b\n"
    assert grade(ADD, noisy, sandbox).passed == 3
    cheat = ("class Any:\n    def __eq__(self, other):\n        return True\n"
             "def add(a, b):\n    return Any()\n")
    assert grade(ADD, cheat, sandbox).passed == 0


def test_expected_outputs_never_enter_the_sandbox():
    from rftgym.envs.code.harness import build_program

    program, marker = build_program(ADD, ADD.reference, [t.input for t in ADD.tests])
    blob = "".join(program.files.values())
    assert '["l",[["i",1],["i",2]]]' not in blob and "0.30000000000000004" not in blob and marker in blob


def test_grading_stdio_style(sandbox):
    assert grade(ECHO, ECHO.reference, sandbox).passed == 2
    raw = "import os, sys\ndata = sys.stdin.buffer.read()\nos.write(1, str(int(data) * 2).encode() + b'\\n')\n"
    assert grade(ECHO, raw, sandbox).passed == 2
    via_open = "print(2 * int(open(0).read()))\n"
    assert grade(ECHO, via_open, sandbox).passed == 2
    wrong = grade(ECHO, "print(4)\n", sandbox)
    assert [r.passed for r in wrong.results] == [True, False] and wrong.results[1].got == "4\n"
    exits = grade(ECHO, "import sys\nsys.exit(1)\n", sandbox)
    assert exits.passed == 0 and exits.results[0].error.startswith("SystemExit")


@pytest.mark.parametrize("ending", [
    # main in a thread (for a larger stack), never joined: the program's end waits for it
    "import threading\nthreading.stack_size(1 << 26)\ndef main():\n    n = int(input())\n    print(n * 2)\n"
    "threading.Thread(target=main).start()\n",
    # output flushed, then os._exit: the test ends, the runner goes on to the next one
    "import os, sys\nprint(int(input()) * 2)\nsys.stdout.flush()\nos._exit(0)\n",
    # output written by an exit handler
    "import atexit\nn = int(input())\natexit.register(lambda: print(n * 2))\n",
    # sys.exit(0) with a thread still to finish
    "import sys, threading, time\nn = int(input())\n"
    "threading.Thread(target=lambda: (time.sleep(0.05), print(n * 2))).start()\nsys.exit(0)\n",
    # a forked process that leaves with os._exit: the real one there
    "import os\nn = int(input())\npid = os.fork()\nif pid == 0:\n    os._exit(0)\nos.waitpid(pid, 0)\nprint(n * 2)\n",
    # a thread pool never shut down (its idle workers are woken at the end, as Python does), in every test
    "from concurrent.futures import ThreadPoolExecutor\npool = ThreadPoolExecutor(2)\n"
    "print(sum(pool.map(int, [input(), input() if False else '0'])) * 2)\n",
])
def test_a_stdio_program_ends_as_a_python_program_would(sandbox, ending):
    result = grade(ECHO, ending, sandbox)
    assert result.passed == 2, [(r.got, r.error) for r in result.results]


def test_a_stdio_os_exit_status_is_a_failure_of_its_test_only(sandbox):
    result = grade(ECHO, "import os\nn = int(input())\nprint(n * 2, flush=True)\nos._exit(3 if n == 5 else 0)\n",
                   sandbox)
    assert [r.passed for r in result.results] == [True, False]
    assert result.results[1].error.startswith("SystemExit") and "3" in result.results[1].error


def test_grade_many_keeps_order_and_needs_expected(sandbox):
    results = grade_many([(ADD, ADD.reference), (ECHO, "print(0)"), (ADD, "x = (")], sandbox)
    assert [r.status for r in results] == ["ok", "ok", "syntax_error"]
    assert [r.passed for r in results] == [3, 0, 0]
    from rftgym.core.errors import ConfigError
    with pytest.raises(ConfigError, match="build_tests"):
        grade(ADD, ADD.reference, sandbox, tests=[TestCase("(1, 1)", None)])


def test_dataset_tests_check(sandbox):
    task = CodeTask("t", "mbpp", "function", "", "add", ADD.reference,
                    dataset_tests="assert add(1, 2) == 3\nassert add(2, 2) == 4")
    assert run_dataset_tests(task, ADD.reference, sandbox).passed is True
    assert run_dataset_tests(task, "def add(a, b):\n    return 3\n", sandbox).passed is False
    assert math.isnan(float("nan"))


@pytest.mark.parametrize("forged", [
    '{"i": 0, "got": "[\\"i\\", 1]", "s": "x"}',            # seconds not a number
    '{"i": 0, "got": "[\\"i\\", 1]", "s": [1]}',
    '{"i": 0, "got": ' + "1" * 5000 + '}',                  # over Python's int-digit limit
    '[' * 100000,                                           # nesting past the recursion limit
    '{"i": 0, "got": "' + '[' * 100000 + '"}',              # a "got" that cannot be decoded
    '{"i": true, "got": "[\\"i\\", 1]"}',                   # a bool is not an index
    '{"i": 0, "got": 7, "error": null}',                    # got must be an encoding (str)
    '{"phase": []}',                                        # a phase that is not a name
    '{"phase": {"import": 1}, "error": [' + '0,' * 10000 + '0]}',
])
def test_forged_or_malformed_records_fail_the_test_and_never_raise(forged):
    """Candidate code shares the runner's process and can print records between the marker:
    whatever it prints, grading does not raise and a forged record cannot pass a test."""
    from rftgym.envs.code.harness import RunRecord, parse_run
    from rftgym.envs.code.sandbox import ExecResult

    marker = "@@M@@"
    stdout = f"{marker}{forged}{marker}\n{marker}" + '{"done": true}' + f"{marker}\n"
    result = ExecResult(exit_code=0, signal=None, stdout=stdout, stderr="", timed_out=False,
                        output_truncated=False, wall_seconds=0.1, limit_hit=None)
    outcome = parse_run(result, marker, 1)
    record = outcome.records[0]
    assert isinstance(record, RunRecord) and isinstance(record.seconds, float)
    task = CodeTask(task_id="t", source="generated", style="function", prompt="", entry_point="f",
                    reference="def f():\n    return 2\n", tests=(TestCase("()", '["i", 2]', "dataset"),))
    from rftgym.envs.code.harness import _compare

    assert not _compare(task, task.tests[0], record).passed


@pytest.mark.parametrize("name, code", [
    ("a writer of its own on fd 1", "out = open(1, 'w', closefd=False)\nn = int(input())\nout.write(str(n * 2) + '\\n')\n"),
    ("sys.__stdout__", "import sys\nn = int(input())\nsys.__stdout__.write(str(n * 2) + '\\n')\n"),
    ("fileinput left reading", "import fileinput\nfor line in fileinput.input():\n    print(int(line) * 2)\n    break\n"),
    # PyRival's FastIO: sys.stdout replaced by a buffer whose flush writes through os, a global
    ("a FastIO stdout", "import os, sys\nfrom io import BytesIO, IOBase\n"
                        "class FastIO(IOBase):\n"
                        "    def __init__(self, file):\n        self._fd = file.fileno(); self.buffer = BytesIO()\n"
                        "    def write(self, s):\n        return self.buffer.write(s.encode())\n"
                        "    def flush(self):\n        os.write(self._fd, self.buffer.getvalue())\n"
                        "        self.buffer.truncate(0); self.buffer.seek(0)\n"
                        "sys.stdout = FastIO(sys.stdout)\nn = int(input())\nprint(n * 2)\n"),
    # print() and a writer of its own: at its end stdout is flushed first, then the writer
    ("print, then a writer of its own", "out = open(1, 'w', closefd=False)\nn = int(input())\n"
                                        "out.write(str(n * 2)[1:] + '\\n')\nprint(str(n * 2)[:1], end='')\n"),
    # a finalizer that uses a global: it runs with its globals there
    ("a finalizer using a global", "import sys\nclass Last:\n    def __del__(self):\n"
                                   "        sys.stdout.write(str(ANSWER) + '\\n')\n"
                                   "ANSWER = int(input()) * 2\nkeep = Last()\n"),
])
def test_a_stdio_test_ends_as_a_program_does(sandbox, name, code):
    """Each stdio test runs in one interpreter after another: what a real program's end does (its
    files flushed as they close, sys.__stdout__ flushed, fileinput closed) must happen at each
    test's end, or its output lands in the next test's, or the next test fails."""
    graded = grade(ECHO, code, sandbox)
    assert graded.passed == graded.total == 2, [(r.got, r.error) for r in graded.results]
    assert sandbox.run(Program({"main.py": code}, stdin="3\n")).stdout == "6\n"  # as a program on its own


def test_a_finalizer_past_the_time_limit_is_a_timeout(sandbox):
    looping = "class Stuck:\n    def __del__(self):\n        while True:\n            pass\nkeep = Stuck()\nprint(int(input()) * 2)\n"
    graded = grade(ECHO, looping, sandbox, per_test_seconds=0.3)
    assert graded.passed == 0 and graded.results[0].error.startswith("Timeout"), [r.error for r in graded.results]
