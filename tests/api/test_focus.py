"""The FOCUS export, /api/v1/billed/focus/ (issue 39): finance downloads a period as FOCUS 1.2
whose BilledCost adds up to the statements to the cent.

The week of `test_people_usage` (ISO weeks as periods: whole GPUs, a MIG slice priced per
slice-hour, a TPU, a rate change mid-week, two teams) is closed; then late data arrives for
it and the next week bills it as adjustments, with one of finance's own. Every row is checked
against the specification's column rules, written out here from its text (FOCUS_Spec, tag
v1.2, specification/columns/*.md), in JSON and in CSV.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from fractions import Fraction
from typing import Any

import pytest
from django.conf import LazySettings
from django.core.management import call_command
from django.db import transaction
from django.test import override_settings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from billing import pricing, services
from billing.focus_columns import COLUMNS, FOCUS_VERSION
from billing.models import LineKind, Period, Statement, StatementLine
from billing.selectors import billed_usage
from metering.hours import MS_PER_HOUR
from metering.models import UsageHour
from teams.models import Team
from tests.api.cast import Cast
from tests.api.test_people_usage import (
    A100,
    H100,
    MONDAY,
    Week,
    _allocation,
    _card,
    _hours,
    week_scenario,
)

pytestmark = pytest.mark.django_db

FOCUS = "/api/v1/billed/focus/"
NEXT_MONDAY = MONDAY + timedelta(days=7)

# --- The specification's rules, from its text ---------------------------------------------------

# Per column: data type and whether it allows nulls (each column's "Content constraints").
SPEC: dict[str, tuple[str, bool]] = {
    "BilledCost": ("Decimal", False),
    "BillingAccountId": ("String", False),
    "BillingAccountName": ("String", True),
    "BillingCurrency": ("String", False),
    "BillingPeriodEnd": ("Date/Time", False),
    "BillingPeriodStart": ("Date/Time", False),
    "ChargeCategory": ("String", False),
    "ChargeClass": ("String", True),
    "ChargeDescription": ("String", True),
    "ChargeFrequency": ("String", False),
    "ChargePeriodEnd": ("Date/Time", False),
    "ChargePeriodStart": ("Date/Time", False),
    "CommitmentDiscountCategory": ("String", True),
    "CommitmentDiscountId": ("String", True),
    "CommitmentDiscountName": ("String", True),
    "CommitmentDiscountQuantity": ("Decimal", True),
    "CommitmentDiscountStatus": ("String", True),
    "CommitmentDiscountType": ("String", True),
    "CommitmentDiscountUnit": ("String", True),
    "ConsumedQuantity": ("Decimal", True),
    "ConsumedUnit": ("String", True),
    "ContractedCost": ("Decimal", False),
    "ContractedUnitPrice": ("Decimal", True),
    "EffectiveCost": ("Decimal", False),
    "InvoiceId": ("String", True),
    "InvoiceIssuerName": ("String", False),
    "ListCost": ("Decimal", False),
    "ListUnitPrice": ("Decimal", True),
    "PricingCategory": ("String", True),
    "PricingQuantity": ("Decimal", True),
    "PricingUnit": ("String", True),
    "ProviderName": ("String", False),
    "PublisherName": ("String", False),
    "RegionId": ("String", True),
    "RegionName": ("String", True),
    "ResourceId": ("String", True),
    "ResourceName": ("String", True),
    "ResourceType": ("String", True),
    "ServiceCategory": ("String", False),
    "ServiceName": ("String", False),
    "ServiceSubcategory": ("String", False),
    "SkuId": ("String", True),
    "SkuMeter": ("String", True),
    "SkuPriceDetails": ("JSON", True),
    "SkuPriceId": ("String", True),
    "SubAccountId": ("String", True),
    "SubAccountName": ("String", True),
    "SubAccountType": ("String", True),
    "Tags": ("JSON", True),
}
# The enumerated columns' allowed values ("Allowed values" tables).
ALLOWED = {
    "ChargeCategory": {"Usage", "Purchase", "Tax", "Credit", "Adjustment"},
    "ChargeClass": {"Correction"},
    "ChargeFrequency": {"One-Time", "Recurring", "Usage-Based"},
    "PricingCategory": {"Standard", "Dynamic", "Committed", "Other"},
    "CommitmentDiscountCategory": {"Spend", "Usage"},
    "CommitmentDiscountStatus": {"Used", "Unused"},
    "ServiceCategory": {
        "AI and Machine Learning",
        "Analytics",
        "Business Applications",
        "Compute",
        "Databases",
        "Developer Tools",
        "Multicloud",
        "Identity",
        "Integration",
        "Internet of Things",
        "Management and Governance",
        "Media",
        "Migration",
        "Mobile",
        "Networking",
        "Security",
        "Storage",
        "Web",
        "Other",
    },
}
# Numeric Format: an integer or decimal (or E notation), a sign only when negative.
NUMERIC = re.compile(r"-?\d+(\.\d+)?([eE]-?\d+)?")
# Date/Time Format: ISO 8601 extended, in UTC, with seconds and a Z.
DATE_TIME = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z")
CURRENCY = re.compile(r"[A-Z]{3}")
# Unit Format: `<singular-unit>-<plural-time-units>`, each part capitalised.
UNIT = re.compile(r"[A-Z][A-Za-z]*( [A-Z][A-Za-z]*)*-Hours")


def check_row(row: dict[str, Any]) -> None:
    """A row against the specification: each column's type, nullability and allowed values,
    and the rules that tie columns together."""
    for name, (data_type, nullable) in SPEC.items():
        value = row[name]
        if value is None or value == "":
            assert nullable, f"{name} is null in {row}"
            continue
        assert isinstance(value, str), f"{name}: {value!r}"
        if data_type == "Decimal":
            assert NUMERIC.fullmatch(value), f"{name}: {value!r} is not Numeric Format"
        elif data_type == "Date/Time":
            assert DATE_TIME.fullmatch(value), f"{name}: {value!r} is not Date/Time Format"
        elif data_type == "JSON":
            parsed = json.loads(value)
            assert isinstance(parsed, dict)
            assert all(isinstance(item, str | int | float | bool) for item in parsed.values())
        if name in ALLOWED:
            assert value in ALLOWED[name], f"{name}: {value!r} is not an allowed value"
    present = {name for name, value in row.items() if value not in (None, "")}
    usage = row["ChargeCategory"] == "Usage"
    correction = row["ChargeClass"] == "Correction"
    assert CURRENCY.fullmatch(row["BillingCurrency"])
    assert row["ChargePeriodStart"] < row["ChargePeriodEnd"]
    assert row["BillingPeriodStart"] < row["BillingPeriodEnd"]
    # ConsumedQuantity: null unless usage, and not null on usage that is no correction.
    assert ("ConsumedQuantity" in present) == (usage and not correction)
    assert ("ConsumedUnit" in present) == ("ConsumedQuantity" in present)
    assert ("PricingUnit" in present) == ("PricingQuantity" in present)
    if usage and not correction:
        for name in (
            "PricingQuantity",
            "ListUnitPrice",
            "ContractedUnitPrice",
            "PricingCategory",
            "SkuId",
            "SkuPriceId",
        ):
            assert name in present, f"{name} is null on a usage row"
        assert UNIT.fullmatch(row["ConsumedUnit"]) and UNIT.fullmatch(row["PricingUnit"])
        # The product of a unit price and PricingQuantity matches its cost (to the cent).
        quantity = Decimal(row["PricingQuantity"])
        for price, cost in (
            ("ListUnitPrice", "ListCost"),
            ("ContractedUnitPrice", "ContractedCost"),
        ):
            exact = Decimal(row[price]) * quantity
            assert abs(exact - Decimal(row[cost])) <= Decimal("0.005"), (price, row)
        assert Decimal(row["ListUnitPrice"]) >= 0
    else:
        # Not usage: its costs are its amount (no unit price).
        assert row["ListCost"] == row["ContractedCost"] == row["BilledCost"]
    assert row["EffectiveCost"] == row["BilledCost"]  # no purchases to amortise
    # The *Name and *Type columns are null exactly where their id is.
    for id_, names in (
        ("SubAccountId", ("SubAccountName", "SubAccountType")),
        ("ResourceId", ("ResourceType",)),
    ):
        for name in names:
            assert (name in present) == (id_ in present), (id_, name, row)
    if "ResourceId" in present:
        assert row["ResourceName"] != row["ResourceId"]
    else:
        assert "ResourceName" not in present
    if "SkuId" not in present:
        assert "SkuMeter" not in present and "SkuPriceId" not in present
    if "SkuPriceDetails" in present:
        assert "SkuPriceId" in present
        assert all(key.startswith("x_") for key in json.loads(row["SkuPriceDetails"]))
    # Commitment discounts: none in Tally.
    assert not {name for name in present if name.startswith("CommitmentDiscount")}
    # Custom columns: `x_` prefixed.
    assert set(row) - set(SPEC) == {column.name for column in COLUMNS if column.custom}


# --- The scenario --------------------------------------------------------------------------------


@dataclass
class Closed:
    week: Week
    closed: Period  # W45, closed, with late data since
    next: Period  # W46, open: its adjustments bill W45's late data


@pytest.fixture
def closed(cast: Cast, settings: LazySettings) -> Closed:
    settings.TALLY_BILLING_PERIOD = "week"
    week = week_scenario(cast.alpha, cast.beta)
    services.close_period(period=week.period, actor="fin")
    # Late data for the closed week: three more H100 hours for alpha on Tuesday, a third
    # busy (no whole cents), and a beta hour on Wednesday.
    _hours(
        _allocation("alpha-ml", "late"),
        week.alpha,
        start=MONDAY + timedelta(days=1, hours=5),
        hours=3,
        username="eve",
        job="Job/late",
        utilised=MS_PER_HOUR // 3,
    )
    _hours(
        _allocation("beta-ml", "late-b"),
        week.beta,
        start=MONDAY + timedelta(days=2),
        hours=1,
        username="nora",
        job="Job/nora",
    )
    # The next week: alpha on an A100 on Tuesday and Wednesday.
    _hours(
        _allocation("alpha-ml", "next", product_name=A100),
        week.alpha,
        start=NEXT_MONDAY + timedelta(days=1),
        hours=30,
        username="ana",
        job="Job/next",
        utilised=MS_PER_HOUR * 2 // 7,
    )
    # And beta on a model no rate card prices (billed at zero, on its USD statement).
    _hours(
        _allocation("beta-ml", "unpriced", product_name="AMD Instinct MI300X"),
        week.beta,
        start=NEXT_MONDAY + timedelta(days=3),
        hours=2,
        username="nora",
        job="Job/mi300",
    )
    following = pricing.period_for(NEXT_MONDAY)
    pricing.refresh_statements(period=following)
    services.add_adjustment(
        team=week.beta,
        period=following,
        currency="USD",
        amount=Decimal("-12.34"),
        reason="goodwill for the outage",
        actor="fin",
    )
    week.period.refresh_from_db()
    return Closed(week=week, closed=week.period, next=following)


def _json(cast: Cast, who: str = "finance", **query: str) -> list[dict[str, Any]]:
    response = cast.client(who).get(FOCUS, query)
    assert response.status_code == 200, response.content
    assert response["X-Focus-Version"] == FOCUS_VERSION
    rows: list[dict[str, Any]] = response.json()
    return rows


def _csv(cast: Cast, **query: str) -> tuple[list[str], list[dict[str, str]]]:
    response = cast.client("finance").get(FOCUS, {"format": "csv", **query})
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/csv")
    assert response["Content-Disposition"].startswith("attachment; filename=")
    reader = csv.DictReader(io.StringIO(response.content.decode()))
    rows = list(reader)
    return list(reader.fieldnames or []), rows


def _statement_totals(period: Period) -> dict[tuple[str, str], Decimal]:
    return {
        (statement.team.slug, statement.currency): statement.total
        for statement in Statement.objects.filter(period=period).select_related("team")
    }


def _billed(rows: list[dict[str, Any]]) -> dict[tuple[str, str], Decimal]:
    totals: dict[tuple[str, str], Decimal] = defaultdict(Decimal)
    for row in rows:
        totals[row["SubAccountId"], row["BillingCurrency"]] += Decimal(row["BilledCost"])
    return dict(totals)


# --- Tests ---------------------------------------------------------------------------------------


def test_the_column_table_states_what_the_specification_does() -> None:
    """billing.focus_columns (which the export, schema and docs read) against the text."""
    spec_columns = [column for column in COLUMNS if not column.custom]
    assert [column.name for column in spec_columns] == sorted(SPEC)
    for column in spec_columns:
        assert (column.data_type, column.nullable) == SPEC[column.name], column.name
        if column.name in ALLOWED:
            assert set(column.allowed) == ALLOWED[column.name], column.name
    # Custom columns after all of FOCUS's, `x_` prefixed.
    names = [column.name for column in COLUMNS]
    assert names[len(spec_columns) :] == [column.name for column in COLUMNS if column.custom]
    assert all(name.startswith("x_") for name in names[len(spec_columns) :])


def test_a_closed_period_adds_up_to_its_frozen_statements(cast: Cast, closed: Closed) -> None:
    rows = _json(cast, period="2026-W45")
    for row in rows:
        check_row(row)
    totals = _statement_totals(closed.closed)
    assert len(totals) == 2
    assert _billed(rows) == totals  # to the cent, per team and currency
    assert {row["ChargeCategory"] for row in rows} == {"Usage"}
    # Each frozen usage line's hours, too: late data (eve's three hours on Tuesday, billed in
    # W46's adjustments) only changes how a frozen line's hours and money are shared out.
    lines = StatementLine.objects.filter(statement__period=closed.closed, kind=LineKind.USAGE)
    assert sum(Decimal(row["ConsumedQuantity"]) for row in rows) == sum(
        line.allocated_gpu_hours for line in lines
    )
    # One row per team, model/profile, day and job: the slice's rows name its profile.
    sweep = [row for row in rows if row["ResourceName"] == "sweep"]
    assert {row["SkuId"] for row in sweep} == {f"{A100} 4g.20gb"}
    assert {row["PricingUnit"] for row in sweep} == {"Slice-Hours"}
    assert {row["ChargePeriodStart"][:10] for row in sweep} == {"2026-11-06", "2026-11-07"}
    assert sum(Decimal(row["BilledCost"]) for row in sweep) == Decimal("37.80")
    # Ben's notebook on Friday (a line no late data reached): 24 idle hours at 3.10 USD, idle
    # at 50%: listed at 74.40, billed 37.20.
    (friday,) = [
        row
        for row in rows
        if row["ResourceName"] == "notebook" and row["ChargePeriodStart"] == "2026-11-06T00:00:00Z"
    ]
    assert (friday["ConsumedQuantity"], friday["x_IdleHours"]) == ("24.000000", "24.000000")
    assert (friday["BilledCost"], friday["ListCost"], friday["ListUnitPrice"]) == (
        "37.20",
        "74.40",
        "3.1000",
    )
    assert json.loads(friday["SkuPriceDetails"]) == {"x_IdleFactor": 0.5}
    assert json.loads(friday["Tags"]) == {
        "tally/cluster": "week",
        "tally/namespace": "alpha-ml",
        "tally/job": "Deployment/notebook",
        "tally/person": "ben",
    }
    assert friday["InvoiceId"] == "2026-W45/alpha/USD"
    assert friday["ChargeClass"] is None


def test_the_next_period_has_the_corrections_and_adds_up(cast: Cast, closed: Closed) -> None:
    rows = _json(cast, period="2026-W46")
    for row in rows:
        check_row(row)
    assert _billed(rows) == _statement_totals(closed.next)
    corrections = [row for row in rows if row["ChargeClass"] == "Correction"]
    assert {row["SubAccountId"] for row in corrections} == {"alpha", "beta"}
    for row in corrections:
        assert row["ChargeCategory"] == "Adjustment"
        assert row["x_CorrectsPeriod"] == "2026-W45"
        assert (row["ChargePeriodStart"], row["ChargePeriodEnd"]) == (
            "2026-11-02T00:00:00Z",
            "2026-11-09T00:00:00Z",
        )
        assert row["BillingPeriodStart"] == "2026-11-09T00:00:00Z"
    late = StatementLine.objects.filter(corrects_period=closed.closed)
    assert sum(Decimal(row["BilledCost"]) for row in corrections) == sum(
        line.amount for line in late
    )
    (own,) = [
        row for row in rows if row["ChargeCategory"] == "Adjustment" and row["ChargeClass"] is None
    ]
    assert (own["BilledCost"], own["ChargeDescription"]) == ("-12.34", "goodwill for the outage")
    assert own["ChargeFrequency"] == "One-Time"
    (unpriced,) = [row for row in rows if row["SkuId"] == "AMD Instinct MI300X"]
    assert (unpriced["BilledCost"], unpriced["ListUnitPrice"], unpriced["PricingCategory"]) == (
        "0.00",
        "0",
        "Other",
    )
    assert unpriced["SkuPriceId"] == "unpriced:AMD Instinct MI300X"
    assert unpriced["ConsumedQuantity"] == "2.000000"


def test_a_frozen_line_without_usage_now_is_one_row_for_its_period(
    cast: Cast, closed: Closed
) -> None:
    """Beta's usage of the closed week deleted since (as a re-import can): its frozen line is
    still billed, as one row for the whole week."""
    UsageHour.objects.filter(team=closed.week.beta, hour__lt=NEXT_MONDAY).delete()
    rows = _json(cast, period="2026-W45")
    assert _billed(rows) == _statement_totals(closed.closed)
    (beta,) = [row for row in rows if row["SubAccountId"] == "beta"]
    check_row(beta)
    assert (beta["ChargePeriodStart"], beta["ChargePeriodEnd"]) == (
        "2026-11-02T00:00:00Z",
        "2026-11-09T00:00:00Z",
    )
    assert (beta["BilledCost"], beta["ConsumedQuantity"], beta["Tags"]) == (
        "14.50",
        "5.000000",
        None,
    )


def test_csv_is_the_json_rows_under_the_column_header(cast: Cast, closed: Closed) -> None:
    header, rows = _csv(cast, period="2026-W46")
    assert header == [column.name for column in COLUMNS]
    as_json = _json(cast, period="2026-W46")
    assert len(rows) == len(as_json)
    for row, json_row in zip(rows, as_json, strict=True):
        check_row(row)
        assert row == {name: "" if value is None else value for name, value in json_row.items()}
    assert _billed(rows) == _statement_totals(closed.next)


def test_two_whole_periods_add_up_to_both_statements(cast: Cast, closed: Closed) -> None:
    rows = _json(cast, start="2026-11-02", end="2026-11-16")
    totals: dict[tuple[str, str], Decimal] = defaultdict(Decimal)
    for period in (closed.closed, closed.next):
        for key, total in _statement_totals(period).items():
            totals[key] += total
    assert _billed(rows) == dict(totals)


def test_a_window_is_priced_as_the_billed_usage_is(cast: Cast, closed: Closed) -> None:
    """Part of an open period: its usage priced now, cut at the window's bounds; no
    adjustment (they belong to the whole period's statement)."""
    since = NEXT_MONDAY + timedelta(days=1, hours=6)
    until = NEXT_MONDAY + timedelta(days=2, hours=3)
    rows = _json(cast, start="2026-11-10T06:00:00Z", end="2026-11-11T03:00:00Z")
    for row in rows:
        check_row(row)
        assert "2026-11-10T06:00:00Z" <= row["ChargePeriodStart"] < row["ChargePeriodEnd"]
        assert row["ChargePeriodEnd"] <= "2026-11-11T03:00:00Z"
    assert {row["ChargeCategory"] for row in rows} == {"Usage"}
    assert sum(Decimal(row["ConsumedQuantity"]) for row in rows) == 21
    usage = billed_usage(teams=list(Team.objects.all()), since=since, until=until)
    assert sum(Decimal(row["BilledCost"]) for row in rows) == sum(
        row.billed or 0 for row in usage.people
    )
    # One team of it.
    assert {row["SubAccountId"] for row in _json(cast, team="beta", period="2026-W46")} == {"beta"}


def test_rows_sort_by_any_column(cast: Cast, closed: Closed) -> None:
    rows = _json(cast, period="2026-W45", ordering="-BilledCost,SkuId")
    costs = [Decimal(row["BilledCost"]) for row in rows]
    assert costs == sorted(costs, reverse=True) and len(set(costs)) > 3
    # Nulls last either way.
    rows = _json(cast, period="2026-W46", ordering="ChargeClass")
    assert rows[0]["ChargeClass"] == "Correction" and rows[-1]["ChargeClass"] is None


@pytest.mark.parametrize(
    ("who", "status"),
    [(None, 401), ("lead_a", 403), ("member_a", 403), ("lead_b", 403), ("operator", 200)],
)
def test_finance_and_operators_only(
    cast: Cast, closed: Closed, who: str | None, status: int
) -> None:
    response = cast.client(who).get(FOCUS, {"period": "2026-W45"})
    assert response.status_code == status, response.content
    if status != 200:
        assert "BilledCost" not in response.content.decode()


@pytest.mark.parametrize(
    ("query", "field", "says"),
    [
        ({"period": "2026-13"}, "period", "2026-13"),
        ({"period": "2026-W45", "start": "2026-11-02"}, "period", "not both"),
        ({"start": "2026-11-09", "end": "2026-11-02"}, "end", "reversed"),
        ({"start": "yesterday", "end": "2026-11-02"}, "start", ""),
        ({"start": "2020-01-01", "end": "2026-11-02"}, "end", "at most"),
        ({"team": "gamma", "period": "2026-W45"}, "team", "gamma"),
        ({"ordering": "billed", "period": "2026-W45"}, "ordering", "cannot order by 'billed'"),
    ],
)
def test_bad_queries_are_400s_naming_the_parameter(
    cast: Cast, closed: Closed, query: dict[str, str], field: str, says: str
) -> None:
    response = cast.client("finance").get(FOCUS, query)
    assert response.status_code == 400, response.content
    assert says in " ".join(response.json()[field])


def test_queries_do_not_grow_with_rows(
    cast: Cast, closed: Closed, django_assert_max_num_queries: Any
) -> None:
    # The role (2), teams, periods, frozen lines, rate cards, usage and adjustments.
    for fmt in ("json", "csv"):
        with django_assert_max_num_queries(9):
            response = cast.client("finance").get(FOCUS, {"format": fmt, "period": "2026-W45"})
        assert response.status_code == 200


def test_the_command_writes_the_same_csv(cast: Cast, closed: Closed) -> None:
    out = io.StringIO()
    call_command("focus_export", "--period", "2026-W45", "--format", "csv", stdout=out)
    command_rows = list(csv.DictReader(io.StringIO(out.getvalue())))
    _, api_rows = _csv(cast, period="2026-W45")
    assert command_rows == api_rows
    out = io.StringIO()
    call_command("focus_export", "--period", "2026-W45", "--format", "json", stdout=out)
    assert json.loads(out.getvalue()) == _json(cast, period="2026-W45")


PROVIDER_COLUMNS = ("BillingAccountName", "InvoiceIssuerName", "ProviderName", "PublisherName")


def test_the_provider_is_the_organisation_that_charges_back(cast: Cast, closed: Closed) -> None:
    assert {row[name] for row in _json(cast, period="2026-W45") for name in PROVIDER_COLUMNS} == {
        "Tally"
    }
    with override_settings(TALLY_FOCUS_PROVIDER_NAME="Acme GPU Platform"):
        rows = _json(cast, period="2026-W45")
    assert {row[name] for row in rows for name in PROVIDER_COLUMNS} == {"Acme GPU Platform"}
    for row in rows:
        check_row(row)


@pytest.mark.parametrize("name", ["   ", "x" * 201])
def test_a_provider_name_that_is_blank_or_too_long_stops_the_process(name: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", "from django.conf import settings; settings.INSTALLED_APPS"],
        env={
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "config.settings",
            "TALLY_FOCUS_PROVIDER_NAME": name,
        },
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode != 0
    assert "TALLY_FOCUS_PROVIDER_NAME must name the provider in 1 to 200 characters" in (
        result.stderr
    )


def test_the_docs_page_maps_every_column() -> None:
    with open("docs/focus.md", encoding="utf-8") as page:
        text = page.read()
    for column in COLUMNS:
        assert f"| `{column.name}` |" in text, column.name


# --- Random usage: the daily rows add up to the statement lines exactly ------------------------


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    usage=st.lists(
        st.tuples(
            st.sampled_from(["alpha", "beta"]),
            st.sampled_from([H100, A100]),
            st.integers(min_value=0, max_value=24 * 7 - 1),  # the hour of the week
            st.integers(min_value=1, max_value=MS_PER_HOUR),
            st.fractions(min_value=0, max_value=1),
            st.sampled_from(["ana", "ben", "cara"]),
        ),
        min_size=1,
        max_size=25,
    )
)
def test_random_usage_rows_add_up_to_every_statement_line(
    cast: Cast, settings: LazySettings, usage: list[Any]
) -> None:
    settings.TALLY_BILLING_PERIOD = "week"
    with transaction.atomic():
        _card(H100, "2.9037", "0.35", date(2026, 1, 1), date(2026, 11, 5))
        _card(H100, "3.1111", "0.45", date(2026, 11, 5))
        _card(A100, "1.7", "0.6", date(2026, 1, 1))
        teams = {team.slug: team for team in (cast.alpha, cast.beta)}
        devices: dict[tuple[str, str, str], Any] = {}
        taken = set()
        for slug, product, hour, allocated, busy, person in usage:
            device = devices.get((slug, product, person))
            if device is None:
                device = _allocation(
                    f"{slug}-ml", f"{slug}-{person}-{product[7:11]}", product_name=product
                )
                devices[slug, product, person] = device
            if (device.pk, hour) in taken:
                continue
            taken.add((device.pk, hour))
            _hours(
                device,
                teams[slug],
                start=MONDAY + timedelta(hours=hour),
                hours=1,
                username=person,
                job=f"Job/{person}",
                allocated=allocated,
                utilised=int(allocated * busy),
            )
        period = pricing.period_for(MONDAY)
        rows = _json(cast, period="2026-W45")
        per_line: dict[tuple[str, str, str, str], Decimal] = defaultdict(Decimal)
        for row in rows:
            check_row(row)
            key = (row["SubAccountId"], row["SkuId"], row["ListUnitPrice"], row["x_IdleFactor"])
            per_line[key] += Decimal(row["BilledCost"])
        expected = {
            (slug, line.product_name, f"{line.rate}", f"{line.idle_factor}"): line.amount
            for slug, team in teams.items()
            for line in pricing.usage_lines(team=team, period=period)
        }
        assert dict(per_line) == expected
        # Each row is its day's.
        for row in rows:
            start = datetime.fromisoformat(row["ChargePeriodStart"])
            assert datetime.fromisoformat(row["ChargePeriodEnd"]) - start == timedelta(days=1)
            assert start.astimezone(UTC).hour == 0
        assert sum(Fraction(row["BilledCost"]) for row in rows) == sum(expected.values())
        transaction.set_rollback(True)
