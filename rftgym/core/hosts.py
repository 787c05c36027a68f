"""Host names: which ones are this machine."""

from __future__ import annotations

import ipaddress


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
