"""Exact chat tokens: a context's token ids are the concatenation of per-message spans.

A span is what the chat template renders for one message, tokenized once and cached by the
message's id and content. Assistant messages that the policy sampled have their exact span
(:meth:`ChatTokenizer.assistant_span`) kept by the rollout engine *per episode* and passed back
to :meth:`ChatTokenizer.prompt_ids`, so a later context that contains them feeds the model what
it actually produced, never a retokenization of the decoded text (which can differ: BPE has many
ways to spell a string, and the model may have sampled a non-canonical one). The spans live with
the episode rather than in a global cache because episodes of one group share their seed, hence
their message ids, and may hold the same text sampled as different tokens.

For templates in which each message renders independently once the first message is placed
(ChatML and most others), the concatenated spans equal the tokenized full rendering; the
project's round-trip test checks this for the default model.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Mapping, Sequence

from ..core.errors import TokenizationError
from ..core.messages import Context, Message

# A system message placed before a message renders it "in the middle" of a chat, so that
# templates that add a default system prompt before the first message do not do so.
_ANCHOR = {"role": "system", "content": "anchor"}


class _LRU(OrderedDict):
    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity

    def get_fresh(self, key):
        value = self.get(key)
        if value is not None:
            self.move_to_end(key)
        return value

    def put(self, key, value) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.capacity:
            self.popitem(last=False)


class ChatTokenizer:
    """Renders contexts to token ids through a tokenizer's chat template, span by span."""

    def __init__(self, tokenizer, capacity: int = 50_000):
        if not getattr(tokenizer, "chat_template", None):
            raise TokenizationError(
                "The tokenizer has no chat template; use an instruct/chat model or set tokenizer.chat_template"
            )
        self.tokenizer = tokenizer
        self._spans = _LRU(capacity)  # rendered spans by (id, role, content, first); recomputable
        base = self._render([_ANCHOR], add_generation_prompt=False)
        with_prompt = self._render([_ANCHOR], add_generation_prompt=True)
        if not with_prompt.startswith(base):
            raise TokenizationError("The chat template's generation prompt does not extend the rendered chat")
        self.generation_prompt_text = with_prompt[len(base):]
        self.generation_prompt_ids = tuple(self._encode(self.generation_prompt_text))
        self.stop_ids = self._stop_ids()

    # ------------------------------------------------------------------ rendering

    def _render(self, messages: Sequence[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _stop_ids(self) -> tuple[int, ...]:
        ids = set()
        eos = self.tokenizer.eos_token_id
        if isinstance(eos, int):
            ids.add(eos)
        # The token that closes an assistant turn in the template (e.g. <|im_end|>) also stops.
        closing = self.closing_text("x")
        if closing:
            first = self._encode(closing)[:1]
            if first and first[0] in self.tokenizer.all_special_ids:
                ids.add(first[0])
        return tuple(sorted(ids))

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

    def closing_text(self, content: str) -> str:
        """What the template writes after an assistant message's content (e.g. '<|im_end|>\\n')."""
        span = self.span_text(Message("assistant", content, "probe"), first=False)
        head = self.generation_prompt_text + content
        return span[len(head):] if span.startswith(head) else ""

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
        a stop token the model already sampled."""
        if message.role != "assistant":
            raise ValueError(f"only assistant messages are bound to sampled tokens, got {message.role}")
        closing = self._encode(self.closing_text(message.content))
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
