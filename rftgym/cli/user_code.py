"""The user's own code that a command line names (``module:EnvId``, ``--agent module:name``, a
baseline's wrapper): imported with the current directory on the path, or found without importing."""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import os
import sys
import traceback


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


def _is_module_name(module: str) -> bool:
    """Whether ``module`` is a dotted module name (``pkg.sub``), not a file's path (``pkg/sub``,
    ``my_env.py``, ``../my_env``, ``.my_env``)."""
    return not module.endswith(".py") and all(part.isidentifier() for part in module.split("."))


def _module_name_for(path: str) -> str:
    """What to give instead of the file path ``path``: its module name, and where to run."""
    parts = [part for part in path.removesuffix(".py").replace("\\", "/").split("/") if part not in ("", ".")]
    if path.startswith("/") or ".." in parts or not parts:
        name, folder = (parts[-1] if parts else path).lstrip("."), os.path.dirname(os.path.abspath(path))
        return (f"give the module's name, {name!r}, as Python imports it, and run from {folder} (or put that folder on "
                "PYTHONPATH)")
    return f"give it as Python imports it, {'.'.join(parts).lstrip('.')!r}, from the directory that holds it"


class NotInModule(AttributeError):
    """The module of ``module:name`` was imported and has no ``name``."""


class NotModuleName(ValueError):
    """A name that is not of the form ``module:name``."""


def _load_object(path: str):
    """The object ``module:name`` names (an env's entry point, an agent, a baseline's wrapper)."""
    module_name, _, name = path.partition(":")
    if not module_name or not name:
        raise NotModuleName(f"{path!r} is not of the form 'module:name'")
    module = _import_users_module(module_name)
    try:
        return getattr(module, name)
    except AttributeError:
        names = [n for n in vars(module) if not n.startswith("_")]
        close = difflib.get_close_matches(name, names, n=1)
        where = getattr(module, "__file__", None)
        raise NotInModule(f"{module_name!r}{f' ({where})' if where else ''} has no {name!r}"
                          + (f" (did you mean {close[0]!r}?)" if close else "") + shadowing_note(module_name)) from None


def shadowing_note(module_name: str) -> str:
    """Where a file of ``module_name``'s name is here but the import found another module first
    (./code.py and the standard library's code: the current directory is searched last), a note
    saying so; else ''."""
    here = os.path.join(os.getcwd(), *module_name.split(".")) + ".py"
    where = getattr(sys.modules.get(module_name), "__file__", None)
    if not os.path.isfile(here) or (where is not None and os.path.realpath(where) == os.path.realpath(here)):
        return ""
    return f"; it is not {here}, which an import finds only after {where or 'that module'}: rename the file"


def load_failure(module: str, exc: BaseException, form: str = "module:name") -> str:
    """Why loading from ``module`` failed, and what to do, for a message. A module that is not
    there is told apart from one that was found and failed while it ran: for that one, the file and
    line where its error was raised (a syntax error names them itself)."""
    if isinstance(exc, NotInModule):
        return str(exc)
    if isinstance(exc, NotModuleName):
        return f"{exc}; give {form}"
    if not _is_module_name(module):
        return f"{module!r} is a file path, not a module name; {_module_name_for(module)}"
    if isinstance(exc, ModuleNotFoundError) and exc.name and (module + ".").startswith(exc.name + "."):
        return (f"no module {exc.name!r} is on the Python path (the current directory is searched too); give "
                f"{form} with a module on the Python path")
    if isinstance(exc, SyntaxError):
        return f"SyntaxError: {exc}; fix the module"
    frames = [frame for frame in traceback.extract_tb(exc.__traceback__)
              if not frame.filename.startswith("<") and "importlib" not in frame.filename]
    at = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        return f"importing it needs {exc.name!r}, which is not installed{f' (imported at {at})' if at else ''}; install it"
    return f"{type(exc).__name__}: {exc}{f', raised at {at}' if at else ''}; fix the module"
