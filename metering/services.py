"""Metering's writes that people and commands make (the agents' own go through `ingest`)."""

from __future__ import annotations

import secrets

from django.utils import timezone

from inventory.models import Cluster
from metering import ingest
from metering.models import AgentToken
from teams import audit


def issue_agent_token(*, cluster: Cluster, node: str, actor: str) -> str:
    """Create a bearer token for the agent on `node` ("*": an agent that reports for every
    node) and return it. Only its SHA-256 is stored, so it cannot be shown again; the token's
    creation is audited as `actor` (the hash, never the token)."""
    token = secrets.token_urlsafe(32)
    audit.create(
        actor=actor,
        obj=AgentToken(
            cluster=cluster,
            node=node,
            token_sha256=ingest.token_sha256(token),
            created_at=timezone.now(),
        ),
    )
    return token
