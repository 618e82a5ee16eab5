"""One API vocabulary (issue 35, item 5): every endpoint refuses a query parameter it does not
take, every window (`start`/`end`, or `<side>_start`/`<side>_end` where a query holds two) is
refused reversed or empty, the old window names still work for one release with a
`Deprecation` header, and a token request never meets the CSRF check.

The endpoints are read from the URLconf, so a new one is tried without being listed here."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver
from rest_framework.test import APIClient

from teams.tokens import create_token
from tests.api.cast import Cast, Seeded

V1 = "api/v1/"


def _walk(patterns: list[Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for pattern in patterns:
        route = prefix + str(pattern.pattern).lstrip("^").rstrip("$").replace("\\", "")
        if isinstance(pattern, URLResolver):
            yield from _walk(pattern.url_patterns, route)
        elif isinstance(pattern, URLPattern):
            yield route, pattern.callback


def v1_list_endpoints() -> list[str]:
    """Every GET endpoint under /api/v1/ without a path parameter (no object id, no format
    suffix), as the URLconf has it."""
    found = []
    for route, callback in _walk(get_resolver().url_patterns):
        if not route.startswith(V1) or "(?P" in route or "<" in route or route == V1:
            continue
        actions = getattr(callback, "actions", None)
        view_class = getattr(callback, "cls", None) or getattr(callback, "view_class", None)
        takes_get = "get" in actions if actions is not None else hasattr(view_class, "get")
        if takes_get:
            found.append(f"/{route}")
    return sorted(set(found))


ENDPOINTS = v1_list_endpoints()


def test_the_urlconf_walk_finds_the_endpoints() -> None:
    # A walk that found nothing would make every test below pass vacuously.
    for expected in ("/api/v1/usage/jobs/", "/api/v1/billed/people/", "/api/v1/compare/"):
        assert expected in ENDPOINTS
    assert len(ENDPOINTS) >= 20


def _taken(client: APIClient, endpoint: str) -> list[str]:
    """The parameters `endpoint` takes, as its 400 for an unknown one lists them."""
    response = client.get(endpoint, {"no_such_parameter": "1"})
    assert response.status_code == 400, (endpoint, response.content)
    (message,) = response.json()["no_such_parameter"]
    assert message.startswith("unknown query parameter")
    return message.split("this endpoint takes ", 1)[1].split(", ")


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_an_unknown_parameter_is_a_400_naming_it(seeded: Seeded, endpoint: str) -> None:
    client = seeded.cast.client("operator")
    taken = _taken(client, endpoint)
    assert "format" in taken
    # No endpoint takes the window under another name than start/end (old names are aliases).
    assert not {"since", "until", "from", "to"} & set(taken), (endpoint, taken)


def _windows(taken: list[str]) -> list[str]:
    """The prefixes of the windows an endpoint takes ('' for start/end, 'before_' ...)."""
    return [name.removesuffix("start") for name in taken if name.endswith("start")]


WINDOWED = [
    "/api/v1/usage/",
    "/api/v1/usage/claims/",
    "/api/v1/usage/jobs/",
    "/api/v1/usage/users/",
    "/api/v1/billed/people/",
    "/api/v1/billed/jobs/",
    "/api/v1/billed/focus/",
    "/api/v1/periods/",
    "/api/v1/statements/",
    "/api/v1/statement-lines/",
    "/api/v1/adjustments/",
    "/api/v1/decisions/",
    "/api/v1/compare/",
]


def test_the_windowed_endpoints_are_those_the_urlconf_has(seeded: Seeded) -> None:
    client = seeded.cast.client("operator")
    assert [e for e in ENDPOINTS if _windows(_taken(client, e))] == sorted(WINDOWED)


def _full_query(taken: list[str], prefixes: list[str]) -> dict[str, str]:
    # The other windows of a query that holds several, and compare's team (the fleet).
    return {f"{prefix}{bound}": day for prefix in prefixes for bound, day in GOOD.items()}


GOOD = {"start": "2026-11-02", "end": "2026-11-09"}


@pytest.mark.parametrize("endpoint", WINDOWED)
@pytest.mark.parametrize(
    ("start", "end", "says"),
    [
        ("2026-11-09", "2026-11-02", "the window is reversed"),
        ("2026-11-02T05:00Z", "2026-11-02T05:00Z", "the window is empty"),
    ],
)
def test_a_reversed_or_empty_window_is_a_400_naming_end(
    seeded: Seeded, endpoint: str, start: str, end: str, says: str
) -> None:
    client = seeded.cast.client("operator")
    taken = _taken(client, endpoint)
    prefixes = _windows(taken)
    for prefix in prefixes:
        query = {**_full_query(taken, prefixes), f"{prefix}start": start, f"{prefix}end": end}
        response = client.get(endpoint, query)
        assert response.status_code == 400, (endpoint, query, response.content)
        assert says in " ".join(response.json()[f"{prefix}end"])


@pytest.mark.parametrize("endpoint", WINDOWED)
def test_a_good_window_is_answered(seeded: Seeded, endpoint: str) -> None:
    client = seeded.cast.client("operator")
    taken = _taken(client, endpoint)
    response = client.get(endpoint, _full_query(taken, _windows(taken)))
    assert response.status_code == 200, response.content
    assert "Deprecation" not in response


def test_the_reported_query_is_refused_rather_than_answered_with_all_time(
    seeded: Seeded,
) -> None:
    # Issue 35: billed's names on a usage endpoint answered 200 with all-time data.
    client = seeded.cast.client("finance")
    response = client.get(
        "/api/v1/usage/jobs/",
        {"team": "alpha", "start": "2026-11-02", "end": "2026-11-09", "snice": "x"},
    )
    assert response.status_code == 400
    assert "snice" in response.json()


@pytest.mark.parametrize(
    ("endpoint", "old", "new"),
    [
        ("/api/v1/usage/", ("from", "to"), ("start", "end")),
        ("/api/v1/decisions/", ("from", "to"), ("start", "end")),
        ("/api/v1/billed/people/", ("since", "until"), ("start", "end")),
    ],
)
def test_old_names_work_for_one_release_with_a_deprecation_header(
    seeded: Seeded, endpoint: str, old: tuple[str, str], new: tuple[str, str]
) -> None:
    client = seeded.cast.client("operator")
    day = seeded.last.start
    window = (f"{day:%Y-%m-%d}", f"{seeded.last.end:%Y-%m-%d}")
    by_old = client.get(endpoint, dict(zip(old, window, strict=True)))
    by_new = client.get(endpoint, dict(zip(new, window, strict=True)))
    assert by_old.status_code == by_new.status_code == 200
    assert by_old.json() == by_new.json()
    assert by_old["Deprecation"] == "true"
    assert f"query parameter {old[0]} is deprecated: use {new[0]}" in by_old["Warning"]
    assert "Deprecation" not in by_new
    # An old name on an endpoint that never took the window is unknown, not an alias.
    refused = client.get("/api/v1/quotas/", {old[0]: window[0]})
    assert refused.status_code == 400 and old[0] in refused.json()


def test_a_period_by_label_is_a_window(seeded: Seeded) -> None:
    client = seeded.cast.client("finance")
    label = seeded.last.label
    by_label = client.get("/api/v1/usage/", {"period": label})
    by_bounds = client.get(
        "/api/v1/usage/",
        {"start": f"{seeded.last.start:%Y-%m-%d}", "end": f"{seeded.last.end:%Y-%m-%d}"},
    )
    assert by_label.status_code == 200
    assert by_label.json()["results"] and by_label.json() == by_bounds.json()
    both = client.get("/api/v1/usage/", {"period": label, "start": "2026-11-02"})
    assert both.status_code == 400 and "not both" in " ".join(both.json()["period"])


def test_the_schema_documents_what_each_endpoint_takes(seeded: Seeded) -> None:
    client = seeded.cast.client("operator")
    schema = client.get("/api/schema/", {"format": "json"}).json()
    for endpoint in ENDPOINTS:
        documented = {
            parameter["name"]
            for parameter in schema["paths"][endpoint]["get"].get("parameters", [])
            if parameter["in"] == "query"
        }
        assert documented | {"format"} == set(_taken(client, endpoint)), endpoint


# --- CSRF and methods -------------------------------------------------------------------------


def _token_client(user: Any) -> APIClient:
    client = APIClient(enforce_csrf_checks=True)
    token = create_token(user=user, days=1, actor="test").token
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    return client


def test_a_token_post_to_no_endpoint_is_a_json_404(cast: Cast) -> None:
    response = _token_client(cast.finance).post("/api/v1/no-such-thing/", {}, format="json")
    assert response.status_code == 404
    assert response["Content-Type"] == "application/json"
    assert "No API endpoint at /api/v1/no-such-thing/" in response.json()["detail"]


def test_a_token_put_on_a_read_only_endpoint_is_a_json_405(cast: Cast) -> None:
    response = _token_client(cast.finance).put("/api/v1/usage/", {}, format="json")
    assert response.status_code == 405
    assert response.json()["detail"] == 'Method "PUT" not allowed.'


def test_a_session_post_without_its_csrf_token_is_still_refused(seeded: Seeded) -> None:
    client = Client(enforce_csrf_checks=True)
    client.force_login(seeded.cast.finance)
    response = client.post(
        f"/api/v1/periods/{seeded.last.pk}/close/", {}, content_type="application/json"
    )
    assert response.status_code == 403
    assert re.search("CSRF", response.json()["detail"])
    seeded.last.refresh_from_db()
    assert seeded.last.closed_at is None
