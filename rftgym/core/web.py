"""HTTP plumbing shared by the clients of servers (the chat API agent, the retrieval client).

A socket timeout bounds each read only, so a server that trickles bytes (of a TLS handshake, the
reply's headers or its body) could hold a request for ever, and no timeout reaches the lookup of
the host's name at all. A client therefore gives each request one :class:`Deadline` that covers
all of it: :func:`open_within` looks up the host, connects, sends and reads the headers by it
(with an opener from :func:`build_opener`), and :func:`read_body` or :func:`read_error_body` read
the body in the time left::

    deadline = Deadline(timeout_s)
    with open_within(opener, request, deadline) as response:  # RequestTooSlow past the deadline
        body = read_body(response, deadline.left(), max_bytes)  # BodyTooSlow past it
"""

from __future__ import annotations

import contextlib
import copy
import email.utils
import functools
import http.client
import ipaddress
import math
import os
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request

MAX_RETRY_AFTER_S = 60.0  # the longest wait a server's Retry-After gets


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` (a URL's host name) is this machine: ``localhost``, a name under
    ``.localhost`` (either with the root's dot at its end, or without), or a loopback address.
    Requests to such a host never go through a proxy from the environment (HTTP_PROXY would
    otherwise take them, since urllib does not bypass loopback by itself)."""
    if not host:
        return False
    name = _fully_qualified(host.lower())
    if name == "localhost." or name.endswith(".localhost."):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class RequestTooSlow(TimeoutError):
    """A request was not connected, sent and answered with its reply's status line and headers
    by its deadline."""


class NameLookupTooSlow(RequestTooSlow):
    """The lookup of a request's host name did not finish by its deadline; the message says what
    to check."""


class BodyTooLarge(Exception):
    """A body is over the size its reader allows."""


class BodyTooSlow(Exception):
    """A body did not arrive within its reader's time limit."""


class BodyCutShort(Exception):
    """The connection closed before the end of the body its Content-Length announced (asking
    again may well get all of it)."""


class Deadline:
    """The time by which a whole request must be done, ``timeout_s`` seconds from now: looking
    up the host's name, connecting, a TLS handshake, sending the request, and the reply's headers
    and body."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.at = time.monotonic() + timeout_s  # a time.monotonic() value

    def left(self) -> float:
        """Seconds until the deadline, 0 once it has passed."""
        return max(self.at - time.monotonic(), 0.0)


# An error reply's body says why (a context that is full, a quota spent) and is small
# (read_error_body's max_bytes): one that came late in its request's time still gets this long.
ERROR_BODY_GRACE_S = 5.0


def error_body_time(deadline: Deadline) -> float:
    """Seconds an error reply's body may take: what ``deadline`` has left, and at least
    :data:`ERROR_BODY_GRACE_S` (or the whole timeout where that is shorter)."""
    return max(deadline.left(), min(deadline.timeout_s, ERROR_BODY_GRACE_S))


def build_opener(*handlers) -> urllib.request.OpenerDirector:
    """urllib's ``build_opener(*handlers)`` with HTTP and HTTPS handlers whose connections
    :func:`open_within` can shut at a request's deadline (urllib's defaults, otherwise). An HTTP
    or HTTPS handler of the caller's would replace those, and is refused (TypeError)."""
    own = [h for h in handlers if isinstance(h, (urllib.request.HTTPHandler, urllib.request.HTTPSHandler))
           or h in (urllib.request.HTTPHandler, urllib.request.HTTPSHandler)]
    if own:
        raise TypeError(f"build_opener makes its own HTTP and HTTPS handlers (their connections keep a request's "
                        f"deadline); {own[0]!r} would replace them")
    return urllib.request.build_opener(_HTTPHandler(), _HTTPSHandler(), *handlers)


def open_within(opener: urllib.request.OpenerDirector, request: urllib.request.Request, deadline: Deadline):
    """``opener.open(request)``, connected, sent and answered with its status line and headers
    by ``deadline``; reading the body in ``deadline.left()`` is the caller's part (read_body).
    Each socket read waits at most ``deadline.timeout_s`` as well.

    Raises RequestTooSlow (a TimeoutError) once the deadline has passed, whatever the error it
    caused (a connection shut mid-headers may even look like a complete reply; a name lookup that
    took too long says so and what to check); urlopen's errors
    (HTTPError, URLError, http.client's) otherwise; TypeError for an opener not made by
    :func:`build_opener`, whose connections the deadline cannot reach."""
    shutter = _Shutter(deadline.at)
    setattr(request, _SHUTTER, shutter)  # the handlers' connections give it their sockets
    try:
        response = opener.open(request, timeout=deadline.timeout_s)
    except Exception as exc:
        if isinstance(lookup := getattr(exc, "reason", None), NameLookupTooSlow):  # says what to check
            raise lookup from None
        if not (shutter.shut.is_set() or deadline.left() == 0):
            raise
        if isinstance(exc, urllib.error.HTTPError):
            exc.close()
        raise _too_slow(deadline) from None
    finally:
        shutter.close()  # from here on read_body bounds the body
        delattr(request, _SHUTTER)
    if shutter.shut.is_set():  # shut after the headers came, or while they did
        response.close()
        raise _too_slow(deadline)
    if not shutter.adopted:
        response.close()
        raise TypeError("open_within needs an opener from rftgym.core.web.build_opener, whose connections its "
                        "deadline can shut; urllib's own could hold a request for ever")
    return response


def _too_slow(deadline: Deadline) -> RequestTooSlow:
    return RequestTooSlow(f"no reply within {deadline.timeout_s:g} s")


def read_body(stream, timeout_s: float, max_bytes: int, length: int | None = None) -> bytes:
    """A body from ``stream`` (an HTTP response, or a server's request stream: anything with
    ``read1``), read within ``timeout_s`` in all and at most ``max_bytes`` long. Without
    ``length``, to the end of the response; with it, exactly that many bytes (a request's
    Content-Length, on a connection that stays open after it). Raises BodyTooSlow, BodyTooLarge
    or BodyCutShort. A client gives it the time its request's Deadline has left.

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
    connection = _duplicate_socket(stream) if isinstance(stream, http.client.HTTPResponse) else None
    if connection is None:
        yield threading.Event()
        return
    shutter = _Shutter(deadline)
    shutter.adopt(connection)
    try:
        yield shutter.shut
    finally:
        shutter.close()


class _Shutter:
    """Shuts down the connections it adopts at ``deadline`` (a time.monotonic() value), or at
    once if that has passed, so that whatever read or write waits on them then ends (with an
    empty read or an error); ``shut`` is set once that has happened. It holds duplicates of their
    descriptors, and closes them only once its timer has stopped: a late shutdown must never hit
    a descriptor reused meanwhile."""

    def __init__(self, deadline: float):
        self.deadline = deadline
        self.shut = threading.Event()
        self._lock = threading.Lock()  # a connection adopted as the timer fires is shut too
        self._connections: list[socket.socket] = []
        self.adopted = 0  # connections adopted in all (close() lets them go)
        self._timer = threading.Timer(max(deadline - time.monotonic(), 0.0), self._shut_all)
        self._timer.daemon = True  # never keeps the interpreter from exiting
        self._timer.start()

    def adopt(self, connection: socket.socket) -> None:
        """Shut ``connection`` (a duplicate, closed by close()) at the deadline."""
        with self._lock:
            self._connections.append(connection)
            self.adopted += 1
            if self.shut.is_set():
                _shut_down(connection)

    def _shut_all(self) -> None:
        with self._lock:
            self.shut.set()
            for connection in self._connections:
                _shut_down(connection)

    def close(self) -> None:
        self._timer.cancel()
        self._timer.join()
        for connection in self._connections:
            connection.close()
        self._connections.clear()


def _shut_down(connection: socket.socket) -> None:
    try:
        connection.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed by the peer
        pass


# The attribute of a request that open_within sends, its _Shutter, which the request's
# connections (made by the handlers below) give their sockets to.
_SHUTTER = "_rftgym_shutter"


class _ConnectionsShutAtDeadline:
    """Mixin for urllib's HTTP and HTTPS handlers: a connection made for a request that
    open_within sends gives its socket to the request's _Shutter as soon as it is connected, so a
    TLS handshake or a proxy's tunnel set up on it is within the deadline too."""

    def do_open(self, http_class, req, **http_conn_args):
        shutter = getattr(req, _SHUTTER, None)
        if shutter is not None:
            http_class = functools.partial(_connection_shut_by, http_class, shutter)
        return super().do_open(http_class, req, **http_conn_args)


class _HTTPHandler(_ConnectionsShutAtDeadline, urllib.request.HTTPHandler):
    pass


class _HTTPSHandler(_ConnectionsShutAtDeadline, urllib.request.HTTPSHandler):
    pass


def _connection_shut_by(http_class, shutter: _Shutter, *args, **kwargs) -> http.client.HTTPConnection:
    connection = http_class(*args, **kwargs)
    # http.client's hook that opens the connection's socket (its TLS and tunnel code run on it).
    connection._create_connection = functools.partial(_connect_shut_by, shutter)
    return connection


def _connect_shut_by(shutter: _Shutter, address, timeout=None, source_address=None) -> socket.socket:
    """socket.create_connection by ``shutter``'s deadline: the host's name looked up, and each of
    its addresses tried in turn, in the time the deadline leaves (and at most ``timeout`` each);
    the socket is given to ``shutter`` (whose timer reaches it only once it is connected)."""
    host, port = address
    addresses = _addresses_by(host, port, _time_left(shutter.deadline, timeout))
    sock = _connect_to_first(addresses, shutter.deadline, timeout, source_address)
    try:
        shutter.adopt(sock.dup())
    except OSError:
        sock.close()
        raise
    return sock


def _time_left(deadline: float, timeout=None) -> float:
    """Seconds until ``deadline`` (a time.monotonic() value), at most ``timeout`` (a number, or
    http.client's "no timeout given"); TimeoutError once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the request's deadline passed before it connected")
    return min(left, timeout) if isinstance(timeout, (int, float)) else left


# "localhost" is this machine's loopback (RFC 6761, as is_loopback has it), so it needs no lookup.
# IPv4 first: most local servers listen there (an address that refuses costs one quick try).
_LOCALHOST_ADDRESSES = ("127.0.0.1", "::1")


def _addresses_by(host: str, port: int, seconds: float) -> list[tuple]:
    """``socket.getaddrinfo(host, port, 0, SOCK_STREAM)``, as socket.create_connection asks it,
    within ``seconds``. An IP address or localhost (``localhost.`` too) needs no lookup; a name is
    looked up on a worker thread, as nothing can make getaddrinfo itself give up (a resolver that
    hangs would hold the request far past its deadline). RequestTooSlow if the lookup takes longer."""
    if _fully_qualified(host.lower()) == "localhost.":
        return [info for loopback in _LOCALHOST_ADDRESSES for info in _numeric_addresses(loopback, port)]
    numeric = _numeric_addresses(host, port)
    return numeric if numeric else _looked_up_within(host, port, seconds)


def _fully_qualified(name: str) -> str:
    """``name`` with the root's dot at its end ("localhost" and "localhost." are one name)."""
    return name if name.endswith(".") else name + "."


def _numeric_addresses(host: str, port: int) -> list[tuple]:
    """getaddrinfo's answer for ``host`` if it is an IP address (which takes no lookup), else []."""
    try:
        return socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM, 0, socket.AI_NUMERICHOST)
    except socket.gaierror:  # a name (or an address family this machine lacks)
        return []


# A lookup the deadline gave up on goes on until the resolver's own timeouts end it, so while DNS
# is down each request would leave one more thread behind. Requests for the same name therefore
# share the lookup in flight (_lookups, by getaddrinfo's arguments), and at most this many run at
# once: a lookup of yet another name waits, within its deadline, for one of them to end.
MAX_LOOKUPS_IN_FLIGHT = 16
_lookups: dict[tuple, _Lookup] = {}
_lookups_changed = threading.Condition()  # guards _lookups; notified as each lookup ends


class _Lookup:
    """One getaddrinfo call (``query``: its arguments) on a daemon thread; each request that
    waits on it gets its answer or its error once ``done`` is set. It answers the requests that
    found it in flight only: the next request looks the name up afresh (DNS answers change)."""

    def __init__(self, query: tuple):
        self.query = query
        self.done = threading.Event()
        self.answer: list[tuple] = []
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            self.answer = socket.getaddrinfo(*self.query)
        except Exception as exc:  # noqa: BLE001 - raised on the threads of the requests that wait
            self.error = exc
        finally:
            with _lookups_changed:
                del _lookups[self.query]
                _lookups_changed.notify_all()
            self.done.set()


def _forget_the_parents_lookups() -> None:
    """In a forked child (a vector env's worker, say) the parent's lookup threads do not run, so
    their lookups would never end there, and their lock may have been held as the fork came."""
    global _lookups, _lookups_changed
    _lookups, _lookups_changed = {}, threading.Condition()


if hasattr(os, "register_at_fork"):  # not on Windows, which cannot fork
    os.register_at_fork(after_in_child=_forget_the_parents_lookups)


def _shown_seconds(seconds: float) -> str:
    """A lookup's time as a message says it: to a tenth of a second (hundredths below one tenth),
    so that the time a 1 s request had left when its lookup began (0.996 s) reads as 1."""
    return f"{round(seconds, 1 if seconds >= 0.1 else 2):g}"


def _looked_up_within(host: str, port: int, seconds: float) -> list[tuple]:
    """getaddrinfo's answer for the name ``host``, or its error, from the lookup in flight for it
    (one is started if there is none), waited on for ``seconds``. A lookup that takes longer is
    left to end on its own (the resolver's own timeouts end it; a daemon thread never keeps the
    interpreter from exiting)."""
    give_up_at = time.monotonic() + seconds
    lookup = _lookup_in_flight((host, port, 0, socket.SOCK_STREAM), give_up_at, seconds)
    if not lookup.done.wait(max(give_up_at - time.monotonic(), 0.0)):
        raise NameLookupTooSlow(f"the name lookup of {host} did not finish within {_shown_seconds(seconds)} s; check "
                                f"the DNS settings (/etc/resolv.conf) and that the DNS server they name answers, "
                                f"or give the server's IP address in the URL")
    if lookup.error is not None:
        raise _own_copy(lookup.error)
    return list(lookup.answer)


def _lookup_in_flight(query: tuple, give_up_at: float, seconds: float) -> _Lookup:
    """The lookup in flight for ``query`` (getaddrinfo's arguments), or a new one started once
    fewer than MAX_LOOKUPS_IN_FLIGHT run; NameLookupTooSlow if none could start by ``give_up_at``
    (a time.monotonic() value, ``seconds`` from when the request's lookup began)."""
    with _lookups_changed:
        if not _lookups_changed.wait_for(lambda: query in _lookups or len(_lookups) < MAX_LOOKUPS_IN_FLIGHT,
                                         timeout=max(give_up_at - time.monotonic(), 0.0)):
            raise NameLookupTooSlow(f"the name lookup of {query[0]} could not start within {_shown_seconds(seconds)} s: "
                                    f"lookups of {len(_lookups)} other names are still waiting on the resolver; "
                                    f"check the DNS settings (/etc/resolv.conf) and that the DNS server they name "
                                    f"answers, or give the servers' IP addresses in their URLs")
        if query not in _lookups:
            lookup = _Lookup(query)
            # Started before it is registered (it cannot end before: it needs the lock to), so a
            # thread that fails to start leaves nothing behind for later requests to wait on.
            threading.Thread(target=lookup.run, name=f"rftgym-lookup-{query[0]}", daemon=True).start()
            _lookups[query] = lookup
        return _lookups[query]


def _own_copy(error: Exception) -> Exception:
    """``error`` for one of the requests that shared its lookup: one exception object raised on
    several threads at once would have their tracebacks grow into one another."""
    try:
        return copy.copy(error)
    except Exception:  # noqa: BLE001 - an exception that cannot be copied is raised as it is
        return error


def _connect_to_first(addresses: list[tuple], deadline: float, timeout, source_address) -> socket.socket:
    """A socket connected to the first of ``addresses`` (getaddrinfo's answer) that takes a
    connection, as socket.create_connection tries them, each within what ``deadline`` leaves;
    the last try's error if none does."""
    error = None
    for family, kind, protocol, _, address in addresses:
        left = _time_left(deadline, timeout)
        sock = None
        try:
            sock = socket.socket(family, kind, protocol)
            sock.settimeout(left)
            if source_address:
                sock.bind(source_address)
            sock.connect(address)
            return sock
        except OSError as exc:
            error = exc
            if sock is not None:
                sock.close()
    if error is None:
        raise OSError("getaddrinfo returns an empty list")
    try:
        raise error
    finally:
        error = None  # the traceback holds this frame, which holds the error: no cycle


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


# How OpenSSL versions word a TLS hello answered in plain HTTP (1.1 and 3.0: wrong version
# number; 3.2 on: record layer failure; others: packet length, unknown protocol, http request).
_NOT_TLS = ("wrong_version_number", "wrong version number", "record layer failure", "packet length too long",
            "packet_length_too_long", "unknown protocol", "unknown_protocol", "http request", "http_request")


def plain_http_answer(reason: object) -> bool:
    """Whether a TLS failure says the server answered in plain HTTP (not a certificate problem,
    which another scheme would not mend)."""
    if not isinstance(reason, ssl.SSLError) or isinstance(reason, ssl.SSLCertVerificationError):
        return False
    return any(marker in str(reason).lower() for marker in _NOT_TLS)
