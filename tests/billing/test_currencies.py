"""Money is kept in ISO 4217 currencies only (issue 33, finding 7): a rate card or an
adjustment in any three letters made statements in "NAN"."""

from __future__ import annotations

import textwrap
from datetime import UTC, date, datetime
from decimal import Decimal

import pytest

from billing.models import Statement
from billing.periods import PricingError
from billing.pricing import period_for
from billing.rates import RateCardValueError, rate_card_value_errors
from billing.services import add_adjustment, save_rate_card
from quota.policy import PolicyError, apply_policy, load_policy
from teams.models import Team

pytestmark = pytest.mark.django_db

CARD = {
    "product_name": "NVIDIA H100 80GB HBM3",
    "profile": "",
    "valid_from": date(2026, 1, 1),
    "valid_until": None,
    "per_gpu_hour": Decimal("2.50"),
    "idle_factor": Decimal("0.4"),
}


@pytest.mark.parametrize("code", ["USD", "EUR", "JPY", "KWD", "CHF"])
def test_iso_4217_currencies_are_taken(code: str) -> None:
    assert rate_card_value_errors({**CARD, "currency": code}) == {}


@pytest.mark.parametrize("code", ["NAN", "ABC", "QQQ", "XXX", "usd", "EURO"])
def test_other_codes_are_refused_on_rate_cards(code: str) -> None:
    errors = rate_card_value_errors({**CARD, "currency": code})
    assert "is not an ISO 4217 currency code" in errors["currency"]
    with pytest.raises(RateCardValueError):
        save_rate_card(card=None, values={**CARD, "currency": code}, actor="ops", closed=[])


def test_the_policy_file_refuses_a_rate_in_no_currency() -> None:
    text = """\
    rates:
    - productName: NVIDIA H100 80GB HBM3
      perGpuHour: "2.50"
      currency: NAN
      from: 2026-01-01
    """
    with pytest.raises(PolicyError) as caught:
        apply_policy(policy=load_policy(textwrap.dedent(text)), prune=False, actor="ops")
    assert any("'NAN' is not an ISO 4217 currency code" in error for error in caught.value.errors)


def test_an_adjustment_in_no_currency_is_refused_and_makes_no_statement() -> None:
    team = Team.objects.create(slug="nlp", name="NLP")
    period = period_for(datetime(2026, 12, 1, tzinfo=UTC))
    with pytest.raises(PricingError, match="'NAN' is not an ISO 4217 currency code"):
        add_adjustment(
            team=team, period=period, currency="nan", amount=Decimal(5), reason="x", actor="fin"
        )
    assert not Statement.objects.exists()
    line = add_adjustment(
        team=team, period=period, currency="eur", amount=Decimal(5), reason="x", actor="fin"
    )
    assert line.statement.currency == "EUR"
