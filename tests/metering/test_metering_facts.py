"""An allocation is metered and counted by what its device was when it started.

A device that gains a UUID later (NVIDIA dynamic MIG, a driver upgrade that starts publishing
one) is metered by it from then on; a driver profile edited in an open period gives its devices
another unit or share. Neither changes the hours an allocation has held when they are rolled up
again: the allocation keeps its meter id, unit and share, and its samples are found under the
meter id it kept or the device's new one, each counted once. Everything goes through the real
sync (`import_snapshot`), ingest and rollup, on PostgreSQL.
"""

from __future__ import annotations

import textwrap
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest

from billing import pricing
from inventory import services
from inventory.models import Allocation, Device
from metering import ingest, rollup
from metering.hours import epoch_ms
from metering.ingest import SampleRow
from metering.models import UsageHour
from quota.policy import apply_policy, load_policy
from teams.models import Team, TeamNamespace

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 11, 2, 8, 0, tzinfo=UTC)
HOUR = timedelta(hours=1)
MINUTE_MS = 60_000
HOUR_MS = 3_600_000
LATER = T0 + timedelta(days=2)
NEW_UUID = "GPU-3f1c0b7e-51a2-4c6e-9d0a-7b2e8c1d4f55"


def gpu(uuid: str = "") -> dict[str, Any]:
    """An H100 as NVIDIA's driver publishes it; without a uuid before the driver upgrade."""
    attributes: dict[str, Any] = {
        "type": {"string": "gpu"},
        "productName": {"string": "NVIDIA H100 80GB HBM3"},
    }
    if uuid:
        attributes["uuid"] = {"string": uuid}
    return {"name": "gpu-0", "attributes": attributes, "capacity": {"memory": {"value": "80Gi"}}}


def mig() -> dict[str, Any]:
    """A 3g.40gb MIG device of an A100: 3/7 of the GPU by NVIDIA's built-in profile."""
    return {
        "name": "gpu-1-mig-3g40gb-0",
        "attributes": {
            "type": {"string": "mig"},
            "uuid": {"string": "MIG-8a4d2c1e-0b9f-5e3a-a1c7-2d6f9e0b4c83"},
            "parentUUID": {"string": "GPU-5b0e9c2d-7a1f-4e8b-b3c6-0f2a1d9e8c74"},
            "profile": {"string": "3g.40gb"},
            "productName": {"string": "NVIDIA A100-SXM4-80GB"},
        },
        "capacity": {"memory": {"value": "40Gi"}},
    }


def resource_slice(*devices: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "node-a-gpu.nvidia.com"},
        "spec": {
            "driver": "gpu.nvidia.com",
            "nodeName": "node-a",
            "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
            "devices": list(devices),
        },
    }


def claim(name: str, namespace: str, device: str | None) -> dict[str, Any]:
    """A one-device claim, allocated `device` of node-a (None: not allocated, or no longer)."""
    body: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}"},
        "spec": {
            "devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]
            }
        },
    }
    if device is not None:
        result = {"request": "gpu", "driver": "gpu.nvidia.com", "pool": "node-a", "device": device}
        body["status"] = {"allocation": {"devices": {"results": [result]}}}
    return body


def sync(objects: list[dict[str, Any]], at: datetime) -> None:
    report = services.import_snapshot(cluster=services.get_cluster("lab"), objects=objects, at=at)
    assert not report.errors


def send(meter_id: str, start: datetime, minutes: range, util: float) -> None:
    """One sample a minute from `start` (the minutes given), as node-a's agent sends them."""
    rows = [
        SampleRow(meter_id, epoch_ms(start) + minute * MINUTE_MS, util, None, None)
        for minute in minutes
    ]
    result = ingest.ingest(node="node-a", samples=rows, received_at=start)
    assert result.accepted == len(rows)


def roll_up(hours: int) -> None:
    rollup.rollup_hours(hours=[T0 + n * HOUR for n in range(hours)], now=LATER)


def figures() -> dict[tuple[datetime, int], tuple[Any, ...]]:
    return {
        (row.hour, row.allocation_id): (
            row.device_uuid,
            row.unit,
            row.gpu_share,
            row.allocated_gpu_ms,
            row.utilised_gpu_ms,
            row.unmeasured_gpu_ms,
        )
        for row in UsageHour.objects.all()
    }


def only(hours: int, rows: dict[tuple[datetime, int], tuple[Any, ...]]) -> dict[Any, Any]:
    """The rows of the first `hours` hours from T0."""
    return {key: value for key, value in rows.items() if key[0] < T0 + hours * HOUR}


def two_claims(whole_gpu: dict[str, Any]) -> list[dict[str, Any]]:
    """node-a with `whole_gpu` and a MIG device; team vision holds the GPU, namespace nlp (no
    team's) the MIG device."""
    return [
        resource_slice(whole_gpu, mig()),
        claim("a", "vision", "gpu-0"),
        claim("b", "nlp", "gpu-1-mig-3g40gb-0"),
    ]


@pytest.fixture
def team() -> Team:
    team = Team.objects.create(slug="vision", name="Vision")
    TeamNamespace.objects.create(team=team, namespace="vision")
    return team


def test_a_device_that_gains_a_uuid_keeps_the_hours_rolled_up_before(team: Team) -> None:
    # gpu-0 publishes no uuid yet: metered by the identity formed from where it is published.
    sync(two_claims(gpu()), T0)
    held = Allocation.objects.get(claim__name="a")
    formed = held.meter_id
    assert formed.startswith("dra-") and formed == Device.objects.get(name="gpu-0").meter_id
    mig_meter = Allocation.objects.get(claim__name="b").meter_id
    send(formed, T0, range(120), 40.0)  # 08:00-09:59 at 40%
    send(mig_meter, T0, range(180), 60.0)  # 08:00-10:59 at 60%
    roll_up(2)
    before = figures()
    assert before[T0 + HOUR, held.pk] == (formed, "gpu", 1, HOUR_MS, HOUR_MS * 40 // 100, 0)

    # The driver upgrade at 10:00: gpu-0 now publishes its uuid and is metered by it.
    sync(two_claims(gpu(NEW_UUID)), T0 + 2 * HOUR)
    assert Device.objects.get(name="gpu-0").meter_id == NEW_UUID
    held.refresh_from_db()
    assert (held.meter_id, held.end) == (formed, None)

    # The hours rolled up before come out the same, utilised hours and all.
    roll_up(2)
    assert figures() == before

    # From 10:02 the samples name the uuid. 10:00-10:01 is the last formed-id sample's hold
    # (09:59 + 120 s); 10:01-10:02 is measured by neither.
    send(NEW_UUID, T0 + 2 * HOUR, range(2, 60), 80.0)
    roll_up(3)
    rows = figures()
    assert only(2, rows) == before
    third = rows[T0 + 2 * HOUR, held.pk]
    assert third == (
        formed,
        "gpu",
        1,
        HOUR_MS,
        MINUTE_MS * 40 // 100 + 58 * MINUTE_MS * 80 // 100,
        MINUTE_MS,
    )
    # The MIG device, untouched, is rolled up the ordinary way, whole hours in the database.
    share_micro = 428_571  # 3/7 of the GPU, to the millionth
    assert rows[T0 + 2 * HOUR, Allocation.objects.get(claim__name="b").pk][3:] == (
        rollup.gpu_ms(HOUR_MS, share_micro),
        rollup.utilised_gpu_ms(HOUR_MS * 60 * rollup.UTIL_SCALE, share_micro),
        0,
    )

    # Rerunning changes nothing; team totals add up to the fleet's.
    roll_up(3)
    assert figures() == rows
    fleet_ms = sum(UsageHour.objects.values_list("allocated_gpu_ms", flat=True))
    period = pricing.period_for(T0)
    lines = [
        line
        for charged in (team, None)
        for line in pricing.usage_lines(team=charged, period=period)
    ]
    assert sum(line.allocated for line in lines) == Decimal(fleet_ms) / HOUR_MS


def test_samples_under_both_names_in_one_hour_are_counted_once() -> None:
    sync([resource_slice(gpu()), claim("a", "vision", "gpu-0")], T0)
    held = Allocation.objects.get()
    formed = held.meter_id
    # The old agent's samples to 08:29 (the last holds to 08:31), the new one's from 08:30,
    # after the upgrade: the minute both cover counts once, and no time is unmeasured below
    # zero.
    send(formed, T0, range(30), 50.0)
    sync([resource_slice(gpu(NEW_UUID)), claim("a", "vision", "gpu-0")], T0 + HOUR / 2)
    send(NEW_UUID, T0, range(30, 60), 50.0)
    roll_up(1)
    assert figures() == {(T0, held.pk): (formed, "gpu", 1, HOUR_MS, HOUR_MS // 2, 0)}


def test_a_profile_edited_after_an_allocation_started_changes_none_of_its_hours(
    team: Team,
) -> None:
    objects = [resource_slice(mig()), claim("b", "vision", "gpu-1-mig-3g40gb-0")]
    sync(objects, T0)
    old = Allocation.objects.get()
    roll_up(2)
    before = figures()
    assert {value[1:4] for value in before.values()} == {
        ("gpu", Decimal("0.428571"), rollup.gpu_ms(HOUR_MS, 428_571))
    }

    # An operator counts NVIDIA devices as accelerators, each a whole one, from 09:00 on.
    apply_policy(
        policy=load_policy(
            textwrap.dedent(
                """\
                teams: []
                drivers:
                  gpu.nvidia.com:
                    unit: accelerator
                    share: []
                """
            )
        ),
        prune=False,
        actor="operator",
        dry_run=False,
    )
    sync(objects, T0 + HOUR)
    device = Device.objects.get()
    assert (device.unit, device.gpu_share) == ("accelerator", 1)
    roll_up(2)
    assert figures() == before

    # The claim released and made again: the new allocation counts as the device is now.
    sync([resource_slice(mig()), claim("b", "vision", None)], T0 + 2 * HOUR)
    sync(objects, T0 + 2 * HOUR)
    new = Allocation.objects.exclude(pk=old.pk).get()
    assert (new.unit, new.device_share, new.gpu_share) == ("accelerator", 1, 1)
    roll_up(3)
    rows = figures()
    assert only(2, rows) == before
    assert rows[T0 + 2 * HOUR, new.pk][1:4] == ("accelerator", 1, HOUR_MS)
