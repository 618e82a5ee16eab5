"""Only the API server's client certificate reaches the webhooks (issue 17, item 4).

Through real TLS: gunicorn as deployed (deploy/gunicorn.conf.py) with a client CA and an
allowed name, on the test database, sent a real CREATE review by callers without a
certificate, with one from another CA, with one of the right CA and the wrong name, and with
the API server's; only the last is decided, and only it reserves. Then `config.webhook_auth`
on its own, over an in-process TLS connection, and the warnings when no CA is configured.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from django.core import checks
from django.db import connection
from django.http import HttpResponse
from django.test import RequestFactory

from config.webhook_auth import (
    NO_CA_WARNING,
    CallerRefused,
    WebhookCallerMiddleware,
    authenticate,
)
from db.embedded import postgres_url
from quota.models import AdmissionDecision, Reservation
from tests.deploy.tls import Gunicorn, Issued, Pki
from tests.quota.fixtures import claim, gpu_request, make_team, review

PATH = "/admission/resourceclaims"


@dataclass(frozen=True)
class Callers:
    pki: Pki
    serving_ca: Issued
    callers_ca: Issued
    server: Issued

    def context(self, client: Issued | None) -> ssl.SSLContext:
        return self.pki.client_context(self.serving_ca, client)


@pytest.fixture(scope="module")
def callers(tmp_path_factory: pytest.TempPathFactory) -> Callers:
    pki = Pki(tmp_path_factory.mktemp("pki"))
    serving_ca = pki.ca("serving-ca")
    callers_ca = pki.ca("webhook-callers")
    pki.ca("another-ca")
    pki.leaf("kube-apiserver", by=callers_ca)
    pki.leaf("kube-apiserver-by-san", by=callers_ca, dns=("kube-apiserver",))
    pki.leaf("some-kubelet", by=callers_ca)
    pki.leaf("kube-apiserver-elsewhere", by=pki.issued["another-ca"])
    server = pki.leaf("tally-web", by=serving_ca, server=True)
    return Callers(pki, serving_ca, callers_ca, server)


def _environment(callers: Callers, **more: str) -> dict[str, str]:
    return {
        "TLS_CERT_FILE": str(callers.server.cert_file),
        "TLS_KEY_FILE": str(callers.server.key_file),
        "WEB_CONCURRENCY": "1",
        "TALLY_WARM_UP_SECONDS": "0",
        **more,
    }


@pytest.fixture(scope="module")
def webhook(
    callers: Callers, tmp_path_factory: pytest.TempPathFactory, django_db_setup: None
) -> Iterator[Gunicorn]:
    """gunicorn on the test database, trusting `webhook-callers` for `kube-apiserver`."""
    environment = _environment(
        callers,
        DATABASE_URL=postgres_url(connection.settings_dict),
        TALLY_WEBHOOK_CLIENT_CA_FILE=str(callers.callers_ca.cert_file),
        TALLY_WEBHOOK_CLIENT_NAMES="kube-apiserver",
    )
    with Gunicorn(tmp_path_factory.mktemp("gunicorn"), environment=environment) as server:
        server.wait_until_serving(callers.context(None))
        yield server


def _admit(webhook: Gunicorn, context: ssl.SSLContext, name: str) -> tuple[int, bytes]:
    """POST a CREATE review of claim `name` (one GPU): (status, body)."""
    body = json.dumps(review(claim(name, [gpu_request(1)]), uid=f"uid-{name}"))
    connection = http.client.HTTPSConnection("127.0.0.1", webhook.port, context=context, timeout=30)
    try:
        connection.request("POST", PATH, body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def _nothing_decided(name: str) -> None:
    assert not Reservation.objects.filter(name=name).exists()
    assert not AdmissionDecision.objects.filter(name=name).exists()


@pytest.fixture
def team(fleet: None) -> None:
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 8}])


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("team")
@pytest.mark.parametrize("certificate", ["kube-apiserver", "kube-apiserver-by-san"])
def test_the_api_server_is_decided_and_reserves(
    webhook: Gunicorn, callers: Callers, certificate: str
) -> None:
    status, body = _admit(webhook, callers.context(callers.pki.issued[certificate]), "train")
    assert status == 200, body
    assert json.loads(body)["response"]["allowed"] is True
    assert Reservation.objects.filter(name="train").count() == 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("team")
@pytest.mark.parametrize(
    ("certificate", "reason"),
    [
        (None, "no client certificate presented"),
        (
            "some-kubelet",
            "client certificate (some-kubelet) is not an allowed webhook caller",
        ),
    ],
    ids=["no-certificate", "wrong-name"],
)
def test_a_caller_without_the_certificate_is_refused_before_any_decision(
    webhook: Gunicorn, callers: Callers, certificate: str | None, reason: str
) -> None:
    client = callers.pki.issued[certificate] if certificate else None
    status, body = _admit(webhook, callers.context(client), "sneaky")
    assert status == 403
    assert body.decode() == f"webhook caller not authenticated: {reason}\n"
    _nothing_decided("sneaky")
    assert f"webhook caller refused: {reason} (from 127.0.0.1, POST {PATH})" in webhook.log


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("team")
def test_a_certificate_from_another_ca_fails_the_handshake(
    webhook: Gunicorn, callers: Callers
) -> None:
    context = callers.context(callers.pki.issued["kube-apiserver-elsewhere"])
    with pytest.raises((ssl.SSLError, ConnectionError, http.client.HTTPException)):
        _admit(webhook, context, "elsewhere")
    _nothing_decided("elsewhere")
    assert "certificate verify failed" in webhook.log


def test_other_paths_need_no_certificate(webhook: Gunicorn, callers: Callers) -> None:
    """Probes, the portal and the agents present none."""
    connection = http.client.HTTPSConnection(
        "127.0.0.1", webhook.port, context=callers.context(None), timeout=30
    )
    try:
        connection.request("GET", "/healthz")
        assert connection.getresponse().status == 200
    finally:
        connection.close()


# -- gunicorn's start ---------------------------------------------------------------------


def test_gunicorn_warns_when_the_webhooks_do_not_authenticate(
    callers: Callers, tmp_path: Path
) -> None:
    environment = _environment(callers, DATABASE_URL="postgres://tally@127.0.0.1:1/tally")
    with Gunicorn(tmp_path, environment=environment) as server:
        server.wait_until_serving(callers.context(None))
    (line,) = [line for line in server.log.splitlines() if NO_CA_WARNING in line]
    assert "[WARNING]" in line


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"TALLY_WEBHOOK_CLIENT_CA_FILE": "/nonexistent/ca.crt"},
            "TALLY_WEBHOOK_CLIENT_CA_FILE='/nonexistent/ca.crt' is not a readable PEM CA",
        ),
        (
            {"TALLY_WEBHOOK_CLIENT_CA_FILE": "{ca}", "TLS_CERT_FILE": "", "TLS_KEY_FILE": ""},
            "TALLY_WEBHOOK_CLIENT_CA_FILE is set but TLS is off",
        ),
    ],
    ids=["unreadable-ca", "no-tls"],
)
def test_gunicorn_refuses_a_client_ca_it_cannot_use(
    callers: Callers, tmp_path: Path, settings: dict[str, str], message: str
) -> None:
    ca = str(callers.callers_ca.cert_file)
    environment = _environment(callers, **{k: v.format(ca=ca) for k, v in settings.items()})
    server = Gunicorn(tmp_path, environment=environment)
    process = server.start()
    try:
        assert process.wait(timeout=60) == 1
    finally:
        server.stop()
    assert message in server.log


# -- config.webhook_auth on its own, over an in-process TLS connection ---------------------


@pytest.fixture
def tls_connection(callers: Callers) -> Iterator[Any]:
    """`connect(client)`: the server's end of a TLS connection made with gunicorn's
    context (the callers' CA, certificates optional) by a client presenting `client`."""
    ends: list[socket.socket] = []

    def connect(client: Issued | None) -> ssl.SSLSocket:
        server_context = ssl.create_default_context(
            ssl.Purpose.CLIENT_AUTH, cafile=str(callers.callers_ca.cert_file)
        )
        server_context.load_cert_chain(str(callers.server.cert_file), str(callers.server.key_file))
        server_context.verify_mode = ssl.CERT_OPTIONAL
        server_end, client_end = socket.socketpair()
        server = server_context.wrap_socket(
            server_end, server_side=True, do_handshake_on_connect=False
        )
        client_side = callers.context(client).wrap_socket(
            client_end, server_hostname="127.0.0.1", do_handshake_on_connect=False
        )
        ends.extend([server, client_side])
        # Neither end of a blocking handshake finishes without the other.
        handshake = threading.Thread(target=client_side.do_handshake)
        handshake.start()
        server.do_handshake()
        handshake.join()
        return server

    yield connect
    for end in ends:
        end.close()


@pytest.mark.parametrize(
    ("certificate", "allowed", "caller"),
    [
        ("kube-apiserver", ["kube-apiserver"], "kube-apiserver"),
        ("kube-apiserver-by-san", ["kube-apiserver"], "kube-apiserver"),
        ("some-kubelet", [], "some-kubelet"),  # no names: any certificate of the CA
    ],
)
def test_authenticate_accepts_an_allowed_verified_certificate(
    tls_connection: Any, callers: Callers, certificate: str, allowed: list[str], caller: str
) -> None:
    server = tls_connection(callers.pki.issued[certificate])
    assert authenticate({"gunicorn.socket": server}, allowed) == caller


def test_authenticate_refuses_what_is_not_an_allowed_verified_certificate(
    tls_connection: Any, callers: Callers
) -> None:
    with pytest.raises(CallerRefused, match=r"^no client certificate presented$"):
        authenticate({"gunicorn.socket": tls_connection(None)}, [])
    kubelet = tls_connection(callers.pki.issued["some-kubelet"])
    with pytest.raises(CallerRefused, match=r"\(some-kubelet\) is not an allowed webhook caller"):
        authenticate({"gunicorn.socket": kubelet}, ["kube-apiserver"])
    plain, other = socket.socketpair()
    with plain, other, pytest.raises(CallerRefused, match="the connection is not TLS"):
        authenticate({"gunicorn.socket": plain}, [])
    with pytest.raises(CallerRefused, match="the connection is not TLS"):
        authenticate({}, [])  # not gunicorn: runserver, the test client


def _middleware(settings: Any, ca_file: str) -> WebhookCallerMiddleware:
    settings.TALLY_WEBHOOK_CLIENT_CA_FILE = ca_file
    settings.TALLY_WEBHOOK_CLIENT_NAMES = ["kube-apiserver"]
    return WebhookCallerMiddleware(lambda request: HttpResponse("decided"))


def test_the_middleware_guards_only_the_webhooks_and_only_with_a_ca(settings: Any) -> None:
    factory = RequestFactory()
    guarded = _middleware(settings, "/etc/tally/webhook-ca.crt")
    refused = guarded(factory.post(PATH, b"{}", content_type="application/json"))
    assert refused.status_code == 403
    assert refused.content == b"webhook caller not authenticated: no client certificate: " + (
        b"the connection is not TLS\n"
    )
    assert guarded(factory.get("/healthz")).content == b"decided"
    assert guarded(factory.post("/ingest/samples")).content == b"decided"
    unguarded = _middleware(settings, "")
    assert unguarded(factory.post(PATH, b"{}", content_type="application/json")).content == (
        b"decided"
    )


def test_the_deployment_check_warns_without_a_ca(settings: Any) -> None:
    settings.TALLY_WEBHOOK_CLIENT_CA_FILE = ""
    found = checks.run_checks(include_deployment_checks=True, tags=[checks.Tags.security])
    (warning,) = [message for message in found if message.id == "tally.W001"]
    assert warning.level == checks.WARNING
    assert warning.msg == NO_CA_WARNING
    settings.TALLY_WEBHOOK_CLIENT_CA_FILE = "/etc/tally/webhook-ca.crt"
    found = checks.run_checks(include_deployment_checks=True, tags=[checks.Tags.security])
    assert "tally.W001" not in {message.id for message in found}
