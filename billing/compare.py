"""Did it help? Two windows of a team or of the fleet compared: the change in utilisation split
into what the workload mix did and what the jobs' own efficiency did (issue 19, item 4).

Utilisation is utilised / measured hours, where measured = allocated - unmeasured = utilised +
idle: hours without samples are neither utilised nor idle, so they are left out of both sides
of the ratio (and shown apart, as coverage), rather than counted as idle.

Jobs are what billing charges usage to (`UsageHour.job`, "Kind/name" of the claim's owner),
keyed as `/api/v1/usage/jobs/` keys them, by team, namespace and job; a claim without an owner
(job "") is a workload of its own, keyed by its claim's name, so unrelated standalone claims of
a namespace are not mixed into one job. Hours of one unit only (GPU-hours by default): hours of
different units never add up.

The decomposition (`decompose`), for windows 0 (before) and 1 (after), a job j with measured
hours m_j and utilised hours u_j, window totals M and U, overall ratio R = U / M:

- C, the jobs with measured hours in both windows; R_C = sum_C u / sum_C m in each window
  (0 when C is empty); within C, the share s_j = m_j / sum_C m and efficiency e_j = u_j / m_j.
- mix        = sum_C (e_mid_j - R_C_mid) (s1_j - s0_j)
- efficiency = sum_C s_mid_j (e1_j - e0_j)
- entering   = sum over jobs measured only after:  (m1_j / M1) (e1_j - R_C1)  = R1 - R_C1
- leaving    = -sum over jobs measured only before: (m0_j / M0) (e0_j - R_C0) = -(R0 - R_C0)

where x_mid = (x0 + x1) / 2 (midpoint weights). Since s1 e1 - s0 e0 = s_mid (e1 - e0) +
e_mid (s1 - s0) and the shifts s1 - s0 sum to 0 over C (so centring e_mid on R_C_mid changes
no sum, only makes each job's mix term read "more weight on a job better than average"),
mix + efficiency = R_C1 - R_C0, and mix + efficiency + entering + leaving = R1 - R0 exactly.
Swapping the windows negates every part (entering and leaving trade places): the split does
not depend on which window is called "before". All of it in `Fraction`s; rounding only where
figures are shown (`shown_parts`, which keeps the shown parts adding up to the shown total).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import ROUND_HALF_EVEN, Decimal
from enum import StrEnum
from fractions import Fraction
from typing import Any

from django.db.models import Case, CharField, F, Q, Sum, Value, When

from billing import windows
from billing.rounding import largest_remainders
from billing.units import hours_label
from inventory.models import Unit
from metering.hours import KEPT_HOURS, hours_from_ms, idle_of
from metering.models import UsageHour
from teams.models import Team

ZERO = Fraction(0)


@dataclass(frozen=True)
class Window:
    """A half-open interval `[start, end)` of whole UTC hours."""

    start: datetime
    end: datetime

    def __str__(self) -> str:
        return f"{self.start:%Y-%m-%dT%H:%MZ}..{self.end:%Y-%m-%dT%H:%MZ}"

    def q(self) -> Q:
        return Q(hour__gte=self.start, hour__lt=self.end)


def parse_window(start: str, end: str) -> Window:
    """`[start, end)` from two bounds, through the one window parser
    (`billing.windows.parse_window`); `ValueError` when either is not one or the window is
    reversed or empty."""
    window = windows.parse_window({"start": start, "end": end}, with_period=False, required=True)
    assert window.start is not None and window.end is not None
    return Window(window.start, window.end)


def parse_unit(value: str) -> str:
    """A unit (`inventory.models.Unit`); `ValueError` naming the ones there are."""
    if value not in Unit.values:
        raise ValueError(f"{value!r} is not a unit: give one of {', '.join(Unit.values)}")
    return value


@dataclass(frozen=True, order=True)
class JobKey:
    """A job as billing charges it: team slug ("" for none), namespace, job ("Kind/name"),
    and for a claim without an owner (job "") the claim's name."""

    team: str
    namespace: str
    job: str
    claim: str = ""

    def __str__(self) -> str:
        return f"{self.namespace}/{self.job or f'claim {self.claim}'}"


@dataclass(frozen=True)
class Hours:
    """A job's or a window's hours, in milliseconds of the unit."""

    allocated_ms: int = 0
    utilised_ms: int = 0
    unmeasured_ms: int = 0

    @property
    def measured_ms(self) -> int:
        return self.allocated_ms - self.unmeasured_ms

    @property
    def idle_ms(self) -> int:
        return idle_of(self.allocated_ms, self.utilised_ms, self.unmeasured_ms)

    @property
    def ratio(self) -> Fraction | None:
        """Utilised over measured hours; None with no measured hours."""
        return Fraction(self.utilised_ms, self.measured_ms) if self.measured_ms > 0 else None

    def __add__(self, other: Hours) -> Hours:
        return Hours(
            allocated_ms=self.allocated_ms + other.allocated_ms,
            utilised_ms=self.utilised_ms + other.utilised_ms,
            unmeasured_ms=self.unmeasured_ms + other.unmeasured_ms,
        )


class Presence(StrEnum):
    """Where a job has measured hours: both windows, only after, only before, or neither (all
    its hours unmeasured: it weighs nothing in either ratio)."""

    BOTH = "both"
    ENTERING = "entering"
    LEAVING = "leaving"
    UNMEASURED = "unmeasured"


@dataclass(frozen=True)
class Parts:
    """A change in utilisation (a fraction, 0.125 = 12.5 points) and its four parts."""

    mix: Fraction = ZERO
    efficiency: Fraction = ZERO
    entering: Fraction = ZERO
    leaving: Fraction = ZERO

    @property
    def total(self) -> Fraction:
        return self.mix + self.efficiency + self.entering + self.leaving

    def __add__(self, other: Parts) -> Parts:
        return Parts(
            mix=self.mix + other.mix,
            efficiency=self.efficiency + other.efficiency,
            entering=self.entering + other.entering,
            leaving=self.leaving + other.leaving,
        )


@dataclass(frozen=True)
class JobChange:
    """One job's hours in each window and its contribution to each part (`parts` None when a
    window has no measured hours at all, so there is no change to split)."""

    key: JobKey
    before: Hours
    after: Hours
    presence: Presence
    parts: Parts | None


@dataclass(frozen=True)
class Decomposition:
    """Both windows' totals, each job's change, and the whole's parts."""

    before: Hours
    after: Hours
    jobs: list[JobChange]
    parts: Parts | None  # None: a window without measured hours has no utilisation


def _presence(before: Hours, after: Hours) -> Presence:
    if before.measured_ms > 0:
        return Presence.BOTH if after.measured_ms > 0 else Presence.LEAVING
    return Presence.ENTERING if after.measured_ms > 0 else Presence.UNMEASURED


def _job_parts(
    before: Hours,
    after: Hours,
    presence: Presence,
    *,
    common: tuple[Hours, Hours],
    totals: tuple[Hours, Hours],
) -> Parts:
    common_ratio = [side.ratio or ZERO for side in common]
    if presence is Presence.BOTH:
        e0 = Fraction(before.utilised_ms, before.measured_ms)
        e1 = Fraction(after.utilised_ms, after.measured_ms)
        s0 = Fraction(before.measured_ms, common[0].measured_ms)
        s1 = Fraction(after.measured_ms, common[1].measured_ms)
        centre = (common_ratio[0] + common_ratio[1]) / 2
        return Parts(
            mix=((e0 + e1) / 2 - centre) * (s1 - s0),
            efficiency=(s0 + s1) / 2 * (e1 - e0),
        )
    if presence is Presence.ENTERING:
        share = Fraction(after.measured_ms, totals[1].measured_ms)
        return Parts(entering=share * ((after.ratio or ZERO) - common_ratio[1]))
    if presence is Presence.LEAVING:
        share = Fraction(before.measured_ms, totals[0].measured_ms)
        return Parts(leaving=-share * ((before.ratio or ZERO) - common_ratio[0]))
    return Parts()


def decompose(before: Mapping[JobKey, Hours], after: Mapping[JobKey, Hours]) -> Decomposition:
    """The shift-share decomposition of the module's docstring, per job and in all. Jobs in
    key order; the per-job parts sum exactly to the whole's."""
    keys = sorted(set(before) | set(after))
    empty = Hours()
    pairs = [(key, before.get(key, empty), after.get(key, empty)) for key in keys]
    totals = (sum((b for _, b, _ in pairs), empty), sum((a for _, _, a in pairs), empty))
    presences = [_presence(b, a) for _, b, a in pairs]
    both = [(b, a) for (_, b, a), p in zip(pairs, presences, strict=True) if p is Presence.BOTH]
    common = (sum((b for b, _ in both), empty), sum((a for _, a in both), empty))
    splittable = totals[0].measured_ms > 0 and totals[1].measured_ms > 0
    jobs = [
        JobChange(
            key=key,
            before=b,
            after=a,
            presence=presence,
            parts=_job_parts(b, a, presence, common=common, totals=totals) if splittable else None,
        )
        for (key, b, a), presence in zip(pairs, presences, strict=True)
    ]
    parts = (
        sum((job.parts for job in jobs if job.parts is not None), Parts()) if splittable else None
    )
    return Decomposition(before=totals[0], after=totals[1], jobs=jobs, parts=parts)


@dataclass(frozen=True)
class Comparison:
    """Two windows of a team (or of the fleet: `team` None) compared, in hours of `unit`."""

    team: Team | None
    unit: str
    before_window: Window
    after_window: Window
    decomposition: Decomposition

    @property
    def scope(self) -> str:
        return self.team.slug if self.team else "fleet"

    @property
    def hours_label(self) -> str:
        return hours_label(self.unit)


def window_hours(
    *, team: Team | None, unit: str, before: Window, after: Window
) -> tuple[dict[JobKey, Hours], dict[JobKey, Hours]]:
    """Each job's hours of `unit` in each window, summed in SQL in one query. The fleet (team
    None) includes the usage of namespaces of no team."""
    rows = UsageHour.objects.filter(before.q() | after.q(), unit=unit)
    if team is not None:
        rows = rows.filter(team=team)
    claim_key = Case(
        When(job="", then=F("claim_name")), default=Value(""), output_field=CharField()
    )
    sums: dict[str, Any] = {
        f"{column}_{side}": Sum(column, filter=window.q(), default=0)
        for side, window in (("before", before), ("after", after))
        for column in ("allocated_gpu_ms", "utilised_gpu_ms", "unmeasured_gpu_ms")
    }
    grouped = (
        rows.annotate(claim_key=claim_key)
        .values("team__slug", "namespace", "job", "claim_key")
        .annotate(**sums)
        .order_by()
    )
    found: tuple[dict[JobKey, Hours], dict[JobKey, Hours]] = ({}, {})
    for row in grouped:
        key = JobKey(
            team=row["team__slug"] or "",
            namespace=row["namespace"],
            job=row["job"],
            claim=row["claim_key"],
        )
        for side, into in (("before", found[0]), ("after", found[1])):
            # PostgreSQL sums bigints as numeric: whole numbers, kept as ints here.
            hours = Hours(
                allocated_ms=int(row[f"allocated_gpu_ms_{side}"]),
                utilised_ms=int(row[f"utilised_gpu_ms_{side}"]),
                unmeasured_ms=int(row[f"unmeasured_gpu_ms_{side}"]),
            )
            if hours.allocated_ms:
                into[key] = hours
    return found


def compare_windows(
    *, team: Team | None, before: Window, after: Window, unit: str = Unit.GPU
) -> Comparison:
    """`team`'s (None: the fleet's) utilisation in `after` against `before`, decomposed.
    The caller has decided that its user may see `team` (or the fleet)."""
    hours = window_hours(team=team, unit=unit, before=before, after=after)
    return Comparison(
        team=team,
        unit=unit,
        before_window=before,
        after_window=after,
        decomposition=decompose(*hours),
    )


# --- Shown figures ----------------------------------------------------------------------------

HOUR_PLACES = KEPT_HOURS
PART_NAMES = ("mix", "efficiency", "entering", "leaving")


def to_decimal(value: Fraction, places: int) -> Decimal:
    """`value` rounded half to even at `places` decimals."""
    scaled = value * 10**places
    return Decimal(round(scaled)).scaleb(-places)


def shown_parts(parts: Sequence[Fraction], places: int) -> tuple[list[Decimal], Decimal]:
    """The parts and their sum rounded to `places` decimals so that the shown parts add up to
    the shown total (largest remainders: each part is its value rounded down or up)."""
    scale = 10**places
    total = round(sum(parts, ZERO) * scale)
    units = largest_remainders({index: part * scale for index, part in enumerate(parts)}, total)
    shown = [Decimal(units[index]).scaleb(-places) for index in range(len(parts))]
    return shown, Decimal(total).scaleb(-places)


def hours_of(milliseconds: int) -> Decimal:
    return hours_from_ms(milliseconds, KEPT_HOURS, ROUND_HALF_EVEN)


def points(value: Fraction | None, places: int) -> Decimal | None:
    """A utilisation or a change in percent (points), rounded; None stays None."""
    return None if value is None else to_decimal(value * 100, places)


def window_summary(window: Window, hours: Hours, places: int) -> dict[str, Any]:
    return {
        "start": window.start,
        "end": window.end,
        "allocated_hours": hours_of(hours.allocated_ms),
        "measured_hours": hours_of(hours.measured_ms),
        "utilised_hours": hours_of(hours.utilised_ms),
        "idle_hours": hours_of(hours.idle_ms),
        "unmeasured_hours": hours_of(hours.unmeasured_ms),
        "utilisation_pct": points(hours.ratio, places),
    }


def summary(comparison: Comparison, places: int = 4) -> dict[str, Any]:
    """The comparison's headline as plain values (Decimals, datetimes, None where a window
    has no measured hours): each window's hours and utilisation, the change in points and its
    parts, shown so that they add up to it, and the exact fractions."""
    result = comparison.decomposition
    counts = {presence.value: 0 for presence in Presence}
    for job in result.jobs:
        counts[job.presence.value] += 1
    parts = result.parts
    shown: dict[str, Decimal | None] = dict.fromkeys(PART_NAMES)
    change = None
    if parts is not None:
        values = [getattr(parts, name) * 100 for name in PART_NAMES]
        rounded, change = shown_parts(values, places)
        shown = dict(zip(PART_NAMES, rounded, strict=True))
    return {
        "scope": comparison.scope,
        "team": comparison.team.slug if comparison.team else None,
        "unit": comparison.unit,
        "hours_label": comparison.hours_label,
        "before": window_summary(comparison.before_window, result.before, places),
        "after": window_summary(comparison.after_window, result.after, places),
        "change_pp": change,
        "parts_pp": {name: shown[name] for name in PART_NAMES},
        "exact": None
        if parts is None
        else {
            "change": str(parts.total),
            **{name: str(getattr(parts, name)) for name in PART_NAMES},
        },
        "jobs": counts,
    }


ROW_COLUMNS = (
    "kind",
    "team",
    "namespace",
    "job",
    "claim",
    *(
        f"{side}_{figure}"
        for side in ("before", "after")
        for figure in (
            "allocated_hours",
            "utilised_hours",
            "idle_hours",
            "unmeasured_hours",
            "utilisation_pct",
            "share_pct",
        )
    ),
    "mix_pp",
    "efficiency_pp",
    "entering_pp",
    "leaving_pp",
    "change_pp",
)


def _row_figures(side: str, hours: Hours, total: Hours, places: int) -> dict[str, Any]:
    share = Fraction(hours.measured_ms, total.measured_ms) if total.measured_ms else None
    return {
        f"{side}_allocated_hours": hours_of(hours.allocated_ms),
        f"{side}_utilised_hours": hours_of(hours.utilised_ms),
        f"{side}_idle_hours": hours_of(hours.idle_ms),
        f"{side}_unmeasured_hours": hours_of(hours.unmeasured_ms),
        f"{side}_utilisation_pct": points(hours.ratio, places),
        f"{side}_share_pct": points(share, places),
    }


def job_rows(comparison: Comparison, places: int = 4) -> list[dict[str, Any]]:
    """One row per job (`ROW_COLUMNS`), the biggest contribution to the change first: its hours,
    utilisation and share of the window's measured hours in each window, and its part of
    each part of the change, in points (each rounded on its own; `summary` has the whole)."""
    result = comparison.decomposition
    weighed = []
    for job in result.jobs:
        parts = job.parts
        values = (
            dict.fromkeys(f"{name}_pp" for name in (*PART_NAMES, "change"))
            if parts is None
            else {
                **{f"{name}_pp": points(getattr(parts, name), places) for name in PART_NAMES},
                "change_pp": points(parts.total, places),
            }
        )
        row = {
            "kind": job.presence.value,
            "team": job.key.team,
            "namespace": job.key.namespace,
            "job": job.key.job,
            "claim": job.key.claim,
            **_row_figures("before", job.before, result.before, places),
            **_row_figures("after", job.after, result.after, places),
            **values,
        }
        weighed.append((abs(parts.total) if parts else ZERO, row))
    weighed.sort(key=lambda pair: -pair[0])  # stable: key order among equals
    return [row for _, row in weighed]


def total_row(comparison: Comparison, places: int = 4) -> dict[str, Any]:
    """The whole scope as one row of `ROW_COLUMNS` (kind `total`), for a CSV's first line."""
    result = comparison.decomposition
    head = summary(comparison, places)
    return {
        "kind": "total",
        "team": comparison.team.slug if comparison.team else "",
        "namespace": "",
        "job": "",
        "claim": "",
        **_row_figures("before", result.before, result.before, places),
        **_row_figures("after", result.after, result.after, places),
        **{f"{name}_pp": head["parts_pp"][name] for name in PART_NAMES},
        "change_pp": head["change_pp"],
    }


# --- Input ------------------------------------------------------------------------------------

SIDES = ("before", "after")
WINDOW_PARAMETERS = tuple(
    f"{side}_{bound}" for side in SIDES for bound in (windows.START, windows.END)
)
# A side's window may be a billing period instead (`before_period=2026-10`).
PERIOD_PARAMETERS = tuple(f"{side}_{windows.PERIOD}" for side in SIDES)


class CompareInputError(ValueError):
    """Bad parameters of a comparison: `errors` maps each parameter at fault to why."""

    def __init__(self, errors: dict[str, str]) -> None:
        super().__init__("; ".join(f"{name}: {reason}" for name, reason in errors.items()))
        self.errors = errors


def parse_parameters(params: Mapping[str, str]) -> tuple[Window, Window, str]:
    """The windows and unit of the API's and the portal's query parameters (`before_start`,
    `before_end` or `before_period`, the same for `after`, and `unit`, default gpu), each
    window through `billing.windows.parse_window`; `CompareInputError` naming every parameter
    at fault."""
    errors: dict[str, str] = {}
    found: dict[str, Window] = {}
    for side in SIDES:
        try:
            window = windows.parse_window(params, prefix=f"{side}_", required=True)
        except windows.WindowError as exc:
            errors.update(exc.errors)
            continue
        assert window.start is not None and window.end is not None
        found[side] = Window(window.start, window.end)
    unit = params.get("unit") or Unit.GPU
    try:
        parse_unit(unit)
    except ValueError as exc:
        errors["unit"] = str(exc)
    if errors:
        raise CompareInputError(errors)
    return found["before"], found["after"], unit
