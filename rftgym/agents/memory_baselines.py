"""Baselines for ``rftgym/MemoryQA-v0``, so the value of learned pruning can be measured.

* No memory: the same env with ``allow_prune=False`` (the prune tool is hidden from the system
  prompt and refused), as MemAct trained half its rollouts. That is an env option, not an agent.
* :class:`HeuristicPruner`: wraps ANY agent and prunes by age. Before each turn it looks at the
  context; the *age* of a search-result message is the number of assistant messages after it in the
  context (turns the agent has acted with it in view, of those the env has not deleted). If at least
  ``min_stale`` result messages have age ``>= keep_turns`` (defaults 2 and 1), the wrapper answers
  this turn itself with one ``<prune ids="…">note</prune>`` naming the first result id of each of
  them, instead of asking the wrapped agent; otherwise it delegates, and always right after its own
  prune and for good once one of its prunes was refused (an id it named is still in view: the env's
  tool calls ran out, say), so that a refused prune is never sent again. The note is ``Title: first
  sentence`` of the top hit of each pruned batch, joined by ``"; "`` and cut to ``note_chars``.
* :class:`WorldOracleAgent`: a scripted searcher that knows the generated world: it resolves each
  objective's chain from the question text, searches every entity of the chain by name in order,
  and answers an objective as soon as its chain has been searched (in the same turn as the next
  search). It works under any memory policy: it remembers the names it has searched in each
  episode itself (keyed by the episode's task message, whose id is unique to the episode), as
  a prune deletes a search's turn with its results and a note need not name them; answers it
  has given are read from its turns, which the env keeps. (Two episodes run at once with the
  same seed share those ids: give such a run one oracle per episode.)
"""

from __future__ import annotations

import re
from typing import Mapping, Sequence

from ..core.messages import Context
from ..core.tags import parse_tags
from ..core.values import is_int
from ..envs.memory import context_ops
from ..envs.search.world import ATTRIBUTES, RELATIONS, World
from .base import Agent, AgentReply

PRUNE_FINISH_REASON = "heuristic_prune"
_TASK_LINE = re.compile(r"^(\d+)\. (.+)$", re.MULTILINE)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s")


class HeuristicPruner(Agent):
    """Prune every search result older than ``keep_turns`` turns, else let ``agent`` act."""

    def __init__(self, agent: Agent, keep_turns: int = 1, note_chars: int = 160, min_stale: int = 2):
        for name, value, low in (("keep_turns", keep_turns, 0), ("note_chars", note_chars, 0),
                                 ("min_stale", min_stale, 1)):
            if not is_int(value) or value < low:
                raise ValueError(f"{name} must be an int of at least {low}, got {value!r}")
        self.agent = agent
        self.keep_turns = keep_turns
        self.note_chars = note_chars
        self.min_stale = min_stale
        self.name = f"prune{keep_turns}+{getattr(agent, 'name', 'agent')}"

    def prune_action(self, context: Context) -> str | None:
        """The prune this wrapper would send for ``context``, or None to delegate."""
        assistants = [i for i, m in enumerate(context.messages) if m.role == "assistant"]
        own = [i for i in assistants if _is_own_prune(context.messages[i].content)]
        if own and own[-1] == assistants[-1]:
            return None
        in_view = {result_id.lower() for message in context.messages if message.role == "user"
                   for result_id, _ in context_ops.result_lines(message.content)}
        if own and in_view & set(_named_ids(context.messages[own[-1]].content)):
            return None   # that prune was refused: the next would be too
        ids, notes = [], []
        for index, message in enumerate(context.messages):
            lines = context_ops.result_lines(message.content) if message.role == "user" else []
            if not lines:
                continue
            age = sum(1 for a in assistants if a > index)
            if age >= self.keep_turns:
                ids.append(lines[0][0])
                if not lines[0][1].startswith("(no documents"):
                    notes.append(_first_sentence(lines[0][1]))
        if len(ids) < self.min_stale:
            return None
        note = "; ".join(notes)[: self.note_chars]
        return f'<prune ids="{",".join(ids)}">{note}</prune>'

    @property
    def token_level(self) -> bool:  # type: ignore[override]
        return bool(getattr(self.agent, "token_level", False))

    @property
    def keyed_sampling(self) -> bool:  # type: ignore[override]
        return bool(getattr(self.agent, "keyed_sampling", False))

    def act(self, contexts: Sequence[Context], *, sample_keys: Sequence | None = None) -> list[AgentReply]:
        return self._act(contexts, None, sample_keys)

    def act_tokens(self, contexts: Sequence[Context], sampled_spans: Sequence[Mapping], *,
                   sample_keys: Sequence | None = None) -> list[AgentReply]:
        return self._act(contexts, sampled_spans, sample_keys)

    def _act(self, contexts: Sequence[Context], sampled_spans: Sequence[Mapping] | None,
             sample_keys: Sequence | None) -> list[AgentReply]:
        replies: list[AgentReply | None] = [None] * len(contexts)
        delegated = []
        for i, context in enumerate(contexts):
            action = self.prune_action(context)
            if action is None:
                delegated.append(i)
            else:  # no tokens: the wrapper's own turns are not trained
                replies[i] = AgentReply(text=action, finish_reason=PRUNE_FINISH_REASON)
        if delegated:
            chosen = [contexts[i] for i in delegated]
            # The wrapped agent's replies keep their episodes' keys (the engine passes them only
            # when that agent samples by key).
            keyed = {} if sample_keys is None else {"sample_keys": [sample_keys[i] for i in delegated]}
            if sampled_spans is None:
                inner = self.agent.act(chosen, **keyed)
            else:
                inner = self.agent.act_tokens(chosen, [sampled_spans[i] for i in delegated], **keyed)
            for i, reply in zip(delegated, inner):
                replies[i] = reply
        return replies  # type: ignore[return-value]

    def assistant_span(self, message, reply: AgentReply):
        if reply.finish_reason == PRUNE_FINISH_REASON:
            return None
        return self.agent.assistant_span(message, reply)

    def on_assistant_message(self, message, reply: AgentReply) -> None:
        if reply.finish_reason != PRUNE_FINISH_REASON:  # the wrapped agent's own turn
            self.agent.on_assistant_message(message, reply)

    def close(self) -> None:
        self.agent.close()


def _is_own_prune(text: str) -> bool:
    return text.startswith("<prune ids=") and text.endswith("</prune>") and text.count("<prune") == 1


def _named_ids(own_prune: str) -> list[str]:
    (tag,) = parse_tags(own_prune, ("prune",)).find("prune")
    return context_ops.parse_prune_ids(tag.attr("ids"))


def _first_sentence(line: str) -> str:
    return _SENTENCE_END.split(line, maxsplit=1)[0]


# ---------------------------------------------------------------- oracle


def solve_world_question(world: World, text: str) -> tuple[list[str], str] | None:
    """(names of the chain's entities in search order, answer) for a question the world made."""
    by_name = {e.name: e for e in world.entities.values()}
    for attribute, (_, template) in ATTRIBUTES.items():
        prefix, suffix = template.split("{}")
        if not (text.startswith(prefix) and text.endswith(suffix)):
            continue
        description = text[len(prefix): len(text) - len(suffix)]
        stripped = []  # outermost relation first
        while True:
            for relation, (_, _, phrase) in RELATIONS.items():
                head = phrase.split("{}")[0]
                if description.startswith(head):
                    stripped.append(relation)
                    description = description[len(head):]
                    break
            else:
                break
        entity = by_name.get(description)
        if entity is None:
            return None
        chain = [entity]
        for relation in reversed(stripped):
            target = chain[-1].relations.get(relation)
            if target is None:
                return None
            chain.append(world.entities[target])
        if attribute not in chain[-1].attributes:
            return None
        return [e.name for e in chain], chain[-1].attributes[attribute]
    return None


class WorldOracleAgent(Agent):
    """Searches each objective's chain by entity name, then answers it from the world."""

    name = "world-oracle"

    def __init__(self, world: World):
        self.world = world
        self._searched: dict[str, set[str]] = {}  # task message id -> the names searched in its episode

    def act(self, contexts: Sequence[Context]) -> list[AgentReply]:
        return [AgentReply(text=self.reply(context), finish_reason="stop") for context in contexts]

    def reply(self, context: Context) -> str:
        task_message = next((m for m in context if m.role == "user" and m.content.startswith("Task:")), None)
        task = task_message.content if task_message is not None else ""
        key = task_message.id if task_message is not None else ""
        if not any(m.role == "assistant" for m in context):  # an episode's first turn: nothing searched yet
            self._searched.pop(key, None)
        searched, answered = self._searched.setdefault(key, set()), set()
        for message in context:
            if message.role == "assistant":
                parsed = parse_tags(message.content, ("search", "answer"))
                searched.update(t.text for t in parsed.find("search") if t.closed)
                answered.update(t.attr("id") for t in parsed.find("answer") if t.closed)
        parts, next_search = [], None
        for number, question in _TASK_LINE.findall(task):
            solution = solve_world_question(self.world, question.strip())
            names, answer = solution if solution is not None else ([], "unknown")
            missing = [n for n in names if n not in searched]
            if missing:
                next_search = next_search or missing[0]
            elif number not in answered:
                parts.append(f'<answer id="{number}">{answer}</answer>')
        if next_search is not None:
            parts.append(f"<search>{next_search}</search>")
            searched.add(next_search)
        return "".join(parts) or "<answer>unknown</answer>"
