"""URLs for servers kvflow starts or prints."""

from __future__ import annotations

import ipaddress


def url_host(host: str) -> str:
    """The host part of a URL that reaches, from this machine, a server listening on `host` (a
    --host bind address). A wildcard address reaches the server on the loopback address of its
    family: "0.0.0.0" and "" (every IPv4 address) as 127.0.0.1, "::" (every IPv6 address, and IPv4
    too on dual-stack hosts) as [::1], which answers whether or not the socket is IPv6-only. An
    IPv6 literal is bracketed, as a URL needs ("::1" -> "[::1]"); names and IPv4 addresses are
    kept as given."""
    h = host.strip()
    if h.startswith("[") and h.endswith("]"):
        h = h[1:-1]
    if not h:
        return "127.0.0.1"
    try:
        ip = ipaddress.ip_address(h)
    except ValueError:
        return h  # a name (localhost, example.com)
    if ip.is_unspecified:
        return "[::1]" if ip.version == 6 else "127.0.0.1"
    return f"[{h}]" if ip.version == 6 else h
