"""Database sessions (SESSION_ENGINE): logging out deletes the session's row, so a cookie
copied before stops working.

A cookie whose key Django could not have made (a NUL byte, other characters) is treated as no
session, never sent to the database, where a NUL byte would be an error.
"""

from __future__ import annotations

from django.contrib.sessions.backends.base import VALID_KEY_CHARS
from django.contrib.sessions.backends.db import SessionStore as DatabaseSessionStore

_KEY_CHARS = frozenset(VALID_KEY_CHARS)


class SessionStore(DatabaseSessionStore):
    """Django's database store that refuses keys outside Django's own alphabet."""

    def _validate_session_key(self, key: str | None) -> bool:
        return bool(key) and 8 <= len(key or "") <= 40 and set(key or "") <= _KEY_CHARS
