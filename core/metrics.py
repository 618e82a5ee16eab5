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
with the table. So are pending demand (`quota.pending.PendingDemandCollector`:
`tally_pending_claims`, `tally_pending_demand_units` by team, device class and unit, and
`tally_pending_longest_wait_seconds` by team) and stranded gangs
(`inventory.stranded.StrandedGangCollector`: `tally_stranded_gangs`,
`tally_stranded_gang_devices`, `tally_stranded_gang_units` by team and unit) and idle hours
(`billing.idle.IdleCollector`: `tally_idle_unit_hours` by team and unit, over the last 24
rolled-up hours). Their labels
come from the database (teams, the clusters' device classes; any other class is "other").

Every label takes its values from a fixed set declared here (`Bounded`): a value outside it is
counted as "other", so nothing a client sends can add series (a reason per sample index once
made 5,000 of them from one batch). The one open set, the quota rule that decided, is the
policy's rule names, capped per process.
"""

from __future__ import annotations

import hmac
import os
import re
import threading
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Generic, TypeVar
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    make_wsgi_app,
)
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment

CONTENT_TYPE = CONTENT_TYPE_LATEST

# The API server gives a webhook timeoutSeconds (3 s); the buckets resolve up to there.
WEBHOOK_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0)
ROLLUP_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

OTHER = "other"
# The label values each metric may take (besides "other").
# "workloads": the webhook that records who created a workload (quota.workloads); its
# results are "allowed" (unchanged), "annotated" and "replaced" (a creator sent was not kept).
WEBHOOKS = ("validate", "mutate", "workloads")
WEBHOOK_RESULTS = ("allowed", "denied", "error", "annotated", "replaced")
SYNC_KINDS = ("Node", "DeviceClass", "ResourceSlice", "ResourceClaim")
# Why an ingested sample was left out: the field at fault (`sample`: not an object; `ts_window`:
# a time outside TALLY_INGEST_MAX_AGE_DAYS / TALLY_INGEST_MAX_SKEW_SECONDS), or why the token
# may not send it.
INGEST_REJECT_REASONS = (
    "sample",
    "uuid",
    "ts",
    "ts_window",
    "gpu_util",
    "mem_used_bytes",
    "processes",
    "device_elsewhere",
    "unknown_device_limit",
    # Samples naming their device by driver and device name or PCI address (issue 18).
    "driver",
    "device",
    "pool",
    "node",
    "pci_bus_id",
    "partition",
    "not_metered",
    "ambiguous_device",
    # A mean's covered time, and what a MIG sample says of its GPU instance.
    "covered_seconds",
    "parent_uuid",
    "mig_placement",
    "mig_profile",
    "mig_profile_id",
    "gpu_instance_id",
)
# Quota rule names (slugs of at most 63 characters, written by operators in the policy), and
# "" when no rule decided: at most this many distinct ones per process, then "other".
MAX_RULE_LABELS = 256
_RULE_NAME = re.compile(r"[-a-zA-Z0-9_]{0,63}")

M = TypeVar("M", bound=MetricWrapperBase)


class Capped:
    """An open label set: values matching `pattern`, the first `most` distinct ones seen."""

    def __init__(self, *, pattern: re.Pattern[str], most: int) -> None:
        self.pattern = pattern
        self.most = most
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __contains__(self, value: object) -> bool:
        if value in self._seen:
            return True
        if not isinstance(value, str) or not self.pattern.fullmatch(value):
            return False
        with self._lock:
            if len(self._seen) >= self.most:
                return False
            self._seen.add(value)
        return True


class Bounded(Generic[M]):
    """A labelled metric whose labels take values from fixed sets only; any other value is
    counted as "other". Made by `Bounded(Counter, name, help, labels={label: values}, ...)`."""

    def __init__(
        self,
        kind: type[M],
        name: str,
        documentation: str,
        *,
        labels: Mapping[str, Iterable[str] | Capped],
        **options: object,
    ) -> None:
        self.allowed = {
            label: values if isinstance(values, Capped) else frozenset(values)
            for label, values in labels.items()
        }
        self.metric: M = kind(name, documentation, list(self.allowed), **options)  # type: ignore[arg-type]

    def labels(self, *values: str, **named: str) -> M:
        """The child for these label values (positional in declared order, or by name), each
        outside its set replaced by "other"."""
        given = dict(zip(self.allowed, values, strict=True)) if values else named
        if given.keys() != self.allowed.keys():
            raise ValueError(f"labels {sorted(given)} are not {sorted(self.allowed)}")
        return self.metric.labels(
            **{
                label: value if value in self.allowed[label] else OTHER
                for label, value in given.items()
            }
        )


WEBHOOK_DECISIONS = Bounded(
    Counter,
    "tally_webhook_decisions",
    "Admission decisions, by webhook (validate, mutate), result (allowed, denied, error) "
    "and the quota rule that decided (empty when none did).",
    labels={
        "webhook": WEBHOOKS,
        "result": WEBHOOK_RESULTS,
        "rule": Capped(pattern=_RULE_NAME, most=MAX_RULE_LABELS),
    },
)
WEBHOOK_LATENCY = Bounded(
    Histogram,
    "tally_webhook_duration_seconds",
    "Time to answer one AdmissionReview, by webhook.",
    labels={"webhook": WEBHOOKS},
    buckets=WEBHOOK_BUCKETS,
)
SYNC_LAG = Bounded(
    Gauge,
    "tally_sync_lag_seconds",
    "Seconds between an object's change in the API server and its import, by kind "
    "(the last event applied).",
    labels={"kind": SYNC_KINDS},
    multiprocess_mode="mostrecent",
)
SYNC_EVENTS_APPLIED = Bounded(
    Counter,
    "tally_sync_events_applied",
    "Watch events applied to the inventory, by kind.",
    labels={"kind": SYNC_KINDS},
)
SYNC_RELISTS = Bounded(
    Counter,
    "tally_sync_relists",
    "Full lists imported (at start and after 410 Gone), by kind.",
    labels={"kind": SYNC_KINDS},
)
INGEST_SAMPLES = Counter("tally_ingest_samples", "Utilisation samples stored from node agents.")
INGEST_REJECTED = Bounded(
    Counter,
    "tally_ingest_rejected_samples",
    "Utilisation samples rejected, by reason (the field at fault, or why the token may not "
    "send the sample).",
    labels={"reason": INGEST_REJECT_REASONS},
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
METERING_SILENT_HOURS = Bounded(
    Counter,
    "tally_metering_silent_hours",
    "Hours a metering engine answered with no reading of any device a cluster held, by "
    "cluster and outcome: pending (within TALLY_PROMETHEUS_SILENCE_GRACE_SECONDS, retried) or "
    "unmeasured (billed without utilisation after it). Counted at each run that finds them.",
    labels={
        "cluster": Capped(pattern=re.compile(r"[-a-z0-9]{1,63}"), most=256),
        "outcome": ("pending", "unmeasured"),
    },
)
METERING_DEADLINE_HOURS = Counter(
    "tally_metering_deadline_hours",
    "Hours a rollup run left pending because it had spent TALLY_PROMETHEUS_RUN_DEADLINE_SECONDS "
    "asking metering engines; the next run goes on.",
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


def start_metrics_server(
    port: int, *, address: str = "0.0.0.0", token: str | None = None
) -> WSGIServer:
    """Serve the process metrics on `port` from a thread, for processes without a web server.

    For the syncer (`sync_inventory`) and the Celery worker, whose metrics the web pods cannot
    see. With `token` (TALLY_METRICS_TOKEN, as the web pods' /metrics takes it) a scrape needs
    `Authorization: Bearer <token>`, or is answered 401; without, anyone who reaches the port
    may read it, and only the NetworkPolicy (the monitoring namespace alone) keeps others out.
    """
    app = make_wsgi_app(process_registry())
    server = make_server(
        address,
        port,
        _bearer_only(app, token) if token else app,
        ThreadingWSGIServer,
        handler_class=_QuietHandler,
    )
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server


class _QuietHandler(WSGIRequestHandler):
    """No access log line for every scrape."""

    def log_message(self, format: str, *args: object) -> None:
        pass


# The answer to a scrape without the token, here and on the web pods (`config.metrics_auth`).
BEARER_REFUSAL = "metrics need a bearer token\n"
BEARER_CHALLENGE = 'Bearer realm="tally-metrics"'


def bearer_matches(authorization: str, token: str) -> bool:
    """Whether an `Authorization` header's value is `Bearer <token>` (compared in constant
    time)."""
    scheme, _, given = authorization.partition(" ")
    given = given.strip() if scheme.lower() == "bearer" else ""
    return hmac.compare_digest(given.encode(), token.encode())


def _bearer_only(app: WSGIApplication, token: str) -> WSGIApplication:
    """`app`, answering 401 to a request without `Authorization: Bearer <token>`."""

    def guarded(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        if bearer_matches(environ.get("HTTP_AUTHORIZATION", ""), token):
            return app(environ, start_response)
        start_response(
            "401 Unauthorized",
            [
                ("Content-Type", "text/plain; charset=utf-8"),
                ("WWW-Authenticate", BEARER_CHALLENGE),
            ],
        )
        return [BEARER_REFUSAL.encode()]

    return guarded
