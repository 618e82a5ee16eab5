"""Requests outside the webhooks wait on the database at most TALLY_REQUEST_DEADLINE_MS
(config/deadlines.py; issue 40, finding 4): their connection's statement_timeout is that long,
a statement that runs past it is a 503 that says why (not a 500, and not a thread held for as
long as the statement would run), and the webhooks keep their own timeouts.

The silent database (no answer at all, where only the client's bound helps) is
tests/deploy/test_webhook_isolation.py, through gunicorn.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from django.db import connection
from django.http import HttpRequest, HttpResponse
from django.test import Client
from django.urls import path
from pytest_django.fixtures import SettingsWrapper

from config.urls import urlpatterns as project_patterns

DEADLINE_MS = 300


def statement_timeout(request: HttpRequest) -> HttpResponse:
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('statement_timeout')")
        return HttpResponse(cursor.fetchone()[0])


def slow(request: HttpRequest) -> HttpResponse:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_sleep(5)")
    return HttpResponse("slept")


urlpatterns = [
    path("deadline/timeout/", statement_timeout),
    path("deadline/slow/", slow),
    path("admission/timeout/", statement_timeout),  # under the webhooks' prefix
    path("admin/deadline-timeout/", statement_timeout),  # and the admin's
    *project_patterns,
]


@pytest.fixture
def deadline(settings: SettingsWrapper) -> Iterator[None]:
    settings.ROOT_URLCONF = __name__
    settings.TALLY_REQUEST_DEADLINE_MS = DEADLINE_MS
    yield
    connection.close()  # its statement_timeout is this test's


@pytest.mark.django_db(transaction=True)  # autocommit, as served: the session's setting holds
@pytest.mark.usefixtures("deadline")
def test_a_request_statement_times_out_at_the_deadline() -> None:
    client = Client()
    assert client.get("/deadline/timeout/").content.decode() == f"{DEADLINE_MS}ms"
    started = time.monotonic()
    response = client.get("/deadline/slow/")
    seconds = time.monotonic() - started
    assert response.status_code == 503
    assert response["Retry-After"] == "5"
    assert response.content.decode() == (
        "the database did not answer within this request's deadline (0.3 s); try again shortly\n"
    )
    assert seconds < 2.5  # the statement asked for 5 s
    # The connection is still good for the next request.
    assert client.get("/deadline/timeout/").status_code == 200


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("deadline")
def test_the_webhooks_are_not_bound_by_the_request_deadline() -> None:
    connection.close()  # a fresh session: nothing set on it by an earlier request
    assert Client().get("/admission/timeout/").content.decode() == "0"


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("deadline")
def test_the_admin_has_no_deadline_even_after_a_bounded_request() -> None:
    """An operator's action (closing a period) may take longer than a page; the connection a
    portal request left its statement_timeout on is not used for it as it is."""
    client = Client()
    assert client.get("/deadline/timeout/").content.decode() == f"{DEADLINE_MS}ms"
    assert client.get("/admin/deadline-timeout/").content.decode() == "0"
    assert client.get("/deadline/timeout/").content.decode() == f"{DEADLINE_MS}ms"
