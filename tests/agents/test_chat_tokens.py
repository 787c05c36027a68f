"""The per-message token cache keeps sampled tokens exact, even when they are not canonical."""

from __future__ import annotations

from rftgym.core.messages import Context, Message


def test_bound_assistant_message_keeps_non_canonical_tokens(default_policy):
    chat, tokenizer = default_policy.chat, default_policy.tokenizer
    text = "hello world"
    canonical = tokenizer(text, add_special_tokens=False)["input_ids"]
    # Spell the same text one character per token: a valid but non-canonical tokenization.
    spelled = [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(ch))[0] for ch in "hello"]
    spelled += tokenizer(" world", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(spelled) == text and spelled != canonical
    stop = chat.stop_ids[0]

    question = Message("user", "greet me", "q")
    answer = Message("assistant", text, "a")
    follow_up = Message("user", "thanks", "f")
    span = chat.assistant_span(answer, spelled + [stop])
    context = Context((question, answer, follow_up))
    ids = chat.prompt_ids(context, {answer.id: span})

    head = chat.prompt_ids(Context((question,)))  # ends with the generation prompt
    assert ids[: len(head)] == head
    assert ids[len(head): len(head) + len(spelled) + 1] == spelled + [stop]
    # The template's own rendering retokenizes the text and so differs exactly there.
    rendered = tokenizer(chat.render_text(context), add_special_tokens=False)["input_ids"]
    assert rendered != ids
    assert len(rendered) == len(ids) - len(spelled) + len(canonical)


def test_message_ids_are_cached_per_id_and_content(default_policy):
    chat = default_policy.chat
    a = Message("user", "one", "x")
    b = Message("user", "two", "x")  # same id, another episode's content
    assert chat.message_ids(a, first=False) != chat.message_ids(b, first=False)
    assert chat.message_ids(a, first=False) is chat.message_ids(a, first=False)


def test_length_cut_assistant_gets_template_closing(default_policy):
    chat, tokenizer = default_policy.chat, default_policy.tokenizer
    sampled = tokenizer("partial ans", add_special_tokens=False)["input_ids"]  # no stop token: cut by length
    message = Message("assistant", "partial ans", "p")
    span = chat.assistant_span(message, sampled)
    closing = tokenizer(chat.closing_text("partial ans"), add_special_tokens=False)["input_ids"]
    assert list(span) == list(chat.generation_prompt_ids) + sampled + closing
    assert closing[0] in chat.stop_ids  # the template closes the turn the model never closed


def test_spans_are_per_episode_even_when_ids_and_text_collide(default_policy):
    """Two episodes of one group share their seed, hence message ids, and may say the same text
    with different tokens; each must get its own tokens back."""
    chat, tokenizer = default_policy.chat, default_policy.tokenizer
    question = Message("user", "greet me", "q")
    answer = Message("assistant", "hello world", "a")  # same id and text in both episodes
    follow_up = Message("user", "thanks", "f")
    canonical = tokenizer("hello world", add_special_tokens=False)["input_ids"]
    spelled = [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(ch))[0] for ch in "hello"]
    spelled += tokenizer(" world", add_special_tokens=False)["input_ids"]
    context = Context((question, answer, follow_up))
    episode_a = {answer.id: chat.assistant_span(answer, canonical)}
    episode_b = {answer.id: chat.assistant_span(answer, spelled)}
    ids_a, ids_b = chat.prompt_ids(context, episode_a), chat.prompt_ids(context, episode_b)
    head = len(chat.prompt_ids(Context((question,))))
    assert ids_a[head: head + len(canonical)] == canonical
    assert ids_b[head: head + len(spelled)] == spelled
