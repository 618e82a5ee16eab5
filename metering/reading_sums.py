"""An engine's readings summed here, per device and hour, as they come parsed (`Readings
.columns`), rather than loaded reading by reading for the rollup's SQL to sum.

`hour_sums` makes the rows `metering.rollup._PER_HOUR_SQL` makes of the same readings read
through `metering.prometheus.load_readings`'s view (gap to the device's next reading, NULL
after its last, no covered time), with the same integer arithmetic: a reading's utilisation
(`UTIL_SCALE`ths of a percent, each rounded half to even as PostgreSQL's round() of a double
and Python's round() do) holds from its instant for its gap to the device's next reading, at
most the hold; the part of that span in its own hour (cut at the window's end) counts there,
the part past the hour's end spills into the next. `piece_coverage` makes what
`metering.rollup._PIECE_COVERAGE_SQL` makes of them for the pieces of hours allocations hold in
part. The rollup then loads only the sums (a row per device and hour: a thousand GPUs' hour is
about 2,000 small rows, not 62,000 readings) and reads them as it reads the per device-hour
sums kept of samples (`metering.hoursums`).

Only the last reading of a device in an hour can reach past the hour's end or the window's:
every other one's span ends at the latest at the next reading, in the same hour and before the
window's end. So a device's spans are its gaps (at most the hold) but at those readings.
"""

from __future__ import annotations

import contextlib
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import repeat
from operator import mul, sub

from metering.hours import MS_PER_HOUR, UTIL_SCALE

# A device's readings as two lists side by side: instants (ms since the epoch), rising, and
# percents (`metering.prometheus.Readings.columns`). Kept so from the engine's series to the
# sums: no tuple per reading to make, take apart again and have the garbage collector go over.
Columns = tuple[list[int], list[float]]
# (meter id, hour since the epoch, covered ms, covered ms times utilisation, spill ms into the
# next hour or None, that spill times utilisation or None): `_PER_HOUR_SQL`'s row.
HourSum = tuple[str, int, int, int, int | None, int | None]
_SCALE = float(UTIL_SCALE)
_WHOLE = float.is_integer


def _units(percents: Sequence[float]) -> list[int] | None:
    """Each percent in `UTIL_SCALE`ths, rounded half to even (ValueError for a NaN, as the
    SQL's cast of it to bigint fails); None where every percent is whole (DCGM's are): then
    a sum of spans times percents, made in doubles, is exact (each product and sum a whole
    number under 2**53: spans of an hour and its hold, times at most 100), and times
    `UTIL_SCALE` is the sum of spans times units, with no rounding per reading."""
    with contextlib.suppress(TypeError):  # (a percent that is no float: rounded below)
        if all(map(_WHOLE, percents)):
            return None
    return list(map(round, map(mul, percents, repeat(_SCALE))))


def _weighted(spans: list[int], percents: Sequence[float], units: list[int] | None) -> int:
    """The sum of `spans` times utilisation in `UTIL_SCALE`ths (`_units`)."""
    if units is None:
        return int(sum(map(mul, spans, percents))) * UTIL_SCALE
    return sum(map(mul, spans, units))


def hour_sums(
    columns: Mapping[str, Columns], *, start_ms: int, end_ms: int, hold_ms: int
) -> Iterator[HourSum]:
    """Per device and hour, the sums of its readings in `[start_ms - hold_ms, end_ms)`, as
    `_PER_HOUR_SQL` makes them from the view of `columns` (instants rising, one reading an
    instant). A device's readings outside that range count only by the gap they end."""
    low = start_ms - hold_ms
    for meter_id, (stamps, percents) in columns.items():
        count = len(stamps)
        if not count:
            continue
        lo = bisect_left(stamps, low) if stamps[0] < low else 0
        hi = bisect_left(stamps, end_ms) if stamps[-1] >= end_ms else count
        if lo >= hi:
            continue
        whole = lo == 0 and hi == count  # (usually: the engine is asked for that range)
        own = stamps if whole else stamps[lo:hi]
        # Each reading's span: its gap to the next (which may lie past the window's end), at
        # most the hold; the hold after the device's last.
        spans = list(map(sub, stamps[lo + 1 : hi + 1], own))
        if hi == count:
            spans.append(hold_ms)
        if max(spans) > hold_ms:
            spans = [span if span < hold_ms else hold_ms for span in spans]
        values = percents if whole else percents[lo:hi]
        units = _units(values)
        first = own[0] // MS_PER_HOUR
        last = own[-1] // MS_PER_HOUR
        at = 0
        for hour in range(first, last + 1):
            next_h = (hour + 1) * MS_PER_HOUR
            upto = len(own) if hour == last else bisect_left(own, next_h, at)
            if upto == at:
                continue
            # The hour's last reading: its span cut at the hour's end and the window's.
            end = upto - 1
            ts = own[end]
            reach = ts + spans[end]
            spans[end] = min(reach, next_h, end_ms) - ts
            spill = spill_weighted = None
            if reach > next_h:
                spill = min(reach, end_ms) - next_h
                spill_weighted = _weighted([spill], values[end:upto], units and units[end:upto])
            if at == 0 and upto == len(own):
                covered = sum(spans)
                weighted = _weighted(spans, values, units)
            else:
                part = spans[at:upto]
                covered = sum(part)
                weighted = _weighted(part, values[at:upto], units and units[at:upto])
            yield meter_id, hour, covered, weighted, spill, spill_weighted
            at = upto


def piece_coverage(
    columns: Mapping[str, Columns],
    pieces: Iterable[tuple[int, str, int, int]],
    *,
    hold_ms: int,
) -> dict[int, tuple[int, int]]:
    """Per piece (`(piece, meter id, start, end)`; a piece may come once per name): the
    milliseconds the readings of its device cover within `[start, end)` and those
    milliseconds times utilisation, summed over its names, as `_PIECE_COVERAGE_SQL` makes
    them; a piece they do not cover is left out."""
    found: dict[int, tuple[int, int]] = {}
    for piece, meter_id, a0, a1 in pieces:
        column = columns.get(meter_id)
        if column is None:
            continue
        stamps, percents = column
        count = len(stamps)
        covered_sum = weighted_sum = 0
        any_covered = False
        for index in range(bisect_left(stamps, a0 - hold_ms), bisect_left(stamps, a1)):
            ts = stamps[index]
            span = stamps[index + 1] - ts if index + 1 < count else hold_ms
            covered = min(ts + min(span, hold_ms), a1) - max(ts, a0)
            if covered > 0:
                any_covered = True
                covered_sum += covered
                weighted_sum += covered * round(percents[index] * _SCALE)
        if any_covered:
            before = found.get(piece, (0, 0))
            found[piece] = (before[0] + covered_sum, before[1] + weighted_sum)
    return found
