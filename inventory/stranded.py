"""Stranded gangs: gangs some of whose members hold devices while others do not (issue 20).

A gang (`Gang`, live while `ended_at` is null) needs `size` pods running together. Its members
are distinct Pods: a claim's owner Pod (by uid, from its owner references), else the claim
itself. A member holds while any of its claims has an open allocation. The gang is partial
while 0 < members holding < size: the devices its holding members have are idle, waiting for
the rest, and no other job can use them (the deadlock a gang scheduler exists to prevent).

It is stranded once it has been partial without a break for TALLY_STRANDED_GANG_MINUTES. The
stretch is worked out from the allocation history of its claims (released ones included), so a
gang that ran whole for a week and lost one pod five minutes ago is partial since then, not for
a week. What it held during the stretch is summed from the allocations' fixed metering (their
`gpu_share` of their unit), per model, profile and unit, so that billing can price it.

Readers see the gangs of namespaces of the teams `visible_teams` shows them (the namespace's
owner now); finance and operators see every gang, those of no team too (team "").
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.db.models import OuterRef, QuerySet, Subquery
from django.utils import timezone
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from inventory.models import Allocation, Cluster, Gang, ResourceClaim
from inventory.profiles import hours_label, unit_label
from teams.models import Team, TeamNamespace
from teams.selectors import user_role, visible_teams


@dataclass(frozen=True)
class HeldDevices:
    """What a stranded gang held of one model, profile and share during its stretch."""

    product_name: str
    profile: str
    unit: str  # gpu, tpu, gaudi, accelerator ("" for a device not metered)
    # The device's share of its unit (a MIG slice's of its GPU), which a slice's rate card
    # prices an hour of.
    device_share: Decimal
    devices: int  # held now
    # Milliseconds of the unit held during the stretch (time held times the held share).
    unit_ms: Decimal


@dataclass(frozen=True)
class StrandedGang:
    """A gang partial for longer than the threshold, with what its holding members hold."""

    cluster: str
    namespace: str
    key: str
    source: str
    team: str  # the namespace owner's slug; "" for no team
    size: int
    members_holding: int
    # Members with a live claim (holding or not); `size` less these have not appeared.
    members_present: int
    devices_held: int
    units_held: Decimal  # the held devices' shares of their unit, summed
    unit: str  # the unit they count; "accelerator" when they mix
    stranded_since: datetime
    stranded_seconds: int
    held: tuple[HeldDevices, ...]

    @property
    def unit_label(self) -> str:
        """The unit's name for `units_held` of it ("GPU", "GPUs")."""
        return unit_label(self.unit, plural=self.units_held != 1)

    @property
    def hours_label(self) -> str:
        return hours_label(self.unit)


def stranded_gangs(
    *,
    user: Any,
    now: datetime,
    cluster: Cluster | None = None,
    team: Team | None = None,
    threshold: timedelta | None = None,
) -> list[StrandedGang]:
    """The stranded gangs `user` may see (every one for `user=None`: the system's own view, as
    the alerts read them; of `cluster`, and of `team`'s namespaces, when given), longest
    stranded first. `threshold`: how long a gang must have been partial
    (TALLY_STRANDED_GANG_MINUTES when None). Three queries, whatever the number of gangs."""
    gangs = _visible_gangs(user)
    if cluster is not None:
        gangs = gangs.filter(cluster=cluster)
    if team is not None:
        gangs = gangs.filter(
            namespace__in=TeamNamespace.objects.filter(team=team).values("namespace")
        )
    return _stranded(gangs, now=now, threshold=threshold)


def stranded_threshold() -> timedelta:
    return timedelta(minutes=settings.TALLY_STRANDED_GANG_MINUTES)


def _visible_gangs(user: Any) -> QuerySet[Gang]:
    gangs = Gang.objects.filter(ended_at__isnull=True)
    if user is None or user_role(user) in ("operator", "finance"):
        return gangs
    owned = TeamNamespace.objects.filter(team__in=visible_teams(user=user)).values("namespace")
    return gangs.filter(namespace__in=owned)


def _member(claim_uid: str, owner_references: Any) -> str:
    """The Pod a claim belongs to (its owner Pod's uid, else name), else the claim itself."""
    for owner in owner_references if isinstance(owner_references, list) else []:
        if isinstance(owner, dict) and owner.get("kind") == "Pod":
            pod = owner.get("uid") or owner.get("name")
            if isinstance(pod, str) and pod:
                return f"pod:{pod}"
    return f"claim:{claim_uid}"


def _partial_since(
    intervals: dict[str, list[tuple[datetime, datetime | None]]], size: int, now: datetime
) -> datetime | None:
    """When the gang's current partial stretch began (0 < members holding < size without a
    break up to `now`); None when it is not partial now. Events at one instant are applied
    together, so a member handing over from one allocation to the next never breaks it."""
    events: dict[datetime, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for member, spans in intervals.items():
        for start, end in spans:
            if start >= now:
                continue
            events[start][member] += 1
            if end is not None and end < now:
                events[end][member] -= 1
    open_spans: dict[str, int] = defaultdict(int)
    since: datetime | None = None
    for moment in sorted(events):
        for member, change in events[moment].items():
            open_spans[member] += change
        holding = sum(1 for count in open_spans.values() if count > 0)
        since = (since or moment) if 0 < holding < size else None
    return since


def _stranded(
    gangs: QuerySet[Gang], *, now: datetime, threshold: timedelta | None
) -> list[StrandedGang]:
    threshold = stranded_threshold() if threshold is None else threshold
    holding = gangs.filter(claims__allocations__end__isnull=True).distinct()
    rows = list(
        holding.annotate(
            team_slug=Subquery(
                TeamNamespace.objects.filter(namespace=OuterRef("namespace")).values("team__slug")[
                    :1
                ]
            )
        ).values("pk", "cluster__name", "namespace", "key", "source", "size", "team_slug")
    )
    if not rows:
        return []
    gang_ids = [row["pk"] for row in rows]
    allocations = Allocation.objects.filter(claim__gang_id__in=gang_ids).values(
        "claim__gang_id",
        "claim__uid",
        "claim__owner_references",
        "start",
        "end",
        "product_name",
        "profile",
        "unit",
        "device_share",
        "gpu_share",
    )
    by_gang: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for allocation in allocations:
        by_gang[allocation["claim__gang_id"]].append(dict(allocation))
    present: dict[int, set[str]] = defaultdict(set)
    for gang_id, uid, owners in ResourceClaim.objects.filter(
        gang_id__in=gang_ids, released_at__isnull=True
    ).values_list("gang_id", "uid", "owner_references"):
        present[gang_id].add(_member(uid, owners))
    stranded = []
    for row in rows:
        gang = _weigh(row, by_gang[row["pk"]], present[row["pk"]], now=now)
        if gang is not None and now - gang.stranded_since >= threshold:
            stranded.append(gang)
    stranded.sort(key=lambda g: (g.stranded_since, g.cluster, g.namespace, g.key))
    return stranded


def _weigh(
    row: dict[str, Any], allocations: list[dict[str, Any]], present: set[str], *, now: datetime
) -> StrandedGang | None:
    """The gang of `row` as a stranded gang, if it is partial now (whatever the threshold)."""
    intervals: dict[str, list[tuple[datetime, datetime | None]]] = defaultdict(list)
    for allocation in allocations:
        member = _member(allocation["claim__uid"], allocation["claim__owner_references"])
        intervals[member].append((allocation["start"], allocation["end"]))
    since = _partial_since(intervals, row["size"], now)
    if since is None:
        return None
    lines: dict[tuple[str, str, str, Decimal], dict[str, Any]] = {}
    holding: set[str] = set()
    for allocation in allocations:
        key = (
            allocation["product_name"],
            allocation["profile"],
            allocation["unit"],
            allocation["device_share"],
        )
        line = lines.setdefault(key, {"devices": 0, "unit_ms": Decimal(0)})
        end = allocation["end"]
        if end is None:
            line["devices"] += 1
            holding.add(_member(allocation["claim__uid"], allocation["claim__owner_references"]))
        held_from, held_to = max(allocation["start"], since), min(end or now, now)
        if held_to > held_from:
            milliseconds = (held_to - held_from) // timedelta(milliseconds=1)
            line["unit_ms"] += milliseconds * allocation["gpu_share"]
    held = tuple(
        HeldDevices(
            product_name=product,
            profile=profile,
            unit=unit,
            device_share=share,
            devices=line["devices"],
            unit_ms=line["unit_ms"],
        )
        for (product, profile, unit, share), line in sorted(lines.items())
        if line["devices"] or line["unit_ms"]
    )
    open_allocations = [a for a in allocations if a["end"] is None]
    units = {a["unit"] for a in open_allocations if a["unit"]}
    return StrandedGang(
        cluster=row["cluster__name"],
        namespace=row["namespace"],
        key=row["key"],
        source=row["source"],
        team=row["team_slug"] or "",
        size=row["size"],
        members_holding=len(holding),
        members_present=len(present | holding),
        devices_held=len(open_allocations),
        units_held=sum((a["gpu_share"] for a in open_allocations), Decimal(0)),
        unit=units.pop() if len(units) == 1 else ("accelerator" if units else ""),
        stranded_since=since,
        stranded_seconds=int((now - since).total_seconds()),
        held=held,
    )


def stranded_by_team(gangs: Iterable[StrandedGang]) -> dict[tuple[str, str], list[Any]]:
    """Per team and unit: stranded gangs, devices held and their units."""
    summed: dict[tuple[str, str], list[Any]] = defaultdict(lambda: [0, 0, Decimal(0)])
    for gang in gangs:
        total = summed[(gang.team, gang.unit)]
        total[0] += 1
        total[1] += gang.devices_held
        total[2] += gang.units_held
    return dict(summed)


class StrandedGangCollector(Collector):
    """`tally_stranded_gangs`, `tally_stranded_gang_devices` and
    `tally_stranded_gang_units` by team and unit, from the database at scrape time (see
    `core.metrics`). `clock` gives the time stretches are measured to."""

    def __init__(self, clock: Callable[[], datetime] = timezone.now) -> None:
        self.clock = clock

    def collect(self) -> Iterator[Metric]:
        labels = ["team", "unit"]
        families = (
            GaugeMetricFamily(
                "tally_stranded_gangs",
                "Gangs partial (some members holding devices, others not) for longer than "
                "TALLY_STRANDED_GANG_MINUTES, by team ('' for none) and unit.",
                labels=labels,
            ),
            GaugeMetricFamily(
                "tally_stranded_gang_devices",
                "Devices the stranded gangs hold, by team and unit.",
                labels=labels,
            ),
            GaugeMetricFamily(
                "tally_stranded_gang_units",
                "What the stranded gangs hold in units (GPUs, TPU chips; a MIG device its "
                "share of its GPU), by team and unit.",
                labels=labels,
            ),
        )
        everything = Gang.objects.filter(ended_at__isnull=True)
        for key, values in sorted(
            stranded_by_team(_stranded(everything, now=self.clock(), threshold=None)).items()
        ):
            for family, value in zip(families, values, strict=True):
                family.add_metric(list(key), float(value))
        yield from families
