"""Servers on 127.0.0.1 that answer too slowly to finish yet fast enough that no socket read
times out, for the tests of clients' request deadlines (rftgym.core.web). Each sends a byte every
``every_s`` until it is stopped; leaving the ``with`` block stops it and joins its threads. And
a name resolver that never answers (:class:`HangingResolver`)."""

from __future__ import annotations

import contextlib
import shutil
import socket
import ssl
import subprocess
import threading
import time

STATUS_LINE = b"HTTP/1.1 200 OK\r\n"


@contextlib.contextmanager
def trickling_server(first: bytes = STATUS_LINE, byte: bytes = b"X", every_s: float = 0.2,
                     tls: ssl.SSLContext | None = None):
    """Yields the port of a server that, on each connection, does the TLS handshake (with
    ``tls``), reads the request's head, sends ``first`` and then ``byte`` every ``every_s`` for
    ever: a status line followed by a header that never ends, by default."""
    stop = threading.Event()
    threads: list[threading.Thread] = []
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.05)

    def serve(connection: socket.socket) -> None:
        try:
            if tls is not None:
                connection = tls.wrap_socket(connection, server_side=True)
            head = b""
            while b"\r\n\r\n" not in head:
                if not (chunk := connection.recv(65536)):
                    return
                head += chunk
            connection.sendall(first)
            while not stop.wait(every_s):
                connection.sendall(byte)
        except OSError:  # the client gave up (a TLS error is an OSError too)
            pass
        finally:
            connection.close()

    def accept() -> None:
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            connection.settimeout(10)
            thread = threading.Thread(target=serve, args=(connection,), daemon=True)
            threads.append(thread)
            thread.start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        acceptor.join(timeout=5)
        listener.close()
        for thread in threads:
            thread.join(timeout=5)


def self_signed_tls(directory) -> tuple[ssl.SSLContext, str]:
    """A server TLS context with a fresh certificate for 127.0.0.1 (made by the openssl command,
    skipped where there is none) and the certificate's path, for a client to trust."""
    import pytest

    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("the openssl command makes the test's certificate")
    cert, key = str(directory / "cert.pem"), str(directory / "key.pem")
    subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", key, "-out", cert, "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True, timeout=60)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    return context, cert


def finishes_within(seconds: float, call) -> BaseException | None:
    """Runs ``call()`` on a thread and returns the exception it raised (None if it returned), or
    fails the test if it is still running after ``seconds`` (the thread ends once the server it
    waits on is stopped)."""
    import pytest

    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=seconds)
    if thread.is_alive():
        pytest.fail(f"still waiting after {seconds:g} s")
    return outcome[0]


class HangingResolver:
    """Stands in for socket.getaddrinfo: an IP address (AI_NUMERICHOST) is answered as usual, a
    name in ``names`` with its addresses (None: no such name), and any other name hangs, as behind
    a DNS server that never answers, until ``release()``: then it fails as a resolver's timeout
    would, or is answered late if ``names`` has it by then."""

    def __init__(self):
        self.real = socket.getaddrinfo
        self.names: dict[str, list[tuple[str, int]] | None] = {}  # name -> the (IP, port)s it resolves to
        self.looked_up: list[str] = []  # the names asked for, in order
        self.hanging = 0  # lookups waiting now
        self._lock = threading.Lock()
        self._released = threading.Event()

    def __call__(self, host, port, family=0, type=0, proto=0, flags=0):
        if flags & socket.AI_NUMERICHOST:
            return self.real(host, port, family, type, proto, flags)
        self.looked_up.append(host)
        if host in self.names and self.names[host] is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        if host in self.names:
            return self.answer(host)
        with self._lock:
            self.hanging += 1
        try:
            self._released.wait()
        finally:
            with self._lock:
                self.hanging -= 1
        if self.names.get(host) is not None:
            return self.answer(host)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    def answer(self, host) -> list[tuple]:
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", address) for address in self.names[host]]

    def release(self) -> None:
        """Lets every hanging lookup end, and waits until none is left waiting, nor any of
        rftgym.core.web's lookup threads (named rftgym-lookup-...) that asked it: a lookup still
        in flight would answer the next test's requests for its name."""
        self._released.set()
        give_up_at = time.monotonic() + 5
        while self.hanging and time.monotonic() < give_up_at:
            time.sleep(0.01)
        assert not self.hanging, "a lookup still hangs after its release"
        for thread in lookup_threads():
            thread.join(timeout=max(give_up_at - time.monotonic(), 0.1))
        assert not lookup_threads(), "a lookup thread is still running after the resolver's release"

    @classmethod
    @contextlib.contextmanager
    def installed(cls, monkeypatch):
        """One in socket.getaddrinfo's place, released when the block ends."""
        stand_in = cls()
        monkeypatch.setattr(socket, "getaddrinfo", stand_in)
        yield stand_in
        stand_in.release()  # no thread is left waiting on it


def lookup_threads() -> list[threading.Thread]:
    """The threads on which rftgym.core.web looks names up, running now."""
    return [thread for thread in threading.enumerate() if thread.name.startswith("rftgym-lookup-")]
