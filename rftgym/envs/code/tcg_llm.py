"""LLM-proposed tests (O1-CODER's TCG prompt): an agent writes inputs, the reference validates them.

The agent is asked for ``n`` diverse inputs: function calls, one per line, in a ```python block
(function style) or one fenced block of stdin per input (stdio style). Every proposal is run
through the reference in the sandbox; proposals it rejects (error, timeout, nondeterminism) or
that repeat are dropped. Kept tests have origin ``"llm"`` and their expected output is the
reference's, never the agent's.
"""

from __future__ import annotations

import random
import re
from typing import Sequence

from ...agents.base import Agent, replies_with_room
from ...core.messages import Context, Message
from .parsing import example_calls
from .sandbox import Sandbox
from .tasks import CodeTask, TestCase
from .tcg import ORDER, TCGConfig, domain_relations, in_domain, run_reference_many, select_tests

_FENCE = re.compile(r"```[ \t]*([\w+-]*)[ \t]*\n(.*?)```", re.DOTALL)


def tcg_prompt(task: CodeTask, n: int) -> str:
    """The test-generation instruction for ``task`` (spec, signature or I/O contract, examples)."""
    if task.style == "function":
        how = (f"Write {n} diverse test inputs for the function `{task.entry_point}`: typical cases, edge cases "
               "(empty, zero, one element, boundaries) and tricky cases, all valid for the specification. "
               f"Put them in one ```python code block, one call per line, like {task.entry_point}(...). "
               "Write only the calls, not the expected results.")
    else:
        how = (f"Write {n} diverse valid inputs for this program: typical, edge and tricky cases. Give each input "
               "as the exact standard-input text in its own ```text code block. Do not write the outputs.")
    return f"You are a test case generator.\n\n# Problem\n\n{task.prompt}\n\n# Your job\n\n{how}"


def parse_proposals(task: CodeTask, text: str) -> list[str]:
    """Test inputs in the agent's reply, deduplicated, in order."""
    blocks = _FENCE.findall(text)
    if task.style == "function":
        body = "\n".join(b for lang, b in blocks if lang.lower() in ("python", "py", "")) if blocks else text
        return example_calls(body, task.entry_point)
    inputs = [b if b.endswith("\n") else b + "\n" for lang, b in blocks if lang.lower() not in ("python", "py")]
    return list(dict.fromkeys(inputs))


def propose_tests_many(agent: Agent, tasks: Sequence[CodeTask], n: int, sandbox: Sandbox,
                       config: TCGConfig | None = None) -> list[tuple[TestCase, ...]]:
    """For each task, the agent's proposals that the reference accepts, as ``"llm"`` tests."""
    config = config or TCGConfig()
    contexts = [Context((Message("user", tcg_prompt(task, n), f"tcg-{i}"),)) for i, task in enumerate(tasks)]
    replies = replies_with_room(agent.act(contexts), "proposing tests")
    known = [{t.input for t in task.tests} | {t.input for t in task.examples} for task in tasks]
    # Mended to the relations between arguments the examples show, as generated inputs are (.relations).
    proposals = [[p for p in in_domain(parse_proposals(task, reply.text), domain_relations(task), random.Random(0))
                  if p not in seen][:n]
                 for task, reply, seen in zip(tasks, replies, known)]
    repeats = 2 if config.check_determinism else 1
    runs = run_reference_many(tasks, proposals, sandbox, config.per_test_seconds, repeats)
    return [select_tests(task, [(p, "llm") for p in props], task_runs, config)
            for task, props, task_runs in zip(tasks, proposals, runs)]


def propose_tests(agent: Agent, task: CodeTask, n: int, sandbox: Sandbox,
                  config: TCGConfig | None = None) -> tuple[TestCase, ...]:
    return propose_tests_many(agent, [task], n, sandbox, config)[0]


def with_llm_tests(task: CodeTask, proposed: Sequence[TestCase], max_tests: int | None = None) -> CodeTask:
    """``task`` with ``proposed`` merged into its tests (deduplicated, capped, LLM tests ranked
    after example/dataset tests and before edge/random ones)."""
    merged = {t.input: t for t in task.tests}
    for test in proposed:
        merged.setdefault(test.input, test)
    ordered = sorted(merged.values(), key=lambda t: ORDER.index(t.origin))
    return task.with_tests(ordered[: max_tests or len(ordered)])
