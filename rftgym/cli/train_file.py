"""``rftgym train --config FILE``: TrainConfig settings from a JSON or YAML file, as TRL's and
verl's users keep them. Its keys are TrainConfig's fields (as a checkpoint's state.json holds
them under ``config``: ``learning_rate``, ``tasks_per_step``, ``env_kwargs``, ...); a flag given on
the command line wins over the file, and the file over the defaults. ``env_kwargs`` and
``eval_env_kwargs`` are merged with ``--env-arg`` and ``--eval-env-arg`` (the flags' pairs win)."""

from __future__ import annotations

import argparse
import difflib
import json
from pathlib import Path

from ..envs.common import same_env_id
from .common import UsageError
from .train_flags import AUTO_SWITCH, TRAIN_FLAGS

# Fields whose flag takes another spelling than the field's value: the file gives the value.
SWITCH_FIELDS = ("compile", "checkpoint_mlp")   # True / False / null, the flag's on / off / auto
OPTION_FIELDS = ("env_kwargs", "eval_env_kwargs")   # mappings, merged under the flags' KEY=VALUE pairs


def read_train_file(path: str) -> dict:
    """The settings in ``path`` (a mapping of TrainConfig fields), or a UsageError saying what is wrong."""
    from ..train import TrainConfig

    file = Path(path).expanduser()
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--config: cannot read {path} ({getattr(exc, 'strerror', None) or exc})") from None
    yaml_file = file.suffix.lower() in (".yaml", ".yml")
    try:
        if yaml_file:
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except ImportError:
        raise UsageError(f"--config: {path} is YAML, and PyYAML is not installed (pip install pyyaml), or give "
                         "the settings as JSON") from None
    except Exception as exc:   # json's and yaml's own errors: say where the file is malformed
        raise UsageError(f"--config: {path} is not valid {'YAML' if yaml_file else 'JSON'}: {exc}") from None
    if not isinstance(data, dict):
        raise UsageError(f"--config: {path} must hold a mapping of TrainConfig settings "
                         f"({{\"learning_rate\": 1e-6, ...}}), not {type(data).__name__}")
    known = set(TrainConfig.__dataclass_fields__)
    unknown = [key for key in data if key not in known]
    if unknown:
        hints = {key: difflib.get_close_matches(str(key), sorted(known), n=1) for key in unknown}
        shown = ", ".join(f"{key!r}" + (f" (did you mean {hints[key][0]!r}?)" if hints[key] else "") for key in unknown)
        raise UsageError(f"--config: {path} has keys that are no TrainConfig field: {shown}. Its keys are the fields "
                         "as checkpoint/state.json's 'config' holds them (learning_rate, not --lr)")
    for name in OPTION_FIELDS:
        if data.get(name) is not None and not isinstance(data[name], dict):
            raise UsageError(f"--config: {path}: {name} must be a mapping of env options, got {data[name]!r}")
    # YAML 1.1 (PyYAML) reads 1e-6 as a string (it wants 1.0e-6); a number field takes it as the number.
    for name, field in TrainConfig.__dataclass_fields__.items():
        if isinstance(data.get(name), str) and field.type in ("float", "float | None"):
            try:
                data[name] = float(data[name])
            except ValueError:
                pass   # refused by TrainConfig, naming the field
    return data


def apply_train_file(args: argparse.Namespace, settings: dict, given: set[str] | None) -> set[str]:
    """Put the file's settings into ``args`` where no flag was given (``given``: the fields whose
    flags were; None, for a namespace main() did not make: those whose flag's value is not its
    default), and return the fields the file set, which a resume then takes over the checkpoint's,
    as it takes given flags."""
    flag_fields = {field for _, field, _ in TRAIN_FLAGS}
    if given is None:   # (a namespace made without main(): a flag off its default counts as given)
        given = {field for _, field, options in TRAIN_FLAGS if getattr(args, field, None) != options.get("default")}
    if settings.get("env_id") is not None and not same_env_id(settings["env_id"], args.env):
        raise UsageError(f"--config: the file's env_id {settings['env_id']!r} is not the ENV given, {args.env!r}; "
                         "give the same env, or leave env_id out of the file")
    taken = set()
    for name, value in settings.items():
        if name == "env_id" or (name in given and name not in OPTION_FIELDS):
            continue
        if name in OPTION_FIELDS:
            setattr(args, f"config_{name}", dict(value or {}))
        elif name in SWITCH_FIELDS:
            switch = {value_: word for word, value_ in AUTO_SWITCH.items()}
            if value not in switch:
                raise UsageError(f"--config: {name} must be true, false or null (auto), got {value!r}")
            setattr(args, name, switch[value])
        elif name == "dtype":
            args.dtype = "auto" if value is None else value
        elif name in flag_fields or name in ("seed", "output_dir"):
            setattr(args, name, value)
        else:
            raise UsageError(f"--config: {name} is not set from the command line or a file")
        taken.add(name)
    return taken
