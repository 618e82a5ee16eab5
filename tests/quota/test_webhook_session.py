"""What an admission sets on its PostgreSQL session: timeouts and commit durability.

An admission runs in autocommit (its read and its reserving statement are each atomic): its
first read sets the webhook's timeouts on the session for the statements after it, and its
last statement sets the session's own back. Each statement that writes sets the durability of
its own commit, for its transaction only: as configured for a reservation, not waiting for the
disk for a decision that reserved nothing. However it ends, the connection keeps none of them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from django.db import connection
from django.test import Client

from quota.admission import store
from quota.models import QuotaRule, Reservation
from tests.quota.fixtures import claim, decide, gpu_request, make_team, post, review

pytestmark = [pytest.mark.usefixtures("fleet")]
NAMES = ("statement_timeout", "lock_timeout", "synchronous_commit")
WRITING = ("WITH asked", "INSERT")


def _show(name: str) -> str:
    with connection.cursor() as cursor:
        cursor.execute(f"SHOW {name}")
        value: str = cursor.fetchone()[0]
        return value


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict[str, str]]]:
    """For each of the admission's writing statements: the timeouts in effect as it starts,
    and the commit durability in effect when its transaction commits.

    In autocommit a statement's transaction commits as it ends, with nothing in between to
    look; here it runs in a transaction block that commits just after the look, the same
    statement in the same session otherwise.
    """
    seen: list[dict[str, str]] = []
    fetch = store.fetch_prepared

    def spying(sql: str, params: list[Any]) -> list[tuple[Any, ...]]:
        if not sql.lstrip().startswith(WRITING):
            return fetch(sql, params)
        raw = connection.connection
        at_start = {name: raw.execute(f"SHOW {name}").fetchone()[0] for name in NAMES}
        own_block = raw.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        if own_block:
            raw.execute("BEGIN")
        try:
            rows = fetch(sql, params)
            at_commit = raw.execute("SHOW synchronous_commit").fetchone()[0]
        finally:
            if own_block:
                raw.execute("COMMIT")
        seen.append({**at_start, "synchronous_commit": at_commit})
        return rows

    monkeypatch.setattr(store, "fetch_prepared", spying)
    yield seen


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("pooling", [False, True])
@pytest.mark.parametrize(("durable", "expected"), [(True, "on"), (False, "off")])
def test_an_admission_bounds_its_waits_and_commits_as_configured(
    client: Client,
    settings: Any,
    seen: list[dict[str, str]],
    pooling: bool,
    durable: bool,
    expected: str,
) -> None:
    settings.TALLY_WEBHOOK_DB_TIMEOUT_MS = 1234
    settings.TALLY_WEBHOOK_SYNCHRONOUS_COMMIT = durable
    settings.DATABASE_TRANSACTION_POOLING = pooling
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 2}])
    own = {name: _show(name) for name in NAMES}
    assert own["lock_timeout"] != "1234ms"
    assert decide(client, claim("fits", [gpu_request(2)]))["allowed"] is True
    assert decide(client, claim("over", [gpu_request(1)]))["allowed"] is False
    wanted = {"statement_timeout": "1234ms", "lock_timeout": "1234ms"}
    # The reservation commits as configured; the denial, which reserved nothing, is recorded
    # without waiting for the disk.
    assert seen == [
        {**wanted, "synchronous_commit": expected},
        {**wanted, "synchronous_commit": "off"},
    ]
    assert {name: _show(name) for name in NAMES} == own
    assert connection.connection.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


@pytest.mark.django_db
def test_within_a_callers_transaction_its_commit_keeps_the_callers_durability(
    client: Client, settings: Any, seen: list[dict[str, str]]
) -> None:
    """In a caller's transaction (here the test's) the commit is the caller's: an admission
    does not make it less durable."""
    settings.TALLY_WEBHOOK_DB_TIMEOUT_MS = 1234
    settings.TALLY_WEBHOOK_SYNCHRONOUS_COMMIT = False
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 2}])
    own = _show("synchronous_commit")
    assert decide(client, claim("fits", [gpu_request(2)]))["allowed"] is True
    assert [s["synchronous_commit"] for s in seen] == [own]
    assert seen[0]["lock_timeout"] == "1234ms"
    assert _show("synchronous_commit") == own


@pytest.mark.django_db(transaction=True)
def test_however_an_admission_ends_the_connection_keeps_its_own_settings(
    client: Client, settings: Any, seen: list[dict[str, str]]
) -> None:
    settings.TALLY_WEBHOOK_DB_TIMEOUT_MS = 1234
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 4}])
    own = {name: _show(name) for name in NAMES}
    endings = {
        "admitted": lambda: decide(client, claim("c", [gpu_request(2)])),
        "replayed": lambda: decide(client, claim("c", [gpu_request(2)])),
        "dry run": lambda: decide(client, claim("d", [gpu_request(1)]), dry_run=True),
        "denied when planned": lambda: decide(client, claim("e", [gpu_request(3)])),
        "unowned namespace": lambda: decide(client, claim("f", [gpu_request(1)], "nobody")),
        "mutating webhook": lambda: post(
            client, review(claim("g", [gpu_request(1)])), "/admission/resourceclaims/mutate"
        ).json()["response"],
    }
    for ending, admit in endings.items():
        answer = admit()
        assert {name: _show(name) for name in NAMES} == own, ending
        assert answer["allowed"] is (ending not in ("denied when planned",)), ending
    # Only the statements that write ran with the webhook's settings, every one of them.
    assert len(seen) == 3
    assert all(s["lock_timeout"] == "1234ms" for s in seen)


@pytest.mark.django_db(transaction=True)
def test_behind_a_transaction_pooler_the_settings_stay_in_the_admissions_transaction(
    client: Client, settings: Any
) -> None:
    settings.TALLY_WEBHOOK_DB_TIMEOUT_MS = 1234
    settings.DATABASE_TRANSACTION_POOLING = True
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 10}])
    own = _show("lock_timeout")
    assert decide(client, claim("c", [gpu_request(1)]))["allowed"] is True
    assert _show("lock_timeout") == own != "1234ms"
    assert Reservation.objects.filter(name="c").exists()


def _a_slow_reservation_is_cut_short(
    client: Client, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings.TALLY_WEBHOOK_DB_TIMEOUT_MS = 100
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 10}])
    own = {name: _show(name) for name in NAMES}
    fetch = store.fetch_prepared

    def slow(sql: str, params: list[Any]) -> list[tuple[Any, ...]]:
        if sql.lstrip().startswith("WITH asked"):
            with connection.cursor() as cursor:  # as a statement that stalls
                cursor.execute("SELECT pg_sleep(5)")
        return fetch(sql, params)

    monkeypatch.setattr(store, "fetch_prepared", slow)
    started = time.monotonic()
    answer = decide(client, claim("c", [gpu_request(1)]))
    # Cut at 100 ms: well before the admission's deadline (2.5 s) or the statement's end
    # would, with room for a busy machine.
    assert time.monotonic() - started < 2.0
    assert answer["allowed"] is False
    assert answer["status"]["reason"] == "ServiceUnavailable"
    assert {name: _show(name) for name in NAMES} == own
    assert not Reservation.objects.exists()
    assert QuotaRule.objects.get(name="all-gpus").in_use == 0


@pytest.mark.django_db(transaction=True)
def test_a_stalled_statement_is_cut_short_by_the_statement_timeout(
    client: Client, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _a_slow_reservation_is_cut_short(client, settings, monkeypatch)


@pytest.mark.django_db
def test_within_a_callers_transaction_a_failed_admission_leaves_it_usable(
    client: Client, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inside a transaction (here the test's) the admission takes a savepoint: the statement
    that failed is rolled back alone, and the caller's transaction goes on."""
    _a_slow_reservation_is_cut_short(client, settings, monkeypatch)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("pooling", [False, True])
def test_a_rule_locked_elsewhere_is_a_clear_denial_within_the_lock_timeout(
    client: Client, settings: Any, pooling: bool
) -> None:
    """The webhook's lock timeout bounds the reserving statement's wait for the rule's row
    (in autocommit, or in the admission's transaction behind a pooler), and nothing is
    reserved."""
    settings.TALLY_WEBHOOK_DB_TIMEOUT_MS = 300
    settings.DATABASE_TRANSACTION_POOLING = pooling
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 10}])
    rule = QuotaRule.objects.get(name="all-gpus")
    with rule_locked_by_another_session(rule.pk):
        started = time.monotonic()
        answer = decide(client, claim("c", [gpu_request(1)]))
        elapsed = time.monotonic() - started
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


@contextmanager
def rule_locked_by_another_session(rule_id: int) -> Iterator[None]:
    """The rule's row locked (FOR UPDATE) by another session while the block runs."""
    locked, release = threading.Event(), threading.Event()

    def hold_the_rule() -> None:
        with psycopg.connect(_conninfo()) as other:
            other.execute("SELECT 1 FROM quota_quotarule WHERE id = %s FOR UPDATE", [rule_id])
            locked.set()
            release.wait(10)

    holder = threading.Thread(target=hold_the_rule)
    holder.start()
    try:
        assert locked.wait(10)
        yield
    finally:
        release.set()
        holder.join()


@pytest.mark.django_db(transaction=True)
def test_a_connection_lost_mid_admission_is_closed_and_the_next_admission_reconnects(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 10}])
    fetch = store.fetch_prepared

    def lost(sql: str, params: list[Any]) -> list[tuple[Any, ...]]:
        if sql.lstrip().startswith("WITH asked"):
            backend = connection.connection.info.backend_pid
            with psycopg.connect(_conninfo(), autocommit=True) as other:
                other.execute("SELECT pg_terminate_backend(%s)", [backend])
        return fetch(sql, params)

    monkeypatch.setattr(store, "fetch_prepared", lost)
    answer = decide(client, claim("c1", [gpu_request(1)]))
    assert answer["allowed"] is False
    assert answer["status"]["reason"] == "ServiceUnavailable"
    assert connection.connection is None  # closed: it kept nothing of the admission's
    monkeypatch.setattr(store, "fetch_prepared", fetch)
    assert decide(client, claim("c2", [gpu_request(1)]))["allowed"] is True
    assert list(Reservation.objects.values_list("name", flat=True)) == ["c2"]


def _wait_until_idle(pid: int) -> None:
    """Until the backend `pid` (a connection the webhook gave up on) has finished its
    statement: what it commits is then there to see."""
    with psycopg.connect(_conninfo(), autocommit=True) as other:
        for _ in range(100):
            row = other.execute(
                "SELECT state FROM pg_stat_activity WHERE pid = %s", [pid]
            ).fetchone()
            if row is None or row[0] != "active":
                return
            time.sleep(0.05)
    raise AssertionError(f"backend {pid} still busy")


@pytest.mark.django_db(transaction=True)
def test_a_reservation_that_would_come_after_the_deadline_is_not_made(
    client: Client, settings: Any
) -> None:
    """The reserving statement waits for a rule's lock past the admission's deadline (well
    within its lock timeout): the webhook answers at the deadline, and the statement, when
    it gets the lock, reserves nothing."""
    settings.TALLY_WEBHOOK_DEADLINE_MS = 400
    settings.TALLY_WEBHOOK_DB_TIMEOUT_MS = 5000
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 10}])
    rule = QuotaRule.objects.get(name="all-gpus")
    with rule_locked_by_another_session(rule.pk):
        connection.ensure_connection()
        backend = connection.connection.info.backend_pid
        started = time.monotonic()
        answer = decide(client, claim("c", [gpu_request(1)]))
        elapsed = time.monotonic() - started
    _wait_until_idle(backend)
    assert answer["allowed"] is False
    assert answer["status"]["reason"] == "ServiceUnavailable"
    assert elapsed < 0.4 + 1.1, elapsed  # at the deadline, not the lock's end (5 s or more)
    assert not Reservation.objects.exists()
    rule.refresh_from_db()
    assert rule.in_use == 0


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("path", ["/admission/resourceclaims", "/admission/resourceclaims/mutate"])
def test_the_first_read_is_given_up_at_the_deadline(
    client: Client, settings: Any, path: str
) -> None:
    """The admission's first read has no statement timeout yet (it sets it for the next
    ones): held up by a lock (or a database that went silent), it is given up at the
    deadline all the same, and the connection with it."""
    settings.TALLY_WEBHOOK_DEADLINE_MS = 400
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 10}])
    locked, release = threading.Event(), threading.Event()

    def lock_the_rules() -> None:
        with psycopg.connect(_conninfo()) as other:
            other.execute("LOCK TABLE quota_quotarule IN ACCESS EXCLUSIVE MODE")
            locked.set()
            release.wait(10)

    holder = threading.Thread(target=lock_the_rules)
    holder.start()
    try:
        assert locked.wait(10)
        started = time.monotonic()
        response = post(client, review(claim("c", [gpu_request(1)])), path)
        elapsed = time.monotonic() - started
    finally:
        release.set()
        holder.join()
    answer = response.json()["response"]
    assert answer["allowed"] is False
    assert answer["status"]["reason"] == "ServiceUnavailable"
    assert elapsed < 0.4 + 1.1, elapsed  # at the deadline, not the lock's end (5 s or more)
    assert connection.connection is None  # given up: never used again
    assert decide(client, claim("next", [gpu_request(1)]))["allowed"] is True
