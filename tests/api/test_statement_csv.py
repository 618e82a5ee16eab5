"""The statement CSV (issue 35, item 9): the portal's download and the API's `?format=csv` of a
statement come from one writer (`billing.statement_csv`) and give the same bytes."""

from __future__ import annotations

import csv
import io
from decimal import Decimal

from django.test import Client
from django.urls import reverse

from billing.models import Statement
from billing.statement_csv import STATEMENT_CSV_COLUMNS
from tests.api.cast import Seeded


def test_the_portal_and_the_api_give_the_same_statement_csv(seeded: Seeded) -> None:
    statement = Statement.objects.get(team=seeded.cast.alpha, period=seeded.last)
    assert Statement.objects.filter(team=seeded.cast.alpha, period=seeded.last).count() == 1
    api = seeded.cast.client("finance").get(
        f"/api/v1/statements/{statement.pk}/", {"format": "csv"}
    )
    portal = Client()
    portal.force_login(seeded.cast.finance)
    page = portal.get(reverse("statement-csv", args=["alpha", seeded.last.pk]))
    assert api.status_code == page.status_code == 200
    assert api["Content-Type"] == page["Content-Type"] == "text/csv; charset=utf-8"
    assert api.content == page.content
    rows = list(csv.DictReader(io.StringIO(api.content.decode())))
    assert tuple(rows[0]) == STATEMENT_CSV_COLUMNS
    assert {row["team"] for row in rows} == {"alpha"}
    assert {row["period_label"] for row in rows} == {seeded.last.label}
    # The amounts add up to the statement's total, to the cent.
    assert sum(Decimal(row["amount"]) for row in rows) == statement.total
    assert api["Content-Disposition"] == (
        f'attachment; filename="tally-alpha-{seeded.last.label}-{statement.currency}.csv"'
    )


def test_the_statement_json_is_unchanged_by_the_csv(seeded: Seeded) -> None:
    statement = Statement.objects.get(team=seeded.cast.alpha, period=seeded.last)
    detail = seeded.cast.client("finance").get(f"/api/v1/statements/{statement.pk}/")
    assert detail.status_code == 200
    assert detail.json()["lines"] and detail.json()["team"] == "alpha"


def test_another_teams_statement_csv_is_not_found(seeded: Seeded) -> None:
    statement = Statement.objects.get(team=seeded.cast.alpha, period=seeded.last)
    response = seeded.cast.client("lead_b").get(
        f"/api/v1/statements/{statement.pk}/", {"format": "csv"}
    )
    assert response.status_code == 404
