"""MemoryQA: long-horizon multi-objective QA under a context budget, with memory as an action
(after Memory-as-Action / MemAct).

Observation
    A :class:`~rftgym.core.messages.Context` the env owns and may edit: an optional system
    message (the protocol and the budget), then the task message listing the objectives::

        Task: answer all 3 questions below.
        1. What is the currency of the country of the birthplace of Alda Mertz?
        2. …

    After each turn the env (a) deletes the messages that this turn's valid prunes named (and
    with them the earlier assistant turns they leave without results, below), then
    (b) appends, in this order: the assistant's turn; one message per tool call, in the order of
    the tags (a search batch for each ``<search>``, a memory note for each ``<prune>`` that has a
    note); and, only when the turn had problems or notes (an answer recorded, a prune without a
    note, a refused prune, a tool-call limit, a turn with no tag that did anything), the context
    reached 3/4 of its budget, or the episode was truncated, one status message ``[env] …`` (those, then "Context: N of B
    tokens" as the budget counts it, turns and tool calls left, questions answered). A turn whose
    prunes delete messages also deletes the env's earlier status messages: each reports the state
    at its own turn, so in a long episode they would pile up (unbudgeted) in what the model reads,
    and the context is edited at that turn anyway (a turn without a prune never edits the
    context, so no segment break is added for them). It also deletes every earlier assistant turn none
    of whose search batches is left in the context, as MemAct's prune deletes a tool call with its
    result: the agent's own turns (its reasoning) count against the budget, and would otherwise fill
    it for good. A turn that recorded an answer stays (it shows the agent what it answered); of the
    others, one that searched nothing goes at the first prune after it, and its notes stay as
    ``[memory m…]`` messages. So the observation after a prune is exactly the previous observation
    minus the pruned messages, the earlier status messages and the spent assistant turns, plus the
    new messages above. The task and the system message are never deleted.
    Message formats and the prune rule are in :mod:`.context_ops`.

Action
    The text of one assistant turn, with these tags (reasoning may go in ``<think>…</think>``;
    tool tags inside it are not run, while a ``<think>`` never closed is reported and encloses
    nothing):

    ``<search>query</search>``
        Runs the query (top ``top_k`` documents). Results come back as one message; each hit has a
        short id unique in the episode: ``[r12] Title: text`` (text cut to ``max_doc_chars``).
    ``<prune ids="r12,r13,m2">note</prune>``
        Deletes the WHOLE message holding each named id (naming one hit of a batch deletes the
        batch) and, if the note is not empty, adds ``[memory m<n>] note`` (cut to
        ``max_note_chars``; tool tags inside it run as tags and are not kept in it, and its white
        space is collapsed) at the end of this turn's messages. One ``ids`` attribute lists every
        id (quoted, or bare: ``ids=r12, r13`` is read whole, as the tag parser reads a bare comma
        list). Memory notes can be pruned too.
        Only ids shown in the observation this turn answered count. A prune whose ``ids`` is
        missing or empty, or names anything else (unknown or already pruned ids, the task, an
        objective number, a message id) deletes nothing, keeps no note, and is reported in the
        status message and ``info["prune_error"]``. With ``allow_prune=False`` (the no-memory
        baseline) the system prompt does not mention pruning and every prune is refused so.
    ``<answer id="K">text</answer>``
        Answers objective K (1-based; ``id`` may be left out when the task has one objective).
        Objectives may be answered in any turns; an objective's first answer is final (a repeat is
        reported and ignored). Answers are not tool calls.

    Every non-empty search and every prune (valid or not, except when refused for being turned
    off) is a tool call; beyond ``max_tool_calls`` a call is not run and the status message says
    so. Baselines (no memory, heuristic pruning) are in :mod:`rftgym.agents.memory_baselines`.

Reward
    The score of the answers, ``fraction`` (default: share of objectives answered correctly) or
    ``all_or_nothing`` (1 only if all are correct), paid as it is earned: each turn's reward holds
    what that turn's answers added to the score, so an episode's rewards sum to its score, and an
    episode cut short from outside (a rollout's turn cap, a model whose context is full) keeps
    what its earlier answers earned.
    An answer is correct when its exact match is 1 (``answer_metric="em"``) or its token F1
    against the gold answers is at least ``f1_threshold`` (``"f1"``, default), scored with
    :mod:`rftgym.envs.search.scoring`. On every turn whose returned observation, as the budget
    counts it, exceeds ``max_context_tokens``, ``overflow_penalty`` is subtracted. Rewards lie in
    [-overflow_penalty, 1] per turn.

Episode end
    ``terminated`` once every objective has an answer. ``truncated`` after ``max_turns`` turns,
    or, with ``on_context_overflow="truncate"`` (default), on the first turn whose observation
    exceeds the context budget (with ``"penalize"`` the episode goes on and the status message
    warns). Answers given before truncation still count.

Context tokens
    ``count_tokens(context) -> int`` when given (e.g. :func:`.budget.policy_token_counter` for
    the policy's exact prompt length), else :func:`.budget.estimate_tokens` (4 tokens per message
    plus one per 4 characters). ``max_context_tokens=None`` turns the budget off. The budget
    counts the context without the env's own status messages: the agent cannot prune them, so
    they never push it over (``observation_tokens`` counts them, as the model is fed them). A task
    whose first observation is already over the budget is warned of once. The budget is
    checked on each observation as it is made; ``context_tokens`` is measured again when the next
    turn begins. With the policy's counter, sampled assistant turns are counted by their text (the
    exact sampled spans live with the rollout engine), so the count can differ from the prompt the
    policy was fed by the few tokens of a non-canonical spelling.

Info keys
    ``task_id``, ``objectives`` (count), ``hops`` (per objective), ``turn``,
    ``context_tokens`` (tokens of the context this turn answered; 0 at reset),
    ``observation_tokens`` (tokens of the returned observation), ``peak_context_tokens`` (max of
    ``context_tokens`` so far), ``total_tokens`` (sum of ``context_tokens`` over the turns: the
    tokens processed), ``context_budget``, ``budget_tokens`` (the returned observation as the
    budget counts it, without the env's status messages), ``over_budget`` (``budget_tokens``
    exceeds the budget),
    ``overflows`` (turns over budget so far), ``searches``, ``tool_calls``, ``queries`` and
    ``result_ids`` (this turn's), ``prunes`` (valid prunes so far), ``pruned`` (this turn's valid
    prunes: ``named`` ids, ``removed_ids`` (every id that left the context), ``message_ids``,
    ``note_id``, ``note``), ``pruned_ids`` (every id pruned this episode), ``turns_deleted``
    (earlier assistant turns this turn's prunes deleted with their results), ``memory_notes``
    (notes in the context now), ``prune_error`` (None, or this turn's refused prunes, each distinct
    reason once), ``format_error``
    (None or this turn's problems: tag problems, refused prunes and
    answers), ``answers`` ({"1": text, …}), ``answered``, ``correct``
    (counts), ``score``, ``success`` (all objectives correct), and ``expected``
    ({"1": [gold, …], …}) once the episode has ended.

Options to ``reset``
    ``objectives`` and ``hops`` override the generator's draw; with a dataset,
    ``question_indices`` picks the questions of the task. A reset that raises ends the episode
    before it: step() refuses, as before a first reset, until a reset succeeds.
    After ``close()``, reset() and step() raise RuntimeError: make a new env.

Data
    With no files, tasks come from the search env's seeded world (``world_seed``, ``world_size``;
    ``objectives`` and ``hops`` are the difficulty). ``dataset_path`` (HotpotQA JSON) composes
    tasks of ``objectives`` questions; the corpus is its paragraphs plus the distractor corpus
    ``corpus_path`` (first ``max_distractors`` documents). ``retriever`` is ``bm25``, ``dense``,
    ``remote`` (a service at ``retriever_url``, e.g. ``rftgym serve-retriever --world-seed 0
    --world-size 60``; it is warned of when it does not serve the env's documents) or any
    :class:`~rftgym.envs.search.retrievers.Retriever` object. HotpotQA's paragraphs are longer
    than ``max_doc_chars``' default of 300 allows (at 300, 45 of ``hotpotqa_100.json``'s 100
    questions have a supporting sentence past the cut; none at 1000): raise it, and the budget,
    for a dataset.

Version history
    v0: first version (2026-12-01, before any release: the budget stopped counting the env's own
    status messages, and the score is paid as it is earned rather than at the episode's end;
    2026-12-07: a turn's tags past its 64th are ignored (said in ``format_error``), the
    heuristic-prune baseline runs with pruning allowed, and ``f1_threshold`` with
    ``answer_metric="em"`` or the overflow options without ``max_context_tokens`` are refused;
    ``retriever_timeout_s`` and ``retriever_retries`` set a remote service's; a prune with text
    outside its ids attribute (``ids=r1 r6``, which pruned r1 alone) is refused, ``f1_threshold=0``
    is refused, and so is a prune with an attribute besides ``ids``, a step or reset that raises part
    way leaves no episode to step, and the heuristic-prune baseline never sends a refused prune
    again; a prune deletes the earlier assistant turns it leaves without search results, which
    stayed before, and a note's text counted twice for good, in the turn and in its ``[memory m…]``
    message; the generated world's river and industry questions also take "X river", "X industry"
    and "X company", as its documents say them ("the X river", "an X company"); a draft tag inside
    ``<think>`` that the turn then gives outside it is no format error).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import gymnasium as gym

from ...core.errors import ConfigError, warn_caller
from ..common import (ClosableEnv, chat_spaces, check_bool_options, check_generator_only, check_path_options,
                      check_render_mode, check_reset_options, check_step_call, episode_ends_on_error, nothing_done,
                      read_action, refuse_unread_option, render_context, reset_options, resolve_config,
                      summarize_problems, without_tool_markup, MAX_TAGS_PER_TURN, TOO_MANY_TAGS, PathsAsText)
from ...core.messages import Context, Message, MessageIds
from ...core.tags import never_closed, parse_tags
from ...core.values import int_tuple, is_int
from ..copying import CopyableEnv, Share
from ..search.corpora import has_own_corpus
from ..search.retrievers import check_retriever_options, corpus_source, open_retriever
from ..search.scoring import best_score
from ..search.world import MAX_HOPS, World
from . import context_ops
from .budget import estimate_tokens
from .tasks import MemoryTask, build_corpus, compose_task, draw_indices, generate_task, load_question_pool

PROMPT_WITH_MEMORY = (
    "Answer every question of the task using a search engine. Search with <search>query</search>; each result "
    "has an id such as [r3]. {budget}, so delete results you no longer "
    "need with <prune ids=\"r3,r4\">a short note of the facts to keep</prune>: the messages holding those ids "
    "are removed, as are your earlier turns with no results left in view (those that answered stay), and the "
    "note stays as [memory m1]. Answer question N with <answer id=\"N\">short answer"
    "</answer>; you may answer the questions one at a time. The task ends when all are answered."
)
PROMPT_WITHOUT_MEMORY = (
    "Answer every question of the task using a search engine. Search with <search>query</search>; each result "
    "has an id such as [r3]. {budget}. Answer question N with "
    "<answer id=\"N\">short answer</answer>; you may answer the questions one at a time. The task ends when "
    "all are answered."
)
AUTO = "auto"
MAX_QUERY_CHARS = 300
WARN_FRACTION = 0.75  # a status message reports the context size from this share of the budget on
MAX_OVERFLOW_PENALTY = 1000.0  # per turn; the task reward is at most 1


@dataclass(frozen=True)
class MemoryQAConfig:
    objectives: tuple[int, ...] = (2, 3)
    hops: tuple[int, ...] = (2, 3)
    world_seed: int = 0
    world_size: int = 60
    dataset_path: str | None = None
    corpus_path: str | None = None
    max_distractors: int | None = None
    retriever: Any = "bm25"  # a name in retrievers.ENV_RETRIEVERS or a Retriever object
    retriever_url: str | None = None
    # A remote service's seconds per attempt (from connecting to the reply's last byte) and retries
    # after the first: a dense index on a busy CPU may need more than 10 s.
    retriever_timeout_s: float = 10.0
    retriever_retries: int = 2
    top_k: int = 5
    max_doc_chars: int = 300
    max_context_tokens: int | None = 1024
    count_tokens: Callable[[Context], int] | None = None
    on_context_overflow: str = "truncate"  # or "penalize"
    overflow_penalty: float = 0.1
    max_turns: int = 24
    max_tool_calls: int = 24
    allow_prune: bool = True
    max_note_chars: int = 500
    answer_metric: str = "f1"  # or "em"
    f1_threshold: float = 0.8
    reward_mode: str = "fraction"  # or "all_or_nothing"
    system_prompt: str | None = AUTO  # AUTO: the default prompt for allow_prune; None: no system message
    max_action_chars: int = 32_000
    tags: tuple[str, ...] = field(default=("search", "prune", "answer", "think"), init=False)

    def __post_init__(self) -> None:
        for name, low, high in (("objectives", 1, 20), ("hops", 1, MAX_HOPS)):
            raw = getattr(self, name)
            try:
                values = int_tuple(raw)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"{name} must be a list of ints in [{low}, {high}], got {raw!r}") from exc
            if not values or not all(low <= v <= high for v in values):
                raise ConfigError(f"{name} must be a non-empty list of ints in [{low}, {high}], got {raw!r}")
            object.__setattr__(self, name, values)
        for name, low in (("world_seed", 0), ("world_size", 2), ("top_k", 1), ("max_doc_chars", 20),
                          ("max_turns", 1), ("max_tool_calls", 0), ("max_note_chars", 1), ("max_action_chars", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"{name} must be an int of at least {low}, got {value!r}")
        for name in ("max_context_tokens", "max_distractors"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"{name} must be a positive int or None, got {value!r}")
        check_path_options(self, ("dataset_path", "corpus_path"))
        check_generator_only(self, ("hops", "world_seed", "world_size"))
        if self.corpus_path is not None and self.dataset_path is None:
            raise ConfigError("corpus_path (distractors) needs dataset_path (the questions); "
                              "without both, the generated world is used")
        # Options that the others leave unread would be ignored without a word.
        if self.corpus_path is None:
            refuse_unread_option(self, "max_distractors", because="limits the distractor corpus, and no corpus_path "
                                 "is given", fix="add corpus_path (with dataset_path), or drop max_distractors")
        check_retriever_options(self)
        if self.count_tokens is not None and not callable(self.count_tokens):
            raise ConfigError("count_tokens must be a function context -> int (e.g. budget.policy_token_counter(policy))")
        if self.on_context_overflow not in ("truncate", "penalize"):
            raise ConfigError(f"on_context_overflow must be 'truncate' or 'penalize', got {self.on_context_overflow!r}")
        # A penalty is per turn, against a task reward of at most 1: bounded, so that an episode's sum stays finite.
        for name, high in (("overflow_penalty", MAX_OVERFLOW_PENALTY), ("f1_threshold", 1.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not 0 <= value <= high:
                raise ConfigError(f"{name} must be a number in [0, {high:g}], got {value!r}")
        if self.f1_threshold == 0:
            raise ConfigError("f1_threshold must be above 0: every answer has a token F1 of at least 0, so 0 would "
                              "count any answer correct; 1.0 asks for every token, the default 0.8 for most")
        check_bool_options(self, ("allow_prune",))
        if not self.allow_prune:
            refuse_unread_option(
                self, "max_note_chars",
                because="caps the notes that prunes keep, and allow_prune=False refuses every prune, so no note is "
                        "kept",
                fix="drop max_note_chars, or set allow_prune=True")
        if self.answer_metric not in ("f1", "em"):
            raise ConfigError(f"answer_metric must be 'f1' or 'em', got {self.answer_metric!r}")
        if self.answer_metric == "em":
            refuse_unread_option(self, "f1_threshold", because="is the token F1 an answer needs, and "
                                 "answer_metric='em' scores answers by exact match", fix="drop f1_threshold, or set "
                                 "answer_metric='f1'")
        if self.max_context_tokens is None:
            for name in ("on_context_overflow", "overflow_penalty"):
                refuse_unread_option(self, name, because="acts on a context past max_context_tokens, and "
                                     "max_context_tokens=None sets no budget", fix=f"drop {name}, or give "
                                     "max_context_tokens")
        if self.reward_mode not in ("fraction", "all_or_nothing"):
            raise ConfigError(f"reward_mode must be 'fraction' or 'all_or_nothing', got {self.reward_mode!r}")
        if self.system_prompt is not None and not isinstance(self.system_prompt, str):
            raise ConfigError(f"system_prompt must be a string, 'auto' or None, got {type(self.system_prompt).__name__}")

    def prompt(self) -> str | None:
        if self.system_prompt != AUTO:
            return self.system_prompt
        template = PROMPT_WITH_MEMORY if self.allow_prune else PROMPT_WITHOUT_MEMORY
        budget = (f"Your context holds at most about {self.max_context_tokens} tokens"
                  if self.max_context_tokens is not None else "Your context has no token limit, but a short one "
                                                               "is easier to read")
        return template.format(budget=budget)


@dataclass
class _Turn:
    """What one turn did, collected while its tags are applied."""

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    new_messages: list[Message] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)  # message ids
    queries: list[str] = field(default_factory=list)
    result_ids: list[str] = field(default_factory=list)
    pruned: list[dict[str, Any]] = field(default_factory=list)
    prune_errors: list[str] = field(default_factory=list)
    deleted_turns: list[str] = field(default_factory=list)  # earlier assistant turns' message ids


def _given_after(parsed, draft) -> bool:
    """Whether a tag inside ``<think>`` is given for real after it: a closed tag of its name
    outside any ``<think>``, for the same objective when it is an ``<answer>``."""
    return any(t.name == draft.name and t.closed and t.start >= draft.end and not parsed.inside_closed(t, "think")
               and (draft.name != "answer" or t.attr("id") == draft.attr("id")) for t in parsed.tags)


class MemoryQAEnv(CopyableEnv, ClosableEnv, PathsAsText, gym.Env[Context, str]):
    """Several questions in one episode; evidence overflows the context unless the agent prunes.

    ``copy.deepcopy(env)`` branches an episode (the copies share the retriever) and ``pickle``
    sends one to another process (see :mod:`rftgym.envs.copying`)."""

    shared_attributes = ("config", "count_tokens", "world", "pool", "_documents")
    resource_attributes = ("retriever", "_retriever_share")

    metadata = {
        "render_modes": ["ansi", "human"],
        "render_fps": 4,
        # Columns `rftgym eval` adds for this env: (column, info key, reducer in rollout.metrics).
        "eval_metrics": (("ctx_tok_mean", "context_tokens", "turn_mean"),
                         ("ctx_tok_max", "context_tokens", "turn_max"),
                         ("total_tok/ep", "total_tokens", "final_mean"),
                         ("prunes/ep", "prunes", "final_mean"),
                         ("correct/ep", "correct", "final_mean"),
                         ("overflow_rate", "overflows", "final_rate")),
        # `rftgym eval` passes a local policy's token counter through this option.
        "token_counter_option": "count_tokens",
        # `rftgym eval --baselines` runs these beside the agent: (label, env options, agent wrapper).
        # The no-memory run keeps no notes: a max_note_chars given for the agent's run is set back
        # to its default there, which MemoryQAConfig would otherwise refuse as unread. The pruning
        # baseline prunes, also beside an agent's run with allow_prune=False.
        "eval_baselines": (("no-memory", {"allow_prune": False, "max_note_chars": MemoryQAConfig.max_note_chars},
                            None),
                           ("heuristic-prune", {"allow_prune": True},
                            "rftgym.agents.memory_baselines:HeuristicPruner")),
        # what its episodes give beyond the reward: the agent's context edits, whose segments DCPO trains
        "train_signals": frozenset({"context_edits"}),
        # how a remote retriever is reached, not what it serves: `rftgym eval --resume` does not compare them
        "transport_options": ("retriever_url", "retriever_timeout_s", "retriever_retries"),
    }

    def __init__(self, render_mode: str | None = None, **config: Any):
        check_render_mode(render_mode, self.metadata)
        self.config = cfg = resolve_config(MemoryQAConfig, config)
        self.render_mode = render_mode
        self.count_tokens = cfg.count_tokens or estimate_tokens
        self.world: World | None = None
        self.pool = None
        if cfg.dataset_path is None:
            self.world = World(cfg.world_seed, cfg.world_size)
            documents = self.world.documents
        else:
            self.pool = load_question_pool(cfg.dataset_path)  # a missing, empty or malformed file says so here
            if not has_own_corpus(cfg.dataset_path):  # its corpus is the questions' own paragraphs
                raise ConfigError(f"{cfg.dataset_path} holds questions without their own paragraphs (NQ-style); "
                                  "MemoryQA builds its corpus from them, so give a HotpotQA, MuSiQue or 2Wiki file "
                                  "as dataset_path (and distractors, if any, as corpus_path)")
            if max(cfg.objectives) > len(self.pool):
                raise ConfigError(f"objectives={list(cfg.objectives)} but {cfg.dataset_path} has {len(self.pool)} "
                                  "answerable questions")
            documents = build_corpus(cfg.dataset_path, cfg.corpus_path, cfg.max_distractors)
        self._documents = documents
        self._open_resources()
        longest_title = max(len(d.title) for d in documents)
        longest_task = 100 + max(cfg.objectives) * (2_000 if self.pool is not None else 300)
        self.observation_space, self.action_space = chat_spaces(
            max_messages=2 + 2 * cfg.max_turns + cfg.max_tool_calls, max_action_chars=cfg.max_action_chars,
            longest_message=max(len(cfg.prompt() or ""), longest_task,
                                MAX_QUERY_CHARS + 100 + cfg.top_k * (longest_title + cfg.max_doc_chars + 24)))
        self.task: MemoryTask | None = None
        self._warned_start_over_budget = False
        self._context = Context()
        self._ids: MessageIds | None = None
        self._done = False

    # ------------------------------------------------------------------ gymnasium API

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        self.check_open("reset")
        super().reset(seed=seed)
        # A reset that raises (a bad option, a data error, a token count) leaves no episode to step:
        # not the last one, nor the part of the new one made before it raised.
        self.task, self._context, self._done = None, Context(), True
        self.task = self._draw_task(reset_options(options))
        self._ids = MessageIds.from_rng(self.np_random)
        messages = []
        prompt = self.config.prompt()
        if prompt:
            messages.append(self._ids.message("system", prompt))
        messages.append(self._ids.message("user", self.task.prompt()))
        self._context = Context(tuple(messages))
        self._task_message_ids = tuple(m.id for m in messages)
        self._prunable: dict[str, str] = {}  # result / memory id -> id of the message holding it
        self._next_result = self._next_memory = 1
        self._turn = self._searches = self._tool_calls = self._prunes = self._overflows = 0
        self._total_tokens = self._peak_tokens = 0
        self._pruned_ids: list[str] = []
        self._status_ids: set[str] = set()  # the env's status messages: not the agent's to budget
        # Each assistant turn in the context -> the search batches it brought in (see _spent_turns).
        self._turn_batches: dict[str, tuple[str, ...]] = {}
        self._answers: dict[int, str] = {}
        self._correct: dict[int, bool] = {}
        self._paid = 0.0  # the score paid out so far
        self._observation_tokens = self._budget_tokens = self._tokens(self._context)
        budget = self.config.max_context_tokens
        over_budget = budget is not None and self._budget_tokens > budget
        if over_budget and not self._warned_start_over_budget:  # once per env: a setting, not an episode
            self._warned_start_over_budget = True
            warn_caller(f"MemoryQA task {self.task.id}: its first observation is {self._budget_tokens} tokens, over "
                        f"max_context_tokens={budget}, so its episodes overflow on the first turn whatever the "
                        "agent does; raise max_context_tokens, or give fewer objectives")
        self._done = False
        if self.render_mode == "human":
            self.render()
        return self._context, self._info(_Turn(), context_tokens=0, over_budget=over_budget)

    def step(self, action: str):
        self.check_open("step")
        check_step_call(self.task is not None, self._done, action)
        with episode_ends_on_error(self):
            return self._step(action)

    def _step(self, action: str):
        self._turn += 1
        # Measured again now rather than reusing the last step's count, so that a counter whose
        # result changes once the agent has seen its reply (a cache, a binding) is honoured.
        context_tokens = self._tokens(self._context)
        self._total_tokens += context_tokens
        self._peak_tokens = max(self._peak_tokens, context_tokens)
        action, cut = read_action(action, self.config.max_action_chars)
        assistant = self._ids.message("assistant", action)
        answered_before = len(self._answers)
        turn = self._play(action)
        turn.problems[:0] = cut

        terminated = len(self._answers) == len(self.task.objectives)
        if turn.deleted:  # the context is edited anyway: the stale statuses go with the pruned messages
            turn.deleted.extend(sorted(self._status_ids))
            self._status_ids.clear()
            turn.deleted_turns = self._spent_turns()
            turn.deleted.extend(turn.deleted_turns)
        if len(self._answers) == answered_before:  # a turn that recorded an answer stays: it shows what it answered
            self._turn_batches[assistant.id] = tuple(m.id for m in turn.new_messages
                                                     if context_ops.is_results(m.content))
        context = self._context.without(turn.deleted).appended(assistant, *turn.new_messages)
        # The budget is the agent's: it counts what the agent can prune, not the env's statuses.
        budget_tokens = self._tokens(context.without(self._status_ids) if self._status_ids else context)
        budget = self.config.max_context_tokens
        near_budget = budget is not None and budget_tokens >= WARN_FRACTION * budget
        over_budget = budget is not None and budget_tokens > budget
        cut_by_budget = over_budget and self.config.on_context_overflow == "truncate"
        truncated = not terminated and (self._turn >= self.config.max_turns or cut_by_budget)
        if turn.notes or turn.problems or near_budget or truncated:
            status = self._ids.message("user", self._status(turn, budget_tokens, terminated, truncated))
            self._status_ids.add(status.id)
            context = context.appended(status)
        observation_tokens = self._tokens(context)
        reward = 0.0
        if over_budget:
            self._overflows += 1
            reward -= float(self.config.overflow_penalty)
        score = self._score()
        reward += score - self._paid
        self._paid = score
        self._context = context
        self._observation_tokens, self._budget_tokens = observation_tokens, budget_tokens
        self._done = terminated or truncated
        info = self._info(turn, context_tokens=context_tokens, over_budget=over_budget)
        if self.render_mode == "human":
            self.render()
        return self._context, float(reward), bool(terminated), bool(truncated), info

    def render(self) -> str | None:
        self.check_open("render")  # (a closed env's context is gone: it would show an empty one)
        return render_context(self._context, self.render_mode)

    def _free_resources(self) -> None:  # on close()
        self._release_shares()  # the last env holding the retriever closes it
        self._context = Context()

    def _open_resources(self) -> None:
        serve = None
        if self.config.corpus_path is not None:  # the dataset's paragraphs and then corpus_path's: no one file
            serve = ("rftgym serve-retriever --corpus FILE, FILE holding the dataset's paragraphs and the first "
                     "max_distractors documents of corpus_path")
        retriever, owned = open_retriever(self.config, self._documents, corpus_source(self.config), serve)
        self.retriever = retriever
        self._retriever_share = Share(retriever, self) if owned else None  # None: the caller's to close

    # ------------------------------------------------------------------ the protocol

    def _play(self, action: str) -> _Turn:
        turn = _Turn()
        parsed = parse_tags(action, self.config.tags, may_be_empty=("prune",))  # a prune without a note
        turn.problems.extend(dict.fromkeys(
            # a reply cut at the token limit most often leaves a long note open
            problem + " (if the reply was cut off at its length limit, keep the note shorter)"
            if problem == never_closed("prune") else problem for problem in parsed.problems))
        visible = dict(self._prunable)  # what the observation showed: prunes can name only these
        handled = 0
        for tag in parsed.tags:
            if tag.name == "think" or not tag.closed:
                continue  # unclosed tags are already reported by the parser and never run
            handled += 1
            if handled > MAX_TAGS_PER_TURN:
                turn.problems.append(TOO_MANY_TAGS)
                break
            if parsed.inside_closed(tag, "think"):
                if not _given_after(parsed, tag):  # a draft the turn then gives for real is no problem
                    turn.problems.append(f"a <{tag.name}> inside <think> was not run")
            elif tag.name == "search":
                self._search(tag.text, turn)
            elif tag.name == "prune":
                self._prune(tag, visible, turn)
            else:
                self._answer(tag, turn)
        if not turn.problems and not any(tag.name != "think" for tag in parsed.tags):
            # Plain text or only <think>: nothing happened, and the agent is told so (a status message).
            turn.problems.append(nothing_done(parsed, ("search", "prune", "answer"),
                                              "the turn had no <search>, <prune> or <answer>, so nothing was done"))
        return turn

    def _take_tool_call(self, kind: str, turn: _Turn) -> bool:
        if self._tool_calls >= self.config.max_tool_calls:
            turn.notes.append(f"Tool call limit reached ({self.config.max_tool_calls}); a {kind} was not run. "
                              "Answer the remaining questions.")
            return False
        self._tool_calls += 1
        return True

    def _search(self, query: str, turn: _Turn) -> None:
        query = without_tool_markup(query, self.config.tags)  # a call inside a query is not part of it
        if not query:
            turn.problems.append("an empty <search> was not run")
            return
        if not self._take_tool_call("search", turn):
            return
        query = query[:MAX_QUERY_CHARS]
        hits = self.retriever.search([query], self.config.top_k)[0]
        ids = [f"r{self._next_result + i}" for i in range(max(1, len(hits)))]
        self._next_result += len(ids)
        message = self._ids.message("user", context_ops.format_results(query, hits, ids, self.config.max_doc_chars))
        self._searches += 1
        for rid in ids:
            self._prunable[rid] = message.id
        turn.new_messages.append(message)
        turn.queries.append(query)
        turn.result_ids.extend(ids)

    def _prune(self, tag, visible: dict[str, str], turn: _Turn) -> None:
        if not self.config.allow_prune:
            self._prune_error("pruning is turned off in this environment; the <prune> was ignored", turn)
            return
        if not self._take_tool_call("prune", turn):
            return
        if sum(name == "ids" for name, _ in tag.attrs) > 1:
            self._prune_error('the <prune> has more than one ids attribute; list every id in one, ids="r1,r2"', turn)
            return
        if other := next((name for name, _ in tag.attrs if name != "ids"), None):
            self._prune_error(f'the <prune> has an attribute {other[:40]}=, which it does not read; give only '
                              'ids="r1,r2", and the note between <prune …> and </prune>', turn)
            return
        if stray := tag.stray_attribute_text:
            self._prune_error(f'the <prune> tag holds "{stray[:60]}" outside its ids attribute; list every id in '
                              'it, quoted: ids="r1,r2"', turn)
            return
        named = context_ops.parse_prune_ids(tag.attr("ids"))
        # Ids already pruned earlier in this turn are no longer there to prune.
        still_visible = {k: v for k, v in visible.items() if k in self._prunable}
        check = context_ops.check_prune(named, still_visible, self._protected())
        if check.error is not None:
            self._prune_error(check.error, turn)
            return
        doomed = set(check.message_ids)
        removed = [k for k, v in self._prunable.items() if v in doomed]
        for key in removed:
            del self._prunable[key]
        turn.deleted.extend(check.message_ids)
        self._pruned_ids.extend(removed)
        self._prunes += 1
        # The note is what the agent keeps to read; tool tags inside it ran (or were refused) as tags.
        note = without_tool_markup(tag.text, ("search", "prune", "answer"))
        note = note[: self.config.max_note_chars]
        note_id = None
        if note:
            note_id = f"m{self._next_memory}"
            self._next_memory += 1
            message = self._ids.message("user", context_ops.format_memory(note_id, note))
            self._prunable[note_id] = message.id
            turn.new_messages.append(message)
        turn.pruned.append({"named": named, "removed_ids": removed, "message_ids": list(check.message_ids),
                            "note_id": note_id, "note": note or None})
        if note_id is None:  # a note is its own confirmation
            turn.notes.append(f"Pruned {', '.join(removed)}; no note was kept.")

    def _spent_turns(self) -> list[str]:
        """The earlier assistant turns a pruning turn deletes besides the messages it names: each
        whose search batches are all gone now (pruned, this turn or before), as MemAct's prune
        deletes a tool call with its result; a turn that searched nothing goes at the first prune
        after it (its notes stay as ``[memory m…]`` messages). Turns that recorded an answer are
        not in ``_turn_batches``: they stay. Without this the agent's own turns (its reasoning
        above all) would fill a budget it could never free."""
        held = set(self._prunable.values())  # the messages whose ids can still be pruned
        spent = [turn_id for turn_id, batches in self._turn_batches.items() if held.isdisjoint(batches)]
        for turn_id in spent:
            del self._turn_batches[turn_id]
        return spent

    def _prune_error(self, error: str, turn: _Turn) -> None:
        turn.prune_errors.append(error)
        turn.problems.append(f"prune refused: {error}")

    def _protected(self) -> dict[str, str]:
        protected = {"task": "the task", "question": "the task", "system": "the system message"}
        for k in range(1, len(self.task.objectives) + 1):
            protected[str(k)] = protected[f"q{k}"] = f"objective {k} of the task"
        for message in self._context:
            what = ("the system message" if message.role == "system" else "the task"
                    if message.id in self._task_message_ids else f"a {message.role} message")
            protected[message.id.lower()] = what
        return protected

    def _answer(self, tag, turn: _Turn) -> None:
        k = self._objective_number(tag.attr("id"))
        count = len(self.task.objectives)
        if k is None:
            turn.problems.append(f'an <answer> needs id="N" with N from 1 to {count}; it was not recorded')
        elif not (text := without_tool_markup(tag.text, self.config.tags)):
            turn.problems.append(f"the answer to objective {k} is empty; it was not recorded")
        elif k in self._answers:
            turn.problems.append(f"objective {k} was already answered; the first answer stands")
        else:
            self._answers[k] = text
            golds = self.task.objectives[k - 1].answers
            if self.config.answer_metric == "em":
                self._correct[k] = best_score("em", text, golds) == 1.0
            else:
                self._correct[k] = best_score("f1", text, golds) >= self.config.f1_threshold
            turn.notes.append(f"Answer to question {k} recorded.")

    def _objective_number(self, raw: str | None) -> int | None:
        count = len(self.task.objectives)
        if raw is None or not raw.strip():
            return 1 if count == 1 else None
        text = raw.strip().lower().lstrip("q#")
        if text.isdecimal() and 1 <= int(text) <= count:  # not isdigit: "²" is a digit int() refuses
            return int(text)
        return None

    def _score(self) -> float:
        correct = sum(self._correct.values())
        count = len(self.task.objectives)
        if self.config.reward_mode == "all_or_nothing":
            return float(correct == count)
        return correct / count

    def _status(self, turn: _Turn, tokens: int, terminated: bool, truncated: bool = False) -> str:
        lines = list(dict.fromkeys(turn.notes))
        if turn.problems:
            lines.append(f"Problems: {summarize_problems(turn.problems)}.")
        budget = self.config.max_context_tokens
        count = len(self.task.objectives)
        lines.append(f"Context: {tokens} of {budget if budget is not None else 'unlimited'} tokens. "
                     f"Turn {self._turn} of {self.config.max_turns}; "
                     f"{self.config.max_tool_calls - self._tool_calls} tool calls left. "
                     f"Answered {len(self._answers)} of {count} questions.")
        over_budget = budget is not None and tokens > budget
        if terminated:
            lines.append("All questions are answered; the task is over.")
        elif truncated:
            lines.append("The context is over its budget, so the task ends here." if over_budget and
                         self.config.on_context_overflow == "truncate" else "That was the last turn; the task is over.")
        elif over_budget:
            lines.append("The context is over its budget: prune results you no longer need."
                         if self.config.allow_prune else "The context is over its budget.")
        return "[env] " + "\n".join(lines)

    # ------------------------------------------------------------------ helpers

    def _tokens(self, context: Context) -> int:
        """``count_tokens(context)``, held to what it promises: a count, not another value that
        would compare or add wrongly further on."""
        count = self.count_tokens(context)
        if not is_int(count) or count < 0:
            raise ValueError(f"count_tokens returned {count!r} for a context of {len(context)} messages; it must return "
                             "the context's number of tokens, a non-negative int")
        return int(count)

    def _draw_task(self, options: dict[str, Any]) -> MemoryTask:
        check_reset_options(options, from_dataset=self.pool is not None,
                            dataset_options=("question_indices", "objectives"), generator_options=("objectives", "hops"))
        if self.pool is not None:
            indices = options.get("question_indices")
            if indices is not None and options.get("objectives") is not None:
                raise ValueError("give question_indices (the questions themselves) or objectives (how many to "
                                 "draw), not both")
            if indices is None:
                objectives = self._option_int(options, "objectives", self.config.objectives, 1, 20)
                indices = draw_indices(self.np_random, len(self.pool), objectives)
            return compose_task(self.pool, indices)
        objectives = self._option_int(options, "objectives", self.config.objectives, 1, 20)
        hops = options.get("hops")
        try:
            hops = self.config.hops if hops is None else int_tuple(hops)
        except TypeError:
            hops = ()
        if not hops or not all(1 <= h <= MAX_HOPS for h in hops):
            raise ValueError(f"hops must be an int (or ints) in [1, {MAX_HOPS}], got {options.get('hops')!r}")
        return generate_task(self.world, self.np_random, objectives, hops)

    def _option_int(self, options, name, choices, low, high) -> int:
        value = options.get(name)
        if value is None:
            return int(choices[int(self.np_random.integers(len(choices)))])
        if not is_int(value) or not low <= value <= high:
            raise ValueError(f"{name} must be an int in [{low}, {high}], got {value!r}")
        return int(value)

    def _info(self, turn: _Turn, *, context_tokens: int, over_budget: bool = False) -> dict[str, Any]:
        info = {
            "task_id": self.task.id,
            "objectives": len(self.task.objectives),
            "hops": list(self.task.hops),
            "turn": self._turn,
            "context_tokens": int(context_tokens),
            "observation_tokens": int(self._observation_tokens),
            "peak_context_tokens": int(self._peak_tokens),
            "total_tokens": int(self._total_tokens),
            "context_budget": self.config.max_context_tokens,
            "budget_tokens": int(self._budget_tokens),
            "over_budget": bool(over_budget),
            "overflows": self._overflows,
            "searches": self._searches,
            "tool_calls": self._tool_calls,
            "queries": list(turn.queries),
            "result_ids": list(turn.result_ids),
            "prunes": self._prunes,
            "pruned": [dict(p) for p in turn.pruned],
            "pruned_ids": list(self._pruned_ids),
            "turns_deleted": len(turn.deleted_turns),
            "memory_notes": sum(1 for key in self._prunable if key.startswith("m")),
            "prune_error": summarize_problems(turn.prune_errors),  # distinct, as format_error
            "format_error": summarize_problems(turn.problems),
            "answers": {str(k): v for k, v in sorted(self._answers.items())},
            "answered": len(self._answers),
            "correct": sum(self._correct.values()),
            "score": self._score(),
            "success": len(self._correct) == len(self.task.objectives) and all(self._correct.values()),
        }
        if self._done:
            info["expected"] = {str(k): list(q.answers) for k, q in enumerate(self.task.objectives, start=1)}
        return info
