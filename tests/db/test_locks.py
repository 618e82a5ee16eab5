"""Named advisory locks: stable class ids, refused collisions, one round trip, real exclusion."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from django.db import connection, connections, transaction
from django.db.transaction import TransactionManagementError

from db import locks


def test_class_ids_are_stable_across_releases() -> None:
    # A changed id lets an old and a new process hold "the same" lock at once during a
    # rolling deploy: these values never change.
    assert locks.class_id("billing.ingest.device") == 416_167_296
    assert locks.class_id("billing.rollup.hour") == -636_416_475


def test_two_names_with_one_class_id_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(locks, "_class_id", lambda name: 7)
    with pytest.raises(ValueError, match="'a' and 'b' hash to the same class id 7"):
        locks._class_ids(["a", "b"])


def test_an_undeclared_name_is_refused() -> None:
    with pytest.raises(ValueError, match="undeclared advisory lock name"):
        locks.class_id("billing.typo")  # type: ignore[arg-type]


def test_the_statement_takes_the_keys_once_in_ascending_order() -> None:
    sql, params = locks.xact_lock_sql("billing.rollup.hour", [5, 3, 5, -1])
    assert sql == "SELECT count(pg_advisory_xact_lock(%s, key)) FROM unnest(%s::int4[]) AS key"
    assert params == [locks.class_id("billing.rollup.hour"), [-1, 3, 5]]
    with pytest.raises(ValueError, match="must be int4"):
        locks.xact_lock_sql("billing.rollup.hour", [2**31])


@pytest.mark.django_db
def test_outside_a_transaction_is_an_error() -> None:
    # pytest-django's test transaction is an atomic block: leave it for this check.
    connection.in_atomic_block, was = False, connection.in_atomic_block
    try:
        with pytest.raises(TransactionManagementError):
            locks.advisory_xact_lock("billing.rollup.hour", [1])
    finally:
        connection.in_atomic_block = was


def held(name: locks.LockName, key: int) -> bool:
    """Whether any session holds the advisory lock of `name` on `key` (pg_locks shows the two
    int4 keys as unsigned oids)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT EXISTS (SELECT FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2 "
            "AND classid::bigint = %s AND objid::bigint = %s AND granted)",
            [locks.class_id(name) % 2**32, key % 2**32],
        )
        row = cursor.fetchone()
        return bool(row and row[0])


@pytest.fixture
def other_session() -> Iterator[None]:
    yield
    connections.close_all()


@pytest.mark.django_db(transaction=True)
def test_a_lock_is_held_to_the_end_of_the_transaction_and_excludes_another(
    other_session: None,
) -> None:
    taken = threading.Event()
    release = threading.Event()

    def holder() -> None:
        with transaction.atomic():
            locks.advisory_xact_lock("billing.ingest.device", [-5, 42])
            taken.set()
            release.wait(10)
        connections.close_all()

    thread = threading.Thread(target=holder)
    thread.start()
    assert taken.wait(10)
    assert held("billing.ingest.device", 42)
    assert held("billing.ingest.device", -5)
    # Another kind of lock on the same key is another lock.
    assert not held("billing.rollup.hour", 42)
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_try_advisory_xact_lock(%s, 42)", [locks.class_id("billing.ingest.device")]
        )
        assert cursor.fetchone() == (False,)
    release.set()
    thread.join(10)
    assert not held("billing.ingest.device", 42)
