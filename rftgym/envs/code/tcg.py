"""The Test Case Generator (after O1-CODER): inputs from several sources, outputs from the reference.

Inputs come from the spec's examples, the dataset's own tests, type-driven random generation
(or a generated task's own input sampler) and edge cases. The reference solution runs on all of
them in the sandbox, twice (in two processes under two hash seeds, so that output that depends on
string hashing, e.g. a set's order, or on addresses is caught; every graded run uses the default
seed); inputs where it raises, times out or disagrees with itself are dropped. Generated inputs
keep the relations between arguments that every example shows (:mod:`.relations`: ``n ==
len(arr)``, strings of one length, a sentence's shape), mended to hold them or dropped.
Tests are deduplicated by input and capped, example- and dataset-derived tests first.
When one trivial answer passes most of a function's tests (a constant: a predicate that random
inputs almost always make False, a filter they leave empty; or one builtin applied to one
argument, :mod:`.trivial`: ``return items`` where most random rotations come back to the start),
further rounds (up to ``RARE_ROUNDS``) mutate the inputs where it fails
(:func:`~.inputs.neighbour_inputs`) and add the mutants where it still fails, as random tests
ahead of the others; if it still passes too many, random tests it passes are dropped, the last
first, until it passes at most ``MAJORITY_SHARE`` of the suite (the spec's examples, the
dataset's tests and edge cases are never dropped), so that a trivial answer cannot earn more.
Built suites are cached on disk (``$RFTGYM_CACHE`` or ``~/.cache/rftgym``, under ``tcg/``).
LLM-proposed tests live in :mod:`.tcg_llm`.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import platform
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ...core.errors import ConfigError, warn_caller
from ...core.files import replace_text, unexpanded_path
from .harness import RunOutcome, check_per_test_seconds, execute_many, has_property
from .inputs import argument_models, edge_args, neighbour_inputs, parsed_examples, random_args
from .sandbox import DEFAULT_HASH_SEED, Sandbox, SandboxLimits
from .codec import display, encode, encoded_equal
from .parsing import stated_outputs
from .relations import Relation, conform, observed_relations
from .tasks import ORIGINS, CodeTask, TestCase, args_source, parse_args_source
from .trivial import TrivialAnswer, trivial_answers

# 2: inputs slow for the reference are dropped; 3: rare outputs searched for; 4: the second reference
# run under another hash seed (in a warm jail both runs had had its zygote's); 5: several rounds of
# rare-output search, then random tests of the dominant output dropped; 6: inputs kept in the
# examples' domain (no 0, empty value or sign change the examples do not show); 7: one-step trivial
# answers (echo, sorted, len, max, ... of an argument) held down as constants are, and the generated
# rotate, merge_intervals and kth_largest tasks' samplers drawing fewer inputs such an answer passes;
# 8: generated inputs keep the relations between arguments every example shows (.relations), and a
# one-item list or string is an edge only where an example had at most one
CACHE_VERSION = 8
MAJORITY_SHARE = 0.6  # a trivial answer passing more of the suite than this: search for inputs where it fails
RARE_ROUNDS = 3  # rounds of that search, each from the rare-output inputs found so far
REFERENCE_TIME_SHARE = 0.25  # the reference may use at most this share of a test's time limit
ORDER = ("example", "dataset", "llm", "edge", "random")  # what the cap keeps first


@dataclass(frozen=True)
class TCGConfig:
    sources: tuple[str, ...] = ("example", "dataset", "random", "edge")
    n_random: int = 20
    n_edge: int = 10
    max_tests: int = 40
    seed: int = 0
    # The time limit the reference runs under; an input it needs more than REFERENCE_TIME_SHARE of
    # it for is dropped. CodeTCG lowers it to its own per_test_seconds (grading's limit) when that
    # is lower, so that the reference passes every test kept.
    per_test_seconds: float = 2.0
    check_determinism: bool = True
    use_cache: bool = True
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        built_in = tuple(origin for origin in ORIGINS if origin != "llm")
        if isinstance(self.sources, str) or not all(s in ORIGINS for s in self.sources):
            raise ConfigError(f"TCGConfig.sources must be a tuple drawn from {built_in}, got {self.sources!r}")
        if "llm" in self.sources:
            raise ConfigError("TCGConfig.sources cannot hold 'llm': a model's proposed inputs come from "
                              "rftgym.envs.code.tcg_llm (an agent proposing them), not from the built-in generator; "
                              f"draw sources from {built_in}")
        object.__setattr__(self, "sources", tuple(self.sources))
        for name in ("n_random", "n_edge", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"TCGConfig.{name} must be an int >= 0, got {value!r}")
        if isinstance(self.max_tests, bool) or not isinstance(self.max_tests, int) or self.max_tests < 1:
            raise ConfigError(f"TCGConfig.max_tests must be an int >= 1, got {self.max_tests!r}")
        counts = {"random": self.n_random, "edge": self.n_edge}
        if not self.sources:
            raise ConfigError(f"TCGConfig.sources is empty, so no input is generated and every task would be "
                              f"untestable; draw sources from {built_in}")
        if all(counts.get(source) == 0 for source in self.sources):
            raise ConfigError(f"TCGConfig.sources={self.sources} with " + " and ".join(
                f"n_{source}=0" for source in self.sources) + " generate no input, so every task would be "
                "untestable; raise them, or add 'example' or 'dataset' to sources")
        check_per_test_seconds(self.per_test_seconds)  # as grading checks it (TCGConfig's own per_test_seconds)
        for name in ("check_determinism", "use_cache"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"TCGConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if self.cache_dir is not None and (not isinstance(self.cache_dir, (str, os.PathLike))
                                           or not os.fspath(self.cache_dir).strip()):
            raise ConfigError(f"TCGConfig.cache_dir must be a directory's path (or None: $RFTGYM_CACHE or "
                              f"~/.cache/rftgym), got {self.cache_dir!r}")
        if self.cache_dir is not None and unexpanded_path(self.cache_dir):
            raise ConfigError(f"TCGConfig.cache_dir {unexpanded_path(self.cache_dir)}")


# ---------------------------------------------------------------- candidate inputs

def _rng(config: TCGConfig, task: CodeTask, purpose: str = "") -> random.Random:
    digest = hashlib.sha256(f"{config.seed}:{task.task_id}{purpose}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def candidate_inputs(task: CodeTask, config: TCGConfig) -> list[tuple[str, str]]:
    """(input, origin) pairs to try, in priority order, deduplicated by input."""
    rng = _rng(config, task)
    out: list[tuple[str, str]] = []
    if "example" in config.sources:
        out += [(t.input, "example") for t in task.examples]
    if "dataset" in config.sources:
        out += [(t.input, t.origin if t.origin != "example" else "dataset") for t in task.tests if t.origin != "random"]
    # Every input the spec or dataset gives is in the domain: model random inputs on all of them.
    example_inputs = list(dict.fromkeys([t.input for t in task.examples] + [t.input for t in task.tests]))
    if task.input_sampler is not None:
        if "edge" in config.sources and task.style == "function":
            out += [(s, "edge") for s in _function_edges(task, [task.input_sampler(rng) for _ in range(8)], config, rng)]
        if "random" in config.sources:
            out += [(task.input_sampler(rng), "random") for _ in range(config.n_random)]
    elif task.style == "function":
        relations, mending = domain_relations(task), _rng(config, task, ":domain")
        try:
            if "edge" in config.sources:
                out += [(s, "edge") for s in _function_edges(task, example_inputs, config, rng, relations, mending)]
            if "random" in config.sources:
                models = argument_models(task.reference, task.entry_point, example_inputs)
                if models is not None:
                    out += [(s, "random") for s in
                            domain_sources(random_args(models, rng, config.n_random), relations, mending)]
        except OverflowError:  # examples beyond float range (1e308, 10**400): their tests, and no others
            pass
    seen: dict[str, str] = {}
    for source, origin in out:
        seen.setdefault(source, origin)
    return list(seen.items())


def _function_edges(task: CodeTask, inputs: list[str], config: TCGConfig, rng: random.Random,
                    relations: Sequence[Relation] = (), mending: random.Random | None = None) -> list[str]:
    models = argument_models(task.reference, task.entry_point, inputs)
    if not models or config.n_edge == 0:
        return []
    try:
        base = parse_args_source(inputs[0]) if inputs else None
    except (ValueError, SyntaxError):
        base = None
    edges = domain_sources(edge_args(models, base, rng), relations, mending)
    return edges[: config.n_edge]


def domain_relations(task: CodeTask) -> tuple[Relation, ...]:
    """The relations between a function task's arguments that all its examples and dataset tests
    show (none for a generated task, whose own sampler keeps its domain)."""
    if task.style != "function" or task.input_sampler is not None:
        return ()
    examples = parsed_examples(list(dict.fromkeys([t.input for t in task.examples] + [t.input for t in task.tests])))
    try:
        return observed_relations(examples)
    except (ValueError, TypeError, MemoryError, RecursionError):  # values no relation reads (e.g. exotic __eq__)
        return ()


def domain_sources(arguments: Sequence[tuple], relations: Sequence[Relation], rng: random.Random | None) -> list[str]:
    """``arguments`` mended to hold ``relations`` (those that cannot be, dropped), as argument
    lists, deduplicated in order."""
    rng = rng or random.Random(0)
    mended = (args if not relations else conform(args, relations, rng) for args in arguments)
    return list(dict.fromkeys(args_source(args) for args in mended if args is not None))


def in_domain(sources: Sequence[str], relations: Sequence[Relation], rng: random.Random | None) -> list[str]:
    """:func:`domain_sources` of argument lists (one that does not parse is dropped where there are
    relations to keep)."""
    if not relations:
        return list(sources)
    return domain_sources(parsed_examples(list(sources)), relations, rng)


# ---------------------------------------------------------------- cache

def cache_dir(config: TCGConfig) -> Path:
    root = config.cache_dir or os.environ.get("RFTGYM_CACHE") or Path.home() / ".cache" / "rftgym"
    return Path(root) / "tcg"


def cache_key(task: CodeTask, config: TCGConfig, limits: SandboxLimits | None = None) -> str:
    """What a task's tests depend on: the task, the TCG's settings, and where the reference ran
    (the sandbox's limits, under which an input it needs too much memory for is dropped, and the
    Python version, whose behaviour it records)."""
    fields = {k: v for k, v in dataclasses.asdict(config).items() if k not in ("use_cache", "cache_dir")}
    payload = {"v": CACHE_VERSION, "id": task.task_id, "style": task.style, "entry": task.entry_point,
               "reference": task.reference, "setup": task.setup_code, "prompt": task.prompt,
               "examples": [t.input for t in task.examples], "tests": [(t.input, t.origin) for t in task.tests],
               "config": fields, "limits": dataclasses.asdict(limits or SandboxLimits()),
               "python": platform.python_version(),
               # (how outputs compare decides which trivial answers pass, so which tests are kept)
               **({"compare_as": task.compare_as} if task.compare_as != "exact" else {}),
               **({"output_property": task.output_property} if task.output_property else {})}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _cache_read(task: CodeTask, config: TCGConfig, limits: SandboxLimits | None
                ) -> tuple[tuple[TestCase, ...], str | None] | None:
    """The cached tests, and why there are none where there are none (None: not cached)."""
    if not config.use_cache:
        return None
    path = cache_dir(config) / f"{cache_key(task, config, limits)}.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        rows, reason = (data, None) if isinstance(data, list) else (data["tests"], data.get("untestable"))
        return tuple(TestCase(r["input"], r["expected"], r["origin"]) for r in rows), \
            reason if isinstance(reason, str) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None  # missing or unreadable: rebuild


def _cache_write(task: CodeTask, config: TCGConfig, limits: SandboxLimits | None, tests: Sequence[TestCase],
                 untestable: str | None = None) -> None:
    """Tests as a list; no tests with the reason why, which later builds repeat in their warning."""
    if not config.use_cache:
        return
    directory = cache_dir(config)
    rows = [dataclasses.asdict(t) for t in tests]
    try:
        directory.mkdir(parents=True, exist_ok=True)
        replace_text(directory / f"{cache_key(task, config, limits)}.json",
                     json.dumps(rows if rows else {"tests": rows, "untestable": untestable}))
    except OSError:
        pass  # a read-only cache only costs speed


# ---------------------------------------------------------------- building

def _usable(got: str | None, error: str | None, style: str) -> bool:
    if error is not None or got is None:
        return False
    # A repr with an address changes from run to run; such an output cannot be an expectation.
    return not (style == "function" and " at 0x" in got)


def select_tests(task: CodeTask, candidates: list[tuple[str, str]], runs: Sequence[RunOutcome],
                 config: TCGConfig) -> tuple[TestCase, ...]:
    """Keep the inputs on which every reference run agreed without error; order and cap."""
    kept: list[TestCase] = []
    for index, (source, origin) in enumerate(candidates):
        records = [run.records[index] for run in runs]
        first = records[0]
        if not _usable(first.got, first.error, task.style):
            continue
        if any(r.got != first.got or r.error is not None for r in records[1:]):
            continue
        # A test the reference itself barely finishes in time would fail correct candidates
        # whenever the machine is busy: keep only inputs with ample headroom.
        if max(r.seconds for r in records) > REFERENCE_TIME_SHARE * config.per_test_seconds:
            continue
        test = TestCase(source, first.got, origin)
        # Graded by a property: an input whose reference result lacks it is outside the task's
        # domain (HumanEval 32 promises a zero only for an even number of coefficients).
        if task.output_property is not None and not has_property(task, test, first.got, domain=True):
            continue
        kept.append(test)
    kept.sort(key=lambda t: ORDER.index(t.origin))  # stable: source order within an origin
    return tuple(kept[: config.max_tests])


def run_reference_many(tasks: Sequence[CodeTask], inputs: Sequence[Sequence[str]], sandbox: Sandbox,
                       per_test_seconds: float, repeats: int = 1) -> list[list[RunOutcome]]:
    """The reference of each task on its inputs, ``repeats`` times (separate processes, the
    ``r``-th under hash seed ``r``: the first as every graded run, the others different)."""
    jobs = [(task, task.reference, list(ins)) for task, ins in zip(tasks, inputs) for _ in range(repeats)]
    seeds = [DEFAULT_HASH_SEED + r for _ in tasks for r in range(repeats)]
    outcomes = execute_many(jobs, sandbox, per_test_seconds, hash_seeds=seeds)
    return [outcomes[i * repeats:(i + 1) * repeats] for i in range(len(tasks))]


def build_tests_many(tasks: Sequence[CodeTask], config: TCGConfig, sandbox: Sandbox) -> list[CodeTask]:
    """Each task with ``.tests`` filled by the TCG (cached tasks are not rerun)."""
    if not isinstance(config, TCGConfig):
        raise ConfigError(f"config must be a TCGConfig, got {type(config).__name__}")
    out: list[CodeTask | None] = [None] * len(tasks)
    todo: list[int] = []
    for i, task in enumerate(tasks):
        cached = _cache_read(task, config, getattr(sandbox, "limits", None))
        if cached is not None:
            tests, reason = cached
            out[i] = task.with_tests(tests)
            _warn_if_the_dataset_disagrees(task, tests)
            if not tests:
                _warn_untestable(task, f"{reason + '; ' if reason else ''}as found when its tests were built and "
                                       f"cached in {cache_dir(config)}")
        else:
            todo.append(i)
    candidates = {i: candidate_inputs(tasks[i], config) for i in todo}
    repeats = 2 if config.check_determinism else 1
    runs = run_reference_many([tasks[i] for i in todo], [[s for s, _ in candidates[i]] for i in todo], sandbox,
                              config.per_test_seconds, repeats)
    runs_of = dict(zip(todo, runs))  # task index -> its reference runs
    built = {i: select_tests(tasks[i], candidates[i], task_runs, config) for i, task_runs in runs_of.items()}
    complete = {i: all(run.status == "ok" for run in task_runs) for i, task_runs in runs_of.items()}
    # Further rounds, for tasks whose tests one output dominates: inputs near the rare-output ones.
    tried = {i: {source for source, _ in candidates[i]} for i in todo}
    relations = {}  # of the tasks searched, found once
    for round_ in range(1, RARE_ROUNDS + 1):
        near = {}
        for i in todo:
            skewed = _dominant_trivial(tasks[i], built[i])
            if skewed is None:
                continue
            rng = _rng(config, tasks[i], ":neighbours" if round_ == 1 else f":neighbours{round_}")
            relations.setdefault(i, domain_relations(tasks[i]))
            near_inputs = in_domain(neighbour_inputs(skewed[1], rng, config.n_random), relations[i], rng)
            sources = [s for s in near_inputs if s not in tried[i]]
            if sources:
                near[i] = (skewed[0], sources)
                tried[i].update(sources)
        if not near:
            break
        order = list(near)
        runs = run_reference_many([tasks[i] for i in order], [near[i][1] for i in order], sandbox,
                                  config.per_test_seconds, repeats)
        for i, task_runs in zip(order, runs):
            dominant, sources = near[i]
            found = select_tests(tasks[i], [(s, "random") for s in sources], task_runs,
                                 dataclasses.replace(config, max_tests=len(sources)))
            rare = [t for t in found if dominant not in trivial_answers(t, tasks[i].compare_as)]
            kept = [t for t in built[i] if t.origin != "random"] + rare + [t for t in built[i] if t.origin == "random"]
            built[i] = tuple(kept[: config.max_tests])
            complete[i] = complete[i] and all(run.status == "ok" for run in task_runs)
    built = {i: _rebalanced(tasks[i], tests) for i, tests in built.items()}
    for i in todo:
        reason = None if built[i] else untestable_reason(candidates[i], runs_of[i])
        if complete[i]:  # a run cut short by the sandbox is not cached, so a later build retries
            _cache_write(tasks[i], config, getattr(sandbox, "limits", None), built[i], reason)
        out[i] = tasks[i].with_tests(built[i])
        _warn_if_the_dataset_disagrees(tasks[i], built[i])
        if reason is not None:
            _warn_untestable(tasks[i], reason)
    return out  # type: ignore[return-value]


def _warn_untestable(task: CodeTask, reason: str) -> None:
    # Tests are built as the env resets, inside gymnasium's wrappers (warn_caller looks past them).
    warn_caller(f"task {task.task_id}: no tests could be made ({reason}); its episodes end with status "
                "'untestable' and a pass rate of 0")


def stated_and_contradicted(task: CodeTask, tests: Sequence[TestCase]) -> tuple[int, list[tuple[TestCase, object]]]:
    """How many of ``tests`` a literal assert of the task's dataset states an output for
    (``assert f(...) == literal``), and those whose reference output contradicts it, each with the
    stated value."""
    if not (task.dataset_tests or task.challenge_tests) or task.style != "function":
        return 0, []
    stated = stated_outputs("\n".join(filter(None, (task.dataset_tests, task.challenge_tests))), task.entry_point)
    compared = [test for test in tests if test.input in stated and test.expected is not None]
    return len(compared), [(test, stated[test.input]) for test in compared
                           if not encoded_equal(encode(stated[test.input]), test.expected, how=task.compare_as)]


def _warn_if_the_dataset_disagrees(task: CodeTask, tests: Sequence[TestCase]) -> None:
    """Say so when the task's reference returns other values than its dataset's asserts state (a
    dataset row at odds with itself): the tests take the reference's outputs, while the prompt
    shows the dataset's assert, so the model would be graded against what it was shown."""
    _, wrong = stated_and_contradicted(task, tests)
    if not wrong:
        return
    test, value = wrong[0]
    call = f"{task.entry_point}({', '.join(map(repr, parse_args_source(test.input)))})"
    more = f" (and {len(wrong) - 1} more of its asserts)" if len(wrong) > 1 else ""
    warn_caller(f"task {task.task_id}: its dataset asserts {call} == {display(encode(value))}, but its reference "
                f"solution returns {display(test.expected)}{more}; the tests take the reference's outputs while the "
                "prompt shows the dataset's assert. Fix the task's code or its asserts (MBPP: 'code', 'test_list', "
                "'challenge_test_list')")


def untestable_reason(candidates: Sequence[tuple[str, str]], runs: Sequence[RunOutcome]) -> str:
    """Why the reference runs left no test (for a task's data to be fixed or dropped)."""
    if not candidates:
        return "no inputs could be made: its examples and asserts give none whose arguments are literals"
    errors = [record.error for record in runs[0].records if record.error is not None]
    if runs[0].status != "ok" and runs[0].message:
        return f"the reference solution's run failed: {runs[0].message}"
    if len(errors) == len(runs[0].records):
        return f"the reference solution failed on every input ({errors[0].strip().splitlines()[-1]})"
    return "the reference solution's outputs were not usable (they changed between runs, took too long or failed)"


def _dominant_trivial(task: CodeTask, tests: Sequence[TestCase],
                      skip: frozenset = frozenset()) -> tuple[TrivialAnswer, list[tuple]] | None:
    """``(the trivial answer, the arguments of the tests it fails)`` for the trivial answer
    (:func:`~.trivial.trivial_answers`) not in ``skip`` that passes the most of a function's
    tests, over ``MAJORITY_SHARE`` of them, and fails some (one passing them all is the solution,
    or as good as one: the next is taken); else None. Of answers passing equally many, the first
    met wins."""
    if task.style != "function" or len(tests) < 4:
        return None
    answers = [trivial_answers(test, task.compare_as) for test in tests]
    counts = collections.Counter(answer for passing in answers for answer in passing if answer not in skip)
    for dominant, count in counts.most_common():  # ties: first inserted, as answers list them in a fixed order
        if count <= MAJORITY_SHARE * len(tests):
            return None
        bases = []
        for test, passing in zip(tests, answers):
            if dominant not in passing:
                try:
                    bases.append(parse_args_source(test.input))
                except (ValueError, SyntaxError):
                    continue
        if bases:
            return dominant, bases
    return None


def _rebalanced(task: CodeTask, tests: tuple[TestCase, ...]) -> tuple[TestCase, ...]:
    """``tests`` without random tests that a dominant trivial answer passes, the last first, until
    it passes at most ``MAJORITY_SHARE`` of them (or no such random test is left); then the same
    for the next answer that dominates what is left, until none does that random tests can be
    dropped for. A trivial answer then passes at most that share where the rare-output search
    found enough inputs it fails."""
    unreducible: set[TrivialAnswer] = set()  # dominant, with no random test of its own left to drop
    while True:
        skewed = _dominant_trivial(task, tests, frozenset(unreducible))
        if skewed is None:
            return tests
        dominant = skewed[0]
        passes = [dominant in trivial_answers(test, task.compare_as) for test in tests]
        total, count = len(tests), sum(passes)
        dropped = set()
        for index in reversed(range(len(tests))):
            if count <= MAJORITY_SHARE * total:
                break
            if tests[index].origin == "random" and passes[index]:
                dropped.add(index)
                count, total = count - 1, total - 1
        if not dropped:
            unreducible.add(dominant)
            continue
        tests = tuple(t for index, t in enumerate(tests) if index not in dropped)


def build_tests(task: CodeTask, config: TCGConfig | None, sandbox: Sandbox) -> CodeTask:
    """``task`` with ``.tests`` filled by the TCG."""
    return build_tests_many([task], config or TCGConfig(), sandbox)[0]
