"""HTTP plumbing shared by the clients of servers (the chat API agent, the retrieval client)."""

from __future__ import annotations

import ipaddress
import time


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
    """A reply's body is over the size its reader allows."""


class BodyTooSlow(Exception):
    """A reply's body did not arrive within its reader's time limit."""


class BodyCutShort(Exception):
    """The connection closed before the end of the body its Content-Length announced (asking
    again may well get all of it)."""


def read_body(response, timeout_s: float, max_bytes: int) -> bytes:
    """A response's body, read within ``timeout_s`` of its headers (a socket timeout bounds each
    read only, so a server trickling bytes could hold a request for ever) and at most
    ``max_bytes`` long. Raises BodyTooSlow, BodyTooLarge or BodyCutShort."""
    deadline = time.monotonic() + timeout_s
    chunks, size = [], 0
    while chunk := response.read1(1 << 16):
        size += len(chunk)
        if size > max_bytes:
            raise BodyTooLarge(f"over {max_bytes >> 20} MiB")
        if time.monotonic() > deadline:
            raise BodyTooSlow(f"over {timeout_s:g} s")
        chunks.append(chunk)
    if getattr(response, "length", None):  # bytes the Content-Length promised that never came
        raise BodyCutShort(f"the connection closed {response.length} bytes before the end of the reply")
    return b"".join(chunks)
