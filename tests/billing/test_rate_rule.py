"""The rate-card rule, once (issue 37): `billing.pricing.RateCards` chooses the card that
prices a model's hour on a day; `rate_for` (the alerts' one card) asks it instead of a query
of its own, so the two cannot disagree."""

from __future__ import annotations

import inspect
from datetime import date, timedelta
from decimal import Decimal
from typing import Any

import pytest

from billing import pricing
from billing.models import RateCard
from billing.pricing import RateCards, rate_for

pytestmark = pytest.mark.django_db

DAY = date(2026, 11, 30)


def _card(profile: str, valid_from: date, price: str, **extra: object) -> RateCard:
    card: RateCard = RateCard.objects.create(
        product_name="NVIDIA H100",
        profile=profile,
        per_gpu_hour=Decimal(price),
        currency=str(extra.pop("currency", "USD")),
        valid_from=valid_from,
        **extra,
    )
    return card


def test_the_rule_and_rate_for_agree_on_every_case() -> None:
    old = _card("", DAY - timedelta(days=30), "2.00")
    gpu = _card("", DAY - timedelta(days=1), "2.50")
    _card("", DAY + timedelta(days=1), "3.00")  # not in force yet
    ended = _card("1g.10gb", DAY - timedelta(days=10), "0.50", valid_until=DAY)
    slice_card = _card("3g.40gb", DAY - timedelta(days=2), "1.20")
    # Two cards from the same day in two currencies: the one written last.
    _card("2g.20gb", DAY, "0.80")
    euro = _card("2g.20gb", DAY, "0.75", currency="EUR")
    cards = RateCards(first_day=DAY - timedelta(days=30), last_day=DAY + timedelta(days=1))
    cases = {
        ("", DAY): gpu,  # the newest in force
        ("", DAY - timedelta(days=5)): old,
        ("3g.40gb", DAY): slice_card,  # the profile's own card
        ("1g.10gb", DAY): gpu,  # its own card ended (valid_until is exclusive): the GPU's
        ("1g.10gb", DAY - timedelta(days=1)): ended,
        ("2g.20gb", DAY): euro,
        ("7g.80gb", DAY): gpu,  # no card of its own
    }
    for (profile, day), expected in cases.items():
        assert cards.on("NVIDIA H100", profile, day) == expected, (profile, day)
        assert rate_for("NVIDIA H100", profile, day) == expected, (profile, day)
    assert rate_for("NVIDIA A100", "", DAY) is None
    assert rate_for("NVIDIA H100", "", DAY - timedelta(days=31)) is None


def test_rate_for_has_no_rule_of_its_own(django_assert_num_queries: Any) -> None:
    _card("", DAY, "2.50")
    source = inspect.getsource(pricing.rate_for)
    assert "RateCards(" in source and "order_by" not in source
    with django_assert_num_queries(1):
        assert rate_for("NVIDIA H100", "3g.40gb", DAY) is not None
