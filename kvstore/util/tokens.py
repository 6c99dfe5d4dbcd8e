"""The one comparison of a supplied secret with the expected one, in constant time: the gRPC
token (kvstore.server.auth), HTTP's header and ``?token=``, the local socket's hello, and the
cluster token on the peer data path (kvstore.cluster.peer_server)."""

from __future__ import annotations

import hmac


def _bytes(secret: str | bytes) -> bytes:
    return secret.encode("utf-8", "surrogateescape") if isinstance(secret, str) else bytes(secret)


def token_matches(supplied: str | bytes, expected: str | bytes) -> bool:
    """Whether ``supplied`` equals ``expected``, in a time that does not depend on where they differ."""
    return hmac.compare_digest(_bytes(supplied), _bytes(expected))
