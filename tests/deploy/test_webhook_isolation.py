"""The webhook keeps its deadline while the database is silent and the portal is busy (issue 40,
finding 4).

gunicorn as deployed (deploy/gunicorn.conf.py: one worker, its 4 threads, a portal and a
webhook listener), its database behind a proxy that goes silent (it holds everything sent, as
a network that drops packets does). Sixteen API clients keep asking for as long as the
silence lasts: before, they held every thread for the whole outage and the reviews waited
behind them, past the API server's 3 s. Now the webhook listener has threads of its own, so
each review is answered (denied: the database cannot be reached, failing closed) within the
API server's timeout; and the API requests end at their own deadline with a 503 that says why,
rather than when the network comes back.
"""

from __future__ import annotations

import http.client
import json
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from django.contrib.auth.models import Group, User
from django.db import connection

from config.deadlines import CLIENT_GRACE_SECONDS
from teams.selectors import FINANCE_GROUP
from teams.tokens import create_token
from tests.deploy.tls import Gunicorn, Pki
from tests.quota.fixtures import claim, gpu_request, make_team, review
from tests.quota.test_unreachable_database import SilentProxy

API_SERVER_TIMEOUT_SECONDS = 3.0
REQUEST_DEADLINE_SECONDS = 2.0
PORTAL_CLIENTS = 16
REVIEWS = 8
# The network comes back after this at the latest (the reported outage: 45 s).
SILENCE_SECONDS = 40.0


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    seconds: float


def _send(context: ssl.SSLContext, port: int, method: str, path: str, **headers: str) -> Answer:
    body = headers.pop("body", None)
    connection = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=60)
    started = time.monotonic()
    try:
        connection.request(method, path, body, {"Content-Type": "application/json", **headers})
        response = connection.getresponse()
        return Answer(response.status, response.read(), time.monotonic() - started)
    finally:
        connection.close()


def _admit(context: ssl.SSLContext, port: int, name: str) -> Answer:
    body = json.dumps(review(claim(name, [gpu_request(1)]), uid=f"uid-{name}"))
    return _send(context, port, "POST", "/admission/resourceclaims", body=body)


def _allowed(answer: Answer) -> bool:
    return answer.status == 200 and bool(json.loads(answer.body)["response"]["allowed"])


@pytest.fixture
def proxy() -> Iterator[SilentProxy]:
    settings = connection.settings_dict
    silent = SilentProxy(str(settings["HOST"] or "127.0.0.1"), int(settings["PORT"] or 5432))
    yield silent
    silent.close()


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("fleet")
def test_the_webhook_answers_in_time_while_the_portal_waits_on_a_silent_database(
    proxy: SilentProxy, tmp_path: Path
) -> None:
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 25}])
    reader = User.objects.create_user("fin")  # finance: reads every team
    reader.groups.add(Group.objects.create(name=FINANCE_GROUP))
    token = create_token(user=reader, days=1, actor="test").token
    pki = Pki(tmp_path)
    serving_ca = pki.ca("serving-ca")
    server_cert = pki.leaf("tally-web", by=serving_ca, server=True)
    context = pki.client_context(serving_ca, None)
    settings = connection.settings_dict
    gunicorn = Gunicorn(
        tmp_path,
        listeners=2,
        environment={
            "TLS_CERT_FILE": str(server_cert.cert_file),
            "TLS_KEY_FILE": str(server_cert.key_file),
            "WEB_CONCURRENCY": "1",
            "GUNICORN_THREADS": "4",
            "TALLY_WARM_UP_SECONDS": "0",
            "DATABASE_URL": f"postgres://{settings['USER']}@127.0.0.1:{proxy.port}/"
            f"{settings['NAME']}",
            "TALLY_REQUEST_DEADLINE_MS": str(int(REQUEST_DEADLINE_SECONDS * 1000)),
            "LOG_FORMAT": "json",  # each request's duration, as the server measured it
        },
    )
    portal_port, webhook_port = gunicorn.ports
    gunicorn.environment["TALLY_LISTENERS"] = f"{webhook_port}=/admission/"
    api = {"Authorization": f"Token {token}"}
    with gunicorn:
        gunicorn.wait_until_serving(context)
        # Warm: connections made, the fleet's shapes loaded.
        for attempt in range(5):
            if _allowed(_admit(context, webhook_port, f"warm-{attempt}")):
                break
        else:
            pytest.fail(f"no claim admitted through the proxy:\n{gunicorn.log}")
        assert _send(context, portal_port, "GET", "/api/v1/teams/", **api).status == 200

        proxy.hold_from(b"")  # silent from the next byte anyone sends
        network_back = threading.Timer(SILENCE_SECONDS, proxy.release)
        network_back.start()
        stop = threading.Event()
        portal_answers: list[Answer] = []

        def portal_client() -> None:
            while not stop.is_set():
                portal_answers.append(_send(context, portal_port, "GET", "/api/v1/teams/", **api))

        clients = [threading.Thread(target=portal_client) for _ in range(PORTAL_CLIENTS)]
        try:
            for client in clients:
                client.start()
            time.sleep(0.5)  # every portal thread taken
            reviews = [_admit(context, webhook_port, f"silent-{n}") for n in range(REVIEWS)]
        finally:
            stop.set()
            for client in clients:
                client.join(timeout=SILENCE_SECONDS + 30)
            network_back.cancel()
            proxy.release()
        after = _admit(context, webhook_port, "after")
    log = gunicorn.log

    seconds = sorted(round(answer.seconds, 2) for answer in reviews)
    assert seconds[-1] < API_SERVER_TIMEOUT_SECONDS, (seconds, log)
    for answer in reviews:
        response = json.loads(answer.body)["response"]
        assert response["allowed"] is False, (response, log)
        assert response["status"]["reason"] == "ServiceUnavailable", (response, log)
    # The API's requests ended at their own deadline, with a 503 that says why.
    assert portal_answers, log
    assert {answer.status for answer in portal_answers} == {503}, (portal_answers[:3], log)
    assert b"the database did not answer within this request's deadline" in (portal_answers[0].body)
    # Each took its thread for no longer than its deadline (the clients waited longer: 16 of
    # them queue for 4 threads).
    served = [
        line["duration_ms"] / 1000
        for line in map(json.loads, (text for text in log.splitlines() if text.startswith("{")))
        if line.get("logger") == "tally.request" and line.get("status") == 503
    ]
    assert len(served) == len(portal_answers), log
    bound = REQUEST_DEADLINE_SECONDS + CLIENT_GRACE_SECONDS + 0.5
    assert max(served) < bound, (sorted(served)[-5:], log)
    assert _allowed(after), (after, log)
