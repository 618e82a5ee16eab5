"""`/api/v1/compare/`: scoped like the usage endpoints, the decomposition worked out by hand in
tests/billing/test_compare.py, CSV, and a 400 naming each bad parameter."""

from __future__ import annotations

import csv
import io
from fractions import Fraction
from typing import Any

import pytest
from pytest_django import DjangoAssertNumQueries

from billing.compare import ROW_COLUMNS
from tests.api.cast import Cast
from tests.billing.test_compare import AFTER, BEFORE, usage

pytestmark = pytest.mark.django_db

URL = "/api/v1/compare/"
WINDOWS = {
    "before_start": "2026-11-02",
    "before_end": "2026-11-09",
    "after_start": "2026-11-09",
    "after_end": "2026-11-16T00:00Z",
}


@pytest.fixture
def usage_of_both(cast: Cast) -> Cast:
    """Alpha: the mix-and-efficiency case (70% -> 85%); beta: 50% -> 100%; a namespace of no
    team in the after window."""
    for hour, job, allocated, utilised in ((0, "Job/a", 10, 5), (1, "Job/b", 10, 9)):
        usage(cast.alpha, BEFORE.start, job, allocated, utilised, claim=f"c{hour}")
    for hour, job, allocated, utilised in ((0, "Job/a", 10, 7), (1, "Job/b", 30, 27)):
        usage(cast.alpha, AFTER.start, job, allocated, utilised, claim=f"c{hour}")
    usage(cast.beta, BEFORE.start, "Job/x", 4, 2, namespace="nlp")
    usage(cast.beta, AFTER.start, "Job/x", 4, 4, namespace="nlp")
    usage(None, AFTER.start, "Pod/stray", 10, 0, namespace="default")
    return cast


def get(cast: Cast, who: str | None, **params: str) -> Any:
    return cast.client(who).get(URL, {**WINDOWS, **params})


def test_a_lead_compares_the_team_with_each_part(usage_of_both: Cast) -> None:
    response = get(usage_of_both, "lead_a", team="alpha")
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["scope"] == "alpha" and body["unit"] == "gpu"
    assert body["hours_label"] == "GPU-hours"
    assert body["before"] == {
        "start": "2026-11-02T00:00:00Z",
        "end": "2026-11-09T00:00:00Z",
        "allocated_hours": "20.000000",
        "measured_hours": "20.000000",
        "utilised_hours": "14.000000",
        "idle_hours": "6.000000",
        "unmeasured_hours": "0.000000",
        "utilisation_pct": "70.0000",
    }
    assert body["after"]["utilisation_pct"] == "85.0000"
    assert body["change_pp"] == "15.0000"
    assert body["parts_pp"] == {
        "mix": "7.5000",
        "efficiency": "7.5000",
        "entering": "0.0000",
        "leaving": "0.0000",
    }
    assert body["exact"]["change"] == "3/20"
    rows = body["results"]
    assert [(row["job"], row["kind"]) for row in rows] == [("Job/a", "both"), ("Job/b", "both")]
    assert rows[0]["mix_pp"] == "4.3750" and rows[0]["efficiency_pp"] == "7.5000"
    assert sum(Fraction(row["change_pp"]) for row in rows) == Fraction(body["change_pp"])


@pytest.mark.parametrize(
    ("who", "params", "status"),
    [
        ("lead_a", {"team": "alpha"}, 200),
        ("lead_a", {"team": "beta"}, 404),  # another team: as if there were none
        ("lead_b", {"team": "alpha"}, 404),
        ("lead_a", {}, 403),  # the fleet: finance and operators only
        ("lead_a", {"team": "nope"}, 404),
        ("lead_a", {"team": "al\x00pha"}, 404),
        ("member_a", {"team": "alpha"}, 403),  # no role in Tally
        (None, {"team": "alpha"}, 401),
        ("finance", {"team": "beta"}, 200),
        ("finance", {}, 200),
        ("operator", {"team": "alpha"}, 200),
        ("operator", {}, 200),
    ],
)
def test_who_may_compare_what(
    usage_of_both: Cast, who: str | None, params: dict[str, str], status: int
) -> None:
    response = get(usage_of_both, who, **params)
    assert response.status_code == status, response.content
    if status == 404:
        assert response.json()["detail"].startswith("No team")
    if status == 403 and who == "lead_a":
        assert "give team=<slug>" in response.json()["detail"]


def test_the_fleet_counts_every_team_and_namespaces_of_none(usage_of_both: Cast) -> None:
    body = get(usage_of_both, "operator").json()
    assert body["scope"] == "fleet" and body["team"] is None
    assert body["jobs"] == {"both": 3, "entering": 1, "leaving": 0, "unmeasured": 0}
    # 16/24 -> 38/54; the stray pod entering at 0% pulls the fleet down.
    stray = next(row for row in body["results"] if row["job"] == "Pod/stray")
    assert stray["team"] == "" and stray["kind"] == "entering"
    assert Fraction(stray["entering_pp"]) < 0
    assert Fraction(body["exact"]["change"]) == Fraction(38, 54) - Fraction(16, 24)


def test_csv_is_the_whole_scope_then_each_job(usage_of_both: Cast) -> None:
    response = get(usage_of_both, "lead_a", team="alpha", format="csv")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/csv")
    rows = list(csv.reader(io.StringIO(response.content.decode())))
    assert rows[0] == list(ROW_COLUMNS)
    table = [dict(zip(rows[0], row, strict=True)) for row in rows[1:]]
    assert [row["kind"] for row in table] == ["total", "both", "both"]
    assert table[0]["team"] == "alpha"
    assert table[0]["before_utilisation_pct"] == "70.0000"
    assert table[0]["change_pp"] == "15.0000" and table[0]["efficiency_pp"] == "7.5000"
    assert table[0]["before_share_pct"] == "100.0000"


def test_an_empty_window_gives_nulls_not_an_error(cast: Cast) -> None:
    response = get(cast, "lead_a", team="alpha")
    assert response.status_code == 200
    body = response.json()
    assert body["change_pp"] is None and body["exact"] is None
    assert body["before"]["utilisation_pct"] is None and body["results"] == []
    rows = list(
        csv.reader(io.StringIO(get(cast, "lead_a", team="alpha", format="csv").content.decode()))
    )
    assert len(rows) == 2 and rows[1][0] == "total"


@pytest.mark.parametrize(
    ("params", "errors"),
    [
        ({"before_start": "yesterday"}, {"before_start"}),
        ({"after_end": "2026-11-16T10:30Z"}, {"after_end"}),
        ({"before_end": "2026-11-01"}, {"before_end"}),
        ({"after_start": "", "after_end": ""}, {"after_start", "after_end"}),
        ({"unit": "qpu"}, {"unit"}),
        (
            {"before_start": "2026-13-01", "after_start": "x" * 5000},
            {"before_start", "after_start"},
        ),
    ],
)
def test_bad_parameters_are_a_400_naming_each(
    cast: Cast, params: dict[str, str], errors: set[str]
) -> None:
    response = get(cast, "lead_a", team="alpha", **params)
    assert response.status_code == 400, response.content
    body = response.json()
    assert set(body) == errors
    assert all(isinstance(body[name], list) and body[name][0] for name in errors)


def test_a_missing_window_names_its_parameters(cast: Cast) -> None:
    response = cast.client("operator").get(URL, {"before_start": "2026-11-02"})
    assert response.status_code == 400
    assert set(response.json()) == {"before_end", "after_start", "after_end"}
    assert response.json()["after_end"][0].startswith("required")


def test_csv_errors_are_json(cast: Cast) -> None:
    response = get(cast, "lead_a", team="alpha", before_start="nope", format="csv")
    assert response.status_code == 400
    assert response.json()["before_start"]
    assert get(cast, "lead_a", team="alpha", format="xml").status_code == 406


def test_one_query_for_the_figures(
    usage_of_both: Cast, django_assert_max_num_queries: DjangoAssertNumQueries
) -> None:
    client = usage_of_both.client("operator")
    with django_assert_max_num_queries(4):  # the role (2 groups lookups at most), the figures
        assert client.get(URL, WINDOWS).status_code == 200


def test_listed_in_the_api_root(cast: Cast) -> None:
    root = cast.client("operator").get("/api/v1/").json()
    assert root["compare"].endswith("/api/v1/compare/")


def test_the_browsable_api_shows_it(usage_of_both: Cast) -> None:
    response = usage_of_both.client("operator").get(URL, WINDOWS, HTTP_ACCEPT="text/html")
    assert response.status_code == 200
    assert "Did it help?" in response.content.decode()
