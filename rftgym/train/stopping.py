"""How a training run stops on Ctrl-C (and on SIGTERM or SIGHUP, which the CLI raises as
interrupts too): never with a half-written checkpoint, and keeping the steps it finished.

A step has two parts. Until its update starts, the weights and the optimizer are still those of
the step before, so a stop there can save them as they are (with the random states the step
began with: a resumed run then draws what the uninterrupted one would have), and so can an error
there (a rollout whose env or server failed): ``--resume`` then goes on from that step. From
the update on they change, so a stop is held until the step is done and saved; a second stop
ends the run at once, without the steps since the last checkpoint. The ranks of a launch stop together at the end of either part
instead (:class:`LaunchStops`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

# The signals that stop a run the way Ctrl-C does. Only a callable handler is replaced (Python's
# own for SIGINT, the CLI's for SIGTERM and SIGHUP): an ignored signal (nohup) stays ignored and
# a default one (a script calling train() with SIGTERM unhandled) still ends the process.
STOPPING_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


def say(text: str) -> None:
    """``text`` on stderr, where there is still somewhere to say it."""
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # no terminal to say it on (hung up, closed, stderr shut): stop all the same
        pass


@contextlib.contextmanager
def held_stops(notice: str, *, second_stops_now: bool) -> Iterator[list[int]]:
    """Hold a stop that arrives inside the block. Yields the list of held signals, which the
    block may read; when it ends without an error, a held stop is raised as it would have been
    (by the handler it replaced). With ``second_stops_now`` a second signal is raised at once.
    ``notice`` is said (on stderr) when the first one arrives. Only the main thread receives
    signals; elsewhere nothing is held."""
    held: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield held
        return
    previous: dict[int, Callable] = {}

    def hold(signum, frame):
        if held and second_stops_now:
            previous[signum](signum, frame)  # raises: the run stops here
        if not held and frame is not None:  # (None: handed on by an inner block, which said what it does)
            say(notice)
        held.append(signum)

    try:
        for signum in STOPPING_SIGNALS:
            handler = signal.getsignal(signum)
            if callable(handler):
                previous[signum] = signal.signal(signum, hold)
        yield held
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if held:
        # Stops now, as it would have then. The frame None tells an enclosing block's hold (a
        # checkpoint written at a step's end) that this stop was announced already: the step it
        # would announce ("stopping once this step is done") is done.
        previous[held[0]](held[0], None)


@contextlib.contextmanager
def keeping_finished_steps(keep: Callable[[], None], enabled: bool,
                           raised_together: Callable[[BaseException], bool] | None = None) -> Iterator[None]:
    """Before a step's update: a stop or an error inside the block first calls ``keep()`` (which
    saves the steps done so far: the weights are still theirs), then goes on. ``enabled`` False (a
    launch of several ranks, which would each stop at another point of the step): it just goes on,
    but for an error that ``raised_together`` says every rank raised at the same point (a failed
    rollout, which the ranks agree on), where all of them keep the finished steps together."""
    try:
        yield
    except KeyboardInterrupt:
        if enabled:
            with held_stops("rftgym train: saving the finished steps, then stopping", second_stops_now=False):
                keep()
        raise
    except Exception as exc:
        if enabled or (raised_together is not None and raised_together(exc)):
            _keep_after_an_error(keep)
        raise


def _keep_after_an_error(keep: Callable[[], None]) -> None:
    """``keep()`` (it saves the finished steps, and says what it saves) after a step's error, which
    stays the one reported: a failure to save is only said."""
    try:
        with held_stops("rftgym train: saving the finished steps, then stopping", second_stops_now=False):
            keep()
    except Exception as save_error:
        say(f"rftgym train: the finished steps could not be saved after this step's error "
            f"({type(save_error).__name__}: {save_error})")


@contextlib.contextmanager
def finishing_the_step(keep: Callable[[], None], enabled: bool, lost: str = "this step") -> Iterator[None]:
    """From a step's update to its end: a stop is held until the block is done, then ``keep()``
    saves the step and the stop goes on. A second stop ends the run at once, without the steps
    since the last checkpoint, which ``lost`` names ("steps 3 to 5") for the notice."""
    if not enabled:
        yield
        return
    with held_stops("rftgym train: stopping once this step is done and saved (its update, metrics and "
                    f"checkpoint); interrupt again to stop now without saving, losing {lost}",
                    second_stops_now=True) as held:
        yield
        if held:
            keep()


# A launcher forwards a terminal's Ctrl-C (and a scheduler's SIGTERM) to ranks that got it
# already: a second stop within this many seconds of the first is the same stop, not a second one.
SAME_STOP_S = 5.0


class LaunchStops:
    """How the ranks of a launch (torchrun, accelerate launch) stop together and keep their
    finished steps. A stop reaches each rank at another point of its step (one in its rollout,
    another waiting for it in a collective), or one rank only, so none may act on it alone:
    inside :meth:`noting` a stop is only noted, and at the points of the step every rank
    reaches (:meth:`stop_if_asked`: after the rollout, and at the step's end) the ranks ask each
    other whether any was stopped; if one was, all keep the finished steps there (a collective
    checkpoint) and stop together. A second stop more than :data:`SAME_STOP_S` after the first
    ends that rank's process at once, without saving (exit status 128 + the signal's
    number). The launcher's own grace period (torchrun's
    ``--shutdown-timeout``, 30 s by default) ends ranks that take longer to reach such a point;
    the last checkpoint then stays. For one process (``enabled`` False) nothing is done here:
    :func:`keeping_finished_steps` and :func:`finishing_the_step` stop it where it is."""

    def __init__(self, ranks, enabled: bool):
        self.ranks, self.enabled = ranks, enabled
        self.noted: list[tuple[int, float]] = []  # (signal, when) of the stops this rank received
        self._previous: dict[int, Callable] = {}

    @contextlib.contextmanager
    def noting(self) -> Iterator[None]:
        if not self.enabled or threading.current_thread() is not threading.main_thread():
            yield
            return

        def note(signum, frame):
            now = time.monotonic()
            if self.noted and now - self.noted[0][1] > SAME_STOP_S:
                # At once: an exception would go through the process group's goodbyes, which wait
                # on peers still inside a collective with this rank (for the group's timeout, half an
                # hour on CPU). The launcher sees the rank gone and ends the others.
                say(f"rftgym train: rank {getattr(self.ranks, 'rank', 0)}: stopped at once (a second stop); the "
                    "steps since the last checkpoint are lost")
                os._exit(128 + signum)
            if not self.noted and self.ranks.is_main:
                say("rftgym train: stopping every rank once they reach the end of this step's rollout or of the "
                    f"step, with the finished steps saved; interrupt again, {SAME_STOP_S:g} s or more from now, to "
                    "stop at once without them")
            self.noted.append((signum, now))

        try:
            for signum in STOPPING_SIGNALS:
                handler = signal.getsignal(signum)
                if callable(handler):
                    self._previous[signum] = signal.signal(signum, note)
            yield
        finally:
            for signum, handler in self._previous.items():
                signal.signal(signum, handler)
            self._previous = {}

    def stop_if_asked(self, keep: Callable[[], None]) -> None:
        """Where every rank is: when any rank was stopped, ``keep()`` (on every rank: it saves the
        finished steps together), then stop, each rank as its own handler of that signal stops
        (the CLI's exit status tells a SIGTERM from a Ctrl-C)."""
        if not self.enabled:
            return
        signum = self.ranks.max_int(self.noted[0][0] if self.noted else 0)  # one collective
        if not signum:
            return
        keep()
        handler = self._previous.get(signum)
        if handler is None:  # not the main thread, or a signal this rank does not stop on
            raise KeyboardInterrupt
        handler(signum, None)
        raise KeyboardInterrupt  # (a handler that returned)
