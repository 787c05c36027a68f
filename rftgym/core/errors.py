"""Typed errors for broken infrastructure.

A bad *action* is never an exception in rftgym: it becomes an observation plus an ``info`` flag.
These errors are for things a person has to fix (a config, a data file, a missing package, a
server that is down), and every message says what to do next. :func:`warn_caller` warns of what
is not an error, at the user's own line.
"""

from __future__ import annotations

import os
import sys
import warnings

# Where rftgym's own code lives (as its modules' co_filename spell it: the same sys.path entry).
PACKAGE_DIR = os.path.dirname(os.path.dirname(__file__)) + os.sep


class RftgymError(Exception):
    """Base class of every error rftgym raises on purpose."""


class ConfigError(RftgymError, ValueError):
    """A configuration value is invalid; the message names the field and what is allowed.

    ``field`` names the config field(s) at fault (a name or a tuple of names; ``fields`` is always
    the tuple), so that a front end can point at its own spelling of them (a CLI flag, a config
    file key) without reading the message.
    """

    def __init__(self, message: str, *, field: str | tuple[str, ...] | None = None):
        super().__init__(message)
        self.fields: tuple[str, ...] = (field,) if isinstance(field, str) else tuple(field or ())


class DataFormatError(RftgymError, ValueError):
    """A data file does not have the documented format; the message names the file and line."""


class MissingDependencyError(RftgymError, ImportError):
    """An optional dependency is not installed; the message names the extra to install."""

    def __init__(self, package: str, extra: str, purpose: str):
        super().__init__(
            f"{purpose} needs the '{package}' package, which is not installed. "
            f"Install it with: pip install 'rftgym[{extra}]'"
        )
        self.package = package
        self.extra = extra


class ModelLoadError(RftgymError, RuntimeError):
    """A model or tokenizer could not be loaded from local files."""


class AgentError(RftgymError, RuntimeError):
    """An agent could not produce a reply for infrastructure reasons (not bad text).

    Raised out of :func:`rftgym.rollout.run_episodes`, it carries the episodes finished before it:
    ``finished_episodes``, a list of :class:`~rftgym.core.records.Episode` in the order of
    ``seeds`` (not the order they finished; possibly empty), and ``finished_indices``, their
    positions in ``seeds`` (ascending, one per episode). run_episodes sets both; raised anywhere
    else, it has neither.
    """


class ChatAPIError(AgentError):
    """An OpenAI-compatible server failed, timed out or answered in an unexpected shape."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class EnvContractError(RftgymError, RuntimeError):
    """An environment returned something the protocol does not allow (e.g. a reward that is not
    a finite number, an observation that is not a Context): a bug in the env to fix.

    Raised out of :func:`rftgym.rollout.run_episodes`, it carries the episodes finished before it:
    ``finished_episodes``, a list of :class:`~rftgym.core.records.Episode` in the order of
    ``seeds`` (not the order they finished; possibly empty), and ``finished_indices``, their
    positions in ``seeds`` (ascending, one per episode). run_episodes sets both; raised anywhere
    else, it has neither.
    """


class EnvError(RftgymError, RuntimeError):
    """An environment raised an exception of its own from ``reset`` or ``step``; the message names
    the env, the seed and the turn, and the original exception is the cause. An env whose
    ``close`` fails after the last episode raises one too, carrying every episode.

    Raised out of :func:`rftgym.rollout.run_episodes`, it carries the episodes finished before it:
    ``finished_episodes``, a list of :class:`~rftgym.core.records.Episode` in the order of
    ``seeds`` (not the order they finished; possibly empty), and ``finished_indices``, their
    positions in ``seeds`` (ascending, one per episode). run_episodes sets both; raised anywhere
    else, it has neither.
    """


class TrainingError(RftgymError, RuntimeError):
    """A training run cannot go on: its update diverged, or its outputs cannot be written."""


class TokenizationError(RftgymError, RuntimeError):
    """A chat template does not render contexts as a sequence of per-message spans."""


def require(module: str, extra: str, purpose: str):
    """Import an optional dependency lazily, or raise an error that names the extra."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(module.split(".")[0], extra, purpose) from exc


def warn_caller(message: str, category: type[Warning] = UserWarning, also_skipping: tuple[str, ...] = ()) -> None:
    """``warnings.warn`` at the first frame outside rftgym and gymnasium (whose ``make`` and
    wrappers call an env's ``__init__``, ``reset`` and ``step``), and outside the directories
    ``also_skipping`` names (e.g. torch's, for code that autograd calls): the user's line that led
    here (a call of ``gym.make``, of a policy's ``generate`` or ``act``, of ``run_episodes``, of
    ``train``), however many frames lie between. A fixed ``stacklevel`` is right for one way in
    only: the same warning reached through the rollout engine would name a line of rftgym's own."""
    skipped = (PACKAGE_DIR, *_gymnasium_dir(), *also_skipping)
    if sys.version_info >= (3, 12):
        warnings.warn(message, category, skip_file_prefixes=skipped)
    else:
        warnings.warn(message, category, stacklevel=_stacklevel_outside(skipped))


def _gymnasium_dir() -> tuple[str, ...]:
    """Gymnasium's directory once it is imported (rftgym's service and retrievers run without it)."""
    module = sys.modules.get("gymnasium")
    return (os.path.dirname(module.__file__) + os.sep,) if module is not None and module.__file__ else ()


def _stacklevel_outside(prefixes: tuple[str, ...]) -> int:
    """The ``stacklevel`` that makes a ``warnings.warn`` in the caller of this function name the
    first frame outside ``prefixes`` (the outermost frame if there is none), as
    ``skip_file_prefixes`` does on Python 3.12+. Frames of importlib's bootstrap are passed
    uncounted, as ``warnings`` passes them."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and (frame.f_code.co_filename.startswith(prefixes) or _importing(frame)):
        frame = frame.f_back
        level += not _importing(frame)
    return level


def _importing(frame) -> bool:
    name = frame.f_code.co_filename
    return "importlib" in name and "_bootstrap" in name
