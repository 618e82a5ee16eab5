"""What one request of a claim can take on each rule: the counting the admission weighs
(`quota.admission.decision.plan_claim`) and the ledger's recount works out again (`per_device`).

A claim is counted by what it can really take, all its devices on one node (devices published
without a node reach every node): `ExactCount` the count of matching devices that count most
on one node that has that many (see `_most_of_count_on_a_node`), `All` every matching device
of the node where they count most, each by its own shape (see `_most_on_a_node`), of the nodes
where they can all be given (not too many, not more than their shared counter sets hold, no
pool there the scheduler allocates nothing from), never a device of such a pool (one that
publishes a device name or counter set twice, or whose devices consume a counter set or counter
its slices do not publish: `shapes.InvalidPools`), a MIG
device its share of its GPU, a consumable share (KEP-5075) the largest fraction it
consumes of any of the device's capacities (`inventory.capacity`: its requests under any
capacity name, qualified or not, rounded up by `requestPolicy`, and the policy's default for
what it does not name), `adminAccess` nothing. Amounts are in the unit of
the devices a rule covers (GPUs, TPU chips, Gaudi cards; "accelerators" when they differ), and
messages say which. Rules bind devices, not class names:
a request counts on every rule that covers a device it could be given (the rule's device
class's selectors and its own), whatever class the request names; one whose class matches no
device yet counts whole devices on the rules of its class and of its class's driver, and one
whose class names no driver either is denied under enforce (`demand`). `claim_amounts` is what an
admitted claim holds until it is allocated, as the ledger's recount works it out again.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from kubernetes.utils import parse_quantity

from inventory import capacity, dra
from inventory.checks import InvalidPool
from inventory.profiles import unit_label
from quota import cel
from quota.admission.plans import MEMORY_CAPACITIES, Demand, Rule
from quota.admission.shapes import NO_SHORTFALL, FleetShapes, Shape, rule_unit
from quota.models import Unit


def demand(
    request: dra.ParsedRequest,
    rules: Sequence[Rule],
    fleet: FleetShapes,
    warnings: list[str],
) -> Demand:
    """What `request` can take on each of `rules` that limits it: each rule that covers a
    device the request could be given (its class's selectors and its own, over the fleet's
    shapes, less those that cannot provide its capacity requests and those whose every device
    is in a pool the scheduler allocates nothing from), whatever class the request names. A
    request whose every matching device is in such pools can never be allocated: it counts
    nothing, with a warning naming the pool and what is wrong with it. So does an `All`
    request that no node can give everything it matches (`_never_allocated`). An `ExactCount`
    request for more devices than any node can give now counts as the most its devices could,
    with a warning (`_too_few`): a node that can may join."""
    result = Demand(name=request.name, amounts={}, devices=0)
    if request.admin_access or not rules:
        return result  # admin access observes devices; it holds nothing
    selectors = tuple(request.selectors)
    asked = tuple(sorted(request.capacity_requests.items()))

    def eligible(selectors: tuple[str, ...]) -> list[Shape]:
        """The shapes of the request's class that `selectors` select and that can provide
        its capacity requests, once per fleet snapshot."""
        return fleet.derived(
            ("eligible", request.device_class_name, selectors, asked),
            lambda: _eligible(
                fleet.candidates(request.device_class_name, selectors),
                request.capacity_requests,
            ),
        )

    candidates = eligible(selectors)
    if not candidates and selectors:
        # Its own selectors match no shape. Shapes leave out what identifies one device (its
        # uuid, index, PCI address: `dra.IDENTITY_ATTRIBUTES`), so a selector that reads one
        # cannot be weighed here; it counts as what any device of its class could be given
        # (the most it could take), never as nothing.
        unweighed = eligible(())
        if unweighed:
            candidates = unweighed
            selectors = ()
            warnings.append(
                f'request "{request.name}": no device of class "{request.device_class_name}" '
                "matches its selectors before allocation (a uuid or index is not weighed); "
                "until it is allocated, each device it asks for counts as the most one of its "
                "class could"
            )
    placeable = fleet.placeable(candidates)
    if candidates and not placeable:
        # Devices it matches, each in a pool the scheduler allocates none of: never given.
        shape_ids = {shape.id for shape in candidates}
        result.amounts = {
            rule.pk: Decimal(0)
            for rule in rules
            if shape_ids & fleet.covered(rule.device_class, rule.selector)
        }
        warnings.append(
            _never_placed(request, fleet.invalid.holding(shape.id for shape in candidates))
        )
        return result
    matched, candidates = candidates, placeable
    result.shapes = frozenset(shape.id for shape in candidates)
    per_device_on: dict[int, Decimal] = {}
    keys: dict[int, tuple[Any, ...]] = {}
    for rule in rules:
        # What one device counts on this rule: the same for every request that asks alike, so
        # worked out once per fleet snapshot (None: the rule covers none of the candidates).
        key = (
            request.device_class_name,
            selectors,
            asked,
            rule.device_class,
            rule.selector,
            rule.unit,
        )
        each = fleet.derived(
            key,
            functools.partial(
                _per_device_on,
                rule,
                request.device_class_name,
                candidates,
                fleet,
                request.capacity_requests,
            ),
        )
        if each is None:
            continue
        per_device_on[rule.pk] = each
        keys[rule.pk] = key
        if rule.selector:  # validated when written; kept safe if stored otherwise
            error = fleet.derived(
                ("selector error", rule.selector), functools.partial(_selector_error, rule.selector)
            )
            if error:
                warnings.append(
                    f'quota rule "{rule.name}" has a bad selector, applied to its whole class: '
                    f"{error}"
                )
    if not candidates and not fleet.class_drivers(request.device_class_name):
        known = request.device_class_name in fleet.class_selectors
        result.unbound = (
            f'request "{request.name}": no device in the inventory matches class '
            f'"{request.device_class_name}", '
            + ("and its selectors name no driver" if known else "which the inventory does not know")
            + ", so Tally cannot tell which quota rules it would count on"
        )
    if not per_device_on:
        return result
    if not candidates:
        # Nothing to weigh it by: it counts as whole devices on every rule of its class and of
        # its driver, the most it could take, until the sync sees what it was given.
        units = {fleet.unit(r.device_class, r.selector) for r in rules if r.pk in per_device_on}
        whole = units.pop() if len(units) == 1 else "accelerator"
        asking = (
            " with capacity " + ", ".join(f"{name}: {value}" for name, value in asked)
            if asked
            else ""
        )
        class_drivers = fleet.class_drivers(request.device_class_name)
        drivers = ", ".join(sorted(class_drivers))
        of_driver = f" and of its driver {drivers}" if drivers else ""
        if request.allocation_mode == "All":
            return _all_of_no_device(request, result, per_device_on, fleet, whole, warnings)
        result.note = (
            f' (request "{request.name}": no device of class "{request.device_class_name}"'
            f"{asking} in the inventory matches it; until allocated, each device it asks for "
            f"counts as a whole {unit_label(whole, plural=False)} (no memory) on every quota "
            f"rule of its class{of_driver})"
        )
        warnings.append(result.note.removeprefix(" (").removesuffix(")"))
    if request.allocation_mode != "All":
        if request.count == 1 or not candidates:
            # One device: the most one of them counts, wherever it is. None known: whole ones.
            result.devices = request.count
            result.amounts = {
                rule_id: each * request.count for rule_id, each in per_device_on.items()
            }
            return result
        exact = fleet.derived(
            ("exact on nodes", request.device_class_name, selectors, asked),
            functools.partial(_exact_on_nodes, fleet, candidates, request.capacity_requests),
        )
        result.devices = request.count
        if request.count > min(exact.most, dra.ALLOCATION_RESULTS_MAX_SIZE):
            # No node can give it that many now. One that can may join (an autoscaler's node)
            # and the claim be allocated there: it counts as the most its devices could count,
            # never nothing, with a warning saying why it waits.
            result.amounts = {
                rule_id: each * request.count for rule_id, each in per_device_on.items()
            }
            warnings.append(_too_few(request, exact, fleet, matched))
            return result
        for rule in rules:
            if rule.pk in per_device_on:
                result.amounts[rule.pk] = fleet.derived(
                    ("exact on rule", *keys[rule.pk], request.count),
                    functools.partial(
                        _most_of_count_on_a_node,
                        rule,
                        request.count,
                        exact,
                        candidates,
                        fleet,
                        request.capacity_requests,
                    ),
                )
        return result
    every = fleet.derived(
        ("all on nodes", request.device_class_name, selectors, asked),
        functools.partial(_all_on_nodes, fleet, candidates),
    )
    result.devices = every.devices
    for rule in rules:
        if rule.pk in per_device_on:
            # Keyed by the rule's definition, as `each` is: what it counts depends on that.
            result.amounts[rule.pk] = fleet.derived(
                ("all on rule", *keys[rule.pk]),
                functools.partial(
                    _most_on_a_node, rule, every, candidates, fleet, request.capacity_requests
                ),
            )
    if not every.nodes and (every.too_many or every.refused):
        warnings.append(_never_allocated(request.name, every, candidates))
    return result


def _all_of_no_device(
    request: dra.ParsedRequest,
    result: Demand,
    per_device_on: dict[int, Decimal],
    fleet: FleetShapes,
    whole: str,
    warnings: list[str],
) -> Demand:
    """An `allocationMode: All` request through a class that matches no device yet (a MIG
    profile not configured, GPUs not bound to vfio): it will be given every matching device of
    a node once they appear, so it counts as the most devices of its class's driver any one
    node has, each a whole device, on the rules of its class and of its driver, with a
    warning; never 0. Where the fleet has no device of that driver at all nothing says how
    many it would be given: `unbound` (denied where an enforce rule binds the team)."""
    if result.unbound:
        return result  # a class that names no driver: said already
    class_drivers = fleet.class_drivers(request.device_class_name)
    drivers = ", ".join(sorted(class_drivers))
    most = fleet.most_of_drivers(class_drivers)
    if not most:
        result.unbound = (
            f'request "{request.name}" (allocationMode All): no device of class '
            f'"{request.device_class_name}" is in the inventory, nor any of its driver '
            f"{drivers or '(none named)'}, so Tally cannot tell how many devices it would be "
            "given"
        )
        return result
    result.devices = most
    result.amounts = {rule_id: each * most for rule_id, each in per_device_on.items()}
    label = unit_label(whole, plural=most != 1)
    result.note = (
        f' (request "{request.name}" (allocationMode All): class "{request.device_class_name}" '
        f"matches no device yet; until allocated, it counts as {most} whole {label}, the most "
        f"devices of its driver {drivers} on one node, on every quota rule of its class and "
        "driver)"
    )
    warnings.append(result.note.removeprefix(" (").removesuffix(")"))
    return result


def _never_placed(request: dra.ParsedRequest, pools: list[InvalidPool]) -> str:
    """Why a request whose every matching device is in `pools`, which the scheduler allocates
    nothing from, can never be allocated: the first pool and what its devices consume that it
    does not publish. What matters comes first: the API server keeps 256 characters."""
    mode = " (allocationMode All)" if request.allocation_mode == "All" else ""
    return (
        f'request "{request.name}"{mode} can never be allocated, and counts nothing on quota '
        f"rules: it matches only devices of {_invalid_pools(pools)}"
    )


def _invalid_pools(pools: list[InvalidPool]) -> str:
    """ "pool d/p, which the scheduler allocates nothing from: counter set 'x' is published by
    no slice of generation 1 (consumed by y)": the first of `pools`, and how many more."""
    if not pools:
        return "a pool the scheduler allocates nothing from"
    first = pools[0]
    others = len(pools) - 1
    more = f" (and {others} more such pool{'s' if others > 1 else ''})" if others else ""
    return (
        f"pool {first.driver}/{first.pool}{more}, which the scheduler allocates nothing from: "
        f"{first.problem()}"
    )


def _too_few(
    request: dra.ParsedRequest, exact: ExactOnNodes, fleet: FleetShapes, candidates: list[Shape]
) -> str:
    """Why an `ExactCount` request cannot be allocated: it asks for more devices than the
    scheduler gives one claim (never), or no node can give it that many of the devices it
    matches now (its own and those every node reaches; not those of a pool the scheduler
    allocates nothing from, named when `candidates`, the shapes it matches, have devices in
    one). It counts as the most its devices could. What matters comes first: the API server
    keeps 256 characters."""
    limit = dra.ALLOCATION_RESULTS_MAX_SIZE
    if request.count > limit:
        return (
            f'request "{request.name}" can never be allocated: it asks for {request.count} '
            f"devices, more than the {limit} one claim is given"
        )
    why = (
        f"it asks for {request.count} devices, all given on one node, and no node can give "
        f"more than {exact.most} of those it matches"
    )
    if fleet.invalid.pools:
        pools = fleet.invalid.holding(shape.id for shape in candidates)
        if pools:
            why += f", not counting those of {_invalid_pools(pools)}"
    return (
        f'request "{request.name}" cannot be allocated on any node now (a node that can may '
        f"join), and counts as the most its devices could: {why}"
    )


def _never_allocated(request_name: str, every: AllOnNodes, candidates: list[Shape]) -> str:
    """Why an `All` request can be allocated on no node that has devices it matches: too
    many of them for one claim, more than their shared counter sets hold, or a pool there the
    scheduler allocates nothing from. (The API server keeps 256 characters of a warning.)"""
    unit = unit_label(rule_unit(candidates), plural=False)
    limit = dra.ALLOCATION_RESULTS_MAX_SIZE
    if every.invalid:
        pools = _invalid_pools(list(every.invalid_pools))
        if every.invalid == every.refused and not every.too_many:
            return (
                f'request "{request_name}" (allocationMode All) can never be allocated, and '
                f"counts nothing on quota rules: each node with devices it matches has {pools}"
            )
        # Refused for different reasons: the pool comes first, as the API server keeps 256
        # characters and a pool's name may be a long node name.
        return (
            f'request "{request_name}" (allocationMode All) can never be allocated, counting '
            f"nothing: {pools}. It is on each node with devices it matches where they are not "
            "too many for one claim nor overfill a shared counter set."
        )
    if not every.short_of_counters:
        reason = (
            f"would be given all {every.too_many} devices it matches on a node, more than the "
            f"{limit} the scheduler gives one claim, on every node that has any"
        )
    elif not every.too_many:
        reason = (
            "matches, on each node with any, devices that consume more of a shared counter set "
            f"than it has (a whole {unit} and its partitions)"
        )
    else:
        reason = (
            f"matches, on each node with any, more than {limit} devices (a claim's most) or "
            "devices that consume more of a shared counter set than it has"
        )
    return (
        f'request "{request_name}" (allocationMode All) {reason}: it can never be allocated, '
        "and counts nothing on quota rules"
    )


def _eligible(candidates: list[Shape], capacity_requests: dict[str, str]) -> list[Shape]:
    """The candidate shapes that can provide `capacity_requests`: the scheduler gives a
    request only devices that publish every capacity it asks for, with enough of it, in
    amounts their `requestPolicy` allows."""
    if not capacity_requests:
        return candidates
    return [shape for shape in candidates if _consumes(shape, capacity_requests) is not None]


def _consumes(shape: Shape, capacity_requests: dict[str, str]) -> dict[str, Decimal] | None:
    """What a request asking `capacity_requests` consumes of a device of `shape`, by capacity;
    None when it cannot be given one."""
    try:
        return capacity.requested_amounts(shape.capacity, capacity_requests, shape.driver)
    except capacity.CapacityError:
        return None


@dataclass(frozen=True)
class AllOnNodes:
    """Where an `allocationMode: All` request can be allocated: the scheduler gives it every
    device it matches on the node (each shareable one a share of what it asks), so a node
    where that is more than a claim can hold (`dra.ALLOCATION_RESULTS_MAX_SIZE`) never can,
    nor one where together they consume more of a shared counter set than it holds (a whole
    GPU and its partitions published together, KEP-4815; see `shapes.counter_shortfall`).
    Devices that consume no counters (a GPU beside its static MIG devices) are all given."""

    # The matching devices by shape id, of each node where they can all be given.
    nodes: tuple[Mapping[int, int], ...]
    # The most matching devices on one of those nodes.
    devices: int
    # The most matching devices on a node where they are too many to be given (0: none is).
    too_many: int
    # The nodes where the matching devices consume more of a counter set than it holds.
    short_of_counters: int = 0
    # The nodes with a pool the scheduler allocates nothing from, and those pools.
    invalid: int = 0
    invalid_pools: tuple[InvalidPool, ...] = ()

    @property
    def refused(self) -> int:
        """The nodes with matching devices where the request cannot be allocated (not those
        where they are too many: counted by how many, in `too_many`)."""
        return self.short_of_counters + self.invalid


def _all_on_nodes(fleet: FleetShapes, candidates: list[Shape]) -> AllOnNodes:
    """Devices published without a node (a pool of `allNodes` or a `nodeSelector`) can be
    reached from a node: they are weighed as on every node, and on a node with none of its
    own (the most such a request could be given). A node with devices of a pool the scheduler
    allocates nothing from (`FleetShapes.invalid`; one published without a node: every node)
    is left out, whatever they are: the scheduler fails an All request there. What the devices
    consume of their counter sets is read (`FleetShapes.counter_shortfall`) only when some
    other node has two matching devices or more."""
    ids = {shape.id for shape in candidates}
    off_node = {shape_id: n for shape_id, n in fleet.off_node.items() if shape_id in ids}
    on_nodes: list[tuple[int | None, dict[int, int]]] = []
    too_many = invalid = 0
    invalid_pools: dict[tuple[str, str], InvalidPool] = {}
    for node_id, shapes in [*fleet.per_node.items(), (None, {})]:
        matching = {shape_id: n for shape_id, n in shapes.items() if shape_id in ids}
        for shape_id, n in off_node.items():
            matching[shape_id] = matching.get(shape_id, 0) + n
        devices = sum(matching.values())
        met = fleet.invalid.on(node_id) if devices and fleet.invalid.pools else []
        if devices > dra.ALLOCATION_RESULTS_MAX_SIZE:
            too_many = max(too_many, devices)
        elif met:
            invalid += 1
            invalid_pools.update(((pool.driver, pool.pool), pool) for pool in met)
        elif devices:
            on_nodes.append((node_id, matching))
    shortfall = (
        fleet.counter_shortfall(frozenset(ids))
        if any(sum(matching.values()) > 1 for _, matching in on_nodes)
        else NO_SHORTFALL
    )
    nodes = [matching for node_id, matching in on_nodes if not shortfall.on(node_id)]
    return AllOnNodes(
        nodes=tuple(nodes),
        devices=max((sum(node.values()) for node in nodes), default=0),
        too_many=too_many,
        short_of_counters=len(on_nodes) - len(nodes),
        invalid=invalid,
        invalid_pools=tuple(invalid_pools[key] for key in sorted(invalid_pools)),
    )


@dataclass(frozen=True)
class ExactOnNodes:
    """Where an `ExactCount` request can be given its devices: all on one node (a claim's
    allocation has one node selector), from the devices it matches there and those published
    without a node, which every node reaches (not those of a pool the scheduler allocates
    nothing from). Nodes that hold the same devices are one entry.

    A shareable device (KEP-5075) is weighed as giving the request as many shares as its
    capacity holds (`_shares_of_one`): the allocators before the one that tries combinations of
    a request's devices rather than permutations (kubernetes#133678) give one request several
    shares of one device, the newer ones one; a quota weighs the most it could take."""

    # The matching devices by shape id that one node reaches, each distinct set once, with how
    # many they are.
    nodes: tuple[tuple[int, Mapping[int, int]], ...]
    # The most matching devices one node reaches.
    most: int


def _exact_on_nodes(
    fleet: FleetShapes, candidates: list[Shape], capacity_requests: dict[str, str]
) -> ExactOnNodes:
    """The sets of matching devices the nodes reach (`ExactOnNodes`), from the distinct sets
    of devices the nodes hold (`FleetShapes.placeable_by_node`), never from the nodes one by
    one: a fleet of thousands of nodes holds a few dozen sets."""
    ids = {shape.id for shape in candidates}
    shares = {
        shape.id: _shares_of_one(shape, capacity_requests)
        for shape in candidates
        if shape.shareable
    }
    on_nodes, off_node = fleet.placeable_by_node()
    everywhere = {shape_id: n for shape_id, n in off_node.items() if shape_id in ids}
    distinct: dict[frozenset[tuple[int, int]], Mapping[int, int]] = {}
    for shapes in (*on_nodes, {}):  # {}: a node with none of its own
        matching = dict(everywhere)
        for shape_id, n in shapes.items():
            if shape_id in ids:
                matching[shape_id] = matching.get(shape_id, 0) + n
        for shape_id in shares.keys() & matching.keys():
            matching[shape_id] = min(matching[shape_id] * shares[shape_id], dra.MAX_REQUEST_COUNT)
        if matching:
            distinct.setdefault(frozenset(matching.items()), matching)
    nodes = tuple((sum(matching.values()), matching) for matching in distinct.values())
    return ExactOnNodes(nodes=nodes, most=max((devices for devices, _ in nodes), default=0))


def _shares_of_one(shape: Shape, capacity_requests: dict[str, str]) -> int:
    """How many shares a request asking `capacity_requests` could take of one shareable device
    of `shape`: as many as the largest fraction of a capacity it consumes fits in the device
    (one, when it consumes the whole device, as a request that names no capacity of a device
    without a policy does); any number when that cannot be read, the most it could take."""
    consumed = _consumes(shape, capacity_requests)
    if consumed is None:
        return 1  # it cannot be given one (left out before)
    try:
        fraction = capacity.consumed_fraction(shape.capacity, consumed, shape.driver)
    except capacity.CapacityError:
        return dra.MAX_REQUEST_COUNT
    return min(int(1 / fraction), dra.MAX_REQUEST_COUNT) if fraction > 0 else dra.MAX_REQUEST_COUNT


def _most_of_count_on_a_node(
    rule: Rule,
    count: int,
    exact: ExactOnNodes,
    candidates: list[Shape],
    fleet: FleetShapes,
    capacity_requests: dict[str, str],
) -> Decimal:
    """What an `ExactCount` request of `count` devices counts on `rule`: on each node that
    reaches that many matching devices, the sum of the `count` of them that count most on the
    rule (each by its own shape; one the rule does not cover counts nothing, and an
    integrated GPU nothing on a rule of accelerators); the most over those nodes. A node with
    one discrete GPU and one integrated GPU gives two devices that count one GPU, not two."""
    each = _per_shape_on(rule, candidates, fleet, capacity_requests)
    most = Decimal(0)
    for devices, node in exact.nodes:
        if devices < count:
            continue
        left, total = count, Decimal(0)
        for amount, n in sorted(
            ((each[shape_id], n) for shape_id, n in node.items() if shape_id in each),
            reverse=True,
        ):
            taken = min(n, left)
            total += amount * taken
            left -= taken
            if not left:
                break
        most = max(most, total)
    return most


def _most_on_a_node(
    rule: Rule,
    every: AllOnNodes,
    candidates: list[Shape],
    fleet: FleetShapes,
    capacity_requests: dict[str, str],
) -> Decimal:
    """What an `All` request counts on `rule`: on each node where it can be allocated, the sum
    of what each matching device there counts on the rule (by its own shape: a 40GB and an
    80GB GPU, a GPU and MIG devices, count each what they are); the most over those nodes,
    which need not be the node with the most devices. A rule that covers some of the shapes
    counts only those. A node where they consume more of a shared counter set than it holds
    is not among them (`AllOnNodes`)."""
    each = _per_shape_on(rule, candidates, fleet, capacity_requests)
    return max(
        (
            sum(
                (each[shape_id] * n for shape_id, n in node.items() if shape_id in each),
                Decimal(0),
            )
            for node in every.nodes
        ),
        default=Decimal(0),
    )


def _per_device_on(
    rule: Rule,
    request_class: str,
    candidates: list[Shape],
    fleet: FleetShapes,
    capacity_requests: dict[str, str],
) -> Decimal | None:
    """The most one device of `candidates` that `rule` covers counts on it; None when it
    covers none of them (it does not limit the request). A request that no known device
    matches is limited, as whole devices, by the rules of the class it names, by those of its
    class's driver (`FleetShapes.class_drivers`): the devices that match it when they appear (a
    MIG profile configured later, GPUs bound to vfio) are that driver's, and by those whose
    class names no driver, which may cover them too."""
    if not candidates:
        # A rule whose class names no driver ("any accelerator") may cover its devices too.
        drivers = fleet.class_drivers(request_class)
        if (
            rule.device_class != request_class
            and fleet.class_drivers(rule.device_class)
            and not drivers & fleet.rule_drivers(rule.device_class, rule.selector)
        ):
            return None
        return Decimal(1) if rule.unit == Unit.GPUS else Decimal(0)
    each = _per_shape_on(rule, candidates, fleet, capacity_requests)
    return max(each.values()) if each else None


def _per_shape_on(
    rule: Rule,
    candidates: list[Shape],
    fleet: FleetShapes,
    capacity_requests: dict[str, str],
) -> dict[int, Decimal]:
    """What one device of each of `candidates` that `rule` covers counts on it, by shape id: a
    share of a shareable device what the request consumes of it."""
    covered = fleet.covered(rule.device_class, rule.selector)
    accelerators = fleet.covers_accelerators(rule.device_class, rule.selector)
    return {
        shape.id: per_device(
            shape,
            rule,
            _consumes(shape, capacity_requests) if shape.shareable else None,
            of_accelerators=accelerators,
        )
        for shape in candidates
        if shape.id in covered
    }


def _selector_error(selector: str) -> str:
    try:
        cel.compile_selector(selector)
    except cel.CELError as exc:
        return str(exc)
    return ""


def per_device(
    shape: Shape,
    rule: Rule,
    consumed: Mapping[str, Any] | None,
    *,
    of_accelerators: bool = False,
) -> Decimal:
    """What one device of `shape` counts on `rule`. `consumed`: what a share of a shareable
    device takes of its capacities (`inventory.capacity.requested_amounts`, or an allocation's
    `consumedCapacity`); None for the whole device. A share counts its fraction of the device
    (the largest of any capacity) and, on a memory rule, the memory it consumes.

    A device that is not an accelerator (kind "other": Intel's integrated GPU, a NIC) counts
    nothing on a rule that covers accelerators (`of_accelerators`), and one device on a rule
    that covers only such devices, which then limits how many are held."""
    if rule.unit == Unit.MEMORY:
        if consumed is not None:
            for name in MEMORY_CAPACITIES:
                key = capacity.capacity_name(consumed, name, shape.driver)
                if key is not None:
                    return Decimal(parse_quantity(consumed[key]))
            return Decimal(0)
        return Decimal(shape.memory_bytes or 0)
    if shape.kind == "other":
        share = Decimal(0) if of_accelerators else Decimal(1)
    else:
        share = shape.gpu_share
    if consumed is None:
        return share
    try:
        fraction = capacity.consumed_fraction(shape.capacity, consumed, shape.driver)
    except capacity.CapacityError:
        return share  # a quantity that cannot be read: the whole device, the most it takes
    return (share * fraction).quantize(Decimal("0.000001"))
