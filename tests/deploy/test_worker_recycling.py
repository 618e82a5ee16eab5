"""No webhook request is dropped when gunicorn recycles a web worker (issue 17, item 7).

gunicorn as deployed (deploy/gunicorn.conf.py: two workers of four threads, TLS, the webhook's
client CA), but with `--max-requests 40` so that workers recycle often (and `--preload`, so
that a new worker does not set Django up again: it only makes recycles cheaper), under
clients that keep their connections alive and send webhook requests back to back, each with
the API server's client certificate, as the API server does. A client reconnects when its
connection was closed between requests (as Go's HTTP client does: it sees the close before it
reuses the connection) or after `Connection: close`; every other failure (reset, TLS EOF, no
answer) is a dropped request: the API server does not retry a webhook POST, and
failurePolicy: Fail denies the CREATE.

The load runs until the workers have recycled RECYCLES times; MAX_LOAD_SECONDS is only a
safety net for a server that stops recycling, never the expected length of a run (a few
seconds on an idle machine, longer on a busy one). With gunicorn's own gthread worker
(`--worker-class gthread`) this drops about two requests per recycle; the deployed
`DrainingThreadWorker` drops none.
"""

from __future__ import annotations

import http.client
import json
import select
import ssl
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.deploy.tls import Gunicorn, Pki
from tests.quota.fixtures import claim, gpu_request, review

RECYCLES = 8
# A safety net only: the load stops at RECYCLES recycles, however long a busy machine takes.
MAX_LOAD_SECONDS = 120.0
# Fewer recycles than this (the safety net ran out) would prove little.
MIN_RECYCLES = 4
CLIENTS = 8
MAX_REQUESTS = 40
RECYCLED = "Autorestarting worker"
PATH = "/admission/resourceclaims"


@dataclass
class Load:
    requests: int = 0
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, error: str | None) -> None:
        with self.lock:
            self.requests += 1
            if error is not None:
                self.errors.append(error)


def _closed_between_requests(connection: http.client.HTTPSConnection) -> bool:
    """The server ended an idle connection (readable while no request is out: its EOF)."""
    return connection.sock is not None and bool(select.select([connection.sock], [], [], 0)[0])


def _client(
    port: int, context: ssl.SSLContext, stop: threading.Event, load: Load, number: int
) -> None:
    connection = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=15)
    sent = 0
    while not stop.is_set():
        if _closed_between_requests(connection):
            connection.close()  # the next request connects again
        uid = f"client-{number}-{sent}"
        sent += 1
        # An UPDATE: the webhook answers it without its database, so the load is the server's.
        body = json.dumps(review(claim(uid, [gpu_request(1)]), uid=uid, operation="UPDATE"))
        try:
            connection.request("POST", PATH, body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            answer = response.read()
        except (OSError, http.client.HTTPException) as exc:
            load.count(f"{uid}: {exc!r}")
            connection.close()
            continue
        if response.status != 200 or json.loads(answer)["response"]["uid"] != uid:
            load.count(f"{uid}: HTTP {response.status}: {answer[:200]!r}")
        else:
            load.count(None)
    connection.close()


def run_load(gunicorn: Gunicorn, context: ssl.SSLContext, *, recycles: int, seconds: float) -> Load:
    """CLIENTS clients until gunicorn has recycled `recycles` workers (or has exited), or for
    at most `seconds`."""
    load, stop = Load(), threading.Event()
    threads = [
        threading.Thread(target=_client, args=(gunicorn.port, context, stop, load, number))
        for number in range(CLIENTS)
    ]
    for thread in threads:
        thread.start()
    until = time.monotonic() + seconds
    while time.monotonic() < until and gunicorn.log.count(RECYCLED) < recycles:
        if gunicorn.process is not None and gunicorn.process.poll() is not None:
            break  # the server is gone: waiting out the safety net would show nothing more
        time.sleep(0.2)
    stop.set()
    for thread in threads:
        thread.join()
    return load


def recycling_server(folder: Path, *arguments: str) -> tuple[Gunicorn, ssl.SSLContext]:
    """gunicorn as deployed with the webhook's client CA, recycling workers every
    MAX_REQUESTS; and the API server's client context."""
    pki = Pki(folder)
    serving_ca = pki.ca("serving-ca")
    server = pki.leaf("tally-web", by=serving_ca, server=True)
    callers_ca = pki.ca("webhook-callers")
    apiserver = pki.leaf("kube-apiserver", by=callers_ca)
    gunicorn = Gunicorn(
        folder,
        environment={
            "TLS_CERT_FILE": str(server.cert_file),
            "TLS_KEY_FILE": str(server.key_file),
            "TALLY_WEBHOOK_CLIENT_CA_FILE": str(callers_ca.cert_file),
            "TALLY_WEBHOOK_CLIENT_NAMES": "kube-apiserver",
            # Nothing listens there: a request that needed the database would fail.
            "DATABASE_URL": "postgres://tally@127.0.0.1:1/tally",
            "TALLY_WARM_UP_SECONDS": "0",
            "WEB_CONCURRENCY": "2",
        },
        arguments=(
            *("--max-requests", str(MAX_REQUESTS), "--max-requests-jitter", "10", "--preload"),
            *arguments,
        ),
    )
    return gunicorn, pki.client_context(serving_ca, apiserver)


def test_recycling_workers_drop_no_webhook_request(tmp_path: Path) -> None:
    gunicorn, context = recycling_server(tmp_path)
    with gunicorn:
        gunicorn.wait_until_serving(context)
        load = run_load(gunicorn, context, recycles=RECYCLES, seconds=MAX_LOAD_SECONDS)
    recycles = gunicorn.log.count(RECYCLED)
    assert recycles >= MIN_RECYCLES, f"only {recycles} recycles:\n{gunicorn.log[-3000:]}"
    assert load.requests > MIN_RECYCLES * MAX_REQUESTS
    assert load.errors == [], (
        f"{len(load.errors)} of {load.requests} requests dropped across {recycles} recycles: "
        f"{load.errors[:5]}"
    )
