"""A day's statement, to the cent, of claims on AMD auto-partition devices
(vendors/amd-mi300x-autopartition), synced, allocated for a day, rolled up and closed.

Each claim of a mode device holds one of the mode's partitions, which the scheduler records in
the result's `consumedCapacity` (the capacities' defaults: one partition and its memory,
compute units and SIMDs): a CPX share is an eighth of its MI300X, a DPX share a half.
"""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest

from inventory import services as inventory_services
from inventory.dumps import iter_objects
from inventory.models import Allocation
from teams.models import Team, TeamNamespace
from tests.billing.test_vendor_billing import (
    AMD,
    DAY,
    card,
    close_october,
    exactly,
    result,
    usage_lines,
    vendor_claim,
)
from tests.fixtures import DRA

pytestmark = pytest.mark.django_db
POOL = "mi300x-node-3"


def share(device: str, share_id: str, partitions: int) -> dict[str, object]:
    """One share of a mode device of `partitions`, as the scheduler records it."""
    return result(
        AMD,
        POOL,
        device,
        shareID=share_id,
        consumedCapacity={
            "partitions": "1",
            "memory": f"{192 // partitions}Gi",
            "computeUnits": str(304 // partitions),
            "simdUnits": str(1216 // partitions),
        },
    )


def test_a_days_statement_of_cpx_and_dpx_shares_to_the_cent() -> None:
    team = Team.objects.create(slug="research", name="Research")
    TeamNamespace.objects.create(team=team, namespace="research")
    card("AMD_Instinct_MI300X_OAM", "4.00")
    slices = list(iter_objects(DRA / "vendors" / "amd-mi300x-autopartition.yaml"))
    claims = [
        # Two CPX shares of MI300X 0 (3 GPU-h each) and one DPX share of MI300X 1 (12 GPU-h).
        vendor_claim(
            "cpx-pair",
            [
                share("gpu-0-cpx-nps1", "0c5b7e3a-1d2f-4a6b-8c9d-0e1f2a3b4c5d", 8),
                share("gpu-0-cpx-nps1", "9f8e7d6c-5b4a-4392-8170-6f5e4d3c2b1a", 8),
            ],
            exactly(AMD, 2),
        ),
        vendor_claim(
            "dpx",
            [share("gpu-1-dpx-nps2", "3a4b5c6d-7e8f-4a0b-9c1d-2e3f4a5b6c7d", 2)],
            exactly(AMD),
        ),
    ]
    cluster = inventory_services.get_cluster("fx")
    kinds = ["ResourceSlice", "DeviceClass", "ResourceClaim"]
    report = inventory_services.import_snapshot(
        cluster=cluster, objects=[*slices, *claims], at=DAY, kinds=kinds
    )
    assert report.errors == []
    allocations = Allocation.objects.filter(
        claim__namespace__in=team.namespaces.values("namespace")
    ).order_by("device_name", "share_id")
    assert [(a.device_name, a.gpu_share, a.profile) for a in allocations] == [
        ("gpu-0-cpx-nps1", Decimal("0.125"), "cpx_nps1"),
        ("gpu-0-cpx-nps1", Decimal("0.125"), "cpx_nps1"),
        ("gpu-1-dpx-nps2", Decimal("0.5"), "dpx_nps2"),
    ]
    report = inventory_services.import_snapshot(
        cluster=cluster, objects=slices, at=DAY + timedelta(days=1), kinds=kinds
    )
    assert report.errors == []

    statements = close_october()

    line = usage_lines(statements)["AMD_Instinct_MI300X_OAM"]
    # 2 x 24 h x 1/8 + 24 h x 1/2 = 18 GPU-hours at 4.00.
    assert (line.unit, line.allocated_gpu_hours.normalize(), line.amount) == (
        "gpu",
        Decimal(18),
        Decimal("72.00"),
    )
    assert line.unmeasured_gpu_hours == line.allocated_gpu_hours
    (statement,) = statements
    assert statement.total == Decimal("72.00")
