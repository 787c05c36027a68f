"""SIGTERM (a scheduler's or a launcher's stop) and SIGHUP (the terminal closed, e.g. an ssh
session that dropped) raised as interrupts, so that a run stops the way Ctrl-C stops it: its own
cleanup (a training run saves its finished steps), and a message saying what it kept."""

from __future__ import annotations

import signal

from ..train.stopping import say  # noqa: F401 (the CLI's messages after a stop: the terminal may be gone)

# SIGHUP only where it ends the process now (its default): under nohup it is ignored, and stays so.
_HANDLED = ((signal.SIGTERM, False),) + (((signal.SIGHUP, True),) if hasattr(signal, "SIGHUP") else ())


class _Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where the run is, like Ctrl-C."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__()
        self.signum = signum


def stop_reason(stop: KeyboardInterrupt) -> tuple[str, int]:
    """How a run was stopped, in words, and the exit status a shell reports for it (128 + signal)."""
    if not isinstance(stop, _Terminated):
        return "interrupted", 128 + signal.SIGINT
    if hasattr(signal, "SIGHUP") and stop.signum == signal.SIGHUP:
        return "hung up (SIGHUP)", 128 + stop.signum
    return "terminated (SIGTERM)", 128 + stop.signum


def _stop_on_sigterm() -> dict:
    """Make SIGTERM and SIGHUP stop a run the way Ctrl-C does (the run's own cleanup, then a
    message naming what it kept) instead of ending the process at once. Returns the handlers it
    replaced, for :func:`_restore_handlers`; none where handlers cannot be set (not the main
    thread)."""
    def terminated(signum, frame):
        raise _Terminated(signum)

    replaced = {}
    for signum, only_if_default in _HANDLED:
        try:
            if only_if_default and signal.getsignal(signum) is not signal.SIG_DFL:
                continue
            replaced[signum] = signal.signal(signum, terminated)
        except ValueError:  # signal only works in the main thread
            break
    return replaced


def _restore_handlers(replaced: dict) -> None:
    for signum, handler in replaced.items():
        signal.signal(signum, handler)
