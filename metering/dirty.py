"""Hours marked to be rolled up again: late samples, samples adopted late, and allocations the
sync saw (or saw change) after their hours were rolled up. `metering.rollup.rollup_pending`
works the marks off."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import connection
from django.db.models import Q

from db.bulk import AnyOf
from db.copy import json_rows
from inventory.models import Allocation
from metering import retention
from metering.hours import hour_start, hours_between
from metering.models import DirtyHour

log = logging.getLogger(__name__)


def mark_dirty(*, hours: set[datetime], at: datetime) -> None:
    """Mark the UTC hours holding `hours` as to be rolled up again, as of `at` (a mark made
    while a rollup runs outlives it). One upsert, in hour order, so concurrent marks never
    deadlock.

    Hours of a day whose samples retention has dropped (`metering.retention`) are not marked:
    rolled up again without their samples, their measured time would turn unmeasured and
    bill a closed period's usage anew. Such a day is past TALLY_SAMPLE_RETENTION_DAYS, which
    is longer than any late sample may be (TALLY_INGEST_MAX_AGE_DAYS); only a claim the sync
    sees months late can touch it, and its hours there are logged, not billed."""
    starts = {hour_start(hour) for hour in hours}
    starts -= _dropped(starts, at=at)
    if starts:
        with connection.cursor() as cursor:
            cursor.execute(_MARK, [at, sorted(starts)])


# Each mark a new version (`DirtyHour.version`): what tells a mark a rollup read from one made
# since, as `marked_at` (the writer's time) cannot.
_MARK = f"""
INSERT INTO {DirtyHour._meta.db_table} (hour, marked_at, version)
SELECT hour, %s, nextval('billing_dirtyhour_version')
FROM unnest(%s::timestamptz[]) AS hour ORDER BY hour
ON CONFLICT (hour) DO UPDATE SET marked_at = EXCLUDED.marked_at, version = EXCLUDED.version
"""


def _dropped(starts: set[datetime], *, at: datetime) -> set[datetime]:
    """The hours among `starts` whose day's sample partition retention has dropped."""
    cutoff = retention.retention_cutoff(at)
    old = {start for start in starts if start.astimezone(UTC).date() < cutoff}
    if not old:
        return set()
    kept = retention.sample_partitions()
    dropped = {start for start in old if start.astimezone(UTC).date() not in kept}
    if dropped:
        log.warning(
            "%d hour(s) from %s to %s not marked for rollup: their samples are past retention "
            "(TALLY_SAMPLE_RETENTION_DAYS) and gone",
            len(dropped),
            f"{min(dropped):%Y-%m-%d %H:00}",
            f"{max(dropped):%Y-%m-%d %H:00}",
        )
    return dropped


def mark_claims_dirty(*, claim_ids: list[int], at: datetime) -> None:
    """Mark every hour the claims' allocations span, so usage follows what the sync saw."""
    intervals = Allocation.objects.filter(AnyOf("claim_id", claim_ids)).values_list("start", "end")
    mark_dirty(hours=span_hours(intervals, at=at), at=at)


def mark_changes_dirty(
    *,
    at: datetime,
    spans: Iterable[tuple[datetime, datetime]],
    reattributed: Iterable[int] = (),
    unfilled: Mapping[int, tuple[str, str]] | None = None,
) -> None:
    """Mark only the hours whose usage rows can change because of what changed (see
    `inventory.signals.claims_changed`): each of `spans` up to `at`; every hour of the
    allocations of the `reattributed` claims; every hour of each `unfilled` allocation whose
    (username, job) is no longer what it was when the change was sent. Allocations the sync
    did not touch keep their rows: their intervals and who they charge are as before."""
    intervals: list[tuple[datetime, datetime | None]] = list(spans)
    reattributed = list(reattributed)
    if reattributed:
        intervals += Allocation.objects.filter(AnyOf("claim_id", reattributed)).values_list(
            "start", "end"
        )
    if unfilled:
        intervals += _filled_since(unfilled)
    mark_dirty(hours=span_hours(intervals, at=at), at=at)


def _filled_since(
    unfilled: Mapping[int, tuple[str, str]],
) -> list[tuple[datetime, datetime | None]]:
    """The intervals of the allocations `unfilled` names whose (username, job) is no longer
    what it says, compared in the database: a batch of the sync sends thousands, of which
    none or a few were filled in, and reading each back cost more than the rest of the
    marking. The sent rows travel as one JSON parameter (`db.copy.json_rows`)."""
    sent = [[pk, username, job] for pk, (username, job) in unfilled.items()]
    with connection.cursor() as cursor:
        cursor.execute(_FILLED_SINCE, [json.dumps(sent)])
        return cursor.fetchall()


_FILLED_SINCE = f"""
SELECT allocation.start, allocation."end"
FROM {Allocation._meta.db_table} AS allocation
JOIN ({json_rows("bigint", "text", "text")}) AS sent(id, username, job) ON allocation.id = sent.id
WHERE (allocation.username, allocation.job) IS DISTINCT FROM (sent.username, sent.job)
"""


def span_hours(
    intervals: Iterable[tuple[datetime, datetime | None]], *, at: datetime
) -> set[datetime]:
    """The hours `intervals` reach into, each cut at `at` (an open one runs to `at`); `at`'s
    own hour for an interval that ends at it or starts there."""
    # Merge the intervals first: a large import holds thousands of allocations over the same
    # weeks, and each hour is to be marked once.
    ordered = sorted(
        (start, min(end or at, at) + timedelta(milliseconds=1)) for start, end in intervals
    )
    hours: set[datetime] = set()
    merged_start: datetime | None = None
    merged_end: datetime | None = None
    for start, end in ordered:
        if merged_end is not None and start <= merged_end:
            merged_end = max(merged_end, end)
            continue
        if merged_start is not None and merged_end is not None:
            hours |= hours_between(merged_start, merged_end)
        merged_start, merged_end = start, end
    if merged_start is not None and merged_end is not None:
        hours |= hours_between(merged_start, merged_end)
    return hours


def on_claims_changed(
    sender: Any,
    *,
    claim_ids: list[int],
    at: datetime,
    spans: Iterable[tuple[datetime, datetime]] | None = None,
    reattributed: Iterable[int] = (),
    unfilled: Mapping[int, tuple[str, str]] | None = None,
    **_: Any,
) -> None:
    """`inventory.signals.claims_changed` receiver: the hours the change touched are rolled up
    again; every hour of the claims' allocations where the sender does not say which.

    `unfilled` is compared with the allocations as they are when this runs: quota's receiver
    calls this after its own step, which may fill them in (quota/apps.py;
    tests/metering/test_dirty_marks.py checks it)."""
    if spans is None:
        mark_claims_dirty(claim_ids=claim_ids, at=at)
        return
    mark_changes_dirty(at=at, spans=spans, reattributed=reattributed, unfilled=unfilled)


def on_ownership_changed(
    sender: Any, *, namespace: str, since: datetime | None, at: datetime, **_: Any
) -> None:
    """`teams.ownership.ownership_changed` receiver: the hours of the namespace's allocations
    from `since` (every hour where None) are rolled up again, charged to their new owner."""
    allocations = Allocation.objects.filter(claim__namespace=namespace)
    if since is not None:
        allocations = allocations.filter(Q(end__isnull=True) | Q(end__gt=since))
    intervals = [
        (start if since is None else max(start, since), end)
        for start, end in allocations.values_list("start", "end")
    ]
    mark_dirty(hours=span_hours(intervals, at=at), at=at)
