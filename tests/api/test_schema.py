"""The OpenAPI schema, its docs page, and schemathesis against the schema: for each operation,
generated requests (as the operator, on a small seeded dataset) get no 5xx and responses that
match the schema."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from django.core.handlers.wsgi import WSGIHandler
from django.core.signals import request_finished, request_started
from django.db import close_old_connections
from hypothesis import HealthCheck, Phase, settings
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from tests.api.cast import Seeded

pytestmark = pytest.mark.django_db


def test_schema_and_docs_are_served(db: None) -> None:
    client = APIClient()
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert schema.status_code == 200
    paths = schema.json()["paths"]
    assert "/api/v1/periods/{id}/close/" in paths
    assert "/api/v1/usage/claims/" in paths
    docs = client.get("/api/docs/")
    assert docs.status_code == 200
    assert b"/api/schema/" in docs.content
    assert b"/static/drf_spectacular_sidecar/" in docs.content  # served here, not from a CDN
    assert b"cdn." not in docs.content


@pytest.fixture
def api_schema(seeded: Seeded) -> Iterator[Any]:
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
def operator_token(seeded: Seeded) -> str:
    return Token.objects.create(user=seeded.cast.operator).key


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
