"""A `SCRIPT_NAME` cannot walk a request around the listeners' and the webhook's checks
(issue 40, finding 3).

gunicorn takes SCRIPT_NAME from a request header when the peer is in `forwarded_allow_ips`
(loopback by default: `kubectl port-forward`, a sidecar); the URL router then routes what
follows it, while checks made on the whole path saw something else. First through gunicorn as
deployed, with its four listeners and the webhook's client CA: a certificate-less
`POST /x/admission/resourceclaims` with `SCRIPT_NAME: /x` is refused on every listener and
reserves nothing, and `/x/metrics` is served on no listener but the metrics one (where the
header is ignored, so it is a 404 too). Then the middlewares on their own, given a request
whose SCRIPT_NAME a server did take: they judge the path the router routes.
"""

from __future__ import annotations

import http.client
import json
import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.db import connection
from django.http import HttpRequest, HttpResponse
from django.test import RequestFactory
from pytest_django.fixtures import SettingsWrapper

from config.listeners import ListenerMiddleware
from config.webhook_auth import WebhookCallerMiddleware
from db.embedded import postgres_url
from quota.models import AdmissionDecision, Reservation
from tests.deploy.tls import Gunicorn, Issued, Pki
from tests.quota.fixtures import claim, gpu_request, make_team, review

LISTENERS = ("portal", "webhook", "ingest", "metrics")
PREFIXES = {"webhook": "/admission/", "ingest": "/ingest/", "metrics": "/metrics"}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    pki = Pki(tmp_path_factory.mktemp("pki"))
    serving_ca = pki.ca("serving-ca")
    pki.leaf("tally-web", by=serving_ca, server=True)
    pki.ca("webhook-callers")
    return pki


def _context(pki: Pki) -> ssl.SSLContext:
    """A client that trusts the server and presents no certificate."""
    return pki.client_context(pki.issued["serving-ca"], None)


@pytest.fixture(scope="module")
def server(
    pki: Pki, tmp_path_factory: pytest.TempPathFactory, django_db_setup: None
) -> Iterator[tuple[Gunicorn, dict[str, int]]]:
    """gunicorn as deployed: a port per listener, assigned as deploy/base/web.yaml does."""
    server_cert: Issued = pki.issued["tally-web"]
    gunicorn = Gunicorn(
        tmp_path_factory.mktemp("gunicorn"),
        listeners=len(LISTENERS),
        environment={
            "TLS_CERT_FILE": str(server_cert.cert_file),
            "TLS_KEY_FILE": str(server_cert.key_file),
            "WEB_CONCURRENCY": "1",
            "TALLY_WARM_UP_SECONDS": "0",
            "DATABASE_URL": postgres_url(connection.settings_dict),
            "TALLY_WEBHOOK_CLIENT_CA_FILE": str(pki.issued["webhook-callers"].cert_file),
            "TALLY_WEBHOOK_CLIENT_NAMES": "kube-apiserver",
            # Loopback scrapes without a token: these tests are about the listeners' paths.
            "TALLY_METRICS_ANONYMOUS": "true",
        },
    )
    ports = dict(zip(LISTENERS, gunicorn.ports, strict=True))
    gunicorn.environment["TALLY_LISTENERS"] = ",".join(
        f"{ports[name]}={prefix}" for name, prefix in PREFIXES.items()
    )
    with gunicorn:
        gunicorn.wait_until_serving(_context(pki))
        yield gunicorn, ports


def _send(
    pki: Pki, port: int, method: str, path: str, body: str = "", script_name: str = "/x"
) -> tuple[int, bytes]:
    connection = http.client.HTTPSConnection("127.0.0.1", port, context=_context(pki), timeout=30)
    try:
        headers = {"Content-Type": "application/json"}
        if script_name:
            headers["SCRIPT_NAME"] = script_name
        connection.request(method, path, body or None, headers)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("fleet")
@pytest.mark.parametrize("listener", LISTENERS)
def test_a_script_name_does_not_reach_the_webhook_without_a_certificate(
    server: tuple[Gunicorn, dict[str, int]], pki: Pki, listener: str
) -> None:
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 8}])
    body = json.dumps(review(claim("mallory", [gpu_request(2)]), username="mallory"))
    status, answer = _send(pki, server[1][listener], "POST", "/x/admission/resourceclaims", body)
    assert status in {403, 404}, answer
    assert b'"allowed"' not in answer
    assert not Reservation.objects.filter(name="mallory").exists()
    assert not AdmissionDecision.objects.filter(name="mallory").exists()


@pytest.mark.parametrize("listener", LISTENERS)
def test_metrics_are_not_served_under_a_script_name(
    server: tuple[Gunicorn, dict[str, int]], pki: Pki, listener: str
) -> None:
    status, answer = _send(pki, server[1][listener], "GET", "/x/metrics")
    assert status == 404, answer
    assert b"# TYPE" not in answer


def test_the_listeners_still_serve_their_paths(
    server: tuple[Gunicorn, dict[str, int]], pki: Pki
) -> None:
    """The refusals above are the SCRIPT_NAME's doing: without it, metrics answer."""
    status, answer = _send(pki, server[1]["metrics"], "GET", "/metrics", script_name="")
    assert status == 200, answer
    assert b"# TYPE" in answer


# -- the middlewares, given a SCRIPT_NAME a server did take --------------------------------


def _with_script_name(method: str, path: str, port: str) -> HttpRequest:
    """A request as gunicorn makes it from `SCRIPT_NAME: /x` and `/x<path>`."""
    request = RequestFactory().generic(method, path, SERVER_PORT=port, SCRIPT_NAME="/x")
    assert (request.path, request.path_info) == ("/x" + path, path)
    return request


def test_the_webhook_check_judges_the_routed_path(
    settings: SettingsWrapper, tmp_path: Path
) -> None:
    settings.TALLY_WEBHOOK_CLIENT_CA_FILE = str(tmp_path / "ca.crt")
    settings.TALLY_WEBHOOK_CLIENT_NAMES = ["kube-apiserver"]
    guarded = WebhookCallerMiddleware(lambda request: HttpResponse("decided"))
    request = _with_script_name("POST", "/admission/resourceclaims", "8443")
    refused = guarded(request)
    assert refused.status_code == 403
    assert refused.content.startswith(b"webhook caller not authenticated: no client certificate")


def test_the_listeners_judge_the_routed_path(settings: SettingsWrapper) -> None:
    settings.TALLY_LISTENERS = ["8443=/admission/", "9090=/metrics"]
    listeners = ListenerMiddleware(lambda request: HttpResponse("served"))
    for path, port in [("/metrics", "8000"), ("/admission/resourceclaims", "8000")]:
        refused = listeners(_with_script_name("GET", path, port))
        assert refused.status_code == 404, path
    served = listeners(_with_script_name("GET", "/metrics", "9090"))
    assert served.content == b"served"
