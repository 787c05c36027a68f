"""Constructor plumbing every rftgym env shares: render-mode and config checks, and the metadata
that callers (eval, the trainer) read before they make an env."""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import json
import math
import os
import re
import sys
from contextlib import contextmanager
from typing import Any, Mapping, TypeVar

from ..core.errors import ConfigError
from ..core.spaces import AssistantText, ContextSpace
from ..core.values import is_int

ConfigT = TypeVar("ConfigT")


def check_render_mode(render_mode: str | None, metadata: dict) -> None:
    if render_mode is not None and render_mode not in metadata["render_modes"]:
        raise ConfigError(f"render_mode must be one of {metadata['render_modes']} or None, got {render_mode!r}")


def resolve_config(config_class: type[ConfigT], options: dict[str, Any]) -> ConfigT:
    """The env's config from ``config=ConfigClass(...)``, ``config={field: value}`` or its fields
    as keywords (not two of them). A dict is what ``env.spec.to_json()`` writes of a config, so
    that ``gym.make`` of a spec read back from JSON makes the same env."""
    options = dict(options)
    given = options.pop("config", None)
    name = config_class.__name__
    if given is not None and not isinstance(given, (config_class, dict)):
        raise ConfigError(f"config must be a {name} or a dict of its fields, got {type(given).__name__}; "
                          "or pass its fields as keywords")
    if given is not None and options:
        raise ConfigError(f"pass either config={name}(...) or its fields as keywords, not both "
                          f"(got config= and {', '.join(sorted(options))})")
    if isinstance(given, dict):
        check_text_for_values(config_class, given)
        return config_from_dict(config_class, given)
    check_option_names(config_class, options)
    check_text_for_values(config_class, options)
    return given if given is not None else config_class(**options)


def check_text_for_values(config_class: type, options: dict[str, Any]) -> None:
    """Refuse text given for a number or a boolean field (a YAML value in quotes, a string built
    in Python): the field's own check would say the value is out of range, or take "false" as
    true, where what is wrong is its type."""
    fields = {f.name: f for f in dataclasses.fields(config_class)}
    for name, value in options.items():
        field = fields.get(name)
        if field is None or not isinstance(value, str):
            continue
        kinds = set(re.findall(r"\w+", field.type if isinstance(field.type, str) else str(field.type))) - {"None"}
        if not kinds or not kinds <= {"int", "float", "bool"}:   # (a number or a flag alone, or None)
            continue
        wanted = "true or false (a boolean)" if kinds == {"bool"} else "a number"
        meant = _value_of_text(value, kinds)
        hint = f" (e.g. {name}={json.dumps(meant)})" if meant is not None else ""
        raise ConfigError(f"{name} must be {wanted}, got the text {value!r}; give the value itself, not "
                          f"text{hint}", field=name)


def _value_of_text(text: str, kinds: set[str]):
    """The value ``text`` reads as for a field of ``kinds`` (an int where it takes ints only), or None."""
    word = text.strip().lower()
    if kinds == {"bool"}:
        return {"true": True, "false": False}.get(word)
    try:
        number = float(word)
    except ValueError:
        return None
    if not math.isfinite(number):
        return None
    return int(number) if "float" not in kinds and number.is_integer() else number


class UnknownOptionError(ConfigError, TypeError):
    """An env was given a keyword it does not take. A TypeError too, as Python's own error for an
    unexpected keyword is, so that code catching that (gymnasium's make, which adds the env id,
    and front ends that read the name from "unexpected keyword argument 'NAME'") still does."""


def check_option_names(config_class: type, options: dict[str, Any]) -> None:
    """Refuse a keyword that is not one of ``config_class``'s settable fields, naming it, the field
    it most likely meant and the valid ones (Python's own TypeError names none of them)."""
    fields = {f.name: f for f in dataclasses.fields(config_class)}
    settable = [name for name, f in fields.items() if f.init]
    unknown = [name for name in options if name not in settable]
    if not unknown:
        return
    name, config_name = unknown[0], config_class.__name__
    if name in fields:
        why = f" ({name} is set by {config_name} itself; leave it out)"
    else:
        close = difflib.get_close_matches(name, settable, n=1, cutoff=0.75)
        why = f" (did you mean {close[0]!r}?)" if close else ""
    others = f" (and {', '.join(map(repr, unknown[1:]))})" if len(unknown) > 1 else ""
    raise UnknownOptionError(f"{config_name} got an unexpected keyword argument {name!r}{why}{others}; the env's "
                             f"options are {', '.join(settable)} and render_mode", field=tuple(unknown))


def config_from_dict(config_class: type[ConfigT], values: dict[str, Any]) -> ConfigT:
    """A config from a dict of its fields, as ``dataclasses.asdict`` (and so a JSON spec) writes
    it: lists stand for tuples, and a field the config sets itself (``init=False``) may appear
    with the value it would get anyway."""
    fields = {f.name: f for f in dataclasses.fields(config_class)}
    settable = sorted(name for name, f in fields.items() if f.init)
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(f"config has unknown field(s) {unknown}; {config_class.__name__}'s fields are {settable}")
    given = {name: _tuples_for_lists(value) for name, value in values.items()}
    config = config_class(**{name: value for name, value in given.items() if fields[name].init})
    for name in sorted(set(given) - set(settable)):
        if given[name] != getattr(config, name):
            raise ConfigError(f"config field {name} is set by {config_class.__name__} itself "
                              f"({getattr(config, name)!r}), got {values[name]!r}; leave it out")
    return config


def _tuples_for_lists(value: Any) -> Any:
    """JSON has no tuples: a config's tuples come back as lists (nested ones too)."""
    if isinstance(value, list):
        return tuple(_tuples_for_lists(item) for item in value)
    return value


def render_context(context, render_mode: str | None) -> str | None:
    """``ansi``: the context as text; ``human``: print it. One line head per message."""
    text = "\n".join(f"[{m.role}] {m.content}" for m in context)
    if render_mode == "ansi":
        return text
    if render_mode == "human":
        # Agent text may hold what the terminal cannot show (a lone surrogate, say): escaped, never an error.
        encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
        print(text.encode(encoding, "backslashreplace").decode(encoding, "replace"))
    return None


def check_bool_options(config, names: tuple[str, ...]) -> None:
    """Each of ``config``'s ``names`` is True or False: ``--env-arg pseudocode=yes`` is a string,
    and "0" or "false" as a string would read as true."""
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be true or false, got {value!r} (on the command line: --env-arg "
                              f"{name}=true)", field=name)


def check_path_options(config, names: tuple[str, ...]) -> None:
    """Each of ``config``'s ``names`` is None or a non-empty path (``--env-arg dataset_path=`` gives
    an empty one, which would read as the current directory or as no file at all); a pathlib path
    is kept as its text (a config is compared, and written to JSON, by its values)."""
    for name in names:
        value = getattr(config, name)
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
            object.__setattr__(config, name, value)  # (in the frozen config's own __post_init__)
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"{name} must be a path to a file (a string or a pathlib path), got {value!r}",
                              field=name)
        if value is not None and not value.strip():
            raise ConfigError(f"{name} is empty; give the path of a file, or leave {name} out", field=name)


def check_generator_only(config, names: tuple[str, ...], dataset: str | None = None,
                         instead: str = "dataset_path to use the generator") -> None:
    """Refuse ``config``'s generator options (``names``) set away from their defaults while a dataset
    is read (they would be ignored without a word). ``dataset`` says which one is read; by default
    ``dataset_path``, when it is set. ``instead``: what else the user may drop or add."""
    if dataset is None:
        if config.dataset_path is None:
            return
        dataset = "dataset_path is given"
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    changed = [n for n in names if getattr(config, n) != defaults[n]]
    if changed:
        raise ConfigError(f"{', '.join(changed)} {'shapes' if len(changed) == 1 else 'shape'} generated tasks only, "
                          f"and {dataset}: drop {' and '.join(changed)}, or {instead}")


def read_action(action: str, limit: int) -> tuple[str, list[str]]:
    """The action as an env reads it, at most ``limit`` characters, and the problem to report when
    it was cut (a tag past the cut is then missing, and the agent must learn why)."""
    if len(action) <= limit:
        return action, []
    return action[:limit], [f"the reply was longer than {limit:,} characters; only the first {limit:,} were read"]


def refuse_unread_option(config, name: str, *, because: str, fix: str) -> None:
    """Refuse ``config``'s option ``name`` set away from its default, when the config's other
    settings leave it unread (call this only then): it would be ignored without a word.
    ``because`` says why it has no effect, ``fix`` what to do instead."""
    default = next(f.default for f in dataclasses.fields(config) if f.name == name)
    value = getattr(config, name)
    if value != default:
        raise ConfigError(f"{name}={value!r} {because}; {fix}", field=name)


class PathsAsText:
    """Mixin: the spec ``gym.make`` records keeps a pathlib option (``dataset_path=Path(...)``) as
    its text, as the config reads it, so that ``env.spec.to_json()`` writes it (gymnasium sets the
    spec after the env is made, through this setter)."""

    _spec = None

    @property
    def spec(self):
        return self._spec

    @spec.setter
    def spec(self, value) -> None:
        kwargs = getattr(value, "kwargs", None)
        if isinstance(kwargs, dict) and any(isinstance(v, os.PathLike) for v in kwargs.values()):
            value = dataclasses.replace(value, kwargs={key: os.fspath(v) if isinstance(v, os.PathLike) else v
                                                       for key, v in kwargs.items()})
        self._spec = value


class ClosableEnv:
    """Mixin: ``close()`` frees what the env holds (its ``_free_resources``), once; later calls do
    nothing. After it, ``reset``, ``step`` and ``render`` (each env calls :meth:`check_open`
    first) raise one error saying so, in every env alike: without it one env would go on working,
    another fail deep inside its closed sandbox or retriever with a message about a resource the
    user never made."""

    closed = False  # set on the instance by close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True  # first: an env whose freeing fails is closed all the same
        self._free_resources()

    def _free_resources(self) -> None:
        """Give back what the env holds (a sandbox share, a retriever share); nothing by default."""

    def check_open(self, method: str) -> None:
        if self.closed:
            raise RuntimeError(f"{method}() after close(): this env was closed; make a new one with "
                               f"{how_to_remake(self)}")


def how_to_remake(env) -> str:
    """How the user made ``env``, to say how to make a new one: ``gym.make('id', ...)`` or its class."""
    spec = getattr(env, "spec", None)
    return f"gym.make({spec.id!r}, ...)" if spec is not None else f"{type(env).__name__}(...)"


def check_step_call(started: bool, done: bool, action) -> None:
    """Misuse of ``step`` (not of the protocol: bad agent text is an observation, never this)."""
    if not started:
        raise RuntimeError("call reset() before step()")
    if done:
        raise RuntimeError("the episode has ended; call reset() to start a new one")
    if not isinstance(action, str):
        raise TypeError(f"an action is the assistant's text (str), got {type(action).__name__}")


@contextmanager
def episode_ends_on_error(env):
    """Around the body of an env's ``step``: a step that raises part way (a retriever timing out,
    a sandbox failing) may have changed some of the episode's state and not the rest, and a step
    from there would play a turn no agent led to. So the episode ends (``env._done``), and step()
    refuses until a reset."""
    try:
        yield
    except BaseException:
        env._done = True
        raise


# The info key of an env that pays on the turn that ends the episode (CodeTCG, VerifiableQA): what
# its own turn budget running out on this step would have paid, beyond this step's reward (0 once
# the episode has ended). A cut the env cannot see (gymnasium's TimeLimit, a rollout's turn cap, a
# full context) would otherwise lose that reward: whoever cuts the episode adds it to its return.
REWARD_IF_CUT = "reward_if_cut"
# Its companion: the info values that ending on this step would report in place of this step's own
# (CodeTCG: the last graded submission's outcome; {} when they would be the same), merged into the
# last turn's info by whoever pays the cut, so that the episode is reported as it is paid.
INFO_IF_CUT = "info_if_cut"


def settle_cut(reward: float, info: dict) -> tuple[float, dict]:
    """The reward and info of a step on which an episode was cut (it ended truncated, not
    terminated), with what the env said such a cut pays and reports added: what a loop that
    bounds episodes with a TimeLimit, a turn cap or a context limit records for that step."""
    return float(reward) + float(info.get(REWARD_IF_CUT, 0.0)), {**info, **info.get(INFO_IF_CUT, {})}


MAX_REPORTED_PROBLEMS = 3


# What an env says of an <answer> written inside <think>…</think> (reasoning, not the reply's answer).
ANSWER_IN_THINK = "an <answer> inside <think> is reasoning, not an answer; it was not graded (give it after </think>)"


def without_elements(text: str, names, *, unclosed: bool = False) -> str:
    """``text`` without its ``<name ...>…</name>`` elements for ``names`` (tags of any case, as
    the tag parser reads them; nested ones too), each replaced by a space. An element goes when
    every tag of ``names`` inside it pairs up; one whose content keeps a stray tag of them stays.
    With ``unclosed``, an element never closed runs to the end and goes as well. One pass over the
    tags: a reply of thousands of nested tags costs no more than its length."""
    alternatives = "|".join(re.escape(name) for name in names)
    tag_start = re.compile(rf"<\s*/?\s*(?:{alternatives})(?=[\s>/])", re.I)
    closing = re.compile(rf"<\s*/\s*({alternatives})\s*>", re.I)
    opening = re.compile(rf"<\s*({alternatives})(?=[\s>/])[^>]*>", re.I)
    # The tags still unpaired, as (lowercased name, or None for one that pairs with nothing;
    # whether it opens; where it starts), and the spans removed so far, outermost last.
    unpaired: list[tuple[str | None, bool, int]] = []
    removed: list[tuple[int, int]] = []
    position = 0
    for start in (match.start() for match in tag_start.finditer(text)):
        if start < position:  # inside the opening tag before it (its attributes)
            continue
        if (tag := closing.match(text, start)) is not None:
            name, opens = tag.group(1).lower(), False
        elif (tag := opening.match(text, start)) is not None:
            name, opens = tag.group(1).lower(), True
        else:  # "<search" never closed by ">": no tag, but an element around it cannot go
            unpaired.append((None, False, start))
            position = start + 1
            continue
        position = tag.end()
        if not opens and unpaired and unpaired[-1][:2] == (name, True):
            element_start = unpaired.pop()[2]
            while removed and removed[-1][0] >= element_start:  # the elements inside it
                removed.pop()
            removed.append((element_start, position))
        else:
            unpaired.append((name, opens, start))
    if unclosed:
        first_open = next((start for name, opens, start in unpaired if opens), None)
        if first_open is not None:
            removed = [span for span in removed if span[0] < first_open] + [(first_open, len(text))]
    pieces, kept_from = [], 0
    for start, end in removed:
        pieces.append(text[kept_from:start])
        pieces.append(" ")
        kept_from = end
    pieces.append(text[kept_from:])
    return "".join(pieces)


# The tool tags (searches, answers, prunes...) one turn has run or refused; the rest of a reply of
# thousands of them is ignored, with a problem saying so, so that no reply holds a step for long
# (each tag's text is read in time proportional to its length).
MAX_TAGS_PER_TURN = 64
TOO_MANY_TAGS = f"the turn has more than {MAX_TAGS_PER_TURN} tags; those after the {MAX_TAGS_PER_TURN}th were ignored"


def without_tool_markup(text: str, tags) -> str:
    """A tag's text (an answer, a query, a note) without tool markup inside it
    (``<answer>X <search>q</search></answer>`` answers X): the env's tags and what they enclose
    are not part of it, a nested ``<answer>`` included; an inner tag never closed runs to the end.
    White space is collapsed."""
    text = without_elements(text, tags, unclosed=True)
    names = "|".join(re.escape(tag) for tag in tags)
    return " ".join(re.sub(rf"<\s*/\s*(?:{names})\s*>", " ", text, flags=re.I).split())


def nothing_done(parsed, calls: tuple[str, ...], what: str) -> str:
    """The problem of a turn that made no call: ``what`` (e.g. "the turn had no <search> or
    <answer>, so nothing was done"), and, when a call's tag is inside a fenced code block (where
    tags are text: :mod:`rftgym.core.tags`), that this is why."""
    pattern = re.compile(rf"<\s*(?:{'|'.join(re.escape(c) for c in calls)})\b", re.I)
    fenced = next((m.group(0).lstrip("< ").lower() for b in parsed.code_blocks if (m := pattern.search(b.code))), None)
    if fenced is None:
        return what
    return f"{what} (the <{fenced}> inside a ``` code block is text, not a call; write it outside the block)"


def summarize_problems(problems) -> str | None:
    """The distinct problems, at most a few, or None if there are none: a reply with thousands of
    stray tags must not become a feedback message thousands of lines long."""
    distinct = list(dict.fromkeys(problems))
    if not distinct:
        return None
    text = "; ".join(distinct[:MAX_REPORTED_PROBLEMS])
    if len(distinct) > MAX_REPORTED_PROBLEMS:
        text += f"; and {len(distinct) - MAX_REPORTED_PROBLEMS} more"
    return text


def chat_spaces(*, max_messages: int, longest_message: int, max_action_chars: int):
    """``(observation_space, action_space)`` of a chat env. Every observation must lie in the
    space, so the limits follow what the config allows (``max_messages`` messages, none longer
    than ``longest_message`` or an action); the floors keep ordinary contexts well inside."""
    observation = ContextSpace(max_messages=max(512, max_messages),
                               max_message_chars=max(200_000, max_action_chars, longest_message),
                               roles=("system", "user", "assistant"))
    return observation, AssistantText(max_chars=max_action_chars)


def reset_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """A copy of ``reset``'s ``options`` (None: none). Anything but a dict is the caller's mistake,
    said as such: ``dict()`` of it would fail with a message about sequences, or read a list of
    pairs as options."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise TypeError(f"options must be a dict of reset options or None, got {type(options).__name__} "
                        f"{options!r:.80}; e.g. reset(seed=0, options={{}})")
    return dict(options)


def check_reset_options(options: dict[str, Any], *, from_dataset: bool, dataset_options: tuple[str, ...] = ("task_index",),
                        generator_options: tuple[str, ...] = ()) -> None:
    """Refuse reset options the env would not read: an unknown name (a typo would otherwise be
    ignored without a word) or one that does not apply to where its tasks come from (e.g. a
    generator's ``difficulty`` while the env serves a dataset). An option set to None counts as
    absent (the env draws it). The caller's mistake: ValueError."""
    options = {name: value for name, value in options.items() if value is not None}
    known = set(dataset_options) | set(generator_options)
    usable = set(dataset_options) if from_dataset else set(generator_options)
    unknown = sorted(set(options) - known)
    if unknown:  # named with what this env reads as it is set up, not what another setting would
        raise ValueError(f"unknown reset option(s) {unknown}; this env reads {sorted(usable) or 'no options'}")
    misplaced = sorted(set(options) - usable)
    if misplaced:
        source = "serves a dataset" if from_dataset else "generates its tasks"
        raise ValueError(f"reset option(s) {misplaced} do not apply here: this env {source}, so it reads "
                         f"{sorted(usable) or 'no options'}")


TASK_SELECTIONS = ("seed", "random")


def check_task_selection(config, generated: bool, fix: str = "give dataset_path") -> None:
    """``task_selection`` is one of :data:`TASK_SELECTIONS`, and given only where a dataset is read
    (``generated``: the tasks are made from each reset's seed, and it would be ignored)."""
    if config.task_selection not in TASK_SELECTIONS:
        raise ConfigError(f"task_selection must be 'seed' (reset(seed=i) gives dataset item i mod its size) or "
                          f"'random' (a draw from the env's RNG), got {config.task_selection!r}")
    if generated:
        refuse_unread_option(config, "task_selection", because="picks a dataset item at each reset, and this env "
                             "generates its tasks from the reset's seed", fix=f"drop task_selection, or {fix}")


def covering_episodes(dataset, selection: str) -> int | None:
    """An env's ``eval_episodes``: with a dataset served by seed, its size (seeds 0 to size - 1
    cover it once: ``rftgym eval``'s default episodes); None otherwise (the CLI's default)."""
    return len(dataset) if dataset is not None and selection == "seed" else None


def dataset_index(options: dict[str, Any], size: int, np_random, seed: int | None = None,
                  selection: str = "random") -> int:
    """The dataset item for this episode: ``options["task_index"]``; else, with ``selection``
    "seed" and a seed, ``seed % size`` (seeds 0 to size - 1 cover the dataset once: what
    ``rftgym eval`` runs by default, through the env's ``eval_episodes``); else a draw from the
    env's RNG. A bad index is the caller's mistake (ValueError), not the agent's."""
    by_seed = seed % size if seed is not None and selection == "seed" else None
    index = options.get("task_index", by_seed)
    if index is None:
        index = int(np_random.integers(size))
    if not is_int(index) or not 0 <= index < size:
        raise ValueError(f"task_index must be an int in [0, {size}), got {index!r}")
    return int(index)


def env_entry_point(env_id: str):
    """A registered env's entry point (its class, or a factory), loaded without making an env.
    ``module:EnvId`` imports ``module`` first, as ``gymnasium.make`` does."""
    import gymnasium

    module, _, bare = env_id.rpartition(":")
    if module:
        importlib.import_module(module)
    entry = gymnasium.spec(bare).entry_point
    if isinstance(entry, str):
        module_name, _, name = entry.partition(":")
        entry = getattr(importlib.import_module(module_name), name)
    return entry


def short_env_name(env_id: str) -> str:
    """``VerifiableQA-v0`` for ``rftgym/VerifiableQA-v0`` (and for ``module:ns/VerifiableQA-v0``)."""
    return env_id.rpartition(":")[2].split("/")[-1]


def same_env_id(first: str, second: str) -> bool:
    """Whether two env ids name one registered env: ``module:ns/Name-v0`` imports ``module`` and
    makes ``ns/Name-v0``, the id the env's spec (and a run started from Python) records."""
    return first.rpartition(":")[2] == second.rpartition(":")[2]


def env_metadata(env_id: str) -> dict:
    """The ``metadata`` of a registered env's class, read without making an env (``{}`` for an
    entry point that has none, such as a factory function)."""
    metadata = getattr(env_entry_point(env_id), "metadata", None)
    return metadata if isinstance(metadata, dict) else {}


def with_training_defaults(metadata: dict, env_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``env_kwargs`` with the options an env asks training to set unless the caller gave them
    (``metadata["training_options"]``; e.g. CodeTCG's ``require_isolation``: a policy under
    training is rewarded for whatever a weaker sandbox lets its programs reach)."""
    return {**(metadata.get("training_options") or {}), **env_kwargs}


def with_policy_token_counter(metadata: dict, env_kwargs: dict[str, Any], policy) -> dict[str, Any]:
    """``env_kwargs`` with the policy's own token count for an env whose budget takes a counter.

    An env with a token budget names its counter option in ``metadata["token_counter_option"]``;
    with a local policy (anything with ``chat.prompt_ids``), the budget is measured with the
    policy's own tokenizer and chat template, in evaluation and training alike, so that a budget a
    policy learned to keep is the budget it is judged by. A counter the caller set is kept; without
    a policy the env uses its documented estimate."""
    from .memory.budget import policy_token_counter

    option = metadata.get("token_counter_option")
    if option is None or option in env_kwargs or not hasattr(getattr(policy, "chat", None), "prompt_ids"):
        return env_kwargs
    return {**env_kwargs, option: policy_token_counter(policy)}


def with_policy_options(metadata: dict, env_kwargs: dict[str, Any], policy) -> dict[str, Any]:
    """``env_kwargs`` with every option that stands for the policy acting in the env bound to
    ``policy``: what ``rftgym eval`` and ``rftgym train`` make their envs with.

    Those are its token counter (:func:`with_policy_token_counter`) and each option named in
    ``metadata["policy_options"]`` (option -> ``bind(value, policy)``) that was given as a string,
    as a command line or a JSON config (``TrainConfig.env_kwargs``) gives it: CodeTCG's
    ``step_scorer="rollout"`` becomes a RolloutStepScorer over ``policy``. A value that is not a
    string (an object of the caller's) is kept; an env that declares no such option is untouched."""
    env_kwargs = with_policy_token_counter(metadata, env_kwargs, policy)
    for option, bind in (metadata.get("policy_options") or {}).items():
        if isinstance(env_kwargs.get(option), str):
            env_kwargs = {**env_kwargs, option: bind(env_kwargs[option], policy)}
    return env_kwargs


class PolicyToBeLoaded:
    """The agent of an env made only to check its options before the policy is loaded (see
    :func:`with_policy_stand_in`). It never acts: such an env is closed unused."""

    name = "policy-to-be-loaded"

    def act(self, contexts):
        raise RuntimeError("this env was made to check its options before the policy was loaded, and its "
                           "policy-bound options (e.g. CodeTCG's step_scorer='rollout') have no policy to act; make "
                           "the env to run with with_policy_options(metadata, env_kwargs, agent)")


def with_policy_stand_in(metadata: dict, env_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``env_kwargs`` for an env made to check them before the policy is loaded (``rftgym eval``
    and ``rftgym train`` fail fast on a bad option, before a model loads): the policy-bound options
    are bound as :func:`with_policy_options` will bind them, to a stand-in that never acts, so that
    the env checks them (and what they require, such as CodeTCG's ``pseudocode=True``) as it will
    then."""
    return with_policy_options(metadata, env_kwargs, PolicyToBeLoaded())
