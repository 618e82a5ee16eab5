"""Which counters measure a partition's size (KEP-4815), checked on NVIDIA's dynamic MIG.

The counter set is the one the NVIDIA GPU DRA driver publishes for a MIG-capable GPU whose
slices are created on demand: the capacities of its reference page (multiprocessors,
copyEngines, decoders, encoders, jpegEngines, ofaEngines, memory) as counters, plus one
`memorySliceN` of 1 per memory slice, as its static MIG devices carry them
(tests/fixtures/dra/nvidia-slices.yaml). An A100-SXM4-80GB has one JPEG and one optical-flow
engine: the `+me` profile takes both, the other 1g profiles neither.
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest

from inventory import services
from inventory.dra import _SHARE_QUANTUM, size_counters
from inventory.dumps import iter_objects
from inventory.models import Device, DriverProfile
from tests.fixtures import DRA

pytestmark = pytest.mark.django_db
AT = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)
SEVENTH = (Decimal(1) / 7).quantize(_SHARE_QUANTUM)

A100_TOTALS = {
    "multiprocessors": "98",
    "copyEngines": "7",
    "decoders": "5",
    "encoders": "0",
    "jpegEngines": "1",
    "ofaEngines": "1",
    "memory": "80Gi",
}
# name: (SMs, copy engines, decoders, JPEG, OFA, memory, first memory slice, memory slices)
A100_SLICES: dict[str, tuple[int, int, int, int, int, str, int, int]] = {
    "1g.10gb-3": (14, 1, 0, 0, 0, "9856Mi", 3, 1),
    "1g.10gb-me-0": (14, 1, 1, 1, 1, "9856Mi", 0, 1),
    "1g.20gb-4": (14, 1, 1, 0, 0, "19968Mi", 4, 2),
    "2g.20gb-2": (28, 2, 1, 0, 0, "19968Mi", 2, 2),
    "3g.40gb-4": (42, 3, 2, 0, 0, "40192Mi", 4, 4),
    "4g.40gb-0": (56, 4, 2, 0, 0, "40192Mi", 0, 4),
    "7g.80gb-0": (98, 7, 5, 1, 1, "80896Mi", 0, 8),
}


def _counters(
    sms: int, engines: int, decoders: int, jpeg: int, ofa: int, memory: str, start: int, n: int
) -> dict[str, Any]:
    counters = {
        "multiprocessors": sms,
        "copyEngines": engines,
        "decoders": decoders,
        "encoders": 0,
        "jpegEngines": jpeg,
        "ofaEngines": ofa,
        "memory": memory,
        **{f"memorySlice{index}": 1 for index in range(start, start + n)},
    }
    return {name: {"value": str(value)} for name, value in counters.items()}


def dynamic_mig_slice(driver: str) -> dict[str, Any]:
    """One node's ResourceSlice: a counter set for GPU 0 and MIG devices consuming from it,
    published (as before they are created) without uuid or profile attribute here, so that
    only the counters can say their size."""
    totals = {name: {"value": value} for name, value in A100_TOTALS.items()}
    totals.update({f"memorySlice{index}": {"value": "1"} for index in range(8)})
    devices = [
        {
            "name": f"gpu-0-mig-{name.replace('.', '')}",
            "attributes": {
                "type": {"string": "mig"},
                "productName": {"string": "NVIDIA A100-SXM4-80GB"},
            },
            "consumesCounters": [
                {"counterSet": "gpu-0-counter-set", "counters": _counters(*shape)}
            ],
        }
        for name, shape in A100_SLICES.items()
    ]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"a100-node-{driver}"},
        "spec": {
            "driver": driver,
            "pool": {"name": "a100-node", "generation": 1, "resourceSliceCount": 1},
            "nodeName": "a100-node",
            "sharedCounters": [{"name": "gpu-0-counter-set", "counters": totals}],
            "devices": devices,
        },
    }


def shares(driver: str) -> dict[str, Decimal]:
    services.import_snapshot(
        cluster=services.get_cluster("fx"),
        objects=[dynamic_mig_slice(driver)],
        at=AT,
        kinds=["ResourceSlice"],
    )
    rows = Device.objects.filter(driver=driver, gone_at__isnull=True)
    return {row.name.removeprefix("gpu-0-mig-"): row.gpu_share for row in rows}


EXPECTED = {
    "1g10gb-3": SEVENTH,  # 14 of 98 SMs; 1 of 8 memory slices is less
    "1g10gb-me-0": SEVENTH,  # the GPU's only JPEG and OFA engines do not make it the GPU
    "1g20gb-4": Decimal("0.25"),  # 2 of 8 memory slices: it blocks a quarter of the memory
    "2g20gb-2": (Decimal(2) / 7).quantize(_SHARE_QUANTUM),
    "3g40gb-4": Decimal("0.5"),  # 4 of 8 memory slices
    "4g40gb-0": (Decimal(4) / 7).quantize(_SHARE_QUANTUM),
    "7g80gb-0": Decimal(1),
}


def test_nvidia_profile_names_its_size_counters() -> None:
    # Counters first, so that the built-in profile's size counters decide (its MIG devices
    # otherwise take their share from the profile name, n/7).
    DriverProfile.objects.create(
        driver="gpu.nvidia.com", spec={"share": ["counters"]}, source="admin"
    )
    assert shares("gpu.nvidia.com") == EXPECTED


def test_a_driver_without_a_profile_finds_the_size_counters_from_the_pool() -> None:
    assert shares("gpu.dynamic.example.com") == EXPECTED


def test_size_counters_leave_out_engines_only_some_partitions_take() -> None:
    totals = {"gpu-0": {"sms": Decimal(98), "jpeg": Decimal(1), "ofa": Decimal(1)}}
    totals["gpu-0"].update({f"slice-{i}": Decimal(1) for i in range(8)})
    consumers = [
        {"sms": Decimal(14), "jpeg": Decimal(0), "slice-0": Decimal(1)},
        {"sms": Decimal(14), "jpeg": Decimal(1), "ofa": Decimal(1), "slice-1": Decimal(1)},
    ]
    measured = size_counters(totals, {"gpu-0": consumers})["gpu-0"]
    assert measured == {"sms", *(f"slice-{i}" for i in range(8))}
    # A set nobody consumes from, or whose counters no device takes in common: all count.
    assert size_counters(totals, {})["gpu-0"] == set(totals["gpu-0"])
    # Named ones win, patterns included.
    assert size_counters(totals, {"gpu-0": consumers}, ["slice-*"])["gpu-0"] == {
        f"slice-{i}" for i in range(8)
    }


def test_a_fixture_with_several_counters_and_no_memory_keeps_its_quarters() -> None:
    """tests/fixtures/dra/vendors/partitionable-counters.yaml: every partition takes some of
    each of its three counters, so all three measure; a quarter takes 1/8, 1/4 and 1/5."""
    objects = list(iter_objects(DRA / "vendors" / "partitionable-counters.yaml"))
    services.import_snapshot(
        cluster=services.get_cluster("fx"), objects=objects, at=AT, kinds=["ResourceSlice"]
    )
    quarters = Device.objects.filter(name__contains="quarter", gone_at__isnull=True)
    assert quarters.count() == 4
    assert {(row.kind, row.gpu_share) for row in quarters} == {("partition", Decimal("0.25"))}
