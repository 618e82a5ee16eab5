"""The two writes: closing a period and adding an adjustment (finance and operators only)."""

from __future__ import annotations

from decimal import Decimal

import pytest

from billing.models import LineKind, Period, StatementLine
from teams.models import AuditEntry
from tests.api.cast import Seeded

pytestmark = pytest.mark.django_db


def close_url(period: Period) -> str:
    return f"/api/v1/periods/{period.pk}/close/"


@pytest.mark.parametrize("who", ["finance", "operator"])
def test_finance_and_operators_close_an_ended_period(seeded: Seeded, who: str) -> None:
    response = seeded.cast.client(who).post(close_url(seeded.last))
    assert response.status_code == 200, response.content
    actor = getattr(seeded.cast, who).username
    assert response.json()["is_closed"] is True
    assert response.json()["closed_by"] == actor
    seeded.last.refresh_from_db()
    assert seeded.last.is_closed
    entry = AuditEntry.objects.get(action="update", object_type="period")
    assert entry.actor == actor
    assert entry.before is not None
    assert entry.after is not None
    assert entry.before["closed_at"] is None
    assert entry.after["closed_by"] == actor


@pytest.mark.parametrize(("who", "status"), [("lead_a", 403), ("member_a", 403), (None, 401)])
def test_others_cannot_close(seeded: Seeded, who: str | None, status: int) -> None:
    assert seeded.cast.client(who).post(close_url(seeded.last)).status_code == status
    seeded.last.refresh_from_db()
    assert not seeded.last.is_closed
    assert not AuditEntry.objects.filter(object_type="period").exists()


def test_closing_an_open_or_closed_period_is_a_400_with_the_reason(seeded: Seeded) -> None:
    finance = seeded.cast.client("finance")
    running = finance.post(close_url(seeded.current))
    assert running.status_code == 400
    assert running.json() == {"detail": f"period {seeded.current} has not ended yet"}
    again = finance.post(close_url(seeded.closed))
    assert again.status_code == 400
    assert "already closed" in again.json()["detail"]
    assert finance.post("/api/v1/periods/999999/close/").status_code == 404
    assert not AuditEntry.objects.filter(object_type="period").exists()


def adjustment(seeded: Seeded, **overrides: object) -> dict[str, object]:
    return {
        "team": "alpha",
        "period": seeded.current.pk,
        "currency": "eur",
        "amount": "-12.345",
        "reason": "credit for the outage",
        **overrides,
    }


def test_finance_adds_an_adjustment(seeded: Seeded) -> None:
    response = seeded.cast.client("finance").post(
        "/api/v1/adjustments/", adjustment(seeded, product_name="NVIDIA H100 80GB HBM3"), "json"
    )
    assert response.status_code == 201, response.content
    line = response.json()
    assert line["team"] == "alpha"
    assert line["currency"] == "EUR"
    assert line["amount"] == "-12.35"
    assert line["kind"] == LineKind.ADJUSTMENT
    assert line["created_by"] == "fin"
    stored = StatementLine.objects.get(pk=line["id"])
    assert stored.statement.total == Decimal("-12.35")
    entry = AuditEntry.objects.filter(action="create").latest("pk")  # the seed audits one
    assert entry.object_type == "statement line"
    assert entry.actor == "fin"
    assert entry.after is not None
    assert entry.after["reason"] == "credit for the outage"


@pytest.mark.parametrize(
    ("who", "status"), [("lead_a", 403), ("lead_b", 403), ("member_a", 403), (None, 401)]
)
def test_only_finance_and_operators_add_adjustments(
    seeded: Seeded, who: str | None, status: int
) -> None:
    before = StatementLine.objects.count()
    response = seeded.cast.client(who).post("/api/v1/adjustments/", adjustment(seeded), "json")
    assert response.status_code == status
    assert StatementLine.objects.count() == before


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"reason": "   "}, "reason"),
        ({"reason": None}, "reason"),
        ({"team": "nope"}, "team"),
        ({"team": "al\x00pha"}, "team"),
        ({"period": 999999}, "period"),
        ({"currency": "EURO"}, "currency"),
        ({"amount": "0"}, "amount"),
        ({"amount": "NaN"}, "amount"),
    ],
)
def test_adjustment_input_is_validated(seeded: Seeded, overrides: dict, field: str) -> None:
    response = seeded.cast.client("operator").post(
        "/api/v1/adjustments/", adjustment(seeded, **overrides), "json"
    )
    assert response.status_code == 400
    assert field in response.json()


def test_no_adjustment_in_a_closed_period(seeded: Seeded) -> None:
    response = seeded.cast.client("finance").post(
        "/api/v1/adjustments/", adjustment(seeded, period=seeded.closed.pk), "json"
    )
    assert response.status_code == 400
    assert "is closed" in response.json()["detail"]


def test_read_only_endpoints_refuse_writes(seeded: Seeded) -> None:
    operator = seeded.cast.client("operator")
    assert operator.post("/api/v1/teams/", {"slug": "x", "name": "x"}).status_code == 405
    assert operator.patch("/api/v1/teams/alpha/", {"name": "x"}).status_code == 405
    assert operator.post("/api/v1/rate-cards/", {"per_gpu_hour": "0"}).status_code == 405
    assert operator.post("/api/v1/quotas/", {"limit": "100"}).status_code == 405
    assert operator.delete(f"/api/v1/periods/{seeded.last.pk}/").status_code == 405
