"""Dates at the edges of the calendar (years 1 and 9999, ISO weeks) on every page and endpoint
that takes one: a 400 naming the parameter, never a 500 (issue 40, finding 5).

Python's datetimes end at 9999-12-31 and begin at 0001-01-01; a window bound there used to
overflow in the arithmetic after parsing (the week before a week, a window's end). Tally
counts time from 1970-01-01 to 9999-01-01 (`metering.moments`): out of that range is a 400,
its edges are answered.

The fuzz is schemathesis over every operation of the API that takes a date, with date and
date-time values drawn mostly from the limits, and the period and compare-window parameters
too; bounded (`max_examples`) so that it runs in seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import UTC
from typing import Any

import pytest
import schemathesis
from django.contrib.auth.models import AbstractBaseUser
from django.core.handlers.wsgi import WSGIHandler
from django.core.signals import request_finished, request_started
from django.db import close_old_connections
from django.test import Client
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.formats import unregister_string_format

from tests.api.cast import Cast, Seeded

pytestmark = pytest.mark.django_db

# The days where the calendar or Tally's range ends, and ISO weeks at the ends of years.
LIMIT_DAYS = [
    "0001-01-01",
    "0001-01-08",
    "1969-12-31",
    "1970-01-01",
    "9998-12-31",
    "9999-01-01",
    "9999-12-31",
    "0001-W01",
    "9999-W52",
    "2020-W53",
    "2026-W53",
]
LIMIT_MOMENTS = [
    *LIMIT_DAYS,
    "0001-01-01T00:00:00Z",
    "0001-01-01T00:00:00+01:00",
    "1969-12-31T23:00:00Z",
    "9999-01-01T00:00:00Z",
    "9999-12-31T23:00:00Z",
    "9999-12-31T23:59:59.999999-01:00",
    "9999-W52-7T23:00:00Z",
]
# Period names at the limits, as `?period=` takes them (a month, an ISO week, a start day).
OUT_OF_RANGE = ["0001-01-01", "0001-01-08", "1969-12-31", "9999-12-31", "9999-W52"]


# --- The portal's pages ---------------------------------------------------------------------

WEEK_PAGES = [
    "/teams/alpha/week/",
    "/teams/alpha/week.csv",
    "/fleet/week/",
    "/fleet/week.csv",
]


@pytest.fixture
def operator_page(cast: Cast) -> Client:
    client = Client(raise_request_exception=False)
    client.force_login(cast.operator)
    return client


@pytest.mark.parametrize("day", OUT_OF_RANGE)
@pytest.mark.parametrize("page", WEEK_PAGES)
def test_a_week_out_of_range_is_a_400_naming_start(
    operator_page: Client, page: str, day: str
) -> None:
    response = operator_page.get(page, {"start": day})
    assert response.status_code == 400
    text = response.content.decode()
    assert "start: " in text
    assert "out of range" in text or "is not a day" in text


@pytest.mark.parametrize("page", WEEK_PAGES)
def test_the_first_week_in_range_is_shown(operator_page: Client, page: str) -> None:
    assert operator_page.get(page, {"start": "1970-01-01"}).status_code == 200


@pytest.mark.parametrize("moment", LIMIT_MOMENTS)
@pytest.mark.parametrize("bound", ["before_start", "before_end", "after_start", "after_end"])
def test_the_compare_page_names_a_bound_at_the_limits(
    operator_page: Client, bound: str, moment: str
) -> None:
    query = {
        "before_start": "2026-11-02",
        "before_end": "2026-11-09",
        "after_start": "2026-11-09",
        "after_end": "2026-11-16",
        bound: moment,
    }
    response = operator_page.get("/compare/", query)
    assert response.status_code in (200, 400)
    if response.status_code == 400:
        assert bound in response.content.decode()


# --- The API ----------------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["/api/v1/billed/people/", "/api/v1/billed/jobs/"])
@pytest.mark.parametrize(
    "since", ["9999-12-31", "9999-12-31T23:00:00Z", "9999-W52", "0001-01-01", "1969-12-31"]
)
def test_billed_usage_start_out_of_range_is_a_400_naming_start(
    cast: Cast, endpoint: str, since: str
) -> None:
    response = cast.client("finance").get(endpoint, {"start": since})
    assert response.status_code == 400, response.content
    assert "out of range" in " ".join(response.json()["start"])


@pytest.mark.parametrize("endpoint", ["/api/v1/billed/people/", "/api/v1/billed/jobs/"])
@pytest.mark.parametrize(
    "query",
    [
        {"start": "9999-01-01"},
        {"start": "9998-12-31", "end": "9999-01-01"},
        {"start": "1970-01-01", "end": "1970-01-02"},
    ],
)
def test_billed_usage_at_the_edges_of_the_range_is_answered(
    cast: Cast, endpoint: str, query: dict[str, str]
) -> None:
    response = cast.client("finance").get(endpoint, query)
    assert response.status_code == 200, response.content
    assert response.json()["results"] == []


# --- Schema-driven fuzz -----------------------------------------------------------------------

DATE_FORMATS = ("date", "date-time")
# Query parameters that take a date or a period in plain strings (no format in the schema).
DATE_NAMES = frozenset(
    {
        "period",
        "start",
        "end",
        "before_start",
        "before_end",
        "before_period",
        "after_start",
        "after_end",
        "after_period",
    }
)


def _date_parameters(operation: Any) -> list[str]:
    """The query parameters of `operation` that take a date, a moment or a period (read from
    its definition: operations are filtered before their parameters are built)."""
    return [
        parameter["name"]
        for parameter in operation.definition.raw.get("parameters", [])
        if parameter.get("in") == "query"
        and (
            parameter["name"] in DATE_NAMES
            or parameter.get("schema", {}).get("format") in DATE_FORMATS
        )
    ]


def _takes_dates(ctx: Any) -> bool:
    """Operations with a date in their query, and every write (their bodies' dates are drawn
    from the limits by the formats the fixture registers)."""
    operation = ctx.operation
    return bool(_date_parameters(operation)) or "requestBody" in operation.definition.raw


# What the fuzz gives a date parameter: the limits only (ordinary dates are the schema fuzz's,
# tests/api/test_schema.py), in every spelling some date parameter takes.
QUERY_LIMITS = st.sampled_from(
    [
        "0001-01-01",
        "1969-12-31",
        "1970-01-01",
        "9999-01-01",
        "9999-12-31",
        "9999-12-31T23:00:00Z",
        "0001-01-01T00:00:00+01:00",
        "0001-W01",
        "9999-W52",
        "0001-01",
        "9999-12",
    ]
)


# What the schema's `date` and `date-time` formats may hold (RFC 3339), at the limits.
FORMAT_LIMITS = {
    "date": st.one_of(
        st.sampled_from([day for day in LIMIT_DAYS if "W" not in day]),
        st.dates().map(lambda day: day.isoformat()),
    ),
    "date-time": st.one_of(
        st.sampled_from(
            [moment for moment in LIMIT_MOMENTS if "T" in moment and "W" not in moment]
        ),
        st.datetimes(timezones=st.just(UTC)).map(lambda moment: moment.isoformat()),
    ),
}


@pytest.fixture
def date_limit_schema(seeded: Seeded, settings: Any) -> Iterator[Any]:
    settings.TALLY_API_DOCS_PUBLIC = True  # schemathesis reads the schema without a login
    # As tests/api/test_schema.py: keep the test's transaction's connection open.
    for signal in (request_started, request_finished):
        signal.disconnect(close_old_connections)
    # Dates and date-times in bodies and query strings alike, drawn from the limits.
    for name, strategy in FORMAT_LIMITS.items():
        schemathesis.openapi.format(name, strategy)
    try:
        schema = schemathesis.openapi.from_wsgi("/api/schema/", WSGIHandler())
        schema.hook(flatmap_query)
        yield schema
    finally:
        for name in DATE_FORMATS:
            unregister_string_format(name)
        for signal in (request_started, request_finished):
            signal.connect(close_old_connections)


def flatmap_query(ctx: Any, query: dict[str, Any] | None) -> st.SearchStrategy[dict[str, Any]]:
    """The generated query with one of its date parameters at a limit and the others left
    out: a bound alone is where a window's other bound is worked out, past the calendar."""
    names = _date_parameters(ctx.operation)
    rest = {name: value for name, value in (query or {}).items() if name not in names}
    if not names:
        return st.just(rest)
    return st.tuples(st.sampled_from(names), QUERY_LIMITS).map(
        lambda chosen: {**rest, chosen[0]: chosen[1]}
    )


@pytest.fixture
def finance_token(seeded: Seeded, api_token: Callable[[AbstractBaseUser], str]) -> str:
    # Finance reads every team and may write what finance writes (adjustments, periods).
    return api_token(seeded.cast.finance)


limit_schema = schemathesis.pytest.from_fixture("date_limit_schema").include(func=_takes_dates)


@settings(
    max_examples=10,
    phases=[Phase.generate],
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@limit_schema.parametrize()
def test_no_date_at_the_limits_is_a_server_error(
    case: schemathesis.Case, finance_token: str
) -> None:
    case.call_and_validate(
        headers={"Authorization": f"Token {finance_token}"}, checks=[not_a_server_error]
    )
