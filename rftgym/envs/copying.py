"""Copies of an env in the middle of an episode.

``copy.deepcopy(env)`` branches an episode: tree search over an agent's turns (MCTS as in
O1-CODER), or trying several replies from one state. The copy continues from the same context,
counters and random state, and from then on the two are independent. What an env builds once and
never changes (its config, corpus, generated world, dataset) is shared, not copied; so are its
expensive resources, a retriever's index or a code sandbox: each copy holds a
share, and the resource is closed when the last env holding it is closed, whichever that is.

``copy.copy(env)`` is the same branch: a shallow copy would share the episode's state with the
original, so a step on one would change the other.

``pickle`` sends an env, mid-episode too, to another process (a worker pool): there the resources
are made afresh from the config (an index is built again, a sandbox share taken in that process).

An env that was closed is neither copied nor pickled (a RuntimeError says so): its shares are
given back, and a copy could not be reset or stepped (see :class:`.common.ClosableEnv`).
"""

from __future__ import annotations

import copy
import threading
import weakref
from typing import Any

from .common import how_to_remake


class _Shares:
    """How many envs hold a resource; the last to give its share back closes it."""

    def __init__(self, resource: Any):
        self.resource = resource
        self.count = 1
        self._lock = threading.Lock()

    def take(self) -> None:
        with self._lock:
            if self.count == 0:
                raise RuntimeError(f"{type(self.resource).__name__} is closed: an env closed before it was copied "
                                   "cannot be copied; copy it before closing it")
            self.count += 1

    def release(self) -> None:
        with self._lock:
            self.count -= 1
            last = self.count == 0
        if last:
            self.resource.close()


class Share:
    """One env's share of a resource (anything with ``close()``) that it and its copies use. It
    is given back by :meth:`release` (once; later calls do nothing) or when the env is garbage
    collected unclosed, as a dropped branch of a tree search is; the last share closes the
    resource."""

    def __init__(self, resource: Any, holder: Any, _shares: _Shares | None = None):
        self.resource = resource
        if _shares is None:
            _shares = _Shares(resource)
        else:
            _shares.take()
        self._shares = _shares
        self.release = weakref.finalize(holder, _shares.release)

    def copy_for(self, holder: Any) -> "Share":
        return Share(self.resource, holder, self._shares)

    @property
    def open(self) -> bool:
        return self._shares.count > 0


class CopyableEnv:
    """Mixin giving an env ``copy.deepcopy`` (and ``copy.copy``, the same) and ``pickle`` support
    (see the module docstring).

    An env lists in ``shared_attributes`` what it never changes after ``__init__`` (shared by a
    copy, pickled as is; not its spaces, which hold a random generator of their own) and in
    ``resource_attributes`` what holds a process resource (left out of a pickle). A deep copy
    takes a share of each :class:`Share` among them (``_share_resources``, which an env with other
    resources extends); ``_release_shares()`` gives this env's back; ``_open_resources()`` makes
    the resources again after unpickling."""

    shared_attributes: tuple[str, ...] = ()
    resource_attributes: tuple[str, ...] = ()

    def __deepcopy__(self, memo: dict) -> "CopyableEnv":
        self._check_copyable()
        clone = object.__new__(type(self))
        memo[id(self)] = clone
        # The spec (from gym.make) is read-only too, and its kwargs may hold the caller's objects
        # (a retriever, a token counter), which a deep copy must not copy.
        shared = {"spec", "_spec", *self.shared_attributes, *self.resource_attributes}  # (_spec: PathsAsText)
        for key, value in self.__dict__.items():
            clone.__dict__[key] = value if key in shared else copy.deepcopy(value, memo)
        self._share_resources(clone)
        return clone

    def __copy__(self) -> "CopyableEnv":
        # A shallow copy would share the episode's mutable state (message ids, counters, records)
        # and this env's resource shares (closing it would close the original's sandbox): a
        # copy of an env is always a branch.
        return copy.deepcopy(self)

    def __getstate__(self) -> dict:
        self._check_copyable()
        return {key: value for key, value in self.__dict__.items() if key not in self.resource_attributes}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._open_resources()

    def _check_copyable(self) -> None:
        # A closed env's resources are given back: a copy could not run (and would take a share
        # of them again), so say so here rather than when the copy is reset.
        if getattr(self, "closed", False):
            raise RuntimeError(f"this env was closed, so it cannot be copied or pickled; copy it before closing it, "
                               f"or make a new one with {how_to_remake(self)}")

    def _share_resources(self, clone: "CopyableEnv") -> None:
        """Give ``clone`` (a deep copy) its shares of the resources."""
        for key in self.resource_attributes:
            value = getattr(self, key, None)
            if isinstance(value, Share):
                setattr(clone, key, value.copy_for(clone))

    def _release_shares(self) -> None:
        """Give back this env's shares (on close; twice is safe)."""
        for key in self.resource_attributes:
            value = getattr(self, key, None)
            if isinstance(value, Share):
                value.release()

    def _open_resources(self) -> None:
        """Make the resources again (after unpickling); none by default."""
