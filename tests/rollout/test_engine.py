"""Batched rollouts with scripted agents and a tiny model; segments at context edits."""

from __future__ import annotations

import warnings

import gymnasium as gym
import numpy as np
import pytest

import rftgym  # noqa: F401
from rftgym.agents.base import CONTEXT_FULL, Agent, AgentReply
from rftgym.agents.hf_policy import HFPolicy, SamplingConfig
from rftgym.agents.scripted import ScriptedAgent
from rftgym.core.errors import AgentError, ConfigError, EnvContractError, EnvError
from rftgym.core.messages import Context, MessageIds
from rftgym.core.spaces import AssistantText, ContextSpace
from rftgym.rollout import RolloutConfig, run_episodes, summarize
from rftgym.rollout.engine import SAFETY_NET_TURNS


def make_qa():
    return gym.make("rftgym/VerifiableQA-v0")


def test_episodes_come_back_in_seed_order_with_reset_seeds():
    seen = []
    episodes = run_episodes(make_qa, ScriptedAgent(["<answer>1</answer>"]), seeds=[5, 6, 7, 8, 9],
                            config=RolloutConfig(num_envs=2), on_episode=seen.append)
    assert [e.seed for e in episodes] == [5, 6, 7, 8, 9]
    assert len(seen) == 5
    env = make_qa()
    for episode in episodes:
        context, _ = env.reset(seed=episode.seed)
        assert episode.context(0) == context


def test_seeds_are_checked_up_front_and_numpy_ints_taken():
    agent = ScriptedAgent(["<answer>1</answer>"])
    episodes = run_episodes(make_qa, agent, seeds=np.arange(5, 7))
    assert [e.seed for e in episodes] == [5, 6] and all(type(e.seed) is int for e in episodes)
    assert run_episodes(make_qa, agent, seeds=[None])[0].seed is None
    for bad, shown in ((-1, "-1"), (1.5, "1.5"), ("3", "'3'"), (True, "True")):
        with pytest.raises(ValueError, match=rf"seeds\[1\] is {shown}; a seed is an int >= 0 \(or None"):
            run_episodes(make_qa, agent, seeds=[0, bad])


class CountingAgent(Agent):
    """Answers wrongly, and records how many contexts each call carried."""

    def __init__(self):
        self.batch_sizes = []

    def act(self, contexts):
        self.batch_sizes.append(len(contexts))
        return [AgentReply(text="no tag here") for _ in contexts]


def test_batch_stays_full_while_seeds_remain():
    agent = CountingAgent()
    episodes = run_episodes(make_qa, agent, seeds=list(range(7)), config=RolloutConfig(num_envs=3))
    assert all(e.truncated and len(e.turns) == 3 for e in episodes)
    assert max(agent.batch_sizes) == 3
    assert agent.batch_sizes[:4] == [3, 3, 3, 3]  # refilled as episodes end, not after the whole batch


class StepCounter(gym.Wrapper):
    steps = 0

    def step(self, action):
        StepCounter.steps += 1
        return super().step(action)


class FullAtTurn(Agent):
    """Answers wrongly until its context has ``full_at`` assistant turns, then has no room left."""

    def __init__(self, full_at):
        self.full_at = full_at

    def act(self, contexts):
        return [AgentReply(text="", finish_reason=CONTEXT_FULL)
                if sum(m.role == "assistant" for m in c) >= self.full_at else AgentReply(text="no tag here")
                for c in contexts]


@pytest.mark.parametrize("full_at", [0, 1])
def test_an_agent_without_room_ends_the_episode_truncated_without_stepping_the_env(full_at):
    StepCounter.steps = 0
    episodes = run_episodes(lambda: StepCounter(make_qa()), FullAtTurn(full_at), seeds=[0, 1, 2],
                            config=RolloutConfig(num_envs=2))
    assert StepCounter.steps == 3 * full_at  # the env saw the real replies only
    for episode in episodes:
        assert len(episode.turns) == full_at + 1 and episode.truncated and not episode.terminated
        last = episode.turns[-1]
        assert (last.action, last.reward, last.finish_reason, last.info) == ("", 0.0, CONTEXT_FULL,
                                                                               {"context_full": True})
        assert last.context_ids == episode.final_context_ids  # it saw the context the env left
        assert episode.context_full and not episode.success


def test_env_columns_score_an_episode_that_ran_out_of_context_as_unfinished():
    from rftgym.rollout.metrics import env_metrics

    class FirstReplyThenFull(Agent):  # one reply, then no room for another
        def __init__(self, first_reply):
            self.first_reply = first_reply

        def act(self, contexts):
            return [AgentReply(text="", finish_reason=CONTEXT_FULL) if any(m.role == "assistant" for m in c)
                    else AgentReply(text=self.first_reply) for c in contexts]

    def make_env():
        return gym.make("rftgym/SearchEvalQA-v0")

    env = make_env()
    env.reset(seed=0)
    answer = f"<answer>{env.unwrapped.question.answers[0]}</answer>"
    good = run_episodes(make_env, FirstReplyThenFull(answer), seeds=[0])  # answers at once, right
    full = run_episodes(make_env, FirstReplyThenFull("<search>capital</search>"), seeds=[1])
    assert good[0].turns[-1].info["em"] == 1.0 and full[0].context_full and len(full[0].turns) == 2
    spec = gym.make("rftgym/SearchEvalQA-v0").unwrapped.metadata["eval_metrics"]
    columns = env_metrics(good + full, spec)
    assert columns["em"] == 0.5  # the unanswered episode scores 0, not left out
    assert columns["searches/ep"] == 0.5  # its env's last report (1 search) counts; the answer had none
    # What an evaluation during training sends between processes gives the same columns.
    import pickle

    from rftgym.rollout.metrics import reducers_view

    views = [reducers_view(e, spec) for e in good + full]
    assert env_metrics(views, spec) == columns
    assert [(v.success, v.context_full, v.total_reward) for v in views] == [
        (e.success, e.context_full, e.total_reward) for e in good + full]
    assert len(pickle.dumps(views)) < len(pickle.dumps(good + full)) / 3
    summary = summarize(good + full)
    assert summary["context_full"] == 1 and summary["success"] == 0.5
    # The empty turn recording the end is no reply: one turn each, and the search had no format error.
    assert summary["turns"] == 1.0 and summary["format_error_rate"] == 0.0
    assert full[0].to_json()["summary"]["turns"] == 1  # the episode file counts them alike


def test_a_prompt_over_the_policy_limit_ends_only_its_own_episode(tiny_policy):
    first = len(tiny_policy.chat.prompt_ids(make_qa().reset(seed=0)[0]))
    policy = HFPolicy(tiny_policy.model, tiny_policy.tokenizer,
                      sampling=SamplingConfig(max_new_tokens=4, temperature=0.0, max_prompt_tokens=first + 8))
    with pytest.warns(UserWarning, match="context_full"):
        episodes = run_episodes(make_qa, policy, seeds=[0], config=RolloutConfig(num_envs=1))
    turns = episodes[0].turns
    assert turns[0].finish_reason == "length" and turns[-1].finish_reason == CONTEXT_FULL
    assert len(turns) == 2 and turns[-1].prompt_ids is None  # the second prompt outgrew first + 8 tokens
    assert summarize(episodes)["truncated"] == 1.0


@pytest.mark.parametrize("reward, message", [
    (float("nan"), "returned the reward nan; a reward is a finite number"),
    (float("-inf"), "returned the reward -inf"),
    (None, "returned the reward None"),
])
def test_an_env_breaking_the_step_contract_is_named(reward, message):
    class BadReward(gym.Wrapper):
        def step(self, action):
            context, _, terminated, truncated, info = self.env.step(action)
            return context, reward, terminated, truncated, info

    with pytest.raises(EnvContractError, match=r"rftgym/VerifiableQA-v0 \(seed 3, turn 1\) " + message):
        run_episodes(lambda: BadReward(make_qa()), ScriptedAgent(["<answer>1</answer>"]), seeds=[3])

    class TextObservation(gym.Wrapper):
        def reset(self, **kwargs):
            context, info = self.env.reset(**kwargs)
            return context[-1].content, info

    with pytest.raises(EnvContractError, match=r"reset to a str; an rftgym env's observation is the chat context"):
        run_episodes(lambda: TextObservation(make_qa()), ScriptedAgent(["x"]), seeds=[0])


def test_a_reply_the_env_cut_is_fed_back_as_the_env_kept_it(tiny_policy):
    # VerifiableQA keeps at most max_action_chars of a reply: the next prompt must hold that text,
    # not the tokens the model sampled, and the cut starts a new segment.
    def make_env():
        return gym.make("rftgym/VerifiableQA-v0", max_action_chars=3, max_attempts=2)

    policy = HFPolicy(tiny_policy.model, tiny_policy.tokenizer, sampling=SamplingConfig(max_new_tokens=6,
                                                                                        temperature=0.0))
    with pytest.warns(UserWarning, match="stored a reply other than the agent's text"):
        (episode,) = run_episodes(make_env, policy, seeds=[0])
    first, second = episode.turns[:2]
    kept = episode.messages[first.message_id].content
    assert kept != first.action and len(kept) <= 3
    assert second.prompt_ids == policy.chat.prompt_ids(episode.context(1))  # rendered as the env wrote it
    assert len(episode.segments) == len(episode.turns) > 1  # every cut reply starts a new segment


def test_an_env_that_reuses_a_message_id_for_other_content_is_named():
    from rftgym.core.messages import Context, Message

    class Restating(gym.Wrapper):  # rewrites its status message in place, keeping its id
        def step(self, action):
            context, *rest = self.env.step(action)
            status = Message("user", f"status after {len(context)} messages", "status")
            return Context(context.messages + (status,)), *rest

        def reset(self, **kwargs):
            context, info = self.env.reset(**kwargs)
            return Context(context.messages + (Message("user", "status: start", "status"),)), info

    with pytest.raises(EnvContractError, match=r"turn 1\) sent message 'status' again with other content"):
        run_episodes(lambda: Restating(make_qa()), ScriptedAgent(["no tag"]), seeds=[0])


class Returns(Agent):
    def __init__(self, make_replies):
        self.make_replies = make_replies

    def act(self, contexts):
        return self.make_replies(contexts)


@pytest.mark.parametrize("make_replies, message", [
    (lambda cs: (AgentReply("x") for _ in cs), "returned a generator from act"),
    (lambda cs: ["x" for _ in cs], r"returned 'x' \(a str\) as a reply; each reply is an AgentReply: wrap the "
                                   r"text, AgentReply\(text=...\)"),
    (lambda cs: [AgentReply(None) for _ in cs], "returned a reply with NoneType text"),
    (lambda cs: [AgentReply("x"), AgentReply("y")], "returned 2 replies for 1 contexts"),
    (lambda cs: [AgentReply("x", sampled_ids=[1, 2]) for _ in cs], "sampled_ids without prompt_ids"),
    (lambda cs: [AgentReply("x", prompt_ids=[1], sampled_ids=[1, 2], logprobs=[0.0]) for _ in cs],
     "returned 1 log-probs for 2 sampled tokens"),
    (lambda cs: [AgentReply("x", prompt_ids="abc", sampled_ids="de") for _ in cs],
     "returned prompt_ids that are not a sequence of token ids"),
    (lambda cs: [AgentReply("x", prompt_ids=[1], sampled_ids=[2.5]) for _ in cs],
     "returned sampled_ids that are not a sequence of token ids"),
    (lambda cs: [AgentReply("x", prompt_ids=[1, -2], sampled_ids=[2]) for _ in cs],
     r"returned a negative token id \(-2\) in prompt_ids; token ids are >= 0"),
    (lambda cs: [AgentReply("x", prompt_ids=(1,), sampled_ids=(np.int64(-1),)) for _ in cs],
     r"returned a negative token id \(-1\) in sampled_ids"),
    (lambda cs: [AgentReply("x", prompt_ids=[1], sampled_ids=[2, 3], logprobs=[float("nan"), 1.0]) for _ in cs],
     "the log-prob nan for a sampled token"),
    (lambda cs: [AgentReply("x", prompt_ids=[1], sampled_ids=[2], logprobs=["-1"]) for _ in cs],
     "log-probs that are not numbers"),
    (lambda cs: [AgentReply("x", prompt_ids=[1]) for _ in cs], "prompt_ids or logprobs without sampled_ids"),
    (lambda cs: [AgentReply("x", logprobs=[0.0]) for _ in cs], "prompt_ids or logprobs without sampled_ids"),
    (lambda cs: [AgentReply("x", finish_reason=7) for _ in cs], "finish_reason 7; it is a str or None"),
    (lambda cs: [AgentReply("42", finish_reason=CONTEXT_FULL) for _ in cs],
     "returned text with finish_reason 'context_full'"),
])
def test_an_agent_breaking_its_contract_is_named(make_replies, message):
    from rftgym.core.errors import AgentError

    with pytest.raises(AgentError, match=message):
        run_episodes(make_qa, Returns(make_replies), seeds=[0])


def test_an_agent_that_raises_is_named_with_where_it_was():
    from rftgym.core.errors import AgentError

    calls = []

    def breaks_on_the_second_call(contexts):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return [AgentReply("no tag") for _ in contexts]

    with pytest.raises(AgentError, match=r"agent 'agent' raised RuntimeError: boom \(replying to "
                                         r"rftgym/VerifiableQA-v0 seed 5 turn 2\)") as info:
        run_episodes(make_qa, Returns(breaks_on_the_second_call), seeds=[5])
    assert isinstance(info.value.__cause__, RuntimeError)


@pytest.mark.parametrize("call, where", [("reset", r"in reset \(seed 5\)"), ("step", r"in step \(seed 5, turn 2\)")])
def test_an_env_that_raises_is_named_with_where_it_was(call, where):
    from rftgym.core.errors import EnvError

    class Breaks(gym.Wrapper):
        def __init__(self, env):
            super().__init__(env)
            self.steps = 0

        def reset(self, **kwargs):
            if call == "reset":
                raise ValueError("boom")
            return self.env.reset(**kwargs)

        def step(self, action):
            self.steps += 1
            if self.steps == 2:
                raise ValueError("boom")
            return self.env.step(action)

    with pytest.raises(EnvError, match=rf"rftgym/VerifiableQA-v0 raised ValueError {where}: boom") as info:
        run_episodes(lambda: Breaks(make_qa()), Returns(lambda cs: [AgentReply("no tag") for _ in cs]), seeds=[5])
    assert isinstance(info.value.__cause__, ValueError)


def test_an_option_the_env_refuses_is_named_with_the_options():
    from rftgym.core.errors import EnvError

    with pytest.raises(EnvError, match=r"raised ValueError in reset \(seed 3, options \{'hops': 9\}\): .*hops"):
        run_episodes(lambda: gym.make("rftgym/MemoryQA-v0"), Returns(lambda cs: [AgentReply("x") for _ in cs]),
                     seeds=[3], options=[{"hops": 9}])


def test_each_turn_records_the_info_as_it_was_then():
    class History(gym.Wrapper):  # hands out the same list every step, appending to it
        def reset(self, **kwargs):
            self.seen = []
            return self.env.reset(**kwargs)

        def step(self, action):
            context, reward, terminated, truncated, info = self.env.step(action)
            self.seen.append(len(self.seen))
            return context, reward, terminated, truncated, {**info, "seen": self.seen}

    (episode,) = run_episodes(lambda: History(make_qa()), ScriptedAgent(["no tag"]), seeds=[0])
    assert [t.info["seen"] for t in episode.turns] == [[0], [0, 1], [0, 1, 2]]


def test_numpy_rewards_are_rewards():
    import numpy as np

    for reward in (np.True_, np.array(0.25), np.float32(0.5), 1):
        class Numpy(gym.Wrapper):
            def step(self, action):
                context, _, terminated, truncated, info = self.env.step(action)
                return context, reward, np.bool_(terminated), truncated, info

        (episode,) = run_episodes(lambda: Numpy(make_qa()), ScriptedAgent(["<answer>1</answer>"]), seeds=[0])
        assert episode.total_reward == float(reward) and isinstance(episode.turns[0].reward, float)


@pytest.mark.parametrize("step_result, message", [
    (lambda out: out[:4], r"step returned a 4-tuple; Gymnasium's step returns a 5-tuple"),
    (lambda out: (out[0], out[1], "False", out[3], out[4]), "returned terminated='False'"),
    (lambda out: (out[0], "0.5", *out[2:]), "returned the reward '0.5'"),
    (lambda out: (out[0], [0.5], *out[2:]), r"returned the reward \[0.5\]"),
])
def test_an_env_step_of_the_wrong_shape_is_named(step_result, message):
    class Odd(gym.Wrapper):
        def step(self, action):
            return step_result(self.env.step(action))

    with pytest.raises(EnvContractError, match=message):
        run_episodes(lambda: Odd(make_qa()), ScriptedAgent(["x"]), seeds=[0])


def test_every_env_made_is_closed_and_a_failing_close_does_not_hide_the_error():
    closed, made = [], []

    class Tracked(gym.Wrapper):
        def close(self):
            closed.append(self)
            raise OSError("close failed")

    def make_env():
        if len(made) == 2:
            raise RuntimeError("the third env cannot be made")
        made.append(Tracked(make_qa()))
        return made[-1]

    with pytest.raises(RuntimeError, match="the third env cannot be made"), \
            pytest.warns(UserWarning, match="closing an env failed too"):
        run_episodes(make_env, ScriptedAgent(["x"]), seeds=[0, 1, 2], config=RolloutConfig(num_envs=3))
    assert closed == made and len(made) == 2


def test_a_close_that_fails_after_the_episodes_is_named_like_a_failing_step():
    class FailingClose(gym.Wrapper):
        def close(self):
            raise OSError("disk gone")

    with pytest.raises(EnvError, match=r"rftgym/VerifiableQA-v0 raised OSError in close: disk gone") as info:
        run_episodes(lambda: FailingClose(make_qa()), ScriptedAgent(["x"]), seeds=[0, 1])
    assert isinstance(info.value.__cause__, OSError)


class _EndlessEnv(gym.Env):
    """An env with no turn budget of its own: every reply is answered, nothing ends."""

    def __init__(self):
        self.observation_space, self.action_space = ContextSpace(), AssistantText()

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.ids = MessageIds.from_rng(self.np_random)
        self.context = Context((self.ids.message("user", "go on"),))
        return self.context, {}

    def step(self, action):
        self.context = self.context.appended(self.ids.message("assistant", action))
        self.context = self.context.appended(self.ids.message("user", "go on"))
        return self.context, 0.0, False, False, {}


def test_rollout_safety_net_truncates_an_env_without_a_budget_but_never_cuts_an_env_budget():
    episodes = run_episodes(_EndlessEnv, ScriptedAgent(["?"]), seeds=[0])
    assert len(episodes[0].turns) == SAFETY_NET_TURNS and episodes[0].truncated
    assert episodes[0].turns[-1].info["rollout_truncated"]
    # An env's own max_turns above the net runs to its end (it was cut at the net without a word).
    episodes = run_episodes(lambda: gym.make("rftgym/VerifiableQA-v0", max_turns=SAFETY_NET_TURNS + 6),
                            ScriptedAgent(["?"]), seeds=[0])
    assert len(episodes[0].turns) == SAFETY_NET_TURNS + 6 and episodes[0].truncated
    assert "rollout_truncated" not in episodes[0].turns[-1].info


def test_a_gymnasium_time_limit_is_a_budget_of_the_envs_own():
    gym.register("rftgym-tests/Endless-v0", entry_point=_EndlessEnv)
    try:
        episodes = run_episodes(lambda: gym.make("rftgym-tests/Endless-v0", max_episode_steps=SAFETY_NET_TURNS + 6),
                                ScriptedAgent(["?"]), seeds=[0])
    finally:
        gym.registry.pop("rftgym-tests/Endless-v0")
    assert len(episodes[0].turns) == SAFETY_NET_TURNS + 6 and episodes[0].truncated
    assert "rollout_truncated" not in episodes[0].turns[-1].info  # the TimeLimit ended it


class TokenAgent(Agent):
    """Replies "ok" with token records of a given kind (numpy arrays, odd log-probs, ...)."""

    def __init__(self, sampled=(7, 8), logprobs=(-0.5, -0.25), token_level=False):
        self.sampled, self.logprobs, self.token_level = sampled, logprobs, token_level

    def act(self, contexts, **keyed):
        return [AgentReply(text="ok", prompt_ids=np.array([1, 2, 3]), sampled_ids=self.sampled,
                           logprobs=self.logprobs) for _ in contexts]


def test_token_records_are_kept_as_lists_of_python_numbers():
    agent = TokenAgent(sampled=np.array([7, 8]), logprobs=np.array([-0.5, -0.25], dtype=np.float32))
    with pytest.warns(UserWarning, match="not bound to its message"):
        (episode,) = run_episodes(make_qa, agent, seeds=[0])
    turn = episode.turns[0]
    assert turn.prompt_ids == [1, 2, 3] and turn.sampled_ids == [7, 8] and turn.logprobs == [-0.5, -0.25]
    assert all(type(t) is int for t in turn.sampled_ids) and all(type(x) is float for x in turn.logprobs)
    assert summarize([episode])["episodes"] == 1
    episode.to_json()  # as the eval command writes it


@pytest.mark.parametrize("logprob", [5.0, float("-inf"), float("inf"), float("nan")])
def test_an_impossible_log_prob_is_refused(logprob):
    with pytest.raises(AgentError, match="a sampled token's log-prob is finite and at most 0"):
        run_episodes(make_qa, TokenAgent(logprobs=(-0.5, logprob)), seeds=[0])


@pytest.mark.parametrize("token_level", [False, True])
def test_tokens_an_agent_leaves_unbound_are_said_once(token_level):
    # Not token-level, or token-level without assistant_span: later prompts would be re-tokenized.
    with pytest.warns(UserWarning, match="recorded sampled tokens for a reply but they are not bound") as caught:
        run_episodes(make_qa, TokenAgent(token_level=token_level), seeds=[0])
    assert sum("not bound" in str(w.message) for w in caught) == 1


def test_a_wrapper_that_changes_the_text_and_keeps_the_tokens_is_not_bound(tiny_policy):
    class Tidier(Agent):
        token_level = keyed_sampling = True

        def act(self, contexts, **keyed):
            replies = tiny_policy.act(contexts, **keyed)
            for reply in replies:
                reply.text = reply.text.strip() + "."  # text changed, tokens kept
            return replies

        def assistant_span(self, message, reply):
            return tiny_policy.assistant_span(message, reply)

    with pytest.warns(UserWarning, match="the reply's text is not what its tokens decode to"):
        (episode,) = run_episodes(make_qa, Tidier(), seeds=[0])
    assert episode.turns[0].sampled_ids  # recorded, but not bound to the stored text


@pytest.mark.parametrize("make_env", [_EndlessEnv, lambda: gym.make("rftgym/VerifiableQA-v0", max_turns=10)],
                         ids=["no budget", "larger budget"])
def test_a_rollout_max_turns_caps_every_env(make_env):
    episodes = run_episodes(make_env, ScriptedAgent(["?"]), seeds=[0], config=RolloutConfig(max_turns=3))
    assert len(episodes[0].turns) == 3 and episodes[0].truncated
    assert episodes[0].turns[-1].info["rollout_truncated"]
    # A smaller budget of the env's own ends the episode first, as the env ends it.
    episodes = run_episodes(lambda: gym.make("rftgym/VerifiableQA-v0", max_turns=2), ScriptedAgent(["?"]),
                            seeds=[0], config=RolloutConfig(max_turns=3))
    assert len(episodes[0].turns) == 2 and "rollout_truncated" not in episodes[0].turns[-1].info


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "3"])
def test_rollout_config_refuses_a_bad_max_turns(value):
    with pytest.raises(ConfigError, match="max_turns must be None"):
        RolloutConfig(max_turns=value)


def test_options_length_must_match():
    with pytest.raises(ConfigError, match="one per seed"):
        run_episodes(make_qa, ScriptedAgent(["x"]), seeds=[0, 1], options=[{}])


def test_tiny_model_rollout_records_tokens_and_summary(tiny_policy):
    episodes = run_episodes(make_qa, tiny_policy, seeds=list(range(5)), config=RolloutConfig(num_envs=4))
    for episode in episodes:
        assert episode.turns and all(t.has_tokens for t in episode.turns)
        assert len(episode.segments) == 1
    summary = summarize(episodes)
    assert summary["episodes"] == 5
    assert summary["sampled_tokens"] == sum(e.num_sampled_tokens for e in episodes) / 5
    # Means are floats even where every episode has the same count (a table prints 1.000, not 1).
    assert all(type(summary[key]) is float for key in ("reward", "turns", "sampled_tokens", "prompt_tokens"))
    assert len({len(e.turns) for e in episodes}) == 1  # every episode played as many turns: an int mean


class ForgetfulEnv(gym.Env):
    """Test env that, after the second turn, deletes the first assistant turn from the context
    (as a memory prune would) and keeps a note instead."""

    metadata = {"render_modes": []}

    def __init__(self):
        self.observation_space = ContextSpace()
        self.action_space = AssistantText()

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.ids = MessageIds.from_rng(self.np_random)
        self.turn = 0
        self.context = Context((self.ids.message("user", "Tell me three things, one per turn."),))
        return self.context, {}

    def step(self, action):
        self.turn += 1
        context = self.context.appended(self.ids.message("assistant", action))
        if self.turn == 2:
            first_reply = [m for m in context if m.role == "assistant"][0]
            context = context.without([first_reply.id]).appended(self.ids.message("user", "note: first thing kept"))
        else:
            context = context.appended(self.ids.message("user", "next"))
        self.context = context
        return context, 0.0, self.turn >= 3, False, {}


class ReplyDropping(gym.Env):
    """Test env that forgets to keep the agent's reply in its observation (a common bug)."""

    metadata = {"render_modes": []}

    def __init__(self):
        self.observation_space, self.action_space = ContextSpace(), AssistantText()

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.ids, self.turn = MessageIds.from_rng(self.np_random), 0
        self.context = Context((self.ids.message("user", "go"),))
        return self.context, {}

    def step(self, action):
        self.turn += 1
        self.context = self.context.appended(self.ids.message("user", "next"))
        return self.context, 0.0, self.turn >= 3, False, {}


def test_an_env_that_drops_the_agents_reply_is_warned_of_once():
    with pytest.warns(UserWarning, match="went on without the agent's reply as a new assistant message") as caught:
        episodes = run_episodes(ReplyDropping, ScriptedAgent("x"), seeds=[0, 1], config=RolloutConfig(num_envs=1))
    assert sum("went on without the agent's reply" in str(w.message) for w in caught) == 1
    assert all(t.message_id is None for e in episodes for t in e.turns)
    with warnings.catch_warnings():  # an env that keeps them: nothing to say
        warnings.simplefilter("error")
        run_episodes(ForgetfulEnv, ScriptedAgent("x"), seeds=[0])


def test_context_edit_starts_a_new_segment_with_the_edited_prompt(tiny_policy):
    episode = run_episodes(ForgetfulEnv, tiny_policy, seeds=[0])[0]
    assert len(episode.turns) == 3
    segments = episode.segments
    assert [s.turn_indices for s in segments] == [(0, 1), (2,)]
    second = segments[1]
    third_turn = episode.turns[2]
    # The new segment's prompt is exactly the edited context the model saw, all mask 0.
    assert second.token_ids[: second.prompt_length] == third_turn.prompt_ids
    assert second.loss_mask == [0] * len(third_turn.prompt_ids) + [1] * len(third_turn.sampled_ids)
    chat = tiny_policy.chat
    spans = {t.message_id: chat.assistant_span(episode.messages[t.message_id], t.sampled_ids) for t in episode.turns}
    assert second.token_ids == chat.prompt_ids(episode.context(2), spans) + third_turn.sampled_ids
    # The first segment trains turns 0 and 1 only: mask-1 tokens are exactly their samples.
    first = segments[0]
    sampled = [t for i, t in enumerate(first.token_ids) if first.loss_mask[i]]
    assert sampled == episode.turns[0].sampled_ids + episode.turns[1].sampled_ids


def test_a_keyed_token_level_agent_may_implement_act_alone():
    class KeyedActOnly(Agent):
        token_level = keyed_sampling = True

        def __init__(self):
            self.keys = []

        def act(self, contexts, *, sample_keys=None):  # the base act_tokens passes the keys on
            self.keys += sample_keys
            return [AgentReply(text="<answer>1</answer>") for _ in contexts]

    agent = KeyedActOnly()
    run_episodes(make_qa, agent, seeds=[3, 3])
    assert agent.keys == [(1, 3, 0, 0), (1, 3, 1, 0)]


# ---------------------------------------------------------------- cuts the env cannot see

@pytest.fixture
def sum_task(tmp_path):
    """One task whose wrong answer ("41") is known: a clean wrong answer is worth the format reward."""
    path = tmp_path / "qa.jsonl"
    path.write_text('{"question": "What is 6 times 7?", "answer": "42", "id": "mul"}\n', encoding="utf-8")
    return str(path)


WRONG = "<answer>41</answer>"
FORMAT_REWARD = 0.1  # VerifiableQA's default format_weight: what a clean wrong answer is worth


class WrongThenFull(Agent):
    """Answers wrongly (a clean answer) once, then has no room left."""

    def act(self, contexts):
        return [AgentReply(text="", finish_reason=CONTEXT_FULL) if any(m.role == "assistant" for m in c)
                else AgentReply(text=WRONG) for c in contexts]


@pytest.mark.parametrize("cut", ["rollout cap", "time limit", "full context"])
def test_a_cut_the_env_cannot_see_is_paid_what_its_own_budget_would_pay(sum_task, cut):
    kwargs = {"dataset_path": sum_task, "max_attempts": 3, "max_turns": 5}
    make_env, agent, config = (lambda: gym.make("rftgym/VerifiableQA-v0", **kwargs)), ScriptedAgent(WRONG), None
    if cut == "rollout cap":
        config = RolloutConfig(max_turns=2)
    elif cut == "time limit":
        make_env = lambda: gym.make("rftgym/VerifiableQA-v0", max_episode_steps=2, **kwargs)  # noqa: E731
    else:
        agent = WrongThenFull()
    episode = run_episodes(make_env, agent, seeds=[0], config=config)[0]
    *early, last = episode.turns
    assert episode.truncated and not episode.terminated
    assert [t.reward for t in early] == [0.0] * len(early)  # a turn that does not end the episode pays nothing
    assert last.reward == pytest.approx(FORMAT_REWARD) and last.info["reward_if_cut"] == pytest.approx(FORMAT_REWARD)
    assert episode.total_reward == pytest.approx(FORMAT_REWARD)


def test_the_envs_own_budget_is_paid_once():
    # The env's own truncation pays the answer itself; its info then owes nothing more.
    episode = run_episodes(lambda: gym.make("rftgym/VerifiableQA-v0", max_attempts=2, max_turns=2),
                           ScriptedAgent(["no tag here", "<answer>no such answer</answer>"]), seeds=[0])[0]
    assert episode.truncated and [t.reward for t in episode.turns] == [0.0, pytest.approx(FORMAT_REWARD)]
    assert episode.turns[-1].info["reward_if_cut"] == 0.0


@pytest.mark.parametrize("owed", [float("nan"), "0.1", True, None, 10 ** 400])
def test_an_env_owing_a_reward_that_is_not_a_number_is_named(owed):
    class BadOwed(gym.Wrapper):
        def step(self, action):
            context, reward, terminated, truncated, info = self.env.step(action)
            return context, reward, terminated, truncated, {**info, "reward_if_cut": owed}

    with pytest.raises(EnvContractError, match=r"turn 1\) returned info\['reward_if_cut'\]=.*a finite number"):
        run_episodes(lambda: BadOwed(make_qa()), ScriptedAgent(["<answer>1</answer>"]), seeds=[3])


def test_an_owed_reward_may_be_a_numpy_number(sum_task):
    class NumpyOwed(gym.Wrapper):
        def step(self, action):
            context, reward, terminated, truncated, info = self.env.step(action)
            return context, np.float32(reward), terminated, truncated, \
                {**info, "reward_if_cut": np.float32(info["reward_if_cut"])}

    episode = run_episodes(lambda: NumpyOwed(gym.make("rftgym/VerifiableQA-v0", dataset_path=sum_task, max_attempts=3,
                                                      max_turns=5)),
                           ScriptedAgent(WRONG), seeds=[0], config=RolloutConfig(max_turns=1))[0]
    assert type(episode.turns[-1].reward) is float and episode.turns[-1].reward == pytest.approx(FORMAT_REWARD)


@pytest.mark.parametrize("report", [["status"], "ok", {"reward_if_cut": 1.0}])
def test_an_env_whose_report_if_cut_is_not_a_dict_of_info_values_is_named(report):
    class BadReport(gym.Wrapper):
        def step(self, action):
            context, reward, terminated, truncated, info = self.env.step(action)
            return context, reward, terminated, truncated, {**info, "info_if_cut": report}

    with pytest.raises(EnvContractError, match=r"turn 1\) returned info\['info_if_cut'\] as .*; it is a dict of the "
                                               r"info values a cut"):
        run_episodes(lambda: BadReport(make_qa()), ScriptedAgent(["<answer>1</answer>"]), seeds=[3])


# ---------------------------------------------------------------- summaries and tables

def test_a_summary_of_no_episodes_has_every_key_with_nan_means():
    import math

    full = summarize(run_episodes(make_qa, ScriptedAgent(["<answer>1</answer>"]), seeds=[0]))
    empty = summarize([])
    assert list(empty) == list(full)
    counts = ("episodes", "context_full", "replies", "cut_replies")
    assert all(empty[k] == 0 for k in counts) and full["replies"] == 1 and full["cut_replies"] == 0
    assert all(math.isnan(v) for k, v in empty.items() if k not in counts)


def test_episodes_that_played_no_turn_have_no_format_error_rate():
    import math

    from rftgym.core.records import Episode, Turn

    def cut_at_once():  # its first prompt left no room for a reply: one empty CONTEXT_FULL turn
        turn = Turn(0, (), "", 0.0, False, True, {}, finish_reason=CONTEXT_FULL)
        return Episode("test", 0, {}, [turn], ())

    summary = summarize([cut_at_once(), cut_at_once()])
    assert summary["turns"] == 0 and summary["context_full"] == 2
    assert math.isnan(summary["format_error_rate"])  # no turn was played: no rate, not a rate of 0


@pytest.mark.parametrize("row, cells", [(["a"], 1), (["a", 1.0, "c"], 3)])
def test_a_table_row_without_one_cell_per_header_is_named(row, cells):
    from rftgym.rollout import format_table

    with pytest.raises(ValueError, match=rf"format_table: rows\[1\] has {cells} cells for 2 headers \(id, score\): "
                                         r"\['a'.*\]; give each row one cell per header"):
        format_table([["x", 0.5], row], ["id", "score"])
    assert format_table([["x", 0.5]], ["id", "score"]).splitlines() == ["id  score", "--  -----", "x   0.500"]
    assert format_table([["x", float("nan")]], ["id", "score"]).splitlines()[2].rstrip() == "x   -"  # a mean of nothing
