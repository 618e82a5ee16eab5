"""Utilisation from a Prometheus-compatible engine (Prometheus, Thanos, Mimir, VictoriaMetrics):
the metering source of clusters that already scrape their exporters, instead of raw samples.

`TALLY_METERING_SOURCE` says which clusters it meters (`prometheus`, or `samples` with some
clusters set apart: `samples,gpu-east=prometheus`), and `TALLY_PROMETHEUS_URL` the engine, or
`TALLY_PROMETHEUS_URLS` one per cluster (`gpu-east=http://...`; the others: the single URL's).
For each window the rollup works on, each engine's HTTP query API (`/api/v1/query`) is asked
for the utilisation series of each exporter (`TALLY_PROMETHEUS_EXPORTERS`): with a range
selector, the readings the engine holds as scraped (`TALLY_PROMETHEUS_STEP_SECONDS=0`), or with
a subquery, one mean per step (`avg_over_time(m[60s])[1h:60s]`), a reading per step for the
whole step. Metric names, scales and the labels a series names its device by are settings
(defaults: the exporters'):

- DCGM: `DCGM_FI_PROF_GR_ENGINE_ACTIVE` (ratio, x100), else `DCGM_FI_DEV_GPU_UTIL` (percent);
  a whole GPU by `UUID`; a MIG device by a label carrying its own UUID where the operator
  relabels one (`mig_uuid=`), else by its parent's `UUID` and `GPU_I_ID`: DCGM does not know
  MIG UUIDs and the inventory does not know GPU instance ids, but the node agents send each
  MIG device's with its samples, kept as each device's spells under each GPU instance
  (`metering.mig_instances`), so each reading goes to the device that GPU instance was at its
  time (an id reused A, B, A maps by time to each spell's own device). A reading no spell
  covers falls back to `GPU_I_PROFILE`, which names a MIG device when its GPU has one of that
  profile.
- AMD device-metrics-exporter: `gpu_gfx_activity` (percent); a GPU by `hostname` and
  `serial_number`: a node's GPUs numbered by their lowest `gpu_id` are its AMD devices' PCI
  addresses in order (what the node agent reads from sysfs, here from the inventory), a
  partition by `gpu_partition_id` when the compute partition type is not SPX.
- Intel XPU Manager exporter: `xpum_engine_group_ratio{type="compute"}` (ratio, x100), else
  `xpum_engine_ratio`; a GPU by `node` and `pci_bdf`; tile and card series skipped.
- Intel Gaudi metric exporter: `habanalabs_utilization`; a card by `node` and `Serial`, the
  card of that node whose `serial` attribute it is (the exporter writes no PCI address).
- GKE's TPU metrics: `duty_cycle_node`, else `duty_cycle`; a chip by `node` and the chip index
  ending `accelerator_id`.

Which of these a series is matched by is its exporter profile's declared rule
(`agent.exporters.MatchBy`), which `match_series` dispatches on; the inventory lookups a rule
needs are made here.

Devices named by PCI address are resolved as the ingest resolves samples naming them
(`metering.ingest.resolve_named`), so one device has one meter id whichever source measured it.
A device with several series (two scrape jobs, several engines) reads their maximum at one
instant, from the first of its exporter's metrics that has a reading then.

The readings are summed per device and hour here, as the rollup's SQL sums samples
(`metering.reading_sums`: the same integer arithmetic, hold and spill into the next hour), and
only those sums go into a temporary table (`load_hour_sums`), which the rollup's own SQL reads
as it reads the sums kept of samples: the hold, the unmeasured time, the rounding and the
reruns are the rollup's, so an hour is billed the same whichever source measured it. Where a
percent cannot be summed so (NaN), the readings themselves are loaded (`load_readings`: a run of
a device's readings to a row of arrays, read through a view shaped like `billing_sample`) and
the rollup's SQL sums them, as it did before.
An engine that does not answer, or answers in part, raises `EngineUnavailable` naming its
clusters: the rollup writes nothing for their hours, which stay marked and are retried, never
billed as idle; the other clusters' rows are written. Hours the
engine may still be receiving (`TALLY_PROMETHEUS_SETTLE_SECONDS`) are marked to be rolled up
again. An engine that answers with no reading of any device a cluster held is not believed at
once (`metering.silence`). One rollup run spends at most TALLY_PROMETHEUS_RUN_DEADLINE_SECONDS
asking engines (`RunBudget`): an engine that never answers holds a worker that long, not a
timeout per hour; the hours not asked stay pending for the next run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import operator
import re
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from itertools import islice, repeat
from operator import itemgetter
from typing import Any

import orjson
from django.conf import settings
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.db import connection
from django.db.models import Q, QuerySet
from django.utils import timezone

from agent.exporters import PROFILES, ExporterProfile, MatchBy, ScrapeContext
from inventory.models import Allocation, Device, DeviceKind
from metering import reading_sums, silence
from metering.blocks import readings_between
from metering.dirty import mark_dirty
from metering.hours import MS_PER_HOUR, epoch_ms, hour_at, sample_hold_ms
from metering.ingest import NAMED, PCI_ATTRIBUTES, PCI_KEY, pci_address, resolve_named
from metering.mig_instances import covering
from metering.models import MigInstance
from metering.reading_sums import Columns

log = logging.getLogger(__name__)

SOURCES = ("samples", "prometheus")
# The readings of one rollup run, shaped as the rollup reads `billing_sample`: a temporary view
# over `_READING_RUNS` (and `_SAMPLES`, where some clusters send samples).
READINGS_TABLE = "tally_prometheus_readings"
# The engine's readings, a run of at most `_RUN_READINGS` readings of one device to a row:
# arrays of instants and percents, and the instant of the device's next reading after them.
_READING_RUNS = "tally_prometheus_reading_runs"
# At most this many readings to a row: a row of two arrays of 64 stays well under the size past
# which PostgreSQL compresses or moves a row's values out of line (TOAST, about 2 kB), and an
# hour's readings a minute apart (61, and the hold's) fit one row.
_RUN_READINGS = 64
# The samples of the window's devices metered by samples, where some clusters send samples.
_SAMPLES = "tally_prometheus_samples"
# The per device-hour sums of the engine's readings, made here (`load_hour_sums`).
HOUR_SUMS_TABLE = "tally_prometheus_hour_sums"
# The statistics target the samples' ANALYZE runs with (rows sampled: 300 times this).
_READINGS_STATISTICS = 10

# Per exporter: the roles a label may play (its metrics, labels and how a series names its
# device are the exporter's profile's, `agent.exporters`, the node agent's too).
EXPORTER_ROLES: dict[str, frozenset[str]] = {
    name: profile.roles for name, profile in PROFILES.items()
}
_METRIC = re.compile(
    r"\s*(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)\s*(?:\{(?P<matchers>[^{}]*)\})?"
    r"\s*(?:\*\s*(?P<scale>[0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?))?\s*(?:,|$)"
)
_LABEL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class EngineUnavailable(Exception):
    """An engine could not be asked, or answered with an error or in part: the hours it was
    asked for (`hours`, filled in by the rollup) stay pending. From `window_readings`, also
    the clusters whose engine failed (`clusters`) and the readings of the clusters whose
    engines answered (`answered`), which the rollup bills."""

    def __init__(
        self,
        message: str,
        *,
        hours: Sequence[datetime] = (),
        clusters: Iterable[str] = (),
        answered: Readings | None = None,
    ) -> None:
        super().__init__(message)
        self.hours = list(hours)
        self.clusters = frozenset(clusters)
        self.answered = answered


class EngineUnreachable(EngineUnavailable):
    """The engine did not answer at all (refused, timed out): its other questions for the
    run are not asked, each would wait as long."""


class EngineSilent(EngineUnavailable):
    """The engine answered, with no reading of any device the clusters held, within the
    grace (`metering.silence`): their hours stay pending, as for an engine that did not
    answer."""


class RunBudget:
    """What one rollup run may still spend asking engines: it ends at a deadline
    (TALLY_PROMETHEUS_RUN_DEADLINE_SECONDS from its start; each question's timeout is cut to
    what is left), and it remembers the engines that did not answer, which are not asked again
    in the run. Monotonic time: a clock step neither ends nor extends it."""

    def __init__(self, seconds: float | None = None) -> None:
        if seconds is None:
            seconds = float(settings.TALLY_PROMETHEUS_RUN_DEADLINE_SECONDS)
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds
        self.unreachable: dict[str, EngineUnavailable] = {}  # engine URL -> how it failed

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def spent(self) -> EngineUnavailable | None:
        """Why no more question may be asked, once the deadline has passed; else None."""
        if self.left() > 0:
            return None
        return EngineUnavailable(
            f"this run spent its {self.seconds:g} s asking metering engines "
            "(TALLY_PROMETHEUS_RUN_DEADLINE_SECONDS): left pending for the next run"
        )


# --- Settings ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Metric:
    """One utilisation metric: its PromQL vector selector and the factor to percent."""

    selector: str
    scale: float


@dataclass(frozen=True)
class Exporter:
    """What to ask of one exporter's series: metrics in order of preference, and which label
    plays which role (`uuid` -> `UUID`); a series carrying a `skip` label is not read."""

    name: str
    metrics: tuple[Metric, ...]
    labels: Mapping[str, str]
    skip: tuple[str, ...] = ()

    def label(self, labels: Mapping[str, str], role: str) -> str:
        name = self.labels.get(role)
        return labels.get(name, "") if name else ""

    @property
    def profile(self) -> ExporterProfile:
        """The exporter's profile (`agent.exporters`): its metrics' defaults and the rule a
        series names its device by (`profile.match`)."""
        return PROFILES[self.name]


@dataclass(frozen=True)
class Config:
    """The Prometheus source's settings, parsed (`config()`)."""

    default_source: str
    cluster_sources: Mapping[str, str]
    url: str  # the engine of every cluster `cluster_urls` does not name
    cluster_urls: Mapping[str, str]
    headers: tuple[tuple[str, str], ...]
    timeout_seconds: float
    step_seconds: int
    query_hours: int
    settle_ms: int
    selector: str  # label matchers added to every metric's; `{cluster}`: the cluster's name
    exporters: tuple[Exporter, ...]
    ca_file: str = ""

    def source(self, cluster: str) -> str:
        return self.cluster_sources.get(cluster, self.default_source)

    def url_for(self, cluster: str) -> str:
        """The base URL of the engine that meters `cluster`."""
        return self.cluster_urls.get(cluster, self.url)

    @property
    def used(self) -> bool:
        """Whether any cluster may be metered by the engine."""
        return self.default_source == "prometheus" or "prometheus" in self.cluster_sources.values()


def parse_sources(value: str) -> tuple[str, dict[str, str]]:
    """`TALLY_METERING_SOURCE`: a default source and `cluster=source` exceptions."""
    default, per_cluster = "", {}
    for item in (part.strip() for part in value.split(",")):
        if not item:
            continue
        cluster, _, source = item.rpartition("=")
        source = source.strip().lower()
        if source not in SOURCES:
            raise ImproperlyConfigured(
                f"TALLY_METERING_SOURCE: {source!r} is not a source ({', '.join(SOURCES)})"
            )
        if not cluster:
            if default:
                raise ImproperlyConfigured("TALLY_METERING_SOURCE: give one default source")
            default = source
        elif cluster.strip() in per_cluster:
            raise ImproperlyConfigured(f"TALLY_METERING_SOURCE: cluster {cluster!r} given twice")
        else:
            per_cluster[cluster.strip()] = source
    return default or "samples", per_cluster


def _url_fault(url: str) -> str:
    """Why `url` is not an engine's base URL, or "" when it is: http(s) with a host (the
    API's path is added to it, so no query or fragment either)."""
    if not url.startswith(("http://", "https://")):
        return "it must start with http:// or https://"
    if any(char.isspace() or not char.isprintable() for char in url):
        return "it holds a space or a control character (percent-encode them in a path)"
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 (read for its check)
    except ValueError as error:  # a port that is no number from 0 to 65535, a bad IPv6 address
        return str(error)
    if not parts.hostname:
        return "it names no host (http://prometheus:9090, not http:///api or http://:9090)"
    if parts.query or parts.fragment:
        return "a base URL has no query or fragment: the API's path is added to it"
    return ""


def _base_url(value: str, *, variable: str, optional: bool = False) -> str:
    """`value` as an engine's base URL (no trailing slash; "" for none, where `optional`), or
    `ImproperlyConfigured` naming `variable` (and the cluster, in TALLY_PROMETHEUS_URLS) and
    what is wrong with it: a URL given is checked whether or not it is used."""
    url = value.strip()
    fault = _url_fault(url) if url or not optional else ""
    if fault:
        raise ImproperlyConfigured(
            f"{variable}={url!r} is not a base URL (http://... or https://...): {fault}"
        )
    return url.rstrip("/")


def parse_urls(value: str) -> dict[str, str]:
    """`TALLY_PROMETHEUS_URLS`: `cluster=URL, ...`, the engine of each cluster named."""
    urls: dict[str, str] = {}
    for item in (part.strip() for part in value.split(",")):
        if not item:
            continue
        cluster, equals, text = (part.strip() for part in item.partition("="))
        if not equals or not cluster:
            raise ImproperlyConfigured(
                f"TALLY_PROMETHEUS_URLS: {item!r} is not cluster=URL "
                "(e.g. gpu-east=http://prometheus.gpu-east:9090, comma-separated)"
            )
        if cluster in urls:
            raise ImproperlyConfigured(f"TALLY_PROMETHEUS_URLS: cluster {cluster!r} given twice")
        urls[cluster] = _base_url(text, variable=f"TALLY_PROMETHEUS_URLS: {cluster}")
    return urls


def parse_metrics(variable: str, value: str) -> tuple[Metric, ...]:
    """`name{matchers}*scale, ...` (matchers and scale optional) as metrics."""
    metrics, position = [], 0
    text = value.strip()
    while position < len(text):
        match = _METRIC.match(text, position)
        if match is None or match.end() == position:
            raise ImproperlyConfigured(
                f"{variable}: {text[position:]!r} is not a metric like "
                'name{label="value"}*100 (comma-separated)'
            )
        matchers = (match.group("matchers") or "").strip().rstrip(",")
        metrics.append(
            Metric(
                selector=match.group("name") + (f"{{{matchers}}}" if matchers else ""),
                scale=float(match.group("scale") or 1),
            )
        )
        position = match.end()
    if not metrics:
        raise ImproperlyConfigured(f"{variable}: name at least one metric")
    return tuple(metrics)


def parse_labels(
    variable: str, value: str, roles: frozenset[str]
) -> tuple[dict[str, str], tuple[str, ...]]:
    """`role=label, ...` (`skip=a|b`: labels whose series are not read)."""
    labels: dict[str, str] = {}
    skip: tuple[str, ...] = ()
    for item in (part.strip() for part in value.split(",")):
        if not item:
            continue
        role, equals, name = (part.strip() for part in item.partition("="))
        if not equals or role not in roles:
            raise ImproperlyConfigured(
                f"{variable}: {item!r} is not role=label with a role of {', '.join(sorted(roles))}"
            )
        names = tuple(name.split("|")) if role == "skip" else (name,)
        bad = [part for part in names if not _LABEL_NAME.fullmatch(part)]
        if bad:
            raise ImproperlyConfigured(f"{variable}: {bad[0]!r} is not a Prometheus label name")
        if role == "skip":
            skip = names
        else:
            labels[role] = name
    return labels, skip


def _headers(value: str) -> tuple[tuple[str, str], ...]:
    headers = []
    for line in value.splitlines():
        if not line.strip():
            continue
        name, colon, content = line.partition(":")
        if not colon or not re.fullmatch(r"[A-Za-z0-9-]+", name.strip()):
            raise ImproperlyConfigured(
                "TALLY_PROMETHEUS_HEADERS: each line is `Name: value`, e.g. "
                "`Authorization: Bearer ...` or `X-Scope-OrgID: tenant`"
            )
        headers.append((name.strip(), content.strip()))
    return tuple(headers)


def config() -> Config:
    """The settings, parsed; `ImproperlyConfigured` naming the variable at fault."""
    return _config(
        settings.TALLY_METERING_SOURCE,
        settings.TALLY_PROMETHEUS_URL,
        settings.TALLY_PROMETHEUS_URLS,
        settings.TALLY_PROMETHEUS_HEADERS,
        settings.TALLY_PROMETHEUS_TIMEOUT_SECONDS,
        settings.TALLY_PROMETHEUS_STEP_SECONDS,
        settings.TALLY_PROMETHEUS_QUERY_HOURS,
        settings.TALLY_PROMETHEUS_SETTLE_SECONDS,
        settings.TALLY_PROMETHEUS_SELECTOR,
        tuple(settings.TALLY_PROMETHEUS_EXPORTERS),
        tuple(
            (
                settings.TALLY_PROMETHEUS_EXPORTER_METRICS.get(name)
                or PROFILES[name].prometheus_metrics(),
                settings.TALLY_PROMETHEUS_EXPORTER_LABELS.get(name)
                or PROFILES[name].prometheus_labels(),
            )
            for name in EXPORTER_ROLES
        ),
        settings.TALLY_PROMETHEUS_CA_FILE,
        settings.TALLY_SAMPLE_HOLD_SECONDS,
    )


@lru_cache(maxsize=8)
def _config(
    source: str,
    url: str,
    urls: str,
    headers: str,
    timeout: int,
    step: int,
    query_hours: int,
    settle: int,
    selector: str,
    exporters: tuple[str, ...],
    specs: tuple[tuple[str, str], ...],
    ca_file: str,
    hold_seconds: int,
) -> Config:
    default, per_cluster = parse_sources(source)
    cluster_urls = parse_urls(urls)
    elsewhere = [
        cluster for cluster in cluster_urls if per_cluster.get(cluster, default) != "prometheus"
    ]
    if elsewhere:
        raise ImproperlyConfigured(
            f"TALLY_PROMETHEUS_URLS: cluster {elsewhere[0]!r} is not metered by prometheus "
            "(TALLY_METERING_SOURCE): give it `=prometheus` there, or drop its URL"
        )
    # The default engine meters every cluster metered by prometheus without its own URL.
    unnamed = [
        cluster
        for cluster, name in per_cluster.items()
        if name == "prometheus" and cluster not in cluster_urls
    ]
    default_url = _base_url(url, variable="TALLY_PROMETHEUS_URL", optional=True)
    if not default_url and (default == "prometheus" or unnamed):
        whom = (
            "every cluster TALLY_PROMETHEUS_URLS does not name"
            if default == "prometheus"
            else f"cluster(s) {', '.join(unnamed)}, which TALLY_PROMETHEUS_URLS does not name"
        )
        raise ImproperlyConfigured(
            "TALLY_PROMETHEUS_URL: set it to the engine's base URL (http://... or https://...) "
            f"when TALLY_METERING_SOURCE names prometheus: it meters {whom}"
        )
    if step > hold_seconds:
        raise ImproperlyConfigured(
            f"TALLY_PROMETHEUS_STEP_SECONDS={step} is longer than TALLY_SAMPLE_HOLD_SECONDS="
            f"{hold_seconds}: each step's mean would cover only the hold, the rest unmeasured"
        )
    unknown = [name for name in exporters if name not in EXPORTER_ROLES]
    if unknown:
        raise ImproperlyConfigured(
            f"TALLY_PROMETHEUS_EXPORTERS: {unknown[0]!r} is not one of {', '.join(EXPORTER_ROLES)}"
        )
    if "{" in selector.replace("{cluster}", "") or "}" in selector.replace("{cluster}", ""):
        raise ImproperlyConfigured(
            'TALLY_PROMETHEUS_SELECTOR: label matchers without braces, e.g. cluster="{cluster}"'
        )
    parsed = []
    for name, (metrics, labels) in zip(EXPORTER_ROLES, specs, strict=True):
        if name not in exporters:
            continue
        upper = name.upper()
        roles, skip = parse_labels(f"TALLY_PROMETHEUS_{upper}_LABELS", labels, EXPORTER_ROLES[name])
        parsed.append(
            Exporter(
                name=name,
                metrics=parse_metrics(f"TALLY_PROMETHEUS_{upper}_METRICS", metrics),
                labels=roles,
                skip=skip,
            )
        )
    return Config(
        default_source=default,
        cluster_sources=per_cluster,
        url=default_url or "",
        cluster_urls=cluster_urls,
        headers=_headers(headers),
        timeout_seconds=float(timeout),
        step_seconds=step,
        query_hours=query_hours,
        settle_ms=settle * 1000,
        selector=selector.strip().strip(","),
        exporters=tuple(parsed),
        ca_file=ca_file,
    )


@checks.register()
def check_settings(**_: Any) -> list[checks.CheckMessage]:
    """`manage.py check` (and every start that runs the checks) names a bad setting."""
    try:
        config()
    except ImproperlyConfigured as error:
        return [checks.Error(str(error), id="billing.E101")]
    return []


# --- The engine -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Series:
    """One series of a range query: its labels and its (ms since the epoch, value) points."""

    labels: Mapping[str, str]
    points: list[tuple[int, float]]


class Engine:
    """One engine's HTTP query API, at base URL `url`: instant queries (POSTed, as long
    queries need), with the settings' headers, CA bundle and timeout."""

    def __init__(self, conf: Config, url: str, budget: RunBudget | None = None) -> None:
        self.conf = conf
        self.url = url
        self.budget = budget
        self._ssl = ssl.create_default_context(cafile=conf.ca_file) if conf.ca_file else None

    def _timeout(self, query: str) -> float:
        """The question's timeout: the setting's, cut to what the run has left."""
        if self.budget is None:
            return self.conf.timeout_seconds
        if (spent := self.budget.spent()) is not None:
            raise EngineUnavailable(f"{self.url}: {query}: not asked: {spent}")
        return min(self.conf.timeout_seconds, self.budget.left())

    def matrix(self, query: str, *, at_ms: int) -> list[Series]:
        """The range vector `query` evaluates to at `at_ms`; `EngineUnavailable` if the engine
        cannot be asked, refuses, or answers with warnings (a partial answer: a store down)."""
        body = urllib.parse.urlencode({"query": query, "time": f"{at_ms / 1000:.3f}"}).encode()
        request = urllib.request.Request(
            f"{self.url}/api/v1/query",
            data=body,
            method="POST",
            headers={
                "Content-Type": "application/x-www-form-urlencoded",
                **dict(self.conf.headers),
            },
        )
        timeout = self._timeout(query)
        try:
            with urllib.request.urlopen(request, timeout=timeout, context=self._ssl) as response:
                answer: Any = orjson.loads(response.read())
        except urllib.error.HTTPError as error:
            raise EngineUnavailable(
                f"{self.url}: {query}: HTTP {error.code}: {_error_text(error)}"
            ) from error
        except OSError as error:
            if self.budget is not None and (spent := self.budget.spent()) is not None:
                # Cut short by the run's deadline: not a sign the engine is down.
                raise EngineUnavailable(f"{self.url}: {query}: cut short: {spent}") from error
            raise EngineUnreachable(f"{self.url}: {query}: did not answer: {error}") from error
        except ValueError as error:
            raise EngineUnavailable(f"{self.url}: {query}: not JSON: {error}") from error
        if not isinstance(answer, dict) or answer.get("status") != "success":
            text = answer if not isinstance(answer, dict) else answer.get("error")
            raise EngineUnavailable(f"{self.url}: {query}: the engine answered an error: {text}")
        if answer.get("warnings"):
            warnings = "; ".join(answer["warnings"])
            raise EngineUnavailable(f"{self.url}: {query}: a partial answer: {warnings}")
        data = answer.get("data") or {}
        if data.get("resultType") != "matrix":
            raise EngineUnavailable(
                f"{self.url}: {query}: expected a matrix, got {data.get('resultType')}"
            )
        series = []
        for result in data.get("result") or []:
            points = [(round(ts * 1000), float(value)) for ts, value in result.get("values") or []]
            # A reading that is no number (NaN, ±Inf) is left out. Checked on the sum, in C: a
            # sum that is not finite (one such reading, or finite ones overflowing) sends the
            # series through the check of each reading.
            if not math.isfinite(sum(map(_VALUE, points))):
                points = [point for point in points if math.isfinite(point[1])]
            series.append(Series(labels=result.get("metric") or {}, points=points))
        return series


def _error_text(error: urllib.error.HTTPError) -> str:
    try:
        body: Any = json.load(error)
        return f"{body.get('errorType')}: {body.get('error')}"
    except (OSError, ValueError, AttributeError):
        return str(error.reason)


def _selector(metric: Metric, extra: str) -> str:
    if not extra:
        return metric.selector
    if metric.selector.endswith("}"):
        return f"{metric.selector[:-1]}, {extra}}}"
    return f"{metric.selector}{{{extra}}}"


def fetch(
    engine: Engine, exporter: Exporter, metric: Metric, *, extra: str, start_ms: int, end_ms: int
) -> list[Series]:
    """The readings of `metric` in `[start_ms, end_ms)`, in chunks of at most
    TALLY_PROMETHEUS_QUERY_HOURS, the last one a hold longer at most: as scraped (step 0), or
    one mean per step, each reading placed at the start of the step it is the mean of. Points
    outside the window are left out (chunk edges may repeat one; the caller keeps one per
    instant).

    A rollup run asks for its hours and the hold before them (`_ask`): the hold rides with
    the last chunk rather than making a question of its own, which doubled the questions of
    a run of one hour."""
    conf = engine.conf
    selector = _selector(metric, extra)
    step_ms = conf.step_seconds * 1000
    chunk_ms = conf.query_hours * MS_PER_HOUR
    found: list[Series] = []
    chunk_start = start_ms
    while chunk_start < end_ms:
        chunk_end = min(chunk_start + chunk_ms, end_ms)
        if end_ms - chunk_end <= sample_hold_ms():
            chunk_end = end_ms
        length = chunk_end - chunk_start
        if step_ms:
            # Steps ending at chunk_start + step ... chunk_end + step: their means cover the
            # chunk; a step's mean is over (t - step, t], placed at t - step.
            query = f"avg_over_time({selector}[{step_ms}ms])[{length}ms:{step_ms}ms]"
            series = engine.matrix(query, at_ms=chunk_end + step_ms - 1)
            shift = step_ms
        else:
            query = f"{selector}[{length}ms]"
            series = engine.matrix(query, at_ms=chunk_end - 1)
            shift = 0
        for one in series:
            points = one.points
            if not points:
                continue
            # Most series lie within the chunk as they are (step 0): kept, not copied.
            if (
                shift
                or min(map(_INSTANT, points)) < chunk_start
                or max(map(_INSTANT, points)) >= chunk_end
            ):
                points = [
                    (ts - shift, value)
                    for ts, value in points
                    if chunk_start <= ts - shift < chunk_end
                ]
                if not points:
                    continue
            found.append(Series(labels=one.labels, points=points))
        chunk_start = chunk_end
    return found


# --- Devices ----------------------------------------------------------------------------------


_INSTANT = itemgetter(0)
_VALUE = itemgetter(1)
_WHOLE = float.is_integer
_PLUS_ZERO = float.__add__


def _percent(value: float, scale: float) -> float:
    # As the node agent sends it: counters over slightly different windows can overshoot.
    return round(min(100.0, max(0.0, value * scale)), 2)


@dataclass
class Identities:
    """The window's devices as series name them."""

    by_uuid: dict[str, str] = field(default_factory=dict)  # published uuid -> meter id
    # (parent uuid, GPU instance id) -> the devices it was, spell by spell: (first ms, last ms,
    # meter id)
    instances: dict[tuple[str, int], list[tuple[int, int, str]]] = field(default_factory=dict)
    mig: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    # (DRA driver, node) -> the PCI addresses of its devices, in order (`MatchBy.PCI_ORDER`)
    buses: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    # (DRA driver, node) -> serial number -> device name (`MatchBy.SERIAL`)
    serials: dict[tuple[str, str], dict[str, str]] = field(default_factory=dict)


def _identities(devices: QuerySet[Device], start_ms: int, end_ms: int) -> Identities:
    """`devices` by UUID, every MIG device of their parents not gone before the window (a
    profile names a MIG device only where its GPU has one of that profile), and the devices
    their parents' GPU instances were about the window, as the agents saw them."""
    present = Q(gone_at__isnull=True) | Q(gone_at__gt=hour_at(start_ms // MS_PER_HOUR))
    found = Identities()
    rows = list(devices.values_list("uuid", "meter_id", "parent_uuid", "kind", "cluster_id"))
    parents = {parent for _, _, parent, kind, _ in rows if kind == DeviceKind.MIG and parent}
    clusters = {cluster_id for *_, cluster_id in rows}
    # Of devices publishing one UUID (a GPU offered as `gpu` and as `vfio`), the series goes to
    # the one metered by it, whatever order the rows come in: it is put last.
    for uuid, meter_id, *_ in sorted(rows, key=lambda row: (row[1] == row[0], row[1])):
        if uuid and meter_id:
            found.by_uuid[uuid] = meter_id
    mig: dict[tuple[str, str], list[str]] = defaultdict(list)
    for parent, profile, meter_id in Device.objects.filter(
        present, parent_uuid__in=parents, kind=DeviceKind.MIG
    ).values_list("parent_uuid", "profile", "meter_id"):
        mig[parent, profile].append(meter_id)
    found.mig = dict(mig)
    instances: dict[tuple[str, int], list[tuple[int, int, str]]] = defaultdict(list)
    # Only what the devices' own clusters' agents recorded: another cluster's GPU of the same
    # UUID (a token naming it) never claims these series.
    for parent, instance_id, first_ms, last_ms, meter_id in MigInstance.objects.filter(
        cluster_id__in=clusters,
        parent_uuid__in=parents,
        first_ms__lt=end_ms,
        last_ms__gte=start_ms - 2 * sample_hold_ms(),
    ).values_list("parent_uuid", "gpu_instance_id", "first_ms", "last_ms", "meter_id"):
        instances[parent, instance_id].append((first_ms, last_ms, meter_id))
    found.instances = {key: sorted(spans) for key, spans in instances.items()}
    return found


@dataclass(frozen=True)
class InstanceMeters:
    """The devices one GPU instance was (`Identities.instances`: their spells), for a DCGM MIG
    series: a reading goes to the device whose spell, held as a sample holds, covers its
    instant and began last (an id reused goes to the later device from its first sample:
    `metering.mig_instances.covering`, the rule the ingest places an agent's DCGM samples by);
    none, where an agent reported the GPU instance near the window (it has spells): to no
    device, as the ingest sets such a sample aside (between two devices' spells, or past the
    last, it may have been neither); where none did (no NVML agent on the node): to
    `fallback`, the device the series' profile names, if any. Two spells beginning at the
    same instant cannot be told apart: that reading is not matched."""

    spans: Sequence[tuple[int, int, str]]
    fallback: str | None
    hold_ms: int

    def meter_at(self, ts: int) -> str | None:
        meters = covering(self.spans, ts, self.hold_ms)
        if not meters:
            return None if self.spans else self.fallback
        return next(iter(meters)) if len(meters) == 1 else None


def _node_buses(driver: str, nodes: set[str], start_ms: int) -> dict[tuple[str, str], list[str]]:
    """Per node, the PCI addresses of its devices of `driver` in address order (partitions
    share one), read as the inventory and the ingest read them (`pciBusID`, else `pciAddr`):
    `MatchBy.PCI_ORDER`."""
    buses: dict[str, set[str]] = defaultdict(set)
    start = hour_at(start_ms // MS_PER_HOUR)
    for node, attributes in Device.objects.filter(
        Q(gone_at__isnull=True) | Q(gone_at__gt=start),
        node__name__in=nodes,
        driver=driver,
        attributes__has_any_keys=list(PCI_ATTRIBUTES),
    ).values_list("node__name", "attributes"):
        bus = pci_address(attributes)
        if bus is not None:
            buses[node].add(bus)
    return {(driver, node): sorted(found) for node, found in buses.items()}


SERIAL_ATTRIBUTE = "serial"


def _node_serials(
    driver: str, nodes: set[str], start_ms: int
) -> dict[tuple[str, str], dict[str, str]]:
    """Per node, its devices of `driver` by their `serial` attribute (the card's serial
    number, as the Gaudi DRA driver publishes it): serial -> device name. A serial two
    devices of one node carry names neither (`MatchBy.SERIAL`)."""
    found: dict[tuple[str, str], dict[str, str]] = defaultdict(dict)
    twice: set[tuple[str, str, str]] = set()
    start = hour_at(start_ms // MS_PER_HOUR)
    for node, name, attributes in Device.objects.filter(
        Q(gone_at__isnull=True) | Q(gone_at__gt=start),
        node__name__in=nodes,
        driver=driver,
        attributes__has_key=SERIAL_ATTRIBUTE,
    ).values_list("node__name", "name", "attributes"):
        serial = _attribute_text(attributes.get(SERIAL_ATTRIBUTE))
        if not serial:
            continue
        known = found[driver, node].setdefault(serial, name)
        if known != name:
            twice.add((driver, node, serial))
    for driver_, node, serial in twice:
        found[driver_, node].pop(serial, None)
    return dict(found)


def _attribute_text(value: Any) -> str:
    """A published attribute's value as text: the DRA form (`{"string": ...}`) or plain."""
    if isinstance(value, dict):
        value = value.get("string", "")
    return value if isinstance(value, str) else ""


def _pci_order_indexes(exporter: Exporter, series: Iterable[Series]) -> dict[tuple[str, str], int]:
    """(node, serial) -> physical GPU index. amd-smi (and so the exporter) numbers a node's
    GPUs, or their partitions, in PCI address order, a GPU's partitions one after another
    under its serial: a GPU's lowest `gpu_id` over its number of partitions is its index (a
    GPU missing from the window shifts no other)."""
    lowest: dict[tuple[str, str], int] = {}
    partitions: dict[tuple[str, str], int] = defaultdict(lambda: 1)
    for one in series:
        node = exporter.label(one.labels, "node")
        serial = exporter.label(one.labels, "serial") or exporter.label(one.labels, "gpu_id")
        gpu_id = exporter.label(one.labels, "gpu_id")
        partition = exporter.label(one.labels, "partition")
        if serial and _is_number(gpu_id):
            key = (node, serial)
            lowest[key] = min(int(gpu_id), lowest.get(key, int(gpu_id)))
            if _is_number(partition):
                partitions[key] = max(partitions[key], int(partition) + 1)
    return {key: gpu_id // partitions[key] for key, gpu_id in lowest.items()}


# A label value read as a number: ASCII digits only. `str.isdigit` also takes superscripts
# ("²"), which `int` refuses, and other scripts' digits, which no exporter writes.
_NUMBER = re.compile(r"[0-9]+")


def _is_number(value: str) -> bool:
    """Whether a label value is a whole number `int` reads, in ASCII digits."""
    return _NUMBER.fullmatch(value) is not None


def _named(node: str, driver: str, bus: str, partition: str) -> str:
    """The key `metering.ingest.resolve_named` resolves a device named by PCI address by."""
    return NAMED + NAMED.join((node, driver, "", f"{PCI_KEY}{bus.lower()}{PCI_KEY}{partition}"))


def match_series(
    exporter: Exporter,
    series: Sequence[Series],
    identities: Identities,
    start_ms: int,
) -> tuple[list[str | InstanceMeters | None], list[str]]:
    """Each series' meter id (None: not a device the inventory knows; `InstanceMeters`: a
    MIG series named by its GPU instance, each reading's by its instant), and why each
    unmatched one is (for `meter_prometheus --check`).

    Dispatched on the rule the exporter's profile declares (`MatchBy`), never on which
    exporter it is: the inventory lookups a rule needs (a node's PCI addresses in order, its
    cards by serial number, the GPU instances' spells) are made here for the rule."""
    profile = exporter.profile
    rule = profile.match
    keys: list[str | InstanceMeters | None] = []
    why: list[str] = []
    indexes: dict[tuple[str, str], int] = {}
    if rule is MatchBy.PCI_ORDER:
        indexes = _pci_order_indexes(exporter, series)
        nodes = {node for node, _ in indexes} - {
            node for driver, node in identities.buses if driver == profile.driver
        }
        identities.buses.update(_node_buses(profile.driver, nodes, start_ms))
    elif rule is MatchBy.SERIAL:
        nodes = {exporter.label(one.labels, "node") for one in series} - {""}
        nodes -= {node for driver, node in identities.serials if driver == profile.driver}
        found = _node_serials(profile.driver, nodes, start_ms)
        identities.serials.update(
            {(profile.driver, node): found.get((profile.driver, node), {}) for node in nodes}
        )
    for one in series:
        labels = one.labels
        if any(name in labels for name in exporter.skip):
            keys.append(None)
            continue
        node = exporter.label(labels, "node")
        if rule is MatchBy.UUID:
            key = _by_uuid(exporter, labels, identities, why)
        elif rule is MatchBy.PCI_ORDER:
            key = _by_pci_order(exporter, labels, node, indexes, identities, why)
        elif rule is MatchBy.SERIAL:
            key = _by_serial(exporter, labels, node, identities, why)
        else:
            key = _by_name(exporter, labels, node)
        keys.append(key)
    named = {key for key in keys if isinstance(key, str) and key.startswith(NAMED)}
    resolved: dict[str, str] = {}
    if named:
        resolved, refused, _ = resolve_named(named, node="", agent=None)
        why.extend(reason for _, reason in refused.values())
    return [
        resolved.get(key) if isinstance(key, str) and key.startswith(NAMED) else key for key in keys
    ], why


def _by_uuid(
    exporter: Exporter, labels: Mapping[str, str], identities: Identities, why: list[str]
) -> str | InstanceMeters | None:
    """`MatchBy.UUID`: a whole GPU by its UUID; a MIG device by a label carrying its own
    UUID, else by its parent's UUID and GPU instance id (the spells the agents recorded),
    else by its profile where its GPU has one MIG device of it."""
    uuid = exporter.label(labels, "uuid")
    instance = exporter.label(labels, "gpu_instance")
    if not _is_number(instance):
        return identities.by_uuid.get(uuid)
    own = exporter.label(labels, "mig_uuid")
    profile = exporter.label(labels, "mig_profile")
    candidates = (
        [identities.by_uuid[own]] if own in identities.by_uuid
        else identities.mig.get((uuid, profile), [])
    )  # fmt: skip
    key = candidates[0] if len(candidates) == 1 else None
    spans = identities.instances.get((uuid, int(instance)))
    if spans and own not in identities.by_uuid:
        return InstanceMeters(spans=spans, fallback=key, hold_ms=sample_hold_ms())
    if key is None:
        why.append(
            f"MIG {profile or '?'} (GPU instance {instance}) of {uuid}: no agent "
            f"sent that GPU instance's device, and {len(candidates)} MIG devices of "
            "that profile on that GPU in the inventory"
        )
    return key


def _by_pci_order(
    exporter: Exporter,
    labels: Mapping[str, str],
    node: str,
    indexes: Mapping[tuple[str, str], int],
    identities: Identities,
    why: list[str],
) -> str | None:
    """`MatchBy.PCI_ORDER`: the node's devices of the driver in PCI address order, the
    exporter's physical index into them; a partition where the GPU is partitioned."""
    driver = exporter.profile.driver
    serial = exporter.label(labels, "serial") or exporter.label(labels, "gpu_id")
    index = indexes.get((node, serial))
    buses = identities.buses.get((driver, node), [])
    if index is None or index >= len(buses):
        why.append(f"GPU {serial or '?'} on {node or '?'}: no {driver} PCI address for it")
        return None
    kind = exporter.label(labels, "partition_type").lower()
    partition = exporter.label(labels, "partition")
    partitioned = kind not in ("", "spx") and _is_number(partition)
    return _named(node, driver, buses[index], partition if partitioned else "")


def _by_serial(
    exporter: Exporter,
    labels: Mapping[str, str],
    node: str,
    identities: Identities,
    why: list[str],
) -> str | None:
    """`MatchBy.SERIAL`: the device of the node whose `serial` attribute the series' serial
    number is, by its name."""
    driver = exporter.profile.driver
    serial = exporter.label(labels, "serial")
    device = identities.serials.get((driver, node), {}).get(serial) if node and serial else None
    if device is None:
        why.append(
            f"{driver} card {serial or '?'} on {node or '?'}: no device of that node "
            f"publishes {SERIAL_ATTRIBUTE}={serial!r} (once) in the inventory"
        )
        return None
    return NAMED + NAMED.join((node, driver, "", device))


def _by_name(exporter: Exporter, labels: Mapping[str, str], node: str) -> str | None:
    """`MatchBy.PCI_BUS` and `MatchBy.DEVICE_NAME`: named by driver and PCI address or device
    name, as the agent names it (the profile's own key, on the series' labels as the
    exporter writes them)."""
    if not node:
        return None
    profile = exporter.profile
    device = profile.key(profile.native(labels, exporter.labels), ScrapeContext())
    if device is not None and device.driver and device.pci_bus_id:
        partition = "" if device.partition is None else str(device.partition)
        return _named(node, device.driver, device.pci_bus_id, partition)
    if device is not None and device.driver and device.device:
        return NAMED + NAMED.join((node, device.driver, "", device.device))
    return None


# --- Readings for the rollup ------------------------------------------------------------------


@dataclass
class Readings:
    """A window's readings from the engine: per meter id, its instants and percents sorted by
    time (`columns`; `points` as (ms since the epoch, percent) pairs); `metered` the meter ids
    the engine meters in it; `mixed` whether some allocations held in the window are metered
    by samples."""

    metered: set[str]
    mixed: bool
    columns: dict[str, Columns]
    unmatched: list[str] = field(default_factory=list)
    # Clusters the engine gave no reading of any device held (`metering.silence`).
    silences: list[silence.Silence] = field(default_factory=list)

    @property
    def points(self) -> dict[str, list[tuple[int, float]]]:
        """Per meter id, its (ms since the epoch, percent) readings sorted by time."""
        return {
            meter_id: list(zip(stamps, percents, strict=True))
            for meter_id, (stamps, percents) in self.columns.items()
        }


def window_readings(
    *,
    held: QuerySet[Allocation],
    start_ms: int,
    end_ms: int,
    now: datetime | None = None,
    budget: RunBudget | None = None,
) -> Readings | None:
    """The engines' readings of the devices of `held` (allocations held in `[start_ms,
    end_ms)`) whose cluster they meter, from a hold before the window to its end; None when
    no engine meters any of them (the rollup reads `billing_sample` as ever).

    Each cluster's engine is asked (`TALLY_PROMETHEUS_URLS`, else `TALLY_PROMETHEUS_URL`).
    Where a question gets no full answer, `EngineUnavailable` names the clusters it was for
    (`clusters`) and carries the readings of the others (`answered`): one engine down holds
    back only its clusters' hours. An engine that did not answer at all is not asked again
    in the run (`budget`, else the window), nor is any engine once the run's deadline passed.
    A cluster of whose held devices the engine gave no reading is a silence
    (`metering.silence`, in `silences`): held back too while within the grace of `now`."""
    conf = config()
    if not conf.used:
        return None
    by_cluster: dict[str, set[str]] = defaultdict(set)
    device_ids: set[int] = set()
    mixed = False
    for cluster, meter_id, meter_now, device_id in held.values_list(
        "cluster__name", "meter_id", "device__meter_id", "device_id"
    ):
        if conf.source(cluster) != "prometheus":
            mixed = True
            continue
        by_cluster[cluster] |= {meter_id, meter_now} - {""}
        device_ids.add(device_id)
    if not by_cluster:
        return None
    identities = _identities(Device.objects.filter(pk__in=device_ids), start_ms, end_ms)
    columns: dict[str, Columns] = {}
    unmatched: list[str] = []
    budget = budget or RunBudget(seconds=math.inf)
    unreachable = budget.unreachable
    held_back: dict[EngineUnavailable, list[str]] = defaultdict(list)  # why -> clusters
    silences: list[silence.Silence] = []
    for url, extra, clusters in _questions(conf, sorted(by_cluster)):
        error = unreachable.get(url) or budget.spent()
        if error is None:
            try:
                found, why = _ask(
                    Engine(conf, url, budget),
                    extra=extra,
                    wanted=set().union(*(by_cluster[cluster] for cluster in clusters)),
                    identities=identities,
                    start_ms=start_ms,
                    end_ms=end_ms,
                )
            except EngineUnreachable as failure:
                error = unreachable[url] = failure
            except EngineUnavailable as failure:
                error = failure
            else:
                columns.update(found)  # each cluster's devices are its own: no overlap
                unmatched.extend(why)
                for cluster in clusters:
                    if found.keys() & by_cluster[cluster] or not by_cluster[cluster]:
                        continue
                    silent = silence.silence(
                        cluster=cluster,
                        url=url,
                        devices=len(by_cluster[cluster]),
                        start_ms=start_ms,
                        end_ms=end_ms,
                        now=now,
                    )
                    silences.append(silent)
                    if silent.pending:
                        held_back[EngineSilent(silent.describe())].append(cluster)
                continue
        held_back[error].extend(clusters)
    readings = Readings(
        metered=set().union(*by_cluster.values()),
        mixed=mixed,
        columns=columns,
        unmatched=unmatched,
        silences=silences,
    )
    if held_back:
        raise EngineUnavailable(
            "; ".join(f"cluster {', '.join(names)}: {why}" for why, names in held_back.items()),
            clusters=[name for names in held_back.values() for name in names],
            answered=readings,
        )
    return readings


def _questions(conf: Config, clusters: list[str]) -> list[tuple[str, str, list[str]]]:
    """(engine URL, label matchers, clusters) of each question for a window: one per cluster
    where the selector names it, else one per engine for all the clusters it meters."""
    if "{cluster}" in conf.selector:
        return [
            (conf.url_for(cluster), conf.selector.replace("{cluster}", _quoted(cluster)), [cluster])
            for cluster in clusters
        ]
    per_engine: dict[str, list[str]] = defaultdict(list)
    for cluster in clusters:
        per_engine[conf.url_for(cluster)].append(cluster)
    return [(url, conf.selector, named) for url, named in per_engine.items()]


def _ask(
    engine: Engine,
    *,
    extra: str,
    wanted: set[str],
    identities: Identities,
    start_ms: int,
    end_ms: int,
) -> tuple[dict[str, Columns], list[str]]:
    """One question to one engine: the readings of the meter ids `wanted`, sorted by time,
    and why the series not matched were not; `EngineUnavailable` if it cannot answer."""
    start = start_ms - sample_hold_ms()
    # meter id -> instant -> (rank of the metric, percent): at each instant the first of the
    # exporter's metrics that has a reading, as the agent reads a scrape; of its series, the
    # maximum. Series matched to a meter id by their labels are first kept whole, per meter id
    # (`parts`: rank, scale and points of each): a device with one series, or series whose
    # instants follow one another (the chunks of one), needs no instant-by-instant merge.
    found: dict[str, dict[int, tuple[int, float]]] = defaultdict(dict)
    parts: dict[str, list[tuple[int, float, list[tuple[int, float]]]]] = defaultdict(list)
    unmatched: list[str] = []
    for exporter in engine.conf.exporters:
        for rank, metric in enumerate(exporter.metrics):
            series = fetch(engine, exporter, metric, extra=extra, start_ms=start, end_ms=end_ms)
            meters, why = match_series(exporter, series, identities, start_ms)
            unmatched.extend(why)
            for one, meter in zip(series, meters, strict=True):
                if meter is None or (isinstance(meter, str) and meter not in wanted):
                    continue
                if isinstance(meter, str):
                    parts[meter].append((rank, metric.scale, one.points))
                    continue
                for ts, value in one.points:
                    meter_id = meter.meter_at(ts)
                    if meter_id is None or meter_id not in wanted:
                        continue
                    _keep(found[meter_id], ts, rank, _percent(value, metric.scale))
    columns: dict[str, Columns] = {}
    for meter_id, kept in parts.items():
        if meter_id not in found and (merged := _in_turn(kept)) is not None:
            columns[meter_id] = merged
            continue
        instants = found[meter_id]
        for rank, scale, readings in kept:
            for ts, value in readings:
                _keep(instants, ts, rank, _percent(value, scale))
    for meter_id, instants in found.items():
        stamps = sorted(instants)
        columns[meter_id] = (stamps, [instants[ts][1] for ts in stamps])
    return columns, unmatched


def _keep(instants: dict[int, tuple[int, float]], ts: int, rank: int, percent: float) -> None:
    """Keep the reading at `ts` if it is the first metric's (lowest `rank`) there, or the
    highest of its metric's."""
    reading = (-rank, percent)
    if reading > instants.get(ts, (-rank - 1, 0.0)):
        instants[ts] = reading


def _in_turn(kept: list[tuple[int, float, list[tuple[int, float]]]]) -> Columns | None:
    """The readings of one device's series as percent, in order, when no two of them share an
    instant (each series' instants rising, and each series' after the one before): then no
    reading is weighed against another, whatever its metric. None when some may be."""
    kept = sorted(kept, key=lambda part: part[2][0][0] if part[2] else 0)
    stamps: list[int] = []
    percents: list[float] = []
    for _, scale, readings in kept:
        if not readings:
            continue
        instants = list(map(_INSTANT, readings))
        if (stamps and instants[0] <= stamps[-1]) or not all(
            map(operator.lt, instants, islice(instants, 1, None))
        ):
            return None
        stamps += instants
        percents += _percents(list(map(_VALUE, readings)), scale)
    return stamps, percents


def _percents(values: list[float], scale: float) -> list[float]:
    """`_percent` of each of `values`: where none needs clamping, without its calls (+ 0.0:
    a -0.0 read is 0.0, as `_percent`'s max(0.0, ...) makes it)."""
    if not values:
        return values
    if scale != 1.0:
        values = [value * scale for value in values]
    lowest = min(values)
    if lowest < 0.0 or max(values) > 100.0:
        return [_percent(value, 1.0) for value in values]
    with contextlib.suppress(TypeError):  # (a value that is no float: `_percent` below)
        if all(map(_WHOLE, values)):
            # Whole percents (DCGM's utilisation) round to themselves; with none at 0 (nor
            # -0.0), they are the values themselves.
            return values if lowest > 0.0 else list(map(_PLUS_ZERO, values, repeat(0.0)))
    return [round(value, 2) + 0.0 for value in values]


def _quoted(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


# COPY's text format escapes these in a value (its delimiter, line ends and escape).
_COPY_TEXT_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})
_COPY_NULL = "\\N"


def reading_runs_copy_text(readings: Readings) -> Iterator[str]:
    """The rows of `_READING_RUNS` (device; its readings' instants and percents; the instant
    of the device's next reading after the run, NULL after its last) in COPY's text format, a
    block of lines per device, each a run of at most `_RUN_READINGS` readings as two arrays.
    Each number is made text by `str` or `repr` mapped over a device's readings, with no
    formatting per reading; a percent as `repr` writes it, the shortest text that reads back
    as the same double."""
    for meter_id, (stamps, values) in readings.columns.items():
        if not stamps:
            continue
        prefix = meter_id.translate(_COPY_TEXT_ESCAPES) + "\t{"
        instants = list(map(str, stamps))
        percents = list(map(repr, values))
        # Each run's next instant: the next run's first, NULL after the last.
        following = instants[_RUN_READINGS::_RUN_READINGS]
        following.append(_COPY_NULL)
        yield "".join(
            f"{prefix}{','.join(instants[at : at + _RUN_READINGS])}}}\t"
            f"{{{','.join(percents[at : at + _RUN_READINGS])}}}\t{after}\n"
            for at, after in zip(range(0, len(stamps), _RUN_READINGS), following, strict=True)
        )


def load_readings(readings: Readings, *, start_ms: int, end_ms: int) -> str:
    """Write `readings` where the rollup reads them instead of `billing_sample` (with the
    samples of the window's other devices where some clusters send samples, means with their
    covered time; an engine's readings have none); the name of the temporary view it reads
    them through, shaped like `billing_sample`. Inside the rollup's transaction.

    The readings are stored a run of a device's readings to a row (`_READING_RUNS`) and the
    view unnests them: an hour of a thousand GPUs is a thousand rows to COPY rather than
    62,000, each line of text made by a few joins rather than a formatting per reading, and
    the rollup's sums read the arrays without a table row per reading to store and scan. A
    reading's gap to the device's next is the next instant less its own, the instants
    unnested beside themselves shifted by one (and the run's next: NULL after the last, where
    the hold applies as to a device's latest sample). The table's few rows need no
    statistics: its joins go by device, a hash of its rows."""
    runs = (
        "SELECT r.device_uuid, u.ts_ms, u.gpu_util, u.next_ms - u.ts_ms AS gap_ms, "
        f"CAST(NULL AS bigint) AS covered_ms FROM {_READING_RUNS} AS r CROSS JOIN LATERAL "
        "unnest(r.ts_ms, r.gpu_util, array_append(r.ts_ms[2:], r.next_ms)) "
        "AS u(ts_ms, gpu_util, next_ms)"
    )
    with connection.cursor() as cursor:
        cursor.execute(
            f"DROP VIEW IF EXISTS {READINGS_TABLE}; "
            f"DROP TABLE IF EXISTS {_READING_RUNS}, {_SAMPLES}; "
            f"CREATE TEMP TABLE {_READING_RUNS} (device_uuid text, ts_ms bigint[], "
            "gpu_util double precision[], next_ms bigint) ON COMMIT DROP"
        )
        with cursor.copy(f"COPY {_READING_RUNS} FROM STDIN") as copy:
            for block in reading_runs_copy_text(readings):
                copy.write(block)
        if not readings.mixed:
            # Dropped with the table it reads, at the transaction's end.
            cursor.execute(f"CREATE TEMP VIEW {READINGS_TABLE} AS {runs}")
            return READINGS_TABLE
        _load_samples(cursor, readings, start_ms=start_ms, end_ms=end_ms)
        cursor.execute(
            f"CREATE TEMP VIEW {READINGS_TABLE} AS {runs} UNION ALL "
            f"SELECT device_uuid, ts_ms, gpu_util, gap_ms, covered_ms FROM {_SAMPLES}"
        )
    return READINGS_TABLE


def _load_samples(cursor: Any, readings: Readings, *, start_ms: int, end_ms: int) -> None:
    """The window's samples of the devices the engine does not meter (some clusters send
    samples) into `_SAMPLES`, shaped like `billing_sample`, with a few statistics."""
    cursor.execute(
        # (The view of an earlier run of the transaction that loaded the readings is over
        # this table: it goes first.)
        f"DROP VIEW IF EXISTS {READINGS_TABLE}; "
        f"DROP TABLE IF EXISTS {_SAMPLES}; "
        f"CREATE TEMP TABLE {_SAMPLES} ON COMMIT DROP AS "
        "SELECT device_uuid, ts_ms, gpu_util, gap_ms, covered_ms FROM "
        + readings_between(start_ms - sample_hold_ms(), end_ms)
        + " WHERE ts_ms >= %(start)s AND ts_ms < %(end)s "
        "AND gpu_util IS NOT NULL AND NOT device_uuid = ANY(%(metered)s)",
        {
            "start": start_ms - sample_hold_ms(),
            "end": end_ms,
            "metered": sorted(readings.metered),
        },
    )
    # The samples' size, for the rollup's plans (a join to its pieces), and a few
    # statistics: a sample of 3,000 rows rather than the default 30,000. Set back for the
    # rest of the caller's transaction.
    cursor.execute("SHOW default_statistics_target")
    (target,) = cursor.fetchone()
    cursor.execute(
        f"SET LOCAL default_statistics_target = {_READINGS_STATISTICS}; "
        f"ANALYZE {_SAMPLES}; "
        f"SET LOCAL default_statistics_target = {int(target)}"
    )


@dataclass
class HourSums:
    """An engine's readings of a rollup run as the rollup reads them (`load_hour_sums`): its
    per device-hour sums in `table` (`metering.rollup._PER_HOUR_SQL`'s rows); the window's
    samples of the devices metered by samples in `samples` (shaped like `billing_sample`),
    or None where there are none; and the readings themselves, for the few pieces of hours
    that allocations hold in part (`coverage`)."""

    table: str
    samples: str | None
    readings: Readings
    hold_ms: int

    def coverage(self, pieces: Iterable[tuple[int, str, int, int]]) -> dict[int, tuple[int, int]]:
        """`reading_sums.piece_coverage` of the readings."""
        return reading_sums.piece_coverage(self.readings.columns, pieces, hold_ms=self.hold_ms)


def load_hour_sums(readings: Readings, *, start_ms: int, end_ms: int) -> HourSums | None:
    """Sum `readings` per device and hour here (`metering.reading_sums`) and load only the
    sums (and, where some clusters send samples, the window's samples of theirs), for the
    rollup to read instead of the readings. Inside the rollup's transaction.

    None where a percent cannot be summed (NaN): the caller loads the readings themselves
    (`load_readings`), whose SQL refuses the rows it cannot make, as it always did."""
    hold = sample_hold_ms()
    try:
        sums = list(
            reading_sums.hour_sums(readings.columns, start_ms=start_ms, end_ms=end_ms, hold_ms=hold)
        )
    except (ValueError, OverflowError):
        return None
    with connection.cursor() as cursor:
        cursor.execute(
            f"DROP TABLE IF EXISTS {HOUR_SUMS_TABLE}; "
            f"CREATE TEMP TABLE {HOUR_SUMS_TABLE} (device_uuid text, h bigint, covered bigint, "
            "weighted numeric, spill bigint, spill_weighted numeric) ON COMMIT DROP"
        )
        with cursor.copy(f"COPY {HOUR_SUMS_TABLE} FROM STDIN") as copy:
            copy.write(_hour_sums_copy_text(sums))
        samples = None
        if readings.mixed:
            _load_samples(cursor, readings, start_ms=start_ms, end_ms=end_ms)
            samples = _SAMPLES
    return HourSums(table=HOUR_SUMS_TABLE, samples=samples, readings=readings, hold_ms=hold)


def _hour_sums_copy_text(sums: list[reading_sums.HourSum]) -> str:
    """`sums` in COPY's text format, a line each."""
    escaped: dict[str, str] = {}
    lines = []
    for meter_id, hour, covered, weighted, spill, spill_weighted in sums:
        name = escaped.get(meter_id)
        if name is None:
            name = escaped[meter_id] = meter_id.translate(_COPY_TEXT_ESCAPES)
        if spill is None:
            lines.append(f"{name}\t{hour}\t{covered}\t{weighted}\t{_COPY_NULL}\t{_COPY_NULL}\n")
        else:
            lines.append(f"{name}\t{hour}\t{covered}\t{weighted}\t{spill}\t{spill_weighted}\n")
    return "".join(lines)


def run_hours_limit() -> int | None:
    """The most hours one rollup run may cover when the engine meters some cluster (its
    readings are held in memory: TALLY_PROMETHEUS_QUERY_HOURS), else None."""
    conf = config()
    return conf.query_hours if conf.used else None


def mark_unsettled(*, start_ms: int, end_ms: int, now: datetime) -> None:
    """Mark the window's hours that ended less than TALLY_PROMETHEUS_SETTLE_SECONDS before
    `now` (or have not ended) to be rolled up again: the engine may still be receiving them
    (remote write, a scrape retried). Marked as of the wall clock, so the run that rolls them
    up now leaves the mark."""
    settled = epoch_ms(now) - config().settle_ms
    hours = {
        hour_at(hour)
        for hour in range(start_ms // MS_PER_HOUR, (end_ms - 1) // MS_PER_HOUR + 1)
        if (hour + 1) * MS_PER_HOUR > settled
    }
    if hours:
        mark_dirty(hours=hours, at=timezone.now())
