"""SIGTERM (a scheduler's or a launcher's stop) raised as an interrupt, so that a run stops the
way Ctrl-C stops it: its own cleanup, and a message saying what it kept."""

from __future__ import annotations

import signal


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
