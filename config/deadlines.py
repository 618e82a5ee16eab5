"""A deadline for the portal's, the API's and ingest's requests: they wait on the database at
most TALLY_REQUEST_DEADLINE_MS. The webhooks keep their own, shorter one; the admin has none
(an operator's action, closing a billing period say, may rightly take longer than a page).

In a database outage these requests used to wait as long as the outage did (45 s measured,
issue 40 finding 4), each holding a server thread. Two bounds now:

- on the server, `statement_timeout` (the same length), so that a slow statement or one
  waiting on a lock ends there and frees its locks. It is set on a connection the first time
  a request uses it and stays set for the connection's life (one `SET` per connection, not
  per request); the webhook sets its own for its admissions and sets this one back. Behind a
  pooler that lends connections per transaction (DATABASE_TRANSACTION_POOLING) nothing may be
  set on the session, so there the client's bound alone holds.
- on the client, `db.postgresql.deadline`: CLIENT_GRACE_SECONDS past the request's deadline
  the socket of a connection still waiting is shut down, for a server that does not answer at
  all (a host gone, a network that holds packets): no server-side timeout starts for a
  statement the server never received. The grace lets a server that does answer cancel its
  statement first, which leaves the connection usable.

Either way, and when no connection can be made (refused, or past DATABASE_CONNECT_TIMEOUT),
the request is answered 503, saying the database did not answer in time, with a Retry-After.
The webhooks also have workers of their own (deploy/gunicorn.conf.py), so that requests
waiting here never delay an admission.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from django.conf import settings
from django.db import DatabaseError, OperationalError, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.http import HttpRequest, HttpResponse
from psycopg import errors, pq

from core.logging import ADMISSION_PREFIX
from db.postgresql import deadline

log = logging.getLogger(__name__)
# How long after the deadline the client gives up on a server that has not cancelled the
# statement itself (at its statement_timeout): the answer's time to travel.
CLIENT_GRACE_SECONDS = 0.5
# The admin's actions (closing a billing period, say) may rightly run longer than a page:
# operators' requests have no deadline, as before.
UNBOUNDED_PREFIXES = ("/admin/",)
# Set on a request whose deadline shut a connection down, or whose statement the server
# cancelled at its statement_timeout.
_EXPIRED = "tally_deadline_expired"


class RequestDeadlineExceeded(DatabaseError):
    """A request used the database past its deadline."""


class _QueryDeadline:
    """The execute wrapper (`connection.execute_wrapper`) that bounds each of a request's
    statements by the request's deadline."""

    def __init__(self, request: HttpRequest, at: float) -> None:
        self.request = request
        self.at = at
        self.statement_timeout = f"{settings.TALLY_REQUEST_DEADLINE_MS}ms"

    def __call__(
        self,
        execute: Callable[..., Any],
        sql: str,
        params: Any,
        many: bool,
        context: dict[str, Any],
    ) -> Any:
        wrapper: BaseDatabaseWrapper = context["connection"]
        if time.monotonic() >= self.at:
            setattr(self.request, _EXPIRED, True)
            raise RequestDeadlineExceeded("the request's deadline passed before this statement")
        self._set_statement_timeout(wrapper)
        with deadline.deadline(wrapper.connection, at=self.at + CLIENT_GRACE_SECONDS) as watch:
            try:
                return execute(sql, params, many, context)
            except DatabaseError as exc:
                if watch.expired or isinstance(exc.__cause__, errors.QueryCanceled):
                    setattr(self.request, _EXPIRED, True)
                raise

    def _set_statement_timeout(self, wrapper: BaseDatabaseWrapper) -> None:
        """Once per connection: its statements end at the deadline's length on the server. Only
        outside a transaction, whose rollback would take the setting back with it."""
        raw = wrapper.connection
        if (
            settings.DATABASE_TRANSACTION_POOLING
            or getattr(wrapper, "_tally_timed", None) is raw
            or raw.info.transaction_status != pq.TransactionStatus.IDLE
        ):
            return
        with deadline.deadline(raw, at=self.at + CLIENT_GRACE_SECONDS):
            raw.execute(
                "SELECT set_config('statement_timeout', %s, false)", [self.statement_timeout]
            )
        wrapper._tally_timed = raw  # type: ignore[attr-defined]


def _unbound_connections() -> None:
    """Close the connections an earlier request of this thread left a statement_timeout on: the
    next statement connects afresh, with the server's own settings. Operators' requests are
    few; a reconnect now and then is cheaper than a RESET's care in an outage. A connection
    inside a transaction (ATOMIC_REQUESTS, a test's) is not closed, which would end the
    transaction under its owner: its setting is reset in it instead (and again next time,
    since a rollback would take the reset back)."""
    for wrapper in connections.all(initialized_only=True):
        raw = wrapper.connection
        if raw is None or getattr(wrapper, "_tally_timed", None) is not raw:
            continue
        if raw.info.transaction_status == pq.TransactionStatus.IDLE:
            wrapper.close()
        else:
            raw.execute("RESET statement_timeout")


class RequestDeadlineMiddleware:
    """Bounds the database time of each request outside the webhooks (TALLY_REQUEST_DEADLINE_MS),
    and answers 503 to one that ran past it."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        # The webhooks run to their own deadline (TALLY_WEBHOOK_DEADLINE_MS) and timeouts.
        if request.path_info.startswith(ADMISSION_PREFIX):
            return self.get_response(request)
        if request.path_info.startswith(UNBOUNDED_PREFIXES):
            _unbound_connections()
            return self.get_response(request)
        bound = _QueryDeadline(
            request, time.monotonic() + settings.TALLY_REQUEST_DEADLINE_MS / 1000
        )
        with ExitStack() as stack:
            for wrapper in connections.all():
                stack.enter_context(wrapper.execute_wrapper(bound))
            response = self.get_response(request)
        if response.status_code >= 500 and getattr(request, _EXPIRED, False):
            # Past the deadline in another middleware (the session's save, say): Django has
            # made its 500 of it already.
            return _past_deadline(request, reason="a statement after the view")
        return response

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        # Past the deadline, or no connection to be had (refused, or the connect timeout):
        # the database is not answering, which is no fault of the request's.
        if isinstance(exception, OperationalError) or (
            isinstance(exception, DatabaseError) and getattr(request, _EXPIRED, False)
        ):
            return _past_deadline(request, reason=str(exception).strip())
        return None


def _past_deadline(request: HttpRequest, *, reason: str) -> HttpResponse:
    """The 503 for a request whose database did not answer by its deadline."""
    seconds = settings.TALLY_REQUEST_DEADLINE_MS / 1000
    log.warning(
        "request past its deadline: the database did not answer within %g s (%s %s: %s)",
        seconds,
        request.method,
        request.path,
        reason,
    )
    response = HttpResponse(
        f"the database did not answer within this request's deadline ({seconds:g} s); "
        "try again shortly\n",
        status=503,
        content_type="text/plain",
    )
    response["Retry-After"] = "5"
    return response
