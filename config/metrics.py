"""Tally's Prometheus metrics: the objects other modules update, and how they are exposed.

Every process that updates a metric imports it from here, so each name is declared once:

- the webhooks: `WEBHOOK_DECISIONS.labels(webhook=..., result=..., rule=...).inc()` and
  `with WEBHOOK_LATENCY.labels(webhook=...).time(): ...`;
- the inventory sync: `SYNC_LAG`, `SYNC_EVENTS_APPLIED`, `SYNC_RELISTS` (by `kind`);
- the ingest endpoint: `INGEST_SAMPLES`, `INGEST_REJECTED` (by `reason`);
- the Celery tasks: `ROLLUP_DURATION`, `BILLING_LAST_SUCCESS` (`.set_to_current_time()`),
  `QUOTA_DRIFT_RULES` and `QUOTA_DRIFT_FIXED` (`quota.services.reconcile_usage`).

Gunicorn runs several worker processes, and Celery's prefork pool several children: when
`PROMETHEUS_MULTIPROC_DIR` is set (before this module is imported) prometheus-client keeps
the values in memory-mapped files there, and `render` merges every process's files. The
directory must be empty when the server starts (the gunicorn config clears it) and private to
one pod (an emptyDir).

Outstanding reservations are not counted in any process: `quota.metrics.ReservationCollector`
(one of `DATABASE_COLLECTORS`) asks the database at scrape time, with one small aggregate
query, so every web replica reports the same truth and no process has to keep a gauge in step
with the table.
"""

from __future__ import annotations

import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

CONTENT_TYPE = CONTENT_TYPE_LATEST

# The API server gives a webhook timeoutSeconds (3 s); the buckets resolve up to there.
WEBHOOK_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0)
ROLLUP_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

WEBHOOK_DECISIONS = Counter(
    "tally_webhook_decisions",
    "Admission decisions, by webhook (validate, mutate), result (allowed, denied, error) "
    "and the quota rule that decided (empty when none did).",
    ["webhook", "result", "rule"],
)
WEBHOOK_LATENCY = Histogram(
    "tally_webhook_duration_seconds",
    "Time to answer one AdmissionReview, by webhook.",
    ["webhook"],
    buckets=WEBHOOK_BUCKETS,
)
SYNC_LAG = Gauge(
    "tally_sync_lag_seconds",
    "Seconds between an object's change in the API server and its import, by kind "
    "(the last event applied).",
    ["kind"],
    multiprocess_mode="mostrecent",
)
SYNC_EVENTS_APPLIED = Counter(
    "tally_sync_events_applied", "Watch events applied to the inventory, by kind.", ["kind"]
)
SYNC_RELISTS = Counter(
    "tally_sync_relists", "Full lists imported (at start and after 410 Gone), by kind.", ["kind"]
)
INGEST_SAMPLES = Counter("tally_ingest_samples", "Utilisation samples stored from node agents.")
INGEST_REJECTED = Counter(
    "tally_ingest_rejected_samples", "Utilisation samples rejected, by reason.", ["reason"]
)
ROLLUP_DURATION = Histogram(
    "tally_rollup_duration_seconds", "Time to roll up one hour of usage.", buckets=ROLLUP_BUCKETS
)
QUOTA_DRIFT_RULES = Gauge(
    "tally_quota_drift_rules",
    "Quota rules whose stored usage (in_use or reservation lines) differed from a recount "
    "from scratch at the last reconciliation (reconcile_quotas); should be 0.",
    multiprocess_mode="mostrecent",
)
QUOTA_DRIFT_FIXED = Counter(
    "tally_quota_drift_fixed",
    "Quota rules whose drifted usage a reconciliation set back to the recount.",
)
BILLING_LAST_SUCCESS = Gauge(
    "tally_billing_last_success_timestamp_seconds",
    "When the last billing run (rollup of the pending hours) succeeded, as a Unix time.",
    multiprocess_mode="max",
)


# Collectors that ask the database at scrape time, registered by the apps that own the tables
# (`quota` adds its reservations' in `QuotaConfig.ready`): this module imports no app.
DATABASE_COLLECTORS: list[Collector] = []


def multiprocess_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


def process_registry() -> CollectorRegistry:
    """What this process (or, in multiprocess mode, every process of the pod) has counted."""
    if multiprocess_dir() is None:
        return REGISTRY
    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    return registry


def render(*, include_database: bool = True) -> bytes:
    """The exposition text: the processes' metrics, then (optionally) the database's."""
    output = generate_latest(process_registry())
    if include_database:
        database = CollectorRegistry(auto_describe=False)
        for collector in DATABASE_COLLECTORS:
            database.register(collector)
        output += generate_latest(database)
    return output


def start_metrics_server(port: int, *, address: str = "0.0.0.0") -> None:
    """Serve the process metrics on `port` from a thread, for processes without a web server.

    For the syncer (`sync_inventory`) and the Celery worker and beat, whose metrics the web
    pods cannot see. Only the monitoring namespace may reach the port (NetworkPolicy).
    """
    start_http_server(port, addr=address, registry=process_registry())
