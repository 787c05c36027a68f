"""Test Case Generator quality: dataset tests alone against dataset + TCG tests, side by side.

What is measured, per dataset (``--dataset humaneval|mbpp|generated``, ``--limit N`` first tasks)
------------------------------------------------------------------------------------------------
* tests per task by origin (example, dataset, edge, random) after the TCG (reference run twice in
  the sandbox, failing/nondeterministic inputs dropped, capped at ``--max-tests``);
* reference pass %: the share of tasks whose reference passes all its tests (must be 100, minus
  tasks left with no tests: "untestable");
* a wrong solution (``return None``) must fail: share of tasks where it does;
* the best constant: per function task, the highest pass rate of ``return C`` for C in
  ``CONSTANTS`` (a reward a policy gets without solving anything), with the dataset's tests alone
  and with the TCG suite: the mean, the tasks where it reaches 0.5 and 0.8, and the most on any
  task; and the same for the best trivial answer, a constant or one builtin applied to one
  argument (``return items``, ``return sorted(items)``, ``return max(nums)``: see
  ``rftgym.envs.code.trivial``);
* mutation score: AST mutants of the reference (see ``rftgym.envs.code.mutants``; at most
  ``--mutants`` per task) rejected by the example/dataset-derived tests alone (the "peer": what a
  dataset ships) against the whole TCG suite (ours);
* length-argument alternatives: on function tasks whose every example and dataset input passes an
  int equal to another argument's length (MBPP's ``f(arr, n)``), the reference made to take that
  int from the length itself (``n = len(arr)``), kept where it passes the dataset's own tests: a
  correct solution, which a suite of in-domain inputs passes whole (one that breaks
  ``n == len(arr)`` grades it wrong; see ``rftgym.envs.code.relations``);
* agreement with the dataset's own tests (HumanEval ``check``, MBPP asserts) for the reference;
  and the dataset's literal asserts (``assert f(...) == value``; MBPP's ``challenge_test_list``
  among them since 2026-12-07, 11 tasks of the full MBPP) whose stated value the tests' expected
  output (the reference's) contradicts, which ``CodeTCGEnv`` warns of.

The last line is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
import time
from pathlib import Path

from rftgym.envs.code.harness import grade_many, run_dataset_tests_many
from rftgym.envs.code.mutants import quality_report, summarize
from rftgym.envs.code.sandbox import make_sandbox
from rftgym.envs.code.tasks import parse_args_source
from rftgym.envs.code.tcg import TCGConfig, build_tests_many, stated_and_contradicted
from rftgym.envs.code.trivial import one_step_programs
from provenance import check_positive, provenance_line

# The shared data folder beside the checkout.
DEFAULT_MBPP = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "code" / "mbpp.jsonl"
CONSTANTS = ("False", "True", "0", "1", "[]", "''", "None")


def best_trivial(tasks, sandbox) -> tuple[list[float], list[float], list[tuple[str, str, float]]]:
    """Per function task with tests: the best pass rate of a function returning a constant, and
    of any trivial answer (a constant, or one builtin on one argument: rftgym.envs.code.trivial);
    and (task id, answer, pass rate) where a trivial answer passes at least 0.8 (on a task whose
    solution is one builtin, e.g. a string's length, that answer is the solution)."""
    tasks = [t for t in tasks if t.style == "function" and t.tests]
    programs = []
    for task in tasks:
        constants = [(f"return {c}", f"def {task.entry_point}(*args, **kwargs):\n    return {c}\n")
                     for c in CONSTANTS]
        programs.append((constants, one_step_programs(task.entry_point, _arity(task))))
    results = iter(grade_many([(t, source) for t, (constants, one_step) in zip(tasks, programs)
                               for _, source in constants + one_step], sandbox))
    best_constant, best_any, high = [], [], []
    for task, (constants, one_step) in zip(tasks, programs):
        rates = [next(results).pass_rate for _ in range(len(constants) + len(one_step))]
        best_constant.append(max(rates[:len(constants)]))
        best_any.append(max(rates))
        top = max(range(len(rates)), key=rates.__getitem__)
        if rates[top] >= 0.8:
            high.append((task.task_id, (constants + one_step)[top][0], rates[top]))
    return best_constant, best_any, high


def length_alternatives(tasks) -> list[tuple[object, str]]:
    """(task, source) for each function task whose every example and dataset input passes an int
    equal to another argument's length: its reference with that int set from the length first."""
    import ast

    out = []
    for task in tasks:
        if task.style != "function":
            continue
        try:
            given = [parse_args_source(t.input) for t in task.tests if t.origin in ("example", "dataset")]
            tree = ast.parse(task.reference)
        except (ValueError, SyntaxError, TypeError):
            continue
        if len(given) < 2 or len({len(args) for args in given}) != 1:
            continue
        pair = next(((n, sized) for n in range(len(given[0])) for sized in range(len(given[0])) if all(
            type(args[n]) is int and isinstance(args[sized], (list, tuple, str)) and args[n] == len(args[sized])
            for args in given)), None)
        function = next((node for node in tree.body if isinstance(node, ast.FunctionDef)
                         and node.name == task.entry_point), None)
        params = [a.arg for a in function.args.posonlyargs + function.args.args] if function else []
        if pair is None or len(params) != len(given[0]):
            continue
        docstring = int(bool(function.body) and isinstance(function.body[0], ast.Expr)
                        and isinstance(function.body[0].value, ast.Constant))
        function.body.insert(docstring, ast.parse(f"{params[pair[0]]} = len({params[pair[1]]})").body[0])
        out.append((task, ast.unparse(tree)))
    return out


def _arity(task) -> int:
    try:
        return len(parse_args_source(task.tests[0].input))
    except (ValueError, SyntaxError):
        return 0


def load(args):
    from rftgym.envs.code import datasets
    from rftgym.envs.code.generator import generate_tasks

    if args.dataset == "humaneval":
        tasks = datasets.load_humaneval()
    elif args.dataset == "mbpp":
        tasks = datasets.load_mbpp(args.path or DEFAULT_MBPP)
    else:
        tasks = generate_tasks(args.limit or 45, seed=args.seed, difficulty=args.difficulty)
    return tasks[: args.limit] if args.limit else tasks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", choices=("humaneval", "mbpp", "generated"), default="mbpp")
    parser.add_argument("--path", default=None, help="MBPP JSONL file")
    parser.add_argument("--limit", type=int, default=None, help="first N tasks only")
    parser.add_argument("--mutants", type=int, default=20, help="max mutants per task")
    parser.add_argument("--max-tests", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--difficulty", type=int, choices=(1, 2, 3), default=2, help="of the generated tasks")
    parser.add_argument("--skip-mutants", action="store_true")
    args = parser.parse_args()
    check_positive(parser, args, "limit", "max_tests")
    print(provenance_line(), flush=True)

    tasks = load(args)
    sandbox = make_sandbox()
    config = TCGConfig(max_tests=args.max_tests, seed=args.seed, cache_dir=tempfile.mkdtemp(prefix="rftgym-tcg-"))
    t0 = time.perf_counter()
    built = build_tests_many(tasks, config, sandbox)
    t_build = time.perf_counter() - t0
    refs = grade_many([(t, t.reference) for t in built], sandbox)
    wrong = grade_many([(t, f"def {t.entry_point}(*args, **kwargs):\n    return None\n" if t.style == "function"
                         else "pass\n") for t in built], sandbox)
    t_grade = time.perf_counter() - t0 - t_build
    dataset_only = [t.with_tests(tuple(x for x in t.tests if x.origin in ("example", "dataset"))) for t in built]
    (constants_dataset, trivial_dataset, _), (constants_tcg, trivial_tcg, trivial_high) = (
        best_trivial(dataset_only, sandbox), best_trivial(built, sandbox))
    constants = {"dataset": constants_dataset, "tcg": constants_tcg}
    trivials = {"dataset": trivial_dataset, "tcg": trivial_tcg}
    ref_fail = [(t.task_id, r.status, r.passed, r.total) for t, r in zip(built, refs) if r.pass_rate < 1.0]
    wrong_pass = [t.task_id for t, r in zip(built, wrong) if r.total and r.pass_rate == 1.0]
    checks = run_dataset_tests_many([(t, t.reference) for t in built], sandbox)
    with_checks = [c for c in checks if c.passed is not None]
    dataset_ok = sum(bool(c.passed) for c in with_checks)
    dataset_fail = [(t.task_id, c.error) for t, c in zip(built, checks) if c.passed is False]
    # Correct solutions that compute a length argument themselves: graded on the whole suite.
    alternatives = length_alternatives(built)
    correct = [(task, source) for (task, source), check in zip(alternatives, run_dataset_tests_many(alternatives, sandbox))
               if check.passed]
    alternatives_pass = {"dataset": sum(r.total > 0 and r.pass_rate == 1.0 for r in grade_many(
        [(t.with_tests(tuple(x for x in t.tests if x.origin in ("example", "dataset"))), s) for t, s in correct],
        sandbox)), "tcg": sum(r.total > 0 and r.pass_rate == 1.0 for r in grade_many(correct, sandbox))}
    # The dataset's literal asserts (assert f(...) == value) against the outputs the tests took from the reference.
    stated = [stated_and_contradicted(t, t.tests) for t in built]
    asserts_compared = sum(count for count, _ in stated)
    contradicted = [(t.task_id, test.input, value) for t, (_, wrong) in zip(built, stated) for test, value in wrong]

    summary = {"tasks": len(built), "tests_per_task": sum(len(t.tests) for t in built) / max(1, len(built))}
    if not args.skip_mutants:
        t1 = time.perf_counter()
        summary = summarize(quality_report(built, sandbox, max_mutants=args.mutants, seed=args.seed))
        summary["mutant_seconds"] = round(time.perf_counter() - t1, 1)
    testable = [r for r in refs if r.total]
    print(f"TCG quality on {args.dataset} ({len(built)} tasks{', first ' + str(args.limit) if args.limit else ''}; "
          f"sandbox: {sandbox.isolation})")
    print(f"{'':44s}{'dataset tests only':>20s}{'dataset + TCG':>16s}")
    # Counted here, not taken from the mutant report: --skip-mutants has none.
    origins = collections.Counter(test.origin for task in built for test in task.tests)
    by_origin = {origin: round(count / max(1, len(built)), 2) for origin, count in sorted(origins.items())}
    dataset_tests = by_origin.get("example", 0) + by_origin.get("dataset", 0)
    print(f"{'tests per task':44s}{dataset_tests:>20.1f}{summary['tests_per_task']:>16.1f}")
    print(f"{'  by origin':44s}{'':>20s}{json.dumps(by_origin):>16s}")
    if "mutation_score_tcg_pct" in summary:
        print(f"{'mutation score % (' + str(summary['mutants']) + ' mutants)':44s}"
              f"{summary['mutation_score_dataset_pct']:>20.1f}{summary['mutation_score_tcg_pct']:>16.1f}")
    print(f"{'reference passes all its tests (testable)':44s}{'':>20s}"
          f"{sum(r.pass_rate == 1.0 for r in testable):>10d}/{len(testable)}")
    print(f"{'untestable (no test input survived)':44s}{'':>20s}{len(built) - len(testable):>16d}")
    print(f"{'return-None solution fails':44s}{'':>20s}{len(testable) - len(wrong_pass):>10d}/{len(testable)}")
    means = {k: sum(v) / max(1, len(v)) for k, v in constants.items()}
    trivial_means = {k: sum(v) / max(1, len(v)) for k, v in trivials.items()}
    for label, best, mean in (("best constant", constants, means), ("best trivial answer", trivials, trivial_means)):
        print(f"{label + ': mean pass rate':44s}{mean['dataset']:>20.3f}{mean['tcg']:>16.3f}")
        for level in (0.5, 0.8):
            print(f"{label + ': tasks passing >= ' + str(level):44s}"
                  f"{sum(b >= level for b in best['dataset']):>14d}/{len(best['dataset'])}"
                  f"{sum(b >= level for b in best['tcg']):>10d}/{len(best['tcg'])}")
        print(f"{label + ': most of any task':44s}{max(best['dataset'], default=0):>20.3f}"
              f"{max(best['tcg'], default=0):>16.3f}")
    print(f"{'length-argument alternatives passing all':44s}{alternatives_pass['dataset']:>14d}/{len(correct)}"
          f"{alternatives_pass['tcg']:>10d}/{len(correct)}")
    print(f"{'reference passes the dataset own tests':44s}{dataset_ok:>14d}/{len(with_checks)}")
    print(f"{'literal dataset asserts the TCG outputs break':44s}{'':>20s}"
          f"{len(contradicted):>10d}/{asserts_compared}")
    print(f"{'seconds: build tests / grade ref+wrong':44s}{t_build:>20.1f}{t_grade:>16.1f}")
    for task_id, status, passed, total in ref_fail:
        print(f"  reference failure: {task_id}: {status} {passed}/{total}")
    for task_id, answer, rate in trivial_high:
        print(f"  trivial answer passing >= 0.8 of the TCG suite: {task_id}: {answer} ({rate:.3f})")
    for task_id, error in dataset_fail:
        print(f"  dataset-test failure: {task_id}: {error}")
    for task_id, source, value in contradicted:
        print(f"  dataset assert contradicted: {task_id}: {source} == {value!r}")
    headline = {"bench": "tcg_quality", "dataset": args.dataset, "tasks": len(built), "limit": args.limit,
                "tests_per_task": round(summary["tests_per_task"], 2),
                "reference_pass_testable": sum(r.pass_rate == 1.0 for r in testable), "testable": len(testable),
                "wrong_fails": len(testable) - len(wrong_pass), "dataset_check_pass": dataset_ok,
                "literal_asserts_compared": asserts_compared, "literal_asserts_contradicted": len(contradicted),
                "length_alternatives": len(correct), "length_alternatives_pass": alternatives_pass,
                "best_constant_mean": {k: round(v, 3) for k, v in means.items()},
                "best_constant_ge_0.8": {k: sum(b >= 0.8 for b in v) for k, v in constants.items()},
                "best_trivial_mean": {k: round(v, 3) for k, v in trivial_means.items()},
                "best_trivial_ge_0.8": {k: sum(b >= 0.8 for b in v) for k, v in trivials.items()},
                "best_trivial_max": {k: round(max(v, default=0), 3) for k, v in trivials.items()},
                "build_seconds": round(t_build, 1)}
    if "mutation_score_tcg_pct" in summary:
        headline.update(mutants=summary["mutants"],
                        peer_mutation_score=round(summary["mutation_score_dataset_pct"], 1),
                        ours_mutation_score=round(summary["mutation_score_tcg_pct"], 1),
                        mutant_seconds=summary["mutant_seconds"])
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
