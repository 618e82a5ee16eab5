"""The OpenAPI schema, its docs page, and schemathesis against the schema: for each operation,
generated requests (as the operator, on a small seeded dataset) get no 5xx and responses that
match the schema."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import schemathesis
from django.contrib.auth.models import AbstractBaseUser
from django.core.handlers.wsgi import WSGIHandler
from django.core.signals import request_finished, request_started
from django.db import close_old_connections
from hypothesis import HealthCheck, Phase, settings
from rest_framework.test import APIClient
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from tests.api.cast import Cast, Seeded

pytestmark = pytest.mark.django_db


def test_schema_and_docs_are_served(cast: Cast) -> None:
    client = cast.client("lead_a")
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert schema.status_code == 200
    paths = schema.json()["paths"]
    assert "/api/v1/periods/{id}/close/" in paths
    assert "/api/v1/usage/claims/" in paths
    docs = client.get("/api/docs/")
    assert docs.status_code == 200
    assert b"/api/schema/" in docs.content
    assert b"/static/drf_spectacular_sidecar/" in docs.content  # served here, not from a CDN


def test_docs_page_loads_nothing_from_another_host(cast: Cast) -> None:
    docs = cast.client("lead_a").get("/api/docs/")
    assert docs.status_code == 200
    html = docs.content.decode()
    # Absolute (`https://host`) and protocol-relative (`//host`) references alike.
    hosts = set(re.findall(r"(?:https?:)?//([^/\s\"'<>]+)", html))
    assert hosts <= {"testserver"}, f"the docs page loads from {sorted(hosts)}"


def test_schema_and_docs_need_a_login_unless_public(db: None, settings: Any) -> None:
    anonymous = APIClient()
    schema = anonymous.get("/api/schema/")
    assert schema.status_code in (401, 403)
    assert schema["Content-Type"] == "application/json"
    assert schema.json()["detail"]
    docs = anonymous.get("/api/docs/")
    assert docs.status_code == 302
    assert docs["Location"].startswith("/login/?next=/api/docs/")
    settings.TALLY_API_DOCS_PUBLIC = True
    assert anonymous.get("/api/schema/").status_code == 200
    assert anonymous.get("/api/docs/").status_code == 200


WINDOW_NAMES = ("start", "end", "since", "until")


def test_schema_has_areas_readable_ids_and_documented_errors(cast: Cast) -> None:
    response = cast.client("finance").get(
        "/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json"
    )
    schema = response.json()
    assert schema["info"]["title"] == "Tally API"
    assert schema["info"]["version"] == "v1"
    areas = {"teams", "quota", "billing", "usage", "inventory"}
    assert {tag["name"] for tag in schema["tags"]} == areas
    operations = [
        (path, operation)
        for path, methods in schema["paths"].items()
        for operation in methods.values()
    ]
    assert {tag for _, operation in operations for tag in operation["tags"]} == areas
    ids = {operation["operationId"] for _, operation in operations}
    assert {"adjustments_list", "adjustments_create", "periods_close", "teams_retrieve"} <= ids
    assert not [id_ for id_ in ids if id_.startswith("v1_") or id_.endswith("_create_2")]
    error = {"$ref": "#/components/schemas/Error"}
    for path, operation in operations:
        for code in ("400", "401", "403", "404", "429"):
            documented = operation["responses"][code]["content"]["application/json"]["schema"]
            assert documented == error, (path, code)
    assert schema["components"]["schemas"]["Error"]["properties"]["detail"]["type"] == "string"
    # A billed row's window: `start`/`end`, and the old names marked deprecated.
    billed = schema["components"]["schemas"]["BilledPerson"]["properties"]
    assert {name: billed[name].get("deprecated", False) for name in WINDOW_NAMES} == {
        "start": False,
        "end": False,
        "since": True,
        "until": True,
    }


@pytest.fixture
def api_schema(seeded: Seeded, settings: Any) -> Iterator[Any]:
    settings.TALLY_API_DOCS_PUBLIC = True  # schemathesis reads the schema without a login
    # As Django's test client does: a request must not close the connection that holds the
    # test's transaction (with CONN_MAX_AGE set, PostgreSQL's would be).
    for signal in (request_started, request_finished):
        signal.disconnect(close_old_connections)
    try:
        yield schemathesis.openapi.from_wsgi("/api/schema/", WSGIHandler())
    finally:
        for signal in (request_started, request_finished):
            signal.connect(close_old_connections)


@pytest.fixture
def operator_token(seeded: Seeded, api_token: Callable[[AbstractBaseUser], str]) -> str:
    return api_token(seeded.cast.operator)


schema = schemathesis.pytest.from_fixture("api_schema")


# Settings go outside `parametrize` (that is where a lazy schema reads them). Only the fuzzing
# phase, bounded by `max_examples`: the explicit phase's coverage cases are combinations of
# every query parameter, tens of thousands for the usage endpoints.
@settings(
    max_examples=25,
    phases=[Phase.generate],
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@schema.parametrize()
def test_api_matches_its_schema(case: schemathesis.Case, operator_token: str) -> None:
    case.call_and_validate(
        headers={"Authorization": f"Token {operator_token}"},
        checks=[not_a_server_error, response_schema_conformance],
    )
