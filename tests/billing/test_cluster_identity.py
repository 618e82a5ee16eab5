"""One GPU, one cluster (issue 33, finding 2): a device identity live in one cluster is not
taken by another, so a second cluster's dump with the first one's GPU UUIDs moves no bill.

Samples name a GPU by its UUID alone. Before, `sync_inventory --from-file fleet.json --cluster
lab` of a dump whose GPUs were live in `default` stored them again in `lab` ("Sync warnings:
none"), and every sample then counted for both clusters' allocations: the bills multiplied.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command

from billing.models import RateCard, Statement
from billing.pricing import round_money
from billing.services import bill_period
from inventory import services
from inventory.models import Allocation, Device, Pool
from metering import ingest
from metering.hours import epoch_ms
from metering.ingest import SampleRow
from tests.inventory.test_kube_sync import claim, gpu, resource_slice
from tests.quota.factories import TeamNamespaceFactory

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 12, 1, tzinfo=UTC)
LAB_IMPORT = T0 + timedelta(hours=3)
NOW = T0 + timedelta(hours=10)
H100 = "NVIDIA H100 80GB HBM3"


def dump(*nodes: str) -> dict[str, Any]:
    """A cluster of one-GPU-per-claim nodes: `nodes` with gpu-0 and gpu-1 each, every GPU
    held by a claim of namespace team-a (vision)."""
    items: list[dict[str, Any]] = []
    for node in nodes:
        items.append(resource_slice(node, "gpu-0", "gpu-1"))
        items.extend(
            claim(f"{node}-{device}", node=node, device=device) for device in ("gpu-0", "gpu-1")
        )
    return {"apiVersion": "v1", "kind": "List", "items": items}


def sync_file(tmp_path: Path, cluster: str, fleet: dict[str, Any], at: datetime) -> str:
    path = tmp_path / f"{cluster}-{at:%H%M}.json"
    path.write_text(json.dumps(fleet))
    out, err = StringIO(), StringIO()
    call_command(
        "sync_inventory",
        from_file=path,
        cluster=cluster,
        at=at.isoformat(),
        kinds=["ResourceSlice", "ResourceClaim"],
        stdout=out,
        stderr=err,
    )
    return out.getvalue() + err.getvalue()


def uuid_of(node: str, device: str) -> str:
    return str(gpu(device, node)["attributes"]["uuid"]["string"])


def send_samples(*nodes: str) -> None:
    """Every GPU of `nodes` at 50% every 20 minutes from T0 to NOW."""
    for node in nodes:
        rows = [
            SampleRow(uuid_of(node, device), epoch_ms(T0 + timedelta(minutes=m)), 50.0, None, None)
            for device in ("gpu-0", "gpu-1")
            for m in range(0, 600, 20)
        ]
        ingest.ingest(node=node, samples=rows, received_at=NOW)


def statements() -> dict[str, Decimal]:
    bill_period(period_start=T0, now=NOW)
    return {
        f"{s.team.slug} {s.currency}": round_money(s.total, s.currency)
        for s in Statement.objects.select_related("team")
    }


@pytest.fixture(autouse=True)
def vision() -> None:
    TeamNamespaceFactory.create(team__slug="vision", namespace="team-a")
    RateCard.objects.create(
        product_name=H100,
        per_gpu_hour=Decimal("2.40"),
        idle_factor=Decimal("0.5"),
        currency="USD",
        valid_from=T0.date(),
    )


def test_a_second_cluster_with_the_first_ones_uuids_is_refused_and_moves_no_bill(
    tmp_path: Path,
) -> None:
    fleet = dump("node-a", "node-b")
    sync_file(tmp_path, "default", fleet, T0)
    send_samples("node-a", "node-b")
    before = statements()
    assert set(before) == {"vision USD"} and before["vision USD"] > 0

    said = sync_file(tmp_path, "lab", fleet, LAB_IMPORT)

    assert statements() == before
    assert "4 device(s) refused: their identity is live in cluster default" in said
    assert uuid_of("node-a", "gpu-0") in said
    assert "Sync warnings: none" not in said
    lab = services.get_cluster("lab")
    assert not Device.objects.filter(cluster=lab).exists()
    assert not Allocation.objects.filter(cluster=lab, gpu_share__gt=0).exists()
    assert Pool.objects.get(cluster=lab, name="node-a").refused == {
        "gpu-0": [uuid_of("node-a", "gpu-0"), "default"],
        "gpu-1": [uuid_of("node-a", "gpu-1"), "default"],
    }


def test_a_node_that_moved_is_taken_once_it_has_left_the_first_cluster(tmp_path: Path) -> None:
    """node-b moves from default to lab: lab's sync refuses it while default still has it,
    and takes it at lab's first sync after default let it go; the GPUs of lab's own node are
    taken at once."""
    sync_file(tmp_path, "default", dump("node-a", "node-b"), T0)
    lab_fleet = dump("node-b", "node-c")
    said = sync_file(tmp_path, "lab", lab_fleet, LAB_IMPORT)
    assert "2 device(s) refused" in said
    lab = services.get_cluster("lab")
    assert set(Device.objects.filter(cluster=lab).values_list("pool", flat=True)) == {"node-c"}

    sync_file(tmp_path, "default", dump("node-a"), LAB_IMPORT + timedelta(hours=1))
    taken = LAB_IMPORT + timedelta(hours=2)
    said = sync_file(tmp_path, "lab", lab_fleet, taken)

    assert "refused" not in said
    assert Device.objects.filter(cluster=lab, gone_at__isnull=True).count() == 4
    assert not Pool.objects.filter(cluster=lab).exclude(refused={}).exists()
    # lab's claims on node-b, seen while default had it, are charged from when lab took it:
    # the hours before were default's.
    starts = dict(Allocation.objects.filter(cluster=lab).values_list("pool", "start"))
    assert starts == {"node-b": taken, "node-c": LAB_IMPORT}


def test_the_watch_takes_a_refused_device_once_the_other_cluster_let_it_go() -> None:
    """The live sync: a slice event of lab naming default's GPU is refused; once default's
    slice is deleted, lab's next batch of events (a claim, not the pool) takes it."""
    default, lab = services.get_cluster("default"), services.get_cluster("lab")
    services.import_snapshot(cluster=default, objects=[resource_slice("node-a")], at=T0)
    event = services.WatchEvent("ADDED", resource_slice("node-a"), LAB_IMPORT)

    report = services.apply_watch_events(cluster=lab, events=[event])

    assert report.refused == {"default": [uuid_of("node-a", "gpu-0")]}
    assert not Device.objects.filter(cluster=lab).exists()
    # Said once: the next batches recount the pool and refuse it again, quietly (stored).
    again = services.apply_watch_events(
        cluster=lab,
        events=[
            services.WatchEvent("ADDED", claim("b", node="node-a", device="gpu-0"), LAB_IMPORT)
        ],
    )
    assert again.refused == {} and not again.notes()
    assert Pool.objects.get(cluster=lab).refused
    gone = services.WatchEvent("DELETED", resource_slice("node-a"), LAB_IMPORT)
    services.apply_watch_events(cluster=default, events=[gone])
    later = LAB_IMPORT + timedelta(minutes=5)
    services.apply_watch_events(
        cluster=lab,
        events=[services.WatchEvent("ADDED", claim("c", node="node-a", device="gpu-0"), later)],
    )

    taken = Device.objects.get(cluster=lab, gone_at__isnull=True)
    assert taken.uuid == uuid_of("node-a", "gpu-0")
    # Claim b, seen while the GPU was refused, is charged from when it was taken.
    assert set(
        Allocation.objects.filter(cluster=lab).values_list("claim__name", "device", "start")
    ) == {
        ("b", taken.pk, later),
        ("c", taken.pk, later),
    }
