"""Compacted samples' blocks as the writers and readers of samples meet them: the window
readers' table expression (`readings_between`) and the writers' thaw (`thaw_samples`).
Compaction itself, and why this is enough, is `metering.compaction`. Imports nothing of
`metering.ingest`, which calls it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import UTC, timedelta

from django.conf import settings
from django.db.backends.utils import CursorWrapper
from django.utils import timezone

from metering.hoursums import SKIP_SETTING
from metering.models import SampleBlock
from metering.retention import MS_PER_DAY, PARENT, day_bounds_ms

log = logging.getLogger(__name__)

BLOCKS = SampleBlock._meta.db_table


def readings_between(lo_ms: int, hi_ms: int) -> str:
    """The table expression of every sample's reading in `[lo_ms, hi_ms)`, from
    `billing_sample` and the blocks alike, with the columns the rollup reads from
    `billing_sample` (device_uuid, ts_ms, gpu_util, gap_ms, covered_ms, placed_gpu_instance).
    The bounds are written as literals, so the planner prunes partitions and blocks by them."""
    return f"metering_readings({int(lo_ms)}, {int(hi_ms)})"


# Per device and span `[lo, hi]`: delete the blocks whose span's inside `(lo_ms, hi_ms)`
# meets it, and put their samples back in `billing_sample`. The day bounds pick the blocks
# through the unique index; a block's span lies in its day. A move: the per device-hour sums
# count compacted samples already, so the statement's rows tell the trigger to skip it
# (`metering.hoursums`; the setting is set only when a row goes in, and the trigger clears it).
_THAW_SQL = f"""
WITH r(uuid, lo, hi) AS (SELECT * FROM unnest(%s::text[], %s::bigint[], %s::bigint[])),
thawed AS (
    DELETE FROM {BLOCKS} AS b USING r
    WHERE b.device_uuid = r.uuid AND b.day_ms <= r.hi AND b.day_ms > r.lo - {MS_PER_DAY}
      AND b.lo_ms < r.hi AND b.hi_ms > r.lo
    RETURNING b.*
)
INSERT INTO {PARENT} (device_uuid, ts_ms, gpu_util, mem_used_bytes, processes, node,
                      received_at, gap_ms, covered_ms)
SELECT t.device_uuid, t.day_ms + u.off, u.gpu_util, u.mem_used_bytes, u.processes::jsonb,
       u.node, u.received_at, u.gap_ms, u.covered_ms
FROM thawed AS t
CROSS JOIN LATERAL unnest(t.ts_off, t.gpu_util, t.mem_used_bytes, t.processes, t.node,
                          t.received_at, t.gap_ms, t.covered_ms)
     AS u(off, gpu_util, mem_used_bytes, processes, node, received_at, gap_ms, covered_ms)
WHERE set_config('{SKIP_SETTING}', 'on', true) = 'on'
"""


def _uncompacted_from_ms() -> int:
    """An instant no block's span reaches: compaction takes days before TALLY_SAMPLE_COMPACT_
    AFTER_DAYS before its own today, and a block's span ends before its day does; a day of
    margin for a compacting worker's clock ahead of this one's. A write at or after it, the
    usual one (today's samples), skips the query."""
    today = timezone.now().astimezone(UTC).date()
    first = today - timedelta(days=int(settings.TALLY_SAMPLE_COMPACT_AFTER_DAYS) - 1)
    return day_bounds_ms(first)[0]


def thaw_samples(cursor: CursorWrapper, spans: Mapping[str, tuple[int, int]]) -> int:
    """Put back into `billing_sample` the compacted samples of each device whose block's span
    meets its `[first_ms, last_ms]` in `spans`; how many. Called by every writer of samples
    under the devices' locks (`lock_devices`) and before it reads its neighbours: afterwards
    `billing_sample` alone holds every sample the write can meet. Nothing when no block is
    there: a write of the last days (the usual one) skips even the query, one index probe a
    device otherwise."""
    if not spans or min(lo for lo, _ in spans.values()) >= _uncompacted_from_ms():
        return 0
    uuids = sorted(spans)
    cursor.execute(
        _THAW_SQL,
        [uuids, [spans[uuid][0] for uuid in uuids], [spans[uuid][1] for uuid in uuids]],
    )
    thawed = cursor.rowcount
    if thawed:
        log.info("thawed %d compacted sample(s) of %d device(s)", thawed, len(uuids))
    return thawed
