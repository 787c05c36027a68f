"""Environments named on the command line: ``rftgym envs``'s list, finding an id (rftgym's,
another registered one, or ``module:EnvId``), ``--env-arg``, and making an env whose errors name
the option at fault."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import json
import re
import shlex
import sys
import types
from typing import Any, Sequence

import gymnasium as gym

from .. import envs as env_registry
from ..core.errors import ConfigError, EnvError, RftgymError
from ..core.spaces import ContextSpace
from ..core.values import a_type
from ..envs.common import env_entry_point
from .common import UsageError
from .user_code import _import_users_module, _load_object, load_failure, shadowing_note


# gymnasium.make's own parameters that no env can be given as an option (make(id, **options)
# takes the first for itself). Its max_episode_steps and disable_env_checker are options it applies.
GYM_MAKE_OWN = ("id",)


def _parse_env_args(pairs: Sequence[str], flag: str = "--env-arg") -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise UsageError(f"{flag} takes KEY=VALUE (e.g. {flag} max_attempts=2), got {pair!r}")
        key, raw = pair.split("=", 1)
        if not key.strip():
            raise UsageError(f"{flag} {pair!r} has no KEY before '='; give KEY=VALUE (e.g. {flag} max_attempts=2)")
        if key.strip() in GYM_MAKE_OWN:
            raise UsageError(f"{flag} {key.strip()}: {key.strip()!r} is gymnasium.make's own parameter (the "
                             "environment's id, which the ENV argument gives), so no environment can take an option "
                             "of that name; drop it (an env of your own needs another name for such an option)")
        if key.strip() in kwargs:  # the last one would win without a word
            raise UsageError(f"{flag} {key.strip()} is given twice; give each option once")
        if not raw:  # e.g. KEY=$UNSET: an empty string would quietly replace the option's default
            raise UsageError(f"{flag} {key.strip()}= has no value; give one, leave the option out for its default, "
                             f"or give {flag} {key.strip()}='\"\"' for an empty string")
        try:
            kwargs[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            kwargs[key.strip()] = raw  # a bare string such as a path
        except RecursionError:
            raise UsageError(f"{flag} {key.strip()}=...: its JSON value nests too deeply to read") from None
    return kwargs


def env_arg_pair(key: str, value: Any) -> str:
    """``KEY=VALUE`` as :func:`_parse_env_args` reads ``value`` back, quoted for a shell: JSON, but a
    string bare unless it would read as JSON (``"3"``: the string 3)."""
    text = json.dumps(value, separators=(",", ":"))
    if isinstance(value, str):
        try:
            json.loads(value)
        except ValueError:
            text = value
    return shlex.quote(f"{key}={text}")


def _env_spec(env_id: str):
    """The Gymnasium spec of ``env_id``: one of rftgym's, another registered env, or ``module:EnvId``
    (Gymnasium's form: the module is imported first, and registers the env)."""
    module, _, bare = env_id.rpartition(":")
    if module:
        try:
            _import_users_module(module)
        except Exception as exc:  # noqa: BLE001 (the user's module may raise anything while importing)
            raise UsageError(f"environment {env_id!r}: cannot import {module!r}: "
                             f"{load_failure(module, exc, form='module:EnvId')}") from None
    if bare not in gym.registry:
        # An id that only the user's module registers is found only through it: the hint keeps the module.
        close = [known if known in env_registry.ENVS or not module else f"{module}:{known}"
                 for known in _close_env_ids(bare)]
        guess = f" (did you mean {' or '.join(filter(None, [', '.join(close[:-1]), close[-1]]))}?)" if close else ""
        own = ""
        if module:
            registered = _ids_registered_by(module)
            own = f"; the environments of {module}: {', '.join(f'{module}:{i}' for i in registered)}" if registered \
                else f"; no registered environment's entry point is in {module}{shadowing_note(module)}"
        raise UsageError(f"unknown environment {env_id!r}{guess}{own}; rftgym's environments: "
                         f"{', '.join(env_registry.env_ids())} (your own: module:EnvId, where importing module "
                         "registers EnvId with gymnasium.register)")
    spec = gym.spec(bare)
    if isinstance(spec.entry_point, str):
        try:
            _load_object(spec.entry_point)
        except Exception as exc:  # noqa: BLE001 (importing the entry point's module runs the user's code)
            raise UsageError(f"environment {env_id!r}: its entry point {spec.entry_point!r} cannot be loaded: "
                             f"{load_failure(spec.entry_point.partition(':')[0], exc, form='module:Class')}") from None
    return spec


def _ids_registered_by(module: str) -> list[str]:
    """The ids in Gymnasium's registry whose entry point is in ``module`` (or a module inside it)."""
    def home(entry_point) -> str:
        return entry_point.partition(":")[0] if isinstance(entry_point, str) else \
            getattr(entry_point, "__module__", "") or ""
    return sorted(env_id for env_id, spec in gym.registry.items()
                  if home(spec.entry_point) == module or home(spec.entry_point).startswith(module + "."))


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


def _make_env(env_id: str, kwargs: dict[str, Any], flag: str = "--env-arg",
              sources: dict[str, str] | None = None) -> gym.Env:
    """The env ``kwargs`` make, its errors naming ``flag`` (the flag that gave the options), or for
    an option ``sources`` names, where that one came from (a --config file, a checkpoint)."""
    def source(key: str | None) -> str:
        return (sources or {}).get(key, flag)

    _env_spec(env_id)
    # gymnasium's own make() options, checked here: its errors are not about the env.
    steps = kwargs.get("max_episode_steps")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise UsageError(f"{flag} max_episode_steps must be a positive int (gymnasium's step limit), got {steps!r}")
    try:
        env = gym.make(env_id, **kwargs)
    except TypeError as exc:
        unknown = re.search(r"unexpected keyword argument '([^']+)'", str(exc))
        if unknown is None:  # a type error inside the env (e.g. from a data file), not an unknown option
            raise UsageError(f"{env_id} could not be made: {str(exc).split(' was raised from')[0]}. Check the "
                             f"{flag} values and the data files they name") from exc
        names = _env_option_names(env_id)
        # render_mode reaches the env's constructor (gymnasium checks it against the env's modes).
        modes = _env_class(env_id).metadata.get("render_modes") or []
        if modes and "render_mode" not in names:
            names = [*names, f"render_mode ({' or '.join(map(str, modes))})"]
        candidates = [name.split(" ")[0] for name in names] + ["max_episode_steps"]
        close = difflib.get_close_matches(unknown.group(1), candidates, n=1, cutoff=0.75)
        guess = f" (did you mean {close[0]!r}?)" if close else ""
        valid = f"Valid options: {', '.join(names)}" if names else "It takes no options of its own"
        where = source(unknown.group(1))
        raise UsageError(f"bad {where if where.startswith('--') else f'option in {where}'} for {env_id}: unknown "
                         f"option {unknown.group(1)!r}{guess}. {valid} (and gymnasium's max_episode_steps)") from exc
    except ConfigError as exc:  # (after TypeError: an unknown option is both)
        named = {key: kwargs[key] for key in exc.fields if key in kwargs}  # the option it names, if it says
        # (a flag's values are read as JSON: a file's or a checkpoint's are JSON's own)
        hint = _json_reading_hint({k: v for k, v in (named or kwargs).items() if source(k) == flag}, str(exc), flag)
        # where the option the message starts with came from ("dataset must be one of ...")
        given = next((key for key in kwargs if str(exc).startswith(f"{key} ")), None)
        if hint is None and given is None:
            raise
        said = f"{source(given)} {given}: {exc}" if given is not None else str(exc)
        raise ConfigError(said + (f" ({hint})" if hint else ""), field=exc.fields) from exc
    except RftgymError:
        raise
    except Exception as exc:  # noqa: BLE001 (an env's constructor, the user's code, may raise anything)
        raise EnvError(f"{env_id} could not be made: its constructor raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(env.observation_space, ContextSpace):  # found now, not at the first reset after a model loads
        space = env.observation_space
        env.close()
        raise UsageError(f"{env_id} is not an rftgym environment: its observation space is {a_type(space)}, "
                         "where an rftgym env's observation is the chat context (observation_space "
                         "rftgym.core.spaces.ContextSpace, actions AssistantText). rftgym's own: "
                         f"{', '.join(env_registry.env_ids())}; for an env of your own, see 'Your own env and agent' "
                         "in the README")
    return env


def _json_reading_hint(kwargs: dict[str, Any], message: str, flag: str = "--env-arg") -> str | None:
    """How to write the value an env refused (``message`` names its option), when reading
    ``flag``'s values as JSON is what went wrong: ``42`` meant as a string, ``1,2`` as a list."""
    for key, value in kwargs.items():
        if not re.search(rf"\b{re.escape(key)}\b", message):
            continue
        if isinstance(value, (bool, int, float, list, dict, type(None))) and "string" in message:  # (JSON's)
            return (f"{flag} values are read as JSON, so {key}={json.dumps(value)} is not a string; for the "
                    f"string give {flag} {key}='{json.dumps(json.dumps(value))}'")
        if isinstance(value, str) and "," in value and any(word in message for word in ("list", "subset", "tuple")):
            items = []
            for item in value.split(","):
                try:
                    items.append(json.loads(item))
                except json.JSONDecodeError:
                    items.append(item.strip())
            return f"{flag} values are read as JSON; for a list give {flag} {key}='{json.dumps(items)}'"
    return None


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


def _env_class(env_id: str):
    """The env's class, for its metadata (eval columns and baselines), without making an env; an
    entry point without metadata (e.g. a factory function) reads as empty metadata."""
    _env_spec(env_id)  # what cannot be found or imported, named as a usage error
    found = env_entry_point(env_id)
    return found if isinstance(getattr(found, "metadata", None), dict) else types.SimpleNamespace(metadata={})


def cmd_envs(args: argparse.Namespace) -> int:
    from ..rollout.metrics import format_table

    print(format_table([(env_id, desc) for env_id, (_, desc) in env_registry.ENVS.items()], ["id", "description"]))
    return 0
