"""What several commands share: the usage error, a flag's JSON object, a config error named by
its flag, the --model check, and the checks of the arguments every command gets wrong alike."""

from __future__ import annotations

import argparse
import json
import os
import re

from ..core.errors import ConfigError, ModelLoadError
from ..core.files import unexpanded_path
from ..core.values import checked_megabytes


class UsageError(Exception):
    """A bad command-line argument; printed as 'error: …' with exit status 2."""


def _json_object(text: str | None, flag: str) -> dict | None:
    """A flag's JSON object (None when the flag is not given)."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"{flag}: not valid JSON ({exc}); give an object, e.g. {flag} '{{\"top_k\": 20}}'") from None
    except RecursionError:
        raise UsageError(f"{flag}: its JSON nests too deeply to read; give a flat object, e.g. {flag} "
                         "'{\"top_k\": 20}'") from None
    if not isinstance(value, dict):
        raise UsageError(f"{flag}: give a JSON object, e.g. {flag} '{{\"top_k\": 20}}', not {type(value).__name__}")
    return value


def _flagged(exc: ConfigError, flags: dict[str, str]) -> UsageError | None:
    """``exc`` as a usage error that starts with the flag(s) behind its config field(s), or None
    when it names no field that a flag sets. Inside the message, a field with a flag is named by
    its flag ("drop --lora-alpha", not "drop lora_alpha"): what the user typed. Only names with
    an underscore are rewritten, as those are no English word ("steps" stays as it is)."""
    named = [flags[field] for field in exc.fields if field in flags]
    if not named:
        return None
    said = str(exc)
    for field, flag in flags.items():
        if "_" in field and flag.startswith("--"):
            # A word of its own: not part of a path, a quoted value or a dotted name.
            said = re.sub(rf"(?<![\w.\-/'\"{{]){re.escape(field)}(?![\w\-/'\"])", flag, said)
    if re.match(rf"(?:{'|'.join(map(re.escape, named))})(?![\w\-])", said):  # "--lr must be positive"
        return UsageError(said)
    first = next((field for field in exc.fields if field in flags and said.startswith(f"{field} ")), None)
    if first is not None:  # "steps must be ...": "--steps must be ...", not "--steps: steps must be ..."
        return UsageError(flags[first] + said[len(first):])
    return UsageError(f"{' / '.join(dict.fromkeys(named))}: {said}")


def _check_model_dir(model: str | None, flag: str = "--model") -> None:
    """A --model (or ``flag``) that is not a local model directory, or a training run's directory
    whose checkpoint is damaged, is a usage error, found before any other work (the default model
    is checked where it loads: finding it may convert its weights)."""
    from ..agents.model_loading import check_trained_run, names_default_model, resolve_model_dir
    from ..train.run_dir import is_run_dir

    if names_default_model(model):
        return
    try:
        path = resolve_model_dir(model)
        if is_run_dir(path):
            check_trained_run(path)
    except ModelLoadError as exc:
        raise UsageError(f"{flag}: {exc}") from None


def check_seed_range(seed: int, episodes: int, episodes_said: str) -> None:
    """Episode k runs seed + k: the last must be a seed (below 2^63). ``episodes_said``: how the
    message names the number of episodes (the flag, or an env's default)."""
    if seed + episodes > 2**63:
        raise UsageError(f"--seed {seed} with {episodes_said} would run seeds past 2^63 - 1; give a --seed of at most "
                         f"{2**63 - episodes}")


def _check_common(args: argparse.Namespace) -> None:
    """Arguments every command that has them gets wrong the same way; refused before any work."""
    for flag in ("seed", "sample_seed"):
        seed = getattr(args, flag, 0)
        if seed is not None and not 0 <= seed < 2**63:
            raise UsageError(f"--{flag.replace('_', '-')} must be in [0, 2^63), got {seed}")
    device = getattr(args, "device", None)
    local_only = [flag for flag, given in (("--device", device),
                                           ("--prefix-cache-mb", getattr(args, "prefix_cache_mb", None) is not None))
                  if given]
    if local_only and getattr(args, "agent", None) not in (None, "default", "hf"):
        flags = " and ".join(local_only)
        raise UsageError(f"{flags} {'is' if len(local_only) == 1 else 'are'} read by the local models (--agent default "
                         f"or hf) only, and this run's agent is {args.agent}; drop {flags}")
    if getattr(args, "prefix_cache_mb", None) is not None:
        try:
            checked_megabytes(args.prefix_cache_mb, "--prefix-cache-mb", "turns prefix reuse off")
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
    if device:
        from ..core.devices import device_problem

        problem = device_problem(device)
        if problem is not None:
            raise UsageError(f"--device {device}: {problem}")
    exporting = getattr(args, "command", None) == "export"  # (its OUT is positional, and it expands '~')
    for name, flag in (("out", "OUT" if exporting else "--out"), ("output_dir", "--output-dir")):
        value = getattr(args, name, None)
        if value is not None and not value.strip():  # would quietly mean the default path
            raise UsageError(f"{flag} is empty; give a path" + ("" if exporting else
                                                                 f", or leave {flag} out for the default under runs/"))
        if value is not None and unexpanded_path(os.path.expanduser(value) if exporting else value):
            apart = f", or write the flag and the path apart ({flag} ~/x)" if value.startswith("~") else ""
            raise UsageError(f"{flag} {unexpanded_path(value)}{apart}")
    episodes = getattr(args, "episodes", None)
    if episodes is not None and episodes < 1:
        raise UsageError(f"--episodes must be at least 1, got {episodes}")
    seed = getattr(args, "seed", None)
    if episodes is not None and seed is not None:
        check_seed_range(seed, episodes, f"--episodes {episodes}")
