"""Figures, filters, ordering, pagination and CSV of the list endpoints; query counts pinned."""

from __future__ import annotations

import csv
import io
from decimal import Decimal
from typing import Any

import pytest

from billing import pricing
from billing.services import add_adjustment
from teams.api import Pagination, csv_cell
from tests.api.cast import Seeded, seed_usage

pytestmark = pytest.mark.django_db


def rows(seeded: Seeded, url: str, who: str = "operator", **params: Any) -> list[dict]:
    response = seeded.cast.client(who).get(url, params)
    assert response.status_code == 200, response.content
    return response.json()["results"]


def test_usage_per_day_and_hour(seeded: Seeded) -> None:
    per_day = rows(seeded, "/api/v1/usage/")
    assert [
        (row["team"], row["allocated_gpu_hours"], row["idle_gpu_hours"]) for row in per_day
    ] == [
        ("alpha", "3.000000", "1.500000"),
        ("beta", "1.000000", "0.500000"),
    ]
    assert per_day[0]["efficiency"] == "0.500000"
    assert per_day[0]["start"] == seeded.last.start.replace(day=3).isoformat().replace(
        "+00:00", "Z"
    )
    per_hour = rows(seeded, "/api/v1/usage/", granularity="hour", team="alpha")
    assert [row["allocated_gpu_hours"] for row in per_hour] == ["1.000000"] * 3
    response = seeded.cast.client("operator").get("/api/v1/usage/", {"granularity": "week"})
    assert response.status_code == 400


def test_usage_breakdowns_and_date_range(seeded: Seeded) -> None:
    claims = rows(seeded, "/api/v1/usage/claims/", ordering="-allocated_gpu_hours")
    assert [(row["team"], row["namespace"]) for row in claims] == [
        ("alpha", "alpha-ns"),
        ("beta", "beta-ns"),
    ]
    assert rows(seeded, "/api/v1/usage/users/", team="beta")[0]["username"] == "beta-user"
    assert rows(seeded, "/api/v1/usage/jobs/")[0]["job"].startswith("Job/")
    day = seeded.last.start.date()
    assert rows(seeded, "/api/v1/usage/", **{"from": str(day.replace(day=4))}) == rows(
        seeded, "/api/v1/usage/", team="beta"
    )
    assert rows(seeded, "/api/v1/usage/", to=str(day.replace(day=3))) == []
    assert len(rows(seeded, "/api/v1/usage/", period=str(seeded.last.pk))) == 2
    assert rows(seeded, "/api/v1/usage/", period=str(seeded.current.start.date())) == []
    bad = seeded.cast.client("operator").get("/api/v1/usage/", {"period": "last"})
    assert bad.status_code == 400


def test_statement_lines_with_efficiency(seeded: Seeded) -> None:
    lines = rows(seeded, "/api/v1/statement-lines/", team="alpha", kind="usage")
    assert len(lines) == 1
    line = lines[0]
    assert line["period_start"].startswith(str(seeded.last.start.date()))
    assert (line["currency"], line["rate"], line["idle_factor"]) == ("EUR", "2.5000", "0.5000")
    # 3 GPU-hours, half idle at half price: 2.5 * (3 - 0.5 * 1.5)
    assert (line["efficiency"], line["amount"]) == ("0.500000", "5.63")
    adjustments = rows(seeded, "/api/v1/statement-lines/", kind="adjustment")
    assert [(row["team"], row["amount"], row["efficiency"]) for row in adjustments] == [
        ("beta", "-5.00", None)
    ]
    by_period = rows(seeded, "/api/v1/statements/", period=str(seeded.last.start.date()))
    assert {row["team"] for row in by_period} == {"alpha", "beta"}
    assert rows(seeded, "/api/v1/statements/", period=str(seeded.closed.pk)) == []


def test_periods_are_taken_and_shown_by_name(seeded: Seeded) -> None:
    """`?period=` takes a period as the commands name it (2026-11), as well as its id and its
    start date; and every period shown carries its name."""
    name = seeded.last.label
    by_name = rows(seeded, "/api/v1/statement-lines/", team="alpha", period=name)
    assert by_name == rows(seeded, "/api/v1/statement-lines/", team="alpha", period=seeded.last.pk)
    assert by_name and {line["period_label"] for line in by_name} == {name}
    statements = rows(seeded, "/api/v1/statements/", period=name)
    assert {(row["team"], row["period_label"]) for row in statements} == {
        ("alpha", name),
        ("beta", name),
    }
    assert rows(seeded, "/api/v1/statements/", period=seeded.closed.label) == []
    assert len(rows(seeded, "/api/v1/usage/", period=name)) == 2
    assert rows(seeded, "/api/v1/usage/", period=seeded.current.label) == []
    labels = {row["id"]: row["label"] for row in rows(seeded, "/api/v1/periods/")}
    assert labels[seeded.last.pk] == name
    # A week where billing is monthly, and a month that is no month, say what is wrong.
    client = seeded.cast.client("operator")
    week = client.get("/api/v1/statement-lines/", {"period": "2026-W49"})
    assert week.status_code == 400
    assert week.json() == {
        "period": [
            "'2026-W49' names a week, but billing periods are months "
            "(TALLY_BILLING_PERIOD=month): give the period as 2026-11"
        ]
    }
    assert client.get("/api/v1/statements/", {"period": "2026-13"}).status_code == 400


def test_quota_usage_fraction(seeded: Seeded) -> None:
    quotas = rows(seeded, "/api/v1/quotas/", ordering="-usage_fraction")
    assert [(row["team"], row["in_use"], row["usage_fraction"]) for row in quotas] == [
        ("alpha", "2.000000", "0.250000"),
        ("beta", "0.000000", None),
    ]


def test_periods_and_rate_cards_filters(seeded: Seeded) -> None:
    assert [row["id"] for row in rows(seeded, "/api/v1/periods/", closed="true")] == [
        seeded.closed.pk
    ]
    assert len(rows(seeded, "/api/v1/periods/", closed="false")) == 2
    assert len(rows(seeded, "/api/v1/rate-cards/", product_name="NVIDIA H100 80GB HBM3")) == 1
    assert rows(seeded, "/api/v1/rate-cards/", valid_on="2019-12-31") == []


def test_pagination_is_bounded(seeded: Seeded) -> None:
    client = seeded.cast.client("operator")
    first = client.get("/api/v1/usage/claims/", {"page_size": 1})
    body = first.json()
    assert (body["count"], len(body["results"])) == (2, 1)
    assert first["X-Total-Count"] == "2"
    assert 'rel="next"' in first["Link"]
    assert client.get(body["next"]).json()["results"][0]["team"] == "beta"
    # At most 1000 a page, whatever is asked for.
    assert client.get("/api/v1/usage/claims/", {"page_size": 10**6}).json()["count"] == 2
    assert Pagination.max_page_size == 1000


STATEMENT_LINE_COLUMNS = (
    "id,team,period,period_label,period_start,currency,kind,product_name,profile,"
    "allocated_gpu_hours,utilised_gpu_hours,idle_gpu_hours,unmeasured_gpu_hours,efficiency,rate,"
    "unit,hours,gpu_share,idle_factor,amount,corrects_period,corrects_period_label,"
    "corrects_period_start,reason,created_by"
)


def csv_rows(seeded: Seeded, url: str, who: str = "finance", **params: Any) -> list[list[str]]:
    response = seeded.cast.client(who).get(url, {"format": "csv", **params})
    assert response.status_code == 200
    assert response["Content-Type"] == "text/csv; charset=utf-8"
    return list(csv.reader(io.StringIO(response.content.decode())))


def test_csv_has_a_stable_header(seeded: Seeded) -> None:
    lines = csv_rows(seeded, "/api/v1/statement-lines/")
    assert ",".join(lines[0]) == STATEMENT_LINE_COLUMNS
    assert len(lines) == 4  # alpha's and beta's usage, beta's adjustment
    empty = csv_rows(seeded, "/api/v1/statement-lines/", team="nobody")
    assert empty == [lines[0]]
    teams = csv_rows(seeded, "/api/v1/teams/", who="lead_a")
    assert teams == [
        ["slug", "name", "cost_centre", "namespaces", "leads"],
        ["alpha", "Alpha", "CC-1", "alpha-ns", "la"],
    ]
    usage = csv_rows(seeded, "/api/v1/usage/")
    assert usage[0] == [
        "team",
        "start",
        "product_name",
        "hours",
        "allocated_gpu_hours",
        "utilised_gpu_hours",
        "idle_gpu_hours",
        "unmeasured_gpu_hours",
        "efficiency",
    ]


def test_csv_cells_are_not_formulas(seeded: Seeded) -> None:
    add_adjustment(
        team=seeded.cast.alpha,
        period=seeded.current,
        currency="EUR",
        amount=Decimal(-1),
        reason="=HYPERLINK(1)",
        actor="fin",
    )
    lines = csv_rows(seeded, "/api/v1/adjustments/", team="alpha")
    reason = lines[0].index("reason")
    assert lines[1][reason] == "'=HYPERLINK(1)"
    assert lines[1][lines[0].index("amount")] == "-1.00"


@pytest.mark.parametrize(
    ("value", "cell"),
    [
        ("=1+2", "'=1+2"),
        ("@SUM(A1)", "'@SUM(A1)"),
        ("+cmd", "'+cmd"),
        ("-1.50", "-1.50"),  # a number, not a formula
        (Decimal("-3"), "-3"),
        (" -1", " -1"),
        ("- 1", "'- 1"),
        (None, ""),
        (True, "true"),
        (["a", "=b"], "a;'=b"),
        ([{"k": 1}], '[{"k": 1}]'),
    ],
)
def test_csv_cell(value: Any, cell: str) -> None:
    assert csv_cell(value) == cell


@pytest.mark.parametrize(
    ("url", "queries"),
    # The role takes 2 queries for finance (asked once a request): 2 before the page's count
    # and rows (teams: + namespaces and leads prefetched).
    [
        ("/api/v1/teams/", 6),
        ("/api/v1/quotas/", 6),  # two for the fleet (shapes, classes) naming rules' units
        ("/api/v1/rate-cards/", 4),
        ("/api/v1/periods/", 4),
        ("/api/v1/statements/", 4),
        ("/api/v1/statement-lines/", 4),
        ("/api/v1/adjustments/", 4),
        ("/api/v1/usage/", 4),
        ("/api/v1/usage/claims/", 4),
        ("/api/v1/usage/jobs/", 4),
        ("/api/v1/usage/users/", 4),
        ("/api/v1/decisions/", 3),
        ("/api/v1/inventory/capacity/", 3),
    ],
)
@pytest.mark.parametrize("fmt", ["json", "csv"])
def test_query_counts_do_not_grow_with_rows(
    seeded: Seeded, django_assert_max_num_queries: Any, url: str, queries: int, fmt: str
) -> None:
    # More of everything: counts must not depend on how many rows there are.
    for day in range(5, 10):
        seed_usage(seeded.cast.alpha, f"alpha-ns-{day}", seeded.last.start.replace(day=day), 2)
    pricing.refresh_statements(period=seeded.last)
    client = seeded.cast.client("finance" if "decisions" not in url else "operator")
    with django_assert_max_num_queries(queries):
        response = client.get(url, {"format": fmt})
    assert response.status_code == 200
