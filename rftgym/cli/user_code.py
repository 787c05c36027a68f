"""The user's own code that a command line names (``module:EnvId``, ``--agent module:name``, a
baseline's wrapper): imported with the current directory on the path, or found without importing."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys


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
