"""JSON logs that carry the request id (and the AdmissionReview uid for the webhooks)."""

from __future__ import annotations

import io
import json
import logging
import logging.config
from collections.abc import Iterator

import pytest
from django.test import Client
from pytest_django.fixtures import SettingsWrapper

from core.logging import JsonFormatter, RequestContextFilter, bound, logging_config

pytestmark = pytest.mark.django_db


@pytest.fixture
def json_lines(settings: SettingsWrapper) -> Iterator[io.StringIO]:
    if "core.logging.RequestIdMiddleware" not in settings.MIDDLEWARE:
        settings.MIDDLEWARE = ["core.logging.RequestIdMiddleware", *settings.MIDDLEWARE]
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(RequestContextFilter())
    root = logging.getLogger()
    previous = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield stream
    finally:
        root.removeHandler(handler)
        root.setLevel(previous)


def records(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_the_caller_s_request_id_is_on_every_line_and_echoed(
    client: Client, json_lines: io.StringIO
) -> None:
    response = client.get("/healthz", HTTP_X_REQUEST_ID="req-123")
    assert response["X-Request-Id"] == "req-123"
    (line,) = [r for r in records(json_lines) if r["logger"] == "tally.request"]
    assert line["request_id"] == "req-123"
    assert (line["method"], line["path"], line["status"]) == ("GET", "/healthz", 200)
    assert {"time", "level", "message", "duration_ms"} <= line.keys()


def test_a_request_without_one_gets_a_new_id_and_junk_is_replaced(
    client: Client, json_lines: io.StringIO
) -> None:
    first = client.get("/healthz")["X-Request-Id"]
    second = client.get("/healthz", HTTP_X_REQUEST_ID="bad id\nwith newline")["X-Request-Id"]
    assert len(first) == 32 and len(second) == 32 and first != second
    assert [r["request_id"] for r in records(json_lines)] == [first, second]


def test_webhook_logs_carry_the_admission_uid(client: Client, json_lines: io.StringIO) -> None:
    review = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "operation": "UPDATE",
            "resource": {"group": "resource.k8s.io", "resource": "resourceclaims"},
        },
    }
    client.post(
        "/admission/resourceclaims",
        data=json.dumps(review),
        content_type="application/json",
        HTTP_X_REQUEST_ID="r-1",
    )
    lines = records(json_lines)
    assert lines
    for line in lines:
        assert line["request_id"] == "r-1"
        assert line["admission_uid"] == "705ab4f5-6393-11e8-b7cc-42010a800002"


def test_bound_fields_reach_any_logger_and_end_with_the_block(json_lines: io.StringIO) -> None:
    log = logging.getLogger("inventory.something")
    with bound(request_id="abc"):
        log.warning("inside")
    log.warning("outside")
    inside, outside = records(json_lines)
    assert inside["request_id"] == "abc" and inside["level"] == "WARNING"
    assert "request_id" not in outside


def test_the_logging_config_is_usable() -> None:
    logging.config.dictConfig(logging_config("INFO"))
