"""The fleet as the webhook weighs claims by it: its distinct device shapes, cached per process.

Thousands of devices come in a few dozen shapes (what selectors can tell apart), so a selector
is evaluated once per shape, not per device, and a webhook worker reads the fleet again only
when a sync has changed it. The shapes a quota rule covers (`covers`: its device class's
selectors and its own) are worked out once per rule definition and snapshot.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Protocol, TypeVar

from django.conf import settings
from django.db.models import Count
from kubernetes.utils import parse_quantity

from inventory.models import Cluster, Device, DeviceClass, DeviceShape, Unit
from quota import cel
from quota.models import QuotaRule

T = TypeVar("T")


@dataclass(frozen=True)
class Shape:
    """One distinct device shape of the fleet, as selectors and quota amounts see it."""

    id: int
    driver: str
    kind: str
    gpu_share: Decimal
    memory_bytes: int | None
    # Consumable capacity (KEP-5075): several claims may each take a share of one device.
    shareable: bool
    view: cel.DeviceShape
    # What `gpu_share` counts (inventory.models.Unit: GPUs, TPU chips, Gaudi cards).
    unit: str = Unit.GPU
    # As published (`{name: {"value", "requestPolicy"}}`): what a consumable share takes.
    capacity: dict[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def from_row(cls, row: DeviceShape, *, memory_bytes: int | None) -> Shape:
        """The shape as selectors see it, from its stored row."""
        return cls(
            id=row.pk,
            driver=row.driver,
            kind=row.kind,
            gpu_share=row.gpu_share,
            memory_bytes=memory_bytes,
            shareable=row.allow_multiple_allocations,
            unit=row.unit,
            capacity=row.capacity,
            view=cel.DeviceShape.from_device(
                driver=row.driver,
                attributes=row.attributes,
                capacity=row.capacity,
                allow_multiple_allocations=row.allow_multiple_allocations,
            ),
        )


@dataclass
class FleetShapes:
    """The shapes present in a cluster, and how many devices of each sit on each node."""

    shapes: dict[int, Shape] = field(default_factory=dict)
    # node id -> shape id -> present devices; for `allocationMode: All`.
    per_node: dict[int, dict[int, int]] = field(default_factory=dict)
    class_selectors: dict[str, list[str]] = field(default_factory=dict)
    loaded_at: float = 0.0
    version: int | None = None  # the cluster's fleet version this was loaded at
    _derived: dict[tuple[Any, ...], Any] = field(default_factory=dict, repr=False)

    def derived(self, key: tuple[Any, ...], compute: Callable[[], T]) -> T:
        """`compute()`, once per `key` while this snapshot of the fleet is in use (the shapes a
        request could be given, what its devices count on a rule, the most on one node)."""
        try:
            value: T = self._derived[key]
        except KeyError:
            value = self._derived[key] = compute()
        return value

    def match(self, expression: str, shape: Shape) -> bool:
        """Whether `expression` selects devices of `shape` (see `match`)."""
        return match(expression, shape)

    def covered(self, device_class: str, selector: str) -> frozenset[int]:
        """The ids of this fleet's shapes that a quota rule of `device_class` and `selector`
        covers (see `covers`), worked out once per rule definition and snapshot."""
        return self.derived(
            ("covered", device_class, selector),
            lambda: frozenset(
                shape.id
                for shape in self.shapes.values()
                if covers(self.class_selectors, device_class, selector, shape)
            ),
        )

    def unit(self, device_class: str, selector: str) -> str:
        """What a quota rule of `device_class` and `selector` counts in this fleet: the unit of
        the accelerators it covers, "accelerator" when they differ, "gpu" when it covers none."""
        return self.derived(
            ("unit", device_class, selector),
            lambda: rule_unit(
                self.shapes[shape_id] for shape_id in self.covered(device_class, selector)
            ),
        )

    def covers_accelerators(self, device_class: str, selector: str) -> bool:
        """Whether a quota rule of `device_class` and `selector` covers any accelerator (a
        device of a kind other than "other") in this fleet."""
        return self.derived(
            ("accelerators", device_class, selector),
            lambda: any(
                self.shapes[shape_id].kind != "other"
                for shape_id in self.covered(device_class, selector)
            ),
        )

    def candidates(self, device_class: str, selectors: tuple[str, ...]) -> list[Shape]:
        """The shapes a request of `device_class` with `selectors` could be given."""
        return self.derived(
            ("candidates", device_class, selectors),
            functools.partial(self._select, device_class, selectors),
        )

    def _select(self, device_class: str, selectors: tuple[str, ...]) -> list[Shape]:
        class_selectors = self.class_selectors.get(device_class)
        if class_selectors is None:
            return []  # a class the inventory does not know selects nothing
        expressions = [*class_selectors, *selectors]
        return [
            shape
            for shape in self.shapes.values()
            if all(self.match(expression, shape) for expression in expressions)
        ]


_cache: dict[int, FleetShapes] = {}
_cache_lock = threading.Lock()
# (when read, every cluster), for `every_fleet_shapes`.
_clusters: list[tuple[float, list[Cluster]]] = []
_matches: dict[tuple[str, int], bool] = {}
# Expressions x shapes stays small (rules and request selectors repeat); a process that has
# seen this many distinct pairs starts afresh rather than grow without bound.
MAX_REMEMBERED_MATCHES = 200_000


def match(expression: str, shape: Shape) -> bool:
    """Whether `expression` selects devices of `shape`; a bad expression selects none.

    Remembered per (expression, shape id) by the process, across snapshots: a shape row never
    changes once written, so a selector is evaluated once per shape, however many requests ask
    and however often the fleet is reloaded.
    """
    key = (expression, shape.id)
    result = _matches.get(key)
    if result is None:
        try:
            result = cel.compile_selector(expression).matches(shape.view)
        except cel.CELError:
            result = False
        _matches[key] = result
    return result


def covers(
    class_selectors: dict[str, list[str]], device_class: str, selector: str, shape: Shape
) -> bool:
    """Whether a quota rule of `device_class` and `selector` covers devices of `shape`: the
    class's selectors (as `class_selectors` holds them; none: every device) and the rule's
    own all select it. The class narrows what the rule covers; a claim naming another class
    that selects the same devices is still covered. A class the inventory does not know covers
    no device; a selector that does not compile is left out (validated when the rule is
    written; applied to the whole class if one is stored otherwise).
    """
    expressions = class_selectors.get(device_class)
    if expressions is None or not all(match(expression, shape) for expression in expressions):
        return False
    if not selector:
        return True
    try:
        cel.compile_selector(selector)
    except cel.CELError:
        return True
    return match(selector, shape)


def rule_unit(shapes: Iterable[Shape]) -> str:
    """The unit of the accelerators among `shapes` (devices of kind "other" say nothing):
    theirs when all agree, "accelerator" when they differ, "gpu" when there are none."""
    units = {shape.unit for shape in shapes if shape.kind != "other"}
    if len(units) > 1:
        return Unit.ACCELERATOR
    return units.pop() if units else Unit.GPU


class RuleDefinition(Protocol):
    """What `rule_units` reads of a rule: a `QuotaRule`, or the webhook's snapshot of one."""

    pk: int
    device_class: str
    selector: str


def rule_units(rules: Iterable[RuleDefinition], fleets: Iterable[FleetShapes]) -> dict[int, str]:
    """What each of `rules` counts over `fleets` (every cluster's: a rule is not of one
    cluster): the unit of the accelerators it covers in any of them (see `rule_unit`). The
    API and the webhook's messages both name a rule's unit by it, so they agree."""
    fleets = list(fleets)
    return {
        rule.pk: rule_unit(
            fleet.shapes[shape_id]
            for fleet in fleets
            for shape_id in fleet.covered(rule.device_class, rule.selector)
        )
        for rule in rules
    }


def every_fleet() -> list[FleetShapes]:
    """The present device shapes and device classes of every cluster, in two queries however
    many clusters there are (for reads such as the rules API; without devices per node)."""
    fleets: dict[int, FleetShapes] = defaultdict(FleetShapes)
    present = Device.objects.filter(gone_at__isnull=True, shape__isnull=False).values("shape_id")
    for row in DeviceShape.objects.filter(pk__in=present):
        fleets[row.cluster_id].shapes[row.pk] = shape_of(row)
    for cluster_id, name, selectors in DeviceClass.objects.filter(gone_at__isnull=True).values_list(
        "cluster_id", "name", "selectors"
    ):
        fleets[cluster_id].class_selectors[name] = selectors
    return list(fleets.values())


def fleet_shapes(*, cluster: Cluster) -> FleetShapes:
    """The cluster's present device shapes, as of at most TALLY_SHAPE_CACHE_SECONDS ago.

    A webhook worker serves from memory. Every TALLY_SHAPE_CACHE_SECONDS it reads the
    cluster's fleet version (one row), and only when a sync has changed the fleet since does
    it load it again: the shapes (dozens), devices counted per node and shape, and the device
    classes.
    """
    now = time.monotonic()
    cached = _cache.get(cluster.pk)
    if cached is not None and now - cached.loaded_at < settings.TALLY_SHAPE_CACHE_SECONDS:
        return cached
    with _cache_lock:
        cached = _cache.get(cluster.pk)
        if cached is not None and now - cached.loaded_at < settings.TALLY_SHAPE_CACHE_SECONDS:
            return cached
        version = (
            Cluster.objects.filter(pk=cluster.pk).values_list("fleet_version", flat=True).first()
        )
        if cached is not None and cached.version == version:
            cached.loaded_at = now
            return cached
        fleet = load_fleet(cluster=cluster, version=version)
        fleet.loaded_at = now
        if len(_matches) > MAX_REMEMBERED_MATCHES:
            _matches.clear()
        _cache[cluster.pk] = fleet
        return fleet


def every_fleet_shapes() -> list[FleetShapes]:
    """Every cluster's present shapes, each as `fleet_shapes` keeps it, for what a rule counts
    (`rule_units`): a rule covers devices of every cluster, so its unit is not the local
    fleet's alone. The clusters are read again at most every TALLY_SHAPE_CACHE_SECONDS."""
    now = time.monotonic()
    if not _clusters or now - _clusters[0][0] >= settings.TALLY_SHAPE_CACHE_SECONDS:
        _clusters[:] = [(now, list(Cluster.objects.all()))]
    return [fleet_shapes(cluster=cluster) for cluster in _clusters[0][1]]


def load_fleet(*, cluster: Cluster, version: int | None = None) -> FleetShapes:
    """The cluster's present device shapes as the database holds them now, not cached: for
    the quota services, which count within their own transaction (the sync's included)."""
    fleet = FleetShapes(version=version)
    per_node: dict[int, dict[int, int]] = defaultdict(dict)
    present_shapes: set[int] = set()
    for node_id, shape_id, devices in (
        Device.objects.filter(cluster=cluster, gone_at__isnull=True, shape__isnull=False)
        .values_list("node_id", "shape_id")
        .annotate(devices=Count("id"))
        .order_by()
    ):
        present_shapes.add(shape_id)
        if node_id is not None:
            per_node[node_id][shape_id] = devices
    for row in DeviceShape.objects.filter(pk__in=present_shapes):
        fleet.shapes[row.pk] = shape_of(row)
    fleet.per_node = dict(per_node)
    fleet.class_selectors = dict(
        DeviceClass.objects.filter(cluster=cluster, gone_at__isnull=True).values_list(
            "name", "selectors"
        )
    )
    return fleet


def shape_of(row: DeviceShape) -> Shape:
    """The shape of a stored row, its memory read from its capacity."""
    return Shape.from_row(row, memory_bytes=_memory(row.capacity))


def warm_up(*, cluster: Cluster, seconds: float) -> int:
    """Load the cluster's fleet shapes and evaluate every device class's and quota rule's
    selector against each shape, at most `seconds` long: what a new process's first
    admissions would otherwise pay (hundreds of milliseconds for the first one). Returns how
    many (selector, shape) pairs it evaluated.

    Selectors that claims themselves carry are not known beforehand; each costs its first
    claim one evaluation per shape, as before.
    """
    deadline = time.monotonic() + seconds
    fleet = fleet_shapes(cluster=cluster)
    expressions = {e for selectors in fleet.class_selectors.values() for e in selectors}
    expressions.update(
        QuotaRule.objects.exclude(selector="").values_list("selector", flat=True).distinct()
    )
    evaluated = 0
    for expression in sorted(expressions):
        for shape in fleet.shapes.values():
            if time.monotonic() > deadline:
                return evaluated
            fleet.match(expression, shape)
            evaluated += 1
    return evaluated


def forget_fleet_shapes() -> None:
    """Drop the cache (tests, and after an import that changed the fleet in this process)."""
    with _cache_lock:
        _cache.clear()
        _matches.clear()
        _clusters.clear()


def _memory(capacity: dict[str, dict[str, str]]) -> int | None:
    for name, entry in capacity.items():
        if name.rsplit("/", 1)[-1] in ("memory", "addressableMemory") and "value" in entry:
            return int(parse_quantity(entry["value"]))
    return None
