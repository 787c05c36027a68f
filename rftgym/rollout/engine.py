"""Batched rollouts: many environments, one agent, exact episode records.

Each round, the engine collects the current context of every active environment, asks the agent
for all replies in one batched call, steps every environment with its reply and records the
turn. A finished episode's slot takes the next seed at once, so the batch stays full until the
seeds run out. For token-level agents the engine keeps, per episode, the exact token span of each
sampled assistant message under the id the env gave it, and hands them back with the next
contexts, so later prompts hold exactly the sampled tokens. Agents with keyed sampling get each
reply's key (the episode's task seed, its repeat and the turn: :mod:`rftgym.agents.sampling_keys`),
so a seeded episode samples the same whatever ``num_envs`` is and whichever episodes share a batch.

When the agent answers ``CONTEXT_FULL`` (the context leaves no room for a reply), the episode
ends there as truncated: the engine records a turn with empty action and ``info["context_full"]``,
and does not step the env with it.

An env that pays on the turn that ends the episode (CodeTCG, VerifiableQA) cannot see a cut made
outside it (a Gymnasium TimeLimit, the rollout's turn cap, a full context); each of its steps says
in ``info["reward_if_cut"]`` what its own budget running out there would have paid, and in
``info["info_if_cut"]`` what it would have reported in place of the step's own info. The last turn
of an episode that ends truncated gets that amount (from the step before, for a full context)
added to its reward and those values merged into its info, so a cut episode is paid and reported
as the env's own truncation would have done: the recorded ``Turn.reward`` already holds it.
"""

from __future__ import annotations

import copy
import math
import numbers
import os
import traceback
from dataclasses import dataclass, field
from functools import partial
from collections.abc import Sized
from typing import Any, Callable, Sequence

import gymnasium as gym
import numpy as np

from ..agents.base import CONTEXT_FULL, Agent, AgentReply, why_not_keyed
from ..agents.sampling_keys import check_key, episode_keys
from ..core.errors import AgentError, ConfigError, EnvContractError, EnvError, RftgymError, warn_caller
from ..core.messages import Context, Message
from ..core.records import LOGPROB_ROUNDING, Episode, Turn
from ..core.values import a_type, is_finite_real, is_int
from ..envs.common import INFO_IF_CUT, REWARD_IF_CUT, settle_cut


SAFETY_NET_TURNS = 64


@dataclass(frozen=True)
class RolloutConfig:
    num_envs: int = 8  # episodes run side by side (the agent's batch size)
    # None: a safety net of SAFETY_NET_TURNS for envs without a turn budget of their own (an
    # env's config.max_turns or spec.max_episode_steps), none for the others, whose budget ends
    # them. A number: a cap on every episode, whatever the env's own budget (an episode cut by it
    # is truncated and its last turn's info says "rollout_truncated").
    max_turns: int | None = None

    def __post_init__(self) -> None:
        if not is_int(self.num_envs) or self.num_envs < 1:
            raise ConfigError(f"num_envs must be an integer of at least 1, got {self.num_envs!r}")
        if self.max_turns is not None and (not is_int(self.max_turns) or self.max_turns < 1):
            raise ConfigError(f"max_turns must be None (the env's own budget, else {SAFETY_NET_TURNS} turns) "
                              f"or an integer of at least 1, got {self.max_turns!r}")

    def turn_cap(self, env_budget: int) -> int:
        """The turn at which the rollout truncates an episode of an env whose own budget is
        ``env_budget`` (0: it declares none)."""
        if self.max_turns is not None:
            return self.max_turns
        return env_budget or SAFETY_NET_TURNS


@dataclass
class _Slot:
    env: gym.Env
    seed: int | None = None
    options: dict[str, Any] | None = None
    context: Context = field(default_factory=Context)
    messages: dict[str, Message] = field(default_factory=dict)
    turns: list[Turn] = field(default_factory=list)
    spans: dict[str, tuple[int, ...]] = field(default_factory=dict)  # exact assistant spans, by id
    reset_info: dict[str, Any] = field(default_factory=dict)
    active: bool = False
    warned_changed_reply: bool = False  # the env changed a reply's text (warned once per slot)
    warned_missing_reply: bool = False  # the env kept no assistant message of a reply (once per slot)
    warned_unbound_tokens: bool = False  # sampled tokens the agent did not bind to their message

    @property
    def own_max_turns(self) -> int:
        """The env's own turn budget, 0 when it declares none: the larger of its config's
        ``max_turns`` and Gymnasium's ``max_episode_steps`` (a TimeLimit from ``gym.make``). The
        rollout's safety net must not cut an episode before the env's budget ends it."""
        limit = getattr(getattr(self.env.unwrapped, "config", None), "max_turns", 0)
        steps = getattr(getattr(self.env, "spec", None), "max_episode_steps", None)
        return max(int(limit) if is_int(limit) else 0, int(steps) if is_int(steps) else 0)


def _env_id(env: gym.Env) -> str:
    spec = getattr(env, "spec", None)
    return spec.id if spec is not None else type(env.unwrapped).__name__


def _new_assistant_message(before: Context, after: Context, action: str) -> Message | None:
    """The message the env made from ``action``: the first new assistant message."""
    old = set(before.ids)
    candidates = [m for m in after.messages if m.id not in old and m.role == "assistant"]
    for message in candidates:
        if message.content == action:
            return message
    return candidates[0] if candidates else None


def run_episodes(
    make_env: Callable[[], gym.Env],
    agent: Agent,
    seeds: Sequence[int | None],
    *,
    config: RolloutConfig | None = None,
    options: Sequence[dict[str, Any] | None] | None = None,
    on_episode: Callable[[Episode], None] | None = None,
    sample_keys: Sequence[Sequence[int]] | None = None,
) -> list[Episode]:
    """Run one episode per seed with ``agent``; return the episodes in the order of ``seeds``.

    ``make_env`` makes a new env each call (``lambda: gym.make(env_id)``): each of the
    ``config.num_envs`` episodes run side by side has its own. ``on_episode`` is called with each
    episode as it finishes (in the order they finish).

    ``sample_keys`` (one per seed, each a sequence of non-negative ints) names each episode's
    sampling stream for agents with keyed sampling; by default the task seed and how many earlier
    episodes had it (:func:`~rftgym.agents.sampling_keys.episode_keys`). A caller that runs the
    same seeds again and wants other samples gives its own (the trainer keys by step and task).
    An agent without keyed sampling (``keyed_sampling`` False) cannot take them: given keys are
    then ignored with a warning, as its episodes may sample otherwise in another batch.

    An exception that stops the rollout (an agent or env error, a failing ``on_episode``, a
    KeyboardInterrupt) escapes as it is, of the type it was, and carries the episodes finished
    before it: ``exc.finished_episodes`` (in the order of ``seeds``, possibly empty) and
    ``exc.finished_indices`` (their positions in ``seeds``). So a long rollout that fails near its
    end keeps its work without an ``on_episode``::

        try:
            episodes = run_episodes(make_env, agent, seeds)
        except Exception as exc:
            write_episodes_jsonl("partial.jsonl", exc.finished_episodes)
            raise
    """
    finished: dict[int, Episode] = {}  # position in seeds -> its episode, as each one ends
    slots: list[_Slot] = []
    rolled_out = False
    try:
        config = config if config is not None else RolloutConfig()
        _check_arguments(make_env, agent, seeds, config, options, on_episode)
        seeds = _checked_seeds(seeds)
        keys = _episode_keys(agent, seeds, sample_keys)
        queue = list(range(len(seeds)))
        owner: dict[int, int] = {}  # slot index -> episode index

        def start(slot_index: int) -> None:
            slot = slots[slot_index]
            episode_index = queue.pop(0)
            seed = seeds[episode_index]
            opts = options[episode_index] if options is not None else None
            context, info = checked_reset(slot.env, seed, opts)
            slot.seed, slot.options, slot.context = seed, opts, context
            slot.messages = {m.id: m for m in context}
            slot.turns, slot.spans, slot.reset_info, slot.active = [], {}, _snapshot(info), True
            owner[slot_index] = episode_index

        def finish(slot_index: int) -> None:
            slot = slots[slot_index]
            episode = Episode(_env_id(slot.env), slot.seed, slot.messages, slot.turns, slot.context.ids,
                              slot.reset_info)
            finished[owner.pop(slot_index)] = episode
            slot.active = False
            if on_episode is not None:
                on_episode(episode)

        for _ in range(min(config.num_envs, len(seeds))):
            slots.append(_Slot(_new_env(make_env, slots)))
        for i in range(len(slots)):
            start(i)
        while any(slot.active for slot in slots):
            active = [i for i, slot in enumerate(slots) if slot.active]
            contexts = [slots[i].context for i in active]
            keyed = {} if keys is None else {"sample_keys": [(*keys[owner[i]], len(slots[i].turns)) for i in active]}
            where = partial(_batch_where, slots, active)  # said only if the agent fails
            if agent.token_level:
                replies = _agent_call(agent, "act_tokens", where, contexts, [slots[i].spans for i in active],
                                      **keyed)
            else:
                replies = _agent_call(agent, "act", where, contexts, **keyed)
            _check_replies(agent, replies, len(active))
            for i, reply in zip(active, replies):
                _step(slots[i], agent, reply, config.turn_cap(slots[i].own_max_turns))
                if not slots[i].active:
                    finish(i)
                    if queue:
                        start(i)
        rolled_out = True
        _close_all(slots, raising=False)  # every episode is done: a close that fails is the error
    except BaseException as exc:
        if not rolled_out:
            _close_all(slots, raising=True)
        _carry_finished(exc, finished)
        raise
    return [finished[i] for i in range(len(seeds))]


def _carry_finished(exc: BaseException, finished: dict[int, Episode]) -> None:
    """Hand the episodes finished before ``exc`` to whoever catches it (the attributes documented
    in :func:`run_episodes`), on the exception as it is: callers catch the types they know."""
    order = sorted(finished)
    try:
        exc.finished_episodes = [finished[i] for i in order]
        exc.finished_indices = order
    except (AttributeError, TypeError):  # an exception type that takes no attributes: it escapes as it is
        pass


def check_env_factory(make_env) -> None:
    """Refuse a ``make_env`` that is not a function making a new env each call (an env itself, an
    env id), as :func:`run_episodes` and ``train`` take it."""
    if isinstance(make_env, (gym.Env, str)) or not callable(make_env):
        hint = f"lambda: gym.make({make_env!r})" if isinstance(make_env, str) else "lambda: gym.make(env_id)"
        what = "an env" if isinstance(make_env, gym.Env) else type(make_env).__name__
        raise TypeError(f"make_env is a function that makes a new env each call, e.g. {hint} (each episode run "
                        f"side by side needs its own env), got {what} {_short(make_env)}")


def _check_arguments(make_env, agent, seeds, config, options, on_episode) -> None:
    """Arguments of the wrong kind, named before any env is made (they would fail later, deep in
    the rollout, with a message about something else)."""
    check_env_factory(make_env)
    if not isinstance(agent, Agent):
        if isinstance(agent, type) and issubclass(agent, Agent):
            raise TypeError(f"agent is an Agent instance, got the class {agent.__qualname__}; make one first, "
                            f"e.g. {agent.__qualname__}(...)")
        hint = "; a function from a context to the reply's text is ScriptedAgent(function)" if callable(agent) else ""
        raise TypeError(f"agent is an rftgym Agent (a subclass of rftgym.agents.Agent with act(contexts) -> list of "
                        f"AgentReply), got {type(agent).__name__} {_short(agent)}{hint}")
    if isinstance(seeds, (str, bytes, dict)) or not isinstance(seeds, Sized) or not hasattr(seeds, "__getitem__"):
        raise TypeError(f"seeds is a sequence with one seed (an int, or None) per episode, e.g. range(8) or [0] * 4, "
                        f"got {type(seeds).__name__} {_short(seeds)}")
    if not isinstance(config, RolloutConfig):
        raise TypeError(f"config is a RolloutConfig (e.g. RolloutConfig(num_envs=8)) or None, got "
                        f"{type(config).__name__} {_short(config)}")
    if options is not None:
        if isinstance(options, (str, bytes, dict)) or not isinstance(options, Sized) \
                or not hasattr(options, "__getitem__"):
            raise TypeError(f"options is a sequence with one reset options dict (or None) per seed, e.g. "
                            f"[{{...}}] * {len(seeds)}, or None; got {type(options).__name__} {_short(options)}")
        if len(options) != len(seeds):
            raise ConfigError(f"options has {len(options)} entries for {len(seeds)} seeds; give one per seed or none")
    if on_episode is not None and not callable(on_episode):
        raise TypeError(f"on_episode is a function called with each finished episode (e.g. a list's append), or "
                        f"None; got {type(on_episode).__name__} {_short(on_episode)}")


def _checked_seeds(seeds: Sequence) -> list[int | None]:
    """The seeds as Python ints (numpy's too: Gymnasium's reset takes only Python ints), a
    ValueError naming the first that is not a non-negative int or None (found now, not as an env's
    failure to reset)."""
    checked = []
    for position, seed in enumerate(seeds):
        if seed is not None and (not is_int(seed) or seed < 0):
            raise ValueError(f"seeds[{position}] is {_short(seed)}; a seed is an int >= 0 (or None: an unseeded reset)")
        checked.append(None if seed is None else int(seed))
    return checked


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _new_env(make_env: Callable[[], gym.Env], slots: list[_Slot]) -> gym.Env:
    """A new env from ``make_env``: one that is not an env, or an env that another slot already
    runs (``lambda: env`` would run every episode of the batch in one env, mixing them up), is
    refused."""
    env = make_env()
    if not isinstance(env, gym.Env):
        raise TypeError(f"make_env returned {type(env).__name__} {_short(env)}; it returns a new gymnasium.Env each "
                        "call, e.g. lambda: gym.make(env_id)")
    if any(slot.env is env for slot in slots):
        raise ConfigError(f"make_env returned the same {_env_id(env)} env twice; episodes run side by side each need "
                          "an env of their own: make a new one in each call (lambda: gym.make(env_id)), or run one "
                          "env at a time with RolloutConfig(num_envs=1)")
    return env


def _episode_keys(agent: Agent, seeds: Sequence, sample_keys) -> list[tuple[int, ...]] | None:
    """Each episode's sampling key, for an agent with keyed sampling (None for one without). Given
    keys are checked whatever the agent; an agent that cannot take them is warned about, since the
    caller asked for per-episode streams it will not get."""
    keyed_agent = getattr(agent, "keyed_sampling", False)
    if sample_keys is None:
        return episode_keys(seeds) if keyed_agent else None
    keys = _checked_keys(sample_keys, len(seeds))
    if not keyed_agent:
        warn_caller(f"sample_keys are ignored: agent {_agent_name(agent)!r} has no keyed sampling "
                    f"(keyed_sampling is False{why_not_keyed(type(agent))}), so its replies do not draw from "
                    "per-episode streams, and an episode may sample otherwise in another batch. Pass no "
                    "sample_keys for this agent, or give it keyed sampling (keyed_sampling = True and a "
                    "sample_keys=None parameter on act(), or on act_tokens() for a token-level agent)")
        return None
    return keys


def _agent_name(agent: Agent) -> str:
    return getattr(agent, "name", type(agent).__name__)


def _where(slot: _Slot) -> str:  # turns named from 1, as info["turn"] counts them
    return f"{_env_id(slot.env)} seed {slot.seed} turn {len(slot.turns) + 1}"


def _batch_where(slots: list[_Slot], active: list[int]) -> str:
    return ", ".join(_where(slots[i]) for i in active[:3]) + (" ..." if len(active) > 3 else "")


def _agent_call(agent: Agent, method: str, where: Callable[[], str], *args, **kwargs):
    """``agent``'s ``method`` (act, act_tokens, assistant_span, on_assistant_message): an exception
    of the agent's own (not one of rftgym's, which already say what to do) becomes an AgentError
    that names the agent, the method and where it was (``where()``, made only then)."""
    try:
        return getattr(agent, method)(*args, **kwargs)
    except RftgymError:
        raise
    except Exception as exc:
        in_method = "" if method in ("act", "act_tokens") else f" in {method}()"
        raise AgentError(f"agent {_agent_name(agent)!r} raised {type(exc).__name__}{in_method}: {exc} "
                         f"({'replying to' if not in_method else 'after its reply to'} {where()})") from exc


def _checked_keys(sample_keys, count: int) -> list[tuple[int, ...]]:
    if len(sample_keys) != count:
        raise ConfigError(f"sample_keys has {len(sample_keys)} entries for {count} seeds; give one per seed or none")
    try:
        return [check_key(key, f"sample_keys[{i}]") for i, key in enumerate(sample_keys)]
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None


def _close_all(slots: list[_Slot], *, raising: bool) -> None:
    """Close every env. A close that fails does not stop the others; while the rollout is raising
    an error of its own, a failed close only warns (it would hide that error)."""
    failure, failed_env = None, None
    for slot in slots:
        try:
            slot.env.close()
        except Exception as exc:  # noqa: BLE001 (any env's close)
            if failure is None:
                failure, failed_env = exc, slot.env
    if failure is None:
        return
    if raising:
        warn_caller(f"closing an env failed too ({_env_id(failed_env)} raised {type(failure).__name__}: "
                    f"{failure})")
    elif isinstance(failure, RftgymError):  # already says what to do
        raise failure
    else:  # as reset and step: name the env (a bare OSError says nothing of whose close it was)
        raise EnvError(f"{_env_id(failed_env)} raised {type(failure).__name__} in close: {failure}; an env's close() "
                       "frees what the env owns and is safe to call twice") from failure


def _check_replies(agent: Agent, replies, expected: int) -> None:
    """An agent's answer to one batch: a list of ``expected`` AgentReplies with text, and for
    token-level replies matching token records (they become the training data)."""
    name = _agent_name(agent)
    if not isinstance(replies, (list, tuple)):
        raise AgentError(f"agent {name!r} returned {a_type(replies)} from act(); return a list of "
                         "AgentReply, one per context")
    if len(replies) != expected:
        raise AgentError(f"agent {name!r} returned {len(replies)} replies for {expected} contexts")
    for reply in replies:
        if not isinstance(reply, AgentReply):
            raise AgentError(f"agent {name!r} returned {_short(reply)} (a {type(reply).__name__}) as a reply; each "
                             "reply is an AgentReply: wrap the text, AgentReply(text=...) (rftgym.agents.base)")
        if not isinstance(reply.text, str):
            raise AgentError(f"agent {name!r} returned a reply with {type(reply.text).__name__} text "
                             f"({_short(reply.text)}); an AgentReply's text is a str (\"\" for none)")
        if reply.finish_reason is not None and not isinstance(reply.finish_reason, str):
            raise AgentError(f"agent {name!r} returned the finish_reason {reply.finish_reason!r}; it is a str or None")
        if reply.finish_reason == CONTEXT_FULL and reply.text:
            raise AgentError(f"agent {name!r} returned text with finish_reason {CONTEXT_FULL!r}, which means there "
                             "was no room for a reply (the text would be dropped); send no text with it")
        _check_tokens(name, reply)


def _check_tokens(name: str, reply: AgentReply) -> None:
    """A token-level reply's records, which become training data: both token lists or neither,
    integers, and one log-prob (a finite number, at most 0) per sampled token. Sequences of
    another kind (numpy arrays, tuples) are made lists of Python numbers, as the records keep them."""
    if reply.sampled_ids is None:
        if reply.prompt_ids is not None or reply.logprobs is not None:
            raise AgentError(f"agent {name!r} returned prompt_ids or logprobs without sampled_ids; a token-level "
                             "reply records prompt_ids and sampled_ids (and logprobs) together, or none of them")
        return
    if reply.prompt_ids is None:
        raise AgentError(f"agent {name!r} returned sampled_ids without prompt_ids; a token-level reply "
                         "records both (or neither)")
    for name_of_ids in ("prompt_ids", "sampled_ids"):
        ids = getattr(reply, name_of_ids)
        # Plain ints in a list first, in one pass (a whole prompt, every turn: the numbers ABC is
        # slow); other sequences of integers (numpy's too) become such a list.
        if not (type(ids) is list and all(type(t) is int for t in ids)):
            if isinstance(ids, (str, bytes)) or not all(is_int(t) for t in ids):
                raise AgentError(f"agent {name!r} returned {name_of_ids} that are not a sequence of token ids (ints)")
            ids = [int(t) for t in ids]
            setattr(reply, name_of_ids, ids)
        if ids and min(ids) < 0:  # an embedding row would be read from the end, or an index error raised
            raise AgentError(f"agent {name!r} returned a negative token id ({min(ids)}) in {name_of_ids}; token ids "
                             "are >= 0")
    if reply.logprobs is not None:
        if len(reply.logprobs) != len(reply.sampled_ids):
            raise AgentError(f"agent {name!r} returned {len(reply.logprobs)} log-probs for "
                             f"{len(reply.sampled_ids)} sampled tokens; give one per token")
        if not all(isinstance(x, numbers.Real) and not isinstance(x, bool) for x in reply.logprobs):
            raise AgentError(f"agent {name!r} returned log-probs that are not numbers")
        logprobs = [float(x) for x in reply.logprobs]
        # A sampled token's log-prob is finite and at most 0 (a little above 0 is float rounding).
        bad = next((x for x in logprobs if not -math.inf < x <= LOGPROB_ROUNDING), None)
        if bad is not None:
            raise AgentError(f"agent {name!r} returned the log-prob {bad} for a sampled token; a sampled token's "
                             "log-prob is finite and at most 0 (NaN, infinite or positive ones would turn training's "
                             "importance ratios into NaN or nonsense)")
        reply.logprobs = logprobs


def _snapshot(info: dict) -> dict:
    """The info as it is now: an env may hand out its own mutable state (a list it appends to every
    step), which a shallow copy would leave every turn's record sharing. Values that cannot be
    copied are kept as they are."""
    try:
        return copy.deepcopy(info)
    except Exception:  # noqa: BLE001 (a lock, a file, a generator in the info)
        return dict(info)


def _call_env(env: gym.Env, episode_seed, call: str, turn: int, *args, **kwargs):
    """``env.reset`` or ``env.step``; an exception of the env's own (not one of rftgym's, which
    already say what to do) becomes an EnvError that names the env, the seed and the turn."""
    try:
        return getattr(env, call)(*args, **kwargs)
    except RftgymError:
        raise
    except Exception as exc:
        options = kwargs.get("options")
        where = f"seed {episode_seed}" + (f", turn {turn + 1}" if call == "step" else "") + \
            (f", options {options!r}" if options else "")  # a bad option is the caller's to fix
        if _found_by_gymnasiums_checker(exc):  # what it returned broke the API: no crash of the env's own
            returns = "(observation, info)" if call == "reset" else "(observation, reward, terminated, truncated, info)"
            raise EnvContractError(f"{_env_id(env)} ({where}) broke Gymnasium's {call} API (Gymnasium, reading "
                                   f"what it returned: {exc or type(exc).__name__}); {call} returns {returns}, info "
                                   "a dict") from None
        raise EnvError(f"{_env_id(env)} raised {type(exc).__name__} in {call} ({where}): {exc}") from exc


def _found_by_gymnasiums_checker(exc: BaseException) -> bool:
    """Whether ``exc`` says that what the env returned broke Gymnasium's API, as Gymnasium's own
    code found on reading it: its passive env checker (``gym.make`` wraps an env in it for its first
    reset and step) asserts what they return, and its wrappers unpack a step's 5-tuple."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames or os.sep + "gymnasium" + os.sep not in frames[-1].filename:
        return False
    return os.path.basename(frames[-1].filename) == "passive_env_checker.py" or \
        (isinstance(exc, ValueError) and "values to unpack" in str(exc))


def _unpack(result, size: int, env: gym.Env, seed, call: str) -> tuple:
    if not isinstance(result, tuple) or len(result) != size:
        shape = f"a {len(result)}-tuple" if isinstance(result, tuple) else a_type(result)
        raise EnvContractError(f"{_env_id(env)} (seed {seed}) {call} returned {shape}; Gymnasium's {call} returns a "
                               f"{size}-tuple")
    return result


def _check_observation(where: str, context, info) -> None:
    """What reset and step hand back (``where`` ends in the verb, e.g. "... reset to"): the chat
    context and an info dict."""
    if not isinstance(context, Context):
        raise EnvContractError(f"{where} {a_type(context)}; an rftgym env's observation is the chat "
                               "context (rftgym.core.messages.Context)")
    if not isinstance(info, dict):
        raise EnvContractError(f"{where} {a_type(info)} as its info; Gymnasium's info is a dict")


def checked_reset(env: gym.Env, seed: int | None, options: dict[str, Any] | None = None) -> tuple[Context, dict]:
    """``env.reset(seed=seed, options=options)``, held to the protocol as the engine holds it: an
    exception of the env's own becomes an EnvError naming the env and seed, and anything but a
    (Context, info dict) pair an EnvContractError."""
    context, info = _unpack(_call_env(env, seed, "reset", 0, seed=seed, options=options), 2, env, seed, "reset")
    _check_observation(f"{_env_id(env)} (seed {seed}) reset to", context, info)
    return context, info


def checked_step(env: gym.Env, seed: int | None, turn: int, action: str) -> tuple[Context, float, bool, bool, dict]:
    """``env.step(action)`` on the episode of ``seed``, at ``turn`` (0 for the first; messages name
    it from 1, as ``info["turn"]`` does), held to the protocol as the engine holds it: the reward a
    finite float, the flags bools."""
    context, reward, terminated, truncated, info = _unpack(_call_env(env, seed, "step", turn, action), 5, env, seed,
                                                           "step")
    reward = _checked_step(f"{_env_id(env)} (seed {seed}, turn {turn + 1})", context, reward, terminated, truncated,
                           info)
    return context, reward, bool(terminated), bool(truncated), info


def _checked_step(where: str, context, reward, terminated, truncated, info) -> float:
    """The step's reward as a float, once the env's answer keeps the protocol: a NaN or infinite
    reward would turn every advantage of its group, and then the weights, into NaN."""
    _check_observation(f"{where} returned", context, info)
    for name, flag in (("terminated", terminated), ("truncated", truncated)):
        if not isinstance(flag, (bool, np.bool_)):
            raise EnvContractError(f"{where} returned {name}={flag!r}; Gymnasium's step flags are bools")
    if isinstance(reward, (str, bytes)) or not isinstance(reward, (numbers.Real, np.number, np.bool_, np.ndarray)) \
            or np.ndim(reward) != 0 or np.iscomplexobj(reward):
        raise EnvContractError(f"{where} returned the reward {reward!r}; a reward is a finite number")
    value = float(reward)
    if not math.isfinite(value):
        raise EnvContractError(f"{where} returned the reward {value}; a reward is a finite number (a NaN or "
                               "infinite one would make every advantage of its group, then the weights, NaN)")
    owed = info.get(REWARD_IF_CUT, 0.0)
    if not is_finite_real(owed):
        raise EnvContractError(f"{where} returned info[{REWARD_IF_CUT!r}]={owed!r}; it is the reward a cut of the "
                               "episode on this step is paid, a finite number (0 when nothing would be)")
    report = info.get(INFO_IF_CUT, {})
    if not isinstance(report, dict) or INFO_IF_CUT in report or REWARD_IF_CUT in report:
        raise EnvContractError(f"{where} returned info[{INFO_IF_CUT!r}] as {type(report).__name__} "
                               f"{str(report)[:100]}; it is a dict of the info values a cut of the episode on this "
                               f"step reports in place of the step's own ({{}} when they are the same), without "
                               f"{INFO_IF_CUT!r} or {REWARD_IF_CUT!r} in it")
    return value


def _step(slot: _Slot, agent: Agent, reply: AgentReply, max_turns: int) -> None:
    before = slot.context
    if reply.finish_reason == CONTEXT_FULL:  # no room for a reply: the episode ends, the env unstepped
        last = slot.turns[-1].info if slot.turns else {}  # checked at that step
        owed, info = settle_cut(0.0, {"context_full": True, **{k: last[k] for k in (REWARD_IF_CUT, INFO_IF_CUT)
                                                                 if last.get(k)}})
        info.pop(INFO_IF_CUT, None)  # merged
        slot.turns.append(Turn(index=len(slot.turns), context_ids=before.ids, action="", reward=owed,
                               terminated=False, truncated=True, info=info, finish_reason=CONTEXT_FULL))
        slot.active = False
        return
    context, reward, terminated, truncated, info = checked_step(slot.env, slot.seed, len(slot.turns), reply.text)
    if not (terminated or truncated) and len(slot.turns) + 1 >= max_turns:
        truncated = True
        info = {**info, "rollout_truncated": True}
    if truncated and not terminated:  # cut by whoever: pay, and report, what the env's own budget would have
        reward, info = settle_cut(reward, info)
    message = _new_assistant_message(before, context, reply.text)
    if message is None and not (terminated or truncated) and not slot.warned_missing_reply:
        slot.warned_missing_reply = True  # (on an episode's last turn no later prompt shows the reply)
        warn_caller(f"{_env_id(slot.env)} went on without the agent's reply as a new assistant message in its "
                    "observation; the protocol keeps each reply as the context's next assistant message, so the next "
                    "prompt lacks it, and for a token-level policy each such turn starts a segment of its own")
    if message is not None:
        # The sampled tokens stand for the message only when the env kept the reply's text as it
        # was; an env that changed it (e.g. cut it to a length limit) put other text before the
        # model, which the next prompt renders as the env wrote it.
        kept = message.content == reply.text
        if not kept and not slot.warned_changed_reply:
            slot.warned_changed_reply = True
            warn_caller(f"{_env_id(slot.env)} stored a reply other than the agent's text (e.g. cut or tidied); "
                        "the next prompt shows the env's text, so for a token-level policy that turn ends a "
                        "segment (more segments, each trained with its own prompt)")
        where = partial(_where, slot)
        span = _agent_call(agent, "assistant_span", where, message, reply) \
            if agent.token_level and kept else None
        if span is not None:
            slot.spans[message.id] = span
        elif kept and reply.sampled_ids is not None and not slot.warned_unbound_tokens:
            slot.warned_unbound_tokens = True
            how = ("its assistant_span() gave none: the agent does not implement it, or the reply's text is not "
                   "what its tokens decode to, e.g. a wrapping agent changed the text and kept the tokens"
                   if agent.token_level else
                   "the agent is not token_level, so act_tokens() and assistant_span() are not used")
            warn_caller(f"agent {_agent_name(agent)!r} recorded sampled tokens for a reply "
                        f"but they are not bound to its message ({how}); later prompts re-tokenize the text, "
                        "which may differ from the tokens sampled. A token-level agent sets token_level = True and "
                        "implements act_tokens() and assistant_span() (as HFPolicy does); one that changes a "
                        "reply's text returns no token records for it")
        _agent_call(agent, "on_assistant_message", where, message, reply)
    slot.turns.append(Turn(
        index=len(slot.turns),
        context_ids=before.ids,
        action=reply.text,
        reward=reward,
        terminated=bool(terminated),
        truncated=bool(truncated),
        info=_snapshot(info),
        prompt_ids=reply.prompt_ids,
        sampled_ids=reply.sampled_ids,
        logprobs=reply.logprobs,
        finish_reason=reply.finish_reason,
        message_id=message.id if message is not None else None,
    ))
    for m in context:
        known = slot.messages.setdefault(m.id, m)
        if known != m:  # the records (and the model's exact spans) are keyed by id
            raise EnvContractError(f"{_env_id(slot.env)} (seed {slot.seed}, turn {len(slot.turns)}) sent message "
                                   f"{m.id!r} again with other content; messages are immutable: give an edited "
                                   "message a new id (the records and the model's exact tokens are kept by id)")
    slot.context = context
    slot.active = not (terminated or truncated)
