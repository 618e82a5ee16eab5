"""What the sync stored but cannot trust: pools, device names and counters that do not add up.

Kubernetes validates one ResourceSlice at a time. What spans the slices of a pool (every
slice of a generation seen, a device name used once, each counter set a device consumes
published by some slice of the pool, with the counters consumed) is the driver's promise
alone. The sync counts what it can regardless (the last complete generation, one of two
devices of the same name), and these checks say where it had to: `sync_inventory` prints them
at the end of a run, `fleet_report`, the fleet API and the portal's fleet page list them.

They read the stored Pool and ResourceSlice rows only (the slices' spec as published), so
every reader reports the same findings whichever process stored the rows. Each finding says
since when it has been true (`since`): a pool mid-rollout has been incomplete for seconds, a
broken driver's pool for days. For an incomplete pool, since its newest generation was first
seen; for what a generation's slices publish, since the first of them was stored as it is.

A counter set or counter consumed but not published, a counter set published twice, or a
device name published twice is more than a report: the scheduler allocates no device of such a
pool (`invalid_pools`), and quota admission counts none.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, TypedDict

from django.db import connection
from django.db.models import F, Func, JSONField, Q, QuerySet, Value
from django.db.models.functions import Coalesce
from kubernetes.utils import parse_quantity

from inventory.models import Cluster, Device, Pool, ResourceSlice
from inventory.profiles import INTEL_UNNAMED_PREFIX, VGPU_BOARD_MEMORY_GB, vgpu_type

INCOMPLETE_POOL = "incomplete_pool"
DEVICE_ELSEWHERE = "device_elsewhere"
DUPLICATE_DEVICE = "duplicate_device"
DUPLICATE_COUNTER_SET = "duplicate_counter_set"
MISSING_COUNTER_SET = "missing_counter_set"
UNKNOWN_COUNTER = "unknown_counter"
COUNTER_OVER_SET = "counter_over_set"
UNNAMED_MODEL = "unnamed_model"
UNKNOWN_VGPU_BOARD = "unknown_vgpu_board"
# In the order a summary lists them, with how it names them.
CHECKS = {
    INCOMPLETE_POOL: "incomplete pools",
    DEVICE_ELSEWHERE: "pools with devices live in another cluster",
    DUPLICATE_DEVICE: "duplicate device names",
    DUPLICATE_COUNTER_SET: "duplicate counter sets",
    MISSING_COUNTER_SET: "missing counter sets",
    UNKNOWN_COUNTER: "unknown counters",
    COUNTER_OVER_SET: "counters over their set",
    UNNAMED_MODEL: "models named by PCI id",
    UNKNOWN_VGPU_BOARD: "vGPUs counted whole",
}
# Device names a message spells out before it says "and N more".
_NAMED = 3


class SyncWarning(TypedDict):
    cluster: str
    check: str  # a key of CHECKS
    driver: str
    pool: str
    # The pool generation concerned: the newest one for an incomplete pool.
    generation: int | None
    # The devices concerned (all of them; the message names the first few).
    devices: list[str]
    message: str  # one line, naming the pool, generation and what is wrong
    # Since when it has been true: when the generation concerned was first seen (ISO 8601,
    # UTC), so that the report stays JSON as it is.
    since: str


def sync_warnings(*, cluster: Cluster | None = None) -> list[SyncWarning]:
    """Every finding about the present slices of `cluster` (all clusters when None).

    Sorted by cluster, driver, pool, generation and check. Counter sets are checked only in a
    generation whose slices are all present, as a set may be in a slice not seen yet; device
    names in every generation present. Two queries, whatever the size of the fleet: the
    slices' device names and counters are picked out of their spec by PostgreSQL.
    """
    findings = _incomplete_pools(cluster) + _devices_elsewhere(cluster) + _device_findings(cluster)
    generations: dict[tuple[str, str, str, int], list[dict[str, Any]]] = defaultdict(list)
    for row in _slice_rows(cluster):
        key = (row["cluster__name"], row["driver"], row["pool"], row["generation"])
        generations[key].append(row)
    for (cluster_name, driver, pool, generation), rows in generations.items():
        where = SyncWarning(
            cluster=cluster_name,
            check="",
            driver=driver,
            pool=pool,
            generation=generation,
            devices=[],
            message="",
            since=_iso(min(row["seen"] for row in rows)),
        )
        findings.extend(_duplicates(where, rows))
        if len(rows) >= max(row["resource_slice_count"] for row in rows):
            findings.extend(_counter_findings(where, rows))
    order = list(CHECKS)
    return sorted(
        findings,
        key=lambda found: (
            found["cluster"],
            found["driver"],
            found["pool"],
            found["generation"] or 0,
            order.index(found["check"]),
            found["message"],
        ),
    )


def summarise(warnings: list[SyncWarning]) -> str:
    """How many findings of each check: "3 (incomplete pools: 1, missing counter sets: 2)",
    or "none"."""
    if not warnings:
        return "none"
    counts = {check: 0 for check in CHECKS}
    for found in warnings:
        counts[found["check"]] += 1
    parts = ", ".join(f"{CHECKS[check]}: {count}" for check, count in counts.items() if count)
    return f"{len(warnings)} ({parts})"


def describe_since(since: str, *, now: datetime) -> str:
    """A warning's `since` as people read it, "since 2026-12-04 10:00 UTC (3 h)": when, in UTC
    to the minute, and how long ago, roughly (whole seconds, minutes, hours, then days after
    two days)."""
    at = datetime.fromisoformat(since)
    seconds = max(int((now - at).total_seconds()), 0)
    if seconds < 60:
        age = f"{seconds} s"
    elif seconds < 3600:
        age = f"{seconds // 60} min"
    elif seconds < 48 * 3600:
        age = f"{seconds // 3600} h"
    else:
        age = f"{seconds // 86400} d"
    return f"since {at.astimezone(UTC):%Y-%m-%d %H:%M} UTC ({age})"


def _iso(at: datetime) -> str:
    """`at` in ISO 8601, in UTC ("2026-12-04T10:00:00Z")."""
    return at.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _incomplete_pools(cluster: Cluster | None) -> list[SyncWarning]:
    pools = Pool.objects.filter(newest_generation__isnull=False).filter(
        Q(slices_expected=0) | Q(slices_seen__lt=F("slices_expected"))
    )
    if cluster is not None:
        pools = pools.filter(cluster=cluster)
    findings = []
    for pool in pools.select_related("cluster").order_by("cluster__name", "driver", "name"):
        if pool.counted_generation is None:
            counted = "no generation of it is complete yet, so none of its devices are counted"
        else:
            counted = f"its devices are still counted from generation {pool.counted_generation}"
        findings.append(
            SyncWarning(
                cluster=pool.cluster.name,
                check=INCOMPLETE_POOL,
                driver=pool.driver,
                pool=pool.name,
                generation=pool.newest_generation,
                devices=[],
                since=_iso(pool.newest_generation_seen_at or pool.updated_at),
                message=(
                    f"pool {pool.driver}/{pool.name}: generation {pool.newest_generation} is "
                    f"incomplete ({pool.slices_seen} of {pool.slices_expected} slices seen); "
                    f"{counted}"
                ),
            )
        )
    return findings


def _devices_elsewhere(cluster: Cluster | None) -> list[SyncWarning]:
    """Pools with devices the sync refused, their identity live in another cluster
    (`Pool.refused`): none of their hours are billed here."""
    pools = Pool.objects.exclude(refused={})
    if cluster is not None:
        pools = pools.filter(cluster=cluster)
    findings = []
    for pool in pools.select_related("cluster").order_by("cluster__name", "driver", "name"):
        names = sorted(pool.refused)
        others = sorted({other for _, other in pool.refused.values()})
        findings.append(
            SyncWarning(
                cluster=pool.cluster.name,
                check=DEVICE_ELSEWHERE,
                driver=pool.driver,
                pool=pool.name,
                generation=pool.counted_generation,
                devices=names,
                since=_iso(pool.updated_at),
                message=(
                    f"pool {pool.driver}/{pool.name}: {len(names)} device(s) not taken, their "
                    f"UUID or meter id live in cluster {', '.join(others)}: "
                    f"{first_few(names)}; none of their hours are billed here"
                ),
            )
        )
    return findings


# A vGPU type a framebuffer share is read from (`inventory.profiles.vgpu_fraction`): the
# MIG-backed form (A100-2-10C) is a share of slices, whatever the board.
_VGPU_BY_FRAMEBUFFER = r"^[A-Z][A-Z0-9]*-[0-9]+[ABCQ]$"

_Groups = dict[tuple[str, str, str, str], list[tuple[str, datetime]]]


def _device_findings(cluster: Cluster | None) -> list[SyncWarning]:
    """Per pool, the present devices billed under a name or share no person chose, in one
    query: GPUs whose driver published no model name, named by their PCI device id
    (`inventory.profiles.fallback_model`), and vGPUs whose board's framebuffer Tally's table
    lacks (`inventory.profiles.VGPU_BOARD_MEMORY_GB`), each counted, limited and billed as a
    whole GPU, more than its share, until the board is added."""
    devices = Device.objects.filter(
        Q(product_name__startswith=INTEL_UNNAMED_PREFIX)
        | Q(profile__regex=_VGPU_BY_FRAMEBUFFER, gpu_share=1),
        gone_at__isnull=True,
    )
    if cluster is not None:
        devices = devices.filter(cluster=cluster)
    unnamed: _Groups = defaultdict(list)
    vgpus: _Groups = defaultdict(list)
    for cluster_name, driver, pool, model, profile, share, name, first_seen in (
        devices.values_list(
            "cluster__name", "driver", "pool", "product_name", "profile", "gpu_share", "name",
            "first_seen",
        )
    ):  # fmt: skip
        if model.startswith(INTEL_UNNAMED_PREFIX):
            unnamed[cluster_name, driver, pool, model].append((name, first_seen))
        found = vgpu_type(profile) if share == 1 else None
        if found is not None and found[0] not in VGPU_BOARD_MEMORY_GB:
            vgpus[cluster_name, driver, pool, profile].append((name, first_seen))
    return _pool_findings(
        unnamed,
        UNNAMED_MODEL,
        lambda driver, pool, model, names: (
            f"pool {driver}/{pool}: {_devices(names)} published no model name; counted and "
            f"billed as model {model!r} from the PCI device id. Give that id's model "
            "name to Tally's maintainers (inventory.profiles.INTEL_GPU_MODELS), and "
            "price and limit it under that name until then"
        ),
    ) + _pool_findings(
        vgpus,
        UNKNOWN_VGPU_BOARD,
        lambda driver, pool, profile, names: (
            f"pool {driver}/{pool}: {_devices(names)} of vGPU type {profile}: Tally does not "
            f"know board {profile.split('-', 1)[0]}'s framebuffer, so each is counted and "
            "billed as a whole GPU, more than its share. Give the board's framebuffer to "
            "Tally's maintainers (inventory.profiles.VGPU_BOARD_MEMORY_GB)"
        ),
    )


def _pool_findings(
    groups: _Groups, check: str, message: Callable[[str, str, str, list[str]], str]
) -> list[SyncWarning]:
    """A finding of `check` per group (`_by_pool`), its one line `message(driver, pool, value,
    device names)`, true since its first device was seen."""
    findings = []
    for (cluster_name, driver, pool, value), members in sorted(groups.items()):
        names = sorted(name for name, _ in members)
        findings.append(
            SyncWarning(
                cluster=cluster_name,
                check=check,
                driver=driver,
                pool=pool,
                generation=None,
                devices=names,
                since=_iso(min(seen for _, seen in members)),
                message=message(driver, pool, value, names),
            )
        )
    return findings


def _duplicates(where: SyncWarning, rows: list[dict[str, Any]]) -> list[SyncWarning]:
    """Device names published more than once in one pool generation, across its slices or in
    one slice (a dump is not validated by the API server)."""
    slices_by_device: dict[str, list[str]] = defaultdict(list)
    for row in rows:
        for name in row["device_names"]:
            slices_by_device[str(name)].append(row["name"])
    repeated = sorted(name for name, slices in slices_by_device.items() if len(slices) > 1)
    if not repeated:
        return []
    slices = sorted({name for device in repeated for name in slices_by_device[device]})
    return [
        _finding(
            where,
            DUPLICATE_DEVICE,
            repeated,
            f"{_devices(repeated)} published more than once (slices {', '.join(slices)}); "
            "the scheduler allocates no device of the pool",
        )
    ]


def _counter_findings(where: SyncWarning, rows: list[dict[str, Any]]) -> list[SyncWarning]:
    """Counter sets published more than once in the generation, consumed counter sets no slice
    of it publishes, counters a set does not have, and a device consuming more of a counter
    than its whole set holds."""
    totals: dict[str, dict[str, Decimal]] = {}
    slices_by_set: dict[str, list[str]] = defaultdict(list)
    for row in rows:
        totals.update(_counter_sets(row["counter_sets"]))
        for counter_set in row["counter_sets"]:
            if isinstance(counter_set, dict) and isinstance(counter_set.get("name"), str):
                slices_by_set[counter_set["name"]].append(row["name"])
    findings = [
        _finding(
            where,
            DUPLICATE_COUNTER_SET,
            [],
            f"counter set {set_name!r} published more than once (slices "
            f"{', '.join(sorted(set(slices)))}); the scheduler allocates no device of the pool",
        )
        for set_name, slices in sorted(slices_by_set.items())
        if len(slices) > 1
    ]
    # (check, counter set, counter) → devices; the device names only of one finding.
    found: dict[tuple[str, str, str], list[str]] = defaultdict(list)
    for row in rows:
        consumers = [*row["consumers"], *row["basic_consumers"]]
        consumptions = [*row["consumed"], *row["basic_consumed"]]
        for device, consumed in zip(consumers, consumptions, strict=False):
            for consumption in consumed if isinstance(consumed, list) else []:
                if not isinstance(consumption, dict):
                    continue
                set_name = str(consumption.get("counterSet") or "")
                total = totals.get(set_name)
                if total is None:
                    found[(MISSING_COUNTER_SET, set_name, "")].append(str(device))
                    continue
                for counter, amount in quantities(consumption.get("counters")).items():
                    if counter not in total:
                        found[(UNKNOWN_COUNTER, set_name, counter)].append(str(device))
                    elif amount > total[counter]:
                        found[(COUNTER_OVER_SET, set_name, counter)].append(str(device))
    for (check, set_name, counter), devices in found.items():
        devices = sorted(set(devices))
        what = _devices(devices)
        if check == MISSING_COUNTER_SET:
            problem = f"counter set {set_name!r}, consumed by {what}, is published by no slice"
        elif check == UNKNOWN_COUNTER:
            problem = f"counter {counter!r}, consumed by {what}, is not in set {set_name!r}"
        else:
            problem = (
                f"counter {counter!r} of set {set_name!r} holds less than consumed by {what}, "
                "which can never be allocated"
            )
        findings.append(_finding(where, check, devices, problem))
    return findings


@dataclass(frozen=True)
class InvalidPool:
    """A pool generation the scheduler allocates no device from: a device name or a counter
    set published more than once in it, or a device consuming a counter set no slice of it
    publishes, or a counter its set does not have.

    The scheduler's allocator (k8s.io/dynamic-resource-allocation/structured, `buildPool` over
    the slices of the pool it gathered for a node) marks such a pool invalid, checking in this
    order: `validateDeviceNames` ("duplicate device name X", over the slices of devices it
    gathered for the node), `getAndValidateCounterSets` ("duplicate counter set name X", over
    every slice that publishes counter sets) and `validateDeviceCounterConsumption` ("counter
    set X not found", "counter X not found in counter set Y"). `allocateOne` then takes no
    device from it, the sound ones included, and a request for all devices fails on every
    node the pool is gathered for. Its own counter check (`checkAvailableCounters`) only weighs
    the counters that are published, so the pool check is what stops a device that consumes
    something unpublished. Named by its first problem (in the scheduler's order, as
    `sync_warnings` lists them), with how many others it has."""

    driver: str
    pool: str
    generation: int
    # DUPLICATE_DEVICE, DUPLICATE_COUNTER_SET, MISSING_COUNTER_SET or UNKNOWN_COUNTER
    check: str
    counter_set: str  # the set concerned ("" for a duplicate device name)
    counter: str  # the counter the set lacks ("" unless UNKNOWN_COUNTER)
    # The devices concerned, by name: those that consume what is not published, or the
    # names published more than once.
    devices: tuple[str, ...]
    others: int = 0  # the pool's other problems
    slices: tuple[str, ...] = ()  # for a duplicate: the slices that publish it

    def problem(self) -> str:
        """Its first problem in a line, what matters first (an admission warning is cut at
        256 characters): "counter set 'x' is published by no slice of generation 1 (consumed
        by gpu-0 and 3 more)". The fleet report lists every device of every problem."""
        generation = f"generation {self.generation}"
        if self.check in (DUPLICATE_DEVICE, DUPLICATE_COUNTER_SET):
            if self.check == DUPLICATE_DEVICE:
                more = len(self.devices) - 1
                what = f"device name {self.devices[0] if self.devices else ''!r}"
                what += f" (and {more} more)" if more > 0 else ""
            else:
                what = f"counter set {self.counter_set!r}"
            problems = "problem" if self.others == 1 else "problems"
            others = f"; {self.others} more {problems}" if self.others else ""
            return (
                f"{what} is published more than once in {generation} (slices "
                f"{first_few(list(self.slices))}){others}"
            )
        if self.check == MISSING_COUNTER_SET:
            what = f"counter set {self.counter_set!r} is published by no slice"
        else:
            what = f"counter {self.counter!r} is not in set {self.counter_set!r}"
        consumers = self.devices[0] if self.devices else ""
        if len(self.devices) > 1:
            consumers += f" and {len(self.devices) - 1} more"
        # Duplicates come first: the others of a consumption problem are all unpublished.
        others = f"; {self.others} more not published" if self.others else ""
        return f"{what} of {generation} (consumed by {consumers}{others})"


_DEVICES = Device._meta.db_table
_SLICES = ResourceSlice._meta.db_table
# Why the scheduler allocates nothing from some pools, one row per finding: (check, driver,
# pool, generation, device, counter set, counters consumed, the set's definitions, slices).
# Each pool's newest generation is judged, as the scheduler uses it, and only once its slices
# are all present: a set may be in a slice not seen yet, or replaced mid-rollout (the sync
# counts the devices of the last complete generation meanwhile, which is not judged).
# `{devices_in}` and `{slices_in}` narrow it to some pools. One statement, with no join a
# planner without statistics could make quadratic; the slices' device names and counter sets
# are picked out by PostgreSQL.
# - "dangling": a counter set a present device consumes (its `consumesCounters` entries, the
#   layout the sync normalises every version to) that no slice of its generation publishes
#   with every counter it consumes, and each definition of the set they publish (none: it is
#   missing);
# - DUPLICATE_DEVICE: a device name two slices publish (or one slice twice) that the scheduler
#   can gather for one node: not when each is of its own node (`validateDeviceNames` weighs
#   the slices gathered for a node; one of `allNodes` or a node selector may be gathered
#   with any, and is taken to be);
# - DUPLICATE_COUNTER_SET: a counter set name published twice (every slice that publishes
#   counter sets is gathered for every node).
_INVALID = f"""
WITH consumed AS MATERIALIZED (
    SELECT device.driver, device.pool, device.pool_generation AS generation,
        device.name AS device, consumption->>'counterSet' AS counter_set,
        ARRAY(
            SELECT jsonb_object_keys(
                CASE jsonb_typeof(consumption->'counters')
                    WHEN 'object' THEN consumption->'counters'
                END
            )
        ) AS keys
    FROM {_DEVICES} AS device
    CROSS JOIN LATERAL jsonb_array_elements(
        CASE jsonb_typeof(device.extra->'consumesCounters')
            WHEN 'array' THEN device.extra->'consumesCounters'
        END
    ) AS consumption
    WHERE device.cluster_id = %(cluster)s AND device.gone_at IS NULL{{devices_in}}
),
slices AS MATERIALIZED (
    SELECT slice.driver, slice.pool, slice.generation, slice.name, slice.node_name,
        slice.spec->'sharedCounters' AS counter_sets,
        jsonb_path_query_array(slice.spec, '$.devices[*].name') AS names,
        slice.generation = max(slice.generation) OVER pool
            AND count(*) OVER generation >= max(slice.resource_slice_count) OVER generation
            AS judged
    FROM {_SLICES} AS slice
    WHERE slice.cluster_id = %(cluster)s AND slice.gone_at IS NULL{{slices_in}}
    WINDOW pool AS (PARTITION BY slice.driver, slice.pool),
        generation AS (PARTITION BY slice.driver, slice.pool, slice.generation)
),
published AS MATERIALIZED (
    SELECT slices.driver, slices.pool, slices.generation, slices.name AS slice,
        counter_set->>'name' AS name, counter_set->'counters' AS counters
    FROM slices
    CROSS JOIN LATERAL jsonb_array_elements(
        CASE jsonb_typeof(slices.counter_sets) WHEN 'array' THEN slices.counter_sets END
    ) AS counter_set
    WHERE slices.judged
),
dangling AS (
    SELECT consumed.* FROM consumed
    WHERE EXISTS (
        SELECT FROM slices
        WHERE slices.judged AND slices.driver = consumed.driver
            AND slices.pool = consumed.pool AND slices.generation = consumed.generation
    )
    AND NOT EXISTS (
        SELECT FROM published
        WHERE published.driver = consumed.driver AND published.pool = consumed.pool
            AND published.generation = consumed.generation
            AND published.name = consumed.counter_set AND published.counters ?& consumed.keys
    )
),
named AS MATERIALIZED (
    SELECT slices.driver, slices.pool, slices.generation, slices.name AS slice,
        nullif(slices.node_name, '') AS node, device.name
    FROM slices
    CROSS JOIN LATERAL jsonb_array_elements_text(slices.names) AS device (name)
    WHERE slices.judged
),
repeated AS (
    SELECT driver, pool, generation, name FROM named
    WHERE name IS NOT NULL
    GROUP BY driver, pool, generation, name
    HAVING count(*) > 1
)
SELECT 'dangling', dangling.driver, dangling.pool, dangling.generation, dangling.device,
    dangling.counter_set, dangling.keys,
    coalesce(
        array_agg(published.counters) FILTER (WHERE published.name IS NOT NULL), ARRAY[]::jsonb[]
    ),
    ARRAY[]::text[]
FROM dangling
LEFT JOIN published
    ON published.driver = dangling.driver AND published.pool = dangling.pool
    AND published.generation = dangling.generation AND published.name = dangling.counter_set
GROUP BY dangling.driver, dangling.pool, dangling.generation, dangling.device,
    dangling.counter_set, dangling.keys
UNION ALL
SELECT '{DUPLICATE_DEVICE}', driver, pool, generation, name, '', ARRAY[]::text[],
    ARRAY[]::jsonb[], array_agg(DISTINCT slice ORDER BY slice)
FROM named
JOIN repeated USING (driver, pool, generation, name)
GROUP BY driver, pool, generation, name
HAVING count(*) > count(DISTINCT node)
UNION ALL
SELECT '{DUPLICATE_COUNTER_SET}', driver, pool, generation, '', name, ARRAY[]::text[],
    ARRAY[]::jsonb[], array_agg(DISTINCT slice ORDER BY slice)
FROM published
WHERE name IS NOT NULL
GROUP BY driver, pool, generation, name
HAVING count(*) > 1
"""
# Narrows `_INVALID` to some pools, by (driver, pool): the devices, and the pools' slices.
_DEVICES_IN = """
        AND (device.driver, device.pool) IN (
            SELECT * FROM unnest(%(drivers)s::text[], %(pools)s::text[])
        )"""
_SLICES_IN = """
        AND (slice.driver, slice.pool) IN (
            SELECT * FROM unnest(%(drivers)s::text[], %(pools)s::text[])
        )"""


def invalid_pools(
    *, cluster_id: int, pools: Iterable[tuple[str, str]] | None = None
) -> list[InvalidPool]:
    """The pool generations of the cluster's present devices that the scheduler allocates
    nothing from (`InvalidPool`), by driver and pool; of `pools` (driver, pool) only, when
    given. One query."""
    params: dict[str, Any] = {"cluster": cluster_id}
    narrowed = {"devices_in": "", "slices_in": ""}
    if pools is not None:
        wanted = sorted(set(pools))
        if not wanted:
            return []
        params["drivers"] = [driver for driver, _ in wanted]
        params["pools"] = [pool for _, pool in wanted]
        narrowed = {"devices_in": _DEVICES_IN, "slices_in": _SLICES_IN}
    with connection.cursor() as cursor:
        # Guessing a hundred devices and counter sets per JSON array, the planner would
        # compile the statement (JIT, a second and more) to save nothing. Off for its
        # transaction: the statement's own in autocommit, the caller's otherwise.
        cursor.execute(
            f"SELECT set_config('jit', 'off', true); {_INVALID.format(**narrowed)}", params
        )
        cursor.nextset()
        rows = cursor.fetchall()
    # (driver, pool, generation) -> (check, counter set, counter) -> devices, and slices
    found: dict[tuple[str, str, int], dict[tuple[str, str, str], list[str]]] = defaultdict(
        lambda: defaultdict(list)
    )
    slices: dict[tuple[str, str, int, str, str], set[str]] = defaultdict(set)
    for check, driver, pool, generation, device, set_name, keys, definitions, where in rows:
        problems = found[(driver, pool, generation)]
        set_name = str(set_name or "")
        if check == DUPLICATE_DEVICE:
            problems[(DUPLICATE_DEVICE, "", "")].append(device)
            slices[(driver, pool, generation, DUPLICATE_DEVICE, "")].update(where)
        elif check == DUPLICATE_COUNTER_SET:
            problems[(DUPLICATE_COUNTER_SET, set_name, "")] = []
            slices[(driver, pool, generation, DUPLICATE_COUNTER_SET, set_name)].update(where)
        elif not definitions:
            problems[(MISSING_COUNTER_SET, set_name, "")].append(device)
        else:
            # Each definition as jsonb text; a set defined twice has the counters of either.
            published = {
                key
                for text in definitions
                if isinstance(counters := json.loads(text), dict)
                for key in counters
            }
            for counter in sorted(set(keys) - published):
                problems[(UNKNOWN_COUNTER, set_name, counter)].append(device)
    order = list(CHECKS)
    result = []
    for (driver, pool, generation), problems in sorted(found.items()):
        ordered = sorted(problems, key=lambda problem: (order.index(problem[0]), *problem[1:]))
        if not ordered:
            continue
        check, set_name, counter = ordered[0]
        result.append(
            InvalidPool(
                driver=driver,
                pool=pool,
                generation=generation,
                check=check,
                counter_set=set_name,
                counter=counter,
                devices=tuple(sorted(set(problems[ordered[0]]))),
                others=len(ordered) - 1,
                slices=tuple(sorted(slices.get((driver, pool, generation, check, set_name), ()))),
            )
        )
    return result


# A pool generation: cluster id, driver, pool name and generation.
PoolGeneration = tuple[int, str, str, int]


def published_counter_sets(
    *, generations: set[PoolGeneration]
) -> dict[PoolGeneration, dict[str, dict[str, Decimal]]]:
    """The counter sets the present slices of each pool generation publish, with their
    counters as numbers: `{generation: {set name: {counter: total}}}`. One query."""
    if not generations:
        return {}
    rows = (
        ResourceSlice.objects.filter(
            gone_at__isnull=True,
            cluster_id__in={cluster_id for cluster_id, _, _, _ in generations},
            driver__in={driver for _, driver, _, _ in generations},
            pool__in={pool for _, _, pool, _ in generations},
            generation__in={generation for _, _, _, generation in generations},
        )
        .annotate(counter_sets=_json_path("$.sharedCounters[*]"))
        .values_list("cluster_id", "driver", "pool", "generation", "counter_sets")
        # By name, as `dra.count_pool` reads them: a set defined in two slices is the last's,
        # whatever plan PostgreSQL picks.
        .order_by("name")
    )
    published: dict[PoolGeneration, dict[str, dict[str, Decimal]]] = defaultdict(dict)
    for cluster_id, driver, pool, generation, counter_sets in rows:
        key = (cluster_id, driver, pool, generation)
        if key in generations:
            published[key].update(_counter_sets(counter_sets))
    return published


def _counter_sets(counter_sets: list[Any]) -> dict[str, dict[str, Decimal]]:
    return {
        counter_set["name"]: quantities(counter_set.get("counters"))
        for counter_set in counter_sets
        if isinstance(counter_set, dict) and isinstance(counter_set.get("name"), str)
    }


def _slice_rows(cluster: Cluster | None) -> QuerySet[ResourceSlice, dict[str, Any]]:
    slices = ResourceSlice.objects.filter(gone_at__isnull=True)
    if cluster is not None:
        slices = slices.filter(cluster=cluster)
    # Only the names and counters come back, not the devices' attributes: a pool's slices
    # hold thousands of devices. v1beta1 nests a device's counters under `basic`.
    return (
        slices.values("cluster__name", "name", "driver", "pool", "generation")
        .annotate(
            seen=Coalesce("generation_seen_at", "first_seen"),
            device_names=_json_path("$.devices[*].name"),
            consumers=_json_path("$.devices[*] ? (exists(@.consumesCounters)).name"),
            consumed=_json_path("$.devices[*].consumesCounters"),
            basic_consumers=_json_path("$.devices[*] ? (exists(@.basic.consumesCounters)).name"),
            basic_consumed=_json_path("$.devices[*].basic.consumesCounters"),
            counter_sets=_json_path("$.sharedCounters[*]"),
        )
        .values(
            "cluster__name",
            "name",
            "driver",
            "pool",
            "generation",
            "resource_slice_count",
            "seen",
            "device_names",
            "consumers",
            "consumed",
            "basic_consumers",
            "basic_consumed",
            "counter_sets",
        )
        .order_by("cluster__name", "driver", "pool", "generation", "name")
    )


def _json_path(path: str) -> Func:
    """The items of the slice's spec at a JSON path, as one array (PostgreSQL's jsonpath)."""
    return Func("spec", Value(path), function="jsonb_path_query_array", output_field=JSONField())


def quantities(counters: Any) -> dict[str, Decimal]:
    """Counters (`{name: {value: quantity}}`) as numbers; the sync checked them on the way in,
    so anything else is left out rather than raised."""
    if not isinstance(counters, dict):
        return {}
    return {
        name: Decimal(parse_quantity(entry["value"]))
        for name, entry in counters.items()
        if isinstance(entry, dict) and "value" in entry
    }


def _finding(where: SyncWarning, check: str, devices: list[str], problem: str) -> SyncWarning:
    """A finding in the pool generation `where` names, its message prefixed with it."""
    return SyncWarning(
        cluster=where["cluster"],
        check=check,
        driver=where["driver"],
        pool=where["pool"],
        generation=where["generation"],
        devices=devices,
        message=f"pool {where['driver']}/{where['pool']} generation {where['generation']}: "
        + problem,
        since=where["since"],
    )


def _devices(names: list[str]) -> str:
    """ "devices a, b" or "devices a, b, c and 4 more"."""
    noun = "device" if len(names) == 1 else "devices"
    return f"{noun} {first_few(names)}"


def first_few(names: Sequence[str]) -> str:
    """ "a, b" or "a, b, c and 4 more"."""
    shown = ", ".join(names[:_NAMED])
    more = f" and {len(names) - _NAMED} more" if len(names) > _NAMED else ""
    return f"{shown}{more}"
