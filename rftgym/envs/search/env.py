"""SearchEvalQA: multi-hop QA over a corpus with the Search->Evaluate protocol (after EvalAct
and AutoCoA).

Observation
    A :class:`~rftgym.core.messages.Context`: an optional system message stating the protocol,
    then the question. After each turn that does not end the episode the env appends the
    assistant's turn and one user message with, in order: protocol-violation notices, the hint for
    this turn's evaluation, format problems, and the results of this turn's search.

Action
    The text of one assistant turn, using these tags (reasoning may go in ``<think>…</think>``,
    where an ``<answer>`` is reasoning and is not graded):

    ``<search>query</search>``
        Runs the query; the next observation lists the top ``top_k`` documents as
        ``[i] id=<doc id> | <title>`` followed by the text cut to ``max_doc_chars``, inside
        ``<information>…</information>``. One search runs per turn.
    ``<evaluate>score: N note</evaluate>``
        Rates the last search results from 0 (useless) to 10 (answers the question). The body
        must start with an integer 0-10, optionally labelled ``score:`` and written ``N/10``
        (see :mod:`.protocol`). The next observation maps it to a hint: 0-3 low, 4-6 medium,
        7-10 high confidence.
    ``<answer>text</answer>``
        The final answer; ends the episode. For an unanswerable question the right answer is a
        refusal such as ``<answer>unknown</answer>``. An empty answer is not graded: it is
        reported (``info["format_error"]``) and the episode goes on, as is a reply with neither
        a search nor an answer.

    The protocol: the turn right after a search must *begin* with ``<evaluate>`` (leading white
    space and thinking aside: ``<think>…</think>`` blocks before it, or the text of the ``<think>``
    it sits in, or thinking opened before the reply up to its first ``</think>``; a ``</think>`` in
    a code block or at the very end of the reply closes nothing); after it, the same turn may
    search again or answer. Evaluations drafted inside a closed ``<think>`` and followed by one
    outside it that opens the turn are drafts: that one is the turn's. With ``think_opened_by_template=True`` (a
    reasoning model whose chat template opens ``<think>`` before each reply) every reply begins
    inside thinking: with ``search_in_think``, a reply that stops at ``</search>`` then searches
    inside it, as one that wrote the ``<think>`` itself does, and a reply that never closes it
    holds its ``<answer>`` in its reasoning (not graded).
    Example episode::

        assistant: <search>Alda Mertz</search>
        user:      <information>[1] id=person-3 | Alda Mertz …</information> …
        assistant: <evaluate>score: 6 gives her birthplace, Veloria</evaluate><search>Veloria</search>
        user:      Evaluation recorded: 6/10, medium confidence … <information>…</information>
        assistant: <evaluate>score: 9 Veloria lies in Tulen</evaluate><answer>Tulen</answer>

    Protocol violations: ``skipped_evaluation`` (the turn after a search does not begin with
    ``<evaluate>``), ``malformed_evaluation`` (it does, without a 0-10 score), ``double_search``
    (a search before the previous results were evaluated, also a second search in one turn) and
    ``answer_before_evaluation``. A violating action still takes effect (the search runs, the
    answer is graded), except a second search in one turn, which is not run; the observation
    restates the protocol and the episode's reward is gated.

Reward (paid on the turn that ends the episode; 0 on other turns)
    Token F1 (``reward_metric="f1"``, default) or exact match (``"em"``) of the answer against
    the gold answers, normalized as in the SQuAD/HotpotQA scripts; 1 for a refusal of an
    unanswerable question and 0 for any other answer to it. If the episode had any protocol
    violation the reward is gated once: 0 (``violation_gate="zero"``) or multiplied by a number
    in [0, 1]. Rewards lie in [0, 1].

Episode end
    ``terminated`` on an answer. ``truncated`` when ``max_turns`` turns passed, or when a search
    would exceed ``max_searches`` (with ``on_search_limit="truncate"``; the rest of that turn, an
    answer after the search too, is not played; with ``"message"`` the search is not run and the
    observation says the limit was reached, as in AutoCoA). Either way that turn's
    ``info["search_limit_reached"]`` is True.

Info keys
    ``question_id``, ``hops``, ``answerable``, ``turn``, ``searches``, ``query`` and ``doc_ids``
    (this turn's search, or None and []), ``evaluation_score`` (the 0-10 score on the turn whose
    evaluation closes a Search->Evaluate span, else None; PCAR reads it), ``evaluation_end``
    (on a turn that opens with an evaluation, scored or unreadable: the character offset in the
    action just after ``</evaluate>``, where the next span's tokens begin if the turn searches
    again; PCAR splits the turn there), ``confidence`` (low /
    medium / high, or None), ``evaluation_note``, ``protocol_violation`` (this turn's first
    violation kind, or None), ``protocol_violations`` (episode count of violating turns),
    ``segments`` (every Search->Evaluate span so far: ``search_turn``, ``query``, ``doc_ids``,
    ``evaluate_turn``, ``score``), ``answer``, ``em``, ``f1`` (answer metrics, of an answerable
    question only, 0 on a turn that gives no answer, so that an episode that ends without one scores
    0 in ``rftgym eval``'s columns: None for an unanswerable one, whose answer ``refused`` says
    whether it refused, as MuSiQue's evaluation leaves those out of answer EM and F1), ``gated``, ``format_error``,
    ``success`` (exact match, or a refusal of an unanswerable question, in an episode without a
    protocol violation; ``em`` is the match alone), ``search_limit_reached`` (this turn asked for a
    search past ``max_searches``), and ``expected`` (the gold answers) once the episode has ended.

Options to ``reset``
    ``task_index`` picks a question of a loaded dataset. Otherwise, with
    ``task_selection="seed"`` (the default) ``reset(seed=i)`` gives question ``i % len(dataset)``,
    so that ``rftgym eval`` (whose default episodes are ``eval_episodes``, the dataset's size)
    covers it once; without a seed, or with ``"random"``, the question is drawn. ``hops`` (1-4)
    and ``answerable`` override the generator's draw. A reset that raises ends the episode before
    it: step() refuses, as before a first reset, until a reset succeeds.
    After ``close()``, reset() and step() raise RuntimeError: make a new env.

Data
    With no files, questions come from a seeded generated world (:mod:`.world`; ``world_seed``,
    ``world_size``; ``hops`` is the difficulty) and BM25 runs in-process. ``dataset_path`` loads
    HotpotQA JSON (its contexts form the corpus), MuSiQue-style JSONL or NQ-style JSONL
    questions; ``corpus_path`` gives another corpus (required for NQ). ``retriever`` is
    ``bm25``, ``dense``, ``remote`` (with ``retriever_url``) or any :class:`Retriever` object,
    e.g. a :class:`CallableRetriever` whose results another model writes.

Version history
    v0: first version (2026-12-01, before any release: a dataset is served by seed, a tag inside
    another call's body is that call's text, not a call, and ``think_opened_by_template``;
    2026-12-06: a ``</think>`` that closes nothing no longer counts as thinking before the
    evaluation, drafted evaluations give way to the visible one, an answer in never-closed
    template thinking is not graded, and markup between digits is no score; 2026-12-07: the
    results of the last search allowed say to answer after the evaluation, a turn's tags past
    its 64th are ignored (said in ``format_error``), ``task_selection`` without a dataset is
    refused, and ``retriever_timeout_s`` and ``retriever_retries`` set a remote service's;
    thinking inside an ``<evaluate>`` is not its score or note, "3 of 5" is no score (as "3 out of 5"),
    a step that raises part way ends the episode, and the generated world writes "an engineer",
    where it wrote "a engineer"; ``em`` and ``f1`` are None for an unanswerable question, whose
    refusal ``refused`` reports; the generated world's river and industry questions also take "X
    river", "X industry" and "X company", as its documents say them ("the X river", "an X company");
    a draft ``<answer>`` inside ``<think>`` followed by the answer is no format error).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np

from ...core.errors import ConfigError, warn_caller
from ..common import (ANSWER_IN_THINK, ClosableEnv, chat_spaces, check_bool_options, check_generator_only,
                      check_path_options, check_render_mode, check_reset_options, check_step_call, check_task_selection,
                      covering_episodes, dataset_index, episode_ends_on_error, nothing_done, read_action,
                      render_context, reset_options, resolve_config, summarize_problems, without_elements,
                      without_tool_markup, PathsAsText, MAX_TAGS_PER_TURN, TOO_MANY_TAGS)
from ...core.messages import Context, MessageIds
from ...core.tags import never_closed, parse_tags
from ...core.values import int_tuple, is_int
from . import protocol
from ..copying import CopyableEnv, Share
from .corpora import Question, has_own_corpus, load_corpus, load_questions
from .retrievers import Hit, check_retriever_options, corpus_source, open_retriever
from .scoring import best_score, is_refusal
from .world import MAX_HOPS, World

DEFAULT_SYSTEM_PROMPT = (
    "Answer the question using a search engine. Search with <search>query</search>; the results come back "
    "inside <information></information>. Your reply right after every search must begin with "
    "<evaluate>score: N short note</evaluate>, rating the results' usefulness with an integer N from 0 to 10. "
    "Then search again or give the final answer, a short phrase, in <answer></answer>. If the question cannot "
    "be answered from the documents, answer <answer>unknown</answer>."
)
# With search_in_think=True (the default prompt only): searches go inside the model's thinking.
THINKING_SYSTEM_PROMPT = (
    "Answer the question using a search engine. Think inside <think></think>, and search from within your "
    "thinking with <search>query</search>; the results come back inside <information></information>. Your "
    "reply right after every search must begin with <evaluate>score: N short note</evaluate> (thinking in "
    "<think></think> may come first), rating the results' usefulness with an integer N from 0 to 10. Then search "
    "again or give the final answer, a short phrase, in <answer></answer>, outside <think>. If the question "
    "cannot be answered from the documents, answer <answer>unknown</answer>."
)
MAX_QUERY_CHARS = 500
CALL_TAGS = ("search", "evaluate", "answer")  # the tags that act: each on its own, never inside another


@dataclass(frozen=True)
class SearchEvalQAConfig:
    hops: tuple[int, ...] = (1, 2, 3)
    world_seed: int = 0
    world_size: int = 30
    dataset_path: str | None = None
    corpus_path: str | None = None
    task_selection: str = "seed"
    retriever: Any = "bm25"  # a name in retrievers.ENV_RETRIEVERS or a Retriever object
    retriever_url: str | None = None
    # A remote service's seconds per attempt (from connecting to the reply's last byte) and retries
    # after the first: a dense index on a busy CPU may need more than 10 s.
    retriever_timeout_s: float = 10.0
    retriever_retries: int = 2
    top_k: int = 3
    max_doc_chars: int = 300
    max_searches: int = 4
    max_turns: int = 8
    on_search_limit: str = "truncate"
    search_in_think: bool = False
    think_opened_by_template: bool = False  # each reply begins inside a <think> the chat template opened
    reward_metric: str = "f1"
    violation_gate: Any = "zero"  # "zero" or a multiplier in [0, 1]
    unanswerable_rate: float = 0.0
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT
    max_action_chars: int = 32_000
    tags: tuple[str, ...] = field(default=("search", "evaluate", "answer", "think"), init=False)

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "hops", int_tuple(self.hops))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"hops must be a list of ints in [1, {MAX_HOPS}], got {self.hops!r}") from exc
        if not self.hops or not all(1 <= h <= MAX_HOPS for h in self.hops):
            raise ConfigError(f"hops must be a non-empty list of ints in [1, {MAX_HOPS}], got {list(self.hops)}")
        for name, low in (("world_seed", 0), ("world_size", 2), ("top_k", 1), ("max_doc_chars", 20),
                          ("max_searches", 0), ("max_turns", 1), ("max_action_chars", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"{name} must be an int of at least {low}, got {value!r}")
        check_path_options(self, ("dataset_path", "corpus_path"))
        check_bool_options(self, ("search_in_think", "think_opened_by_template"))
        check_task_selection(self, generated=self.dataset_path is None)
        check_generator_only(self, ("hops", "world_seed", "world_size"))
        check_retriever_options(self)
        if self.on_search_limit not in ("truncate", "message"):
            raise ConfigError(f"on_search_limit must be 'truncate' or 'message', got {self.on_search_limit!r}")
        if self.reward_metric not in ("f1", "em"):
            raise ConfigError(f"reward_metric must be 'f1' or 'em', got {self.reward_metric!r}")
        gate = self.violation_gate
        if gate != "zero" and (isinstance(gate, bool) or not isinstance(gate, (int, float)) or not 0 <= gate <= 1):
            raise ConfigError(f"violation_gate must be 'zero' or a multiplier in [0, 1], got {gate!r}")
        rate = self.unanswerable_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
            raise ConfigError(f"unanswerable_rate must be in [0, 1], got {rate!r}")
        if rate > 0 and self.dataset_path is not None:
            raise ConfigError("unanswerable_rate applies to the generated world only; set it to 0 with dataset_path")
        if self.corpus_path is not None and self.dataset_path is None:
            raise ConfigError("corpus_path needs dataset_path (the questions); without both, the generated world is used")
        if self.system_prompt is not None and not isinstance(self.system_prompt, str):
            raise ConfigError(f"system_prompt must be a string or None, got {type(self.system_prompt).__name__}")

    @property
    def gate_multiplier(self) -> float:
        return 0.0 if self.violation_gate == "zero" else float(self.violation_gate)


class SearchEvalQAEnv(CopyableEnv, ClosableEnv, PathsAsText, gym.Env[Context, str]):
    """Multi-hop QA where every search must be followed at once by an evaluation.

    ``copy.deepcopy(env)`` branches an episode (the copies share the retriever) and ``pickle``
    sends one to another process (see :mod:`rftgym.envs.copying`)."""

    shared_attributes = ("config", "world", "questions", "_documents")
    resource_attributes = ("retriever", "_retriever_share")

    metadata = {
        "render_modes": ["ansi", "human"],
        "render_fps": 4,
        # Columns `rftgym eval` adds for this env: (column, info key, reducer in rollout.metrics).
        "eval_metrics": (("em", "em", "final_mean"), ("f1", "f1", "final_mean"),
                         ("searches/ep", "searches", "final_mean"),
                         ("violation_rate", "protocol_violations", "final_rate")),
        # what its episodes give beyond the reward: each evaluated search's score, which PCAR uses
        "train_signals": frozenset({"evaluation_score"}),
        # how a remote retriever is reached, not what it serves: `rftgym eval --resume` does not compare them
        "transport_options": ("retriever_url", "retriever_timeout_s", "retriever_retries"),
    }

    def __init__(self, render_mode: str | None = None, **config: Any):
        check_render_mode(render_mode, self.metadata)
        self.config = cfg = resolve_config(SearchEvalQAConfig, config)
        self.render_mode = render_mode
        self.world: World | None = None
        self.questions: list[Question] | None = None
        if cfg.dataset_path is None:
            self.world = World(cfg.world_seed, cfg.world_size)
            documents = self.world.documents
        else:
            self.questions = load_questions(cfg.dataset_path)
            if cfg.corpus_path is None and not has_own_corpus(cfg.dataset_path):
                raise ConfigError(f"{cfg.dataset_path} holds questions only; give corpus_path too: the documents "
                                  "to search, as FlashRAG JSONL (one {\"id\", \"contents\"} per line, as its wiki "
                                  "corpora), a JSON list of {\"title\", \"text\"} objects, or {title: [sentences]} "
                                  "JSON")
            documents = load_corpus(cfg.corpus_path or cfg.dataset_path)
            if cfg.corpus_path is not None:
                _warn_if_no_evidence(self.questions, documents, cfg.corpus_path)
        self._documents = documents
        self._open_resources()
        # Every observation must lie in the space: the longest message is a search result (top_k
        # capped documents with titles), a question or the system prompt.
        longest_title = max(len(d.title) for d in documents)
        longest_question = max((len(q.question) for q in self.questions or ()), default=0)
        self.observation_space, self.action_space = chat_spaces(
            max_messages=2 + 2 * cfg.max_turns, max_action_chars=cfg.max_action_chars,
            longest_message=max(longest_question, len(cfg.system_prompt or ""), len(THINKING_SYSTEM_PROMPT),
                                2_000 + cfg.top_k * (longest_title + cfg.max_doc_chars + 64)))
        self.question: Question | None = None
        self._context = Context()
        self._ids: MessageIds | None = None
        self._done = False

    def _open_resources(self) -> None:
        retriever, owned = open_retriever(self.config, self._documents, corpus_source(self.config))
        self.retriever = retriever
        self._retriever_share = Share(retriever, self) if owned else None  # None: the caller's to close

    # ------------------------------------------------------------------ gymnasium API

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        self.check_open("reset")
        super().reset(seed=seed)
        # A reset that raises (a bad option, a data error) leaves no episode to step, not the last one.
        self.question, self._context = None, Context()
        self.question = self._draw_question(seed, reset_options(options))
        self._ids = MessageIds.from_rng(self.np_random)
        messages = []
        if self.config.system_prompt:
            thinking = self.config.search_in_think and self.config.system_prompt == DEFAULT_SYSTEM_PROMPT
            messages.append(self._ids.message("system", THINKING_SYSTEM_PROMPT if thinking else
                                              self.config.system_prompt))
        messages.append(self._ids.message("user", f"Question: {self.question.question}"))
        self._context = Context(tuple(messages))
        self._turn = 0
        self._searches = 0
        self._violations = 0
        self._awaiting_evaluation = False
        self._segments: list[dict[str, Any]] = []
        self._done = False
        if self.render_mode == "human":
            self.render()
        return self._context, self._info(_TurnOutcome())

    def step(self, action: str):
        self.check_open("step")
        check_step_call(self.question is not None, self._done, action)
        with episode_ends_on_error(self):
            return self._step(action)

    def _step(self, action: str):
        self._turn += 1
        action, cut = read_action(action, self.config.max_action_chars)
        context = self._context.appended(self._ids.message("assistant", action))
        outcome = self._play(action)
        outcome.problems[:0] = cut
        if outcome.violation is not None:
            self._violations += 1
        truncated = not outcome.terminated and (outcome.truncated or self._turn >= self.config.max_turns)
        reward = 0.0
        if outcome.terminated:
            outcome.gated = self._violations > 0
            reward = outcome.score * (self.config.gate_multiplier if outcome.gated else 1.0)
            # Solved within the protocol: a gated episode is no success (rejection-sampling
            # fine-tuning keeps successes, and would teach skipping the evaluations); em keeps the match.
            outcome.success = outcome.success and not outcome.gated
        self._done = outcome.terminated or truncated
        if not self._done:
            context = context.appended(self._ids.message(
                "user", outcome.feedback(searches_left=self._searches < self.config.max_searches)))
        self._context = context
        info = self._info(outcome)
        if self.render_mode == "human":
            self.render()
        return self._context, float(reward), bool(outcome.terminated), bool(truncated), info

    def render(self) -> str | None:
        self.check_open("render")  # (a closed env's context is gone: it would show an empty one)
        return render_context(self._context, self.render_mode)

    def _free_resources(self) -> None:  # on close()
        self._release_shares()  # the last env holding the retriever closes it
        self._context = Context()

    # ------------------------------------------------------------------ the protocol

    def _play(self, action: str) -> "_TurnOutcome":
        """Apply the turn's tool calls in order and say what happened."""
        out = _TurnOutcome()
        # The <think> a template opened is read as written before the reply; offsets into the
        # reply (evaluation_end) are taken back by its length.
        opened = "<think>" if self.config.think_opened_by_template else ""
        action = opened + action
        parsed = parse_tags(action, self.config.tags)
        problems = dict.fromkeys(parsed.problems)
        if self.config.search_in_think and any(t.parent == "think" and not parsed.inside_closed(t, "think")
                                               for t in parsed.find("search")):
            # Such a model stops generating at </search>, inside its open <think>: not a format error.
            problems.pop(never_closed("think"), None)
        out.problems.extend(problems)
        # An <answer> inside <think> is part of the reasoning, not the reply's answer; a call inside
        # another call's body (a guess in an evaluation's note, a search inside a query) is its text.
        # An answer wrapped twice is still answered (the outer one, once unwrapped, is empty).
        # Thinking the template opened and the reply never closed holds the whole reply (its
        # searches run, as a model that searches while thinking stops at </search>).
        open_from_template = bool(opened) and any(t.start == 0 and not t.closed for t in parsed.find("think"))
        thought = {t.start for t in parsed.find("answer") if open_from_template or parsed.inside_closed(t, "think")}
        nested = [t for t in parsed.tags if t.closed and t.name in CALL_TAGS
                  and any(parsed.inside_closed(t, outer) for outer in CALL_TAGS if not outer == t.name == "answer")]
        calls = [t for t in parsed.tags if t.closed and t.name in CALL_TAGS and t not in nested
                 and not (t.name == "answer" and t.start in thought)]
        if thought and not any(t.name == "answer" for t in calls):  # a draft, then the answer: no problem
            out.problems.append(ANSWER_IN_THINK)
        if nested:
            out.problems.append(f"a <{nested[0].name}> inside another tag's body was not run; write each "
                                "<search>, <evaluate> and <answer> on its own")
        if sum(t.name == "answer" for t in calls) > 1:  # the first one ends the episode
            out.problems.append("more than one <answer> (or one inside another); the first with text was graded")
        if not calls and not out.problems:  # e.g. plain text, or only <think>: say so, as for a format error
            out.problems.append(nothing_done(parsed, CALL_TAGS, "the reply had no <search> and no <answer>, so "
                                             "nothing was done"))
        if self._awaiting_evaluation:
            self._awaiting_evaluation = False  # owed once: a skipped evaluation is not owed forever
            drafts = _draft_evaluations(parsed, calls)
            # Evaluations drafted in a closed <think>, then one outside it that opens the turn: that
            # one is the turn's (one after visible text leaves the draft the turn's, as before).
            visible_opens = bool(drafts) and _only_thinking_before(parsed, calls[len(drafts)])
            if visible_opens:
                calls = calls[len(drafts):]
            first = calls[0] if calls else None
            if first is not None and first.name == "evaluate" \
                    and (visible_opens or _only_thinking_before(parsed, first)):
                calls = calls[1:]
                self._evaluate(first.body, out)
                out.evaluation_end = first.end - len(opened)
            else:
                # An empty answer is not graded and an empty search not run (see below): what was
                # skipped is then the evaluation.
                acted = first is not None and first.name in ("search", "answer") and first.text.strip()
                kind = {"search": "double_search", "answer": "answer_before_evaluation"}.get(
                    first.name if acted else "", "skipped_evaluation")
                out.flag(kind)
        searched = False
        if len(calls) > MAX_TAGS_PER_TURN:
            out.problems.append(TOO_MANY_TAGS)
            calls = calls[:MAX_TAGS_PER_TURN]
        for tag in calls:
            if tag.name == "evaluate":
                out.problems.append("an <evaluate> that does not open the turn right after a search was ignored")
            elif tag.name == "search":
                if searched:
                    out.flag("double_search")
                    out.problems.append("only one search runs per turn; the later ones were not run")
                # An open <think> counts here: a model that searches while thinking stops generating
                # at </search>, before it could close </think>.
                elif self.config.search_in_think and tag.parent != "think":
                    out.problems.append("searches go inside <think>…</think> here; this one was not run")
                else:
                    searched = self._search(without_tool_markup(tag.text, self.config.tags), out)
                    if out.truncated:
                        return out
            elif not (answer := without_tool_markup(tag.text, self.config.tags)):  # empty or markup only: none
                out.problems.append("an empty <answer> was not graded; put the answer inside <answer>…</answer>")
            else:
                if searched:
                    out.flag("answer_before_evaluation")
                self._answer(answer, out)
                return out
        if searched:
            self._awaiting_evaluation = True
        return out

    def _evaluate(self, body: str, out: "_TurnOutcome") -> None:
        # Thinking inside the evaluation is not part of its score or note.
        parsed = protocol.parse_evaluation(without_elements(body, ("think",), unclosed=True))
        if parsed is None:
            out.flag("malformed_evaluation")
            return
        score, note = parsed
        out.evaluation_score, out.evaluation_note = score, note
        out.notes.append(protocol.hint_message(score, self._searches < self.config.max_searches))
        self._segments[-1].update(evaluate_turn=self._turn, score=score)

    def _search(self, query: str, out: "_TurnOutcome") -> bool:
        if not query:
            out.problems.append("an empty <search> was not run")
            return False
        if self._searches >= self.config.max_searches:
            out.past_search_limit = True
            if self.config.on_search_limit == "truncate":
                out.truncated = True  # the rest of the turn (an answer after the search too) is not played
            else:
                out.notes.append(f"Search limit reached ({self.config.max_searches} searches); the search was not "
                                 "run. Give your final answer in <answer>…</answer>.")
            return False
        if len(query) > MAX_QUERY_CHARS:
            out.notes.append(f"Your query was {len(query)} characters long; only its first {MAX_QUERY_CHARS} were "
                             "searched. A query of a few words finds more.")
            query = query[:MAX_QUERY_CHARS]
        hits = self.retriever.search([query], self.config.top_k)[0]
        self._searches += 1
        out.query, out.doc_ids = query, [h.doc_id for h in hits]
        out.results = self._format_results(hits)
        self._segments.append({"search_turn": self._turn, "query": query, "doc_ids": list(out.doc_ids),
                               "evaluate_turn": None, "score": None})
        return True

    def _format_results(self, hits: list[Hit]) -> str:
        if not hits:
            return "<information>\nNo documents matched the query.\n</information>"
        cap = self.config.max_doc_chars
        lines = []
        for rank, hit in enumerate(hits, start=1):
            text = hit.text if len(hit.text) <= cap else hit.text[: cap - 1].rstrip() + "…"
            lines.append(f"[{rank}] id={hit.doc_id} | {hit.title}\n{text}")
        return "<information>\n" + "\n".join(lines) + "\n</information>"

    def _answer(self, answer: str, out: "_TurnOutcome") -> None:
        out.answer, out.terminated = answer, True
        if self.question.answerable:
            out.em = best_score("em", answer, self.question.answers)
            out.f1 = best_score("f1", answer, self.question.answers)
            out.success = out.em == 1.0
            out.score = out.em if self.config.reward_metric == "em" else out.f1
        else:
            # Answer metrics are over answerable questions only (MuSiQue's own evaluation): a refusal
            # is paid, and reported as refused, not as an exact match.
            out.refused = is_refusal(answer)
            out.success = out.refused
            out.score = float(out.refused)

    # ------------------------------------------------------------------ helpers

    @property
    def eval_episodes(self) -> int | None:
        return covering_episodes(self.questions, self.config.task_selection)

    def _draw_question(self, seed: int | None, options: dict[str, Any]) -> Question:
        check_reset_options(options, from_dataset=self.questions is not None, generator_options=("hops", "answerable"))
        if self.questions is not None:
            return self.questions[dataset_index(options, len(self.questions), self.np_random, seed,
                                                self.config.task_selection)]
        hops = options.get("hops")
        if hops is None:
            hops = self.config.hops[int(self.np_random.integers(len(self.config.hops)))]
        if not is_int(hops) or not 1 <= hops <= MAX_HOPS:
            raise ValueError(f"hops must be an int in [1, {MAX_HOPS}], got {hops!r}")
        answerable = options.get("answerable")
        if answerable is None:
            answerable = not (self.np_random.random() < self.config.unanswerable_rate)
        if not isinstance(answerable, (bool, np.bool_)):  # bool("no") is True
            raise ValueError(f"answerable must be True or False, got {answerable!r}")
        return self.world.question(self.np_random, int(hops), answerable=bool(answerable))

    def _info(self, out: "_TurnOutcome") -> dict[str, Any]:
        info = {
            "question_id": self.question.id,
            "hops": self.question.hops,
            "answerable": self.question.answerable,
            "turn": self._turn,
            "searches": self._searches,
            "query": out.query,
            "doc_ids": list(out.doc_ids),
            "evaluation_score": out.evaluation_score,
            "confidence": None if out.evaluation_score is None else protocol.confidence(out.evaluation_score),
            "evaluation_note": out.evaluation_note,
            "evaluation_end": out.evaluation_end,
            "protocol_violation": out.violation,
            "protocol_violations": self._violations,
            "segments": [dict(s) for s in self._segments],
            "answer": out.answer,
            "em": out.em if self.question.answerable else None,
            "f1": out.f1 if self.question.answerable else None,
            "refused": out.refused,
            "gated": out.gated,
            # A malformed evaluation is also a format error (the observation says it once, as a violation).
            "format_error": summarize_problems(out.problems + [protocol.VIOLATION_MESSAGES[kind] for kind in
                                                               out.violation_kinds if kind == "malformed_evaluation"]),
            "success": out.success,
            "search_limit_reached": out.past_search_limit,
        }
        if self._done:
            info["expected"] = list(self.question.answers)
        return info


def _only_thinking_before(parsed, tag) -> bool:
    """Whether only white space and thinking come before ``tag`` (a turn's ``<evaluate>``) in the
    parsed reply: ``<think>`` blocks (any case, nested too), the text of a ``<think>`` still open
    around it, and thinking opened before the reply (by the template, or carried over from the
    turn before), which the parser reads up to the reply's first ``</think>``. A ``</think>`` in a
    code block, one that ends the reply or a second stray one closes nothing: the text before it
    is visible."""
    text, position = tag.source, 0
    for think in sorted(parsed.find("think"), key=lambda t: t.start):
        if think.start >= tag.start:
            break
        if text[position:think.start].strip():
            return False
        position = max(position, min(think.end, tag.start))
    return not text[position:tag.start].strip()


def _draft_evaluations(parsed, calls: list) -> list:
    """The evaluations that open ``calls`` inside a closed ``<think>`` when an ``<evaluate>``
    outside one follows them before any other call: drafts, and the later one is the turn's
    evaluation. Empty otherwise (a model that evaluates only while thinking keeps its evaluation)."""
    drafts = []
    for call in calls:
        if call.name != "evaluate":
            return []
        if not parsed.inside_closed(call, "think"):
            return drafts
        drafts.append(call)
    return []


def _warn_if_no_evidence(questions: list[Question], documents, corpus_path: str) -> None:
    """``corpus_path`` replaces the questions' own paragraphs as the corpus searched (as in
    Search-R1, where a Wikipedia dump serves every dataset). A corpus that holds none of the
    documents the questions name as evidence makes every question unanswerable from retrieval:
    most likely the corpus of another dataset."""
    def norm(title: str) -> str:  # as a retriever would still find it: case, spaces, underscores aside
        return " ".join(title.replace("_", " ").casefold().split())

    gold = {norm(title) for q in questions for title in q.gold_titles}
    if gold and not any(norm(d.title) in gold for d in documents):
        warn_caller(f"corpus_path {corpus_path} holds none of the {len(gold)} documents the questions name as "
                    "evidence (by title); it replaces the questions' own paragraphs, so retrieval cannot find "
                    "their evidence. Is it the corpus of another dataset? Leave corpus_path out to search the "
                    "questions' own paragraphs")


@dataclass
class _TurnOutcome:
    """What one turn did, collected while its tool calls are applied."""

    violation: str | None = None
    violation_kinds: list[str] = field(default_factory=list)
    evaluation_score: int | None = None
    evaluation_note: str | None = None
    evaluation_end: int | None = None
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    query: str | None = None
    doc_ids: list[str] = field(default_factory=list)
    results: str | None = None
    answer: str | None = None
    em: float = 0.0
    f1: float = 0.0
    refused: bool | None = None  # whether the answer to an unanswerable question refused (None: no such answer)
    score: float = 0.0
    success: bool = False
    gated: bool = False
    terminated: bool = False
    truncated: bool = False
    past_search_limit: bool = False  # a search past max_searches (with "message", its note says to answer)

    def flag(self, kind: str) -> None:
        self.violation = self.violation or kind
        if kind not in self.violation_kinds:
            self.violation_kinds.append(kind)

    def feedback(self, searches_left: bool = True) -> str:
        parts = [protocol.violation_message(kind) for kind in self.violation_kinds]
        parts += self.notes
        if self.problems:
            parts.append(f"Format problems: {summarize_problems(self.problems)}.")
        if self.results is not None:
            parts += [self.results, protocol.EVALUATE_REMINDER]
            if not searches_left:
                parts.append(protocol.LAST_RESULTS)
        elif not self.past_search_limit:  # its note already says to answer (or the episode is over)
            parts.append(protocol.CONTINUE_PROMPT if searches_left else protocol.ANSWER_PROMPT)
        return "\n\n".join(parts)

