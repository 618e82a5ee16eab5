"""Billing's writes as services: each checks, locks and audits itself, whoever calls it."""

from __future__ import annotations

import threading
import time
from datetime import UTC, date, datetime
from decimal import Decimal

import pytest
from django.contrib.auth import get_user_model
from django.db import connection, transaction
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from billing import services
from billing.models import Period, RateCard, Statement, StatementLine
from billing.periods import PricingError
from billing.rates import closed_periods
from teams.models import AuditEntry, Team

pytestmark = pytest.mark.django_db

H100 = "NVIDIA H100 80GB HBM3"
CARD = {
    "product_name": H100,
    "profile": "",
    "currency": "USD",
    "valid_from": date(2026, 1, 1),
    "valid_until": None,
    "per_gpu_hour": Decimal("2.5000"),
    "idle_factor": Decimal("1.0000"),
}


@pytest.fixture
def closed_october() -> Period:
    return Period.objects.create(
        start=datetime(2026, 10, 1, tzinfo=UTC),
        end=datetime(2026, 11, 1, tzinfo=UTC),
        closed_at=timezone.now(),
        closed_by="finance",
    )


def test_a_rate_card_is_created_changed_and_deleted_with_an_audit_entry_each() -> None:
    created = services.save_rate_card(card=None, values=CARD, actor="fin")
    assert created.entry is not None and created.entry.action == "create"
    card = RateCard.objects.get()
    assert card.per_gpu_hour == Decimal("2.5")
    changed = services.save_rate_card(
        card=card, values={**CARD, "per_gpu_hour": Decimal("3")}, actor="fin"
    )
    assert changed.entry is not None
    assert changed.entry.before is not None and changed.entry.after is not None
    assert (changed.entry.before["per_gpu_hour"], changed.entry.after["per_gpu_hour"]) == (
        "2.5000",
        "3.0000",
    )
    # The same values again change nothing, and audit nothing.
    again = services.save_rate_card(
        card=changed.card, values={**CARD, "per_gpu_hour": Decimal("3.0")}, actor="fin"
    )
    assert again.entry is None
    entry = services.delete_rate_card(card=card, actor="fin")
    assert entry.action == "delete"
    assert not RateCard.objects.exists()
    assert list(AuditEntry.objects.values_list("action", flat=True).order_by("pk")) == [
        "create",
        "update",
        "delete",
    ]


def test_a_rate_card_a_closed_period_used_is_neither_repriced_nor_deleted(
    closed_october: Period,
) -> None:
    card = RateCard.objects.create(**CARD)
    with pytest.raises(PricingError, match="was used by the closed period 2026-10"):
        services.save_rate_card(
            card=card, values={**CARD, "idle_factor": Decimal("0.5")}, actor="x"
        )
    with pytest.raises(PricingError, match="it is never deleted"):
        services.delete_rate_card(card=card, actor="x")
    with pytest.raises(PricingError, match="would price the closed period 2026-10"):
        services.save_rate_card(
            card=None,
            values={**CARD, "currency": "EUR", "valid_from": date(2026, 10, 20)},
            actor="x",
        )
    # The closed periods as a caller read them, locked, serve the same check.
    with pytest.raises(PricingError):
        services.delete_rate_card(card=card, actor="x", closed=closed_periods(lock=True))
    card.refresh_from_db()
    assert card.idle_factor == Decimal(1)
    assert not AuditEntry.objects.exists()


def test_an_adjustment_is_audited_and_refused_in_a_closed_period(closed_october: Period) -> None:
    team = Team.objects.create(slug="vision", name="Vision")
    november = Period.objects.create(
        start=datetime(2026, 11, 1, tzinfo=UTC), end=datetime(2026, 12, 1, tzinfo=UTC)
    )
    line = services.add_adjustment(
        team=team, period=november, currency="usd", amount=Decimal("-1.005"), reason="x", actor="f"
    )
    assert line.amount == Decimal("-1.01")  # half away from zero, to the cent
    assert Statement.objects.get().total == Decimal("-1.01")
    entry = AuditEntry.objects.get()
    assert (entry.actor, entry.action, entry.object_type) == ("f", "create", "statement line")
    with pytest.raises(PricingError, match="is closed"):
        services.add_adjustment(
            team=team,
            period=closed_october,
            currency="USD",
            amount=Decimal(1),
            reason="x",
            actor="f",
        )
    with pytest.raises(PricingError, match="needs a reason"):
        services.add_adjustment(
            team=team, period=november, currency="USD", amount=Decimal(1), reason=" ", actor="f"
        )
    assert StatementLine.objects.count() == AuditEntry.objects.count() == 1


def test_a_period_closes_once_audited(closed_october: Period) -> None:
    september = Period.objects.create(
        start=datetime(2026, 9, 1, tzinfo=UTC), end=datetime(2026, 10, 1, tzinfo=UTC)
    )
    assert services.close_period(period=september, actor="finance") == []
    assert september.is_closed  # refreshed
    entry = AuditEntry.objects.get()
    assert entry.before is not None and entry.after is not None
    assert (entry.before["closed_by"], entry.after["closed_by"]) == ("", "finance")
    with pytest.raises(PricingError, match="already closed"):
        services.close_period(period=september, actor="finance")
    assert AuditEntry.objects.count() == 1


def test_the_admin_saves_and_deletes_rate_cards_through_the_services() -> None:
    user = get_user_model().objects.create_superuser("ops-admin", "ops@example.com", "x")
    client = Client()
    client.force_login(user)
    form = {**CARD, "valid_from": "2026-01-01", "valid_until": ""}
    response = client.post(reverse("admin:billing_ratecard_add"), form)
    assert response.status_code == 302, response.content
    card = RateCard.objects.get()
    assert response["Location"] == reverse("admin:billing_ratecard_changelist")
    response = client.post(
        reverse("admin:billing_ratecard_delete", args=[card.pk]), {"post": "yes"}
    )
    assert response.status_code == 302, response.content
    assert not RateCard.objects.exists()
    assert list(AuditEntry.objects.values_list("actor", "action").order_by("pk")) == [
        ("ops-admin", "create"),
        ("ops-admin", "delete"),
    ]


def test_a_rate_card_overlapping_another_is_refused_naming_it() -> None:
    services.save_rate_card(
        card=None, values={**CARD, "valid_until": date(2026, 7, 1)}, actor="fin"
    )
    # Another currency is no way round it: a GPU-hour has one price a day.
    euros = {**CARD, "currency": "EUR", "valid_from": date(2026, 6, 1)}
    with pytest.raises(PricingError, match=r"overlaps the rate card .*2026-01-01 until 2026-07-01"):
        services.save_rate_card(card=None, values=euros, actor="fin")
    assert RateCard.objects.count() == 1
    # From the day the first one ends, it is fine.
    services.save_rate_card(
        card=None, values={**euros, "valid_from": date(2026, 7, 1)}, actor="fin"
    )
    assert RateCard.objects.count() == 2


@pytest.mark.django_db(transaction=True)
def test_two_writers_racing_with_overlapping_cards_store_one() -> None:
    """Each writer checks for overlaps while the other waits: without the lock both saw no
    card and both stored theirs."""
    start = threading.Barrier(2)
    stored: list[str] = []
    refused: list[str] = []
    errors: list[BaseException] = []

    def write(currency: str) -> None:
        try:
            with transaction.atomic():
                start.wait(timeout=10)
                services.save_rate_card(
                    card=None, values={**CARD, "currency": currency}, actor="fin"
                )
                time.sleep(0.3)  # the other writer's check runs meanwhile, or waits
            stored.append(currency)
        except PricingError as exc:
            refused.append(str(exc))
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=write, args=(c,)) for c in ("USD", "EUR")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors
    assert len(stored) == 1 and len(refused) == 1, (stored, refused)
    assert list(RateCard.objects.values_list("currency", flat=True)) == stored
