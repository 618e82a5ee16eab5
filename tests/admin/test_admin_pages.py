"""The admin as operators read it: branded Tally, memory in binary units and money to the cent
(exact figures stay in the inputs, the API and the exports), and a rate card that overlaps
another of its model refused as the policy file refuses it."""

from __future__ import annotations

import re
from datetime import date
from decimal import Decimal
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse

from billing.models import RateCard
from teams.models import AuditEntry
from tests.admin.conftest import Seeded

pytestmark = pytest.mark.django_db

H100 = "NVIDIA H100 80GB HBM3"


def _text(html: bytes) -> str:
    """The page's text, tags dropped and spaces collapsed."""
    return " ".join(re.sub(r"<[^>]+>", " ", html.decode()).split())


def test_the_admin_is_branded_tally(ops_client: Client) -> None:
    page = ops_client.get(reverse("admin:index")).content.decode()
    assert "Django administration" not in page
    assert "Django site admin" not in page
    assert "<title>Teams, quotas, inventory and billing | Tally admin</title>" in page
    assert ">Tally administration</a>" in page


def test_memory_reads_in_binary_units_and_edits_exactly(ops_client: Client, seeded: Seeded) -> None:
    team_page = ops_client.get(reverse("admin:teams_team_change", args=[seeded.team.pk]))
    html = team_page.content.decode()
    assert "2199023255552.000000" not in html
    assert 'value="2199023255552"' in html  # the exact byte count, to edit
    text = _text(team_page.content)
    assert "= 2 TiB" in text
    assert "640 GiB" in text  # in use
    rules = _text(ops_client.get(reverse("admin:quota_quotarule_changelist")).content)
    assert "2 TiB 640 GiB" in rules
    assert "2199023255552" not in rules
    # The API keeps the exact figures.
    assert seeded.memory_rule.limit == Decimal(2 * 2**40)


def test_money_reads_to_the_cent_with_its_currency(ops_client: Client, seeded: Seeded) -> None:
    listed = _text(ops_client.get(reverse("admin:billing_statement_changelist")).content)
    assert "1,388.89 USD" in listed
    assert "1388.890" not in listed.replace("1388.890 USD", "")  # (the object's name aside)
    page = ops_client.get(reverse("admin:billing_statement_change", args=[seeded.statement.pk]))
    assert "Total: 1,388.89 USD" in _text(page.content)
    cells = _cells(page.content)
    assert set(cells["amount_shown"]) == {"115.74 USD"}
    assert set(cells["allocated"]) == {"123,456.12"}  # GPU-hours to the hundredth
    assert cells["rate_shown"][:2] == ["2.5", "2.5/slice-h"]


def _cells(html: bytes) -> dict[str, list[str]]:
    """The inline table's cells by field: `<td class="field-NAME"><p>TEXT</p>`."""
    cells: dict[str, list[str]] = {}
    for name, text in re.findall(r'<td class="field-(\w+)">\s*<p>(.*?)</p>', html.decode()):
        cells.setdefault(name, []).append(text)
    return cells


def _card_form(**changes: Any) -> dict[str, Any]:
    return {
        "product_name": H100,
        "profile": "",
        "currency": "USD",
        "valid_from": "2026-01-01",
        "valid_until": "",
        "per_gpu_hour": "2.5",
        "idle_factor": "1",
        **changes,
    }


def test_a_rate_card_overlapping_another_is_refused_naming_it(ops_client: Client) -> None:
    other = RateCard.objects.create(
        product_name=H100,
        per_gpu_hour=Decimal("2.0"),
        currency="EUR",
        valid_from=date(2026, 3, 1),
        valid_until=date(2026, 6, 1),
    )
    add = reverse("admin:billing_ratecard_add")
    other.refresh_from_db()  # as stored: 2.0000
    # Another currency does not make a second price for the same day.
    response = ops_client.post(add, _card_form(valid_from="2026-05-01"))
    assert response.status_code == 200
    errors = " ".join(response.context["adminform"].form.non_field_errors())
    assert errors == (
        f"valid from 2026-05-01 on, which overlaps the rate card {other} (valid from 2026-03-01 "
        "until 2026-06-01) for the same model and profile: one price a day, in any currency; "
        "end one card the day the other starts"
    )
    assert RateCard.objects.count() == 1
    # Ending the day the other starts, or another profile, is no overlap.
    assert ops_client.post(add, _card_form(valid_until="2026-03-01")).status_code == 302
    assert ops_client.post(add, _card_form(profile="3g.40gb")).status_code == 302
    # Nor may a change stretch a card over another.
    card = RateCard.objects.get(currency="USD", profile="")
    change = reverse("admin:billing_ratecard_change", args=[card.pk])
    response = ops_client.post(change, _card_form(valid_until="2026-04-01"))
    assert response.status_code == 200
    errors = " ".join(response.context["adminform"].form.non_field_errors())
    assert "overlaps the rate card" in errors
    card.refresh_from_db()
    assert card.valid_until == date(2026, 3, 1)
    assert AuditEntry.objects.filter(object_type="rate card").count() == 2


def test_mig_instances_and_dirty_marks_are_listed_read_only(ops_client: Client) -> None:
    from datetime import UTC, datetime

    from inventory.services import get_cluster
    from metering.dirty import mark_dirty
    from metering.models import MigInstance

    mark_dirty(hours={datetime(2026, 11, 30, 6, tzinfo=UTC)}, at=datetime(2026, 12, 1, tzinfo=UTC))
    MigInstance.objects.create(
        cluster=get_cluster("prod-mig"),
        node="a100-node",
        parent_uuid="GPU-a100",
        gpu_instance_id=9,
        meter_id="MIG-one",
        first_ms=0,
        last_ms=60_000,
    )
    listed = _text(ops_client.get(reverse("admin:metering_miginstance_changelist")).content)
    assert "GPU-a100" in listed and "MIG-one" in listed
    marks = ops_client.get(reverse("admin:metering_dirtyhour_changelist"))
    assert marks.status_code == 200 and "Nov. 30, 2026, 6 a.m." in _text(marks.content)
    assert ops_client.get(reverse("admin:metering_miginstance_add")).status_code == 403


def test_the_samples_list_says_older_days_are_compacted(ops_client: Client) -> None:
    samples = _text(ops_client.get(reverse("admin:metering_sample_changelist")).content)
    assert "Recent days only" in samples and "metering_samples(lo_ms, hi_ms)" in samples
    unknown = _text(
        ops_client.get(reverse("admin:metering_unknowndevicesample_changelist")).content
    )
    assert "Recent days only" not in unknown
