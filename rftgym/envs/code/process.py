"""O1-CODER's process reward for pseudocode: value each plan prefix by completing it into code.

O1-CODER rewards a reasoning step by what the steps so far lead to: from the first ``k`` steps
of a plan, the policy writes the code, and the tests' pass rate is that prefix's value.
:class:`RolloutStepScorer` does this with any rftgym agent (``samples`` completions per prefix,
averaged), so a plan whose early steps already point to working code scores high from step 1,
and a step that derails the plan shows as a drop.

A command line or a JSON config (``rftgym train``'s ``env_kwargs``) cannot hold an agent, so there
CodeTCG's ``step_scorer`` is the string ``"rollout"`` or ``"rollout:N"``: a RolloutStepScorer over
the policy that acts in the env, ``N`` completions per prefix. ``rftgym eval`` and ``rftgym train``
bind it to their policy (:func:`rftgym.envs.common.with_policy_options`, which makes it a
:class:`PolicyRollouts`).
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from ...agents.base import replies_with_room
from ...core.errors import ConfigError
from ...core.messages import Context, MessageIds
from ...core.tags import parse_tags
from .feedback import extract_code
from .harness import DEFAULT_MAX_TIMEOUTS, PER_TEST_SECONDS, check_max_timeouts, check_per_test_seconds, grade_many

COMPLETION_PROMPT = (
    "{task}\n\nA plan for the solution, as pseudocode steps:\n{steps}\n\n"
    "Write the complete solution following this plan, in one fenced code block: ```python ... ```"
)


class RolloutStepScorer:
    """``scorer(task, steps) -> [value of steps[:1], value of steps[:2], ...]`` in [0, 1].

    Without a ``sandbox`` it grades in a share of the process's local sandbox, with its default
    limits; given to CodeTCG as its ``step_scorer``, each env grades it in the env's own sandbox
    share instead (:meth:`in_sandbox`), with the env's ``max_timeouts`` and ``per_test_seconds``:
    the completions are the policy's code as much as its submissions are, so they run under the
    env's backend, limits and ``require_isolation``, and a looping one costs what a looping
    submission costs.

    All of a plan's completions are graded in one batch (the sandbox runs them concurrently on its
    workers); a completion gives up its remaining tests after ``max_timeouts`` of them hit the
    per-test time limit (None: every test runs)."""

    def __init__(self, agent, *, samples: int = 1, sandbox=None, max_steps: int = 8,
                 max_timeouts: int | None = DEFAULT_MAX_TIMEOUTS, per_test_seconds: float = PER_TEST_SECONDS):
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            raise ConfigError(f"samples must be a positive int, got {samples!r}", field="samples")
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
            raise ConfigError(f"max_steps must be a positive int, got {max_steps!r}", field="max_steps")
        check_max_timeouts(max_timeouts)
        check_per_test_seconds(per_test_seconds)
        self.agent, self.samples, self.max_steps, self.max_timeouts = agent, samples, max_steps, max_timeouts
        self.per_test_seconds = float(per_test_seconds)
        self._sandbox = sandbox
        self._owns_sandbox = sandbox is None

    @property
    def grades_in_a_sandbox_of_its_own(self) -> bool:
        """Whether no sandbox was given to it (it then opens a local one when it first grades)."""
        return self._owns_sandbox

    def in_sandbox(self, sandbox, *, max_timeouts: int | None = DEFAULT_MAX_TIMEOUTS,
                   per_test_seconds: float = PER_TEST_SECONDS) -> "RolloutStepScorer":
        """This scorer over the same agent, grading in ``sandbox`` (which its owner closes) with
        ``max_timeouts`` and ``per_test_seconds`` (the env's own, so that completions are graded as
        submissions are)."""
        return RolloutStepScorer(self.agent, samples=self.samples, sandbox=sandbox, max_steps=self.max_steps,
                                 max_timeouts=max_timeouts, per_test_seconds=per_test_seconds)

    def __deepcopy__(self, memo: dict) -> "RolloutStepScorer":
        # The agent is shared, not copied (a policy holds a model; gymnasium's env checker copies an
        # env's spec, scorer included); a sandbox given to it stays its owner's, one of its own is not
        # carried over (the copy opens its own when it first grades).
        return RolloutStepScorer(self.agent, samples=self.samples, max_steps=self.max_steps,
                                 max_timeouts=self.max_timeouts, per_test_seconds=self.per_test_seconds,
                                 sandbox=None if self._owns_sandbox else self._sandbox)

    @property
    def sandbox(self):
        if self._sandbox is None:
            from .sandbox_shared import shared_sandbox

            self._sandbox = shared_sandbox("local")  # a share of the process's sandbox
        return self._sandbox

    def __call__(self, task, steps: Sequence[str]) -> list[float]:
        steps = list(steps)[: self.max_steps]
        ids = MessageIds("score")
        contexts = []
        for k in range(1, len(steps) + 1):
            plan = "\n".join(f"{i}. {s}" for i, s in enumerate(steps[:k], start=1))
            prompt = COMPLETION_PROMPT.format(task=task.prompt, steps=plan)
            contexts.extend([Context((ids.message("user", prompt),))] * self.samples)
        replies = replies_with_room(self.agent.act(contexts), "scoring pseudocode steps") if contexts else []
        entry_point = task.entry_point if task.style == "function" else None
        codes = [extract_code(parse_tags(r.text, ("think",)), entry_point)[0] for r in replies]
        # One batch: the sandbox runs the completions side by side instead of one after another.
        graded = iter(grade_many([(task, code) for code in codes if code is not None], self.sandbox,
                                 self.per_test_seconds, max_timeouts=self.max_timeouts))
        rates = [next(graded).pass_rate if code is not None else 0.0 for code in codes]
        return [sum(rates[i:i + self.samples]) / self.samples for i in range(0, len(rates), self.samples)]

    def close(self) -> None:
        if self._owns_sandbox and self._sandbox is not None:
            self._sandbox.close()
            self._sandbox = None


# What a step_scorer given as a string may say (all that --env-arg or a JSON config can hold).
ROLLOUT_SPECS = ("'rollout' (a RolloutStepScorer over the policy that acts in the env, one completion per plan "
                 "prefix) or 'rollout:N' (N completions per prefix, averaged; N a positive int)")


def rollout_samples(spec: str) -> int:
    """The completions per plan prefix that ``spec`` asks for: ``"rollout"`` is 1, ``"rollout:N"``
    is N. Anything else is refused, naming the forms that work."""
    matched = re.fullmatch(r"rollout(?::([0-9]+))?", spec) if isinstance(spec, str) else None
    samples = int(matched.group(1) or 1) if matched else 0  # "rollout:0" is no scorer either
    if samples < 1:
        raise ConfigError(f"step_scorer={spec!r} names no step scorer; a string there is {ROLLOUT_SPECS}; from "
                          "Python, give a callable (task, steps) -> scores, e.g. RolloutStepScorer(agent)",
                          field="step_scorer")
    return samples


class PolicyRollouts(RolloutStepScorer):
    """``step_scorer="rollout"`` or ``"rollout:N"`` bound to ``agent``, the policy that acts in the
    env (:func:`rftgym.envs.common.with_policy_options` makes it; so may code of your own): a
    RolloutStepScorer given no sandbox, which each env made with it grades in the env's own share
    (:meth:`RolloutStepScorer.in_sandbox`)."""

    def __init__(self, spec: str, agent: Any):
        samples = rollout_samples(spec)
        if not callable(getattr(agent, "act", None)):
            raise ConfigError(f"step_scorer={spec!r} scores with the policy that acts in the env, and "
                              f"{type(agent).__name__} is no agent (it has no act(contexts)); bind it to an "
                              "rftgym agent", field="step_scorer")
        super().__init__(agent, samples=samples)
        self.spec = spec

    def __deepcopy__(self, memo: dict) -> "PolicyRollouts":
        # It stands for the acting policy and never grades itself (each env grades in its own
        # share): a copy of an env's spec (gymnasium's env checker makes one) is the same binding.
        return self

    def __repr__(self) -> str:
        return f"PolicyRollouts({self.spec!r})"
