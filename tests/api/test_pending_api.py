"""The pending-demand endpoints: per claim and summed, scoped to the reader's teams, filtered,
ordered and exported (quota.api.demand)."""

from __future__ import annotations

import csv
import io
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import time_machine
from rest_framework.test import APIClient

from tests.api.cast import Cast
from tests.quota.fixtures import AT
from tests.quota.test_pending import queue

__all__ = ["queue"]

pytestmark = pytest.mark.django_db

CLAIMS = "/api/v1/pending/claims/"
SUMMARY = "/api/v1/pending/"


@pytest.fixture(autouse=True)
def _at() -> Iterator[None]:
    with time_machine.travel(AT, tick=False):
        yield


def names(response: Any) -> list[str]:
    assert response.status_code == 200, response.content
    return [row["claim"] for row in response.json()["results"]]


def test_finance_sees_every_pending_claim_longest_waiting_first(queue: Cast) -> None:
    response = queue.client("finance").get(CLAIMS)
    assert names(response) == ["odd", "two-gpus", "small-mig", "again", "a100"]
    first, second = response.json()["results"][:2]
    assert (first["team"], first["waited_seconds"], first["device_class"]) == (
        "",
        18000,
        "tpu.example.org",
    )
    assert second == {
        "cluster": "default",
        "namespace": "alpha",
        "claim": "two-gpus",
        "team": "alpha",
        "job": "",
        "waiting_since": "2026-11-30T09:00:00Z",
        "waited_seconds": 10800,
        "request": "gpu",
        "device_class": "gpu.nvidia.com",
        "unit": "gpu",
        "devices": 2,
        "units": "2.000000",
        "models": ["NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3"],
        "problem": "",
    }


def test_each_lead_and_token_sees_only_their_team(
    queue: Cast, api_token: Callable[[Any], str]
) -> None:
    assert names(queue.client("lead_a").get(CLAIMS)) == ["two-gpus", "small-mig", "again"]
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {api_token(queue.lead_b)}")
    assert names(client.get(CLAIMS)) == ["a100"]
    # Asking for the other team by name shows nothing of it.
    assert names(client.get(CLAIMS, {"team": "alpha"})) == []
    summary = client.get(SUMMARY).json()["results"]
    assert [(r["team"], r["device_class"], r["claims"], r["units"]) for r in summary] == [
        ("beta", "gpu.nvidia.com", 1, "1.000000")
    ]


def test_members_without_role_and_anonymous_are_refused(queue: Cast) -> None:
    for url in (CLAIMS, SUMMARY):
        assert queue.client("member_a").get(url).status_code == 403
        assert queue.client(None).get(url).status_code == 401


def test_summary_per_team_and_class_filtered_and_ordered(queue: Cast) -> None:
    client = queue.client("operator")
    rows = client.get(SUMMARY, {"team": "alpha", "ordering": "-units"}).json()["results"]
    assert [(r["device_class"], r["claims"], r["devices"], r["units"]) for r in rows] == [
        ("gpu.nvidia.com", 2, 3, "3.000000"),
        ("mig.nvidia.com", 1, 1, "0.142857"),
    ]
    assert rows[0]["longest_wait_seconds"] == 10800
    mig = client.get(CLAIMS, {"device_class": "mig.nvidia.com"}).json()["results"]
    assert [(r["claim"], r["units"], r["models"]) for r in mig] == [
        ("small-mig", "0.142857", ["NVIDIA A100-SXM4-80GB"])
    ]
    refused = client.get(SUMMARY, {"ordering": "bogus"})
    assert refused.status_code == 400
    assert client.get(SUMMARY, {"cluster": "nope"}).status_code == 404


def test_csv_has_one_row_per_request(queue: Cast) -> None:
    response = queue.client("lead_a").get(CLAIMS, {"format": "csv"})
    assert response.status_code == 200
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert [(r["claim"], r["units"], r["waited_seconds"]) for r in rows] == [
        ("two-gpus", "2.000000", "10800"),
        ("small-mig", "0.142857", "7200"),
        ("again", "1.000000", "3600"),
    ]
    assert rows[0]["models"] == "NVIDIA A100-SXM4-80GB;NVIDIA H100 80GB HBM3"


def test_query_count_does_not_grow_with_claims(
    queue: Cast, django_assert_max_num_queries: Any
) -> None:
    client = queue.client("finance")
    with django_assert_max_num_queries(12):
        assert client.get(CLAIMS).status_code == 200
