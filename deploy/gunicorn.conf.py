"""Gunicorn settings for the web pods (copied into the image as /opt/tally/etc/).

One process group serves four listeners, one per audience, so NetworkPolicies can tell them
apart by port (see deploy/README.md); `config.listeners.ListenerMiddleware` keeps each
port to its paths:

    8000  portal, API, /healthz, /readyz   users (through the ingress)
    8443  /admission/...                   the Kubernetes API server (webhooks)
    8444  /ingest/...                      the node agents
    9090  /metrics                         monitoring

With TLS_CERT_FILE and TLS_KEY_FILE set (the cert-manager secret), every listener speaks
TLS; gunicorn reads the files for each new connection, so a renewed certificate is served
without a restart. With TALLY_WEBHOOK_CLIENT_CA_FILE set too, a client may present a
certificate, which must be issued by that CA (the handshake fails otherwise);
`config.webhook_auth` then lets only such a caller reach the webhooks.

Workers are `DrainingThreadWorker`s: gunicorn's gthread worker, but one that leaves (at
max_requests, or on SIGTERM) without dropping a request on the connections it holds, and that
serves the webhook listener's connections (the port TALLY_LISTENERS assigns `/admission/`)
with threads of their own (GUNICORN_WEBHOOK_THREADS): portal, API, admin and ingest requests
waiting on a database that does not answer hold only their own threads, never the ones the
API server's reviews need.
"""

from __future__ import annotations

import gc
import os
import selectors
import shutil
import ssl
import time
from concurrent import futures
from functools import partial
from pathlib import Path
from typing import Any

from gunicorn.workers.gthread import ThreadWorker

bind = os.environ.get(
    "GUNICORN_BIND", "0.0.0.0:8000 0.0.0.0:8443 0.0.0.0:8444 0.0.0.0:9090"
).split()
workers = int(os.environ.get("WEB_CONCURRENCY", "3"))
threads = int(os.environ.get("GUNICORN_THREADS", "4"))
# Each worker's threads for the webhook listener's connections, beside `threads` for the rest.
webhook_threads = int(os.environ.get("GUNICORN_WEBHOOK_THREADS", "4"))
# The webhook must answer within its 3 s; a request stuck past 30 s is a hung worker.
timeout = int(os.environ.get("GUNICORN_TIMEOUT", "30"))
graceful_timeout = 25  # inside the pod's terminationGracePeriodSeconds
keepalive = 75  # longer than the API server's and load balancers' idle timeouts
# A recycled worker first drains the connections it holds (DrainingThreadWorker, below).
max_requests = 5000
max_requests_jitter = 500
# The root filesystem is read-only: the heartbeat files go to memory.
worker_tmp_dir = "/dev/shm"
accesslog = None  # core.logging.RequestIdMiddleware logs each request, as JSON
errorlog = "-"
# No proxy inside the pod speaks for a client: TLS ends here and Tally is served at the root.
# gunicorn would otherwise take SCRIPT_NAME/PATH_INFO (which move the routed path away from the
# one the middlewares check) and X-Forwarded-Proto from any loopback peer (`kubectl
# port-forward`, a sidecar). Client addresses behind an ingress: TALLY_TRUSTED_PROXIES.
forwarded_allow_ips = ""  # gunicorn reads these two as comma-separated strings
forwarder_headers = ""
secure_scheme_headers: dict[str, str] = {}

certfile = os.environ.get("TLS_CERT_FILE") or None
keyfile = os.environ.get("TLS_KEY_FILE") or None
# The API server's webhook client certificate is checked against this CA, and only this one.
ca_certs = os.environ.get("TALLY_WEBHOOK_CLIENT_CA_FILE") or None
# Optional: the portal's, the agents' and the probes' clients present none.
cert_reqs = ssl.CERT_OPTIONAL if ca_certs else ssl.CERT_NONE


def on_starting(server: Any) -> None:
    check_client_authentication(server)
    # prometheus-client's multiprocess files from a previous run would be counted again.
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if directory:
        shutil.rmtree(directory, ignore_errors=True)
        Path(directory).mkdir(parents=True, exist_ok=True)


def check_client_authentication(server: Any) -> None:
    """Warn when the webhooks do not authenticate their caller; refuse to start with a client
    CA that cannot be used (the first connection would fail otherwise, not the start)."""
    from config.webhook_auth import NO_CA_WARNING

    if not ca_certs:
        server.log.warning("%s (see deploy/README.md)", NO_CA_WARNING)
        return
    if not certfile:
        raise SystemExit(
            "TALLY_WEBHOOK_CLIENT_CA_FILE is set but TLS is off (TLS_CERT_FILE is not set): "
            "client certificates need TLS"
        )
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=ca_certs)
    except (OSError, ssl.SSLError) as exc:
        raise SystemExit(
            f"TALLY_WEBHOOK_CLIENT_CA_FILE={ca_certs!r} is not a readable PEM CA: {exc}"
        ) from None


def post_worker_init(worker: Any) -> None:
    # Before it serves: the fleet's shapes loaded and the quota rules' selectors evaluated,
    # so that a new worker's (or a recycled one's) first admission is not the slow one.
    from quota.admission.service import warm_up_worker

    warm_up_worker()
    # What the worker holds now (Django, the project's modules, the fleet's shapes: hundreds of
    # thousands of objects) lives as long as it does: kept out of the cyclic collector's
    # reach, so that its full collections, which the objects of a few requests in flight on
    # the threads at once set off again and again, walk only what requests made (an ingest
    # worker of 4 threads spent a third of its CPU in them). The start's garbage goes first.
    gc.collect()
    gc.freeze()


def child_exit(server: Any, worker: Any) -> None:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)


def webhook_ports() -> frozenset[int]:
    """The ports TALLY_LISTENERS assigns the admission webhooks to (none: every port serves
    everything, as in development, and the webhooks share the threads)."""
    from config.listeners import parse_listeners
    from core.logging import ADMISSION_PREFIX

    entries = [e for e in os.environ.get("TALLY_LISTENERS", "").split(",") if e.strip()]
    return frozenset(
        int(port)
        for port, prefixes in parse_listeners(entries).items()
        if any(prefix.startswith(ADMISSION_PREFIX) for prefix in prefixes)
    )


class DrainingThreadWorker(ThreadWorker):
    """gthread, leaving without dropping a request.

    gunicorn 23's gthread worker, once it decides to leave (max_requests reached, SIGTERM),
    may still accept a connection in the same loop (gunicorn#3038), then exits: connections
    accepted but not read yet, idle keep-alive ones and those whose last response promised
    keep-alive are closed while their clients send the next request (connection reset, TLS
    EOF; the API server does not retry a webhook POST). This one, when it leaves, stops
    accepting (the other workers take new connections from the shared socket), answers the
    next request on each connection it holds with `Connection: close`, and exits when it holds
    none, or after `graceful_timeout`: a keep-alive connection still idle then is closed, as
    at its keep-alive timeout.
    """

    def init_process(self) -> None:
        # Set once the worker closes what it still holds (after draining): from then on a
        # finished request's connection is closed, as gthread does once it leaves.
        self.closing = False
        self.webhook_ports = webhook_ports()
        self.webhook_pool = futures.ThreadPoolExecutor(
            max_workers=webhook_threads, thread_name_prefix="webhook"
        )
        super().init_process()

    def enqueue_req(self, conn: Any) -> None:
        """gthread's, but a connection to a webhook port goes to the webhooks' own threads."""
        conn.init()
        port = conn.server[1] if isinstance(conn.server, tuple) else None
        pool = self.webhook_pool if port in self.webhook_ports else self.tpool
        self._wrap_future(pool.submit(self.handle, conn), conn)

    def accept(self, server: Any, listener: Any) -> None:
        if self.alive:
            super().accept(server, listener)

    def run(self) -> None:
        for listener in self.sockets:
            listener.setblocking(False)
            # The name is taken now: a closed listener has none (as gthread does).
            acceptor = partial(self.accept, listener.getsockname())
            self.poller.register(listener, selectors.EVENT_READ, acceptor)
        while self.alive:
            self.serve_events(wait=1.0)
            if not self.is_parent_alive():
                self.close_and_exit()
                return
        with self._lock:
            for listener in self.sockets:
                self.poller.unregister(listener)
        deadline = time.monotonic() + self.cfg.graceful_timeout
        while (self.nr_conns > 0 or self.futures) and time.monotonic() < deadline:
            self.serve_events(wait=0.05)
        self.close_and_exit()

    def serve_events(self, *, wait: float) -> None:
        """One turn of gthread's loop: accept, hand readable connections to the threads."""
        self.notify()
        if self.nr_conns < self.worker_connections:
            for key, _ in self.poller.select(wait):
                key.data(key.fileobj)
            result = futures.wait(self.futures, timeout=0, return_when=futures.FIRST_COMPLETED)
        else:
            result = futures.wait(self.futures, timeout=wait, return_when=futures.FIRST_COMPLETED)
        for done in result.done:
            self.futures.remove(done)
        self.murder_keepalived()

    def close_and_exit(self) -> None:
        self.closing = True
        self.tpool.shutdown(False)
        self.webhook_pool.shutdown(False)
        self.poller.close()
        for listener in self.sockets:
            listener.close()
        futures.wait(self.futures, timeout=self.cfg.graceful_timeout)

    def finish_request(self, fs: Any) -> None:
        # gthread's, but a connection whose response promised keep-alive stays open until
        # the worker closes: its next request is answered (with Connection: close) first.
        if fs.cancelled():
            self.nr_conns -= 1
            fs.conn.close()
            return
        try:
            keepalive, conn = fs.result()
            if keepalive and not self.closing:
                conn.sock.setblocking(False)
                conn.set_timeout()
                with self._lock:
                    self._keep.append(conn)
                    self.poller.register(
                        conn.sock,
                        selectors.EVENT_READ,
                        partial(self.on_client_socket_readable, conn),
                    )
            else:
                self.nr_conns -= 1
                conn.close()
        except Exception:
            self.nr_conns -= 1
            fs.conn.close()


worker_class = DrainingThreadWorker
