"""The fleet week heatmap counts each node's units hour by hour from the devices' presence
(issue 35, finding 4): a node the sync first saw after its devices were held is not 0 units
(so its held hours are not all dark), and a week that holds hours before a device appeared,
or after now, does not count it in them (`?start=` of this week).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import time_machine
from django.contrib.auth.models import Group, User
from django.test import Client
from django.urls import reverse

from inventory.models import Allocation, Device, Node
from metering.models import UsageHour
from teams.models import Team
from teams.selectors import OPERATORS_GROUP
from tests.billing.test_week_report import _rows
from tests.factories import AllocationFactory, DeviceFactory, NodeFactory

pytestmark = pytest.mark.django_db

MONDAY = datetime(2026, 11, 23, tzinfo=UTC)  # the last complete week at NOW
NOW = datetime(2026, 12, 2, 10, 30, tzinfo=UTC)  # Wednesday of the week after
H = 3_600_000


@pytest.fixture(autouse=True)
def _clock() -> Iterator[None]:
    with time_machine.travel(NOW, tick=False):
        yield


@pytest.fixture
def operator() -> Client:
    user = User.objects.create_user("operator")
    user.groups.add(Group.objects.get_or_create(name=OPERATORS_GROUP)[0])
    client = Client()
    client.force_login(user)
    return client


def held(device: Device, team: Team, start: datetime, hours: int) -> Allocation:
    """`device` held from `start`, each hour of `hours` rolled up as fully allocated."""
    allocation = AllocationFactory.create(
        device=device, claim__namespace="vision", start=start, team=team
    )
    UsageHour.objects.bulk_create(
        _rows(allocation, user="ana", job="Job/train", first=start, hours=[(H, H // 2, 0)] * hours)
    )
    return allocation


def heatmap(client: Client, start: str = "") -> str:
    response = client.get(reverse("fleet-week") + (f"?start={start}" if start else ""))
    assert response.status_code == 200
    page = response.content.decode()
    return page[page.index('id="heatmap-allocated"') : page.index('id="utilised-heading"')]


def test_a_node_first_seen_after_its_devices_were_held_has_its_units(operator: Client) -> None:
    """Issue 35: the demo's nodes were first seen at its load, their allocations began days
    before; the week showed 0 units for every node and every held hour at full shade."""
    team = Team.objects.create(slug="vision", name="Vision")
    node = NodeFactory.create(name="gpu-h100-late", first_seen=NOW)
    first, second = (DeviceFactory.create(node=node, first_seen=NOW) for _ in range(2))
    held(first, team, MONDAY, 24 * 7)
    held(second, team, MONDAY + timedelta(days=3), 24 * 4)

    allocated = heatmap(operator)

    # Monday: only the first GPU is known to have been there (from its allocation).
    assert 'rgba(10,88,202,1.00)" title="gpu-h100-late Mon 23 10:00: 1.00 of 1"' in allocated
    # From Thursday both; each held: two of two.
    assert 'rgba(10,88,202,1.00)" title="gpu-h100-late Thu 26 10:00: 2.00 of 2"' in allocated
    assert 'gpu-h100-late <span class="muted">2</span>' in allocated


def test_a_held_hour_is_shaded_by_the_units_present_then(operator: Client) -> None:
    team = Team.objects.create(slug="vision", name="Vision")
    node = NodeFactory.create(name="gpu-h100-half", first_seen=NOW)
    first, second = (DeviceFactory.create(node=node, first_seen=NOW) for _ in range(2))
    # The first GPU was held on Monday only, the second from Tuesday: both there since.
    allocation = held(first, team, MONDAY, 24)
    Allocation.objects.filter(pk=allocation.pk).update(end=MONDAY + timedelta(days=1))
    held(second, team, MONDAY + timedelta(days=1), 24 * 6)

    allocated = heatmap(operator)

    assert 'rgba(10,88,202,0.50)" title="gpu-h100-half Wed 25 10:00: 1.00 of 2"' in allocated
    rows = list(csv.DictReader(io.StringIO(operator.get(reverse("fleet-week-csv")).text)))
    wednesday = [row for row in rows if row["hour"] == "2026-11-25T10:00:00+00:00"]
    assert [(row["node"], row["capacity"], row["allocated"]) for row in wednesday] == [
        ("gpu-h100-half", "2", "1.00")
    ]


def test_this_weeks_units_follow_presence_and_stop_at_now(operator: Client) -> None:
    """`?start=` of this week: a node the sync first saw on Tuesday 06:00 has no units on
    Monday, its 8 from Tuesday 06:00, and none in the hours after now; a GPU gone on Tuesday
    18:00 is no longer counted after it."""
    node = NodeFactory.create(
        name="gpu-h200-new", first_seen=NOW - timedelta(days=1, hours=4, minutes=30)
    )
    seen = node.first_seen
    assert seen == datetime(2026, 12, 1, 6, 0, tzinfo=UTC)
    gpus = [
        DeviceFactory.create(node=node, first_seen=seen, product_name="NVIDIA H200")
        for _ in range(8)
    ]
    Device.objects.filter(pk=gpus[0].pk).update(gone_at=seen + timedelta(hours=12))

    allocated = heatmap(operator, "2026-11-30")

    assert 'title="gpu-h200-new Mon 30 23:00: 0.00 of 0"' in allocated
    assert 'title="gpu-h200-new Tue 01 06:00: 0.00 of 8"' in allocated
    assert 'title="gpu-h200-new Tue 01 17:00: 0.00 of 8"' in allocated
    assert 'title="gpu-h200-new Tue 01 18:00: 0.00 of 7"' in allocated  # gone at its start
    assert 'title="gpu-h200-new Wed 02 10:00: 0.00 of 7"' in allocated  # now is in it
    assert 'title="gpu-h200-new Wed 02 11:00: 0.00 of 0"' in allocated  # to come
    # The week before it was first seen: no row at all.
    page = operator.get(reverse("fleet-week")).content.decode()
    assert "No nodes and no usage in this week." in page and "gpu-h200-new" not in page


def test_a_free_node_present_all_week_is_a_row(operator: Client) -> None:
    used = NodeFactory.create(name="gpu-h100-used", first_seen=MONDAY - timedelta(days=30))
    free = NodeFactory.create(
        name="gpu-h200-free", cluster=used.cluster, first_seen=MONDAY - timedelta(days=30)
    )
    for _ in range(8):
        DeviceFactory.create(node=free, first_seen=free.first_seen, product_name="NVIDIA H200")

    allocated = heatmap(operator)

    assert 'rgba(10,88,202,0.00)" title="gpu-h200-free Mon 23 00:00: 0.00 of 8"' in allocated
    # A node without devices has no units and no usage: no row.
    assert Node.objects.filter(name="gpu-h100-used").exists()
    assert "gpu-h100-used" not in allocated
