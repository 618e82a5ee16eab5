"""Every accelerator allocation is billed, whatever its vendor, in the unit it counts.

Devices are metered by their meter id: an Intel GPU or a Gaudi card publishes no UUID and is
billed all the same, its hours unmeasured until samples name its formed identity. A TPU's
hours are TPU chip-hours, priced and labelled as such; an AMD CPX partition is an eighth of
its MI300X. Statements are checked to the cent, first on devices made by the factories, then
on each vendor's fixture (tests/fixtures/dra/vendors) synced, claimed for a day, rolled up
and closed.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.utils import timezone

from billing import pricing, services
from billing.api.serializers import FlatStatementLineSerializer
from billing.management.commands.statement import statement_json, statement_text
from billing.models import RateCard, Statement, StatementLine
from frontend import selectors as portal
from inventory import profiles
from inventory import services as inventory_services
from inventory.dumps import iter_objects
from inventory.models import Allocation, Device, DeviceKind, Unit
from metering import ingest, rollup
from metering.hours import epoch_ms
from metering.ingest import SampleRow
from metering.models import UsageHour
from teams.models import Team, TeamNamespace
from tests.factories import AllocationFactory, DeviceFactory, NodeFactory
from tests.fixtures import DRA

pytestmark = pytest.mark.django_db
DAY = datetime(2026, 10, 15, tzinfo=UTC)  # a day of a closed-able period (October 2026)
HOUR_MS = 3_600_000
GIB = 2**30


@pytest.fixture
def team() -> Team:
    team = Team.objects.create(slug="research", name="Research")
    TeamNamespace.objects.create(team=team, namespace="research")
    return team


def card(product_name: str, price: str, idle_factor: str = "1") -> RateCard:
    return RateCard.objects.create(
        product_name=product_name,
        per_gpu_hour=Decimal(price),
        idle_factor=Decimal(idle_factor),
        currency="USD",
        valid_from=date(2026, 1, 1),
    )


def unmetered_device(driver: str, name: str, **fields: Any) -> Device:
    """A device whose driver publishes no UUID: metered by the identity formed from where it
    is published, as the sync forms it."""
    node = fields.pop("node", None) or NodeFactory.create()
    return DeviceFactory.create(
        node=node,
        driver=driver,
        pool=node.name,
        name=name,
        uuid="",
        physical_gpu_key=f"{driver}/{node.name}/{name}",
        meter_id=profiles.meter_id(node.cluster.name, driver, node.name, name),
        attributes={},
        **fields,
    )


def hold(device: Device, team: Team, start: datetime, end: datetime | None) -> Allocation:
    return AllocationFactory.create(
        device=device, team=team, start=start, end=end, claim__namespace="research"
    )


def roll_up(start: datetime, hours: int) -> None:
    rollup.rollup_hours(
        hours=[start + timedelta(hours=n) for n in range(hours)], now=start + timedelta(days=40)
    )


def usage(allocation: Allocation) -> tuple[int, int, int]:
    rows = UsageHour.objects.filter(allocation=allocation)
    return (
        sum(row.allocated_gpu_ms for row in rows),
        sum(row.utilised_gpu_ms for row in rows),
        sum(row.unmeasured_gpu_ms for row in rows),
    )


def close_october() -> list[Statement]:
    """October 2026 billed and closed, as beat does once it has ended."""
    run = services.bill_period(period_start=DAY, now=timezone.now(), close=True, actor="finance")
    assert run.closed
    return run.statements


def usage_lines(statements: list[Statement]) -> dict[str, StatementLine]:
    return {
        line.product_name: line
        for statement in statements
        for line in statement.lines.filter(kind="usage")
    }


# --- devices from the factories ---------------------------------------------------------------


def test_a_device_without_uuid_bills_unmeasured_hours_then_utilised_by_its_meter_id(
    team: Team,
) -> None:
    intel = unmetered_device(
        "gpu.intel.com", "0000-03-00-0-0x0bd5", product_name="Intel Data Center GPU Max 1550"
    )
    allocation = hold(intel, team, DAY, DAY + timedelta(hours=2))

    roll_up(DAY, 2)
    # Before: no uuid, no usage row at all. Now two hours allocated, none measured.
    assert usage(allocation) == (2 * HOUR_MS, 0, 2 * HOUR_MS)
    assert set(UsageHour.objects.values_list("device_uuid", flat=True)) == {intel.meter_id}

    # Samples naming its meter id (the agent's node + driver + device identity) measure it.
    samples = [
        SampleRow(intel.meter_id, epoch_ms(DAY) + minute * 60_000, 40.0, None, None)
        for minute in range(60)
    ]
    assert ingest.ingest(node="gpu-node", samples=samples, received_at=DAY).accepted == 60
    roll_up(DAY, 2)
    # The first hour at 40%; the 00:59 sample holds its 120 s hold, a minute into the second
    # hour, whose other 59 minutes are unmeasured.
    assert usage(allocation) == (2 * HOUR_MS, 3_660_000 * 40 // 100, 3_540_000)


def test_a_device_of_kind_other_is_not_billed(team: Team) -> None:
    channel = unmetered_device("compute-domain.nvidia.com", "channel-0", kind=DeviceKind.OTHER)
    channel.meter_id = ""
    channel.save()
    hold(channel, team, DAY, DAY + timedelta(hours=1))
    roll_up(DAY, 1)
    assert not UsageHour.objects.exists()


def test_two_tpu_chips_for_a_day_bill_48_chip_hours_at_the_cards_price(team: Team) -> None:
    node = NodeFactory.create(name="tpu-v4-node-1")
    chips = [
        unmetered_device(
            "tpu.google.com",
            f"accel{index}",
            node=node,
            kind=DeviceKind.GPU,
            unit=Unit.TPU,
            product_name="TPU v4",
        )
        for index in range(2)
    ]
    card("TPU v4", "1.35")
    for chip in chips:
        hold(chip, team, DAY, DAY + timedelta(days=1))

    (statement,) = close_october()

    (line,) = statement.lines.all()
    assert (line.product_name, line.unit) == ("TPU v4", Unit.TPU)
    assert line.allocated_gpu_hours == line.unmeasured_gpu_hours == Decimal(48)
    assert line.amount == Decimal("64.80")  # 48 x 1.35, not 0.00
    assert (line.hours_label, line.rate_unit) == ("TPU chip-hours", "TPU chip-hour")
    assert statement.total == Decimal("64.80")
    assert set(UsageHour.objects.values_list("unit", flat=True)) == {Unit.TPU}

    # Said so wherever the statement is read: the command's JSON and table, the API's CSV.
    shown = statement_json(statement)
    assert (shown["lines"][0]["hours"], shown["lines"][0]["unit"]) == (
        "TPU chip-hours",
        "TPU chip-hour",
    )
    assert (shown["lines"][0]["allocated_gpu_hours"], shown["total"]) == ("48.000000", "64.80")
    table = statement_text(statement)
    assert "TPU chip-hours" in table and "1.3500/TPU chip-h" in table
    assert "GPU-hours" not in table
    api = FlatStatementLineSerializer(line).data
    assert (api["hours"], api["unit"], api["amount"]) == (
        "TPU chip-hours",
        "TPU chip-hour",
        "64.80",
    )


def test_two_amd_cpx_partitions_bill_a_quarter_gpu_hour_per_hour(team: Team) -> None:
    node = NodeFactory.create(name="mi300x-node-2")
    partitions = [
        unmetered_device(
            "gpu.amd.com",
            f"gpu-0-partition-{index}",
            node=node,
            kind=DeviceKind.PARTITION,
            gpu_share=Decimal("0.125"),
            product_name="AMD_Instinct_MI300X_OAM",
            profile="cpx_nps1",
        )
        for index in range(2)
    ]
    card("AMD_Instinct_MI300X_OAM", "4.00")
    held = [hold(part, team, DAY, DAY + timedelta(hours=4)) for part in partitions]
    roll_up(DAY, 4)
    for hour in range(4):
        rows = UsageHour.objects.filter(hour=DAY + timedelta(hours=hour))
        assert sum(row.allocated_gpu_ms for row in rows) == HOUR_MS // 4
    assert [usage(allocation)[0] for allocation in held] == [HOUR_MS // 2] * 2

    (statement,) = close_october()
    (line,) = statement.lines.all()
    assert (line.allocated_gpu_hours, line.hours_label) == (Decimal(1), "GPU-hours")
    assert line.amount == Decimal("4.00")  # 4 h x 1/4 GPU x 4.00


def test_a_consumable_share_counts_its_largest_fraction_under_any_name(team: Team) -> None:
    driver = "gpu.example.com"
    shared = unmetered_device(
        driver,
        "shared-gpu-0",
        product_name="Example Shared GPU",
        capacity={
            f"{driver}/memory": {"value": "80Gi"},
            "cores": {"value": "100"},
        },
    )
    # A quarter of the memory by its unqualified name, half the cores: half the GPU.
    half, quarter = (
        AllocationFactory.create(
            device=shared,
            team=team,
            start=DAY,
            end=DAY + timedelta(hours=1),
            consumed_capacity=consumed,
            share_id=share_id,
        )
        for consumed, share_id in (
            ({"memory": "20Gi", "cores": "50"}, "a"),
            ({f"{driver}/memory": "20Gi"}, "b"),
        )
    )
    roll_up(DAY, 1)
    assert usage(half)[0] == HOUR_MS // 2
    assert usage(quarter)[0] == HOUR_MS // 4


def test_hours_of_different_units_stay_apart_and_totals_say_so(team: Team) -> None:
    gpu = DeviceFactory.create()
    tpu = unmetered_device(
        "tpu.google.com", "accel0", kind=DeviceKind.GPU, unit=Unit.TPU, product_name="TPU v4"
    )
    card("NVIDIA H100 80GB HBM3", "2.00")
    card("TPU v4", "1.00")
    hold(gpu, team, DAY, DAY + timedelta(hours=3))
    hold(tpu, team, DAY, DAY + timedelta(hours=5))

    statements = close_october()

    lines = usage_lines(statements)
    assert {name: (line.unit, line.allocated_gpu_hours) for name, line in lines.items()} == {
        "NVIDIA H100 80GB HBM3": (Unit.GPU, Decimal(3)),
        "TPU v4": (Unit.TPU, Decimal(5)),
    }
    (statement,) = statements
    assert statement.total == Decimal("11.00")  # money adds up: 3 x 2.00 + 5 x 1.00
    assert "GPU-hours, TPU chip-hours, each line in its own unit" in statement_text(statement)
    # The portal names what its totals add up.
    idle = portal.idle_cost(team=team, since=DAY, until=DAY + timedelta(days=1))
    assert idle.hours == "GPU-hours + TPU chip-hours"
    assert {row.product_name: row.hours for row in idle.rows} == {
        "NVIDIA H100 80GB HBM3": "GPU-hours",
        "TPU v4": "TPU chip-hours",
    }
    assert pricing.usage_lines(team=team, period=statements[0].period)


# --- each vendor's fixture, synced, claimed for a day, billed to the cent --------------------

VENDOR_CARDS = {
    "AMD_Instinct_MI300X_OAM": "4.00",
    "Flex 170": "1.10",
    "Raptor Lake-P": "0.50",  # an integrated GPU: not an accelerator, never billed
    "Gaudi2": "2.00",
    "v4": "1.35",
    "v5p": "2.10",
    "NVIDIA A100": "3.00",
    "Example Accelerator 80G": "2.00",
    "NVIDIA H100 80GB HBM3": "2.50",
}


def result(driver: str, pool: str, device: str, **extra: Any) -> dict[str, Any]:
    return {"request": "accel", "driver": driver, "pool": pool, "device": device, **extra}


def vendor_claim(name: str, results: list[dict[str, Any]], request: dict[str, Any]) -> Any:
    """A claim of the research team allocated at the day's start, with `results`."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "research", "uid": f"uid-{name}"},
        "spec": {"devices": {"requests": [{"name": "accel", "exactly": request}]}},
        "status": {
            "allocation": {
                "allocationTimestamp": DAY.isoformat(),
                "devices": {"results": results},
            }
        },
    }


def exactly(device_class: str, count: int = 1) -> dict[str, Any]:
    return {"deviceClassName": device_class, "allocationMode": "ExactCount", "count": count}


def every(device_class: str) -> dict[str, Any]:
    return {"deviceClassName": device_class, "allocationMode": "All"}


AMD, INTEL, GAUDI, TPU = "gpu.amd.com", "gpu.intel.com", "gaudi.intel.com", "tpu.google.com"
NVIDIA, PARTS = "gpu.nvidia.com", "gpu.partitions.example.com"
GAUDI_CARDS = [
    f"0000-{bus}-00-0-0x1020" for bus in ("0f", "17", "1c", "33", "9a", "b3", "b8", "b9")
]
# fixture: (typical claims, {product: (unit, allocated hours, amount)} of the day's statement)
VENDOR_DAYS: dict[str, tuple[list[Any], dict[str, tuple[str, str, str]]]] = {
    # Two whole MI300X (48 GPU-h) and two CPX partitions, an eighth each (6 GPU-h):
    # 54 x 4.00.
    "amd-mi300x.yaml": (
        [
            vendor_claim(
                "amd-whole",
                [result(AMD, "mi300x-node-1", f"gpu-{n}-{127 + n}") for n in (1, 2)],
                exactly(AMD, 2),
            ),
            vendor_claim(
                "amd-cpx",
                [result(AMD, "mi300x-node-2", f"gpu-{n}-{127 + n}") for n in (1, 2)],
                exactly(AMD, 2),
            ),
        ],
        {"AMD_Instinct_MI300X_OAM": ("gpu", "54", "216.00")},
    ),
    # The discrete GPU a day (24 GPU-h x 1.10); the integrated one held too, never billed.
    "intel-gpu.yaml": (
        [
            vendor_claim(
                "intel-flex", [result(INTEL, "intel-node-1", "0000-03-00-0-0x56c0")], exactly(INTEL)
            ),
            vendor_claim(
                "intel-igpu", [result(INTEL, "intel-node-1", "0000-00-02-0-0xa7a0")], exactly(INTEL)
            ),
        ],
        {"Flex 170": ("gpu", "24", "26.40")},
    ),
    # All eight cards of the node: 192 Gaudi card-hours x 2.00.
    "gaudi2.yaml": (
        [
            vendor_claim(
                "gaudi-all",
                [result(GAUDI, "gaudi-node-1", card) for card in GAUDI_CARDS],
                every(GAUDI),
            )
        ],
        {"Gaudi2": ("gaudi", "192", "384.00")},
    ),
    # All four chips of the host: 96 TPU chip-hours x 1.35.
    "tpu.yaml": (
        [
            vendor_claim(
                "tpu-all",
                [result(TPU, "tpu-v4-node-1", f"accel{n}") for n in range(4)],
                every(TPU),
            )
        ],
        {"v4": ("tpu", "96", "129.60")},
    ),
    # KEP-4815's 4x4 slice over four nodes of four chips, a day: 16 chips, 384 TPU chip-hours
    # x 2.10 (the largest fraction of its per-node counters would make it one chip).
    "tpu-multi-host.yaml": (
        [vendor_claim("tpu-4x4", [result(TPU, "tpu-pool", "tpu-4x4-1")], exactly(TPU))],
        {"v5p": ("tpu", "384", "806.40")},
    ),
    # An A100-4C vGPU is a tenth of an A100 (2.4 GPU-h), an A100-10C a quarter (6 GPU-h): both
    # priced as the A100 they are shares of (8.4 GPU-h x 3.00).
    "vgpu.yaml": (
        [
            vendor_claim("vgpu-4c", [result(NVIDIA, "vgpu-vm-1", "gpu-0")], exactly(NVIDIA)),
            vendor_claim("vgpu-10c", [result(NVIDIA, "vgpu-vm-2", "gpu-0")], exactly(NVIDIA)),
        ],
        {"NVIDIA A100": ("gpu", "8.4", "25.20")},
    ),
    # A quarter and a half of the partitionable device, by their counters: 18 GPU-h x 2.00.
    "partitionable-counters.yaml": (
        [
            vendor_claim(
                "part-quarter", [result(PARTS, "part-node-1", "gpu-0-quarter-0")], exactly(PARTS)
            ),
            vendor_claim(
                "part-half", [result(PARTS, "part-node-1", "gpu-0-half-1")], exactly(PARTS)
            ),
        ],
        {"Example Accelerator 80G": ("gpu", "18", "36.00")},
    ),
    # Consumable capacity: 20Gi of 80Gi asked under the qualified name (a quarter, 6 GPU-h),
    # 50 of 100 cores (a half, 12 GPU-h): 18 GPU-h x 2.50.
    "consumable-capacity.yaml": (
        [
            vendor_claim(
                "share-memory",
                [
                    result(
                        NVIDIA,
                        "share-node-1",
                        "gpu-0",
                        shareID="7d1c4e2a-0b5f-4c8e-9a31-2f6d8b0e4c17",
                        consumedCapacity={f"{NVIDIA}/memory": "20Gi"},
                    )
                ],
                {**exactly(NVIDIA), "capacity": {"requests": {f"{NVIDIA}/memory": "20Gi"}}},
            ),
            vendor_claim(
                "share-cores",
                [
                    result(
                        NVIDIA,
                        "share-node-1",
                        "gpu-1",
                        shareID="2b8e6f0d-4a1c-4d3e-8f52-9c7a1e3b5d60",
                        consumedCapacity={"cores": "50"},
                    )
                ],
                {**exactly(NVIDIA), "capacity": {"requests": {"cores": "50"}}},
            ),
        ],
        {"NVIDIA H100 80GB HBM3": ("gpu", "18", "45.00")},
    ),
}


@pytest.mark.parametrize("fixture", sorted(VENDOR_DAYS))
def test_a_days_statement_to_the_cent_for_each_vendor_fixture(team: Team, fixture: str) -> None:
    slices = [
        obj
        for obj in iter_objects(DRA / "vendors" / fixture)
        if obj["kind"] in ("ResourceSlice", "DeviceClass")
    ]
    claims, expected = VENDOR_DAYS[fixture]
    for product, price in VENDOR_CARDS.items():
        card(product, price)
    cluster = inventory_services.get_cluster("fx")
    kinds = ["ResourceSlice", "DeviceClass", "ResourceClaim"]
    report = inventory_services.import_snapshot(
        cluster=cluster, objects=[*slices, *claims], at=DAY, kinds=kinds
    )
    assert report.errors == []
    assert Allocation.objects.filter(
        claim__namespace__in=team.namespaces.values("namespace")
    ).count() == sum(len(claim["status"]["allocation"]["devices"]["results"]) for claim in claims)
    # A day later the claims are gone: their allocations end.
    report = inventory_services.import_snapshot(
        cluster=cluster, objects=slices, at=DAY + timedelta(days=1), kinds=kinds
    )
    assert report.errors == []

    statements = close_october()

    lines = usage_lines(statements)
    assert {
        product: (line.unit, line.allocated_gpu_hours.normalize(), line.amount)
        for product, line in lines.items()
    } == {
        product: (unit, Decimal(hours), Decimal(amount))
        for product, (unit, hours, amount) in expected.items()
    }
    # Never measured (no samples): every hour unmeasured, none idle.
    assert all(line.unmeasured_gpu_hours == line.allocated_gpu_hours for line in lines.values())
    (statement,) = statements
    assert statement.total == sum(Decimal(amount) for _, _, amount in expected.values())


def test_a_vgpu_type_with_a_card_of_its_own_is_priced_per_vgpu_hour_as_a_mig_profile(
    team: Team,
) -> None:
    # The guest's A100-10C is a quarter of an A100: its own card prices an hour of the vGPU,
    # as a MIG profile's card prices an hour of its slice; the A100's card the rest.
    card("NVIDIA A100", "3.00")
    RateCard.objects.create(
        product_name="NVIDIA A100",
        profile="A100-10C",
        per_gpu_hour=Decimal("1.00"),
        idle_factor=Decimal(1),
        currency="USD",
        valid_from=date(2026, 1, 1),
    )
    slices = list(iter_objects(DRA / "vendors" / "vgpu.yaml"))
    claims, _ = VENDOR_DAYS["vgpu.yaml"]
    cluster = inventory_services.get_cluster("fx")
    kinds = ["ResourceSlice", "DeviceClass", "ResourceClaim"]
    inventory_services.import_snapshot(
        cluster=cluster, objects=[*slices, *claims], at=DAY, kinds=kinds
    )
    inventory_services.import_snapshot(
        cluster=cluster, objects=slices, at=DAY + timedelta(days=1), kinds=kinds
    )
    (statement,) = close_october()
    lines = {
        (line.product_name, line.profile): (line.allocated_gpu_hours.normalize(), line.amount)
        for line in statement.lines.filter(kind="usage")
    }
    assert lines == {
        ("NVIDIA A100", ""): (Decimal("2.4"), Decimal("7.20")),  # the A100-4C, no card of its own
        ("NVIDIA A100", "A100-10C"): (Decimal(6), Decimal("24.00")),  # 24 vGPU-hours x 1.00
    }


def test_a_time_sliced_claim_shared_by_three_pods_is_billed_once_as_its_whole_gpu(
    team: Team,
) -> None:
    # docs/concepts/sharing.md, "Who is charged what": time-slicing is the driver's business
    # inside one claim; the claim holds the whole GPU, and the pods sharing it are not charged
    # one by one.
    (template,) = iter_objects(DRA / "claims" / "a100-time-sliced.yaml")
    pods = [{"resource": "pods", "name": f"worker-{n}", "uid": f"pod-{n}"} for n in range(3)]
    shared = vendor_claim(
        "a100-shared", [result(NVIDIA, "gpu-node-1", "gpu-1")], template["spec"]["spec"]
    )
    shared["spec"] = template["spec"]["spec"]
    shared["status"]["reservedFor"] = pods
    card("NVIDIA A100-PCIE-40GB", "2.00")
    slices = [
        *iter_objects(DRA / "deviceclasses-nvidia.yaml"),
        *iter_objects(DRA / "nvidia-slices.yaml"),
    ]
    cluster = inventory_services.get_cluster("fx")
    kinds = ["ResourceSlice", "DeviceClass", "ResourceClaim"]
    report = inventory_services.import_snapshot(
        cluster=cluster, objects=[*slices, shared], at=DAY, kinds=kinds
    )
    assert report.errors == []
    inventory_services.import_snapshot(
        cluster=cluster, objects=slices, at=DAY + timedelta(days=1), kinds=kinds
    )
    (allocation,) = Allocation.objects.all()
    assert (allocation.device_name, allocation.gpu_share) == ("gpu-1", 1)
    (statement,) = close_october()
    assert statement.team == team  # the team owning the claim's namespace in those hours
    (line,) = statement.lines.filter(kind="usage")
    assert (line.product_name, line.allocated_gpu_hours.normalize(), line.amount) == (
        "NVIDIA A100-PCIE-40GB",
        Decimal(24),
        Decimal("48.00"),
    )
