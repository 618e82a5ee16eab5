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
without a restart.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

bind = os.environ.get(
    "GUNICORN_BIND", "0.0.0.0:8000 0.0.0.0:8443 0.0.0.0:8444 0.0.0.0:9090"
).split()
workers = int(os.environ.get("WEB_CONCURRENCY", "3"))
threads = int(os.environ.get("GUNICORN_THREADS", "4"))
worker_class = "gthread"
# The webhook must answer within its 3 s; a request stuck past 30 s is a hung worker.
timeout = int(os.environ.get("GUNICORN_TIMEOUT", "30"))
graceful_timeout = 25  # inside the pod's terminationGracePeriodSeconds
keepalive = 75  # longer than the API server's and load balancers' idle timeouts
max_requests = 5000
max_requests_jitter = 500
# The root filesystem is read-only: the heartbeat files go to memory.
worker_tmp_dir = "/dev/shm"
accesslog = None  # config.logging.RequestIdMiddleware logs each request, as JSON
errorlog = "-"
forwarded_allow_ips = os.environ.get("FORWARDED_ALLOW_IPS", "127.0.0.1")

certfile = os.environ.get("TLS_CERT_FILE") or None
keyfile = os.environ.get("TLS_KEY_FILE") or None


def on_starting(server: Any) -> None:
    # prometheus-client's multiprocess files from a previous run would be counted again.
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if directory:
        shutil.rmtree(directory, ignore_errors=True)
        Path(directory).mkdir(parents=True, exist_ok=True)


def post_worker_init(worker: Any) -> None:
    # Before it serves: the fleet's shapes loaded and the quota rules' selectors evaluated,
    # so that a new worker's (or a recycled one's) first admission is not the slow one.
    from quota.admission.service import warm_up_worker

    warm_up_worker()


def child_exit(server: Any, worker: Any) -> None:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)
