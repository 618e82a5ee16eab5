"""Billing admin: every changelist opens, periods close by their action, services' rows are
read-only, rate card and budget edits are audited and keep closed periods' prices."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

import pytest
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.db.models import Model
from django.http import HttpRequest
from django.test import Client, RequestFactory
from django.urls import reverse
from django.utils import timezone

from billing.models import Period, RateCard, Statement
from billing.periods import period_bounds
from metering.models import AgentToken, Sample, UnknownDeviceSample, UsageHour
from quota.models import Budget
from teams.models import AuditEntry
from tests.quota.factories import TeamFactory

pytestmark = pytest.mark.django_db

MODELS = (
    "metering_agenttoken",
    "metering_sample",
    "metering_unknowndevicesample",
    "metering_dirtyhour",
    "metering_usagehour",
    "billing_ratecard",
    "billing_period",
    "billing_statement",
)


@pytest.fixture
def ops_client() -> Client:
    user = get_user_model().objects.create_superuser("ops-admin", "ops@example.com", "x")
    client = Client()
    client.force_login(user)
    return client


def rate_card(**changes: object) -> RateCard:
    values: dict[str, object] = {
        "product_name": "NVIDIA H100 80GB HBM3",
        "per_gpu_hour": Decimal("2.5"),
        "currency": "USD",
        "valid_from": date(2026, 1, 1),
        **changes,
    }
    return RateCard.objects.create(**values)


@pytest.mark.parametrize("model", MODELS)
def test_changelists_open(ops_client: Client, model: str) -> None:
    response = ops_client.get(reverse(f"admin:{model}_changelist"))
    assert response.status_code == 200


def superuser_request() -> HttpRequest:
    request = RequestFactory().get("/admin/")
    request.user = get_user_model().objects.create_superuser("root", "root@example.com", "x")
    return request


@pytest.mark.parametrize("model", [Sample, UnknownDeviceSample, UsageHour, AgentToken, Statement])
def test_service_tables_cannot_be_added_to_changed_or_deleted(model: type[Model]) -> None:
    model_admin = admin.site._registry[model]
    request = superuser_request()
    assert not model_admin.has_add_permission(request)
    assert not model_admin.has_change_permission(request)
    assert not model_admin.has_delete_permission(request)


def close_action(client: Client, period: Period) -> list[str]:
    response = client.post(
        reverse("admin:billing_period_changelist"),
        {"action": "close", "_selected_action": [period.pk]},
        follow=True,
    )
    assert response.status_code == 200
    return [str(message) for message in response.context["messages"]]


def test_close_period_closes_an_ended_period(ops_client: Client) -> None:
    start, end = period_bounds(timezone.now() - timedelta(days=40))
    period = Period.objects.create(start=start, end=end)

    messages = close_action(ops_client, period)

    period.refresh_from_db()
    assert period.is_closed
    assert period.closed_by == "ops-admin"
    assert messages == [f"Closed period {period.label}: 0 statement(s) frozen."]


def test_close_period_refuses_the_current_period(ops_client: Client) -> None:
    start, end = period_bounds(timezone.now())
    period = Period.objects.create(start=start, end=end)

    messages = close_action(ops_client, period)

    period.refresh_from_db()
    assert not period.is_closed
    assert messages == [
        f"period {period.label} has not ended yet: it ends {period.end:%Y-%m-%d} 00:00 UTC"
    ]


def rate_form(card: RateCard, **changes: object) -> dict[str, object]:
    return {
        "product_name": card.product_name,
        "profile": card.profile,
        "currency": card.currency,
        "valid_from": card.valid_from.isoformat(),
        "valid_until": card.valid_until.isoformat() if card.valid_until else "",
        "per_gpu_hour": str(card.per_gpu_hour),
        "idle_factor": str(card.idle_factor),
        **changes,
    }


def test_rate_card_edit_is_audited(ops_client: Client) -> None:
    card = rate_card()
    url = reverse("admin:billing_ratecard_change", args=[card.pk])

    response = ops_client.post(url, rate_form(card, per_gpu_hour="2.75"))

    assert response.status_code == 302, response.content
    entry = AuditEntry.objects.get()
    assert (entry.actor, entry.action, entry.object_type) == ("ops-admin", "update", "rate card")
    assert entry.before is not None
    assert entry.after is not None
    assert (entry.before["per_gpu_hour"], entry.after["per_gpu_hour"]) == ("2.5000", "2.7500")


def test_a_rate_card_a_closed_period_used_keeps_its_price(ops_client: Client) -> None:
    card = rate_card()
    Period.objects.create(
        start=datetime(2026, 10, 1, tzinfo=UTC),
        end=datetime(2026, 11, 1, tzinfo=UTC),
        closed_at=timezone.now(),
    )
    url = reverse("admin:billing_ratecard_change", args=[card.pk])

    response = ops_client.post(url, rate_form(card, per_gpu_hour="2.75"))

    assert response.status_code == 200
    assert "was used by the closed period 2026-10" in response.content.decode()
    card.refresh_from_db()
    assert card.per_gpu_hour == Decimal("2.5")
    assert not admin.site._registry[RateCard].has_delete_permission(superuser_request(), card)
    # Ending it after the closed period leaves that period's price alone.
    response = ops_client.post(url, rate_form(card, valid_until="2026-11-01"))
    assert response.status_code == 302, response.content


def test_budget_edit_is_audited(ops_client: Client) -> None:
    team = TeamFactory.create(slug="vision")

    response = ops_client.post(
        reverse("admin:quota_budget_add"),
        {"team": team.pk, "gpu_hours": "100", "mode": "hard", "unit": "gpu"},
    )

    assert response.status_code == 302, response.content
    assert Budget.objects.get().gpu_hours == 100
    entry = AuditEntry.objects.get()
    assert (entry.actor, entry.action, entry.object_type) == ("ops-admin", "create", "budget")


@pytest.mark.parametrize(
    ("changes", "field", "message"),
    [
        ({"valid_until": "2025-12-01"}, "valid_until", "2025-12-01 is not after from (2026-01-01)"),
        (
            {"currency": "usd"},
            "currency",
            "'usd' is not an ISO 4217 currency code such as USD, EUR or JPY",
        ),
        ({"per_gpu_hour": "-3"}, "per_gpu_hour", "must be positive, got -3"),
        ({"per_gpu_hour": "0"}, "per_gpu_hour", "must be positive, got 0"),
        ({"idle_factor": "5"}, "idle_factor", "5 is not between 0 and 1"),
        (
            {"profile": "bogus profile"},
            "profile",
            "'bogus profile' is not a device profile such as 3g.40gb (one word)",
        ),
    ],
)
def test_a_new_rate_card_with_bad_values_is_refused_on_its_field(
    ops_client: Client, changes: dict[str, str], field: str, message: str
) -> None:
    template = RateCard(
        product_name="NVIDIA H100 80GB HBM3",
        per_gpu_hour=Decimal("2.5"),
        idle_factor=Decimal(1),
        currency="USD",
        valid_from=date(2026, 1, 1),
    )

    response = ops_client.post(
        reverse("admin:billing_ratecard_add"), rate_form(template, **changes)
    )

    assert response.status_code == 200
    errors = response.context["adminform"].form.errors
    assert errors == {field: [message]}
    assert not RateCard.objects.exists()
    assert not AuditEntry.objects.exists()
