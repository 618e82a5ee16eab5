"""The quota ledger, and the only code that writes it.

The ledger is each rule's `in_use` and the lines it is the sum of: a live reservation's lines
(`ReservationLine`) and a live gang hold's (`GangReservationLine`). Every write of them is
here, whichever path makes it: the webhook's one reserving statement
(`quota.admission.store`, which builds its statement from the fragments below so that the
rules are locked, checked and counted in one round trip) and the ORM writes of
`quota.services` (the sync, expiry, gangs, the recount). tests/quota/test_ledger_owner.py
keeps it so: no other module writes `in_use` or a line.

Callers hold the locks: the usage lock and the rules in id order (`quota.services.lock_usage`)
outside the webhook, the reserving statement's own row locks within it. Nothing here takes a
lock or opens a transaction of its own.
"""

from __future__ import annotations

from decimal import Decimal

from django.db import connection
from django.db.models import F

from quota.models import (
    GangReservation,
    GangReservationLine,
    QuotaRule,
    Reservation,
    ReservationLine,
)

# What holds amounts on rules: a claim's reservation, or a gang's hold.
Holder = Reservation | GangReservation


def change_lines(holder: Holder, amounts: dict[int, Decimal]) -> None:
    """Make the reservation's (or gang hold's) lines `amounts`, moving each rule's `in_use` by
    the difference. The rules are locked already (`lock_usage`)."""
    stored = {line.rule_id: line.amount for line in holder.lines.all()}
    write_lines(holder, stored, amounts)
    for rule_id in sorted(set(stored) | set(amounts)):
        delta = amounts.get(rule_id, Decimal(0)) - stored.get(rule_id, Decimal(0))
        if delta:
            move_usage(rule_id=rule_id, delta=delta)


def write_lines(holder: Holder, stored: dict[int, Decimal], amounts: dict[int, Decimal]) -> None:
    """Make the reservation's (or gang hold's) lines, `stored` now, `amounts`: only what
    differs is written. Usage does not move: the caller moves it, or moves the amounts from one
    holder to another (a gang's member giving its share back to the gang's hold)."""
    lines = (
        ReservationLine.objects.filter(reservation=holder)
        if isinstance(holder, Reservation)
        else GangReservationLine.objects.filter(gang_reservation=holder)
    )
    gone = [rule_id for rule_id in stored if rule_id not in amounts]
    if gone:
        lines.filter(rule_id__in=gone).delete()
    for rule_id, amount in amounts.items():
        if rule_id not in stored:
            if isinstance(holder, Reservation):
                ReservationLine.objects.create(reservation=holder, rule_id=rule_id, amount=amount)
            else:
                GangReservationLine.objects.create(
                    gang_reservation=holder, rule_id=rule_id, amount=amount
                )
        elif stored[rule_id] != amount:
            lines.filter(rule_id=rule_id).update(amount=amount)


def move_usage(*, rule_id: int, delta: Decimal) -> None:
    """Move the rule's `in_use` by `delta`, relative to what is stored (not a value read
    before), as its lines moved. The rule is locked already."""
    QuotaRule.objects.filter(pk=rule_id).update(in_use=F("in_use") + delta)


def set_usage(*, rule_id: int, in_use: Decimal) -> None:
    """Make the rule's `in_use` the recount of its lines (`quota.services.recount_usage`).
    The rule is locked already, and its lines were made what was recounted."""
    QuotaRule.objects.filter(pk=rule_id).update(in_use=in_use)


def forget_usage() -> None:
    """Every rule's `in_use` back to nothing, once every reservation and its lines are gone
    (the benchmark's reset between runs: `bench/webhook.py`); one statement."""
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {_quoted(QuotaRule)} SET in_use = 0")


# --- The reserving statement's writes -------------------------------------------------------
#
# `quota.admission.store` reserves in one statement (a chain of CTEs; see `_reserve_sql` and
# `_gang_reserve_sql` there): its `kept` CTE is the reservation it inserted (no row when the
# claim does not fit), and these are the CTEs that count it. Each takes its amounts from a row
# source of the statement (`source`: a CTE and its alias, as "asked a") with a `rule_id`
# column.


def _quoted(model: type[QuotaRule | ReservationLine | GangReservationLine]) -> str:
    return connection.ops.quote_name(model._meta.db_table)


def _alias(source: str) -> str:
    return source.split()[-1]


def counted_cte(*, source: str, amount: str, skip_zero: bool = False) -> str:
    """The CTE `counted`: each rule of `source` has its `in_use` moved by `amount` once the
    reservation was kept (the rules are locked by the statement's `locked` CTE before);
    with `skip_zero`, only the rules it moves."""
    where = f"r.id = {_alias(source)}.rule_id" + (f" AND {amount} <> 0" if skip_zero else "")
    return f"""counted AS (
    UPDATE {_quoted(QuotaRule)} r SET in_use = r.in_use + {amount} FROM {source}, kept
    WHERE {where} RETURNING r.id
)"""


def lines_cte(*, source: str, amount: str, skip_null: bool = False) -> str:
    """The CTE `lines`: the kept reservation's lines, `amount` on each rule of `source`; with
    `skip_null`, none where `amount` is NULL (a rule the reservation holds nothing on)."""
    where = f" WHERE {amount} IS NOT NULL" if skip_null else ""
    return f"""lines AS (
    INSERT INTO {_quoted(ReservationLine)} (reservation_id, rule_id, amount)
    SELECT kept.id, {_alias(source)}.rule_id, {amount} FROM kept, {source}{where} RETURNING id
)"""


def hold_lines_made_cte() -> str:
    """The CTE `held`: the lines of a gang's hold just made (`made`), what the gang's demand
    (`split.counted`) leaves beyond the first member's own line."""
    return f"""held AS (
    INSERT INTO {_quoted(GangReservationLine)} (gang_reservation_id, rule_id, amount)
    SELECT made.id, s.rule_id, s.counted - COALESCE(s.line, 0) FROM made, split s
    RETURNING id
)"""


def hold_lines_drawn_cte() -> str:
    """The CTE `drawn`: the live hold's (`hold`) lines after a member drew from it (or topped
    it up): `split.after` on each rule where it differs from what was held."""
    return f"""drawn AS (
    INSERT INTO {_quoted(GangReservationLine)} (gang_reservation_id, rule_id, amount)
    SELECT hold.id, s.rule_id, s.after FROM split s, kept, hold WHERE s.after <> s.held
    ON CONFLICT (gang_reservation_id, rule_id) DO UPDATE SET amount = EXCLUDED.amount
    RETURNING id
)"""
