"""/healthz, /readyz and /metrics through the Django test client, and the port split."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request
from typing import Any
from unittest import mock

import pytest
import redis
from django.db import OperationalError
from django.test import Client
from pytest_django.fixtures import SettingsWrapper

from config import ops_urls
from config.listeners import ListenerMiddleware, parse_listeners
from core import metrics
from quota.models import Reservation

pytestmark = pytest.mark.django_db


def test_healthz_needs_nothing(client: Client) -> None:
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.content == b"ok"


def test_readyz_with_the_database_up(client: Client, settings: SettingsWrapper) -> None:
    settings.CELERY_BROKER_URL = "memory://"
    settings.REDIS_URL = None
    response = client.get("/readyz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "checks": {"database": "ok"}, "failed": []}


def test_readyz_with_the_database_down(client: Client, settings: SettingsWrapper) -> None:
    settings.CELERY_BROKER_URL = "memory://"
    settings.REDIS_URL = None
    refused = OperationalError('connection to server at "db" (10.0.0.5), port 5432 failed')
    with mock.patch.object(ops_urls.connection, "cursor", side_effect=refused):
        response = client.get("/readyz")
    assert response.status_code == 503
    assert response.json() == {
        "status": "unavailable",
        "checks": {"database": "unavailable: OperationalError"},
        "failed": ["database"],
    }


def test_readyz_checks_redis_when_it_is_the_broker(
    client: Client, settings: SettingsWrapper
) -> None:
    # Nothing listens on port 1: the connection is refused at once.
    settings.CELERY_BROKER_URL = "redis://127.0.0.1:1/0"
    response = client.get("/readyz")
    assert response.status_code == 503
    body = response.json()
    assert body["failed"] == ["redis"]
    assert body["checks"]["database"] == "ok"
    with mock.patch.object(redis.Redis, "ping", return_value=True):
        assert client.get("/readyz").status_code == 200


def test_metrics_need_the_token_when_one_is_set(client: Client, settings: SettingsWrapper) -> None:
    settings.TALLY_METRICS_TOKEN = "s3cret"
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    response = client.get("/metrics", HTTP_AUTHORIZATION="Bearer s3cret")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain; version=")


def _scrape(port: int, token: str | None) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as refused:
        return refused.code, refused.read().decode()


def test_the_worker_and_syncer_metrics_port_wants_the_token_when_one_is_set() -> None:
    # The process-metrics server the worker and the syncer run, over real HTTP.
    server = metrics.start_metrics_server(0, address="127.0.0.1", token="s3cret")
    try:
        port = server.server_address[1]
        assert _scrape(port, None)[0] == 401
        assert _scrape(port, "wrong")[0] == 401
        status, text = _scrape(port, "s3cret")
        assert status == 200
        assert "tally_" in text or "python_info" in text
    finally:
        server.shutdown()
        server.server_close()
    # Without a token (development), anyone who reaches the port reads it.
    server = metrics.start_metrics_server(0, address="127.0.0.1")
    try:
        assert _scrape(server.server_address[1], None)[0] == 200
    finally:
        server.shutdown()
        server.server_close()


def test_metrics_without_a_token_answer_internal_addresses_only(
    client: Client, settings: SettingsWrapper
) -> None:
    settings.TALLY_METRICS_TOKEN = None
    settings.TALLY_METRICS_ANONYMOUS = True
    assert client.get("/metrics", REMOTE_ADDR="127.0.0.1").status_code == 200
    assert client.get("/metrics", REMOTE_ADDR="10.42.0.7").status_code == 200
    assert client.get("/metrics", REMOTE_ADDR="8.8.8.8").status_code == 403


def test_metrics_without_a_token_refuse_every_scrape_unless_anonymous_is_allowed(
    client: Client, settings: SettingsWrapper
) -> None:
    settings.TALLY_METRICS_TOKEN = None
    settings.TALLY_METRICS_ANONYMOUS = False
    for address in ("127.0.0.1", "10.42.0.7", "8.8.8.8"):
        response = client.get("/metrics", REMOTE_ADDR=address)
        assert response.status_code == 403
        assert b"set TALLY_METRICS_TOKEN" in response.content
        assert b"# TYPE" not in response.content


def test_anonymous_metrics_are_allowed_by_default_with_debug_only() -> None:
    def anonymous(debug: str) -> str:
        code = "from django.conf import settings; print(settings.TALLY_METRICS_ANONYMOUS)"
        environment = {k: v for k, v in os.environ.items() if not k.startswith("TALLY_METRICS")}
        result = subprocess.run(
            [sys.executable, "-c", f"import django; django.setup(); {code}"],
            env={**environment, "DEBUG": debug, "SECRET_KEY": "t"},
            capture_output=True,
            text=True,
            check=True,
        )
        return result.stdout.strip()

    assert anonymous("true") == "True"
    assert anonymous("false") == "False"


def test_check_deploy_warns_when_metrics_have_no_token(settings: SettingsWrapper) -> None:
    from django.core import checks

    settings.TALLY_METRICS_TOKEN = None
    warnings = [m.id for m in checks.run_checks(include_deployment_checks=True)]
    assert "tally.W002" in warnings
    settings.TALLY_METRICS_TOKEN = "s3cret"
    warnings = [m.id for m in checks.run_checks(include_deployment_checks=True)]
    assert "tally.W002" not in warnings


def test_metrics_expose_the_counters_and_outstanding_reservations(
    client: Client, settings: SettingsWrapper, fleet: Any
) -> None:
    settings.TALLY_METRICS_TOKEN = None
    settings.TALLY_METRICS_ANONYMOUS = True
    metrics.WEBHOOK_DECISIONS.labels(webhook="validate", result="denied", rule="gpus").inc()
    metrics.WEBHOOK_LATENCY.labels(webhook="validate").observe(0.02)
    text = client.get("/metrics").content.decode()
    assert 'tally_webhook_decisions_total{result="denied",rule="gpus",webhook="validate"}' in text
    assert "tally_webhook_duration_seconds_bucket" in text
    expected = Reservation.objects.filter(state="reserved").count()
    assert f'tally_reservations_outstanding{{state="reserved"}} {float(expected)}' in text
    assert 'tally_reservations_outstanding{state="allocated"}' in text


def test_multiprocess_mode_merges_the_files(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    from prometheus_client import CollectorRegistry, Counter, values

    values.ValueClass = values.get_value_class()
    try:
        counter = Counter("tally_test_multiprocess", "test", registry=CollectorRegistry())
        counter.inc(3)
        text = metrics.render(include_database=False).decode()
    finally:
        monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR")
        values.ValueClass = values.get_value_class()
    assert "tally_test_multiprocess_total 3.0" in text
    assert list(tmp_path.glob("counter_*.db"))


# -- listeners ----------------------------------------------------------------------------

LISTENERS = ["8443=/admission/", "8444=/ingest/", "9090=/metrics"]


@pytest.mark.parametrize(
    ("port", "path", "served"),
    [
        ("8443", "/admission/resourceclaims", True),
        ("8443", "/api/v1/teams", False),
        ("8443", "/metrics", False),
        ("8444", "/ingest/samples", True),
        ("8444", "/admission/resourceclaims", False),
        ("9090", "/metrics", True),
        ("9090", "/admin/", False),
        ("8000", "/admin/", True),
        ("8000", "/admission/resourceclaims", False),
        ("8000", "/ingest/samples", False),
        ("8000", "/metrics", False),
        ("8443", "/healthz", True),
        ("9090", "/readyz", True),
    ],
)
def test_each_port_serves_only_its_paths(port: str, path: str, served: bool) -> None:
    with mock.patch("config.listeners.settings") as settings:
        settings.TALLY_LISTENERS = LISTENERS
        middleware = ListenerMiddleware(lambda request: None)  # type: ignore[arg-type,return-value]
    assert middleware.serves(port, path) is served


def test_the_port_split_through_the_client(client: Client, settings: SettingsWrapper) -> None:
    settings.TALLY_LISTENERS = LISTENERS
    if "config.listeners.ListenerMiddleware" not in settings.MIDDLEWARE:
        settings.MIDDLEWARE = ["config.listeners.ListenerMiddleware", *settings.MIDDLEWARE]
    settings.TALLY_METRICS_TOKEN = None
    settings.TALLY_METRICS_ANONYMOUS = True
    assert client.get("/metrics", SERVER_PORT="8000").status_code == 404
    assert client.get("/metrics", SERVER_PORT="9090").status_code == 200
    assert client.post("/admission/resourceclaims", SERVER_PORT="8444").status_code == 404
    assert client.get("/healthz", SERVER_PORT="8444").status_code == 200


def test_a_malformed_listener_names_itself() -> None:
    from django.core.exceptions import ImproperlyConfigured

    with pytest.raises(ImproperlyConfigured, match="8443:/admission/"):
        parse_listeners(["8443:/admission/"])
