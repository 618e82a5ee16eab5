"""The demo is deterministic: loaded twice at the same moment (each time into an empty
database), it holds the same figures, samples and fleet (issue 35, item 3)."""

from __future__ import annotations

from typing import Any

import pytest
from django.db.models import Count, F, Sum
from django.db.models.functions import Round

from billing import week
from frontend.week import week_report
from inventory.models import Allocation, Device, Gang, ResourceClaim
from metering.models import Sample, UsageHour
from teams.models import AuditEntry, Team
from tests.demo.test_demo import LOADED_AT, figures, loaded_demo

pytestmark = pytest.mark.django_db(transaction=False)


def everything() -> dict[str, Any]:
    """What the demo holds, by what names it (not by primary keys: sequences move on)."""
    shown = figures()
    del shown["pages"]  # their links name periods by primary key; their figures are below
    start = week.last_complete_week(LOADED_AT)
    return {
        **shown,
        "usage": sorted(
            UsageHour.objects.values_list(
                "hour",
                "allocation__claim__uid",
                "allocation__device_name",
                "team__slug",
                "allocated_gpu_ms",
                "utilised_gpu_ms",
                "unmeasured_gpu_ms",
            )
        ),
        "weeks": {
            team.slug: week.week_csv_rows(week_report(team=team, start=start, now=LOADED_AT))
            for team in Team.objects.order_by("slug")
        },
        "samples": Sample.objects.aggregate(
            n=Count("id"), util=Sum(Round(F("gpu_util") * 10)), gaps=Sum("gap_ms")
        ),
        "claims": sorted(
            ResourceClaim.objects.values_list(
                "cluster__name", "uid", "namespace", "name", "first_seen"
            )
        ),
        "allocations": sorted(
            Allocation.objects.values_list(
                "cluster__name", "claim__uid", "device_name", "start", "end", "username", "job"
            )
        ),
        "devices": sorted(
            Device.objects.values_list("cluster__name", "meter_id", "driver_version", "first_seen")
        ),
        "gangs": sorted(Gang.objects.values_list("cluster__name", "namespace", "key", "size")),
        "audit": sorted(
            AuditEntry.objects.exclude(object_type="agent token").values_list(
                "at", "action", "object_type", "object_repr"
            )
        ),
    }


def test_loading_the_demo_twice_gives_the_same_figures(
    django_db_setup: None, django_db_blocker: Any
) -> None:
    loads = []
    with django_db_blocker.unblock():
        for _ in range(2):
            with loaded_demo():
                loads.append(everything())
    first, second = loads
    assert first["samples"]["n"] > 100_000 and first["totals"]
    for key in first:
        assert first[key] == second[key], key
