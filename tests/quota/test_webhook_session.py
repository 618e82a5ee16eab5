"""What an admission sets on its PostgreSQL session: timeouts and commit durability.

An admission runs in autocommit (its read and its reserving statement are each atomic), with
the webhook's timeouts set on the session by its first read; a request that is no admission
gets the connection's own settings back.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest
from django.db import connection
from django.test import Client

from quota.models import QuotaRule, Reservation
from tests.quota.fixtures import claim, decide, gpu_request, make_team

pytestmark = [pytest.mark.postgres, pytest.mark.usefixtures("fleet")]


def _show(name: str) -> str:
    with connection.cursor() as cursor:
        cursor.execute(f"SHOW {name}")
        value: str = cursor.fetchone()[0]
        return value


@pytest.mark.django_db
@pytest.mark.parametrize(("durable", "expected"), [(True, "on"), (False, "off")])
def test_an_admission_bounds_its_waits_and_commits_as_configured(
    client: Client, settings: Any, durable: bool, expected: str
) -> None:
    settings.TALLY_WEBHOOK_DB_TIMEOUT_MS = 1234
    settings.TALLY_WEBHOOK_SYNCHRONOUS_COMMIT = durable
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 10}])
    assert decide(client, claim("c", [gpu_request(1)]))["allowed"] is True
    assert _show("statement_timeout") == "1234ms"
    assert _show("lock_timeout") == "1234ms"
    assert _show("synchronous_commit") == expected


@pytest.mark.django_db
def test_a_request_that_is_no_admission_gets_the_connections_own_settings_back(
    client: Client, settings: Any
) -> None:
    settings.TALLY_WEBHOOK_DB_TIMEOUT_MS = 1234
    settings.TALLY_WEBHOOK_SYNCHRONOUS_COMMIT = False
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 10}])
    own = {name: _show(name) for name in ("statement_timeout", "lock_timeout")}
    decide(client, claim("c1", [gpu_request(1)]))
    decide(client, claim("c2", [gpu_request(1)]))  # the next admission keeps them
    assert _show("lock_timeout") == "1234ms"
    assert client.get("/healthz").status_code == 200
    assert {name: _show(name) for name in own} == own
    assert _show("synchronous_commit") == "on"


@pytest.mark.django_db(transaction=True)
def test_an_admission_runs_in_autocommit_and_its_reservation_is_visible_at_once(
    client: Client, settings: Any
) -> None:
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 10}])
    assert decide(client, claim("c", [gpu_request(2)]))["allowed"] is True
    assert connection.connection.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    with psycopg.connect(_conninfo()) as other:
        [(state, in_use)] = other.execute(
            "SELECT v.state, r.in_use FROM quota_reservation v, quota_quotarule r "
            "WHERE v.name = 'c' AND r.name = 'all-gpus'"
        ).fetchall()
    assert (state, in_use) == ("reserved", 2)


@pytest.mark.django_db(transaction=True)
def test_a_rule_locked_elsewhere_is_a_clear_denial_within_the_lock_timeout(
    client: Client, settings: Any
) -> None:
    """The reserving statement runs in autocommit too: the webhook's lock timeout bounds its
    wait for the rule's row, and nothing is reserved."""
    settings.TALLY_WEBHOOK_DB_TIMEOUT_MS = 300
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 10}])
    rule = QuotaRule.objects.get(name="all-gpus")
    locked, release = threading.Event(), threading.Event()

    def hold_the_rule() -> None:
        with psycopg.connect(_conninfo()) as other:
            other.execute("SELECT 1 FROM quota_quotarule WHERE id = %s FOR UPDATE", [rule.pk])
            locked.set()
            release.wait(10)

    holder = threading.Thread(target=hold_the_rule)
    holder.start()
    try:
        assert locked.wait(10)
        started = time.monotonic()
        answer = decide(client, claim("c", [gpu_request(1)]))
        elapsed = time.monotonic() - started
    finally:
        release.set()
        holder.join()
    assert answer["allowed"] is False
    assert answer["status"]["reason"] == "ServiceUnavailable"
    assert elapsed < 2.0
    assert not Reservation.objects.exists()
    rule.refresh_from_db()
    assert rule.in_use == 0


def _conninfo() -> str:
    params = connection.get_connection_params()
    return psycopg.conninfo.make_conninfo(
        **{k: v for k, v in params.items() if k in ("host", "port", "user", "dbname", "password")}
    )
