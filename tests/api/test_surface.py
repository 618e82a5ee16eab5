"""The API's surface: one snake_case name per column in the API, the CLI and the portal's CSV;
errors as JSON objects with a `detail` anywhere under /api/; unknown orderings refused."""

from __future__ import annotations

import csv
import io
import json
import re
from typing import Any

import pytest
from django.core.management import call_command
from django.urls import URLPattern
from rest_framework.test import APIClient

from config import api_urls
from config.api_urls import router
from frontend import selectors
from tests.api.cast import Seeded
from tests.factories import DeviceFactory

pytestmark = pytest.mark.django_db

DATA_KEYED = {"gpus_by_model", "baselines"}
# Rows whose column names a published standard fixes: FOCUS's PascalCase (issue 39).
STANDARD_NAMED = {"FocusRow"}
SNAKE_CASE = re.compile(r"[a-z][a-z0-9]*(_[a-z0-9]+)*")


def _names(value: Any) -> set[str]:
    """Every object key in a JSON document, at any depth; the keys of a map keyed by data (GPU
    models, clusters) are data, not names."""
    if isinstance(value, list):
        return {name for item in value for name in _names(item)}
    if isinstance(value, dict):
        return {
            name
            for key, item in value.items()
            for name in {key} | _names(list(item.values()) if key in DATA_KEYED else item)
        }
    return set()


def test_every_field_name_is_snake_case(seeded: Seeded) -> None:
    client = seeded.cast.client("operator")
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    properties = {
        name
        for component_name, component in schema["components"]["schemas"].items()
        if component_name not in STANDARD_NAMED
        for name in component.get("properties", {})
    }
    assert set(schema["components"]["schemas"]) >= STANDARD_NAMED
    assert {name for name in properties if not SNAKE_CASE.fullmatch(name)} == set()
    # And the answers themselves, the fleet report's nested rows included.
    for url in ("/api/v1/inventory/summary/", "/api/v1/inventory/capacity/"):
        response = client.get(url)
        assert response.status_code == 200
        names = _names(response.json())
        assert {name for name in names if not SNAKE_CASE.fullmatch(name)} == set(), url
    capacity = client.get("/api/v1/inventory/capacity/").json()["results"]
    assert capacity and {"product_name", "mig_devices"} <= set(capacity[0])


def _cli_statement(seeded: Seeded, team: str) -> dict[str, Any]:
    out = io.StringIO()
    call_command(
        "statement", "--team", team, "--period", seeded.last.label, "--format", "json", stdout=out
    )
    result: dict[str, Any] = json.loads(out.getvalue())
    return result


def test_statement_lines_carry_unit_and_gpu_share_named_as_in_the_cli_and_portal(
    seeded: Seeded,
) -> None:
    client = seeded.cast.client("finance")
    line = client.get("/api/v1/statement-lines/", {"team": "alpha", "kind": "usage"}).json()[
        "results"
    ][0]
    assert (line["product_name"], line["unit"], line["gpu_share"]) == (
        "NVIDIA H100 80GB HBM3",
        "GPU-hour",
        None,
    )
    adjustment = client.get("/api/v1/adjustments/").json()["results"][0]
    assert adjustment["unit"] is None  # no rate: the price of nothing
    detail = client.get(f"/api/v1/statements/{line_statement(seeded)}/").json()
    assert {"unit", "gpu_share"} <= set(detail["lines"][0])
    # The CLI's JSON lines and the portal's CSV use the API's names, each one of them.
    cli_line = _cli_statement(seeded, "alpha")["lines"][0]
    assert set(cli_line) <= set(line), set(cli_line) - set(line)
    assert (cli_line["product_name"], cli_line["unit"]) == (line["product_name"], line["unit"])
    assert set(selectors.CSV_COLUMNS) <= set(line), set(selectors.CSV_COLUMNS) - set(line)
    # The API's CSV: the same columns as its JSON, unit and gpu_share filled.
    response = client.get("/api/v1/statement-lines/", {"team": "alpha", "format": "csv"})
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert list(rows[0]) == list(line)
    assert (rows[0]["unit"], rows[0]["gpu_share"]) == ("GPU-hour", "")


def line_statement(seeded: Seeded) -> int:
    statements = seeded.cast.client("finance").get("/api/v1/statements/", {"team": "alpha"})
    statement_id: int = statements.json()["results"][0]["id"]
    return statement_id


@pytest.mark.parametrize(
    "path",
    ["/api/v1/nothing/", "/api/nothing", "/api/v1/teams/alpha/nothing/", "/api/v2/teams/"],
)
def test_unknown_api_paths_answer_json_404(seeded: Seeded, path: str) -> None:
    for client in (seeded.cast.client("operator"), APIClient()):
        response = client.get(path, HTTP_ACCEPT="text/html")
        assert response.status_code == 404
        assert response["Content-Type"] == "application/json"
        assert response.json() == {"detail": f"No API endpoint at {path}."}


def test_a_path_without_its_slash_still_redirects(seeded: Seeded) -> None:
    client = seeded.cast.client("operator")
    response = client.get("/api/v1/teams", {"ordering": "name"})
    assert (response.status_code, response["Location"]) == (301, "/api/v1/teams/?ordering=name")
    posted = client.post("/api/v1/adjustments", {}, format="json")
    assert posted.status_code == 404
    assert posted.json()["detail"] == (
        "No API endpoint at /api/v1/adjustments; send to /api/v1/adjustments/."
    )


def test_method_not_allowed_is_json_even_for_csv(seeded: Seeded) -> None:
    client = seeded.cast.client("operator")
    for params in ("", "?format=csv"):
        response = client.delete(f"/api/v1/teams/{params}")
        assert response.status_code == 405
        assert response["Content-Type"] == "application/json"
        assert response.json() == {"detail": 'Method "DELETE" not allowed.'}


def test_errors_of_a_csv_request_are_json(seeded: Seeded) -> None:
    response = seeded.cast.client("operator").get(
        "/api/v1/usage/", {"format": "csv", "period": "last"}
    )
    assert response.status_code == 400
    assert response["Content-Type"] == "application/json"
    assert "period" in response.json()


def test_a_crash_under_api_is_a_json_500(db: None, settings: Any) -> None:
    settings.ROOT_URLCONF = "tests.api.crash_urls"
    client = APIClient(raise_request_exception=False)
    response = client.get("/api/v1/crash/")
    assert response.status_code == 500
    assert response["Content-Type"] == "application/json"
    assert response.json()["detail"].startswith("Internal server error")
    assert "a bug" not in response.content.decode()  # no internals shown
    page = client.get("/crash/")
    assert page.status_code == 500
    assert page["Content-Type"].startswith("text/html")


@pytest.mark.parametrize(
    ("url", "allowed"),
    [
        ("/api/v1/statements/", "team, period_start, currency, total"),
        ("/api/v1/usage/claims/", "team, namespace, claim_name, allocated_gpu_hours"),
    ],
)
def test_an_unknown_ordering_is_refused_naming_the_allowed(
    seeded: Seeded, url: str, allowed: str
) -> None:
    client = seeded.cast.client("operator")
    response = client.get(url, {"ordering": "team,-bogus"})
    assert response.status_code == 400
    (message,) = response.json()["ordering"]
    assert message.startswith(f"cannot order by 'bogus': order by one of {allowed}")
    # Known names, descending ones and an empty term still order.
    assert client.get(url, {"ordering": "-team,"}).status_code == 200


@pytest.mark.parametrize(
    ("url", "asked", "formats"),
    [
        ("/api/v1/inventory/summary/", "csv", "json, api"),
        ("/api/v1/statements/", "bogus", "json, api, csv"),
    ],
)
def test_an_unknown_format_is_a_json_406_naming_the_formats(
    seeded: Seeded, url: str, asked: str, formats: str
) -> None:
    response = seeded.cast.client("operator").get(url, {"format": asked})
    assert response.status_code == 406
    assert response["Content-Type"] == "application/json"
    assert response.json() == {
        "detail": f"No format {asked!r} at this endpoint: ask for one of {formats}."
    }


def _list_urls() -> list[str]:
    return [
        f"/api/v1/{prefix}/"
        for prefix, viewset, _basename in router.registry
        if hasattr(viewset, "list")
    ]


def test_every_list_endpoint_refuses_an_unknown_ordering(seeded: Seeded) -> None:
    client = seeded.cast.client("operator")
    assert "/api/v1/inventory/capacity/" in _list_urls()
    for url in _list_urls():
        response = client.get(url, {"ordering": "bogus"})
        assert response.status_code == 400, url
        (message,) = response.json()["ordering"]
        assert message.startswith("cannot order by 'bogus': order by one of "), url


def test_capacity_orders_by_its_columns(seeded: Seeded) -> None:
    DeviceFactory(product_name="NVIDIA A100 80GB PCIe")
    DeviceFactory(product_name="NVIDIA L4")
    client = seeded.cast.client("operator")
    rows = client.get("/api/v1/inventory/capacity/", {"ordering": "-gpus,product_name"}).json()
    keys = [(-row["gpus"], row["product_name"]) for row in rows["results"]]
    assert keys == sorted(keys) and len(keys) == 3
    assert [row["product_name"] for row in rows["results"]][1:] == [
        "NVIDIA A100 80GB PCIe",
        "NVIDIA L4",
    ]
    names = client.get("/api/v1/inventory/capacity/", {"ordering": "-product_name"}).json()
    assert names["results"][0]["product_name"] == "NVIDIA L4"


def test_the_api_root_lists_every_v1_endpoint(seeded: Seeded) -> None:
    root = seeded.cast.client("operator").get("/api/v1/").json()
    plain = {
        str(pattern.pattern).removeprefix("v1/").removesuffix("/")
        for pattern in api_urls.urlpatterns
        if isinstance(pattern, URLPattern) and str(pattern.pattern).startswith("v1/")
    }
    registered = {prefix for prefix, _viewset, _basename in router.registry}
    assert "inventory/summary" in plain
    assert set(root) == registered | plain
    assert root["inventory/summary"] == "http://testserver/api/v1/inventory/summary/"
