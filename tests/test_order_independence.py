"""Figures that must not depend on the order PostgreSQL returns rows in, nor on the order
objects were written in.

PostgreSQL returns the rows of a query without ORDER BY in whatever order its plan reads
them: an index's order on a small table, the heap's (the order rows were written and
updated in) on a large one. Where such rows reach a choice (the first or the last of two
that clash wins), the choice follows the plan. Each test here forces the heap's order
(`heap_order`) and writes the clashing rows in the order that shows it.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.db import connection

from inventory import checks, services
from inventory.models import Device
from metering import ingest, prometheus, rollup
from metering.hours import epoch_ms
from metering.ingest import SampleRow
from metering.models import UsageHour
from tests.factories import AllocationFactory, DeviceFactory

pytestmark = pytest.mark.django_db

AT = datetime(2026, 6, 1, 12, tzinfo=UTC)
EXAMPLE = "gpu.example.com"
NVIDIA = "gpu.nvidia.com"
GPU_UUID = "GPU-6f1e0c2a-5b7d-4c1e-9a3f-2d8b7e4c1a90"


def heap_order() -> None:
    """Make this transaction's queries scan tables in the heap's order, not an index's: the
    plan a large table gets, on a test's few rows."""
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_indexscan = off")
        cursor.execute("SET LOCAL enable_indexonlyscan = off")
        cursor.execute("SET LOCAL enable_bitmapscan = off")


def load(*objects: dict[str, Any]) -> services.SyncReport:
    return services.import_snapshot(cluster=services.get_cluster("lab"), objects=objects, at=AT)


def counter_slice(
    name: str, devices: list[dict[str, Any]], counters: dict[str, str]
) -> dict[str, Any]:
    """A slice of pool node-a (two slices) that defines counter set `gpu-0-counters`."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": EXAMPLE,
            "nodeName": "node-a",
            "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 2},
            "sharedCounters": [
                {
                    "name": "gpu-0-counters",
                    "counters": {key: {"value": value} for key, value in counters.items()},
                }
            ],
            "devices": devices,
        },
    }


def partition(name: str, memory: str) -> dict[str, Any]:
    return {
        "name": name,
        "attributes": {"type": {"string": "gpu"}, "productName": {"string": "Example X1"}},
        "consumesCounters": [
            {"counterSet": "gpu-0-counters", "counters": {"memory": {"value": memory}}}
        ],
    }


def test_a_counter_set_defined_in_two_slices_is_read_back_as_counted_whatever_the_order() -> None:
    """Two slices of one pool generation define the same counter set differently. The sync
    counts the pool by the definition of the slice last by name (`count_pool` sorts them):
    the device consuming 40Gi is half of an 80Gi set. The fleet's partly used GPUs
    (`partial_gpus`: what is left of each counter set, what is placeable) read the sets back
    through `published_counter_sets`, which must give the same definition, whichever slice
    the heap holds first."""
    heap_order()
    load(
        counter_slice("slice-b", [partition("gpu-0-half", "40Gi")], {"memory": "80Gi"}),
        counter_slice("slice-a", [partition("gpu-0-quarter", "10Gi")], {"memory": "40Gi"}),
    )
    half = Device.objects.get(name="gpu-0-half")
    assert half.gpu_share == Decimal("0.5")  # counted by slice-b's 80Gi

    published = checks.published_counter_sets(generations={(half.cluster_id, EXAMPLE, "node-a", 1)})

    assert published[(half.cluster_id, EXAMPLE, "node-a", 1)]["gpu-0-counters"] == {
        "memory": Decimal(80 * 2**30)
    }


def nvidia_gpu(name: str, device_type: str) -> dict[str, Any]:
    return {
        "name": name,
        "attributes": {
            "type": {"string": device_type},
            "uuid": {"string": GPU_UUID},
            "productName": {"string": "NVIDIA H100 80GB HBM3"},
        },
        "capacity": {"memory": {"value": "80Gi"}},
    }


def test_a_gpu_also_offered_for_passthrough_takes_its_dcgm_series_whatever_the_order() -> None:
    """NVIDIA's driver offers one GPU as `gpu` and as `vfio`, both with its UUID; the sync
    meters the `gpu` device by the UUID and gives the vfio device a formed meter id. With
    both held in a window metered from Prometheus, a DCGM series labelled with the UUID must
    go to the device metered by it, not to whichever of the two rows came back last: else
    the GPU's readings land on the passthrough claim's usage rows (and the GPU's claim is
    billed unmeasured) or the other way round, as the plan changes."""
    heap_order()
    slice_ = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "node-a-gpus"},
        "spec": {
            "driver": NVIDIA,
            "nodeName": "node-a",
            "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
            "devices": [nvidia_gpu("gpu-0", "gpu"), nvidia_gpu("gpu-vfio-0", "vfio")],
        },
    }
    assert load(slice_).errors == []
    meters = dict(Device.objects.values_list("name", "meter_id"))
    assert meters["gpu-0"] == GPU_UUID and meters["gpu-vfio-0"] != GPU_UUID
    start_ms = epoch_ms(AT)
    identities = prometheus._identities(Device.objects.all(), start_ms, start_ms + 3_600_000)
    dcgm = prometheus.Exporter(name="dcgm", metrics=(), labels={"uuid": "UUID"})
    series = [prometheus.Series(labels={"UUID": GPU_UUID}, points=[(start_ms, 50.0)])]

    keys, _ = prometheus.match_series(dcgm, series, identities, start_ms)

    assert keys == [GPU_UUID]


def test_utilised_time_is_the_same_whatever_order_the_samples_arrived_in() -> None:
    """Two GPUs held the whole hour report the same readings, one in time order, the other
    newest first (an agent's retries, two batches crossing). A second each at 32.51 %, 64.49 %
    and 28.05 % is 1250.5 utilised GPU-milliseconds exactly, 1251 rounded half up; summed as
    doubles in the order the heap held the samples, it was 1250 for one of them. The usage row
    (and the statement line's utilised hours and idle discount) must not follow the order
    samples arrived in, nor a parallel plan's order of combining partial sums."""
    heap_order()
    readings = [(0, 32.51), (1000, 64.49), (2000, 28.05), (3000, 0.0)]
    hour = datetime(2026, 10, 15, 10, tzinfo=UTC)
    allocations = {}
    for label, arrival in (("in time order", readings), ("newest first", readings[::-1])):
        device = DeviceFactory.create()
        allocations[label] = AllocationFactory.create(
            device=device, start=hour - timedelta(hours=1), end=None
        ).pk
        for offset_ms, percent in arrival:  # one batch per reading, as they arrived
            ingest.ingest(
                node="node-a",
                samples=[SampleRow(device.uuid, epoch_ms(hour) + offset_ms, percent, None, None)],
                received_at=hour,
            )

    rollup.rollup_hours(hours=[hour], now=hour + timedelta(days=1))

    utilised = dict(
        UsageHour.objects.filter(hour=hour).values_list("allocation_id", "utilised_gpu_ms")
    )
    assert {label: utilised[pk] for label, pk in allocations.items()} == {
        "in time order": 1251,
        "newest first": 1251,
    }
