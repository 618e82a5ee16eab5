"""`db.prepared.fetch_prepared`: each statement keeps its own server-side-binding cursor on
the connection (a cursor rerun with the query it ran last keeps the adapters of its columns;
issue 38), statements taking turns answer each their own rows, and a new connection gets new
cursors."""

from __future__ import annotations

from decimal import Decimal

import pytest
from django.db import connection

from db import prepared
from db.prepared import fetch_prepared

pytestmark = pytest.mark.django_db(transaction=True)

# The same string objects each call, as the webhook's cached statements are.
NUMBERS = "SELECT %s::bigint + 1, %s::numeric"
WORDS = "SELECT upper(%s), %s::text FROM generate_series(1, %s::int)"


def _cursors() -> dict[str, object]:
    return connection._tally_prepared_cursors  # type: ignore[attr-defined]


def test_statements_taking_turns_answer_their_own_rows_each_on_its_own_cursor() -> None:
    for turn in range(3):
        assert fetch_prepared(NUMBERS, [turn, Decimal("1.5")]) == [(turn + 1, Decimal("1.5"))]
        assert fetch_prepared(WORDS, ["ab", "c", 2]) == [("AB", "c"), ("AB", "c")]
        if turn == 0:
            first = dict(_cursors())
    assert set(first) == {NUMBERS, WORDS}
    assert first[NUMBERS] is not first[WORDS]
    assert _cursors()[NUMBERS] is first[NUMBERS]
    assert _cursors()[WORDS] is first[WORDS]


def test_a_new_connection_gets_new_cursors() -> None:
    fetch_prepared(NUMBERS, [1, Decimal(2)])
    before = _cursors()[NUMBERS]
    connection.close()
    assert fetch_prepared(NUMBERS, [1, Decimal(2)]) == [(2, Decimal(2))]
    after = _cursors()[NUMBERS]
    assert after is not before
    assert after.connection is connection.connection  # type: ignore[attr-defined]


def test_past_the_most_cursors_kept_they_are_made_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prepared, "MAX_CURSORS", 2)
    statements = [f"SELECT %s::int + {n}" for n in range(5)]
    for n, sql in enumerate(statements):
        assert fetch_prepared(sql, [10]) == [(10 + n,)]
        assert len(_cursors()) <= 2
    assert fetch_prepared(statements[0], [1]) == [(1,)]
