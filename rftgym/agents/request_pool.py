"""Daemon worker threads for a chat-API agent's concurrent requests."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future

__all__ = ["RequestPool", "on_pool_thread"]

_on_pool_thread = threading.local()  # .active is True on a RequestPool's worker threads


def on_pool_thread() -> bool:
    """Whether the caller runs on one of a :class:`RequestPool`'s worker threads (whose stack
    holds no line of the user's for a warning to name)."""
    return getattr(_on_pool_thread, "active", False)


class RequestPool:
    """Worker threads for concurrent requests. They are daemon threads, unlike a
    ThreadPoolExecutor's, which the interpreter joins at exit: after Ctrl-C or a failed batch a
    request still in flight would hold the process until its timeout. An abandoned request ends
    with the process."""

    def __init__(self, workers: int, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._most, self._name = workers, name
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._queued = self._idle = 0  # jobs no worker has taken yet; workers waiting for one

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        # Workers start as they are needed, up to the cap: a high --num-envs with a few episodes
        # starts a few threads (all at once, it took seconds per thousand).
        with self._lock:
            self._jobs.put((future, fn, args))
            self._queued += 1
            if self._queued > self._idle and len(self._threads) < self._most:
                thread = threading.Thread(target=self._work, name=f"{self._name}-{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                self._idle += 1  # counted now: it takes a job as soon as it runs
                thread.start()
        return future

    def shutdown(self) -> None:
        """Cancel what has not started; workers stop after their current request (not waited for)."""
        while True:
            try:
                future, _, _ = self._jobs.get_nowait()
            except queue.Empty:
                break
            future.cancel()
        for _ in self._threads:
            self._jobs.put(None)

    def _work(self) -> None:
        _on_pool_thread.active = True
        while (job := self._jobs.get()) is not None:
            with self._lock:
                self._queued -= 1
                self._idle -= 1
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                with self._lock:
                    self._idle += 1
                continue
            try:
                result, error = fn(*args), None
            except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
                result, error = None, exc
            with self._lock:  # idle again before the caller hears, so its next request finds this worker
                self._idle += 1
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)
