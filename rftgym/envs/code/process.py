"""O1-CODER's process reward for pseudocode: value each plan prefix by completing it into code.

O1-CODER rewards a reasoning step by what the steps so far lead to: from the first ``k`` steps
of a plan, the policy writes the code, and the tests' pass rate is that prefix's value.
:class:`RolloutStepScorer` does this with any rftgym agent (``samples`` completions per prefix,
averaged), so a plan whose early steps already point to working code scores high from step 1,
and a step that derails the plan shows as a drop.
"""

from __future__ import annotations

from typing import Sequence

from ...agents.base import replies_with_room
from ...core.errors import ConfigError
from ...core.messages import Context, MessageIds
from ...core.tags import parse_tags
from .feedback import extract_code

COMPLETION_PROMPT = (
    "{task}\n\nA plan for the solution, as pseudocode steps:\n{steps}\n\n"
    "Write the complete solution following this plan, in one fenced code block: ```python ... ```"
)


class RolloutStepScorer:
    """``scorer(task, steps) -> [value of steps[:1], value of steps[:2], ...]`` in [0, 1]."""

    def __init__(self, agent, *, samples: int = 1, sandbox=None, max_steps: int = 8):
        if not isinstance(samples, int) or samples < 1:
            raise ConfigError(f"samples must be a positive int, got {samples!r}")
        if not isinstance(max_steps, int) or max_steps < 1:
            raise ConfigError(f"max_steps must be a positive int, got {max_steps!r}")
        self.agent, self.samples, self.max_steps = agent, samples, max_steps
        self._sandbox = sandbox
        self._owns_sandbox = sandbox is None

    @property
    def sandbox(self):
        if self._sandbox is None:
            from .sandbox_shared import shared_sandbox

            self._sandbox = shared_sandbox("local")  # a share of the process's sandbox
        return self._sandbox

    def __call__(self, task, steps: Sequence[str]) -> list[float]:
        from .harness import grade

        steps = list(steps)[: self.max_steps]
        ids = MessageIds("score")
        contexts = []
        for k in range(1, len(steps) + 1):
            plan = "\n".join(f"{i}. {s}" for i, s in enumerate(steps[:k], start=1))
            prompt = COMPLETION_PROMPT.format(task=task.prompt, steps=plan)
            contexts.extend([Context((ids.message("user", prompt),))] * self.samples)
        replies = replies_with_room(self.agent.act(contexts), "scoring pseudocode steps") if contexts else []
        codes = [extract_code(parse_tags(r.text, ("think",)))[0] for r in replies]
        rates = [grade(task, code, self.sandbox).pass_rate if code is not None else 0.0 for code in codes]
        return [sum(rates[i:i + self.samples]) / self.samples for i in range(0, len(rates), self.samples)]

    def close(self) -> None:
        if self._owns_sandbox and self._sandbox is not None:
            self._sandbox.close()
            self._sandbox = None
