"""Hours marked to be rolled up again: late samples, samples adopted late, and allocations the
sync saw (or saw change) after their hours were rolled up. `billing.rollup.rollup_pending`
works the marks off."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from billing.hours import hour_start, hours_between
from billing.models import DirtyHour
from inventory.models import Allocation


def mark_dirty(*, hours: set[datetime], at: datetime) -> None:
    """Mark the UTC hours holding `hours` as to be rolled up again, as of `at` (a mark made
    while a rollup runs outlives it). One upsert, in hour order, so concurrent marks never
    deadlock."""
    starts = {hour_start(hour) for hour in hours}
    if starts:
        DirtyHour.objects.bulk_create(
            [DirtyHour(hour=hour, marked_at=at) for hour in sorted(starts)],
            update_conflicts=True,
            unique_fields=["hour"],
            update_fields=["marked_at"],
        )


def mark_claims_dirty(*, claim_ids: list[int], at: datetime) -> None:
    """Mark every hour the claims' allocations span, so usage follows what the sync saw."""
    # Merge the intervals first: a large import holds thousands of allocations over the same
    # weeks, and each hour is to be marked once.
    intervals = sorted(
        (start, min(end or at, at) + timedelta(milliseconds=1))
        for start, end in Allocation.objects.filter(claim_id__in=claim_ids).values_list(
            "start", "end"
        )
    )
    hours: set[datetime] = set()
    merged_start: datetime | None = None
    merged_end: datetime | None = None
    for start, end in intervals:
        if merged_end is not None and start <= merged_end:
            merged_end = max(merged_end, end)
            continue
        if merged_start is not None and merged_end is not None:
            hours |= hours_between(merged_start, merged_end)
        merged_start, merged_end = start, end
    if merged_start is not None and merged_end is not None:
        hours |= hours_between(merged_start, merged_end)
    mark_dirty(hours=hours, at=at)


def on_claims_changed(sender: Any, *, claim_ids: list[int], at: datetime, **_: Any) -> None:
    """`inventory.signals.claims_changed` receiver: the claims' hours are rolled up again."""
    mark_claims_dirty(claim_ids=claim_ids, at=at)
