"""A reply that stops on a stop id other than the template's end of a turn (e.g. <|endoftext|>
from the model's generation config): the stop token is no text of the message, but the next
prompt feeds it back as sampled, closed by the template's own end of a turn, so the episode
stays one segment."""

from __future__ import annotations

from support import SayAEnv, char_tokenizer

from rftgym.agents.chat_tokens import ChatTokenizer
from rftgym.agents.hf_policy import SamplingConfig
from rftgym.core.messages import Context, Message
from rftgym.rollout import run_episodes


def rendered_ids(chat: ChatTokenizer, context: Context) -> list[int]:
    return list(chat.tokenizer(chat.render_text(context), add_special_tokens=False)["input_ids"])


def test_a_span_keeps_another_stop_id_and_closes_with_the_template():
    tokenizer = char_tokenizer()
    end_of_text, end_of_turn = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    chat = ChatTokenizer(tokenizer, extra_stop_ids=[end_of_text])
    assert end_of_text in chat.stop_ids and end_of_turn in chat.stop_ids
    reply = tokenizer("hi there", add_special_tokens=False)["input_ids"]
    closing = tokenizer("<|im_end|>\n", add_special_tokens=False)["input_ids"]
    question, follow_up = Message("user", "greet me", "q"), Message("user", "thanks", "f")
    for stop, fed in ((end_of_turn, reply), (end_of_text, reply + [end_of_text])):
        text = chat.decode_reply(reply + [stop])
        assert text == "hi there"  # no stop token in the message's text
        answer = Message("assistant", text, "a")
        context = Context((question, answer, follow_up))
        span = chat.assistant_span(answer, reply + [stop])
        # the sampled end of a turn stands for the closing's first token; another stop is kept
        assert list(span) == list(chat.generation_prompt_ids) + fed + closing
        prompt = chat.prompt_ids(context, {answer.id: span})
        if stop == end_of_turn:
            assert prompt == rendered_ids(chat, context)
        else:  # the template's rendering, with the sampled stop token where the model put it
            rendered = rendered_ids(chat, context)
            cut = prompt.index(end_of_text)
            assert prompt[:cut] + prompt[cut + 1:] == rendered


class TwoTurns(SayAEnv):
    """SayAEnv with one more turn first: the reply is kept and a user message follows."""

    def reset(self, *, seed=None, options=None):
        self.context, info = super().reset(seed=seed)
        return self.context, info

    def step(self, action):
        if len(self.context) > 1:
            return super().step(action)
        self.context = self.context.appended(self.ids.message("assistant", action), self.ids.message("user", "more"))
        return self.context, 0.0, False, False, {}


def test_a_rollout_stopping_on_end_of_text_feeds_the_stop_back_in_one_segment(make_char_policy):
    policy = make_char_policy()
    end_of_text, end_of_turn = policy.tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    policy.model.generation_config.eos_token_id = [end_of_turn, end_of_text]
    policy = type(policy)(policy.model, policy.tokenizer, sampling=SamplingConfig(max_new_tokens=6, temperature=0.0))
    assert end_of_text in policy.chat.stop_ids
    calls = []

    def steer(module, inputs, logits):
        # No end of turn; <|endoftext|> exactly at the third token of the first reply.
        calls.append(None)
        logits = logits.clone()
        logits[..., end_of_turn] = -1e4
        logits[..., end_of_text] = 1e4 if len(calls) == 3 else -1e4
        return logits

    handle = policy.model.lm_head.register_forward_hook(steer)
    try:
        episode = run_episodes(TwoTurns, policy, [0])[0]
    finally:
        handle.remove()
    first, second = episode.turns
    assert first.finish_reason == "stop" and first.sampled_ids[-1] == end_of_text and len(first.sampled_ids) == 3
    assert "<|endoftext|>" not in first.action and len(first.logprobs) == 3
    # The next prompt extends what was sampled, the stop token included, so the episode is one
    # segment whose every sampled token is trained on (mask 1) with its log-prob.
    assert second.prompt_ids[: len(first.prompt_ids) + 3] == first.prompt_ids + first.sampled_ids
    context = Context(tuple(episode.messages[i] for i in second.context_ids))
    cut = len(first.prompt_ids) + 2
    assert second.prompt_ids[:cut] + second.prompt_ids[cut + 1:] == rendered_ids(policy.chat, context)
    segments = episode.segments
    assert [s.turn_indices for s in segments] == [(0, 1)]
    whole = segments[0]
    assert whole.token_ids[: len(second.prompt_ids)] == second.prompt_ids
    assert whole.loss_mask[: len(first.prompt_ids) + 3] == [0] * len(first.prompt_ids) + [1] * 3
    assert whole.loss_mask[len(first.prompt_ids) + 3: len(second.prompt_ids)] == \
        [0] * (len(second.prompt_ids) - len(first.prompt_ids) - 3)
