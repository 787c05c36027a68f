"""VerifiableQA: questions with one checkable answer (after RLVR math and OpenRFT).

Observation
    A :class:`~rftgym.core.messages.Context`: an optional system message, then the user's
    question (multiple-choice questions list their options as ``(A) …``). After a turn that does
    not end the episode, the env appends the assistant's turn and a user message with feedback.

Action
    The text of one assistant turn. The final answer goes in ``<answer>…</answer>``: a number,
    a choice letter (``B`` or ``(B)``) or the choice's text. Markup around it (``\\boxed{…}``,
    ``**…**``, ``$…$``) and a leading "Option", "Choice" or "The answer is" are read past. Reasoning
    may precede it, optionally inside ``<think>…</think>``; an ``<answer>`` inside ``<think>`` is
    reasoning and is not graded.

Reward (paid on the turn that ends the episode; 0 on other turns)
    ``(1 - format_weight) * correct + format_weight * well_formatted`` where ``correct`` is 1 if
    the answer is right and ``well_formatted`` is 1 if the turn holds exactly one closed
    ``<answer>`` tag and no malformed tags. An empty ``<answer></answer>`` is no answer: it gets
    a format reminder, like a turn without the tag. With the default ``format_weight=0.1`` a right,
    clean answer gets 1.0, a right but sloppy one 0.9, a wrong but clean one 0.1. Rewards lie in
    [0, 1].

Episode end
    ``terminated`` when the answer is right or ``max_attempts`` wrong answers were given;
    ``truncated`` when ``max_turns`` assistant turns passed without that (turns without an
    ``<answer>`` tag get a format reminder and count against ``max_turns``). Bound the turns with
    ``max_turns``, not gymnasium's ``max_episode_steps``: its TimeLimit wrapper truncates without
    the env knowing, so a wrong answer on the step it cuts (with attempts left) is paid 0, not
    the format reward that truncation by ``max_turns`` pays. That step's ``info["reward_if_cut"]``
    holds it, and the rollout engine adds it to the turn of any episode that ends truncated (a
    TimeLimit, its own turn cap, a full context); a loop of your own adds it likewise.

Info keys
    ``task_id``, ``kind``, ``difficulty``, ``turn``, ``attempts``, ``answer`` (text inside the
    tag, or None), ``correct``, ``format_ok``, ``format_error`` (None or what was wrong; at
    most three distinct tag problems are spelled out), ``success`` (answered correctly),
    ``reward_if_cut`` (what the turn budget running out on this step would have paid: the graded
    answer's reward while the episode is under way, 0 for a turn without one and once the episode
    has ended), and ``expected`` once the episode has ended.

Options to ``reset``
    ``task_index`` picks a task of a loaded dataset. Otherwise, with ``task_selection="seed"``
    (the default) ``reset(seed=i)`` gives task ``i % len(dataset)``, so that ``rftgym eval``
    (whose default episodes are ``eval_episodes``, the dataset's size) covers it once; without a
    seed, or with ``"random"``, the task is drawn. ``kind`` and ``difficulty`` override the
    generator's draw for this episode. An option that does not apply to where the tasks come
    from, or an unknown one, raises ValueError. A reset that raises ends the episode before it:
    step() refuses, as before a first reset, until a reset succeeds.
    After ``close()``, reset() and step() raise RuntimeError: make a new env.

Version history
    v0: first version (2026-12-01, before any release: a dataset is served by seed, and a text
    answer holding a number is graded by value only as a quantity; markup around an answer is read
    past; comparison choices at difficulty 3-5 lie more than 0.001 apart; 2026-12-06: a number
    glued to letters or in exponent notation is no number, where "120cm" read as 12 and "1.5e3"
    as 1.5, and an en or em dash before a number is a minus sign; a denied number, "not 5" or
    "isn't 5", answers nothing, where it was graded as 5; 2026-12-07: ``max_turns=1`` is taken,
    and ``task_selection`` without ``dataset_path`` is refused; a sequence question's answer is at
    a random rank among its choices, where it was always the second smallest; a quantity's number
    ("$3.50", "-5 degrees") is compared by value, where "$350" and "5 degrees" read as the same
    text; "minus 3" is -3, and a bound or scale ("at least 5", "5 or more", "100 thousand"), a
    second sign ("--42") or a denial after the number ("42 is wrong") answers nothing, while "not
    sure but 42" answers 42; a step that raises part way ends the episode; a draft ``<answer>``
    inside ``<think>`` followed by the answer is no format error, where it cost the format reward; later
    that day: a bare number answers a quantity only where words, a unit or currency stand around
    its number, where "3" answered "\\sqrt{3}" and "2" answered "x > 2"; text answers compare their
    operators, relations, brackets and the separators between digits, where "x-1" answered "x+1"
    and "12" answered "(1,2)"; a relation or function of the number in symbols ("< 5", "!= 5",
    "\\sqrt{5}", "x^5", "5+") or words ("5 squared") and a denial around markup ("not **5**"),
    in "cannot" or by "wrong"/"incorrect" beside the number answer nothing; ``\\frac{a}{b}`` and
    ``12{,}345`` read as a/b and 12,345; a sequence question's choices are evenly spaced around
    the answer, where every distractor lay within 1, 2, 3 or the step of it and gave it away; a
    choice's letter after a comma or dash ("B, 42"), after its text ("42 (B)"), in square brackets,
    or with "is correct" or "the correct option is" around it names that choice; markup and a
    sentence's end around an answer are read past wherever they stand ("The answer is **B**.",
    "\\boxed{B}.", "\\(B\\)", "\\mathbf{B}", "**Answer:** B", "=> B", "B is the answer"), as are
    degrees (42^\\circ); a mixed number 2\\frac{1}{3} is 7/3; "5!" is a factorial, not 5; a denial
    in LaTeX text ("\\text{not } 5") or before a choice's letter ("not (B) 92") answers nothing; a
    sequence question's distractor is never a term the question shows; an arithmetic sequence's step
    is at least 4, and its question's choices all lie above the last term shown, spaced by 1, 2 or 3
    with the answer at a uniform rank, where the smallest choice above that term was the answer 47%
    of the time at difficulty 1).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym

from ...core.errors import ConfigError
from ..copying import CopyableEnv
from ..common import (ANSWER_IN_THINK, ClosableEnv, chat_spaces, check_generator_only, check_path_options,
                      check_render_mode, check_reset_options, check_step_call, check_task_selection, covering_episodes,
                      dataset_index, episode_ends_on_error, read_action, render_context, reset_options, resolve_config,
                      summarize_problems, REWARD_IF_CUT, PathsAsText)
from ...core.messages import Context, MessageIds
from ...core.tags import parse_tags
from ...core.values import int_tuple, is_int
from .grading import is_correct
from .tasks import DIFFICULTIES, GENERATORS, Task, generate_task, load_tasks_jsonl

_ANSWER_OPENING = re.compile(r"<\s*answer\s*>", re.IGNORECASE)

DEFAULT_SYSTEM_PROMPT = (
    "You are a careful problem solver. Think step by step, briefly. "
    "Then give your final answer inside <answer></answer> tags, for example <answer>42</answer> "
    "or, for a multiple-choice question, <answer>B</answer>."
)


@dataclass(frozen=True)
class VerifiableQAConfig:
    kinds: tuple[str, ...] = tuple(GENERATORS)
    difficulties: tuple[int, ...] = (1, 2)
    dataset_path: str | None = None
    task_selection: str = "seed"
    max_attempts: int = 1
    max_turns: int = 3
    format_weight: float = 0.1
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT
    max_action_chars: int = 32_000
    tags: tuple[str, ...] = field(default=("answer", "think"), init=False)

    def __post_init__(self) -> None:
        # A single kind or difficulty (e.g. from `--env-arg kinds=arithmetic`) means a tuple of one.
        kinds = (self.kinds,) if isinstance(self.kinds, str) else self.kinds
        try:
            object.__setattr__(self, "kinds", tuple(kinds))
            object.__setattr__(self, "difficulties", int_tuple(self.difficulties))
            if not all(isinstance(k, str) for k in self.kinds):
                raise TypeError("a kind is not a string")
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"kinds must be a list of kind names and difficulties a list of ints in {DIFFICULTIES}; "
                f"got kinds={self.kinds!r}, difficulties={self.difficulties!r}"
            ) from exc
        for name in ("max_attempts", "max_turns", "max_action_chars"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"{name} must be an int, got {value!r}")
        if self.max_action_chars < 1:
            raise ConfigError(f"max_action_chars must be at least 1, got {self.max_action_chars}")
        if self.system_prompt is not None and not isinstance(self.system_prompt, str):
            raise ConfigError(f"system_prompt must be a string or None, got {type(self.system_prompt).__name__}")
        check_path_options(self, ("dataset_path",))
        check_task_selection(self, generated=self.dataset_path is None)
        unknown = set(self.kinds) - set(GENERATORS)
        if not self.kinds or unknown:
            raise ConfigError(f"kinds must be a non-empty subset of {sorted(GENERATORS)}; got {list(self.kinds)}")
        if not self.difficulties or set(self.difficulties) - set(DIFFICULTIES):
            raise ConfigError(f"difficulties must be a non-empty subset of {DIFFICULTIES}; got {list(self.difficulties)}")
        check_generator_only(self, ("kinds", "difficulties"))
        if self.max_attempts < 1:
            raise ConfigError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if self.max_turns < self.max_attempts:
            raise ConfigError(f"max_turns must be at least max_attempts ({self.max_attempts}): each attempt is a turn; "
                              f"got {self.max_turns}")
        if isinstance(self.format_weight, bool) or not isinstance(self.format_weight, (int, float)) \
                or not 0.0 <= self.format_weight < 1.0:
            raise ConfigError(f"format_weight must be in [0, 1), got {self.format_weight!r}")


class VerifiableQAEnv(CopyableEnv, ClosableEnv, PathsAsText, gym.Env[Context, str]):
    """Single- or few-turn questions with a checkable answer, given in <answer> tags.

    ``copy.deepcopy(env)`` branches an episode (the copies share the dataset) and ``pickle`` sends
    one to another process (see :mod:`rftgym.envs.copying`)."""

    shared_attributes = ("config", "dataset")

    # train_signals: what its episodes give beyond the reward (none: PCAR and DCPO have nothing to use)
    metadata = {"render_modes": ["ansi", "human"], "render_fps": 4, "train_signals": frozenset()}

    def __init__(self, render_mode: str | None = None, **config: Any):
        check_render_mode(render_mode, self.metadata)
        self.config = resolve_config(VerifiableQAConfig, config)
        self.render_mode = render_mode
        self.dataset: list[Task] | None = (
            load_tasks_jsonl(self.config.dataset_path) if self.config.dataset_path else None
        )
        # Every observation must lie in the space, so its limits follow the config: a system and a
        # user message, then at most an assistant turn and a feedback message per turn.
        longest_prompt = max((len(t.prompt()) for t in self.dataset or ()), default=0)
        self.observation_space, self.action_space = chat_spaces(
            max_messages=2 + 2 * self.config.max_turns, max_action_chars=self.config.max_action_chars,
            longest_message=max(longest_prompt, len(self.config.system_prompt or "")))
        self.task: Task | None = None
        self._context = Context()
        self._ids: MessageIds | None = None
        self._turn = 0
        self._attempts = 0
        self._done = False

    # ------------------------------------------------------------------ gymnasium API

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        self.check_open("reset")
        super().reset(seed=seed)
        # A reset that raises (a bad option, a data error) leaves no episode to step, not the last one.
        self.task, self._context = None, Context()
        options = reset_options(options)
        self.task = self._draw_task(seed, options)
        self._ids = MessageIds.from_rng(self.np_random)
        messages = []
        if self.config.system_prompt:
            messages.append(self._ids.message("system", self.config.system_prompt))
        messages.append(self._ids.message("user", self.task.prompt()))
        self._context = Context(tuple(messages))
        self._turn = 0
        self._attempts = 0
        self._done = False
        if self.render_mode == "human":
            self.render()
        return self._context, self._info(answer=None, correct=False, format_ok=False, format_error=None)

    def step(self, action: str):
        self.check_open("step")
        check_step_call(self.task is not None, self._done, action)
        with episode_ends_on_error(self):
            return self._step(action)

    def _step(self, action: str):
        self._turn += 1
        action, cut = read_action(action, self.config.max_action_chars)
        context = self._context.appended(self._ids.message("assistant", action))

        parsed = parse_tags(action, self.config.tags)
        # An <answer> inside <think> is part of the reasoning, not the reply's answer.
        in_think = {t.start for t in parsed.find("answer") if parsed.inside_closed(t, "think")}
        answers = [t for t in parsed.find("answer") if t.closed and t.start not in in_think]
        # A draft answer in the reasoning is a problem only when no answer follows it.
        thought = [ANSWER_IN_THINK] if in_think and not answers else []
        format_error = None
        problems = summarize_problems([*cut, *parsed.problems, *thought])
        notes = (["more than one <answer> tag; the last one was graded"] if len(answers) > 1 else []) \
            + ([problems] if problems else [])
        if not answers:
            # Tags inside a code block are code (core.tags): say so where the answer sat in one.
            fenced = ["an <answer> inside a ``` code block is code, not the answer; write it outside the block"] \
                if any(_ANSWER_OPENING.search(block.code) for block in parsed.code_blocks) else []
            format_error = "no <answer>…</answer> tag" + (f" ({'; '.join(fenced + ([problems] if problems else []))})"
                                                         if fenced or problems else "")
        elif not answers[-1].text.strip():
            # An empty answer is no answer: it is not graded, and earns no format reward. The last
            # answer is the one that counts, so an empty one after another leaves none.
            empty = "the <answer> tag is empty" if len(answers) == 1 else \
                "the last of several <answer> tags (the one that counts) is empty, so none was graded"
            answers, format_error = [], "; ".join([empty] + notes[len(answers) > 1:])
        elif notes:
            format_error = "; ".join(notes)
        format_ok = format_error is None
        answer_text = answers[-1].text if answers else None
        correct = answer_text is not None and is_correct(self.task, answer_text)

        reward, terminated, feedback = 0.0, False, None
        if answer_text is not None:
            self._attempts += 1
            if correct or self._attempts >= self.config.max_attempts:
                terminated = True
            else:
                left = self.config.max_attempts - self._attempts
                feedback = f"That answer is not correct. Try again ({left} attempt{'s' if left > 1 else ''} left)."
        else:
            feedback = (
                f"Your reply was not understood: {format_error}. "
                "Give your final answer inside <answer></answer> tags."
            )
        truncated = not terminated and self._turn >= self.config.max_turns
        # Paid on the turn that ends the episode, also when the turn budget (not the attempts) ran
        # out on a graded answer; a turn without one is worth nothing.
        worth = 0.0 if answer_text is None else \
            (1 - self.config.format_weight) * float(correct) + self.config.format_weight * float(format_ok)
        if terminated or truncated:
            reward = worth
        if feedback is not None and not truncated:
            context = context.appended(self._ids.message("user", feedback))
        self._context = context
        self._done = terminated or truncated
        info = self._info(answer=answer_text, correct=correct, format_ok=format_ok, format_error=format_error,
                          reward_if_cut=worth)
        if self.render_mode == "human":
            self.render()
        return self._context, float(reward), terminated, truncated, info

    def render(self) -> str | None:
        self.check_open("render")  # (a closed env's context is gone: it would show an empty one)
        return render_context(self._context, self.render_mode)

    def _free_resources(self) -> None:  # on close(); nothing external is held
        self._context = Context()

    # ------------------------------------------------------------------ helpers

    @property
    def eval_episodes(self) -> int | None:
        return covering_episodes(self.dataset, self.config.task_selection)

    def _draw_task(self, seed: int | None, options: dict[str, Any]) -> Task:
        check_reset_options(options, from_dataset=self.dataset is not None, generator_options=("kind", "difficulty"))
        if self.dataset is not None:
            return self.dataset[dataset_index(options, len(self.dataset), self.np_random, seed,
                                              self.config.task_selection)]
        kinds, difficulties = self.config.kinds, self.config.difficulties
        kind = options.get("kind")
        if kind is None:
            kind = kinds[int(self.np_random.integers(len(kinds)))]
        if not isinstance(kind, str):  # (a list of kinds is the config's kinds=, not a reset option)
            raise ValueError(f"kind must be one task kind, one of {sorted(GENERATORS)}, got {kind!r}; to draw from "
                             "several, make the env with kinds=[...]")
        difficulty = options.get("difficulty")
        if difficulty is None:
            difficulty = difficulties[int(self.np_random.integers(len(difficulties)))]
        if not is_int(difficulty):
            raise ValueError(f"difficulty must be one of {DIFFICULTIES}, got {difficulty!r}")
        return generate_task(self.np_random, kind, int(difficulty))

    def _info(self, *, answer, correct, format_ok, format_error, reward_if_cut=0.0) -> dict[str, Any]:
        info = {
            "task_id": self.task.id,
            "kind": self.task.kind,
            "difficulty": self.task.difficulty,
            "turn": self._turn,
            "attempts": self._attempts,
            "answer": answer,
            "correct": bool(correct),
            "format_ok": bool(format_ok),
            "format_error": format_error,
            "success": bool(correct),
            REWARD_IF_CUT: 0.0 if self._done else float(reward_if_cut),
        }
        if self._done:
            info["expected"] = self.task.answer
        return info

