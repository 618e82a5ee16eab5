"""Pending demand: claims that exist but hold no device, and what they ask for (issue 20).

A claim is pending while it is live (`released_at` is null), has no open allocation and its
status records no allocation (one allocated with `adminAccess` has no `Allocation` row: it only
observes its devices, yet it waits for nothing). It has waited since it last stopped holding
devices, else since it was created (`created_at`, else when the sync first saw it): a claim
that was allocated and then deallocated is waiting again.

What a request asks for is weighed as the webhook weighs it (`quota.admission.demand.demand`)
against a rule that covers the request's own device class: the devices of the fleet it could
be given (its class's selectors and its own, less those that cannot provide its capacity
requests), each counted as the most of its unit it can take (a MIG device its share of its
GPU, a consumable share its fraction of the device, a whole GPU 1). That is why this module
lives in `quota`: the CEL selectors that say which devices a class covers are evaluated here.
A `firstAvailable` request is weighed by its first alternative, the one the scheduler tries
first. A request that no device of the inventory matches counts as whole devices.

Readers see pending claims of the teams `visible_teams` shows them (the namespace's owner
now); finance and operators also see claims in namespaces of no team (team "").
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from django.db.models import Max, OuterRef, Q, QuerySet, Subquery
from django.utils import timezone
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from inventory import dra
from inventory.models import Allocation, Cluster, Device, DeviceClass, ResourceClaim
from inventory.profiles import unit_label
from quota.admission.demand import demand
from quota.admission.plans import RuleSnapshot
from quota.admission.shapes import FleetShapes, load_fleet, rule_unit
from quota.models import Mode, Unit
from teams.models import Team, TeamNamespace
from teams.selectors import user_role, visible_teams

# The label value of a device class no cluster publishes (a claim may name any string) in the
# metrics, so that claims cannot add series.
UNKNOWN_CLASS = "other"


@dataclass(frozen=True)
class PendingRequest:
    """One request of a pending claim: the class it names and what it can take."""

    name: str
    device_class: str
    devices: int
    # Of `unit` (gpu, tpu, gaudi, accelerator): 1 per whole device, a MIG device its share.
    units: Decimal
    unit: str
    # The models (`productName`) of the devices it could be given, sorted.
    models: tuple[str, ...]

    @property
    def unit_label(self) -> str:
        """The unit's name for `units` of it ("GPU", "GPUs")."""
        return unit_label(self.unit, plural=self.units != 1)


@dataclass(frozen=True)
class PendingClaim:
    """A live claim that holds no device, how long it has waited and what it asks for."""

    cluster: str
    namespace: str
    name: str
    team: str  # the namespace owner's slug; "" for no team
    job: str
    waiting_since: datetime
    waited_seconds: int
    requests: tuple[PendingRequest, ...]
    # Why its requests could not be read ("" when they could): it then asks for nothing known.
    problem: str


@dataclass(frozen=True)
class PendingDemand:
    """Pending claims summed per team, device class and unit."""

    team: str
    device_class: str
    unit: str
    models: tuple[str, ...]
    claims: int
    devices: int
    units: Decimal
    longest_wait_seconds: int

    @property
    def unit_label(self) -> str:
        """The unit's name for `units` of it ("GPU", "GPUs")."""
        return unit_label(self.unit, plural=self.units != 1)


def pending_claims(
    *, user: Any, now: datetime, cluster: Cluster | None = None, team: Team | None = None
) -> list[PendingClaim]:
    """The pending claims `user` may see (of `cluster`, and of `team`'s namespaces, when
    given), longest waiting first, then by cluster, namespace and name. One query for the
    claims, and three per cluster for its fleet's shapes, classes and models."""
    claims = _visible_claims(user)
    if team is not None:
        claims = claims.filter(
            namespace__in=TeamNamespace.objects.filter(team=team).values("namespace")
        )
    return _pending(claims, now=now, cluster=cluster)


def pending_demand(
    *, user: Any, now: datetime, cluster: Cluster | None = None, team: Team | None = None
) -> list[PendingDemand]:
    """`pending_claims` summed per team, device class and unit (sorted by them)."""
    return summarize(pending_claims(user=user, now=now, cluster=cluster, team=team))


def summarize(claims: Iterable[PendingClaim]) -> list[PendingDemand]:
    """Pending claims summed per team, device class and unit: a claim counts once in each
    group one of its requests falls in; a claim whose requests could not be read counts in
    the group of class "" and unit ""."""
    groups: dict[tuple[str, str, str], dict[str, Any]] = {}
    for claim in claims:
        requests = claim.requests or (PendingRequest("", "", 0, Decimal(0), "", ()),)
        seen: set[tuple[str, str, str]] = set()
        for request in requests:
            key = (claim.team, request.device_class, request.unit)
            group = groups.setdefault(
                key,
                {"models": set(), "claims": 0, "devices": 0, "units": Decimal(0), "wait": 0},
            )
            group["models"].update(request.models)
            group["devices"] += request.devices
            group["units"] += request.units
            if key not in seen:
                seen.add(key)
                group["claims"] += 1
                group["wait"] = max(group["wait"], claim.waited_seconds)
    return [
        PendingDemand(
            team=team,
            device_class=device_class,
            unit=unit,
            models=tuple(sorted(group["models"])),
            claims=group["claims"],
            devices=group["devices"],
            units=group["units"],
            longest_wait_seconds=group["wait"],
        )
        for (team, device_class, unit), group in sorted(groups.items())
    ]


def _visible_claims(user: Any) -> QuerySet[ResourceClaim]:
    """Live claims in namespaces of the user's teams; every one for finance and operators."""
    claims = ResourceClaim.objects.filter(released_at__isnull=True)
    if user_role(user) in ("operator", "finance"):
        return claims
    owned = TeamNamespace.objects.filter(team__in=visible_teams(user=user)).values("namespace")
    return claims.filter(namespace__in=owned)


def _pending(
    claims: QuerySet[ResourceClaim], *, now: datetime, cluster: Cluster | None
) -> list[PendingClaim]:
    if cluster is not None:
        claims = claims.filter(cluster=cluster)
    held = Allocation.objects.filter(end__isnull=True).values("claim_id")
    rows = (
        claims.exclude(pk__in=held)
        .exclude(Q(status__has_key="allocation") & ~Q(status__allocation=None))
        .annotate(
            team_slug=Subquery(
                TeamNamespace.objects.filter(namespace=OuterRef("namespace")).values("team__slug")[
                    :1
                ]
            ),
            last_held=Max("allocations__end"),
        )
        .values(
            "cluster_id",
            "cluster__name",
            "namespace",
            "name",
            "job",
            "api_version",
            "spec",
            "created_at",
            "first_seen",
            "team_slug",
            "last_held",
        )
        .order_by()
    )
    weighers: dict[int, _Weigher] = {}
    pending = []
    for row in rows:
        weigher = weighers.get(row["cluster_id"])
        if weigher is None:
            cluster_row = Cluster(pk=row["cluster_id"], name=row["cluster__name"])
            weigher = weighers[row["cluster_id"]] = _Weigher(cluster_row)
        since = max(
            moment
            for moment in (row["created_at"] or row["first_seen"], row["last_held"])
            if moment is not None
        )
        requests, problem = weigher.requests(row["spec"], row["api_version"])
        pending.append(
            PendingClaim(
                cluster=row["cluster__name"],
                namespace=row["namespace"],
                name=row["name"],
                team=row["team_slug"] or "",
                job=row["job"],
                waiting_since=since,
                waited_seconds=max(0, int((now - since).total_seconds())),
                requests=requests,
                problem=problem,
            )
        )
    pending.sort(key=lambda c: (-c.waited_seconds, c.cluster, c.namespace, c.name))
    return pending


class _Weigher:
    """Weighs the requests of one cluster's claims against its fleet, read once."""

    def __init__(self, cluster: Cluster) -> None:
        # Not the webhook's cache: a report reads the fleet as the database holds it now.
        self.fleet: FleetShapes = load_fleet(cluster=cluster)
        self.models: dict[int, set[str]] = defaultdict(set)
        for shape_id, product in (
            Device.objects.filter(cluster=cluster, gone_at__isnull=True, shape__isnull=False)
            .exclude(product_name="")
            .values_list("shape_id", "product_name")
            .distinct()
        ):
            self.models[shape_id].add(product)

    def requests(self, spec: Any, api_version: str) -> tuple[tuple[PendingRequest, ...], str]:
        """The claim's requests weighed, or () and why they cannot be read."""
        if not isinstance(spec, dict):
            return (), "the claim has no spec"
        try:
            parsed = dra.parse_claim_requests(spec, api_version)
        except dra.DRAObjectError as exc:
            return (), f"{exc.field_path}: {exc.problem}"
        return tuple(self._weigh(request) for request in parsed), ""

    def _weigh(self, request: dra.ParsedRequest) -> PendingRequest:
        asked = request.first_available[0] if request.first_available else request
        # A rule that covers exactly the class the request names, with no limit to mind.
        rule = RuleSnapshot(
            pk=0,
            name="",
            device_class=asked.device_class_name,
            selector="",
            unit=Unit.GPUS,
            limit=Decimal(0),
            mode=Mode.ENFORCE,
            in_use=Decimal(0),
        )
        weighed = demand(asked, [rule], self.fleet, warnings=[])
        candidates = self.fleet.candidates(asked.device_class_name, tuple(asked.selectors))
        return PendingRequest(
            name=request.name,
            device_class=asked.device_class_name,
            devices=weighed.devices,
            units=weighed.amounts.get(rule.pk, Decimal(0)),
            unit=rule_unit(candidates),
            models=tuple(
                sorted({model for shape in candidates for model in self.models[shape.id]})
            ),
        )


class PendingDemandCollector(Collector):
    """`tally_pending_claims` and `tally_pending_demand_units` by team, device class and unit,
    and `tally_pending_longest_wait_seconds` by team, from the database at scrape time (see
    `core.metrics`). A class no cluster publishes is labelled "other". `clock` gives the
    time waits are counted to."""

    def __init__(self, clock: Callable[[], datetime] = timezone.now) -> None:
        self.clock = clock

    def collect(self) -> Iterator[Metric]:
        labels = ["team", "device_class", "unit"]
        claims = GaugeMetricFamily(
            "tally_pending_claims",
            "Live ResourceClaims holding no device, by team (namespace owner, '' for none), "
            "requested device class and unit.",
            labels=labels,
        )
        units = GaugeMetricFamily(
            "tally_pending_demand_units",
            "Devices the pending claims ask for, in units (GPUs, TPU chips; a MIG device its "
            "share of its GPU), by team, device class and unit.",
            labels=labels,
        )
        waits = GaugeMetricFamily(
            "tally_pending_longest_wait_seconds",
            "How long the longest-waiting pending claim of each team has waited.",
            labels=["team"],
        )
        known = set(DeviceClass.objects.filter(gone_at__isnull=True).values_list("name", flat=True))
        everything = ResourceClaim.objects.filter(released_at__isnull=True)
        summed: dict[tuple[str, str, str], list[Any]] = defaultdict(lambda: [0, Decimal(0)])
        longest: dict[str, int] = defaultdict(int)
        for row in summarize(_pending(everything, now=self.clock(), cluster=None)):
            device_class = row.device_class if row.device_class in known else UNKNOWN_CLASS
            key = (row.team, device_class, row.unit)
            summed[key][0] += row.claims
            summed[key][1] += row.units
            longest[row.team] = max(longest[row.team], row.longest_wait_seconds)
        for key, (count, amount) in sorted(summed.items()):
            claims.add_metric(list(key), count)
            units.add_metric(list(key), float(amount))
        for team, seconds in sorted(longest.items()):
            waits.add_metric([team], seconds)
        yield claims
        yield units
        yield waits
