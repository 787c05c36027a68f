"""Program building and grading: run a candidate against many tests in ONE sandboxed process.

Expected outputs never enter the sandbox: the runner (:mod:`.runner`) reports what each test
returned (function style, type-tagged JSON, see :mod:`.codec`) or printed (stdio style), and the
host compares. A syntax error is found on the host with ``compile()`` and nothing runs.

``GradeResult.status``: ``"ok"`` (every test ran; each passed or failed on its own),
``"syntax_error"``, ``"import_error"`` (defining the code raised or hung), ``"missing_entry_point"``,
``"timeout"`` (the run was stopped by the sandbox's time limit before finishing), ``"crashed"``
(the process died or its output was cut before finishing). Tests that never reported are failed
with the reason in ``error``.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import warnings
from dataclasses import dataclass, replace
from typing import Sequence

from ...core.errors import ConfigError
from ...core.values import valid_text
from .codec import decode, display, encoded_equal, stdout_equal
from .runner import GRACE_SECONDS, runner_source
from .sandbox import DEFAULT_HASH_SEED, ExecResult, Program, Sandbox, SandboxLimits
from .tasks import UNPARSABLE, CodeTask, TestCase, parse_args_source

STATUSES = ("ok", "syntax_error", "import_error", "missing_entry_point", "timeout", "crashed")
BEFORE_TESTS = ("syntax_error", "import_error", "missing_entry_point")  # the code failed before any test ran
PER_TEST_SECONDS = 2.0
MAX_TOTAL_SECONDS = 120.0
# A run gives up its remaining tests after this many of them hit the per-test time limit, so that
# a looping program costs a few seconds, not a time limit per test (CodeTCG's default and its scorer's).
DEFAULT_MAX_TIMEOUTS = 3
MAX_GOT_CHARS = 1_000_000  # the runner's own cap on one encoded return value
REPORT_BYTES_PER_TEST = 256 * 1024
MAX_RUN_OUTPUT_BYTES = 64 * 1024 * 1024
_SHOWN = 2000  # chars of expected/got kept for display


@dataclass(frozen=True)
class TestResult:
    """One graded test. ``expected``/``got`` are readable (a repr for function style, the stdout
    text for stdio); ``got_encoded`` is the raw report."""

    __test__ = False

    input: str
    expected: str
    got: str | None
    error: str | None
    seconds: float
    passed: bool
    origin: str
    got_encoded: str | None = None


@dataclass(frozen=True)
class GradeResult:
    status: str
    passed: int
    total: int
    results: tuple[TestResult, ...]
    message: str | None = None  # what went wrong before the tests (syntax error, import error)

    @property
    def pass_rate(self) -> float:
        return self.passed / self.total if self.total else 0.0


@dataclass(frozen=True)
class RunRecord:
    """What the runner reported for one input (``got`` None if the test did not finish)."""

    got: str | None
    error: str | None
    seconds: float


@dataclass(frozen=True)
class RunOutcome:
    status: str
    records: tuple[RunRecord, ...]
    message: str | None = None


# ---------------------------------------------------------------- building and running

def check_syntax(code: str) -> str | None:
    """The syntax error in ``code`` as one line, or None; nothing is run. The compiler's warnings
    about the candidate's code (``x is 1``, an invalid escape such as ``'\\d'``) are not shown:
    they are the policy's, and would otherwise print in the middle of a run's output."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)
            warnings.simplefilter("ignore", DeprecationWarning)  # Python 3.11's invalid escapes
            compile(code, "solution.py", "exec", dont_inherit=True)
    except UNPARSABLE as exc:
        if isinstance(exc, (RecursionError, MemoryError)):  # "1+1+...+1" thousands long
            return f"{type(exc).__name__}: the code nests too deeply for Python to compile it"
        line = getattr(exc, "lineno", None)  # (a ValueError: a NUL byte)
        return f"{type(exc).__name__}: {getattr(exc, 'msg', str(exc))}" + (f" (line {line})" if line else "")
    return None


def build_program(task: CodeTask, code: str, inputs: Sequence[str], limits: SandboxLimits | None = None,
                  per_test_seconds: float = PER_TEST_SECONDS, max_timeouts: int | None = None, *,
                  hash_seed: int = DEFAULT_HASH_SEED) -> tuple[Program, str]:
    """One Program running ``code`` on every input, and its random marker."""
    marker = "@@RFT-" + secrets.token_hex(12) + "@@"
    config = {"style": task.style, "code": code, "setup": task.setup_code or "", "entry": task.entry_point,
              "inputs": list(inputs), "per_test": float(per_test_seconds),
              "import_seconds": import_seconds(per_test_seconds), "max_timeouts": max_timeouts}
    files = {"main.py": runner_source(marker), "tests.json": json.dumps(config)}
    return Program(files=files, argv=("python", "main.py"), stdin="", limits=limits, hash_seed=hash_seed), marker


def check_max_timeouts(value) -> None:
    """Refuse a ``max_timeouts`` that is neither a positive int nor None (every test runs)."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ConfigError(f"max_timeouts must be a positive int or None (run every test), got {value!r}",
                          field="max_timeouts")


def check_per_test_seconds(per_test_seconds) -> None:
    if isinstance(per_test_seconds, bool) or not isinstance(per_test_seconds, (int, float)) \
            or not 0.01 <= per_test_seconds <= MAX_TOTAL_SECONDS:
        raise ConfigError(f"per_test_seconds must be a number in [0.01, {MAX_TOTAL_SECONDS:g}] (each test's time "
                          f"limit), got {per_test_seconds!r}", field="per_test_seconds")


def import_seconds(per_test_seconds: float) -> float:
    """How long the runner gives the candidate's code to be defined."""
    return max(2.0, 2 * float(per_test_seconds))


def run_limits(base: SandboxLimits, n_tests: int, per_test_seconds: float,
               max_total_seconds: float = MAX_TOTAL_SECONDS) -> SandboxLimits:
    """The sandbox limits for one run of ``n_tests``: enough wall/CPU time for all of them."""
    budget = min(max_total_seconds, 3.0 + 2 * float(per_test_seconds) + n_tests * float(per_test_seconds))
    budget = max(budget, base.wall_seconds)
    # Every test's report shares one stdout: leave room for a fair-sized value per test, so that
    # a correct solution with big outputs is not cut off as "crashed".
    output = max(base.output_bytes, min(n_tests * REPORT_BYTES_PER_TEST, MAX_RUN_OUTPUT_BYTES))
    # The runner reports each test as it ends; between two reports its supervisor waits at most a
    # definition of the code (after a child it had to kill) and a test, each with its grace. A run
    # quiet for twice that (and a start-up's 3 s) has a supervisor that is not running: the
    # candidate, as the same user, can stop it (SIGSTOP) and never let it go on.
    longest_gap = import_seconds(per_test_seconds) + float(per_test_seconds) + 2 * GRACE_SECONDS
    return replace(base, wall_seconds=budget, cpu_seconds=max(base.cpu_seconds, budget), output_bytes=output,
                   quiet_seconds=3.0 + 2 * longest_gap)


def parse_run(result: ExecResult, marker: str, n_inputs: int) -> RunOutcome:
    """Decode the runner's records; tests that never reported get the reason as their error."""
    records: dict[int, RunRecord] = {}
    status, message, done = "ok", None, False
    for chunk in re.findall(re.escape(marker) + r"(.*?)" + re.escape(marker), result.stdout):
        # The candidate runs in the runner's process and can emit records itself: a malformed one
        # (huge ints, deep nesting, wrong types) is dropped, never an exception in the trainer.
        try:
            record = json.loads(chunk)
        except (ValueError, RecursionError):
            continue
        if not isinstance(record, dict):
            continue
        if record.get("done") is True:
            done = True
        elif "phase" in record:
            phase = record["phase"] if isinstance(record["phase"], str) else "fatal"
            status = {"import": "import_error", "entry": "missing_entry_point"}.get(phase, "crashed")
            message = valid_text(f"{str(record.get('error'))[:500]}: {str(record.get('message'))[:500]}")
            done = True
        elif type(record.get("i")) is int and 0 <= record["i"] < n_inputs:
            records[record["i"]] = _test_record(record)
    if not done:
        if result.limit_hit == "quiet":
            status, reason = "timeout", "the runner sent no report for too long (its supervisor was stopped)"
        elif result.timed_out or result.limit_hit in ("wall", "cpu"):
            status, reason = "timeout", f"the run hit the sandbox time limit ({result.limit_hit or 'wall'})"
        else:
            why = result.limit_hit or (f"signal {result.signal}" if result.signal else f"exit code {result.exit_code}")
            status, reason = "crashed", f"the process stopped before this test finished ({why})"
        stderr = f"; stderr: {valid_text(result.stderr[-300:])}" if result.stderr.strip() else ""
        message = message or reason + stderr
    missing = RunRecord(None, message or "not run", 0.0)
    return RunOutcome(status, tuple(records.get(i, missing) for i in range(n_inputs)), message)


def _test_record(record: dict) -> RunRecord:
    """One test's record, with every field checked (anything else reads as a failed test)."""
    got = record.get("got")
    if not isinstance(got, str) or len(got) > MAX_GOT_CHARS:
        got = None
    error, message = record.get("error"), record.get("message")
    if error is not None:  # the candidate's own text (an exception's message): made valid UTF-8
        error = valid_text(str(error)[:500] + (f": {str(message)[:500]}" if message else ""))
    elif got is None:
        error = "no valid result was reported"
    seconds = record.get("s")
    if type(seconds) not in (int, float) or not math.isfinite(seconds) or seconds < 0:
        seconds = 0.0
    return RunRecord(got, error, float(seconds))


def execute_many(jobs: Sequence[tuple[CodeTask, str, Sequence[str]]], sandbox: Sandbox,
                 per_test_seconds: float = PER_TEST_SECONDS, max_timeouts: int | None = None,
                 hash_seeds: Sequence[int] | None = None) -> list[RunOutcome]:
    """Run each ``(task, code, inputs)`` in one program, all programs concurrently. With
    ``max_timeouts``, a run skips its remaining tests after that many per-test timeouts; with
    ``hash_seeds`` (one per job), each program runs under its own ``PYTHONHASHSEED``."""
    check_per_test_seconds(per_test_seconds)
    outcomes: list[RunOutcome | None] = [None] * len(jobs)
    programs, where = [], []
    for index, (task, code, inputs) in enumerate(jobs):
        syntax = check_syntax(code)
        if syntax is not None:
            outcomes[index] = RunOutcome("syntax_error", tuple(RunRecord(None, syntax, 0.0) for _ in inputs), syntax)
            continue
        limits = run_limits(sandbox.limits, len(inputs), per_test_seconds)
        program, marker = build_program(task, code, inputs, limits, per_test_seconds, max_timeouts,
                                        hash_seed=DEFAULT_HASH_SEED if hash_seeds is None else hash_seeds[index])
        programs.append(program)
        where.append((index, marker, len(inputs)))
    for (index, marker, n), result in zip(where, sandbox.run_many(programs)):
        outcomes[index] = parse_run(result, marker, n)
    return outcomes  # type: ignore[return-value]


# ---------------------------------------------------------------- grading

def has_property(task: CodeTask, test: TestCase, got: str | None, domain: bool = False) -> bool:
    """Whether the encoded result ``got`` of ``test`` has the task's ``output_property`` (with
    ``domain``: and ``test``'s input is one the property is promised for)."""
    from .comparison import DOMAINS, PROPERTIES

    if got is None:
        return False
    try:
        args, name = parse_args_source(test.input), task.output_property
        return (not domain or DOMAINS[name](args)) and PROPERTIES[name](args, decode(got))
    except (ValueError, TypeError, KeyError, IndexError, SyntaxError, RecursionError, OverflowError, MemoryError):
        return False


def _compare(task: CodeTask, test: TestCase, record: RunRecord) -> TestResult:
    if test.expected is None:
        raise ConfigError(f"task {task.task_id}: a test has no expected output; build the tests first: "
                          "task = rftgym.envs.code.tcg.build_tests(task, TCGConfig(), sandbox) (it returns the task "
                          "with its tests), then grade(task, code, sandbox)")
    if task.style == "function":
        passed = record.error is None and (encoded_equal(test.expected, record.got, how=task.compare_as)
                                           if task.output_property is None else has_property(task, test, record.got))
        expected, got = display(test.expected, _SHOWN), None if record.got is None else display(record.got, _SHOWN)
    else:
        passed = record.error is None and stdout_equal(test.expected, record.got)
        expected, got = test.expected[:_SHOWN], None if record.got is None else valid_text(record.got[:_SHOWN])
    return TestResult(test.input, expected, got, record.error, record.seconds, passed, test.origin, record.got)


def grade_many(items: Sequence[tuple[CodeTask, str] | tuple[CodeTask, str, Sequence[TestCase] | None]],
               sandbox: Sandbox, per_test_seconds: float = PER_TEST_SECONDS,
               max_timeouts: int | None = None) -> list[GradeResult]:
    """Grade many ``(task, code[, tests])`` at once; tests default to ``task.tests``. With
    ``max_timeouts`` a run gives up (failing the remaining tests) after that many timeouts."""
    jobs, suites = [], []
    for item in items:
        task, code = item[0], item[1]
        tests = tuple(item[2]) if len(item) > 2 and item[2] is not None else task.tests
        for test in tests:
            if test.expected is None:
                _compare(task, test, RunRecord(None, None, 0.0))  # raises the helpful error
        suites.append(tests)
        jobs.append((task, code, [t.input for t in tests]))
    results = []
    for (task, _, _), tests, outcome in zip(jobs, suites, execute_many(jobs, sandbox, per_test_seconds, max_timeouts)):
        graded = tuple(_compare(task, t, r) for t, r in zip(tests, outcome.records))
        results.append(GradeResult(outcome.status, sum(r.passed for r in graded), len(graded), graded, outcome.message))
    return results


def grade(task: CodeTask, code: str, sandbox: Sandbox, tests: Sequence[TestCase] | None = None,
          per_test_seconds: float = PER_TEST_SECONDS, max_timeouts: int | None = None) -> GradeResult:
    """Grade ``code`` on ``tests`` (default ``task.tests``) in one sandboxed run."""
    return grade_many([(task, code, tests)], sandbox, per_test_seconds, max_timeouts)[0]


# ---------------------------------------------------------------- the dataset's own tests

@dataclass(frozen=True)
class DatasetCheck:
    """Whether ``code`` passes the dataset's original assert/check code.

    The check runs in the code's own process, as HumanEval's and MBPP's harnesses run it, so code
    written to cheat can fake a pass (print the marker it can read, then exit): a yardstick for
    the TCG's tests (``benchmarks/tcg_quality.py``), never a reward."""

    passed: bool | None  # None: the task has no dataset tests
    error: str | None


def dataset_check_program(task: CodeTask, code: str, limits: SandboxLimits | None = None
                          ) -> tuple[Program, str] | None:
    if not task.dataset_tests:
        return None
    marker = "@@RFT-OK-" + secrets.token_hex(12) + "@@"
    parts = [task.setup_code or "", code, task.dataset_tests]
    if task.source == "humaneval":
        parts.append(f"check({task.entry_point})")
    source = "\n\n".join(parts) + f"\nprint({marker!r})\n"
    return Program(files={"main.py": source}, argv=("python", "main.py"), limits=limits), marker


def run_dataset_tests_many(items: Sequence[tuple[CodeTask, str]], sandbox: Sandbox,
                           limits: SandboxLimits | None = None) -> list[DatasetCheck]:
    """Run the dataset's own tests (HumanEval's ``check(candidate)``, MBPP's asserts) for each item."""
    checks: list[DatasetCheck | None] = [None] * len(items)
    programs, where = [], []
    for index, (task, code) in enumerate(items):
        syntax = check_syntax(code)
        built = dataset_check_program(task, code, limits)
        if built is None:
            checks[index] = DatasetCheck(None, "no dataset tests")
        elif syntax:
            checks[index] = DatasetCheck(False, syntax)
        else:
            programs.append(built[0])
            where.append((index, built[1]))
    for (index, marker), result in zip(where, sandbox.run_many(programs)):
        ok = result.ok and marker in result.stdout
        tail = result.stderr.strip().splitlines()[-1:] if result.stderr.strip() else []
        checks[index] = DatasetCheck(ok, None if ok else (tail[0] if tail else f"limit {result.limit_hit}"))
    return checks  # type: ignore[return-value]


def run_dataset_tests(task: CodeTask, code: str, sandbox: Sandbox) -> DatasetCheck:
    return run_dataset_tests_many([(task, code)], sandbox)[0]
