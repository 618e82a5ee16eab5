"""The fleet as the webhook weighs claims by it: its distinct device shapes, cached per process.

Thousands of devices come in a few dozen shapes (what selectors can tell apart), so a selector
is evaluated once per shape, not per device, and a webhook worker reads the fleet again only
when a sync has changed it. The shapes a quota rule covers (`covers`: its device class's
selectors and its own) are worked out once per rule definition and snapshot.

The fleet is read from the devices counted per (node, shape) (`inventory.models.NodeShapeCount`,
kept by triggers with the devices), not from the devices; a worker brings its snapshot up to
date by reading only the counts changed since it read it, off the request path. Only what the
devices consume of their pools' shared counter sets, which an `allocationMode: All` request
needs and the counts cannot tell, is read from the devices (`FleetShapes.counter_shortfall`),
once per snapshot and set of shapes. So is which pools the scheduler allocates nothing from
(a device name or counter set published twice, a counter set or counter consumed that no slice
publishes: `InvalidPools`), with each snapshot, checking again only the pools whose slices
changed since they were checked.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Protocol, TypeVar

from django.conf import settings
from django.db import connection
from kubernetes.utils import parse_quantity

from inventory import checks, dra, profiles
from inventory.checks import InvalidPool, published_counter_sets
from inventory.models import (
    Cluster,
    Device,
    DeviceClass,
    DeviceShape,
    NodeShapeCount,
    ResourceSlice,
    Unit,
)
from quota import cel
from quota.admission.refresher import Refresher
from quota.models import QuotaRule

T = TypeVar("T")
log = logging.getLogger(__name__)


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
    # The model its driver's profile reads ("NVIDIA H100 80GB HBM3", "Gaudi2"); "" if none.
    model: str = field(default="", compare=False)
    # Where it publishes that model, as a DRA CEL selector reads it (`device.attributes[...]`:
    # `model_selector`); "" if it publishes none.
    model_attribute: str = field(default="", compare=False)

    @classmethod
    def from_row(cls, row: DeviceShape, *, memory_bytes: int | None) -> Shape:
        """The shape as selectors see it, from its stored row."""
        model, model_attribute = _model(row)
        return cls(
            id=row.pk,
            driver=row.driver,
            kind=row.kind,
            gpu_share=row.gpu_share,
            memory_bytes=memory_bytes,
            shareable=row.allow_multiple_allocations,
            unit=row.unit,
            capacity=row.capacity,
            model=model,
            model_attribute=model_attribute,
            view=cel.DeviceShape.from_device(
                driver=row.driver,
                attributes=row.attributes,
                capacity=row.capacity,
                allow_multiple_allocations=row.allow_multiple_allocations,
            ),
        )


@dataclass(frozen=True)
class CounterShortfall:
    """Where the present devices of some shapes, all given to one claim, would consume more of
    a shared counter set than it holds (KEP-4815: a whole GPU and its partitions, halves and
    quarters of one GPU, the mode devices of one AMD GPU), so that the scheduler cannot give
    them all at once. `nodes`: the ids of the nodes where they would, with the devices
    published without a node; `everywhere`: those published without a node would on their
    own, so on every node."""

    nodes: frozenset[int] = frozenset()
    everywhere: bool = False

    def on(self, node_id: int | None) -> bool:
        """Whether the devices fall short of counters on node `node_id` (None: a node with none
        of its own)."""
        return self.everywhere or node_id in self.nodes


NO_SHORTFALL = CounterShortfall()


@dataclass(frozen=True)
class InvalidPools:
    """The pools of a cluster that the scheduler allocates no device from, because their
    generation publishes a device name or a counter set twice, or a device of theirs consumes a
    counter set no slice of it publishes, or a counter its set does not have
    (`inventory.checks.InvalidPool`), with their present devices. None of those devices can be
    given to a claim, and an `allocationMode: All` request cannot be allocated on a node that
    has any of them (nor on any node, for those published without a node): the scheduler fails
    it on every node an invalid pool is gathered for."""

    pools: tuple[InvalidPool, ...] = ()
    # Their present devices: (driver, pool) -> node id (None: published without a node) ->
    # shape id -> devices.
    devices: Mapping[tuple[str, str], Mapping[int | None, Mapping[int, int]]] = field(
        default_factory=dict
    )

    def devices_of(self, shape_id: int) -> int:
        """How many present devices of shape `shape_id` are in these pools."""
        return self._index[0].get(shape_id, 0)

    def devices_on(self, node_id: int | None) -> Mapping[int, int]:
        """Their present devices on node `node_id` (None: published without a node), by shape
        id."""
        return self._index[3].get(node_id, {})

    def on(self, node_id: int | None) -> list[InvalidPool]:
        """Those an `allocationMode: All` request meets on node `node_id` (None: a node with no
        devices of its own): with devices on it, or published without a node."""
        on_nodes = self._index[1]
        return self._ordered({*on_nodes.get(node_id, ()), *on_nodes.get(None, ())})

    def holding(self, shape_ids: Iterable[int]) -> list[InvalidPool]:
        """Those with present devices of any of `shape_ids`."""
        of_shapes = self._index[2]
        return self._ordered(
            {index for shape_id in shape_ids for index in of_shapes.get(shape_id, ())}
        )

    def _ordered(self, indexes: set[int]) -> list[InvalidPool]:
        return [self.pools[index] for index in sorted(indexes)]

    @functools.cached_property
    def _index(
        self,
    ) -> tuple[
        dict[int, int],
        dict[int | None, set[int]],
        dict[int, set[int]],
        dict[int | None, dict[int, int]],
    ]:
        """Devices by shape; the pools (their places in `pools`) by node and by shape; devices
        by node and shape: a driver that publishes every pool wrong makes thousands of them."""
        by_shape: dict[int, int] = defaultdict(int)
        on_nodes: dict[int | None, set[int]] = defaultdict(set)
        of_shapes: dict[int, set[int]] = defaultdict(set)
        by_node: dict[int | None, dict[int, int]] = defaultdict(dict)
        for index, pool in enumerate(self.pools):
            for node_id, shapes in self.devices.get((pool.driver, pool.pool), {}).items():
                on_nodes[node_id].add(index)
                on_node = by_node[node_id]
                for shape_id, devices in shapes.items():
                    by_shape[shape_id] += devices
                    of_shapes[shape_id].add(index)
                    on_node[shape_id] = on_node.get(shape_id, 0) + devices
        return by_shape, on_nodes, of_shapes, by_node


NO_INVALID_POOLS = InvalidPools()
# `device.driver == 'name'` in a selector: the driver whose devices it is written for.
_DRIVER_NAMED = re.compile(r"""device\.driver\s*==\s*(['"])([^'"]+)\1""")


@dataclass
class FleetShapes:
    """The shapes present in a cluster, and how many devices of each sit on each node."""

    shapes: dict[int, Shape] = field(default_factory=dict)
    # node id -> shape id -> present devices; for `allocationMode: All`.
    per_node: dict[int, dict[int, int]] = field(default_factory=dict)
    class_selectors: dict[str, list[str]] = field(default_factory=dict)
    loaded_at: float = 0.0  # when the fleet version was last checked (`time.monotonic()`)
    version: int | None = None  # the cluster's fleet version this was loaded at
    # shape id -> present devices of it, on a node or not: which shapes `shapes` holds.
    shape_devices: dict[int, int] = field(default_factory=dict, repr=False)
    # shape id -> present devices of it published without a node (not in `per_node`).
    off_node: dict[int, int] = field(default_factory=dict, repr=False)
    # The database snapshot the counts were read in (`pg_current_snapshot()`, as text): a
    # count changed since was changed by a transaction it does not see. None: not read, or
    # read within a caller's transaction, whose own writes (counted, maybe rolled back) no
    # other reader can tell from the database's: the next refresh reads every count again.
    counted_as_of: str | None = field(default=None, repr=False)
    # The cluster whose devices this was read from (None: not read from the database, so
    # there are no device rows to ask; see `counter_shortfall`).
    cluster_id: int | None = None
    # The pools the scheduler allocates nothing from, as of this snapshot (`invalid_pools`).
    invalid: InvalidPools = field(default=NO_INVALID_POOLS, repr=False)
    # Whether `invalid` is still to be found: a worker's first snapshot is served before its
    # pools are checked (`fleet_shapes`), and the background refresher checks them.
    pools_pending: bool = field(default=False, repr=False)
    _derived: dict[tuple[Any, ...], Any] = field(default_factory=dict, repr=False)

    def derived(self, key: tuple[Any, ...], compute: Callable[[], T]) -> T:
        """`compute()`, once per `key` while this snapshot of the fleet is in use (the shapes a
        request could be given, what its devices count on a rule, the most on one node)."""
        try:
            value: T = self._derived[key]
        except KeyError:
            value = self._derived[key] = compute()
        return value

    def counter_shortfall(self, shape_ids: frozenset[int]) -> CounterShortfall:
        """Where the present devices of `shape_ids` consume more of a shared counter set than
        it holds (`CounterShortfall`). The counts say how many devices of a shape sit on a
        node, not what each consumes of which counter set: this is read from the devices, in
        two queries at most, once per set of shapes while this snapshot is in use (only
        `allocationMode: All` needs it)."""
        if self.cluster_id is None or not shape_ids:
            return NO_SHORTFALL
        return self.derived(
            ("counter shortfall", shape_ids),
            functools.partial(counter_shortfall, cluster_id=self.cluster_id, shape_ids=shape_ids),
        )

    def placeable(self, candidates: list[Shape]) -> list[Shape]:
        """Those of `candidates` the scheduler can give a device of: with a present device
        outside the pools it allocates nothing from (`invalid`)."""
        if not self.invalid.pools:
            return candidates
        return [
            shape
            for shape in candidates
            if self.shape_devices.get(shape.id, 0) > self.invalid.devices_of(shape.id)
        ]

    def most_of_drivers(self, drivers: frozenset[str]) -> int:
        """The most devices of `drivers` one node reaches, of those the scheduler can give (its
        own and those published without a node); 0: the fleet has none. What an `All` request
        through a class that matches no device yet could be given, at most, once such devices
        appear (`quota.admission.demand`)."""

        def most() -> int:
            on_nodes, off_node = self.placeable_by_node()
            ids = {shape_id for shape_id, shape in self.shapes.items() if shape.driver in drivers}
            everywhere = sum(n for shape_id, n in off_node.items() if shape_id in ids)
            return everywhere + max(
                (sum(n for shape_id, n in node.items() if shape_id in ids) for node in on_nodes),
                default=0,
            )

        return self.derived(("most of drivers", drivers), most)

    def placeable_by_node(self) -> tuple[tuple[Mapping[int, int], ...], Mapping[int, int]]:
        """The present devices the scheduler can give, by shape id (those of the pools it
        allocates nothing from left out: `invalid`): each distinct set a node holds of its own,
        once (thousands of nodes hold a few dozen sets), and those published without a node,
        which every node reaches. A claim is given all its devices on one node, so what an
        `ExactCount` request can take is weighed per set. Worked out once per snapshot."""
        return self.derived(("placeable by node",), self._placeable_by_node)

    def _placeable_by_node(self) -> tuple[tuple[Mapping[int, int], ...], Mapping[int, int]]:
        invalid = self.invalid if self.invalid.pools else None
        distinct: dict[frozenset[tuple[int, int]], Mapping[int, int]] = {}
        for node_id, shapes in self.per_node.items():
            if invalid is not None and (excluded := invalid.devices_on(node_id)):
                shapes = _less(shapes, excluded)
            if shapes:
                distinct.setdefault(frozenset(shapes.items()), shapes)
        off_node = _less(self.off_node, invalid.devices_on(None)) if invalid else self.off_node
        return tuple(distinct.values()), off_node

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
        return _unit_of(self.accelerator_units(device_class, selector))

    def accelerator_units(self, device_class: str, selector: str) -> frozenset[str]:
        """The units of the accelerators (devices of a kind other than "other") a quota rule
        of `device_class` and `selector` covers in this fleet, worked out once per rule
        definition and snapshot (`rule_units` combines them over every cluster's fleet)."""
        return self.derived(
            ("accelerator units", device_class, selector),
            lambda: frozenset(
                self.shapes[shape_id].unit
                for shape_id in self.covered(device_class, selector)
                if self.shapes[shape_id].kind != "other"
            ),
        )

    def covers_accelerators(self, device_class: str, selector: str) -> bool:
        """Whether a quota rule of `device_class` and `selector` covers any accelerator (a
        device of a kind other than "other") in this fleet."""
        return bool(self.accelerator_units(device_class, selector))

    def class_drivers(self, device_class: str) -> frozenset[str]:
        """The drivers whose devices `device_class` is written for, as its selectors name them
        (`device.driver == '...'`): where a class matches no device yet, what could match it
        once devices appear. Empty: the inventory does not know the class, or it names none."""
        return self.derived(
            ("class drivers", device_class),
            lambda: frozenset(
                match[2]
                for expression in self.class_selectors.get(device_class, ())
                for match in _DRIVER_NAMED.finditer(expression)
            ),
        )

    def rule_drivers(self, device_class: str, selector: str) -> frozenset[str]:
        """The drivers of the devices a quota rule of `device_class` and `selector` covers, and
        those its class names (`class_drivers`)."""
        return self.derived(
            ("rule drivers", device_class, selector),
            lambda: self.class_drivers(device_class)
            | {self.shapes[shape_id].driver for shape_id in self.covered(device_class, selector)},
        )

    def candidates(self, device_class: str, selectors: tuple[str, ...]) -> list[Shape]:
        """The shapes a request of `device_class` with `selectors` could be given; none where
        they cannot be weighed (`unweighable` says why)."""
        return self.weigh(device_class, selectors).shapes

    def unweighable(self, device_class: str, selectors: tuple[str, ...]) -> str | None:
        """Why a request of `device_class` with `selectors` cannot be weighed, or None (see
        `weigh`). Such a request is refused (or warned of) by the webhook, never taken to
        select nothing in silence."""
        weighed = self.weigh(device_class, selectors)
        if weighed.problem is None and weighed.steps > cel.MAX_CLAIM_STEPS:
            return too_many_steps()
        return weighed.problem

    def weigh(
        self, device_class: str, selectors: tuple[str, ...], *, budget: int = cel.MAX_CLAIM_STEPS
    ) -> Weighed:
        """The shapes a request of `device_class` with `selectors` could be given, with what
        stops it being weighed: a selector of the class or of its own that does not compile
        or ran past its steps on a shape (`cel.MAX_EVALUATION_STEPS`), or its own selectors
        running past `budget` steps, summed over the class's shapes (then `steps` is past
        `budget` and `shapes` empty). Worked out once per snapshot, unless stopped short of
        `cel.MAX_CLAIM_STEPS` by a smaller budget (what is left of a claim's)."""
        key = ("candidates", device_class, selectors)
        weighed: Weighed | None = self._derived.get(key)
        if weighed is None:
            weighed = self._select(device_class, selectors, budget)
            if weighed.steps <= budget or budget >= cel.MAX_CLAIM_STEPS:
                self._derived[key] = weighed
        return weighed

    def _select(self, device_class: str, selectors: tuple[str, ...], budget: int) -> Weighed:
        class_selectors = self.class_selectors.get(device_class)
        if class_selectors is None:
            return Weighed([])  # a class the inventory does not know selects nothing
        for expression in class_selectors:
            try:
                cel.compile_selector(expression)
            except cel.CELError as exc:  # said by the sync too
                return Weighed(
                    [], f'device class "{device_class}" cannot be weighed: {exc.brief()}'
                )
        # What the request's own selectors take, summed over the shapes they are evaluated on:
        # each evaluation's steps are remembered with its result, so the sum (and whether it
        # runs past the budget) is the same whichever evaluations were done before.
        steps = 0
        selected = []
        for shape in self.shapes.values():
            for expression in class_selectors:
                found = evaluate(expression, shape)
                if found.refused:
                    problem = f'device class "{device_class}" cannot be weighed: {found.refused}'
                    return Weighed([], problem)
                if not found.matched:
                    break
            else:
                for expression in selectors:
                    found = evaluate(expression, shape)
                    steps += found.steps
                    if found.refused:
                        return Weighed([], found.refused, steps)
                    if steps > budget:
                        return Weighed([], None, steps)
                    if not found.matched:
                        break
                else:
                    selected.append(shape)
        return Weighed(selected, None, steps)


@dataclass(frozen=True)
class Weighed:
    """What `FleetShapes.weigh` found for a request: the shapes it could be given, why it
    cannot be weighed (None: it can), and the steps its own selectors took over the shapes."""

    shapes: list[Shape]
    problem: str | None = None
    steps: int = 0


def too_many_steps() -> str:
    """Why a claim whose selectors run past `cel.MAX_CLAIM_STEPS` is not weighed."""
    return (
        f"its selectors take more than {cel.MAX_CLAIM_STEPS:,} evaluation steps over the "
        "devices of their classes (Tally's limit on one claim; the selectors are too expensive)"
    )


def _less(devices: Mapping[int, int], excluded: Mapping[int, int]) -> dict[int, int]:
    """`devices` (by shape id) without `excluded`, and without the shapes none is left of."""
    left = {shape_id: n - excluded.get(shape_id, 0) for shape_id, n in devices.items()}
    return {shape_id: n for shape_id, n in left.items() if n > 0}


_cache: dict[int, FleetShapes] = {}
_cache_lock = threading.Lock()
# Brings the snapshots that are due up to date, off the request path (`fleet_shapes`).
refresher = Refresher("fleet-shapes")
# A refresh reads a few rows; one that takes this long is stuck, and the snapshot it would
# have replaced is served meanwhile: it gives up, and the next request past due tries again.
REFRESH_TIMEOUT_MS = 30_000
# (when read, every cluster), for `every_fleet_shapes`.
_clusters: list[tuple[float, list[Cluster]]] = []
_matches: dict[tuple[str, int], Match] = {}
# Expressions x shapes stays small (rules and request selectors repeat); a process that has
# seen this many distinct pairs starts afresh rather than grow without bound.
MAX_REMEMBERED_MATCHES = 200_000


@dataclass(frozen=True)
class Match:
    """One selector on one shape: whether it selects it, the steps that took, and `refused`:
    why the selector cannot be weighed (it does not compile, or ran past its steps)."""

    matched: bool
    steps: int = 0
    refused: str | None = None


def evaluate(expression: str, shape: Shape) -> Match:
    """`expression` on devices of `shape`.

    Remembered per (expression, shape id) by the process, across snapshots: a shape row never
    changes once written, so a selector is evaluated once per shape, however many requests ask
    and however often the fleet is reloaded. A selector that runs past its steps does so again
    on the same shape, so that is remembered too.
    """
    key = (expression, shape.id)
    result = _matches.get(key)
    if result is None:
        try:
            selector = cel.compile_selector(expression)
        except cel.CELError as exc:
            result = Match(False, refused=exc.brief())
        else:
            outcome = selector.run(shape.view)
            refused = outcome.error if outcome.exceeded else None
            result = Match(outcome.matched, outcome.steps, refused)
        _matches[key] = result
    return result


def match(expression: str, shape: Shape) -> bool:
    """Whether `expression` selects devices of `shape`; one that cannot be weighed selects
    none (see `evaluate`, and `FleetShapes.unweighable` for what the webhook does then)."""
    return evaluate(expression, shape).matched


def covers(
    class_selectors: dict[str, list[str]], device_class: str, selector: str, shape: Shape
) -> bool:
    """Whether a quota rule of `device_class` and `selector` covers devices of `shape`: the
    class's selectors (as `class_selectors` holds them; none: every device) and the rule's
    own all select it. The class narrows what the rule covers; a claim naming another class
    that selects the same devices is still covered. A class the inventory does not know covers
    no device; a rule's selector that cannot be weighed (validated when the rule is written;
    one stored otherwise, or one that runs past its steps on a shape) is left out: the rule
    applies to its whole class.
    """
    expressions = class_selectors.get(device_class)
    if expressions is None or not all(match(expression, shape) for expression in expressions):
        return False
    if not selector:
        return True
    found = evaluate(selector, shape)
    return True if found.refused else found.matched


def rule_unit(shapes: Iterable[Shape]) -> str:
    """The unit of the accelerators among `shapes` (devices of kind "other" say nothing):
    theirs when all agree, "accelerator" when they differ, "gpu" when there are none."""
    return _unit_of({shape.unit for shape in shapes if shape.kind != "other"})


def _unit_of(units: Collection[str]) -> str:
    """`rule_unit` of shapes whose accelerators have `units`."""
    if len(units) > 1:
        return Unit.ACCELERATOR
    return next(iter(units)) if units else Unit.GPU


class RuleDefinition(Protocol):
    """What `rule_units` reads of a rule: a `QuotaRule`, or the webhook's snapshot of one."""

    pk: int
    device_class: str
    selector: str


def rule_units(rules: Iterable[RuleDefinition], fleets: Iterable[FleetShapes]) -> dict[int, str]:
    """What each of `rules` counts over `fleets` (every cluster's: a rule is not of one
    cluster): the unit of the accelerators it covers in any of them (see `rule_unit`). The
    API and the webhook's messages both name a rule's unit by it, so they agree.

    Each fleet keeps, per rule definition, the units of what the rule covers there
    (`FleetShapes.accelerator_units`): the webhook asks on every admission, and walking the
    covered shapes each time cost more than the rest of weighing a plain claim's units."""
    fleets = list(fleets)
    return {
        rule.pk: _unit_of(
            frozenset().union(
                *(fleet.accelerator_units(rule.device_class, rule.selector) for fleet in fleets)
            )
        )
        for rule in rules
    }


def every_fleet() -> list[FleetShapes]:
    """The present device shapes and device classes of every cluster, in two queries however
    many clusters there are (for reads such as the rules API; without devices per node)."""
    fleets: dict[int, FleetShapes] = defaultdict(FleetShapes)
    present = NodeShapeCount.objects.filter(devices__gt=0).values("shape_id")
    for row in DeviceShape.objects.filter(pk__in=present):
        fleets[row.cluster_id].shapes[row.pk] = shape_of(row)
    for cluster_id, name, selectors in DeviceClass.objects.filter(gone_at__isnull=True).values_list(
        "cluster_id", "name", "selectors"
    ):
        fleets[cluster_id].class_selectors[name] = selectors
    return list(fleets.values())


def fleet_shapes(*, cluster: Cluster) -> FleetShapes:
    """The cluster's present device shapes, as of about TALLY_SHAPE_CACHE_SECONDS ago at most.

    A webhook worker serves from memory. Once its snapshot is TALLY_SHAPE_CACHE_SECONDS old,
    the next request starts the process's background refresher (`refresh_due`) and is served
    the snapshot it has: the refresher reads the cluster's fleet version (one row) and, only
    when a sync has changed the fleet since, the device counts changed since the snapshot was
    read (`refreshed`). So no request waits for a reload, and a reload reads what changed, not
    the fleet. The first load is made on the caller's connection. So is every check when the
    setting is 0 (no snapshot may be served past due) or the caller is within a transaction
    (it may hold writes, to the fleet, that no other connection sees: tests, a sync that
    weighs claims).

    The first load reads the counts (tens of milliseconds at 100,000 GPUs), not which pools
    the scheduler allocates nothing from: checking every pool reads every slice and device
    (1.4 s at 100,000 GPUs), longer than an admission may take, and cancelled at its deadline
    it was tried again by every request, none of which was then answered. The background
    refresher checks them (started by each request served a snapshot still pending, until
    one is not); until it has (a worker's first second or two), the snapshot counts the
    devices of such pools as any others (`FleetShapes.pools_pending`). Behind a transaction
    pooler (`DATABASE_TRANSACTION_POOLING`) every admission is a transaction of its own, which
    holds no writes to the fleet: its pools are checked in the background too.
    """
    fleet = _fleet_shapes(cluster)
    if fleet.pools_pending and settings.TALLY_SHAPE_CACHE_SECONDS > 0:
        refresher.start(refresh_due)
    return fleet


def _fleet_shapes(cluster: Cluster) -> FleetShapes:
    now = time.monotonic()
    cached = _cache.get(cluster.pk)
    if cached is not None and now - cached.loaded_at < settings.TALLY_SHAPE_CACHE_SECONDS:
        return cached
    if (
        cached is not None
        and settings.TALLY_SHAPE_CACHE_SECONDS > 0
        and not connection.in_atomic_block
    ):
        refresher.start(refresh_due)
        return cached
    with _cache_lock:
        cached = _cache.get(cluster.pk)
        if cached is not None and now - cached.loaded_at < settings.TALLY_SHAPE_CACHE_SECONDS:
            return cached
        version = _fleet_version(cluster.pk)
        if cached is not None and cached.version == version:
            cached.loaded_at = now
            return cached
        fleet = refreshed(
            cached or FleetShapes(),
            cluster_id=cluster.pk,
            version=version,
            check_pools=settings.TALLY_SHAPE_CACHE_SECONDS <= 0
            or (connection.in_atomic_block and not settings.DATABASE_TRANSACTION_POOLING),
        )
        _keep(cluster.pk, fleet, loaded_at=now)
    return fleet


def refresh_due() -> None:
    """Bring each cached snapshot that is due (TALLY_SHAPE_CACHE_SECONDS old, or its pools not
    checked yet) up to date: the background refresher's work, on its own connection. A
    snapshot replaced or forgotten meanwhile is left as it is; one that cannot be refreshed is
    served until the next try."""
    now = time.monotonic()
    with _cache_lock:
        due = [
            (cluster_id, fleet)
            for cluster_id, fleet in _cache.items()
            if fleet.pools_pending or now - fleet.loaded_at >= settings.TALLY_SHAPE_CACHE_SECONDS
        ]
    if not due:
        return
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT set_config('statement_timeout', %s, false)", [str(REFRESH_TIMEOUT_MS)]
        )
    for cluster_id, fleet in due:
        try:
            version = _fleet_version(cluster_id)
            if version != fleet.version:
                fresh = refreshed(fleet, cluster_id=cluster_id, version=version)
            elif fleet.pools_pending:
                fresh = with_pools_checked(fleet)
            else:
                fresh = fleet
        except Exception:
            log.exception("cluster %s: the fleet's shapes could not be refreshed", cluster_id)
            fresh = fleet  # tried again once due again
        with _cache_lock:
            if _cache.get(cluster_id) is fleet:
                _keep(cluster_id, fresh, loaded_at=now)


def _fleet_version(cluster_id: int) -> int | None:
    return Cluster.objects.filter(pk=cluster_id).values_list("fleet_version", flat=True).first()


def _keep(cluster_id: int, fleet: FleetShapes, *, loaded_at: float) -> None:
    """Serve `fleet` for the cluster from now on (under `_cache_lock`)."""
    fleet.loaded_at = loaded_at
    if len(_matches) > MAX_REMEMBERED_MATCHES:
        _matches.clear()
    _cache[cluster_id] = fleet


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
    the quota services, which count within their own transaction (the sync's included; the
    counts change with the devices, in the same transaction)."""
    return refreshed(FleetShapes(), cluster_id=cluster.pk, version=version)


def refreshed(
    fleet: FleetShapes, *, cluster_id: int, version: int | None, check_pools: bool = True
) -> FleetShapes:
    """A new snapshot: `fleet` with the device counts changed since it was read applied
    (every count, when it was not read or was read within a transaction: see
    `FleetShapes.counted_as_of`), the shapes that appeared loaded, those no device has any
    more dropped, the device classes read again (a handful), and the pools the scheduler
    allocates nothing from (`invalid_pools`; without `check_pools`, left pending unless this
    process has checked the cluster's pools before, when only those changed are checked).
    `fleet` is left as it was: requests may be reading it."""
    if fleet.counted_as_of is None:
        fleet = FleetShapes()
    as_of, changes = _counts_since(cluster_id, fleet.counted_as_of)
    if fleet.counted_as_of is not None and _xmax(as_of) < _xmax(fleet.counted_as_of):
        # Transaction ids went back: another database (restored from a dump) behind the
        # same name. What changed cannot be told from them; every count is read, and every
        # pool checked again (its slices' marks hold transaction ids too).
        fleet = FleetShapes()
        as_of, changes = _counts_since(cluster_id, None)
        _forget_pool_checks(cluster_id)
    fresh = FleetShapes(
        version=version,
        cluster_id=cluster_id,
        per_node=dict(fleet.per_node),
        off_node=dict(fleet.off_node),
        shape_devices=dict(fleet.shape_devices),
        # Within a transaction, what was read may include its own writes, and go with them.
        counted_as_of=None if connection.in_atomic_block else as_of,
    )
    copied: set[int] = set()  # nodes whose counts are `fresh`'s own, no longer `fleet`'s
    for node_id, shape_id, devices in changes:
        if node_id is None:
            counts = fresh.off_node
        else:
            if node_id not in copied:
                fresh.per_node[node_id] = dict(fresh.per_node.get(node_id, {}))
                copied.add(node_id)
            counts = fresh.per_node[node_id]
        before = counts.pop(shape_id, 0)
        if devices:
            counts[shape_id] = devices
        total = fresh.shape_devices.pop(shape_id, 0) + devices - before
        if total:
            fresh.shape_devices[shape_id] = total
    # A shape no device uses is deleted a day later with its count rows (`inventory.services.
    # delete_unused_shapes`): a snapshot that did not see its count fall (read more than a day
    # before) would keep it, so the shapes still stored are asked for (a few dozen ids).
    stored = set(
        DeviceShape.objects.filter(pk__in=fresh.shape_devices).values_list("pk", flat=True)
    )
    for shape_id in fresh.shape_devices.keys() - stored:
        del fresh.shape_devices[shape_id]
        fresh.off_node.pop(shape_id, None)
        for node_id, counts in list(fresh.per_node.items()):
            if shape_id in counts:
                if node_id not in copied:
                    counts = fresh.per_node[node_id] = dict(counts)
                    copied.add(node_id)
                del counts[shape_id]
    for node_id in copied:
        if not fresh.per_node[node_id]:
            del fresh.per_node[node_id]
    missing = fresh.shape_devices.keys() - fleet.shapes.keys()
    loaded = {row.pk: shape_of(row) for row in DeviceShape.objects.filter(pk__in=missing)}
    fresh.shapes = {
        shape_id: fleet.shapes.get(shape_id) or loaded[shape_id]
        for shape_id in sorted(fresh.shape_devices)
    }
    fresh.class_selectors = dict(
        DeviceClass.objects.filter(cluster_id=cluster_id, gone_at__isnull=True).values_list(
            "name", "selectors"
        )
    )
    if check_pools or cluster_id in _pool_checks:
        fresh.invalid = invalid_pools(cluster_id=cluster_id)
    else:
        fresh.pools_pending = True
    return fresh


def with_pools_checked(fleet: FleetShapes) -> FleetShapes:
    """`fleet` with its pending pools checked (`invalid_pools`): a new snapshot, what was
    derived from the old one dropped (it weighed no pool as invalid)."""
    assert fleet.cluster_id is not None  # read from the database: its pools can be checked
    return dataclasses.replace(
        fleet,
        invalid=invalid_pools(cluster_id=fleet.cluster_id),
        pools_pending=False,
        _derived={},
    )


_COUNTS = NodeShapeCount._meta.db_table
# Every count above zero, and the snapshot they were read in (one statement: the same one).
_COUNTS_PRESENT = f"""
SELECT pg_current_snapshot()::text, counted.node_id, counted.shape_id, counted.devices
FROM (VALUES (1)) AS one
LEFT JOIN {_COUNTS} AS counted ON counted.cluster_id = %(cluster)s AND counted.devices > 0
"""
# The counts a transaction that `since` does not see has changed: each has a transaction id
# at or past the oldest `since` saw running (the index's range), and is not visible in it.
_COUNTS_SINCE = f"""
SELECT pg_current_snapshot()::text, counted.node_id, counted.shape_id, counted.devices
FROM (VALUES (1)) AS one
LEFT JOIN {_COUNTS} AS counted
    ON counted.cluster_id = %(cluster)s
    AND counted.changed_xid >= pg_snapshot_xmin(%(since)s::pg_snapshot)::text::bigint
    AND NOT pg_visible_in_snapshot(counted.changed_xid::text::xid8, %(since)s::pg_snapshot)
"""


def _counts_since(
    cluster_id: int, since: str | None
) -> tuple[str, list[tuple[int | None, int, int]]]:
    """The cluster's device counts (node id or None, shape id, devices) changed since the
    snapshot `since` (None: every count above zero), and the snapshot they were read in. A
    count changes in the transaction that changes its devices: whatever changed that `since`
    did not see is read, and nothing it saw is read again."""
    with connection.cursor() as cursor:
        if since is None:
            cursor.execute(_COUNTS_PRESENT, {"cluster": cluster_id})
        else:
            cursor.execute(_COUNTS_SINCE, {"cluster": cluster_id, "since": since})
        rows = cursor.fetchall()
    changes = [(node, shape, devices) for _, node, shape, devices in rows if shape is not None]
    return rows[0][0], changes


def _xmax(snapshot: str) -> int:
    """The first transaction id a snapshot (`xmin:xmax:xip,...`) has not seen begin."""
    return int(snapshot.split(":")[1])


_DEVICES = Device._meta.db_table
# What the present devices of the shapes consume, per node (NULL: published without a node),
# pool generation, counter set and counter: each amount as published, with how many devices
# consume it (a node's GPUs and partitions repeat a few amounts). The sync checked the layout
# on the way in; anything else is left out rather than raised.
_CONSUMED = f"""
SELECT device.node_id, device.driver, device.pool, device.pool_generation,
    consumption->>'counterSet', counter.key, counter.value->>'value', count(*)
FROM {_DEVICES} AS device
CROSS JOIN LATERAL jsonb_array_elements(
    CASE jsonb_typeof(device.extra->'consumesCounters')
        WHEN 'array' THEN device.extra->'consumesCounters'
    END
) AS consumption
CROSS JOIN LATERAL jsonb_each(
    CASE jsonb_typeof(consumption->'counters') WHEN 'object' THEN consumption->'counters' END
) AS counter
WHERE device.cluster_id = %(cluster)s AND device.shape_id = ANY(%(shapes)s)
    AND device.gone_at IS NULL
GROUP BY 1, 2, 3, 4, 5, 6, 7
"""
# A counter set of a pool generation: driver, pool, generation and the set's name.
CounterSetKey = tuple[str, str, int, str]
# What some devices consume: counter set -> counter -> amount.
Consumption = dict[CounterSetKey, dict[str, Decimal]]


def counter_shortfall(*, cluster_id: int, shape_ids: frozenset[int]) -> CounterShortfall:
    """Where the cluster's present devices of `shape_ids`, all given to one claim, consume more
    of some counter set than it holds (see `CounterShortfall`), as the scheduler's allocator
    decides (KEP-4815): a set's name is its pool's, and a device is given only while every
    counter it consumes has room. A device that consumes no counters conflicts with none (a
    GPU beside its static MIG devices: the scheduler gives them all). A shareable device
    (KEP-5075) consumes its counters once, however many claims take a share of it. A set or
    counter its pool does not publish is not weighed here: the scheduler allocates nothing
    from such a pool, and a node that has one is left out before (`InvalidPools`). Two queries
    at most, one when no device consumes counters."""
    with connection.cursor() as cursor:
        cursor.execute(_CONSUMED, {"cluster": cluster_id, "shapes": sorted(shape_ids)})
        rows = cursor.fetchall()
    on_nodes: dict[int, Consumption] = defaultdict(lambda: defaultdict(dict))
    off_node: Consumption = defaultdict(dict)  # what devices published without a node consume
    amounts: dict[str, Decimal] = {}  # each quantity parsed once
    for node_id, driver, pool, generation, set_name, counter, value, devices in rows:
        if set_name is None or value is None:
            continue
        amount = amounts.get(value)
        if amount is None:
            try:
                amount = amounts[value] = Decimal(parse_quantity(value))
            except ValueError:
                continue  # the sync checks every quantity: stored otherwise, not weighed
        consumption = off_node if node_id is None else on_nodes[node_id]
        counters = consumption[(driver, pool, generation, set_name)]
        counters[counter] = counters.get(counter, Decimal(0)) + amount * devices
    if not on_nodes and not off_node:
        return NO_SHORTFALL
    published = published_counter_sets(
        generations={
            (cluster_id, driver, pool, generation)
            for consumption in [*on_nodes.values(), off_node]
            for driver, pool, generation, _ in consumption
        }
    )
    totals = {
        (driver, pool, generation, set_name): counters
        for (_, driver, pool, generation), sets in published.items()
        for set_name, counters in sets.items()
    }
    return CounterShortfall(
        nodes=frozenset(
            node_id
            for node_id, on_node in on_nodes.items()
            if _exceeds(_together(on_node, off_node), totals)
        ),
        everywhere=_exceeds(off_node, totals),
    )


def _together(*consumptions: Consumption) -> Consumption:
    """What devices consume together: a node's own and those reached from every node (the
    same counter set only when they are of one pool)."""
    summed: Consumption = defaultdict(dict)
    for consumption in consumptions:
        for counter_set, counters in consumption.items():
            for counter, amount in counters.items():
                summed[counter_set][counter] = summed[counter_set].get(counter, Decimal(0)) + amount
    return summed


def _exceeds(consumed: Consumption, totals: dict[CounterSetKey, dict[str, Decimal]]) -> bool:
    """Whether some counter of some set is consumed past what the set holds."""
    return any(
        amount > total[counter]
        for counter_set, counters in consumed.items()
        if (total := totals.get(counter_set)) is not None
        for counter, amount in counters.items()
        if counter in total
    )


# The mark of the cluster's present slices: each row version's place and transaction, so any
# write to one of them (a slice changed, added or gone) changes it.
_SLICES_MARK = f"""
SELECT md5(string_agg(ctid::text || ':' || xmin::text, ',' ORDER BY id))
FROM {ResourceSlice._meta.db_table}
WHERE cluster_id = %(cluster)s AND gone_at IS NULL
"""
# The same, of each pool's.
_POOL_MARKS = f"""
SELECT driver, pool, md5(string_agg(ctid::text || ':' || xmin::text, ',' ORDER BY id))
FROM {ResourceSlice._meta.db_table}
WHERE cluster_id = %(cluster)s AND gone_at IS NULL
GROUP BY driver, pool
"""
# The present devices of some pool generations, per pool, node and shape.
_POOL_DEVICES = f"""
SELECT device.driver, device.pool, device.node_id, device.shape_id, count(*)
FROM {_DEVICES} AS device
JOIN unnest(%(drivers)s::text[], %(pools)s::text[], %(generations)s::bigint[])
    AS pool (driver, pool, generation)
    ON device.driver = pool.driver AND device.pool = pool.pool
    AND device.pool_generation = pool.generation
WHERE device.cluster_id = %(cluster)s AND device.gone_at IS NULL AND device.shape_id IS NOT NULL
GROUP BY 1, 2, 3, 4
"""


@dataclass(frozen=True)
class _PoolChecks:
    """What each pool of a cluster was found to be (`inventory.checks.invalid_pools`), by
    (driver, pool): the mark of its present slices when checked (`_POOL_MARKS`) and the
    problem found (None: sound); the cluster's mark then, and the pools found invalid."""

    mark: str
    pools: Mapping[tuple[str, str], tuple[str, InvalidPool | None]]
    invalid: tuple[InvalidPool, ...]


# By cluster id. A pool's devices and counter sets are all published in its slices, so one
# whose mark is unchanged need not be checked again, nor any pool of a cluster whose mark is.
# Shared by every snapshot of the process (replaced whole, never changed in place): a check
# made within a transaction that then rolled back is of row versions no one will see, and its
# marks never match again.
_pool_checks: dict[int, _PoolChecks] = {}


def invalid_pools(*, cluster_id: int) -> InvalidPools:
    """The cluster's pools the scheduler allocates nothing from (`InvalidPools`), as stored
    now. The mark of its present slices is read; when it changed since its pools were checked
    (always, the first time in a process), each pool's, and the pools whose mark changed are
    checked again; the devices of the pools found invalid are read. One query when no slice
    changed and no pool is invalid, four at most."""
    before = _pool_checks.get(cluster_id) or _PoolChecks(mark="", pools={}, invalid=())
    with connection.cursor() as cursor:
        cursor.execute(_SLICES_MARK, {"cluster": cluster_id})
        (mark,) = cursor.fetchone() or ("",)
    now = before
    if not mark or mark != before.mark:
        # Read after the cluster's mark: a slice changed in between is checked again next time.
        with connection.cursor() as cursor:
            cursor.execute(_POOL_MARKS, {"cluster": cluster_id})
            marks = {(driver, pool): pool_mark for driver, pool, pool_mark in cursor.fetchall()}
        changed = [
            key for key, pool_mark in marks.items() if before.pools.get(key, ("",))[0] != pool_mark
        ]
        found = (
            checks.invalid_pools(
                cluster_id=cluster_id, pools=None if len(changed) == len(marks) else changed
            )
            if changed
            else []
        )
        by_pool = {(pool.driver, pool.pool): pool for pool in found}
        pools = {key: before.pools[key] for key in marks.keys() - set(changed)}
        pools.update((key, (marks[key], by_pool.get(key))) for key in changed)
        now = _pool_checks[cluster_id] = _PoolChecks(
            mark=mark or "",
            pools=pools,
            invalid=tuple(
                sorted(
                    (pool for _, pool in pools.values() if pool is not None),
                    key=lambda pool: (pool.driver, pool.pool),
                )
            ),
        )
    if not now.invalid:
        return NO_INVALID_POOLS
    devices: dict[tuple[str, str], dict[int | None, dict[int, int]]] = defaultdict(
        lambda: defaultdict(dict)
    )
    with connection.cursor() as cursor:
        cursor.execute(
            _POOL_DEVICES,
            {
                "cluster": cluster_id,
                "drivers": [pool.driver for pool in now.invalid],
                "pools": [pool.pool for pool in now.invalid],
                "generations": [pool.generation for pool in now.invalid],
            },
        )
        for driver, pool_name, node_id, shape_id, count in cursor.fetchall():
            devices[(driver, pool_name)][node_id][shape_id] = count
    return InvalidPools(pools=now.invalid, devices=devices)


def _forget_pool_checks(cluster_id: int) -> None:
    _pool_checks.pop(cluster_id, None)


def _model(row: DeviceShape) -> tuple[str, str]:
    """The model a device of `row` publishes, as its driver's built-in profile reads it (what
    denials name: no database read on the webhook's path), and where a DRA CEL selector reads
    it (`device.attributes["<domain>"].<name>`); ("", "") if none."""
    attributes = row.attributes if isinstance(row.attributes, dict) else {}
    for name in profiles.builtin_profile(row.driver).model_attributes:
        # As `dra.ParsedDevice.attribute` looks it up: unqualified (the driver's domain),
        # qualified with the driver's domain, or with NVIDIA's.
        for key, domain in (
            (name, row.driver),
            (f"{row.driver}/{name}", row.driver),
            (f"{dra.NVIDIA_DOMAIN}/{name}", dra.NVIDIA_DOMAIN),
        ):
            entry = attributes.get(key)
            if not isinstance(entry, dict):
                continue
            value = next((entry[t] for t in dra.ATTRIBUTE_TYPES if t in entry), None)
            if value is None:
                continue
            if isinstance(value, list) or not str(value):
                break
            attribute = name.rsplit("/", 1)[-1]
            if "/" in name:  # a qualified name of the profile's: its own domain
                domain = name.rsplit("/", 1)[0]
            usable = "string" in entry and _IDENTIFIER.fullmatch(attribute) is not None
            return str(value), (f"{domain}/{attribute}" if usable else "")
    return "", ""


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def model_selector(attribute: str, models: Iterable[str]) -> str:
    """A DRA CEL selector that matches the devices whose `attribute` ("<domain>/<name>", as
    `Shape.model_attribute`) is one of `models`: what the mutating webhook adds to a request it
    narrows to the models that fit (`quota.admission.decision`)."""
    domain, name = attribute.rsplit("/", 1)
    read = f"device.attributes[{json.dumps(domain)}].{name}"
    return " || ".join(f"{read} == {json.dumps(model)}" for model in sorted(set(models)))


def fit_selector(
    kept: Iterable[tuple[str, str]], attributes: Mapping[str, str], *, by_driver: bool
) -> str:
    """The selector that keeps the models `kept` ((model, driver) pairs), each read where its
    driver publishes it (`attributes`, by driver: `Shape.model_attribute`). Without `by_driver`
    (every candidate device publishes its model under one attribute) as `model_selector`;
    with it (candidates of several drivers, each its own attribute), one clause per driver that
    reads its attribute only on its own devices: `(device.driver == "gpu.nvidia.com" &&
    (device.attributes["gpu.nvidia.com"].productName == "...")) || (device.driver == ...)`.
    A device of another driver never reads an attribute it lacks (CEL's `false && error` is
    false), which would fail its allocation."""
    by: dict[str, set[str]] = defaultdict(set)
    for model, driver in kept:
        by[driver].add(model)
    if not by_driver:
        (attribute,) = {attributes[driver] for driver in by}
        return model_selector(attribute, {model for models in by.values() for model in models})
    clauses = []
    for driver in sorted(by):
        models = model_selector(attributes[driver], by[driver])
        clauses.append(f"(device.driver == {json.dumps(driver)} && ({models}))")
    return " || ".join(clauses)


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
    # Its pools are checked in the background: wait for that, not the first request (the
    # refresher may have been busy with another snapshot when this one was made).
    while fleet.pools_pending and time.monotonic() < deadline:
        refresher.join(max(0.0, deadline - time.monotonic()))
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
    """Drop the cache (tests, and after an import that changed the fleet in this process); a
    refresh running meanwhile keeps nothing."""
    with _cache_lock:
        _cache.clear()
        _matches.clear()
        _clusters.clear()
    _pool_checks.clear()


def _memory(capacity: dict[str, dict[str, str]]) -> int | None:
    for name, entry in capacity.items():
        if name.rsplit("/", 1)[-1] in ("memory", "addressableMemory") and "value" in entry:
            return int(parse_quantity(entry["value"]))
    return None
