"""``HOST:PORT`` addresses: one parser for the ones this node is configured with and the ones it
reads of other nodes (the cluster directory's member entries), so that neither a typo in a
config file nor a forged or garbled entry reaches a socket call as something it cannot take."""

from __future__ import annotations

MAX_HOST = 253  # the longest DNS name


def split_host_port(address: str, *, listen: bool = False) -> tuple[str, int]:
    """``(host, port)`` of ``address`` (``HOST:PORT``, an IPv6 host in brackets: ``[::1]:50061``),
    the brackets taken off. The port is 1..65535; ``listen`` (an address to bind) also allows
    port 0 (any free one) and an empty host (every interface). Raises :class:`ValueError`
    saying what is wrong."""
    host, sep, port = address.rpartition(":")
    if not sep:
        raise ValueError(f"{address!r} is not HOST:PORT (no port)")
    if not port.isascii() or not port.isdigit() or len(port) > 5:
        raise ValueError(f"{address!r}: the port must be a number, got {port!r}")
    low = 0 if listen else 1
    if not low <= int(port) <= 65535:
        raise ValueError(f"{address!r}: the port must be {low}..65535, got {int(port)}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if ":" not in host:
            raise ValueError(f"{address!r}: brackets are for an IPv6 host")
    elif ":" in host:
        raise ValueError(f"{address!r}: an IPv6 host goes in brackets ([::1]:50061)")
    if not host and not listen:
        raise ValueError(f"{address!r}: no host")
    if len(host) > MAX_HOST or not host.isascii() or not host.isprintable() or any(c in host for c in " []/|"):
        raise ValueError(f"{address!r}: not a host name or IP address: {host!r}")
    return host, int(port)
