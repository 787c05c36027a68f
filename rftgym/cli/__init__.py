"""The ``rftgym`` command: list environments, play one by hand, evaluate an agent.

One module a concern: :mod:`.parser` (the arguments), a module for each command (:mod:`.environments`
for ``envs``, :mod:`.play`, :mod:`.evaluate`, :mod:`.train`, :mod:`.export`, :mod:`.serve_retriever`),
and what they share (:mod:`.common`, :mod:`.agents`, :mod:`.user_code`, :mod:`.eval_output`,
:mod:`.sigterm`, :mod:`.launcher`). :func:`main` runs a command and reports its errors."""

from __future__ import annotations

import errno
import os
import sys
import traceback
import warnings
from typing import Sequence

from ..core.errors import AgentError, ConfigError, DataFormatError, EnvError, RftgymError
from .common import UsageError, _check_common
from .launcher import _launch, _leave_launch, _report_error
from .parser import _LaunchedArgumentError, build_parser, given_train_flags
from .sigterm import _restore_handlers, _stop_on_sigterm, say, stop_reason
from .train import train_config_from_args
from .train_flags import TRAIN_FLAGS

__all__ = ["TRAIN_FLAGS", "UsageError", "build_parser", "given_train_flags", "main", "train_config_from_args"]


_SHOWN_WARNINGS: set[str] = set()


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as one line, without the source line it came from (library code, of no use to a
    command's user), written between progress-bar updates rather than into the bar; once, however
    many envs of a command meet the same problem (the one made to check the options, those of the
    rollout)."""
    from tqdm import tqdm

    text = f"{category.__name__}: {message}"
    if text not in _SHOWN_WARNINGS:
        _SHOWN_WARNINGS.add(text)
        tqdm.write(text, file=sys.stderr)


FULL_DEVICE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _report_full_device(prog: str, exc: OSError) -> int:
    """A write that found no room (``rftgym envs > /dev/full``, a full disk): said in one line."""
    try:
        sys.stdout.flush()
    except OSError:  # stdout itself is full: Python flushes it again at exit, so point it at nothing
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    where = f" to {exc.filename}" if exc.filename else " (its output, or a file it writes)"
    _report_error(prog, exc, f"could not write{where}: {exc.strerror}; free some space, or write elsewhere, and "
                  "run it again", same_on_every_rank=False)
    return 1


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
    # An evaluation stopped by SIGTERM or SIGHUP says where its finished episodes are, as after
    # Ctrl-C (rftgym train installs its own handlers).
    replaced = _stop_on_sigterm() if args.command == "eval" else {}
    reported = False
    prog = f"rftgym {args.command}"
    try:
        with warnings.catch_warnings():
            if argv is None:  # run as a program (a caller of main() may be recording warnings: tests)
                warnings.showwarning = _show_warning
            _check_common(args)
            code = args.func(args)
            # Output to a file is buffered: a write that fails (a full disk) fails here, where it is
            # reported, rather than as Python exits.
            sys.stdout.flush()
            return code
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
        how, code = stop_reason(stop)
        if not getattr(stop, "reported", False):  # the evaluation may have said what it kept
            say(how)
        return code
    except BrokenPipeError:  # the reader of the output went away (e.g. `rftgym envs | head -1`): not an error
        # Python flushes stdout again at exit, into the closed pipe: point it at nothing first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports a command its pipe's reader left
    except Exception as exc:  # a crash: under a launcher reported once, like the errors above
        if isinstance(exc, OSError) and exc.errno in FULL_DEVICE:  # the machine's state, not a bug
            reported = True
            return _report_full_device(prog, exc)
        if _launch()[1] <= 1:
            raise
        reported = True
        _report_error(prog, exc, f"{type(exc).__name__}: {exc}", same_on_every_rank=False,
                      details=lambda crash=exc: traceback.print_exception(crash, file=sys.stderr))
        return 1
    finally:
        _restore_handlers(replaced)
        if args.command == "train" or _launch()[1] > 1:
            _leave_launch(reported)
