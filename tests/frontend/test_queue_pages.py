"""The fleet and team pages' pending demand and stranded gangs (issue 20): what each reader
sees, with the figures to the hour and cent."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal

import pytest
import time_machine
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from inventory.models import Allocation, Device, Gang
from tests.factories import AllocationFactory, ResourceClaimFactory
from tests.frontend.seed import Portal

pytestmark = pytest.mark.django_db

H100 = "NVIDIA H100 80GB HBM3"


@dataclass
class Queue:
    portal: Portal
    now: datetime


def _client(portal: Portal, who: str) -> Client:
    client = Client()
    client.force_login(portal.users[who])
    return client


def add_queue(portal: Portal, now: datetime) -> None:
    """In team A's namespace `vision`: a claim for 4 whole GPUs waiting 3 hours, and the
    two-pod JobSet `train` whose worker 0 has held one free H100 for 48 hours while worker 1
    waits."""
    ResourceClaimFactory.create(
        cluster=portal.cluster,
        namespace="vision",
        name="waiting-four",
        spec={
            "devices": {
                "requests": [
                    {"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com", "count": 4}}
                ]
            }
        },
        created_at=now - timedelta(hours=3),
        first_seen=now - timedelta(hours=3),
    )
    gang = Gang.objects.create(
        cluster=portal.cluster,
        namespace="vision",
        key="JobSet/train",
        source="jobset",
        size=2,
        first_seen=now - timedelta(hours=48),
        last_seen=now,
    )
    free = (
        Device.objects.filter(cluster=portal.cluster, product_name=H100, kind="gpu")
        .exclude(pk__in=Allocation.objects.filter(end__isnull=True).values("device_id"))
        .first()
    )
    assert free is not None
    for index in range(2):
        claim = ResourceClaimFactory.create(
            cluster=portal.cluster,
            namespace="vision",
            name=f"train-{index}-gpu",
            gang=gang,
            owner_references=[{"kind": "Pod", "name": f"train-{index}", "uid": f"uid-{index}"}],
            created_at=now - timedelta(hours=48),
            first_seen=now - timedelta(hours=48),
        )
        if index == 0:
            AllocationFactory.create(
                claim=claim, device=free, cluster=portal.cluster, start=now - timedelta(hours=48)
            )


@pytest.fixture
def queue(portal: Portal) -> Iterator[Queue]:
    """`add_queue`, with the clock standing still so that every figure is exact."""
    now = timezone.now().replace(microsecond=0)
    add_queue(portal, now)
    with time_machine.travel(now, tick=False):
        yield Queue(portal=portal, now=now)


def test_team_page_shows_its_queue_and_stranded_gang(queue: Queue) -> None:
    response = _client(queue.portal, "lead_a").get(reverse("team", args=["vision"]))
    assert response.status_code == 200
    waiting = next(c for c in response.context["pending_claims"] if c.name == "waiting-four")
    assert (waiting.waited_seconds, waiting.requests[0].devices) == (3 * 3600, 4)
    (priced,) = response.context["stranded"]
    assert (priced.gang.key, priced.gang.members_holding, priced.gang.devices_held) == (
        "JobSet/train",
        1,
        1,
    )
    assert priced.unit_hours == Decimal(48)
    assert priced.cost == {"USD": Decimal("134.40")}  # 48 GPU-hours at 2.80
    page = response.content.decode()
    assert "Pending demand" in page and "waiting-four" in page and "3 h 0 min" in page
    assert "JobSet/train" in page and "1 of 2" in page and "134.40 USD" in page
    assert "48 GPU-hours" in page
    assert not response.context["show_team"]


def test_another_teams_page_shows_none_of_it(queue: Queue) -> None:
    response = _client(queue.portal, "lead_b").get(reverse("team", args=["nlp"]))
    assert response.status_code == 200
    assert "waiting-four" not in [c.name for c in response.context["pending_claims"]]
    assert response.context["stranded"] == []
    page = response.content.decode()
    assert "waiting-four" not in page and "JobSet/train" not in page
    assert "No gang has been partly held for more than 30 minutes." in page
    # Nor can its lead open team A's page to look.
    assert _client(queue.portal, "lead_b").get(reverse("team", args=["vision"])).status_code == 404


def test_fleet_page_shows_every_teams_queue(queue: Queue) -> None:
    response = _client(queue.portal, "operator").get(reverse("fleet"))
    assert response.status_code == 200
    assert response.context["show_team"]
    vision = [r for _, r in response.context["pending_demand"] if r.team == "vision"]
    gpus = next(r for r in vision if r.device_class == "gpu.nvidia.com")
    assert gpus.devices >= 4 and gpus.longest_wait_seconds >= 3 * 3600
    assert [p.gang.key for p in response.context["stranded"]] == ["JobSet/train"]
    page = response.content.decode()
    assert 'id="pending-demand"' in page and 'id="stranded-gangs"' in page
    assert "134.40 USD" in page
