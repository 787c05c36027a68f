"""The per-message token cache keeps sampled tokens exact, even when they are not canonical."""

from __future__ import annotations

from collections import OrderedDict

import pytest

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
    closing = tokenizer(chat.closing, add_special_tokens=False)["input_ids"]
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


# Chat templates that the per-message spans cannot follow: each is refused when the tokenizer is
# made, saying why, instead of recording prompts the model never saw.
_TURN = "'<|im_start|>' + message['role'] + '\n' + {content} + '<|im_end|>\n'"
_GENERATION = "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
REFUSED_TEMPLATES = {
    # Llama-2/Mistral style: the system message goes into the first user turn.
    "folds the system message": (
        "{% set system = messages[0]['content'] if messages[0]['role'] == 'system' else '' %}"
        "{% for message in messages %}{% if message['role'] != 'system' %}"
        "{% set content = (system + '\n\n' + message['content']) if loop.index0 == 1 and system "
        "else message['content'] %}{{" + _TURN.format(content="content") + "}}{% endif %}{% endfor %}" + _GENERATION,
        "does not render each message on its own"),
    # Gemma-2 style.
    "refuses the system role": (
        "{% for message in messages %}{% if message['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}{{" + _TURN.format(content="message['content']")
        + "}}{% endfor %}" + _GENERATION,
        "cannot render a chat that opens with a system message .*System role not supported"),
    # Roles must alternate after the system message.
    "enforces alternation": (
        "{% for message in messages[1:] %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('roles must alternate') }}{% endif %}{% endfor %}{% for message in messages %}{{"
        + _TURN.format(content="message['content']") + "}}{% endfor %}" + _GENERATION,
        "cannot render the chats rftgym makes .*roles must alternate"),
    # A history header that is not the generation prompt.
    "another header": (
        "{% for message in messages %}{{" + _TURN.format(content="message['content']") + "}}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>\n' }}{% endif %}",
        "renders an assistant turn in the history as"),
}


@pytest.mark.parametrize("name", list(REFUSED_TEMPLATES))
def test_a_template_the_spans_cannot_follow_is_refused_saying_why(name):
    from support import char_tokenizer

    from rftgym.agents.chat_tokens import ChatTokenizer
    from rftgym.core.errors import TokenizationError

    template, message = REFUSED_TEMPLATES[name]
    tokenizer = char_tokenizer()
    tokenizer.chat_template = template
    with pytest.raises(TokenizationError, match=message):
        ChatTokenizer(tokenizer)


def test_messages_that_merge_when_tokenized_are_refused(default_policy):
    import copy

    from rftgym.agents.chat_tokens import ChatTokenizer
    from rftgym.core.errors import TokenizationError

    tokenizer = copy.deepcopy(default_policy.tokenizer)
    # "...\n\n" + "User: ..." tokenized apart is not the two tokenized whole in this BPE.
    tokenizer.chat_template = ("{% for message in messages %}{{ message['role'] | capitalize }}: "
                               "{{ message['content'] }}\n\n{% endfor %}"
                               "{% if add_generation_prompt %}Assistant: {% endif %}")
    with pytest.raises(TokenizationError, match="messages run into each other when tokenized"):
        ChatTokenizer(tokenizer)


def test_a_trimming_template_keeps_the_turns_closing_after_a_spaced_reply():
    from support import char_tokenizer

    from rftgym.agents.chat_tokens import ChatTokenizer

    tokenizer = char_tokenizer()
    tokenizer.chat_template = ("{% for message in messages %}{{" + _TURN.format(content="message['content'] | trim")
                               + "}}{% endfor %}" + _GENERATION)
    chat = ChatTokenizer(tokenizer)
    assert chat.closing == "<|im_end|>\n"
    sampled = tokenizer(" a reply ", add_special_tokens=False)["input_ids"]  # cut by length: no stop token
    span = chat.assistant_span(Message("assistant", " a reply ", "r"), sampled)
    assert list(span) == list(chat.generation_prompt_ids) + sampled + tokenizer("<|im_end|>\n")["input_ids"]


def test_an_end_of_turn_token_added_to_the_vocabulary_stops_and_so_does_the_models_own():
    from support import char_tokenizer

    from rftgym.agents.chat_tokens import ChatTokenizer
    from rftgym.core.errors import TokenizationError

    tokenizer = char_tokenizer()
    tokenizer.add_tokens(["<|eot|>"])  # a token of its own, though not a special one
    tokenizer.chat_template = CHATML_WITH_END.replace("<|im_end|>", "<|eot|>")
    eot = tokenizer.convert_tokens_to_ids("<|eot|>")
    assert eot in ChatTokenizer(tokenizer).stop_ids
    assert 7 in ChatTokenizer(tokenizer, extra_stop_ids=[7]).stop_ids  # e.g. generation_config.eos_token_id
    tokenizer = char_tokenizer()
    tokenizer.eos_token = None  # and the template's end of a turn is plain text: nothing would stop a reply
    tokenizer.chat_template = CHATML_WITH_END.replace("<|im_end|>", "end")
    with pytest.raises(TokenizationError, match="Nothing would end a reply"):
        ChatTokenizer(tokenizer)


CHATML_WITH_END = ("{% for message in messages %}{{" + _TURN.format(content="message['content']") + "}}{% endfor %}"
                   + _GENERATION)


def test_a_lone_surrogate_in_a_message_is_seen_as_a_replacement_character(default_policy):
    chat = default_policy.chat
    half = Context((Message("user", "What is \ud83d?", "q"),))
    whole = Context((Message("user", "What is \ufffd?", "q2"),))
    with pytest.warns(UserWarning, match=r"lone surrogate .* U\+FFFD"):
        ids = chat.prompt_ids(half)  # the tokenizer refused it with a bare TypeError
    assert ids == chat.prompt_ids(whole)


# Qwen2.5's way with tool results: adjacent tool messages share one user block.
TOOLS_BY_NEIGHBOURS = (
    "{%- for message in messages %}"
    "{%- if message.role != 'tool' %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}" + _GENERATION)


def _chat(template):
    from support import char_tokenizer

    from rftgym.agents.chat_tokens import ChatTokenizer

    tokenizer = char_tokenizer()
    tokenizer.chat_template = template
    return ChatTokenizer(tokenizer), tokenizer


def _context(*roles):
    return Context(tuple(Message(role, f"{role} {i}", f"m{i}") for i, role in enumerate(("system", "user", *roles))))


def test_tool_messages_a_template_renders_by_their_neighbours_are_refused_and_others_kept():
    from rftgym.core.errors import TokenizationError

    chat, tokenizer = _chat(TOOLS_BY_NEIGHBOURS)
    assert chat.tool_limit == "two tool messages in a row"
    # What the template renders span by span is fed as it renders it: one tool result, no tool at all.
    for roles in [("assistant", "tool"), ("assistant", "tool", "assistant", "tool"), ("assistant", "user")]:
        context = _context(*roles)
        assert chat.prompt_ids(context) == tokenizer(chat.render_text(context), add_special_tokens=False)["input_ids"]
    adjacent = _context("assistant", "tool", "tool")
    # Spans would give "</tool_response><|im_end|>\n<|im_start|>user\n<tool_response>" where the
    # template writes the two results in one block: refused, saying what to do.
    with pytest.raises(TokenizationError, match=r"renders two tool messages in a row by its neighbours .* join the "
                                                r"tool results of a turn into one tool message"):
        chat.prompt_ids(adjacent)


def test_a_template_without_the_tool_role_refuses_only_contexts_that_hold_one():
    from rftgym.core.errors import TokenizationError

    no_tools = ("{% for message in messages %}{% if message['role'] == 'tool' %}"
                "{{ raise_exception('unknown role') }}{% endif %}{{" + _TURN.format(content="message['content']")
                + "}}{% endfor %}" + _GENERATION)
    chat, _ = _chat(no_tools)
    assert chat.tool_limit == "a tool message"
    chat.prompt_ids(_context("assistant", "user"))
    with pytest.raises(TokenizationError, match="put each tool result in a message of its own role 'user'"):
        chat.prompt_ids(_context("assistant", "tool"))


def test_a_template_that_renders_each_tool_message_alone_takes_any_run_of_them():
    chat, tokenizer = _chat(CHATML_WITH_END)
    assert chat.tool_limit is None
    context = _context("assistant", "tool", "tool", "tool")
    assert chat.prompt_ids(context) == tokenizer(chat.render_text(context), add_special_tokens=False)["input_ids"]


def test_the_span_cache_shrugs_off_an_entry_another_thread_evicts_between_two_steps():
    from rftgym.agents.chat_tokens import _LRU

    class EvictedMeanwhile(_LRU):  # another thread's put evicts the entry right after each step
        def get(self, key, default=None):
            value = super().get(key, default)
            self.pop(key, None)
            return value

        def __setitem__(self, key, value):
            super().__setitem__(key, value)
            self.pop(key, None)

    cache = EvictedMeanwhile(capacity=2)
    OrderedDict.__setitem__(cache, "a", 1)
    assert cache.get_fresh("a") == 1  # found, then gone: no KeyError
    cache.put("b", 2)
    assert "b" not in cache and len(cache) == 0
