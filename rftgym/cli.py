"""The ``rftgym`` command: list environments, play one by hand, evaluate an agent."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import importlib.util
import inspect
import json
import os
import re
import signal
import sys
import time
import traceback
import types
import urllib.parse
import warnings
from pathlib import Path
from typing import Any, Collection, Sequence

import gymnasium as gym

from . import envs as env_registry
from .core.errors import AgentError, ConfigError, DataFormatError, EnvError, ModelLoadError, RftgymError
from .envs.common import env_entry_point, with_policy_token_counter

AGENTS = ("default", "hf", "api", "random", "adversarial")


class UsageError(Exception):
    """A bad command-line argument; printed as 'error: …' with exit status 2."""


# ---------------------------------------------------------------- helpers

# gymnasium.make's own parameters that no env can be given as an option (make(id, **options)
# takes the first for itself). Its max_episode_steps and disable_env_checker are options it applies.
GYM_MAKE_OWN = ("id",)


def _parse_env_args(pairs: Sequence[str]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise UsageError(f"--env-arg takes KEY=VALUE (e.g. --env-arg max_attempts=2), got {pair!r}")
        key, raw = pair.split("=", 1)
        if not key.strip():
            raise UsageError(f"--env-arg {pair!r} has no KEY before '='; give KEY=VALUE (e.g. --env-arg max_attempts=2)")
        if key.strip() in GYM_MAKE_OWN:
            raise UsageError(f"--env-arg {key.strip()}: {key.strip()!r} is gymnasium.make's own parameter (the "
                             "environment's id, which the ENV argument gives), so no environment can take an option "
                             "of that name; drop it (an env of your own needs another name for such an option)")
        if key.strip() in kwargs:  # the last one would win without a word
            raise UsageError(f"--env-arg {key.strip()} is given twice; give each option once")
        try:
            kwargs[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            kwargs[key.strip()] = raw  # a bare string such as a path
    return kwargs


DEFAULT_EVAL_EPISODES = 32
MAX_EVAL_EPISODES = 1_000_000
EVAL_COLUMNS = ["env", "agent", "episodes", "reward", "success", "turns", "format_err", "sampled_tok", "prompt_tok",
                "ep/s"]


def _cell(value) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _env_spec(env_id: str):
    """The Gymnasium spec of ``env_id``: one of rftgym's, another registered env, or ``module:EnvId``
    (Gymnasium's form: the module is imported first, and registers the env)."""
    module, _, bare = env_id.rpartition(":")
    if module:
        try:
            _import_users_module(module)
        except Exception as exc:  # noqa: BLE001 (the user's module may raise anything while importing)
            raise UsageError(f"environment {env_id!r}: cannot import {module!r} ({type(exc).__name__}: {exc}); give "
                             "module:EnvId with a module on the Python path that registers EnvId with "
                             "gymnasium.register") from None
    if bare not in gym.registry:
        # An id that only the user's module registers is found only through it: the hint keeps the module.
        close = [known if known in env_registry.ENVS or not module else f"{module}:{known}"
                 for known in _close_env_ids(bare)]
        guess = f" (did you mean {' or '.join(filter(None, [', '.join(close[:-1]), close[-1]]))}?)" if close else ""
        raise UsageError(f"unknown environment {env_id!r}{guess}; registered environments: "
                         f"{', '.join(env_registry.env_ids())} (your own: module:EnvId, where importing module "
                         "registers EnvId with gymnasium.register)")
    spec = gym.spec(bare)
    if isinstance(spec.entry_point, str):
        try:
            _load_object(spec.entry_point)
        except Exception as exc:  # noqa: BLE001 (importing the entry point's module runs the user's code)
            raise UsageError(f"environment {env_id!r}: its entry point {spec.entry_point!r} cannot be loaded "
                             f"({type(exc).__name__}: {exc}); register it as 'module:Class' with an importable "
                             "module") from None
    return spec


def _close_env_ids(env_id: str) -> list[str]:
    """Registered ids that ``env_id`` is probably a slip of: another case, a version or a letter
    off, or the name without its namespace (``VerifiableQA-v0``)."""
    def forms(name: str) -> set[str]:
        name = name.lower()
        bare = name.rpartition("/")[2]
        return {name, bare, re.sub(r"-v\d+$", "", bare)}

    wanted = forms(env_id)
    scored = []
    for known in gym.registry:
        score = max(difflib.SequenceMatcher(None, a, b).ratio() for a in wanted for b in forms(known))
        if score >= 0.8:
            scored.append((-score, known not in env_registry.ENVS, known))
    return [known for _, _, known in sorted(scored)[:3]]


def _json_object(text: str | None, flag: str) -> dict | None:
    """A flag's JSON object (None when the flag is not given)."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"{flag}: not valid JSON ({exc}); give an object, e.g. {flag} '{{\"top_k\": 20}}'") from None
    if not isinstance(value, dict):
        raise UsageError(f"{flag}: give a JSON object, e.g. {flag} '{{\"top_k\": 20}}', not {type(value).__name__}")
    return value


def _seed_or_none(value: str) -> int | None:
    if value.strip().lower() == "none":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value: {value!r} (an integer, or none)") from None


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
                  "--top-p": ("top_p", 1.0), "--sample-seed": ("seed", 0)}


class _NoteGiven(argparse.Action):
    """Stores a flag's value and notes that the flag was given, whatever its value: an agent of your
    own gets the sampling flags given (``--temperature 0`` too), and keeps its own defaults else."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.flags_given = (*getattr(namespace, "flags_given", ()), self.dest)


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


def _agent_of_your_own(path: str, sampling: dict[str, tuple[str, Any]]):
    """The agent ``--agent module:name`` names: ``name`` in ``module`` (imported as an env module
    is, the current directory on the path) is an Agent or a callable that returns one (a class, a
    factory), called with the ``sampling`` flags given, each as the keyword parameter it names
    (``--temperature 0.7`` as ``temperature=0.7``). A flag it cannot take is refused rather than
    ignored: the run would not sample as asked."""
    from .agents.base import Agent

    module, _, name = path.partition(":")  # both there: _agent_choice checked the flag
    try:
        found = _load_object(path)
    except Exception as exc:  # noqa: BLE001 (the user's module may raise anything while importing)
        raise UsageError(f"--agent {path!r}: cannot load {name!r} from {module!r} ({type(exc).__name__}: {exc}); "
                         "give module:name with a module on the Python path") from None
    if not isinstance(found, Agent) and not callable(found):
        raise UsageError(f"--agent {path!r} is a {type(found).__name__}; name an Agent, or a class or function "
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
        try:
            found = found(**{parameter: value for parameter, value in sampling.values()})
        except Exception as exc:  # noqa: BLE001 (the user's factory)
            raise AgentError(f"--agent {path!r}: making the agent raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(found, Agent):
        raise UsageError(f"--agent {path!r} made a {type(found).__name__}, not an rftgym Agent; subclass "
                         "rftgym.agents.base.Agent (act(contexts) -> list of AgentReply)")
    if found.name == Agent.name:  # it named itself nothing: the table and its errors call it as the user did
        found.name = path
    return found


def _short_name(env_id: str) -> str:
    """``VerifiableQA-v0`` for ``rftgym/VerifiableQA-v0`` (and for ``module:ns/VerifiableQA-v0``)."""
    return env_id.rpartition(":")[2].split("/")[-1]


def _make_env(env_id: str, kwargs: dict[str, Any]) -> gym.Env:
    _env_spec(env_id)
    # gymnasium's own make() options, checked here: its errors are not about the env.
    steps = kwargs.get("max_episode_steps")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise UsageError(f"--env-arg max_episode_steps must be a positive int (gymnasium's step limit), got {steps!r}")
    try:
        return gym.make(env_id, **kwargs)
    except TypeError as exc:
        unknown = re.search(r"unexpected keyword argument '([^']+)'", str(exc))
        if unknown is None:  # a type error inside the env (e.g. from a data file), not an unknown option
            raise UsageError(f"{env_id} could not be made: {str(exc).split(' was raised from')[0]}. Check the "
                             "--env-arg values and the data files they name") from exc
        names = _env_option_names(env_id)
        # render_mode reaches the env's constructor (gymnasium checks it against the env's modes).
        modes = _env_class(env_id).metadata.get("render_modes") or []
        if modes and "render_mode" not in names:
            names = [*names, f"render_mode ({' or '.join(map(str, modes))})"]
        candidates = [name.split(" ")[0] for name in names] + ["max_episode_steps"]
        close = difflib.get_close_matches(unknown.group(1), candidates, n=1, cutoff=0.75)
        guess = f" (did you mean {close[0]!r}?)" if close else ""
        valid = f"Valid options: {', '.join(names)}" if names else "It takes no options of its own"
        raise UsageError(f"bad --env-arg for {env_id}: unknown option {unknown.group(1)!r}{guess}. "
                         f"{valid} (and gymnasium's max_episode_steps)") from exc


def _env_option_names(env_id: str) -> list[str]:
    """The options an env takes: its config dataclass's fields, else its constructor's keywords."""
    module = sys.modules.get(getattr(_env_class(env_id), "__module__", ""), None)
    configs = [v for v in vars(module).values() if dataclasses.is_dataclass(v) and v.__name__.endswith("Config")
               and v.__module__ == module.__name__] if module is not None else []
    if configs:
        names = [f.name for f in dataclasses.fields(configs[0]) if f.init]
    else:  # an env without a config dataclass: its constructor's keyword parameters
        try:
            parameters = inspect.signature(_env_class(env_id)).parameters.values()
        except (TypeError, ValueError):
            parameters = []
        names = [p.name for p in parameters if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return names


def _cwd_on_path() -> None:
    """Put the current directory on the import path: the installed command's path lacks it, and a
    user's env or agent module usually lives there (appended last, so a module here never shadows
    an installed one)."""
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())


def _import_users_module(module: str):
    """``module`` imported, found as :func:`_cwd_on_path` says."""
    _cwd_on_path()
    return importlib.import_module(module)


def _users_sources(env_ids: Sequence[str], agent: str, baselines: bool) -> dict[str, tuple[str, str]]:
    """The Python source files of the modules this evaluation imports to run what it was given:
    an env's ``module:EnvId`` module and its entry point's, ``--agent module:name``'s, and with
    ``--baselines`` the baselines' wrappers' (each with the packages above it). Real path ->
    (module, what named it), so that ``--out`` is never one of them."""
    named: dict[str, str] = {}
    for env_id in env_ids:
        module = env_id.rpartition(":")[0]
        if module:
            named.setdefault(module, f"the environment {env_id}")
        entry = _env_spec(env_id).entry_point
        named.setdefault(entry.partition(":")[0] if isinstance(entry, str) else getattr(entry, "__module__", ""),
                         f"the environment {env_id}")
        for _, _, wrapper in _env_class(env_id).metadata.get("eval_baselines", ()) if baselines else ():
            if wrapper:
                named.setdefault(wrapper.partition(":")[0], f"the baselines of {env_id}")
    if ":" in agent:
        named.setdefault(agent.partition(":")[0], f"--agent {agent}")
    sources: dict[str, tuple[str, str]] = {}
    for module, what in named.items():
        parts = module.split(".") if module else []
        for depth in range(len(parts), 0, -1):  # the module, then the packages it is in
            source = _module_source(".".join(parts[:depth]))
            if source is not None:
                sources.setdefault(os.path.realpath(source), (".".join(parts[:depth]), what))
    return sources


def _module_source(module: str) -> str | None:
    """Where ``module``'s code is, found as an import would find it (the agent's module is not
    imported yet), or None (a module that cannot be found is refused where it is loaded)."""
    if module in sys.modules:
        return getattr(sys.modules[module], "__file__", None)
    _cwd_on_path()  # as _import_users_module finds it
    try:
        spec = importlib.util.find_spec(module)
    except Exception:  # noqa: BLE001 (a parent package's own import may raise anything)
        return None
    return spec.origin if spec is not None and spec.has_location else None


def _load_object(path: str):
    """The object ``module:name`` names (an env's entry point, an agent, a baseline's wrapper)."""
    module_name, _, name = path.partition(":")
    if not module_name or not name:
        raise ValueError(f"{path!r} is not of the form 'module:name'")
    return getattr(_import_users_module(module_name), name)


def _env_class(env_id: str):
    """The env's class, for its metadata (eval columns and baselines), without making an env; an
    entry point without metadata (e.g. a factory function) reads as empty metadata."""
    _env_spec(env_id)  # what cannot be found or imported, named as a usage error
    found = env_entry_point(env_id)
    return found if isinstance(getattr(found, "metadata", None), dict) else types.SimpleNamespace(metadata={})


# The agent configs' fields and the flags that set them, so that a refused value names the flag.
AGENT_FLAGS = {
    "api": {"timeout_s": "--api-timeout", "base_url": "--api-base", "model": "--api-model",
            "max_tokens": "--max-new-tokens", "temperature": "--temperature", "top_p": "--top-p",
            "max_concurrency": "--num-envs", "max_retries": "--api-max-retries", "backoff_s": "--api-backoff",
            "seed": "--sample-seed", "extra_body": "--api-extra"},
    "hf": {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_p": "--top-p",
           "max_batch_size": "--num-envs", "seed": "--sample-seed"},
}


def _flagged(exc: ConfigError, flags: dict[str, str]) -> UsageError | None:
    """``exc`` as a usage error that starts with the flag(s) behind its config field(s), or None
    when it names no field that a flag sets."""
    named = [flags[field] for field in exc.fields if field in flags]
    return UsageError(f"{' / '.join(dict.fromkeys(named))}: {exc}") if named else None


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


def _check_model_dir(model: str | None, flag: str = "--model") -> None:
    """A --model (or ``flag``) that is not a local model directory, or a training run's directory
    whose checkpoint is damaged, is a usage error, found before any other work (the default model
    is checked where it loads: finding it may convert its weights)."""
    from .agents.model_loading import check_trained_run, names_default_model, resolve_model_dir
    from .train.export import is_run_dir

    if names_default_model(model):
        return
    try:
        path = resolve_model_dir(model)
        if is_run_dir(path):
            check_trained_run(path)
    except ModelLoadError as exc:
        raise UsageError(f"{flag}: {exc}") from None


AGENT_OWN_FLAGS = {"hf": (("model", "--model"),),
                   "api": (("api_base", "--api-base"), ("api_model", "--api-model"), ("api_timeout", "--api-timeout"),
                           ("api_max_retries", "--api-max-retries"), ("api_backoff", "--api-backoff"),
                           ("api_extra", "--api-extra"))}


def _check_agent_flags(args: argparse.Namespace) -> None:
    """A flag of another agent is refused: it would be ignored, and the run would evaluate another
    model than the one named (``--model DIR`` with the default agent evaluated SmolLM2)."""
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


def _make_agent(args: argparse.Namespace):
    if args.agent in ("default", "hf"):
        if args.agent == "hf" and not args.model:
            raise UsageError("--agent hf needs --model PATH (a local Hugging Face model directory)")
        if args.agent == "hf":
            _check_model_dir(args.model)
        from .agents.hf_policy import HFPolicy, SamplingConfig

        sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                  top_p=args.top_p, seed=args.sample_seed, max_batch_size=args.num_envs)
        policy = HFPolicy.from_pretrained(args.model if args.agent == "hf" else None, sampling=sampling,
                                          device=args.device)
        policy.prompt_limit()  # --max-new-tokens past the model's context: refused now, as the flag
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
        from .agents.chat_api import ChatAPIAgent

        # A transport flag left out keeps ChatAPIConfig's default.
        transport = {name: value for name, value in (("timeout_s", args.api_timeout),
                                                     ("max_retries", args.api_max_retries),
                                                     ("backoff_s", args.api_backoff),
                                                     ("extra_body", _json_object(args.api_extra, "--api-extra")))
                     if value is not None}
        return ChatAPIAgent.from_url(args.api_base, args.api_model, temperature=args.temperature,
                                     top_p=args.top_p, max_tokens=args.max_new_tokens,
                                     max_concurrency=args.num_envs, seed=args.sample_seed, **transport)
    from .agents.scripted import AdversarialAgent, RandomTextAgent

    if args.agent in ("random", "adversarial"):
        seed = args.sample_seed
        return RandomTextAgent(seed=seed) if args.agent == "random" else AdversarialAgent(seed=seed)
    return _agent_of_your_own(args.agent, _sampling_flags_given(args))


def _check_common(args: argparse.Namespace) -> None:
    """Arguments every command that has them gets wrong the same way; refused before any work."""
    for flag in ("seed", "sample_seed"):
        seed = getattr(args, flag, 0)
        if seed is not None and not 0 <= seed < 2**63:
            raise UsageError(f"--{flag.replace('_', '-')} must be in [0, 2^63), got {seed}")
    device = getattr(args, "device", None)
    if device and getattr(args, "agent", None) not in (None, "default", "hf"):
        raise UsageError(f"--device is read by the local models (--agent default or hf) only, and this run's agent is "
                         f"{args.agent}; drop --device")
    if device:
        import torch

        try:
            parsed = torch.device(device)
        except RuntimeError:
            raise UsageError(f"--device {device!r} is not a torch device; use cpu, cuda or cuda:N") from None
        if parsed.type == "cuda" and not torch.cuda.is_available():
            raise UsageError(f"--device {device}: this torch build or machine has no CUDA; use --device cpu")
        if parsed.type not in ("cpu", "cuda", "mps", "xpu"):
            raise UsageError(f"--device {device!r}: rftgym runs on cpu or cuda (got the {parsed.type} device type)")
        available = {"mps": lambda: torch.backends.mps.is_available(),  # torch.mps has it only from 2.5
                     "xpu": lambda: hasattr(torch, "xpu") and torch.xpu.is_available()}.get(parsed.type)
        if available is not None and not available():
            raise UsageError(f"--device {device}: this torch build or machine has no {parsed.type.upper()} device; "
                             "use --device cpu")
    for name, flag in (("out", "--out"), ("output_dir", "--output-dir")):
        value = getattr(args, name, None)
        if value is not None and not value.strip():  # would quietly mean the default path
            raise UsageError(f"{flag} is empty; give a path, or leave {flag} out for the default under runs/")
    episodes = getattr(args, "episodes", None)
    if episodes is not None and episodes < 1:
        raise UsageError(f"--episodes must be at least 1, got {episodes}")


def _writable_file(path: Path, what: str, inputs: dict | None = None, folders: dict | None = None,
                   sources: dict[str, tuple[str, str]] | None = None) -> None:
    """Refuse an output file path that cannot be written, or that names one of the run's input
    files (an ``--env-arg`` path, a file in one of the input ``folders``: flag -> directory, such
    as the model's, or the source of a module imported for the run: :func:`_users_sources`),
    before any episode runs. Creating the partial file beside it (:func:`_partial`) is the test:
    it is where the episodes go while the run lasts."""
    try:
        if path.is_dir():
            raise UsageError(f"{what} {path} is a directory; give a file name ending in .jsonl, or a new "
                             "directory with several environments")
        if path.exists() and not path.is_file():  # the finished file replaces it: never a device or a pipe
            raise UsageError(f"{what} {path} is not a regular file (a device, pipe or socket); the episodes are "
                             "written to a file that replaces it, so give a file name ending in .jsonl")
        blocking = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
        if blocking is not None:
            raise UsageError(f"{what} {path} cannot be written: {blocking} is a file, not a directory")
        for key, value in (inputs or {}).items():
            # realpath resolves a path through a directory not made yet ("new/../tasks.jsonl") too.
            if isinstance(value, str) and value and Path(value).exists() and (
                    os.path.samefile(path, value) if path.exists()
                    else os.path.realpath(path) == os.path.realpath(value)):
                raise UsageError(f"{what} {path} is the file given as --env-arg {key}; the evaluation would "
                                 "overwrite its own input. Give another --out")
        code = (sources or {}).get(os.path.realpath(path))
        if code is not None:
            module, named_by = code
            raise UsageError(f"{what} {path} is the source of the Python module {module!r}, imported for {named_by}; "
                             "the evaluation would overwrite that code with its episodes. Give another --out")
        for flag, folder in (folders or {}).items():
            # Episodes beside the model's files are fine (a run's eval.jsonl, again); its files are not.
            if path.is_file() and os.path.isdir(folder) and path.resolve().is_relative_to(Path(folder).resolve()) \
                    and not _holds_episodes(path):
                raise UsageError(f"{what} {path} is a file of the {flag} directory {folder}; the evaluation would "
                                 "overwrite it with its episodes. Give another --out")
        path.parent.mkdir(parents=True, exist_ok=True)
        _check_partial(path)
        _partial(path).open("a", encoding="utf-8").close()
    except OSError as exc:
        raise UsageError(f"{what} {path} cannot be written: {exc.strerror or exc}") from None


def _holds_episodes(path: Path) -> bool:
    """Whether ``path`` starts as an episode record does (an earlier evaluation's --out): by its
    first bytes only, since a model's weights file may have no line end for gigabytes."""
    try:
        with open(path, "rb") as handle:
            return handle.read(len(EPISODE_START)) == EPISODE_START
    except OSError:
        return False


EPISODE_START = b'{"env_id": '  # how every line of rftgym's episode files starts (Episode.to_json)


def _partial(path: Path) -> Path:
    """Where an evaluation streams its finished episodes until it completes and replaces ``path``."""
    return path.with_name(path.name + ".partial")


def _check_partial(path: Path) -> None:
    """Refuse to start over the episodes an earlier, unfinished evaluation left in the partial file."""
    partial = _partial(path)
    if partial.is_file() and partial.stat().st_size > 0:
        raise UsageError(f"{partial} holds the episodes of an earlier evaluation that did not complete; move or "
                         "delete it, or give another --out")


def _unique(path: Path, taken: Collection[Path] = ()) -> Path:
    """``path``, or ``stem-2``, ``stem-3``... beside it if it exists (two runs in one second) or is
    ``taken`` by another file of this run (two envs of the same name in other namespaces)."""
    candidate, number = path, 2
    while candidate.exists() or candidate in taken:
        candidate = path.with_name(f"{path.stem}-{number}{path.suffix}")
        number += 1
    return candidate


# ---------------------------------------------------------------- commands

def cmd_envs(args: argparse.Namespace) -> int:
    from .rollout.metrics import format_table

    print(format_table([(env_id, desc) for env_id, (_, desc) in env_registry.ENVS.items()], ["id", "description"]))
    return 0


def cmd_play(args: argparse.Namespace) -> int:
    from .envs.common import settle_cut

    env = _make_env(args.env, _parse_env_args(args.env_arg))
    print(f"{args.env}: you are the assistant. End a line with '\\' to continue on the next line; "
          "Ctrl-D quits.\n")
    seen: set[str] = set()
    if hasattr(sys.stdin, "reconfigure"):
        # Undecodable bytes reach _valid_text (as U+FFFD) instead of failing a whole buffered read.
        sys.stdin.reconfigure(errors="surrogateescape")
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")  # a terminal that is not UTF-8 shows '?' for '…'

    try:
        for episode in range(args.episodes):
            context, info = env.reset(seed=None if args.seed is None else args.seed + episode)
            done = False
            while not done:
                for message in context:
                    if message.id not in seen and message.role != "assistant":
                        print(f"[{message.role}]\n{message.content}\n")
                    seen.add(message.id)
                text = _read_turn()
                if text is None:
                    print("\nbye")
                    return 0
                before = context
                context, reward, terminated, truncated, info = env.step(text)
                if truncated and not terminated:  # paid and reported as rftgym eval records it
                    reward, info = settle_cut(reward, info)
                for message in context:
                    if message.role == "assistant":
                        seen.add(message.id)
                # An env may edit the context (e.g. a memory prune): say what the model no longer sees.
                kept = set(context.ids)
                removed = [m for m in before if m.id not in kept]
                if removed:
                    print(f"[context edited: {len(removed)} earlier message(s) removed]")
                    for message in removed:
                        print(f"  - {message.id} ({message.role}): {_first_line(message.content)}")
                    print()
                print(f"reward={reward:.3f} terminated={terminated} truncated={truncated} info={_brief(info)}\n")
                done = terminated or truncated
    finally:
        env.close()
    return 0


def _brief(info: dict) -> dict:
    """``info`` for a person playing: collections by their size (CodeTCG's tests hold every
    expected output, and a wall of text per turn hides the rest), long text cut, empty values left out."""
    shown = {}
    for key, value in info.items():
        if value is None or (isinstance(value, str) and not value):  # (`in` would compare arrays)
            continue
        if isinstance(value, (list, tuple, dict, set)):
            value = f"<{len(value)} item{'s' if len(value) != 1 else ''}>"
        elif isinstance(value, str) and len(value) > 200:
            value = value[:197] + "..."
        shown[key] = value
    return shown


def _read_turn() -> str | None:
    lines = []
    prompt = "assistant> "
    while True:
        try:
            line = _valid_text(input(prompt))
        except EOFError:
            return None
        except UnicodeDecodeError as exc:  # stdin decoded strictly (e.g. PYTHONIOENCODING=utf-8)
            print(f"\n(that line was not valid {exc.encoding}; type it again)", file=sys.stderr)
            continue
        line = line.removesuffix("\r")  # piped Windows text: its continuation mark sits before a CR
        if line.endswith("\\"):
            lines.append(line[:-1])
            prompt = "........> "
            continue
        lines.append(line)
        return "\n".join(lines)


def _first_line(text: str, width: int = 70) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= width else line[:width - 3] + "..."


def _valid_text(line: str) -> str:
    """The line with any undecodable input bytes as U+FFFD: stdin decoded with surrogateescape (a
    C or UTF-8 locale) keeps them as lone surrogates, which no encoder, tokenizer or file accepts."""
    try:
        return line.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:  # a surrogate that is not an escaped byte
        return line.encode("utf-8", "replace").decode("utf-8")


def cmd_eval(args: argparse.Namespace) -> int:
    if args.episodes is not None and args.episodes < 1:
        raise UsageError(f"--episodes must be at least 1, got {args.episodes}")
    if args.episodes is not None and args.episodes > MAX_EVAL_EPISODES:
        raise UsageError(f"--episodes {args.episodes} is more than one evaluation holds ({MAX_EVAL_EPISODES:,}: every "
                         "episode is kept for the table); split it into runs with --seed S --episodes N")
    if args.num_envs < 1:
        raise UsageError(f"--num-envs must be at least 1, got {args.num_envs}")
    _check_agent_flags(args)
    repeated = sorted({env_id for env_id in args.env if args.env.count(env_id) > 1})
    if repeated:
        raise UsageError(f"{', '.join(repeated)} is given more than once; give each environment once (its "
                         "episodes are set by --episodes and --seed)")
    env_ids = list(args.env)
    env_kwargs = _parse_env_args(args.env_arg)
    episodes_per_env = {}
    for env_id in env_ids:
        probe = _make_env(env_id, env_kwargs)  # fail fast on a bad env id or option, before loading a model
        # An env over a fixed benchmark (e.g. HumanEval) names its size, so that the default
        # evaluation covers each task once; others get DEFAULT_EVAL_EPISODES seeded episodes.
        episodes_per_env[env_id] = args.episodes or getattr(probe.unwrapped, "eval_episodes", None) \
            or DEFAULT_EVAL_EPISODES
        probe.close()
    for env_id in env_ids:
        _check_eval_metadata(env_id, args.baselines)
    if args.baselines and not any(_env_class(e).metadata.get("eval_baselines") for e in env_ids):
        raise UsageError(f"{', '.join(env_ids)} {'declares' if len(env_ids) == 1 else 'declare'} no evaluation "
                         "baselines; drop --baselines")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if args.out and len(env_ids) > 1 and (Path(args.out).suffix == ".jsonl" or Path(args.out).is_file()):
        raise UsageError("with several environments --out is a directory (one JSONL per environment), "
                         f"not a file; got {args.out}")
    outs = {}
    for env_id in env_ids:
        if len(env_ids) == 1 and args.out and not args.out.endswith(("/", os.sep)):
            outs[env_id] = Path(args.out)
        else:
            outs[env_id] = _unique((Path(args.out) if args.out else Path("runs") / "eval")
                                   / f"{_short_name(env_id)}-{_agent_label(args.agent)}-{stamp}.jsonl",
                                   set(outs.values()))
    # Every run's file (each baseline's too): a bad path is refused now, not after the runs before it.
    paths = [path for env_id in env_ids for path in _baseline_paths(env_id, outs[env_id], args.baselines).values()]
    if len(set(paths)) < len(paths):  # e.g. a baseline's file and another env's; never one file for two runs
        raise UsageError(f"two runs of this evaluation would write the same file ({', '.join(map(str, paths))}); "
                         "give another --out")
    rows, written = [], []  # rows: (headers, row); each env has its own columns after the shared ones
    context_full: dict[str, int] = {}
    agent = None
    sources = _users_sources(env_ids, args.agent, args.baselines)
    try:
        for path in paths:
            _writable_file(path, "--out", env_kwargs, {"--model": args.model} if args.agent == "hf" and args.model
                           else {}, sources)
        agent = _build_agent(args)
        for env_id in env_ids:
            for row, path, full in _evaluate_env(args, env_id, agent, env_kwargs, episodes_per_env[env_id],
                                                 outs[env_id]):
                rows.append(row)
                written.append(path)
                if full:
                    context_full[env_id] = context_full.get(env_id, 0) + full
    except BaseException:
        if written:  # the runs that completed before a later one failed are shown, not hidden behind the error
            _print_eval_results(len(env_ids), rows, written, context_full)
        raise
    finally:  # the agent, also after a failure; the (empty) partial files of runs that never started
        if agent is not None:
            agent.close()
        for path in paths:
            partial = _partial(path)
            try:
                if partial.is_file() and partial.stat().st_size == 0:
                    partial.unlink()
            except OSError:  # e.g. a name too long: it was refused, and nothing was made there
                pass
    _print_eval_results(len(env_ids), rows, written, context_full)
    return 0


def _print_eval_results(env_count: int, rows, written: Sequence[Path], context_full: dict[str, int]) -> None:
    """The table of the runs in ``rows``, notes on their episodes, and where they were written."""
    from .rollout import format_table

    if env_count == 1:
        print(format_table([row for _, row in rows], rows[0][0]))
    else:
        # Envs have different own columns: the shared ones, then each env's as key=value text.
        shared = len(EVAL_COLUMNS)
        table = [row[:shared] + [" ".join(f"{h}={_cell(v)}" for h, v in zip(row_headers[shared:], row[shared:]))]
                 for row_headers, row in rows]
        print(format_table(table, EVAL_COLUMNS + ["env metrics"]))
    for env_id, full in context_full.items():
        print(f"note: {full} {env_id} episode(s) ended because the context left no room for another reply "
              "(info context_full, scored as unfinished); lower --max-new-tokens or use a longer-context model")
    # Flushed: after a failure the error follows on stderr, and should not come before this.
    print("episodes written to " + ", ".join(str(p) for p in written), flush=True)


def _check_eval_metadata(env_id: str, baselines: bool) -> None:
    """An env's own eval columns and baselines (its class's metadata; the baselines' wrappers are
    loaded when they will run, with ``--baselines``), checked before any episode runs: a
    malformed entry would otherwise fail after the whole evaluation, or after the envs before it."""
    from .rollout.metrics import metric_spec_problem

    metadata = _env_class(env_id).metadata
    problem = metric_spec_problem(metadata.get("eval_metrics", ()))
    if problem:
        raise ConfigError(f"{env_id}: metadata['eval_metrics'] is malformed: {problem}; e.g. "
                          "(('hit_rate', 'hit', 'final_rate'),) adds a column hit_rate, the share of episodes whose "
                          "last turn's info['hit'] is true")
    columns = [column for column, _, _ in metadata.get("eval_metrics", ())]
    taken = sorted({c for c in columns if columns.count(c) > 1 or c in EVAL_COLUMNS})
    if taken:
        raise ConfigError(f"{env_id}: metadata['eval_metrics'] names the column(s) {', '.join(taken)} twice or as one "
                          f"of the table's own ({', '.join(EVAL_COLUMNS)}); give each column a name of its own")
    declared = metadata.get("eval_baselines", ())
    entries = declared if isinstance(declared, (list, tuple)) else [declared]
    labels = []
    for entry in entries:
        if not (isinstance(entry, (list, tuple)) and len(entry) == 3 and isinstance(entry[0], str)
                and isinstance(entry[1], dict) and (entry[2] is None or isinstance(entry[2], str))):
            raise ConfigError(f"{env_id}: metadata['eval_baselines'] has the entry {entry!r}; each is a (label, env "
                              "options dict, 'module:AgentWrapper' or None) triple")
        label, _, wrapper = entry
        # The label names the baseline's row and its episodes' file (beside the agent's own).
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", label) or label in labels:
            raise ConfigError(f"{env_id}: metadata['eval_baselines'] has the label {label!r}"
                              f"{' twice' if label in labels else ''}; labels are distinct, non-empty and made of "
                              "letters, digits, '_', '.' and '-' (they name files)")
        labels.append(label)
        if wrapper is not None and baselines:  # --baselines: the wrappers will run
            try:
                _load_object(wrapper)
            except Exception as exc:  # noqa: BLE001 (the user's module may raise anything while importing)
                raise ConfigError(f"{env_id}: the baseline {label!r}'s agent wrapper {wrapper!r} cannot be loaded "
                                  f"({type(exc).__name__}: {exc}); give 'module:Wrapper' with an importable module") \
                    from None


def _evaluate_env(args, env_id: str, agent, env_kwargs: dict, episodes: int, out: Path):
    """One env: the agent as it is, then each baseline the env declares (the same agent under other
    env options, or wrapped), all on the same seeds. Yields ``((headers, row), path, context_full)``
    for each run as it completes, so that a later run's failure does not hide it."""
    from .core.records import write_episodes_jsonl

    env_class = _env_class(env_id)
    env_kwargs = with_policy_token_counter(env_class.metadata, env_kwargs, agent)
    seeds = [args.seed + i for i in range(episodes)]
    out.parent.mkdir(parents=True, exist_ok=True)
    runs = [("", agent, env_kwargs)]
    for label, overrides, wrapper in env_class.metadata.get("eval_baselines", ()) if args.baselines else ():
        runs.append((label, _load_object(wrapper)(agent) if wrapper else agent, {**env_kwargs, **overrides}))
    paths = list(_baseline_paths(env_id, out, args.baselines).values())
    for (label, run_agent, run_kwargs), path in zip(runs, paths):
        run_episodes_, elapsed = _evaluate(args, env_id, run_agent, run_kwargs, seeds, label, path)
        target = path.resolve()  # a symlinked --out is written through, not replaced
        complete = target.with_name(target.name + ".complete")
        try:  # in seed order, then in place of any earlier file at once
            write_episodes_jsonl(complete, run_episodes_)
            os.replace(complete, target)
        except OSError as exc:
            raise UsageError(f"cannot write the episodes to {path} ({exc.strerror or exc}); they are all in "
                             f"{_partial(path)}") from None
        finally:
            complete.unlink(missing_ok=True)
        _partial(path).unlink(missing_ok=True)
        headers, row, summary = _eval_row(env_id, env_class, label or getattr(run_agent, "name", args.agent),
                                          run_episodes_, elapsed)
        yield (headers, row), path, summary["context_full"]


def _baseline_paths(env_id: str, out: Path, baselines: bool) -> dict[str, Path]:
    """Where each run of an env's evaluation writes its episodes, by label: ``""`` (the agent as it
    is) to ``out``, and with ``--baselines`` each baseline the env declares beside it."""
    labels = [label for label, _, _ in _env_class(env_id).metadata.get("eval_baselines", ())] if baselines else []
    return {"": out, **{label: out.with_name(f"{out.stem}-{label}{out.suffix}") for label in labels}}


def _evaluate(args, env_id, agent, env_kwargs, seeds, label, path: Path):
    """Run the episodes; each finished one is appended at once to ``path``'s partial file, so an
    interrupted or failed evaluation keeps what it finished, and an earlier ``path`` is left as it
    was until the evaluation completes."""
    from tqdm import tqdm

    from .core.records import append_episode_jsonl
    from .rollout import RolloutConfig, run_episodes

    started = time.perf_counter()
    desc = f"eval {env_id}" + (f" ({label})" if label else "")
    finished = 0
    partial = _partial(path)
    try:
        handle = open(partial, "w", encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"--out {path}: cannot write {partial} ({exc.strerror or exc})") from None
    with handle, tqdm(total=len(seeds), desc=desc, unit="ep", file=sys.stderr) as bar:
        def done(episode):
            nonlocal finished
            try:
                append_episode_jsonl(handle, episode)
            except OSError as exc:
                raise UsageError(f"cannot write episodes to {partial} ({exc.strerror or exc}); the {finished} "
                                 "finished before are there") from None
            finished += 1
            bar.update(1)

        try:
            episodes = run_episodes(lambda: gym.make(env_id, **env_kwargs), agent, seeds,
                                    config=RolloutConfig(num_envs=args.num_envs), on_episode=done)
        except BaseException as exc:
            why = ("terminated (SIGTERM)" if isinstance(exc, _Terminated) else "interrupted"
                   if isinstance(exc, KeyboardInterrupt) else "stopped by an error")
            kept = f"; {path} is as it was" if path.exists() else ""
            if finished:
                print(f"\n{why}: the {finished} finished episodes are in {partial}{kept}", file=sys.stderr)
            else:
                partial.unlink(missing_ok=True)
                if isinstance(exc, KeyboardInterrupt):
                    print(f"\n{why} before any episode finished{kept}", file=sys.stderr)
            if isinstance(exc, KeyboardInterrupt):
                exc.reported = True
            raise
    return episodes, time.perf_counter() - started


def _eval_row(env_id, env_class, agent_name, episodes, elapsed):
    from .rollout import summarize
    from .rollout.metrics import env_metrics

    s = summarize(episodes)
    headers = list(EVAL_COLUMNS)
    row = [env_id, agent_name, s["episodes"], s["reward"], s["success"], s["turns"],
           s["format_error_rate"], s["sampled_tokens"], s["prompt_tokens"], s["episodes"] / elapsed]
    extra = env_metrics(episodes, env_class.metadata.get("eval_metrics", ()))
    return headers + list(extra), row + ["-" if v is None else v for v in extra.values()], s


AUTO_SWITCH = {"auto": None, "on": True, "off": False}


def _train_flags() -> list[tuple[str, str, dict]]:
    """``(flag, TrainConfig field, argparse options)`` for ``rftgym train``; defaults are TrainConfig's.
    The env id, ``--env-arg``, ``--seed`` and ``--output-dir``'s default are set apart."""
    from .train.config import AGGREGATION_NAMES, ALGORITHMS, COMPILE_SCOPES, OLD_LOGPROBS, PARALLELISM, TrainConfig
    from .train.schedule import LR_SCHEDULES

    d = TrainConfig  # the dataclass's defaults
    run, sampling, optim, algo, model = ("run", "sampling", "optimisation", "algorithm-specific", "model and runtime")

    def opt(group, default, help_text, **options):
        kind = {"type": type(default)} if isinstance(default, (int, float)) and not isinstance(default, bool) else {}
        shown = "" if default is None else " (default: %(default)s)"
        return {"group": group, "default": default, "help": help_text + shown, **kind, **options}

    return [
        ("--algo", "algo", opt(run, d.algo, "algorithm", choices=ALGORITHMS)),
        ("--model", "model", opt(run, d.model, "local Hugging Face model directory (default model: SmolLM2-135M-Instruct)")),
        ("--output-dir", "output_dir", opt(run, None, "where metrics, the PNG and checkpoints go "
                                                      "(runs/train/<env>-<algo> when unset; with --resume and "
                                                      "no --algo, the env's one run there)")),
        ("--steps", "steps", opt(run, d.steps, "training steps")),
        ("--save-every", "save_every", opt(run, d.save_every, "checkpoint every N steps (and after the last)")),
        ("--log-every", "log_every", opt(run, d.log_every, "write metrics every N steps (and the last)")),
        ("--eval-every", "eval_every", opt(run, d.eval_every, "every N steps (and after the last) play --eval-episodes "
                                                             "greedy episodes and log eval_reward_mean (0 = never)")),
        ("--eval-episodes", "eval_episodes", opt(run, d.eval_episodes, "episodes per evaluation")),
        ("--eval-seed", "eval_seed", opt(run, d.eval_seed, "seed of the first evaluation episode (the same "
                                                           "episodes as rftgym eval --seed N)")),
        ("--tasks-per-step", "tasks_per_step", opt(sampling, d.tasks_per_step, "tasks sampled per step")),
        ("--group-size", "group_size", opt(sampling, d.group_size, "samples per task (G)")),
        ("--max-new-tokens", "max_new_tokens", opt(sampling, d.max_new_tokens, "token limit of one assistant turn")),
        ("--max-prompt-tokens", "max_prompt_tokens", opt(sampling, d.max_prompt_tokens, "the longest prompt answered; "
                                                         "a longer one ends its episode as truncated (0 = room for "
                                                         "a reply in the model's context)")),
        ("--temperature", "temperature", opt(sampling, d.temperature, "sampling temperature")),
        ("--top-p", "top_p", opt(sampling, d.top_p, "nucleus sampling threshold")),
        ("--rollout-batch-size", "rollout_batch_size", opt(sampling, d.rollout_batch_size,
                                                           "episodes run side by side")),
        ("--lr", "learning_rate", opt(optim, d.learning_rate, "peak learning rate")),
        ("--lr-schedule", "lr_schedule", opt(optim, d.lr_schedule, "after the warm-up", choices=LR_SCHEDULES)),
        ("--warmup-steps", "warmup_steps", opt(optim, d.warmup_steps, "linear warm-up steps")),
        ("--min-lr-ratio", "min_lr_ratio", opt(optim, d.min_lr_ratio, "a decaying schedule's final rate, as a "
                                                                     "share of --lr")),
        ("--weight-decay", "weight_decay", opt(optim, d.weight_decay, "AdamW weight decay")),
        ("--epochs", "epochs_per_step", opt(optim, d.epochs_per_step, "passes over each step's samples")),
        ("--minibatch-size", "minibatch_size", opt(optim, d.minibatch_size, "samples per optimizer step")),
        ("--microbatch-size", "microbatch_size", opt(optim, d.microbatch_size, "gradient accumulation: forward/"
                                                     "backward this many samples at a time (0 = the whole minibatch)")),
        ("--microbatch-tokens", "microbatch_tokens", opt(
            optim, d.microbatch_tokens, "gradient accumulation by tokens: a forward/backward pass computes at most "
                                        "this many tokens, padding included (0 = off; instead of --microbatch-size)")),
        ("--pack-sequences", "pack_sequences", opt(
            optim, d.pack_sequences, "several samples per row, so the update computes no padding (the same "
                                     "gradient)", action=argparse.BooleanOptionalAction)),
        ("--max-grad-norm", "max_grad_norm", opt(optim, d.max_grad_norm, "gradient clipping norm")),
        ("--clip-low", "clip_low", opt(optim, d.clip_low, "PPO ratio clipped below at 1 - clip_low")),
        ("--clip-high", "clip_high", opt(optim, d.clip_high, "PPO ratio clipped above at 1 + clip_high "
                                                             "(> clip-low: DAPO's clip-higher)")),
        ("--aggregation", "aggregation", opt(optim, d.aggregation, "how token losses reduce to one",
                                             choices=AGGREGATION_NAMES)),
        ("--kl-coef", "kl_coef", opt(optim, d.kl_coef, "k3 KL to the initial model (0: no reference)")),
        ("--filter-zero-variance", "filter_zero_variance", opt(
            optim, d.filter_zero_variance, "skip groups whose rewards are all equal (DAPO dynamic sampling)",
            action=argparse.BooleanOptionalAction)),
        ("--filter-overlong", "filter_overlong", opt(
            optim, d.filter_overlong, "mask episodes whose last reply was cut by --max-new-tokens or "
                                                  "that ran out of context (DAPO overlong filtering)",
            action=argparse.BooleanOptionalAction)),
        ("--old-logprobs", "old_logprobs", opt(optim, d.old_logprobs, "the PPO ratio's old log-probs: as sampled, or "
                                               "recomputed by the training forward pass", choices=OLD_LOGPROBS)),
        ("--logprob-chunk-size", "logprob_chunk_size", opt(optim, d.logprob_chunk_size,
                                                           "tokens per chunk of the vocabulary projection")),
        ("--pcar-lambda", "pcar_lambda", opt(algo, d.pcar_lambda, "PCAR: weight of the segment's evaluation score")),
        ("--pcar-delta", "pcar_delta", opt(algo, d.pcar_delta, "PCAR: floor of a segment's advantage scale")),
        ("--dcpo-segment-budget", "dcpo_segment_budget", opt(algo, d.dcpo_segment_budget,
                                                             "DCPO: segments trained per group (0 = all)")),
        ("--lora-rank", "lora_rank", opt(model, d.lora_rank, "LoRA rank (0 = full fine-tuning)")),
        ("--lora-alpha", "lora_alpha", opt(model, d.lora_alpha, "LoRA alpha")),
        ("--gradient-checkpointing", "gradient_checkpointing", opt(
            model, d.gradient_checkpointing, "recompute each decoder layer in the backward pass",
            action=argparse.BooleanOptionalAction)),
        ("--compile", "compile", opt(model, "auto", "torch.compile each decoder layer for the update "
                                                    "(auto: on CUDA only)", choices=tuple(AUTO_SWITCH))),
        ("--compile-scope", "compile_scope", opt(model, d.compile_scope, "what one compiled graph covers: each "
                                                 "decoder layer, or the whole decoder (less host work per forward, "
                                                 "a longer first compile)", choices=COMPILE_SCOPES)),
        ("--checkpoint-mlp", "checkpoint_mlp", opt(model, "auto", "recompute each MLP in the backward pass: about "
                                                   "half the activation memory (auto: on CUDA only)",
                                                   choices=tuple(AUTO_SWITCH))),
        ("--dtype", "dtype", opt(model, "auto", "the model's weights (auto: float32, with bfloat16 autocast on CUDA; "
                                                "bfloat16 keeps float32 master weights in the optimizer)",
                                 choices=("auto", "float32", "bfloat16"))),
        ("--device", "device", opt(model, d.device, "torch device (unset: cuda if available, else cpu)")),
        ("--parallelism", "parallelism", opt(model, d.parallelism, "under torchrun / accelerate launch: ddp "
                                             "replicates the model on every process, fsdp shards parameters, "
                                             "gradients and optimizer state", choices=PARALLELISM)),
        ("--dist-timeout", "dist_timeout_s", opt(model, d.dist_timeout_s, "under a launcher: seconds a process "
                                                 "waits for the others in a collective before the run stops with an "
                                                 "error (unset: PyTorch's default, 30 minutes on CPU, 10 on CUDA); set it "
                                                 "above a step's "
                                                 "slowest rollout", type=float, metavar="SECONDS")),
    ]


def train_config_from_args(args: argparse.Namespace):
    """The :class:`~rftgym.train.TrainConfig` that ``rftgym train``'s arguments describe."""
    from .core.errors import ConfigError
    from .train import TrainConfig

    output_dir = args.output_dir or _default_output_dir(args)
    settings = {field_name: getattr(args, field_name) for _, field_name, _ in TRAIN_FLAGS}
    settings.update(env_id=args.env, env_kwargs=_parse_env_args(args.env_arg), output_dir=output_dir, seed=args.seed,
                    **{name: AUTO_SWITCH[settings[name]] for name in ("compile", "checkpoint_mlp")},
                    dtype=None if args.dtype == "auto" else args.dtype)
    if getattr(args, "resume", False):
        settings = _with_checkpoint_settings(settings, getattr(args, "given", None), Path(output_dir))
    try:
        return TrainConfig(**settings)
    except ConfigError as exc:
        raise (_flagged(exc, _train_field_flags()) or UsageError(str(exc))) from exc


def _train_field_flags() -> dict[str, str]:
    """TrainConfig's fields and the parts of ``rftgym train``'s command line that set them."""
    flags = {field_name: flag for flag, field_name, _ in TRAIN_FLAGS}
    flags.update(env_id="ENV", env_kwargs="--env-arg", seed="--seed", output_dir="--output-dir")
    return flags


def _default_output_dir(args: argparse.Namespace) -> str:
    """runs/train/<env>-<algo>. A resume that names neither the folder nor the algorithm resumes
    the one run of the env with a checkpoint there (not necessarily the default algorithm's), and
    is refused where there are several."""
    from .train.checkpoint import has_checkpoint
    from .train.config import ALGORITHMS

    def folder(algo: str) -> Path:
        return Path("runs") / "train" / f"{_short_name(args.env)}-{algo}"

    given = getattr(args, "given", None)
    if getattr(args, "resume", False) and given is not None and "algo" not in given:
        runs = [folder(algo) for algo in ALGORITHMS if has_checkpoint(folder(algo))]
        if len(runs) == 1:
            print(f"resuming the run in {runs[0]}", file=sys.stderr)
            return str(runs[0])
        if len(runs) > 1:
            raise UsageError(f"--resume: {len(runs)} runs of {args.env} have a checkpoint ("
                             + ", ".join(map(str, runs)) + "); say which with --output-dir (or --algo)")
    return str(folder(args.algo))


def _with_checkpoint_settings(settings: dict, given: set[str] | None, output_dir: Path) -> dict:
    """A resume's settings: those its command line gives, and the checkpoint's for the rest, not
    TrainConfig's defaults (which would quietly turn the run into another: another group size or
    reply length). ``--env-arg`` pairs update the checkpoint's env options. ``given`` (the fields
    whose flags were on the command line) None, or no readable checkpoint: the settings as they
    are (a missing or damaged checkpoint is refused later, with its message). Saved settings that
    TrainConfig refuses (a state.json edited by hand) are refused here, naming their flags: the
    defaults in their place would quietly resume another run."""
    from .core.errors import ConfigError
    from .train import TrainConfig
    from .train.checkpoint import has_checkpoint, saved_state

    if given is None or not has_checkpoint(output_dir):
        return settings
    try:
        state = saved_state(output_dir)
    except ConfigError:
        return settings
    # A setting given on the command line replaces the saved one, so that it can mend a bad one.
    overrides = {name: settings[name] for name in given if name in settings}
    try:
        saved = TrainConfig.from_saved({**state["config"], **overrides}).to_dict()
    except (ConfigError, TypeError, ValueError) as exc:
        flags = {field_name: flag for flag, field_name, _ in TRAIN_FLAGS}
        named = [flags[field] for field in getattr(exc, "fields", ()) if field in flags]
        fix = f"give {' and '.join(dict.fromkeys(named))} to set it for this run, or " if named else ""
        raise UsageError(f"--resume: the settings saved with the checkpoint in {output_dir} (the 'config' of "
                         f"checkpoint/state.json) are refused: {exc}. The checkpoint is left as it is; {fix}mend "
                         "state.json, or start a new run in another output directory") from None
    merged = {name: value if name in given or name not in saved else saved[name] for name, value in settings.items()}
    merged.update(env_id=settings["env_id"], output_dir=settings["output_dir"],
                  env_kwargs={**(saved.get("env_kwargs") or {}), **settings["env_kwargs"]})
    # A model given by a path relative to where the run started: where it was loaded from, absolute.
    loaded_from = state.get("base_model_path")
    if "model" not in given and isinstance(merged["model"], str) and not os.path.isabs(merged["model"]) \
            and isinstance(loaded_from, str) and os.path.isdir(loaded_from):
        merged["model"] = loaded_from
    return merged


def given_train_flags(argv: Sequence[str] | None) -> set[str]:
    """The TrainConfig fields (and ``seed``) whose flags ``rftgym train``'s command line gives: the
    same arguments parsed again with no defaults, so that only what was given remains."""
    namespace = vars(build_parser(defaults=False).parse_args(argv))
    return {name for name in namespace if name in {field for _, field, _ in TRAIN_FLAGS} | {"seed"}}


class _Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's or a launcher's stop), raised where the run is, like Ctrl-C."""


def _stop_on_sigterm():
    """Make SIGTERM stop a training run the way Ctrl-C does (the run's own cleanup, then a message
    naming the checkpoint to resume), instead of ending the process at once. Returns the previous
    handler, or None where handlers cannot be set (not the main thread)."""
    def terminated(signum, frame):
        raise _Terminated()

    try:
        return signal.signal(signal.SIGTERM, terminated)
    except ValueError:  # signal only works in the main thread
        return None


def cmd_train(args: argparse.Namespace) -> int:
    from .train.loop import train

    config = train_config_from_args(args)
    _check_model_dir(config.model)
    _make_env(config.env_id, config.env_kwargs).close()  # fail fast on a bad env id or option
    output_dir = config.output_dir
    from .core.errors import ConfigError

    # train() checks the output directory (on the writing rank, before the model loads).
    previous = _stop_on_sigterm()
    try:
        history = train(config, resume=args.resume)
    except ConfigError as exc:  # a setting the model refuses (e.g. --max-new-tokens past its context), by its flag
        flagged = _flagged(exc, _train_field_flags())
        if flagged is None:
            raise
        raise flagged from exc
    except KeyboardInterrupt as stop:
        from .train.checkpoint import METRICS_FILE, saved_state

        how = "terminated (SIGTERM)" if isinstance(stop, _Terminated) else "interrupted"
        code = 143 if isinstance(stop, _Terminated) else 130
        rank, world = _launch()
        if world > 1 and rank != 0:  # a launcher stops every rank at once: rank 0 says where to resume
            print(f"\nrftgym train: rank {rank}: {how}, see rank 0", file=sys.stderr)
            return code
        try:
            step = saved_state(Path(output_dir))["step"]
        except ConfigError:
            metrics = Path(output_dir) / METRICS_FILE
            logged = metrics.is_file() and metrics.stat().st_size > 0
            print(f"\n{how} before the first checkpoint, so there is nothing to resume; "
                  + (f"start again with another --output-dir (or delete {output_dir})" if logged
                     else "run the same command to start again"), file=sys.stderr)
        else:
            print(f"\n{how}: the checkpoint in {output_dir}/checkpoint is at step {step}; run the same "
                  "command with --resume to continue from there", file=sys.stderr)
        return code
    finally:  # (main leaves the launcher's process group, after any error is reported)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if _launch()[0] != 0:  # under a launcher, rank 0 reports for the run
        return 0
    from .rollout.metrics import format_table

    rows = [[h["step"], h["reward_mean"], h["success_rate"], h["loss"] if h["loss"] is not None else "-",
             h.get("kl_ref", "-"), f"{h['learning_rate']:.3g}", h["step_seconds"]]
            + ([h.get("eval_reward_mean", "-"), h.get("eval_success_rate", "-")] if config.eval_every else [])
            for h in history]
    print(format_table(rows, ["step", "reward", "success", "loss", "kl_ref", "lr", "seconds"]
                       + (["eval reward", "eval success"] if config.eval_every else [])))
    full = [h["context_full_rate"] for h in history if h.get("context_full_rate")]
    if full:
        print(f"note: in {len(full)} of {len(history)} steps some episodes ended because the context left no room "
              f"for another reply (up to {max(full):.0%}; context_full_rate in metrics.jsonl); see "
              "--max-prompt-tokens and --max-new-tokens")
    print(f"metrics: {output_dir}/metrics.jsonl  curve: {output_dir}/learning_curve.png  "
          f"checkpoint: {output_dir}/checkpoint")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from .train.export import export, is_run_dir

    if not is_run_dir(args.run):
        raise UsageError(f"{args.run!r} is not the output directory of an `rftgym train` run with a complete "
                         "checkpoint (checkpoint/state.json); give the --output-dir of a run")
    from .agents.model_loading import check_trained_run

    try:  # a damaged checkpoint is the argument's fault, said before any model loads
        check_trained_run(Path(args.run).expanduser(), doing="export", otherwise="export another run")
    except ModelLoadError as exc:
        raise UsageError(str(exc)) from None
    if args.base_model is not None:
        _check_model_dir(args.base_model, "--base-model")
    out = export(args.run, args.out, base_model=args.base_model)
    print(f"the trained model of {args.run} is in {out}: rftgym eval ENV --agent hf --model {out}")
    return 0


def cmd_serve_retriever(args: argparse.Namespace) -> int:
    from .envs.search.server import serve

    if (args.corpus is None) == (args.world_seed is None):
        raise UsageError("give --corpus FILE (a corpus file) or --world-seed N (the generated world of an env without "
                         "dataset_path, as its world_seed and world_size make it), one of them")
    if args.world_size is not None and args.world_seed is None:
        raise UsageError("--world-size goes with --world-seed (it sizes the generated world)")
    if args.corpus is not None and not Path(args.corpus).is_file():
        raise UsageError(f"--corpus {args.corpus!r} is not a file; give a corpus in one of the supported formats "
                         "(HotpotQA JSON, {title: [sentences]} JSON, [{title, text}] JSON, FlashRAG {id, contents} JSONL)")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in 0-65535, got {args.port}")
    if args.max_connections < 1:
        raise UsageError(f"--max-connections must be >= 1 (connections handled at once), got {args.max_connections}")
    if args.world_seed is not None:
        from .envs.search.env import SearchEvalQAConfig
        from .envs.search.world import MAX_PEOPLE, World

        size = SearchEvalQAConfig.world_size if args.world_size is None else args.world_size
        if args.world_seed < 0:
            raise UsageError(f"--world-seed must be >= 0 (the env's world_seed), got {args.world_seed}")
        if not 2 <= size <= MAX_PEOPLE:
            raise UsageError(f"--world-size must be in [2, {MAX_PEOPLE}] (the env's world_size), got {size}")
        corpus = lambda: World(args.world_seed, size).documents  # noqa: E731
    else:
        corpus = args.corpus
    # a bad --host or a busy --port: ConfigError, before indexing
    serve(corpus, args.index, args.host, args.port, max_connections=args.max_connections)
    return 0


# ---------------------------------------------------------------- parser

TRAIN_FLAGS = _train_flags()


def build_parser(defaults: bool = True) -> argparse.ArgumentParser:
    """The command line. ``defaults=False`` leaves ``rftgym train``'s flags without defaults, so a
    parse holds only the flags given (:func:`given_train_flags`)."""
    parser = _Parser(prog="rftgym", description="Environments, agents and trainers for RL fine-tuning of LLM agents.")
    sub = parser.add_subparsers(dest="command", metavar="{envs,play,eval,train,export,serve-retriever}")
    sub.required = True

    p = sub.add_parser("envs", help="list registered environments")
    p.set_defaults(func=cmd_envs)

    def env_args(p: argparse.ArgumentParser, seed_default=0) -> None:
        p.add_argument("env", help="environment id, e.g. rftgym/VerifiableQA-v0 (see `rftgym envs`)")
        p.add_argument("--env-arg", action="append", default=[], metavar="KEY=VALUE",
                       help="environment option (JSON value or bare string); repeatable")
        p.add_argument("--seed", type=int, default=seed_default, help="seed of the first episode (default 0)")

    p = sub.add_parser("play", help="play an environment by typing the assistant's turns")
    env_args(p)
    p.add_argument("--episodes", type=int, default=1, help="episodes to play, one after another (default 1)")
    p.set_defaults(func=cmd_play)

    p = sub.add_parser("eval", help="evaluate an agent on one or more environments and print a table")
    p.add_argument("env", nargs="+", help="environment id(s), e.g. rftgym/VerifiableQA-v0 (see `rftgym envs`); with "
                                          "several, --env-arg applies to each and --out is a directory")
    p.add_argument("--env-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="environment option (JSON value or bare string); repeatable")
    p.add_argument("--seed", type=int, default=0, help="seed of the first episode (default 0)")
    p.add_argument("--sample-seed", type=_seed_or_none, default=SAMPLING_FLAGS["--sample-seed"][1], metavar="{N,none}",
                   action=_NoteGiven,
                   help="seed of the agent's sampling (with --temperature above 0; also of the random and "
                        "adversarial agents): the default and hf agents draw for each episode from a stream keyed "
                        "by this seed, its task seed and its turn, so it samples alike in any batch and in a run of "
                        "other --seed/--episodes; the api agent sends a seed so derived with each request. none: "
                        "fresh randomness, and no seed sent (default 0)")
    p.add_argument("--agent", type=_agent_choice, default="default", metavar="{" + ",".join(AGENTS) + ",module:name}",
                   help="default: SmolLM2-135M-Instruct (local); hf: --model DIR; api: an OpenAI-compatible server; "
                        "random/adversarial: scripted text; module:name: an agent of your own (an Agent, or a class "
                        "or function that makes one; the sampling flags given are passed to it as temperature=, top_p=, "
                        "max_new_tokens=, seed=)")
    p.add_argument("--episodes", type=int, default=None,
                   help=f"episodes, with seeds --seed, --seed+1, ... (default: every task once for an env over a "
                        f"fixed benchmark such as CodeTCG's HumanEval, else {DEFAULT_EVAL_EPISODES})")
    p.add_argument("--num-envs", type=int, default=16, help="episodes run side by side (the agent's batch; default 16)")
    p.add_argument("--out", help="episodes JSONL path (default runs/eval/<env>-<agent>-<time>.jsonl)")
    p.add_argument("--model", help="local Hugging Face model directory for --agent hf")
    p.add_argument("--device", help="torch device for local models (default: cuda if available, else cpu)")
    p.add_argument("--api-base", help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--api-model", help="model name to send to the API server")
    p.add_argument("--api-timeout", type=float, default=None,
                   help="seconds each attempt at a request to the API server may take in all, from connecting "
                        "to the reply's last byte (the server's whole generation included), before it is retried "
                        "(default 60)")
    p.add_argument("--api-max-retries", type=int, default=None,
                   help="retries of a request that failed for a passing reason (connection, timeout, HTTP 408, 409, "
                        "429, 5xx) before the evaluation stops (default 5)")
    p.add_argument("--api-backoff", type=float, default=None,
                   help="seconds the first retry waits at most; each later one up to twice as long, at most 8 s, "
                        "at random so that requests spread out (default 0.5)")
    p.add_argument("--api-extra", default=None, metavar="JSON",
                   help="a JSON object merged into every request body, for server options such as vLLM's "
                        "'{\"top_k\": 20}' or '{\"chat_template_kwargs\": {\"enable_thinking\": false}}'")
    p.add_argument("--max-new-tokens", type=int, default=SAMPLING_FLAGS["--max-new-tokens"][1], action=_NoteGiven,
                   help="tokens per reply at most (default 256)")
    p.add_argument("--temperature", type=float, default=SAMPLING_FLAGS["--temperature"][1], action=_NoteGiven,
                   help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=SAMPLING_FLAGS["--top-p"][1], action=_NoteGiven,
                   help="nucleus sampling's probability mass (default 1.0: off)")
    p.add_argument("--baselines", action="store_true",
                   help="also run the env's baselines side by side (e.g. no-memory and heuristic pruning for MemoryQA)")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("train", help="train a local model on an environment (GRPO family, PCAR, DCPO, RFT)",
                       description="Train a local model on an environment. Every TrainConfig field has a flag "
                                   "(defaults shown); see rftgym/train/config.py.")
    env_args(p, seed_default=0 if defaults else argparse.SUPPRESS)
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --output-dir; the "
                                                         "flags not given are the checkpoint's settings")
    groups = {}
    for flag, field_name, options in TRAIN_FLAGS:
        options = dict(options)
        if not defaults:
            options["default"] = argparse.SUPPRESS
        group = options.pop("group")
        if group not in groups:
            groups[group] = p.add_argument_group(group)
        groups[group].add_argument(flag, dest=field_name, **options)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("export", help="save a training run's model (LoRA merged) as a Hugging Face model directory")
    p.add_argument("run", help="the run's output directory (rftgym train --output-dir)")
    p.add_argument("out", help="a new directory for the model and its tokenizer")
    p.add_argument("--base-model", default=None, metavar="DIR",
                   help="where the run's base model is now, if it has moved (default: where the run loaded it)")
    p.set_defaults(func=cmd_export)

    from .envs.search.server import DEFAULT_MAX_CONNECTIONS  # standard library only, with the retriever's names

    p = sub.add_parser("serve-retriever", help="serve a corpus index over HTTP (Search-R1's /retrieve shape)")
    p.add_argument("--corpus", default=None, help="corpus file (HotpotQA JSON, {title: [sentences]}, [{title, text}], "
                                                  "or FlashRAG JSONL)")
    p.add_argument("--world-seed", type=int, default=None, metavar="N",
                   help="instead of --corpus: the generated world with this seed, which an env without dataset_path "
                        "searches (its world_seed)")
    p.add_argument("--world-size", type=int, default=None, metavar="N",
                   help="the generated world's size, the env's world_size (default 30, SearchEvalQA's; MemoryQA's "
                        "is 60)")
    p.add_argument("--index", choices=("bm25", "dense"), default="bm25",
                   help="bm25 (default) or dense (all-MiniLM-L6-v2 embeddings, FAISS)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to serve on (default 127.0.0.1: this machine only; 0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS, metavar="N",
                   help=f"connections handled at once (default {DEFAULT_MAX_CONNECTIONS}); more wait their turn to "
                        "be accepted, none is refused")
    p.set_defaults(func=cmd_serve_retriever)
    return parser


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as one line, without the source line it came from (library code, of no use to a
    command's user), written between progress-bar updates rather than into the bar."""
    from tqdm import tqdm

    tqdm.write(f"{category.__name__}: {message}", file=sys.stderr)


def _launch() -> tuple[int, int]:
    """This process's rank and the number of processes, as torchrun or accelerate launch set them
    (``(0, 1)`` for a plain process)."""
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 0, 1


def _report_error(prog: str, exc: BaseException, message: str, same_on_every_rank: bool, details=None) -> None:
    """Print ``PROG: error: message`` (after ``details()``, e.g. a traceback). Under a launcher
    every rank has its part of the error, and the user reads each error once: the rank that reports
    it (:func:`~rftgym.train.distributed.who_reports`) prints it, with its rank unless every rank
    stopped with it, and the others one line that names that rank."""
    rank, world = _launch()
    if world <= 1:
        if details is not None:
            details()
        print(f"{prog}: error: {message}", file=sys.stderr)
        return
    from .train.distributed import who_reports

    report = who_reports(exc, rank, world, same_on_every_rank)
    if report.reporter != rank:
        print(f"{prog}: rank {rank}: stopped, see rank {report.reporter}", file=sys.stderr)
        return
    if details is not None:
        details()
    print(f"{prog}: {'' if report.every_rank else f'rank {rank}: '}error: {message}", file=sys.stderr)


class _LaunchedArgumentError(Exception):
    """An argparse error under a launcher: :func:`main` prints it once for the run."""

    def __init__(self, parser: argparse.ArgumentParser, message: str):
        super().__init__(message)
        self.parser = parser


class _Parser(argparse.ArgumentParser):
    """argparse's parser (and its subcommands', which add_subparsers makes of the same class),
    whose errors under a launcher go to :func:`main`, which prints them once for the run instead of
    once per rank. A flag must be given whole: argparse would take a prefix (--ste for --steps),
    which means another flag, or none, once a flag is added; refused, it is named with the flag it
    is probably short for (:meth:`parse_args`)."""

    def __init__(self, *args, allow_abbrev: bool = False, **kwargs):
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)

    def error(self, message):
        if _launch()[1] > 1:
            raise _LaunchedArgumentError(self, message)
        super().error(message)

    def parse_args(self, args=None, namespace=None):
        """argparse's parse, but an argument that no parser took is reported by the subcommand it
        came after (its usage, and the option it is probably a slip of), not by the top level."""
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            commands = [action for action in self._actions if isinstance(action, argparse._SubParsersAction)]
            command = commands[0].choices.get(getattr(parsed, commands[0].dest, None)) if commands else None
            reporter = command or self
            known = [option for action in reporter._actions for option in action.option_strings]
            close = [match for typed in unknown if typed.startswith("--")
                     for match in _meant(typed.partition("=")[0], known)]
            guess = f" (did you mean {' or '.join(dict.fromkeys(close))}?)" if close else ""
            reporter.error(f"unrecognized arguments: {' '.join(unknown)}{guess}")
        return parsed


def _meant(typed: str, known: list[str]) -> list[str]:
    """The flags ``typed`` is probably a slip of: those it begins (an abbreviation, refused: see
    :class:`_Parser`), else the closest one."""
    started = [option for option in known if option.startswith(typed)]
    return started[:3] or difflib.get_close_matches(typed, known, n=1)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except _LaunchedArgumentError as exc:  # every rank has the same command line: rank 0 says what is wrong
        if _launch()[0] == 0:
            exc.parser.print_usage(sys.stderr)
        _report_error(exc.parser.prog, exc, str(exc), same_on_every_rank=True)
        _leave_launch(reported=True)
        return 2
    if args.command == "train":
        args.given = given_train_flags(argv)
    # An evaluation stopped by SIGTERM says where its finished episodes are, as after Ctrl-C
    # (rftgym train installs its own handler).
    previous = _stop_on_sigterm() if args.command == "eval" else None
    reported = False
    prog = f"rftgym {args.command}"
    try:
        with warnings.catch_warnings():
            if argv is None:  # run as a program (a caller of main() may be recording warnings: tests)
                warnings.showwarning = _show_warning
            _check_common(args)
            return args.func(args)
    except (UsageError, ConfigError, DataFormatError) as exc:  # bad input: arguments, options, data files
        reported = True
        _report_error(prog, exc, str(exc), same_on_every_rank=True)
        parser.exit(2)
    except RftgymError as exc:  # something else failed: a sandbox, a model, a server
        cause = exc.__cause__
        # An agent's or an env's own crash: where it was is the cause's traceback (a server that is
        # down or a sandbox that failed needs only the message).
        crash = isinstance(exc, (AgentError, EnvError)) and cause is not None and not isinstance(cause, RftgymError)
        reported = True
        _report_error(prog, exc, str(exc), same_on_every_rank=False,
                      details=(lambda: traceback.print_exception(cause, file=sys.stderr)) if crash else None)
        return 1
    except KeyboardInterrupt as stop:
        terminated = isinstance(stop, _Terminated)
        if not getattr(stop, "reported", False):  # the evaluation may have said what it kept
            print("terminated (SIGTERM)" if terminated else "interrupted", file=sys.stderr)
        return 143 if terminated else 130
    except BrokenPipeError:  # the reader of the output went away (e.g. `rftgym envs | head -1`): not an error
        # Python flushes stdout again at exit, into the closed pipe: point it at nothing first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports a command its pipe's reader left
    except Exception as exc:  # a crash: under a launcher reported once, like the errors above
        if _launch()[1] <= 1:
            raise
        reported = True
        _report_error(prog, exc, f"{type(exc).__name__}: {exc}", same_on_every_rank=False,
                      details=lambda: traceback.print_exception(exc, file=sys.stderr))
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if args.command == "train" or _launch()[1] > 1:
            _leave_launch(reported)


def _leave_launch(reported: bool) -> None:
    """End this process's part in a launcher's process group (or in one of one: FSDP); after an
    error report, once every rank has printed its part of it."""
    launched = _launch()[1] > 1
    if not launched and "torch.distributed" not in sys.modules:  # no process group without it: nothing to leave
        return
    from .train.distributed import leave_after_report, leave_process_group

    if reported and launched:
        leave_after_report()
    else:
        leave_process_group()


if __name__ == "__main__":
    sys.exit(main())
