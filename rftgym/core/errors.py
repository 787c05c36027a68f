"""Typed errors for broken infrastructure.

A bad *action* is never an exception in rftgym: it becomes an observation plus an ``info`` flag.
These errors are for things a person has to fix (a config, a data file, a missing package, a
server that is down), and every message says what to do next.
"""

from __future__ import annotations


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
    """An agent could not produce a reply for infrastructure reasons (not bad text)."""


class ChatAPIError(AgentError):
    """An OpenAI-compatible server failed, timed out or answered in an unexpected shape."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class EnvContractError(RftgymError, RuntimeError):
    """An environment returned something the protocol does not allow (e.g. a reward that is not
    a finite number, an observation that is not a Context): a bug in the env to fix."""


class EnvError(RftgymError, RuntimeError):
    """An environment raised an exception of its own from ``reset`` or ``step``; the message names
    the env, the seed and the turn, and the original exception is the cause."""


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
