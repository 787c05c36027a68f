"""The agent ``--agent`` names: a built-in one made from its flags, or an agent of your own
(``module:name``); and the flags refused because they would not reach the run's agent."""

from __future__ import annotations

import argparse
import inspect
import re
import shlex
import sys
import urllib.parse
from typing import Any

from ..core.errors import AgentError, ConfigError
from ..core.values import a_type
from .common import UsageError, _check_model_dir, _flagged, _json_object
from .user_code import _load_object, load_failure


AGENTS = ("default", "hf", "api", "random", "adversarial")


def _agent_choice(value: str) -> str:
    """``--agent``'s value: a built-in agent, or module:name (loaded when the agent is made)."""
    if value in AGENTS or (":" in value and all(value.partition(":")[::2])):
        return value
    raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from {', '.join(AGENTS)}, or module:name for "
                                     "an agent of your own)")


def _agent_label(agent: str) -> str:
    """``--agent`` as a part of a file name (``my_agents:Best`` -> ``my_agents-Best``)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", agent)


# eval's sampling flags: the parameter of an agent of your own each one is passed as, and its default.
SAMPLING_FLAGS = {"--max-new-tokens": ("max_new_tokens", 256), "--temperature": ("temperature", 0.0),
                  "--top-p": ("top_p", 1.0), "--sample-seed": ("seed", 0), "--stop": ("stop", None)}


class _NoteGiven(argparse.Action):
    """Stores a flag's value and notes that the flag was given, whatever its value: an agent of your
    own gets the sampling flags given (``--temperature 0`` too), and keeps its own defaults else."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.flags_given = (*getattr(namespace, "flags_given", ()), self.dest)


class _NoteGivenRepeated(_NoteGiven):
    """As :class:`_NoteGiven`, for a flag given once per value: its values are gathered in a list."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, [*(getattr(namespace, self.dest) or ()), values], option_string)


def _sampling_flags_given(args: argparse.Namespace) -> dict[str, tuple[str, Any]]:
    """The sampling flags given on the command line: flag -> (parameter, value)."""
    given = set(getattr(args, "flags_given", ()))
    dests = {flag: flag[2:].replace("-", "_") for flag in SAMPLING_FLAGS}
    return {flag: (parameter, getattr(args, dests[flag]))
            for flag, (parameter, _) in SAMPLING_FLAGS.items() if dests[flag] in given}


def _takes(factory, parameter: str) -> bool:
    """Whether calling ``factory`` accepts ``parameter=`` (by name, or through ``**kwargs``)."""
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): pass nothing
        return False
    return any(p.kind is p.VAR_KEYWORD or (p.name == parameter and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))
               for p in parameters)


def _required_parameters(factory, given: dict[str, Any]) -> list[str]:
    """The parameters ``factory`` needs that ``given`` lacks (none where it has no signature to read)."""
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in parameters if p.default is p.empty and p.name not in given
            and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _agent_of_your_own(path: str, sampling: dict[str, tuple[str, Any]]):
    """The agent ``--agent module:name`` names: ``name`` in ``module`` (imported as an env module
    is, the current directory on the path) is an Agent or a callable that returns one (a class, a
    factory), called with the ``sampling`` flags given, each as the keyword parameter it names
    (``--temperature 0.7`` as ``temperature=0.7``). A flag it cannot take is refused rather than
    ignored: the run would not sample as asked."""
    from ..agents.base import Agent

    module, _, name = path.partition(":")  # both there: _agent_choice checked the flag
    try:
        found = _load_object(path)
    except Exception as exc:  # noqa: BLE001 (the user's module may raise anything while importing)
        raise UsageError(f"--agent {path!r}: cannot load {name!r} from {module!r}: {load_failure(module, exc)}") \
            from None
    if not isinstance(found, Agent) and not callable(found):
        raise UsageError(f"--agent {path!r} is {a_type(found)}; name an Agent, or a class or function "
                         "that makes one")
    made = isinstance(found, Agent)
    refused = [flag for flag, (parameter, _) in sampling.items() if made or not _takes(found, parameter)]
    if refused:
        what = "is an Agent already made" if made else \
            f"takes no {' or '.join(repr(sampling[flag][0]) for flag in refused)} parameter"
        raise UsageError(f"{' and '.join(refused)} cannot reach --agent {path!r}: it {what}, and the run would not "
                         f"sample as asked; drop {' and '.join(refused)}, or name a class or function that takes "
                         f"{' and '.join(sampling[flag][0] + '=' for flag in refused)}")
    if not made:
        given = {parameter: value for parameter, value in sampling.values()}
        needed = _required_parameters(found, given)
        if needed:  # said now: calling it would fail with a TypeError that names no flag
            flags = {parameter: flag for flag, (parameter, _) in SAMPLING_FLAGS.items()}
            fixes = [f"give {flags[n]}" for n in needed if n in flags]
            fixes.append("give the parameter a default" if len(needed) == 1 else "give the parameters defaults")
            raise UsageError(f"--agent {path!r} needs {' and '.join(map(repr, needed))}, which the command line does "
                             f"not give; {', or '.join(fixes)}")
        try:
            found = found(**given)
        except Exception as exc:  # noqa: BLE001 (the user's factory)
            raise AgentError(f"--agent {path!r}: making the agent raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(found, Agent):
        raise UsageError(f"--agent {path!r} made {a_type(found)}, not an rftgym Agent; subclass "
                         "rftgym.agents.base.Agent (act(contexts) -> list of AgentReply)")
    if found.name == Agent.name:  # it named itself nothing: the table and its errors call it as the user did
        found.name = path
    return found


# The agent configs' fields and the flags that set them, so that a refused value names the flag.
AGENT_FLAGS = {
    "api": {"timeout_s": "--api-timeout", "base_url": "--api-base", "model": "--api-model",
            "max_tokens": "--max-new-tokens", "temperature": "--temperature", "top_p": "--top-p",
            "max_concurrency": "--num-envs", "max_retries": "--api-max-retries", "backoff_s": "--api-backoff",
            "seed": "--sample-seed", "extra_body": "--api-extra", "stop": "--stop"},
    "hf": {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_p": "--top-p",
           "max_batch_size": "--num-envs", "seed": "--sample-seed", "prefix_cache_mb": "--prefix-cache-mb",
           "stop": "--stop"},
}


def _build_agent(args: argparse.Namespace):
    try:
        return _make_agent(args)
    except ConfigError as exc:
        # Only the built-in agents' fields are set by flags (an agent of your own sets its own).
        flags = AGENT_FLAGS["api"] if args.agent == "api" else AGENT_FLAGS["hf"] if args.agent in ("default", "hf") \
            else {}
        flagged = _flagged(exc, flags)
        if flagged is None:
            raise
        raise flagged from None


AGENT_OWN_FLAGS = {"hf": (("model", "--model"),),
                   "api": (("api_base", "--api-base"), ("api_model", "--api-model"), ("api_timeout", "--api-timeout"),
                           ("api_max_retries", "--api-max-retries"), ("api_backoff", "--api-backoff"),
                           ("api_extra", "--api-extra"))}


def _check_agent_flags(args: argparse.Namespace) -> None:
    """Without ``--agent``, one agent's own flags name it (``--model DIR``: hf; ``--api-base``:
    api). A flag of another agent than the one given is refused: it would be ignored, and the run
    would evaluate another model than the one named."""
    if "agent" not in getattr(args, "flags_given", ()):
        named = [agent for agent, flags in AGENT_OWN_FLAGS.items()
                 if any(getattr(args, name, None) is not None for name, _ in flags)]
        if len(named) == 1:
            args.agent = named[0]
    for agent, flags in AGENT_OWN_FLAGS.items():
        given = [flag for name, flag in flags if getattr(args, name, None) is not None]
        if given and args.agent != agent:
            raise UsageError(f"{' and '.join(given)} {'is' if len(given) == 1 else 'are'} for --agent {agent}, and "
                             f"this run's agent is {args.agent}; add --agent {agent}, or drop {' and '.join(given)}")
    if args.agent in ("random", "adversarial"):
        unread = [flag for flag in _sampling_flags_given(args) if flag != "--sample-seed"]
        if unread:  # they draw text, not tokens from a model: the flags would be ignored
            raise UsageError(f"{' and '.join(unread)} {'is' if len(unread) == 1 else 'are'} not read by --agent "
                             f"{args.agent}, which draws its text without a model (only --sample-seed applies); "
                             f"drop {' and '.join(unread)}")
    # The api agent samples at the temperature the server sees: --api-extra's, where it sets one.
    extra = _json_object(args.api_extra, "--api-extra") if args.agent == "api" else None
    if args.agent in ("default", "hf", "api") and (extra or {}).get("temperature", args.temperature) == 0:
        unread = [flag for flag in _sampling_flags_given(args) if flag in ("--top-p", "--sample-seed")]
        if unread:  # greedy decoding takes the likeliest token: no nucleus, no draw to seed
            raise UsageError(f"{' and '.join(unread)} {'applies' if len(unread) == 1 else 'apply'} only to sampling, "
                             f"and --agent {args.agent} decodes greedily at --temperature 0 (the default); give "
                             f"--temperature above 0, or drop {' and '.join(unread)}")


def _trained_run_state(model: str | None) -> dict | None:
    """The checkpoint state (step, config) that ``--model`` loads when it names a training run's
    directory (or one of its ``checkpoint-<step>`` folders); None for a model directory."""
    from pathlib import Path

    from ..train.run_dir import is_run_dir, saved_state

    if model is None or not is_run_dir(model):
        return None
    try:
        state = saved_state(Path(model).expanduser(), "evaluate")
        return {"step": int(state["step"]), "config": state.get("config") or {}}
    except (ConfigError, KeyError, TypeError, ValueError):  # (the model's load says what is wrong)
        return None


def _say_which_run(args: argparse.Namespace) -> None:
    """Name the step a training run's directory is evaluated at (it changes as the run goes on;
    noted as ``args.model_step``, read once, before the model loads, for the evaluation's settings),
    and the run's settings this evaluation differs from unasked: another env, or another reply
    length (eval's default is not train's), so that base and trained numbers compare like for like."""
    state = _trained_run_state(args.model)
    args.model_step = None if state is None else state["step"]
    if state is None:
        return
    step, config = state["step"], state["config"]
    trained_on = config.get("env_id")
    print(f"--model: the run in {args.model} at step {step} (trained on {trained_on})", file=sys.stderr)
    if trained_on and trained_on not in args.env:
        print(f"note: the run trained on {trained_on}; this evaluation is of {', '.join(args.env)}", file=sys.stderr)
    elif isinstance(config.get("env_kwargs"), dict) and config["env_kwargs"]:
        from .environments import _parse_env_args, env_arg_pair

        given = _parse_env_args(getattr(args, "env_arg", None) or [])
        other = {key: value for key, value in config["env_kwargs"].items() if given.get(key) != value}
        if other:  # e.g. trained on generated tasks, evaluated on the env's default dataset
            pairs = " ".join(f"--env-arg {env_arg_pair(key, value)}" for key, value in other.items())
            print(f"note: the run trained with env options this evaluation does not give ({', '.join(other)}); add "
                  f"{pairs} to evaluate it on what it trained on", file=sys.stderr)
    trained_tokens = config.get("max_new_tokens")
    if "max_new_tokens" not in getattr(args, "flags_given", ()) and trained_tokens not in (None, args.max_new_tokens):
        print(f"note: the run trained with --max-new-tokens {trained_tokens}, and this evaluation gives each reply "
              f"{args.max_new_tokens} (eval's default); add --max-new-tokens {trained_tokens} to evaluate it as it "
              "trained", file=sys.stderr)
    trained_stops = config.get("stop") or []
    if "stop" not in getattr(args, "flags_given", ()) and trained_stops:
        flags = " ".join(f"--stop {shlex.quote(stop)}" for stop in trained_stops)
        print(f"note: the run trained with replies ending at {', '.join(map(repr, trained_stops))}, and this "
              f"evaluation's do not; add {flags} to evaluate it as it trained", file=sys.stderr)


def _make_agent(args: argparse.Namespace):
    if args.agent in ("default", "hf"):
        if args.agent == "hf" and not args.model:
            raise UsageError("--agent hf needs --model PATH (a local Hugging Face model directory)")
        if args.agent == "hf":
            _check_model_dir(args.model)
            _say_which_run(args)
        from ..agents.hf_policy import HFPolicy, SamplingConfig

        sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                  top_p=args.top_p, seed=args.sample_seed, max_batch_size=args.num_envs,
                                  stop=args.stop)
        reuse = {} if args.prefix_cache_mb is None else {"prefix_cache_mb": args.prefix_cache_mb}
        policy = HFPolicy.from_pretrained(args.model if args.agent == "hf" else None, sampling=sampling,
                                          device=args.device, **reuse)
        policy.prompt_limit()  # --max-new-tokens past the model's context: refused now, as the flag
        if args.prefix_cache_mb and policy.prefix_cache_unused:
            print(f"note: --prefix-cache-mb changes nothing here: {policy.prefix_cache_unused}", file=sys.stderr)
        return policy
    if args.agent == "api":
        if not args.api_base or not args.api_model:
            raise UsageError("--agent api needs --api-base URL (e.g. http://127.0.0.1:8000/v1) and --api-model NAME")
        try:  # a bracket left open is a ValueError of urllib's, not a refusal of the config's
            urllib.parse.urlsplit(args.api_base)
        except ValueError as exc:
            raise UsageError(f"--api-base {args.api_base!r} is not a valid URL ({exc}); give the server's base URL, "
                             "e.g. http://127.0.0.1:8000/v1 (an IPv6 address in brackets: http://[::1]:8000/v1)") \
                from None
        from ..agents.chat_api import ChatAPIAgent

        # A transport flag left out keeps ChatAPIConfig's default.
        transport = {name: value for name, value in (("timeout_s", args.api_timeout),
                                                     ("max_retries", args.api_max_retries),
                                                     ("backoff_s", args.api_backoff),
                                                     ("extra_body", _json_object(args.api_extra, "--api-extra")))
                     if value is not None}
        return ChatAPIAgent.from_url(args.api_base, args.api_model, temperature=args.temperature,
                                     top_p=args.top_p, max_tokens=args.max_new_tokens,
                                     max_concurrency=args.num_envs, seed=args.sample_seed, stop=args.stop,
                                     **transport)
    from ..agents.scripted import AdversarialAgent, RandomTextAgent

    if args.agent in ("random", "adversarial"):
        seed = args.sample_seed
        return RandomTextAgent(seed=seed) if args.agent == "random" else AdversarialAgent(seed=seed)
    return _agent_of_your_own(args.agent, _sampling_flags_given(args))
