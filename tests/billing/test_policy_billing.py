"""Quota as code, the money side: rate cards and budgets declared in the policy file."""

from __future__ import annotations

import textwrap
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any

import pytest
from django.utils import timezone

from billing.models import Period, RateCard
from billing.rates import RateCardValueError
from billing.services import save_rate_card
from quota.models import Budget
from quota.policy import ApplyReport, PolicyError, apply_policy, load_policy
from teams.models import AuditEntry
from tests.quota.factories import DeviceClassFactory

pytestmark = pytest.mark.django_db

TEAM = """\
teams:
- slug: vision
  name: Vision Research
  budget: {gpuHours: 2000, mode: hard}
"""
H100 = """\
- productName: NVIDIA H100 80GB HBM3
  perGpuHour: "2.50"
  idleFactor: "0.4"
  currency: USD
  from: 2026-01-01
"""
A100_SLICE = """\
- productName: NVIDIA A100-SXM4-80GB
  profile: 3g.40gb
  perGpuHour: 0.7
  currency: EUR
  from: "2026-01-01"
  until: 2027-01-01
"""
POLICY = TEAM + "rates:\n" + H100 + A100_SLICE


@pytest.fixture(autouse=True)
def device_classes() -> None:
    DeviceClassFactory.create(name="gpu.nvidia.com")


def apply_text(text: str, *, prune: bool = False) -> ApplyReport:
    return apply_policy(policy=load_policy(textwrap.dedent(text)), prune=prune, actor="tester")


def errors_of(text: str, *, prune: bool = False) -> list[str]:
    with pytest.raises(PolicyError) as caught:
        apply_text(text, prune=prune)
    return caught.value.errors


def money() -> dict[str, list[tuple[Any, ...]]]:
    """Everything of billing's a policy can touch, and the audit trail."""
    return {
        "rate cards": list(RateCard.objects.order_by("pk").values_list()),
        "budgets": list(Budget.objects.order_by("pk").values_list()),
        "audit": list(AuditEntry.objects.order_by("pk").values_list("pk")),
    }


def close(start: datetime, end: datetime) -> Period:
    return Period.objects.create(start=start, end=end, closed_at=timezone.now(), closed_by="x")


OCTOBER = (datetime(2026, 10, 1, tzinfo=UTC), datetime(2026, 11, 1, tzinfo=UTC))


def test_rates_and_budgets_are_applied_and_audited() -> None:
    report = apply_text(POLICY)

    h100 = RateCard.objects.get(product_name="NVIDIA H100 80GB HBM3")
    assert (h100.profile, h100.per_gpu_hour, h100.idle_factor, h100.currency) == (
        "",
        Decimal("2.5"),
        Decimal("0.4"),
        "USD",
    )
    assert (h100.valid_from, h100.valid_until) == (date(2026, 1, 1), None)
    mig = RateCard.objects.get(profile="3g.40gb")
    assert (mig.per_gpu_hour, mig.idle_factor, mig.currency) == (Decimal("0.7"), 1, "EUR")
    assert (mig.valid_from, mig.valid_until) == (date(2026, 1, 1), date(2027, 1, 1))
    budget = Budget.objects.get(team__slug="vision")
    assert (budget.gpu_hours, budget.mode) == (2000, "hard")
    assert report.summary() == "team: 1 created; budget: 1 created; rate card: 2 created"
    created = AuditEntry.objects.get(object_type="rate card", object_repr__contains="H100")
    assert (created.actor, created.action, created.before) == ("tester", "create", None)
    assert created.after is not None
    assert created.after["per_gpu_hour"] == "2.5000"
    assert created.after["valid_from"] == "2026-01-01"
    budget_entry = AuditEntry.objects.get(object_type="budget")
    assert budget_entry.after is not None
    assert (budget_entry.after["team"], budget_entry.after["gpu_hours"]) == ("vision", "2000.000")


def test_applying_twice_changes_nothing() -> None:
    apply_text(POLICY)
    before = money()

    # The same values written otherwise: a number for a string, more trailing zeros.
    report = apply_text(
        POLICY.replace('"2.50"', "2.5")
        .replace('"0.4"', '"0.4000"')
        .replace("gpuHours: 2000", 'gpuHours: "2000.0"')
    )

    assert not report.changed
    assert report.summary() == "no changes"
    assert money() == before


def test_changes_are_updates_with_before_and_after() -> None:
    apply_text(POLICY)

    report = apply_text(POLICY.replace('"2.50"', '"2.75"').replace("mode: hard", "mode: soft"))

    assert report.summary() == "budget: 1 updated; rate card: 1 updated"
    entry = AuditEntry.objects.get(object_type="rate card", action="update")
    assert entry.before is not None
    assert entry.after is not None
    assert (entry.before["per_gpu_hour"], entry.after["per_gpu_hour"]) == ("2.5000", "2.7500")
    assert Budget.objects.get().mode == "soft"


RATES_BROKEN = """\
teams:
- slug: vision
  name: Vision Research
  budget: {gpuHours: 0, mode: strict}
- slug: nlp
  name: Language Models
  budget: {gpuHours: 1.0005, mode: soft, monthly: 3}
rates:
- productName: NVIDIA H100 80GB HBM3
  perGPUHour: "2.50"
  currency: usd
  from: 2026-13-01
- productName: NVIDIA H100 80GB HBM3
  perGpuHour: "2.12345"
  idleFactor: 1.5
  currency: USD
  from: 2026-06-01
  until: 2026-01-01
- productName: ""
  perGpuHour: cheap
  currency: USD
  from: 2026-01-01T00:00:00Z
- productName: NVIDIA H100 80GB HBM3
  perGpuHour: 0
  currency: USD
  from: 2026-01-01
- just a string
"""


def test_every_error_is_reported_with_its_path_and_nothing_is_applied() -> None:
    apply_text(POLICY)
    before = money()

    errors = errors_of(RATES_BROKEN)

    assert errors == [
        "rates[0]: unknown key 'perGPUHour'",
        "rates[0].perGpuHour: required",
        "rates[0].currency: 'usd' is not an ISO 4217 currency code such as USD, EUR or JPY",
        "rates[0].from: '2026-13-01' is not a date (YYYY-MM-DD)",
        "rates[1].perGpuHour: '2.12345' has more than 4 decimal places",
        "rates[1].idleFactor: 1.5 is not between 0 and 1",
        "rates[1].until: 2026-01-01 is not after from (2026-06-01)",
        "rates[2].productName: must not be empty",
        "rates[2].perGpuHour: 'cheap' is not a number",
        "rates[2].from: must be a date (YYYY-MM-DD), got "
        "datetime.datetime(2026, 1, 1, 0, 0, tzinfo=datetime.timezone.utc)",
        "rates[3].perGpuHour: must be positive, got 0",
        "rates[4]: must be a mapping, got str",
        "teams[0].budget.mode: must be hard or soft, got 'strict'",
        "teams[0].budget.gpuHours: must be positive, got 0",
        "teams[1].budget: unknown key 'monthly'",
        "teams[1].budget.gpuHours: 1.0005 has more than 3 decimal places",
    ]
    assert money() == before


def test_overlapping_entries_name_both() -> None:
    text = POLICY + H100.replace("2026-01-01", "2026-07-01") + H100.replace("USD", "EUR")

    errors = errors_of(text)

    assert errors == [
        "rates[2]: valid from 2026-07-01 on, which overlaps rates[0] (valid from 2026-01-01 on) "
        "for the same productName and profile (one price a day, in any currency)",
        "rates[3]: valid from 2026-01-01 on, which overlaps rates[0] (valid from 2026-01-01 on) "
        "for the same productName and profile (one price a day, in any currency)",
        "rates[3]: valid from 2026-01-01 on, which overlaps rates[2] (valid from 2026-07-01 on) "
        "for the same productName and profile (one price a day, in any currency)",
    ]
    # Ending the first where the second begins is a change of price, not an overlap.
    apply_text(
        POLICY.replace("  from: 2026-01-01\n", "  from: 2026-01-01\n  until: 2026-07-01\n", 1)
        + H100.replace("2026-01-01", "2026-07-01")
    )
    assert RateCard.objects.filter(product_name="NVIDIA H100 80GB HBM3").count() == 2


def test_a_closed_period_keeps_its_rates() -> None:
    apply_text(POLICY)
    close(*OCTOBER)
    close(datetime(2026, 9, 1, tzinfo=UTC), datetime(2026, 10, 1, tzinfo=UTC))
    before = money()

    errors = errors_of(
        POLICY.replace('"2.50"', '"3.00"').replace("until: 2027-01-01", "until: 2026-10-15")
        + H100.replace("2026-01-01", "2026-10-20")
        .replace("USD", "CHF")
        .replace("H100 80GB HBM3", "H200")
    )

    assert errors == [
        "rates[0]: the rate for NVIDIA H100 80GB HBM3 (USD) from 2026-01-01 was used by the "
        "closed periods 2026-09, 2026-10; add a new entry from a later date instead",
        "rates[1]: the rate for NVIDIA A100-SXM4-80GB 3g.40gb (EUR) from 2026-01-01 was used "
        "by the closed periods 2026-09, 2026-10; add a new entry from a later date instead",
        "rates[2]: the rate for NVIDIA H200 (CHF) from 2026-10-20 would price the "
        "closed period 2026-10; start it on 2026-11-01 or later",
    ]
    assert money() == before


def test_a_used_rate_is_ended_and_followed_by_a_new_one() -> None:
    apply_text(POLICY)
    close(*OCTOBER)

    # The closed period still sees the same price on the same days: allowed.
    report = apply_text(
        POLICY.replace("  from: 2026-01-01\n", "  from: 2026-01-01\n  until: 2026-11-01\n", 1)
        + H100.replace("2026-01-01", "2026-11-01").replace('"2.50"', '"3.00"')
    )

    assert report.summary() == "rate card: 1 created, 1 updated"
    prices = RateCard.objects.filter(product_name="NVIDIA H100 80GB HBM3").order_by("valid_from")
    assert [(card.valid_until, card.per_gpu_hour) for card in prices] == [
        (date(2026, 11, 1), Decimal("2.5")),
        (None, Decimal("3")),
    ]


def test_prune_deletes_rates_no_longer_declared_but_not_used_ones() -> None:
    apply_text(POLICY)

    report = apply_text(TEAM + "rates:\n" + H100)
    assert "rate card" not in report.counts
    assert any(note.startswith("kept rate card NVIDIA A100") for note in report.notes)

    close(*OCTOBER)
    before = money()
    assert errors_of(TEAM + "rates:\n" + H100, prune=True) == [
        "rates: not declared, but the rate for NVIDIA A100-SXM4-80GB 3g.40gb (EUR) from "
        "2026-01-01 was used by the closed period 2026-10; it is never deleted"
    ]
    assert money() == before

    Period.objects.update(closed_at=None)
    apply_text(TEAM + "rates:\n" + H100, prune=True)
    assert list(RateCard.objects.values_list("currency", flat=True)) == ["USD"]
    deleted = AuditEntry.objects.get(object_type="rate card", action="delete")
    assert deleted.before is not None
    assert (deleted.before["profile"], deleted.after) == ("3g.40gb", None)


def test_without_a_rates_key_rate_cards_are_not_the_files() -> None:
    apply_text(POLICY)

    report = apply_text(TEAM, prune=True)

    assert RateCard.objects.count() == 2
    assert "rates: not declared, so the rate cards are not this file's: --prune keeps them" in (
        report.notes
    )


def test_budgets_are_removed_only_with_prune() -> None:
    apply_text(POLICY)
    without = POLICY.replace("  budget: {gpuHours: 2000, mode: hard}\n", "")

    report = apply_text(without)
    assert Budget.objects.exists()
    assert "kept budget vision: 2000 GPU-hours (hard): not declared (--prune deletes it)" in (
        report.notes
    )

    report = apply_text(without, prune=True)
    assert not Budget.objects.exists()
    assert report.summary() == "budget: 1 deleted"
    entry = AuditEntry.objects.get(object_type="budget", action="delete")
    assert entry.before is not None
    assert entry.before["gpu_hours"] == "2000.000"


def test_closed_periods_are_named_as_the_commands_name_them(settings: Any) -> None:
    """A closed week is `2026-W42` and a closed month `2026-09`, whatever the period length
    configured now (a month stored before billing turned weekly keeps its name)."""
    settings.TALLY_BILLING_PERIOD = "week"
    apply_text(POLICY)
    close(datetime(2026, 9, 1, tzinfo=UTC), datetime(2026, 10, 1, tzinfo=UTC))
    close(datetime(2026, 10, 12, tzinfo=UTC), datetime(2026, 10, 19, tzinfo=UTC))

    assert errors_of(POLICY.replace('"2.50"', '"3.00"')) == [
        "rates[0]: the rate for NVIDIA H100 80GB HBM3 (USD) from 2026-01-01 was used by the "
        "closed periods 2026-09, 2026-W42; add a new entry from a later date instead",
    ]


# One bad value each, as the policy file writes it and as RateCard's field holds it.
BAD_RATE_VALUES = [
    ("until", "2025-12-01", "valid_until", date(2025, 12, 1)),
    ("currency", "usd", "currency", "usd"),
    ("perGpuHour", '"-3"', "per_gpu_hour", Decimal(-3)),
    ("idleFactor", "5", "idle_factor", Decimal(5)),
    ("profile", "bogus profile", "profile", "bogus profile"),
    ("productName", '""', "product_name", ""),
]


@pytest.mark.parametrize(("key", "text", "field", "value"), BAD_RATE_VALUES)
def test_the_policy_file_and_the_service_refuse_the_same_rate_values(
    key: str, text: str, field: str, value: object
) -> None:
    """The policy file, `save_rate_card` (the admin's and every other writer's) apply one rule
    set, `rate_card_value_errors`: same values refused, same message, under each one's name."""
    good = {
        "productName": "NVIDIA H100 80GB HBM3",
        "perGpuHour": '"2.50"',
        "currency": "USD",
        "from": "2026-01-01",
    }
    entry = "\n".join(f"  {name}: {shown}" for name, shown in {**good, key: text}.items())
    policy_errors = errors_of(TEAM + "rates:\n-" + entry[1:] + "\n")

    with pytest.raises(RateCardValueError) as raised:
        save_rate_card(
            card=None,
            values={
                "product_name": "NVIDIA H100 80GB HBM3",
                "per_gpu_hour": Decimal("2.50"),
                "currency": "USD",
                "valid_from": date(2026, 1, 1),
                field: value,
            },
            actor="tester",
        )

    ((service_field, message),) = raised.value.errors.items()
    assert service_field == field
    assert policy_errors == [f"rates[0].{key}: {message}"]
    assert str(raised.value) == f"{field}: {message}"
    assert not RateCard.objects.exists()
    assert not AuditEntry.objects.filter(object_type="rate card").exists()
