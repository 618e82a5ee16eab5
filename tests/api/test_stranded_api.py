"""The stranded-gangs endpoint: scoped to the reader's teams, priced, filtered and exported
(quota.api.stranded)."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

import pytest
import time_machine
from rest_framework.test import APIClient

from billing.models import RateCard
from tests.inventory.test_stranded import H100, MONDAY, NOW, Week, week

__all__ = ["week"]

pytestmark = pytest.mark.django_db

URL = "/api/v1/gangs/stranded/"


@pytest.fixture(autouse=True)
def _now() -> Iterator[None]:
    with time_machine.travel(NOW, tick=False):
        yield


@pytest.fixture
def priced(week: Week) -> Week:
    RateCard.objects.create(
        product_name=H100,
        per_gpu_hour=Decimal("2.5000"),
        currency="EUR",
        valid_from=MONDAY.date(),
    )
    return week


def test_operator_sees_every_stranded_gang_with_its_cost(priced: Week) -> None:
    response = priced.cast.client("operator").get(URL)
    assert response.status_code == 200, response.content
    rows = response.json()["results"]
    assert [(r["team"], r["gang"]) for r in rows] == [
        ("alpha", "JobSet/train"),
        ("beta", "JobSet/small"),
    ]
    train = rows[0]
    assert {k: train[k] for k in ("size", "members_holding", "devices_held", "units_held")} == {
        "size": 2,
        "members_holding": 1,
        "devices_held": 8,
        "units_held": "8.000000",
    }
    assert train["stranded_since"] == "2026-11-23T00:00:00Z"
    assert train["stranded_seconds"] == 604800
    assert train["unit_hours"] == "1344.000000"
    assert train["costs"] == [{"currency": "EUR", "amount": "3360.00"}]
    assert train["held"] == [
        {
            "product_name": H100,
            "profile": "",
            "unit": "gpu",
            "devices": 8,
            "unit_hours": "1344.000000",
        }
    ]
    # The slice has no card of its own: it pays its share of its GPU's price, 2 h x 1/7 x 2.50.
    assert rows[1]["costs"] == [{"currency": "EUR", "amount": "0.71"}]


def test_a_token_of_another_team_sees_nothing_of_yours(
    priced: Week, api_token: Callable[[Any], str]
) -> None:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {api_token(priced.cast.lead_b)}")
    rows = client.get(URL).json()["results"]
    assert [r["gang"] for r in rows] == ["JobSet/small"]
    assert client.get(URL, {"team": "alpha"}).json()["results"] == []
    assert priced.cast.client("member_a").get(URL).status_code == 403
    assert priced.cast.client(None).get(URL).status_code == 401


def test_csv_and_ordering(priced: Week) -> None:
    client = priced.cast.client("finance")
    ordered = client.get(URL, {"ordering": "devices_held"}).json()["results"]
    assert [r["gang"] for r in ordered] == ["JobSet/small", "JobSet/train"]
    assert client.get(URL, {"ordering": "bogus"}).status_code == 400
    response = client.get(URL, {"format": "csv", "team": "alpha"})
    (row,) = csv.DictReader(io.StringIO(response.content.decode()))
    assert (row["gang"], row["unit_hours"], row["devices_held"]) == (
        "JobSet/train",
        "1344.000000",
        "8",
    )
    assert json.loads(row["costs"]) == [{"currency": "EUR", "amount": "3360.00"}]
