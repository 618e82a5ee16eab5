"""What the webhook reads of GPU-hour budgets: all budgets in one query, a team's hours once."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from metering.models import UsageHour
from quota.models import Budget
from teams.models import Team, TeamNamespace
from tests.quota.fixtures import claim, decide, gpu_request, make_team

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fleet")]


def _reads(queries: CaptureQueriesContext, table: str) -> int:
    return sum(1 for query in queries if f'FROM "{table}"' in query["sql"])


def test_budgets_are_read_once_for_all_teams_and_hours_only_for_teams_with_one(
    client: Client, settings: Any
) -> None:
    settings.TALLY_BUDGET_CACHE_SECONDS = 60
    research = make_team([])
    Budget.objects.create(team=research, gpu_hours=Decimal(1000), mode="hard")
    for slug in ("vision", "speech"):
        team = Team.objects.create(slug=slug, name=slug)
        TeamNamespace.objects.create(team=team, namespace=slug)
    with CaptureQueriesContext(connection) as queries:
        for index, namespace in enumerate(["research", "vision", "speech"] * 3):
            body = claim(f"c{index}", [gpu_request(1)], namespace=namespace)
            assert decide(client, body)["allowed"] is True
    assert _reads(queries, Budget._meta.db_table) == 1
    # Only the team with a budget has its GPU-hours read, once while the cache holds.
    assert _reads(queries, UsageHour._meta.db_table) == 1


def test_a_budget_added_later_applies_once_the_cache_expires(client: Client, settings: Any) -> None:
    settings.TALLY_BUDGET_CACHE_SECONDS = 0
    research = make_team([])
    assert decide(client, claim("before", [gpu_request(1)]))["allowed"] is True
    Budget.objects.create(team=research, gpu_hours=Decimal(0), mode="hard")
    answer = decide(client, claim("after", [gpu_request(1)]))
    assert answer["allowed"] is False
    assert answer["status"]["reason"] == "BudgetExceeded"
