"""Exact chat tokens: a context's token ids are the concatenation of per-message spans.

A span is what the chat template renders for one message, tokenized once and cached by the
message's id and content. Assistant messages that the policy sampled have their exact span
(:meth:`ChatTokenizer.assistant_span`) kept by the rollout engine *per episode* and passed back
to :meth:`ChatTokenizer.prompt_ids`, so a later context that contains them feeds the model what
it actually produced, never a retokenization of the decoded text (which can differ: BPE has many
ways to spell a string, and the model may have sampled a non-canonical one). The spans live with
the episode rather than in a global cache because episodes of one group share their seed, hence
their message ids, and may hold the same text sampled as different tokens.

A reply ends where the model samples a stop token. When that token is the template's own end of
a turn (``<|im_end|>``), the span keeps it and adds the rest of the closing. Any other stop (e.g.
``<|endoftext|>`` from the model's generation config) is no text of the message, but it was fed
to the model with the rest of the reply, so the span keeps it too, followed by the template's
whole closing: the next prompt extends what was sampled and the episode stays one segment
(DESIGN.md section 2), while the template's own rendering of the context lacks that token, as it
lacks a non-canonical split of the reply's text.

This needs a template in which each message renders on its own once the first message is
placed (ChatML and most others): then the concatenated spans equal the tokenized full rendering.
:class:`ChatTokenizer` checks that on a probe chat when it is made, and refuses, saying why, a
template that folds the system message into the first user turn, refuses a system message,
renders an assistant turn in the history other than as generation prompt + reply + closing, or
whose messages' tokens run into each other at their boundaries (``"\n\n" + "User"`` tokenized
apart is not ``"\n\nUser"`` tokenized whole). Tool messages are checked apart, alone and two in a
row: a template that renders them by their neighbours (adjacent tool results in one block) stays
usable for chats without them, and :meth:`ChatTokenizer.prompt_ids` refuses a context holding what
it cannot render span by span (:attr:`ChatTokenizer.tool_limit` says what). The project's
round-trip test checks the default model on real episodes.
"""

from __future__ import annotations

import contextlib

from collections import OrderedDict
from typing import Mapping, Sequence

from ..core.errors import TokenizationError, warn_caller
from ..core.messages import Context, Message
from ..core.values import valid_text

# A system message placed before a message renders it "in the middle" of a chat, so that
# templates that add a default system prompt before the first message do not do so.
_ANCHOR = {"role": "system", "content": "anchor"}
# The chat every template is checked on: rftgym's envs open with a system message, then turns.
_PROBE = Context((Message("system", "You are a careful assistant.", "rftgym-probe-0"),
                  Message("user", "What is 2 + 3?", "rftgym-probe-1"),
                  Message("assistant", "It is 5.", "rftgym-probe-2"),
                  Message("user", "Thanks. And 4 + 4?", "rftgym-probe-3")))
# Tool messages (a legal role, used by envs of one's own) are checked apart, on chats that hold one
# and two in a row: some templates render a tool message by its neighbours (Qwen2.5 puts adjacent
# tool results in one user block), which per-message spans cannot follow. Such a template stays
# usable for chats without them; a context that needs what it cannot render is refused.
_TOOL_PROBES = (
    ("a tool message", Context((*_PROBE.messages[:3], Message("tool", "result 1", "rftgym-probe-t1"),
                                Message("user", "And 4 + 4?", "rftgym-probe-t2")))),
    ("two tool messages in a row", Context((*_PROBE.messages[:3], Message("tool", "result 1", "rftgym-probe-t1"),
                                            Message("tool", "result 2", "rftgym-probe-t3")))),
)
_USE_ANOTHER = ("rftgym records the exact tokens of every turn as spans of single messages, so it needs a "
                "template that renders each message on its own (ChatML and most chat models' templates do); "
                "set tokenizer.chat_template to one")


class _LRU(OrderedDict):
    """A least-recently-used cache that threads may share: each operation on it is atomic, and an
    entry another thread evicts between two of them is simply gone (it is recomputable)."""

    def __init__(self, capacity: int = 0):  # a default: pickle rebuilds an OrderedDict with no arguments
        super().__init__()
        self.capacity = capacity

    def get_fresh(self, key):
        value = self.get(key)
        if value is not None:
            with contextlib.suppress(KeyError):
                self.move_to_end(key)
        return value

    def put(self, key, value) -> None:
        self[key] = value
        with contextlib.suppress(KeyError):
            self.move_to_end(key)
        while len(self) > self.capacity:
            try:
                self.popitem(last=False)
            except KeyError:  # emptied by the others meanwhile
                break


class ChatTokenizer:
    """Renders contexts to token ids through a tokenizer's chat template, span by span."""

    def __init__(self, tokenizer, capacity: int = 50_000, extra_stop_ids: Sequence[int] = ()):
        """``extra_stop_ids``: more tokens that end a reply (e.g. the model's generation config's
        ``eos_token_id``), besides the tokenizer's eos and the template's end of a turn."""
        if not getattr(tokenizer, "chat_template", None):
            raise TokenizationError(
                "The tokenizer has no chat template; use an instruct/chat model or set tokenizer.chat_template"
            )
        self.tokenizer = tokenizer
        self._warned_surrogate = False
        self._spans = _LRU(capacity)  # rendered spans by (id, role, content, first); recomputable
        try:
            base = self._render([_ANCHOR], add_generation_prompt=False)
            with_prompt = self._render([_ANCHOR], add_generation_prompt=True)
        except Exception as exc:  # jinja's TemplateError, or whatever the template raises
            raise TokenizationError(f"The chat template cannot render a chat that opens with a system message "
                                    f"({type(exc).__name__}: {exc}), as every rftgym env's does; "
                                    f"{_USE_ANOTHER}") from None
        if not with_prompt.startswith(base):
            raise TokenizationError("The chat template's generation prompt does not extend the rendered chat")
        self.generation_prompt_text = with_prompt[len(base):]
        self.generation_prompt_ids = tuple(self._encode(self.generation_prompt_text))
        try:
            parts = self._check_probe_text()
            self.closing = self._closing(parts[2])
            self.stop_ids = self._stop_ids(extra_stop_ids)
            self._check_probe_tokens(parts)
            self.tool_limit = self._tool_limit()
        except TokenizationError:
            raise
        except Exception as exc:  # e.g. a template that enforces its own order of roles
            raise TokenizationError(f"The chat template cannot render the chats rftgym makes ({type(exc).__name__}: "
                                    f"{exc}); {_USE_ANOTHER}") from None

    # ------------------------------------------------------------------ rendering

    def _render(self, messages: Sequence[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def _encode(self, text: str) -> list[int]:
        valid = valid_text(text)
        if valid is not text and not self._warned_surrogate:
            # A lone surrogate (a "\ud83d" escape in a data file, a reply quoted in half) is no text
            # UTF-8 can hold, and the tokenizer refuses it outright: the model sees U+FFFD there.
            self._warned_surrogate = True
            warn_caller("a message holds a lone surrogate (half of a UTF-16 pair, not text UTF-8 can hold); "
                        "the model sees U+FFFD in its place (further ones are not reported)")
        return list(self.tokenizer(valid, add_special_tokens=False)["input_ids"])

    def _stop_ids(self, extra: Sequence[int]) -> tuple[int, ...]:
        ids = {i for i in extra if isinstance(i, int)}
        eos = self.tokenizer.eos_token_id
        if isinstance(eos, int):
            ids.add(eos)
        # The token that closes an assistant turn in the template (e.g. <|im_end|>) also stops,
        # when it is a token of its own (special, or added to the vocabulary as one).
        first = self._encode(self.closing)[:1]
        added = set(getattr(self.tokenizer, "get_added_vocab", dict)().values())
        if first and (first[0] in self.tokenizer.all_special_ids or first[0] in added):
            ids.add(first[0])
        if not ids:
            raise TokenizationError(f"Nothing would end a reply: the tokenizer has no eos token, and the template's "
                                    f"end of an assistant turn ({self.closing!r}) is not a token of its own; set "
                                    "tokenizer.eos_token to the token that ends the model's turn")
        return tuple(sorted(ids))

    def _closing(self, span: str) -> str:
        """What the template writes after an assistant message's content, read from the probe
        chat's assistant ``span``: templates may trim a reply or drop its <think> part, which would
        hide it in a real one."""
        reply = _PROBE.messages[2].content
        at = span.rfind(reply)
        if at < 0 or not self._is_history_header(span[:at]):
            raise TokenizationError(f"The chat template renders an assistant turn in the history as {span!r}, which "
                                    f"does not begin as its generation prompt {self.generation_prompt_text!r} does, "
                                    "so a turn the model sampled after that prompt could not be fed back as it was "
                                    f"sampled; {_USE_ANOTHER}")
        return span[at + len(reply):]

    def _is_history_header(self, header: str) -> bool:
        # A past turn's header is the generation prompt, or the start of it: reasoning templates
        # prompt with "<think>\n" after the header and drop the reasoning from past turns. The
        # exact span fed back is the generation prompt, the sampled tokens and the closing.
        return self.generation_prompt_text.startswith(header) and (header or not self.generation_prompt_text)

    def _check_probe_text(self) -> list[str]:
        """:data:`_PROBE`'s spans (and the generation prompt), refused unless they join into the
        template's whole rendering of it."""
        whole, parts = self._rendered_both_ways(_PROBE)
        if "".join(parts) != whole:
            raise TokenizationError(f"The chat template does not render each message on its own (e.g. it folds the "
                                    f"system message into the first user turn): a system, user, assistant, user chat "
                                    f"rendered whole reads {whole!r}, message by message {''.join(parts)!r}; "
                                    f"{_USE_ANOTHER}")
        return parts

    def _rendered_both_ways(self, probe: Context) -> tuple[str, list[str]]:
        """``probe`` rendered whole by the template, and as its messages' spans followed by the
        generation prompt: what joins into the whole when the spans can follow the template."""
        parts = [self.span_text(m, first=i == 0) for i, m in enumerate(probe)] + [self.generation_prompt_text]
        return self.render_text(probe), parts

    def _spans_tokenize_apart(self, parts: list[str]) -> bool:
        """Whether ``parts`` tokenized one by one give the token ids of their join."""
        return [i for part in parts for i in self._encode(part)] == self._encode("".join(parts))

    def _tool_limit(self) -> str | None:
        """None if the template renders tool messages span by span, alone and several in a row;
        else what it cannot render so (the first of :data:`_TOOL_PROBES` it fails)."""
        for what, probe in _TOOL_PROBES:
            try:
                whole, parts = self._rendered_both_ways(probe)
            except Exception:  # the template refuses the tool role, or a span does not follow
                return what
            if "".join(parts) != whole or not self._spans_tokenize_apart(parts):
                return what
        return None

    def _check_tools(self, context: Context) -> None:
        """Refuse a context with tool messages this template does not render span by span."""
        roles = [m.role for m in context.messages]
        if "tool" not in roles:
            return
        adjacent = any(a == b == "tool" for a, b in zip(roles, roles[1:]))
        if self.tool_limit == "a tool message" or adjacent:
            raise TokenizationError(
                f"This chat template renders {self.tool_limit} by its neighbours (e.g. several tool results in one "
                "block), so the exact-token spans rftgym feeds the model would not be what the template renders; "
                + ("put each tool result in a message of its own role 'user', or " if self.tool_limit == "a tool message"
                   else "join the tool results of a turn into one tool message, or ")
                + "set tokenizer.chat_template to a template that renders each message on its own")

    def _check_probe_tokens(self, parts: list[str]) -> None:
        """Refuse a template whose :data:`_PROBE` spans tokenized one by one are not its whole
        rendering tokenized."""
        if not self._spans_tokenize_apart(parts):
            whole = "".join(parts)
            left, right = next(((a, b) for a, b in zip(parts, parts[1:])
                                if self._encode(a) + self._encode(b) != self._encode(a + b)), (whole, ""))
            raise TokenizationError("The chat template's messages run into each other when tokenized: the chat "
                                    "tokenized whole gives other token ids than its messages tokenized one by one "
                                    f"(the end of {left[-16:]!r} merges with the start of {right[:16]!r}); "
                                    f"{_USE_ANOTHER}, ending each message with a special token")

    def render_text(self, context: Context, add_generation_prompt: bool = True) -> str:
        """The chat template's own rendering of ``context`` (what the round-trip test compares to)."""
        return self._render(context.to_chat(), add_generation_prompt)

    def span_text(self, message: Message, first: bool) -> str:
        chat = {"role": message.role, "content": message.content}
        if first:
            return self._render([chat], add_generation_prompt=False)
        before = self._render([_ANCHOR], add_generation_prompt=False)
        after = self._render([_ANCHOR, chat], add_generation_prompt=False)
        if not after.startswith(before):
            raise TokenizationError(
                "The chat template does not render a chat as a sequence of per-message spans "
                f"(adding a {message.role} message changed the text before it); rftgym's exact-token "
                "cache cannot be used with this template"
            )
        return after[len(before):]

    # ------------------------------------------------------------------ token spans

    @staticmethod
    def _key(message: Message, first: bool) -> tuple:
        return (message.id, message.role, message.content, first)

    def message_ids(self, message: Message, first: bool) -> tuple[int, ...]:
        key = self._key(message, first)
        span = self._spans.get_fresh(key)
        if span is None:
            span = tuple(self._encode(self.span_text(message, first)))
            self._spans.put(key, span)
        return span

    def prompt_ids(self, context: Context, sampled_spans: Mapping[str, Sequence[int]] | None = None) -> list[int]:
        """Token ids fed to the model to produce the next assistant turn of ``context``.

        ``sampled_spans`` maps the ids of this episode's sampled assistant messages to their exact
        spans (from :meth:`assistant_span`); other messages are rendered through the template.
        """
        if self.tool_limit is not None:
            self._check_tools(context)
        ids: list[int] = []
        for position, message in enumerate(context.messages):
            exact = sampled_spans.get(message.id) if sampled_spans and position > 0 else None
            if exact is not None and message.role == "assistant":
                ids.extend(exact)
            else:
                ids.extend(self.message_ids(message, first=position == 0))
        ids.extend(self.generation_prompt_ids)
        return ids

    def assistant_span(self, message: Message, sampled_ids: Sequence[int]) -> tuple[int, ...]:
        """The exact span of an assistant ``message`` that was produced by sampling ``sampled_ids``:
        generation prompt + sampled tokens + whatever the template writes after the content, minus
        the end of a turn when the model already sampled it (another stop token stays: it was
        sampled, and the next prompt extends the sampled tokens)."""
        if message.role != "assistant":
            raise ValueError(f"only assistant messages are bound to sampled tokens, got {message.role}")
        closing = self._encode(self.closing)
        sampled = list(sampled_ids)
        if sampled and closing and sampled[-1] in self.stop_ids and closing[0] == sampled[-1]:
            closing = closing[1:]
        return tuple(self.generation_prompt_ids) + tuple(sampled) + tuple(closing)

    def decode_reply(self, sampled_ids: Sequence[int]) -> str:
        """The assistant text for sampled tokens: everything before a final stop token."""
        ids = list(sampled_ids)
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)
