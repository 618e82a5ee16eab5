"""Imports that cannot rewrite the past (issue 33, finding 3).

A first import of a running cluster holds claims allocated long before Tally knew the cluster.
Before, their allocations started then: one command wrote "late data" adjustment lines against
closed months. They are now charged from the cluster's first sync, and the sync says so; and
`sync_inventory --from-file ... --dry-run` says what an import would change and the money it
would move, writing nothing.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
import time_machine
from django.core.management import call_command
from django.utils import timezone

from billing.models import LineKind, Period, Statement, StatementLine
from billing.pricing import round_money
from billing.services import bill_period
from inventory.models import Allocation, Cluster, Device, ResourceClaim
from metering.models import DirtyHour, UsageHour
from tests.billing.test_cluster_identity import send_samples, vision  # noqa: F401 (fixture)
from tests.inventory.test_kube_sync import claim, resource_slice

pytestmark = pytest.mark.django_db

NOVEMBER = (datetime(2026, 11, 1, tzinfo=UTC), datetime(2026, 12, 1, tzinfo=UTC))
ALLOCATED_IN_NOVEMBER = datetime(2026, 11, 10, tzinfo=UTC)
FIRST_SYNC = datetime(2026, 12, 1, tzinfo=UTC)  # T0 of the samples `send_samples` sends
NOW = FIRST_SYNC + timedelta(hours=10)


def allocated(obj: dict[str, Any], at: datetime) -> dict[str, Any]:
    obj["status"]["allocation"]["allocationTimestamp"] = f"{at:%Y-%m-%dT%H:%M:%SZ}"
    return obj


def fleet(nodes: dict[str, datetime]) -> dict[str, Any]:
    """Nodes with gpu-0 and gpu-1, each GPU held by a claim of team-a allocated at the time
    given for its node."""
    items: list[dict[str, Any]] = []
    for node, at in nodes.items():
        items.append(resource_slice(node, "gpu-0", "gpu-1"))
        items.extend(
            allocated(claim(f"{node}-{device}", node=node, device=device), at)
            for device in ("gpu-0", "gpu-1")
        )
    return {"apiVersion": "v1", "kind": "List", "items": items}


def sync_file(
    tmp_path: Path,
    objects: dict[str, Any],
    at: datetime,
    *,
    cluster: str = "default",
    **options: Any,
) -> str:
    path = tmp_path / f"{cluster}-{at:%d%H%M}.json"
    path.write_text(json.dumps(objects))
    out, err = StringIO(), StringIO()
    call_command(
        "sync_inventory",
        from_file=path,
        cluster=cluster,
        at=at.isoformat(),
        kinds=["ResourceSlice", "ResourceClaim"],
        stdout=out,
        stderr=err,
        **options,
    )
    return out.getvalue() + err.getvalue()


def close_november() -> None:
    Period.objects.create(
        start=NOVEMBER[0], end=NOVEMBER[1], closed_at=NOVEMBER[1], closed_by="finance"
    )


def test_a_first_import_charges_old_allocations_from_the_first_sync_not_closed_months(
    tmp_path: Path,
) -> None:
    close_november()

    said = sync_file(tmp_path, fleet({"node-a": ALLOCATED_IN_NOVEMBER}), FIRST_SYNC)
    send_samples("node-a")
    bill_period(period_start=FIRST_SYNC, now=NOW)

    assert set(Allocation.objects.values_list("start", flat=True)) == {FIRST_SYNC}
    assert not UsageHour.objects.filter(hour__lt=FIRST_SYNC).exists()
    assert not StatementLine.objects.filter(kind=LineKind.ADJUSTMENT).exists()
    assert Statement.objects.get().total > 0  # December's usage is billed
    assert (
        "2 allocation(s) began before the cluster's first sync (the earliest at 2026-11-10 "
        "00:00 UTC): charged from 2026-12-01 00:00 UTC, the cluster's first sync"
    ) in said
    assert Cluster.objects.get(name="default").first_synced_at == FIRST_SYNC


def test_an_import_dated_in_a_closed_month_charges_from_the_oldest_open_period(
    tmp_path: Path,
) -> None:
    """A first import given `--at` in a closed month: its first sync is in the closed month,
    so its old allocations are charged from the start of the oldest open period instead."""
    close_november()

    said = sync_file(
        tmp_path, fleet({"node-a": ALLOCATED_IN_NOVEMBER}), datetime(2026, 11, 20, tzinfo=UTC)
    )

    assert set(Allocation.objects.values_list("start", flat=True)) == {NOVEMBER[1]}
    assert "charged from 2026-12-01 00:00 UTC, the start of the oldest open billing period" in said


def test_allocations_after_the_first_sync_keep_their_start(tmp_path: Path) -> None:
    sync_file(tmp_path, fleet({"node-a": ALLOCATED_IN_NOVEMBER}), FIRST_SYNC)
    started = FIRST_SYNC + timedelta(hours=1)

    said = sync_file(
        tmp_path,
        fleet({"node-a": ALLOCATED_IN_NOVEMBER, "node-b": started}),
        FIRST_SYNC + timedelta(hours=2),
    )

    assert "began before" not in said
    assert set(
        Allocation.objects.filter(claim__name__startswith="node-b").values_list("start", flat=True)
    ) == {started}


def rows() -> dict[str, Any]:
    return {
        "devices": list(Device.objects.order_by("pk").values_list("pk", "gone_at")),
        "claims": list(ResourceClaim.objects.order_by("pk").values_list("pk", "released_at")),
        "allocations": list(Allocation.objects.order_by("pk").values_list("pk", "start", "end")),
        "statements": list(Statement.objects.order_by("pk").values_list("pk", "total")),
        "dirty": list(DirtyHour.objects.order_by("hour").values_list("hour", "version")),
        "clusters": list(Cluster.objects.order_by("pk").values_list("name", "first_synced_at")),
    }


# The dry run and the import bill as of the same moment (an hour in progress grows).
@time_machine.travel(NOW + timedelta(minutes=30), tick=False)
def test_a_dry_run_says_what_an_import_would_change_and_the_money_and_writes_nothing(
    tmp_path: Path,
) -> None:
    """The dry run's money is what the import then bills, to the cent."""
    sync_file(tmp_path, fleet({"node-a": FIRST_SYNC}), FIRST_SYNC)
    send_samples("node-a")
    bill_period(period_start=FIRST_SYNC, now=timezone.now())
    before = rows()
    billed = round_money(Statement.objects.get().total, "USD")
    # node-a's claims end; node-b comes with two claims started an hour before the dump.
    grown = fleet({"node-b": FIRST_SYNC + timedelta(hours=1)})
    at = FIRST_SYNC + timedelta(hours=2)

    said = sync_file(tmp_path, grown, at, dry_run=True)

    assert rows() == before
    assert "Dry run of" in said and "nothing written" in said
    assert "Allocation: 2 created, 0 updated, 2 gone" in said
    assert "Device: 2 created" in said
    line = next(line for line in said.splitlines() if line.startswith("  vision 2026-12: "))
    figures = line.split(": ", 1)[1].split()
    assert Decimal(figures[0]) == billed
    would = Decimal(figures[2])
    assert would != billed

    sync_file(tmp_path, grown, at)
    bill_period(period_start=FIRST_SYNC, now=timezone.now())

    assert round_money(Statement.objects.get().total, "USD") == would


def test_a_dry_run_names_the_devices_it_would_refuse(tmp_path: Path) -> None:
    sync_file(tmp_path, fleet({"node-a": FIRST_SYNC}), FIRST_SYNC)
    before = rows()

    said = sync_file(tmp_path, fleet({"node-a": FIRST_SYNC}), NOW, cluster="lab", dry_run=True)

    assert "2 device(s) refused: their identity is live in cluster default" in said
    assert "Money: none would move." in said
    assert rows() == before
    assert not Cluster.objects.filter(name="lab").exists()
