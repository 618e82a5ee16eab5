"""Named PostgreSQL advisory locks, held to the end of the transaction.

A lock is named by what it guards (`billing.ingest.device`) and keyed by an int4 (a device's
hash, an hour since the epoch). PostgreSQL's two-key form takes the name's class id as its
first key: a stable hash of the name (the same in every process and release), so callers
never write a bare number and two kinds of lock never share keys by accident. Every name is
declared in `LockName`; two names whose ids would collide are refused when this module loads.
A name outlives a move of the code that takes it (the `billing.*` locks metering takes, since
issue 37): processes of two releases running side by side must take the same lock.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Iterable
from typing import Any, Literal, get_args

from django.db import connection
from django.db.backends.utils import CursorWrapper
from django.db.transaction import TransactionManagementError

LockName = Literal[
    # One device's samples while their gaps are worked out (`metering.ingest`); the key is a
    # hash of the device's UUID (a collision only makes two devices wait on each other).
    "billing.ingest.device",
    # One GPU instance's spells while a batch's samples are merged into them
    # (`metering.mig_instances`); the key is a hash of the instance (a collision only makes two
    # instances wait on each other). Taken after the batch's device locks.
    "billing.ingest.mig_instance",
    # One hour's usage rows while they are rolled up (`metering.rollup`); the key is the hour
    # since the epoch.
    "billing.rollup.hour",
    # Quota usage outside the webhook: the rules' `in_use` and reservation lines written by a
    # policy change, the sync's reservations, expiry and the recount (`quota.services
    # .lock_usage`, which then locks the rules it changes in id order); the key is 0.
    "quota.usage",
    # Every writer of rate cards (`billing.rates.closed_periods(lock=True)`), so that the
    # check that no two cards overlap sees every other writer's cards; the key is 0.
    "billing.rate_cards",
    # The refreshes that bill closed periods' late data (`billing.pricing.refresh_statements`),
    # one at a time, so that two open periods never both bill the same late hours; the key
    # is 0. Taken after the refreshed period's row and never held while waiting for a row.
    "billing.late_data",
    # One alert key's rows (`teams.alerts`: raising it, snoozing or lifting it), so that a new
    # alert sees a snooze or lift committed before it and two lifts never lock its rows in a
    # cycle; the key is a hash of the kind and key (a collision only makes two keys wait).
    "teams.alert.key",
    # Which cluster a device identity (UUID or meter id) is live in (`inventory.services`): a
    # sync that may take new devices holds it from the start of its transaction, so two
    # clusters' syncs never both take one GPU; the key is 0. Taken first in the transaction,
    # before any lock a claim's write takes (`quota.usage`), so no cycle.
    "inventory.device.identity",
    # One UTC day's samples while they are compacted into blocks or dropped by retention
    # (`metering.compaction`, `metering.retention`); the key is the day since the epoch.
    # Taken before the devices' locks (`billing.ingest.device`).
    "metering.compact.day",
]

INT4_MIN, INT4_MAX = -(2**31), 2**31 - 1


def _class_id(name: str) -> int:
    """The first four bytes of the name's SHA-256, as a signed int4."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big", signed=True)


def _class_ids(names: Iterable[str]) -> dict[str, int]:
    ids: dict[str, int] = {}
    for name in names:
        class_id = _class_id(name)
        clash = next((other for other, taken in ids.items() if taken == class_id), None)
        if clash is not None:
            raise ValueError(
                f"advisory lock names {clash!r} and {name!r} hash to the same class id "
                f"{class_id}; rename one"
            )
        ids[name] = class_id
    return ids


_CLASS_IDS = _class_ids(get_args(LockName))


def class_id(name: LockName) -> int:
    """The class id (the first key of PostgreSQL's two-key form) of the locks named `name`."""
    try:
        return _CLASS_IDS[name]
    except KeyError:
        raise ValueError(f"undeclared advisory lock name {name!r}; add it to LockName") from None


def text_key(*parts: object) -> int:
    """The int4 key of a lock on what `parts` name (joined by NUL: a device's UUID, an alert's
    kind and key): a hash, so two names may share a key, which only makes their holders wait
    on each other."""
    return zlib.crc32("\0".join(map(str, parts)).encode()) - 2**31


def xact_lock_sql(name: LockName, keys: Iterable[int]) -> tuple[str, list[Any]]:
    """One statement, and its parameters, that takes the locks `(name, key)` for each of
    `keys` in ascending order (so two transactions that lock overlapping keys never wait on
    each other in a cycle), held to the end of the transaction. For a caller that sends it
    with other statements in one round trip; else `advisory_xact_lock`."""
    ordered = sorted(set(keys))
    if ordered and (ordered[0] < INT4_MIN or ordered[-1] > INT4_MAX):
        raise ValueError(
            f"advisory lock keys of {name!r} must be int4: {ordered[0]}..{ordered[-1]}"
        )
    return (
        "SELECT count(pg_advisory_xact_lock(%s, key)) FROM unnest(%s::int4[]) AS key",
        [class_id(name), ordered],
    )


def advisory_xact_lock(
    name: LockName, keys: Iterable[int], *, cursor: CursorWrapper | None = None
) -> None:
    """Take the locks `(name, key)` for each of `keys`, in ascending order, in one round trip
    (on `cursor`, else a new one), held until the transaction ends. Outside a transaction
    they would be let go at once: that is an error."""
    if not connection.in_atomic_block:
        raise TransactionManagementError(
            f"advisory locks {name!r} are held to the end of a transaction: take them in one"
        )
    sql, params = xact_lock_sql(name, keys)
    if cursor is not None:
        cursor.execute(sql, params)
        return
    with connection.cursor() as own:
        own.execute(sql, params)
