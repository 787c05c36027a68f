"""Copies of an env in the middle of an episode.

``copy.deepcopy(env)`` branches an episode: tree search over an agent's turns (MCTS as in
O1-CODER), or trying several replies from one state. The copy continues from the same context,
counters and random state, and from then on the two are independent. What an env builds once and
never changes (its config, corpus, generated world, dataset, observation spaces) is shared, not
copied; so are its expensive resources, a retriever's index or a code sandbox: each copy holds a
share, and the resource is closed when the last env holding it is closed, whichever that is.

``pickle`` sends an env, mid-episode too, to another process (a worker pool): there the resources
are made afresh from the config (an index is built again, a sandbox share taken in that process).
"""

from __future__ import annotations

import copy
import threading
import weakref
from typing import Any


class SharedResource:
    """A resource (anything with ``close()``) used by an env and its copies: each holds a share
    (:meth:`hold`), and giving back the last share closes it."""

    def __init__(self, resource: Any):
        self.resource = resource
        self._shares = 1
        self._lock = threading.Lock()

    def take(self) -> "SharedResource":
        with self._lock:
            if self._shares == 0:
                raise RuntimeError(f"{type(self.resource).__name__} is closed: an env closed before it was copied "
                                   "cannot be copied; copy it before closing it")
            self._shares += 1
        return self

    def release(self) -> None:
        with self._lock:
            self._shares -= 1
            last = self._shares == 0
        if last:
            self.resource.close()

    @property
    def open(self) -> bool:
        return self._shares > 0

    def hold(self, env: Any, take: bool = True) -> weakref.finalize:
        """A share for ``env`` (``take=False``: the first one, made with this object), given back
        by calling what this returns (once; later calls do nothing) or when ``env`` is garbage
        collected unclosed, as a dropped branch of a tree search is."""
        if take:
            self.take()
        return weakref.finalize(env, self.release)


class CopyableEnv:
    """Mixin giving an env ``copy.deepcopy`` and ``pickle`` support (see the module docstring).

    An env lists in ``shared_attributes`` what it never changes after ``__init__`` (shared by a
    copy, pickled as is; not its spaces, which hold a random generator of their own) and in ``resource_attributes`` what holds a process resource (left out
    of a pickle). ``_share_resources(clone)`` gives a deep copy its shares; ``_open_resources()``
    makes the resources again after unpickling."""

    shared_attributes: tuple[str, ...] = ()
    resource_attributes: tuple[str, ...] = ()

    def __deepcopy__(self, memo: dict) -> "CopyableEnv":
        clone = object.__new__(type(self))
        memo[id(self)] = clone
        # The spec (from gym.make) is read-only too, and its kwargs may hold the caller's objects
        # (a retriever, a token counter), which a deep copy must not copy.
        shared = {"spec", *self.shared_attributes, *self.resource_attributes}
        for key, value in self.__dict__.items():
            clone.__dict__[key] = value if key in shared else copy.deepcopy(value, memo)
        self._share_resources(clone)
        return clone

    def __getstate__(self) -> dict:
        return {key: value for key, value in self.__dict__.items() if key not in self.resource_attributes}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._open_resources()

    def _share_resources(self, clone: "CopyableEnv") -> None:
        """Give ``clone`` (a deep copy) its shares of the resources; none by default."""

    def _open_resources(self) -> None:
        """Make the resources again (after unpickling); none by default."""
