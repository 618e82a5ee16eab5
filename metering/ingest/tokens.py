"""The agents' bearer tokens: stored and looked up by their SHA-256 only."""

from __future__ import annotations

import hashlib

from metering.models import AgentToken

# Tokens


def token_sha256(token: str) -> str:
    """How an agent token is stored and looked up: its SHA-256, never the token."""
    return hashlib.sha256(token.encode()).hexdigest()


def authenticate(token: str) -> AgentToken | None:
    """The unrevoked token `token` is, or None.

    The lookup is by the token's SHA-256, so how long it takes says nothing about the token.
    """
    if not token:
        return None
    return (
        AgentToken.objects.select_related("cluster")
        .filter(token_sha256=token_sha256(token), revoked_at__isnull=True)
        .first()
    )
