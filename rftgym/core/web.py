"""HTTP plumbing shared by the clients of servers (the chat API agent, the retrieval client)."""

from __future__ import annotations

import contextlib
import email.utils
import http.client
import ipaddress
import math
import os
import socket
import threading
import time

MAX_RETRY_AFTER_S = 60.0  # the longest wait a server's Retry-After gets


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` (a URL's host name) is this machine: ``localhost``, a name under
    ``.localhost``, or a loopback address. Requests to such a host never go through a proxy
    from the environment (HTTP_PROXY would otherwise take them, since urllib does not bypass
    loopback by itself)."""
    if not host:
        return False
    if host.lower() == "localhost" or host.lower().endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class BodyTooLarge(Exception):
    """A body is over the size its reader allows."""


class BodyTooSlow(Exception):
    """A body did not arrive within its reader's time limit."""


class BodyCutShort(Exception):
    """The connection closed before the end of the body its Content-Length announced (asking
    again may well get all of it)."""


def read_body(stream, timeout_s: float, max_bytes: int, length: int | None = None) -> bytes:
    """A body from ``stream`` (an HTTP response, or a server's request stream: anything with
    ``read1``), read within ``timeout_s`` in all and at most ``max_bytes`` long. Without
    ``length``, to the end of the response; with it, exactly that many bytes (a request's
    Content-Length, on a connection that stays open after it). Raises BodyTooSlow, BodyTooLarge
    or BodyCutShort.

    A socket timeout bounds each read only, so a peer trickling bytes could hold the reader for
    ever, and one ``read1`` of a chunked response may take many reads (a chunk's size line, its
    trailers). An http.client response's connection is therefore shut at the deadline, which ends
    whatever read is waiting then; a server's request stream bounds its own reads (its connection
    must stay open to answer)."""
    deadline = time.monotonic() + timeout_s
    with _shut_at(stream, deadline) as shut:
        chunks, size = [], 0
        while length is None or size < length:
            try:
                chunk = stream.read1(1 << 16 if length is None else min(1 << 16, length - size))
            except (OSError, http.client.HTTPException):
                if shut.is_set():  # the read failed because the deadline shut the connection
                    raise BodyTooSlow(f"over {timeout_s:g} s") from None
                raise
            if not chunk:
                if shut.is_set():  # the end came from the deadline, not from the peer
                    raise BodyTooSlow(f"over {timeout_s:g} s")
                if length is not None:
                    raise BodyCutShort(f"the connection closed {length - size} bytes before the end of the body")
                break
            size += len(chunk)
            if size > max_bytes:
                raise BodyTooLarge(f"over {max_bytes >> 20} MiB")
            if time.monotonic() > deadline and (length is None or size < length):
                raise BodyTooSlow(f"over {timeout_s:g} s")
            chunks.append(chunk)
    if length is None and getattr(stream, "length", None):  # bytes the Content-Length promised that never came
        raise BodyCutShort(f"the connection closed {stream.length} bytes before the end of the reply")
    return b"".join(chunks)


def read_error_body(error, timeout_s: float, max_bytes: int) -> bytes:
    """The start of an HTTP error reply's body (``error``: urllib's HTTPError, or any stream
    with ``read1``), read for the reason it gives: at most ``max_bytes``, within ``timeout_s`` in
    all. Never raises: what arrived before the deadline, the size, the end or a failure came
    (b"" if nothing did), since the error itself is what the caller reports."""
    stream = getattr(error, "fp", None) or error
    deadline = time.monotonic() + timeout_s
    chunks, size = [], 0
    with _shut_at(stream, deadline) as shut:
        while size < max_bytes and time.monotonic() <= deadline and not shut.is_set():
            try:
                chunk = stream.read1(min(1 << 16, max_bytes - size))
            except (OSError, ValueError, AttributeError, http.client.HTTPException):  # cut short, closed, no body
                break
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    return b"".join(chunks)


@contextlib.contextmanager
def _shut_at(stream, deadline: float):
    """Within the block, ``stream``'s connection is shut down at ``deadline`` (a time.monotonic()
    value) if ``stream`` is an http.client response, so that a read waiting then ends at once
    (with an empty read or an error); the Event it yields is set once that has happened. Any
    other stream, or one whose socket cannot be reached, is left alone (its reads are then
    bounded by its socket timeout only, and the deadline is checked after each)."""
    shut = threading.Event()
    connection = _duplicate_socket(stream) if isinstance(stream, http.client.HTTPResponse) else None
    if connection is None:
        yield shut
        return

    def shut_down() -> None:
        shut.set()
        try:
            connection.shutdown(socket.SHUT_RDWR)
        except OSError:  # already closed by the peer
            pass

    timer = threading.Timer(max(deadline - time.monotonic(), 0.0), shut_down)
    timer.daemon = True  # never keeps the interpreter from exiting
    timer.start()
    try:
        yield shut
    finally:
        timer.cancel()
        timer.join()  # before the close: a late shutdown must not hit a descriptor reused meanwhile
        connection.close()


def _duplicate_socket(response: http.client.HTTPResponse) -> socket.socket | None:
    """A socket on a duplicate of ``response``'s connection descriptor (shutting it down shuts
    the connection; closing it leaves the response's own socket open), or None where there is
    none to reach (a closed response, a platform that cannot duplicate a socket descriptor)."""
    try:
        descriptor = os.dup(response.fileno())
    except (AttributeError, OSError, ValueError):
        return None
    try:
        return socket.socket(fileno=descriptor)
    except OSError:  # not a socket after all
        os.close(descriptor)
        return None


def retry_after_s(headers) -> float | None:
    """The server's ``Retry-After`` (seconds, or an HTTP date) as seconds from now, in [0, 60];
    OpenAI's ``retry-after-ms`` (milliseconds, finer) first when it is there and a number."""
    if headers is None:
        return None
    milliseconds = headers.get("retry-after-ms")
    try:
        seconds = float(milliseconds) / 1000.0 if milliseconds is not None else None
    except ValueError:
        seconds = None
    if seconds is not None and math.isfinite(seconds):
        return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)
    value = headers.get("Retry-After")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            date = email.utils.parsedate_tz(value)
            # An HTTP date is in GMT; one that names no zone is read as GMT too, not as local time.
            seconds = None if date is None else email.utils.mktime_tz((*date[:9], date[9] or 0)) - time.time()
        except (TypeError, ValueError, OverflowError):
            return None
    if seconds is None or not math.isfinite(seconds):
        return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)
