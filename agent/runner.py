"""The node agent: samples GPUs and posts the samples to Tally's ingest endpoint.

    python -m agent

Runs on every GPU node as a DaemonSet (NVML source, or the node's vendor exporter:
`TALLY_AGENT_SOURCE=exporter`, see `agent.exporters`), or once per cluster as a Deployment
reading DCGM through Prometheus (`TALLY_AGENT_SOURCE=dcgm`). No Django and no database: the
standard library, `tenacity` for the retries, `pynvml` only when reading NVML and
`prometheus_client`'s text parser only when reading an exporter.

Two threads share one bounded buffer. The sampler reads the source every interval (on
wall-clock multiples of it) and appends one sample per device; the sender posts the oldest
samples in batches to `POST {TALLY_URL}/ingest/samples` and removes them only once the
server has answered 2xx, so samples leave the buffer in order and only after delivery.

Delivery policy:

- 2xx: the batch is done. Samples the server lists as `rejected` are logged and dropped,
  never retried (the server judged them, sending them again cannot help).
- connection errors, timeouts, 408, 429, 5xx: keep the batch; retry with exponential
  backoff (1 s doubling to `TALLY_AGENT_BACKOFF_MAX_SECONDS`, default 60 s) and jitter, or
  after `Retry-After` when the server sends one (capped the same way).
- 401/403: keep everything, log an error naming the token source, retry every ~60 s
  (the token file is read again on every attempt, so a rotated token is picked up).
- 413: halve the batch size and retry at once. Other 4xx: the batch itself is malformed;
  it is logged and dropped so it cannot block everything behind it.
- The buffer holds `TALLY_AGENT_BUFFER_SAMPLES` samples (default: 15 minutes of 64 devices,
  8 GPUs split into 56 MIG devices, at the interval). When full, the oldest are dropped,
  counted and logged: a server outage of up to 10 minutes loses nothing.
- SIGTERM/SIGINT: stop sampling, then try once to send what is buffered (no backoff,
  bounded by `shutdown_flush_seconds`), and exit.

The server deduplicates on (uuid, ts), so a batch sent twice (answer lost in transit) is
harmless; samples are never sent twice otherwise.
"""

from __future__ import annotations

import argparse
import functools
import http.client
import json
import logging
import math
import os
import signal
import socket
import ssl
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

import tenacity

from agent.means import Averager, Mean
from agent.readings import Source, format_ts

log = logging.getLogger("agent.runner")

# 8 GPUs in MIG mode, 7 instances each: the readings one busy node makes per interval.
DEVICES_PER_NODE_SIZING = 8 + 56
BUFFER_SIZING_SECONDS = 15 * 60
INGEST_PATH = "/ingest/samples"


ENVIRONMENT = """\
configuration (environment variables, defaults in brackets):
  TALLY_URL                        Tally's base URL, http:// or https:// (required)
  TALLY_AGENT_TOKEN_FILE           file holding the agent token, read on every request
  TALLY_AGENT_TOKEN                the agent token itself (exactly one of the two)
  TALLY_NODE_NAME                  this node's name [the host name]
  TALLY_AGENT_SOURCE               nvml, dcgm or exporter [nvml]
  TALLY_EXPORTER_URL               this node's exporter's /metrics (exporter)
  TALLY_EXPORTER_PROFILE           dcgm, amd, intel, gaudi or tpu: which exporter (exporter)
  TALLY_EXPORTER_WITH_NVML         true: read NVML too, for MIG devices (exporter, dcgm) [false]
  TALLY_AGENT_SYS_ROOT             the host's /sys, to find AMD GPUs' PCI addresses [/sys]
  TALLY_HLML_LIBRARY_DIR           the directory holding Habana's libhlml.so, to name Gaudi
                                   cards by serial (exporter, gaudi) [/usr/lib/habanalabs]
  TALLY_PROMETHEUS_URL             Prometheus with the DCGM exporter's metrics (dcgm)
  TALLY_PROMETHEUS_TOKEN_FILE      bearer token for Prometheus (dcgm)
  TALLY_PROMETHEUS_NODE_LABEL      the label naming a metric's node (dcgm) [Hostname]
  TALLY_AGENT_PROC_ROOT            the host's /proc, to find each process' pod [/proc]
  TALLY_AGENT_INTERVAL_SECONDS     seconds between samples [10]
  TALLY_AGENT_MEAN_SECONDS         send each device's mean over this many seconds, a multiple
                                   of the interval, at most Tally's TALLY_SAMPLE_HOLD_SECONDS
                                   (e.g. 60 with an interval of 1) [unset: every reading]
  TALLY_AGENT_BUFFER_SAMPLES       samples kept while ingest is unreachable [15 minutes' worth]
  TALLY_AGENT_BATCH_SIZE           samples per request [500]
  TALLY_AGENT_CA_FILE              CA bundle to verify Tally's certificate
  TALLY_AGENT_TIMEOUT_SECONDS      timeout of each request [10]
  TALLY_AGENT_BACKOFF_MAX_SECONDS  longest pause between retries [60]
  TALLY_AGENT_LOG_LEVEL            DEBUG, INFO, WARNING or ERROR [INFO]
"""


class ConfigError(Exception):
    """A configuration variable is missing or malformed; the message names it."""


@dataclass(frozen=True)
class Config:
    """Everything the agent takes from its environment (see `from_env`)."""

    url: str
    node: str
    token: str | None = None
    token_file: str | None = None
    interval_seconds: float = 10.0
    mean_seconds: float | None = None  # None: every reading is sent as it is
    buffer_samples: int = DEVICES_PER_NODE_SIZING * BUFFER_SIZING_SECONDS // 10
    batch_size: int = 500
    ca_file: str | None = None
    source: str = "nvml"
    prometheus_url: str | None = None
    prometheus_token_file: str | None = None
    prometheus_node_label: str = "Hostname"
    exporter_url: str | None = None
    exporter_profile: str = "dcgm"
    exporter_with_nvml: bool = False
    sys_root: str = "/sys"
    hlml_library_dir: str = "/usr/lib/habanalabs"
    proc_root: str = "/proc"
    timeout_seconds: float = 10.0
    backoff_initial_seconds: float = 1.0
    backoff_max_seconds: float = 60.0
    auth_retry_seconds: float = 60.0
    shutdown_flush_seconds: float = 10.0

    @property
    def ingest_url(self) -> str:
        return self.url.rstrip("/") + INGEST_PATH

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Config:
        """Reads the `TALLY_*` variables; a bad value raises `ConfigError` naming it."""
        url = env.get("TALLY_URL", "").strip()
        if not url.startswith(("http://", "https://")):
            raise ConfigError("TALLY_URL must be set to the Tally base URL (http:// or https://)")
        token = env.get("TALLY_AGENT_TOKEN") or None
        token_file = env.get("TALLY_AGENT_TOKEN_FILE") or None
        if bool(token) == bool(token_file):
            raise ConfigError("set exactly one of TALLY_AGENT_TOKEN and TALLY_AGENT_TOKEN_FILE")
        if token_file and not Path(token_file).is_file():
            raise ConfigError(f"TALLY_AGENT_TOKEN_FILE: no such file {token_file}")
        interval = _positive_float(env, "TALLY_AGENT_INTERVAL_SECONDS", 10.0)
        mean_seconds = _mean_seconds(env, interval)
        default_buffer = math.ceil(
            DEVICES_PER_NODE_SIZING * BUFFER_SIZING_SECONDS / (mean_seconds or interval)
        )
        source = env.get("TALLY_AGENT_SOURCE", "nvml").strip().lower()
        if source not in ("nvml", "dcgm", "exporter"):
            raise ConfigError("TALLY_AGENT_SOURCE must be nvml, dcgm or exporter")
        exporter_url = env.get("TALLY_EXPORTER_URL") or None
        if source == "exporter" and not (exporter_url or "").startswith(("http://", "https://")):
            raise ConfigError(
                "TALLY_EXPORTER_URL (http:// or https://) is required with "
                "TALLY_AGENT_SOURCE=exporter"
            )
        from agent.exporters import HLML_LIBRARY_DIR, PROFILES, MatchBy

        names = list(PROFILES)
        profile = (env.get("TALLY_EXPORTER_PROFILE") or names[0]).strip().lower()
        if profile not in PROFILES:
            raise ConfigError(
                f"TALLY_EXPORTER_PROFILE must be {', '.join(names[:-1])} or {names[-1]}"
            )
        with_nvml = (env.get("TALLY_EXPORTER_WITH_NVML") or "false").strip().lower()
        if with_nvml not in ("true", "false"):
            raise ConfigError("TALLY_EXPORTER_WITH_NVML must be true or false")
        # NVML names MIG devices by UUID: it completes the exporters whose series are matched
        # by UUID, whichever they are.
        by_uuid = [name for name, one in PROFILES.items() if one.match is MatchBy.UUID]
        if with_nvml == "true" and profile not in by_uuid:
            raise ConfigError(
                "TALLY_EXPORTER_WITH_NVML=true goes with TALLY_EXPORTER_PROFILE="
                + " or ".join(by_uuid)
            )
        prometheus_url = env.get("TALLY_PROMETHEUS_URL") or None
        if source == "dcgm" and not prometheus_url:
            raise ConfigError("TALLY_PROMETHEUS_URL is required with TALLY_AGENT_SOURCE=dcgm")
        ca_file = env.get("TALLY_AGENT_CA_FILE") or None
        if ca_file and not Path(ca_file).is_file():
            raise ConfigError(f"TALLY_AGENT_CA_FILE: no such file {ca_file}")
        return cls(
            url=url,
            node=env.get("TALLY_NODE_NAME") or socket.gethostname(),
            token=token,
            token_file=token_file,
            interval_seconds=interval,
            mean_seconds=mean_seconds,
            buffer_samples=_positive_int(env, "TALLY_AGENT_BUFFER_SAMPLES", default_buffer),
            batch_size=_positive_int(env, "TALLY_AGENT_BATCH_SIZE", 500),
            ca_file=ca_file,
            source=source,
            prometheus_url=prometheus_url,
            prometheus_token_file=env.get("TALLY_PROMETHEUS_TOKEN_FILE") or None,
            prometheus_node_label=env.get("TALLY_PROMETHEUS_NODE_LABEL") or "Hostname",
            exporter_url=exporter_url,
            exporter_profile=profile,
            exporter_with_nvml=with_nvml == "true",
            sys_root=env.get("TALLY_AGENT_SYS_ROOT") or "/sys",
            hlml_library_dir=env.get("TALLY_HLML_LIBRARY_DIR") or HLML_LIBRARY_DIR,
            proc_root=env.get("TALLY_AGENT_PROC_ROOT") or "/proc",
            timeout_seconds=_positive_float(env, "TALLY_AGENT_TIMEOUT_SECONDS", 10.0),
            backoff_max_seconds=_positive_float(env, "TALLY_AGENT_BACKOFF_MAX_SECONDS", 60.0),
        )


def _positive_float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a number, got {raw!r}") from None
    if not value > 0 or math.isinf(value):
        raise ConfigError(f"{name} must be positive, got {raw!r}")
    return value


def _mean_seconds(env: Mapping[str, str], interval: float) -> float | None:
    """TALLY_AGENT_MEAN_SECONDS: None when unset, else a whole number of sampling intervals,
    at most an hour (the longest hold Tally allows)."""
    if not env.get("TALLY_AGENT_MEAN_SECONDS"):
        return None
    seconds = _positive_float(env, "TALLY_AGENT_MEAN_SECONDS", 0.0)
    steps = seconds / interval
    if abs(steps - round(steps)) > 1e-9 or round(steps) < 1:
        raise ConfigError(
            f"TALLY_AGENT_MEAN_SECONDS={seconds:g} must be a whole number of "
            f"TALLY_AGENT_INTERVAL_SECONDS={interval:g} intervals"
        )
    if seconds > 3600:
        raise ConfigError(
            f"TALLY_AGENT_MEAN_SECONDS={seconds:g} must be at most 3600 (and at most Tally's "
            "TALLY_SAMPLE_HOLD_SECONDS)"
        )
    return seconds


def _positive_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {raw!r}") from None
    if value <= 0:
        raise ConfigError(f"{name} must be positive, got {raw!r}")
    return value


@dataclass(frozen=True, slots=True)
class Queued:
    seq: int
    node: str
    sample: dict[str, Any]


class SampleBuffer:
    """A bounded FIFO of samples shared by the sampler and the sender (thread-safe).

    Every sample gets a sequence number, so the sender can remove exactly what it sent even
    when the oldest samples were dropped for room while its request was in flight.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.dropped = 0
        self._items: deque[Queued] = deque()
        self._next_seq = 0
        self._changed = threading.Condition()

    def __len__(self) -> int:
        with self._changed:
            return len(self._items)

    def extend(self, node: str, samples: list[dict[str, Any]]) -> int:
        """Appends `samples`; returns how many of the oldest were dropped to make room."""
        with self._changed:
            for sample in samples:
                self._items.append(Queued(self._next_seq, node, sample))
                self._next_seq += 1
            overflow = max(0, len(self._items) - self.capacity)
            for _ in range(overflow):
                self._items.popleft()
            self.dropped += overflow
            self._changed.notify_all()
            return overflow

    def head(self, limit: int) -> list[Queued]:
        """Up to `limit` oldest samples, all of one node (one request carries one node)."""
        with self._changed:
            batch: list[Queued] = []
            for item in self._items:
                if len(batch) == limit or (batch and item.node != batch[0].node):
                    break
                batch.append(item)
            return batch

    def remove_through(self, seq: int) -> None:
        """Drops every sample numbered `seq` or lower."""
        with self._changed:
            while self._items and self._items[0].seq <= seq:
                self._items.popleft()

    def wait(self, stop: threading.Event, timeout: float) -> bool:
        """Waits up to `timeout` seconds for a sample or for `stop` (with `wake()`); True
        when there is a sample."""
        with self._changed:
            self._changed.wait_for(lambda: bool(self._items) or stop.is_set(), timeout)
            return bool(self._items)

    def wake(self) -> None:
        with self._changed:
            self._changed.notify_all()


class Sampler:
    """Reads the source and queues one sample per device; with an `averager`, one per device
    and window of its mean (`agent.means`)."""

    def __init__(
        self, source: Source, buffer: SampleBuffer, *, node: str, averager: Averager | None = None
    ) -> None:
        self.source = source
        self.buffer = buffer
        self.node = node
        self.averager = averager

    def sample_once(self) -> int:
        """One read of the source; returns the number of readings taken."""
        readings = self.source.read()
        if self.averager is None:
            self._queue(Mean(node=reading.node, sample=reading.as_sample()) for reading in readings)
        else:
            self._queue(self.averager.add(readings))
        return len(readings)

    def flush_means(self) -> None:
        """Queue the means of the windows still open: the agent is stopping."""
        if self.averager is not None:
            self._queue(self.averager.flush())

    def _queue(self, samples: Iterable[Mean]) -> None:
        by_node: dict[str, list[dict[str, Any]]] = {}
        for mean in samples:
            by_node.setdefault(mean.node or self.node, []).append(mean.sample)
        for node, node_samples in by_node.items():
            dropped = self.buffer.extend(node, node_samples)
            if dropped:
                log.warning(
                    "buffer full: dropped %d oldest samples (%d dropped since start)",
                    dropped,
                    self.buffer.dropped,
                    extra={
                        "event": "buffer_overflow",
                        "dropped": dropped,
                        "dropped_total": self.buffer.dropped,
                    },
                )

    def run(self, stop: threading.Event, interval: float) -> None:
        """Samples on wall-clock multiples of `interval` until `stop` is set."""
        while not stop.is_set():
            now = time.time()
            if stop.wait(math.ceil(now / interval) * interval - now):
                break
            try:
                self.sample_once()
            except Exception:
                log.exception("reading the GPU source failed", extra={"event": "source_error"})
        self.flush_means()


class RetryLater(Exception):
    """The batch could not be delivered this time; send it again after a pause."""

    def __init__(
        self, message: str, *, status: int | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.status = status  # the HTTP status, None when there was no answer
        self.retry_after = retry_after


class TokenRefused(RetryLater):
    """Ingest refused the token (401/403): retried slowly, the token read again each time."""


def equal_jitter(*, initial: float, maximum: float) -> tenacity.wait_combine:
    """Exponential backoff from `initial`, capped at `maximum`, drawn between half the step and
    the whole of it: agents restarted together spread out, and none of them retries at once."""
    half, ceiling = initial / 2, maximum / 2
    return tenacity.wait_exponential(multiplier=half, max=ceiling) + (
        tenacity.wait_random_exponential(multiplier=half, max=ceiling)
    )


class Sender:
    """Posts buffered samples to the ingest endpoint, with the retry policy of the module."""

    def __init__(self, config: Config, buffer: SampleBuffer) -> None:
        self.config = config
        self.buffer = buffer
        self.batch_size = config.batch_size
        self.rejected_total = 0
        self.sent_total = 0
        self._ssl = ssl.create_default_context(cafile=config.ca_file) if config.ca_file else None
        self._unknown_devices: frozenset[str] = frozenset()
        self._backoff = equal_jitter(
            initial=config.backoff_initial_seconds, maximum=config.backoff_max_seconds
        )
        self._token_pause = tenacity.wait_random(
            0.9 * config.auth_retry_seconds, 1.1 * config.auth_retry_seconds
        )

    def run(self, stop: threading.Event) -> None:
        """Sends until `stop` is set, then flushes once."""
        while not stop.is_set():
            if self.buffer.wait(stop, timeout=1.0):
                self.deliver(stop)
        self.flush()

    def deliver(self, stop: threading.Event) -> None:
        """Sends the oldest batch until it is done with, pausing after each failure (see the
        module docstring); gives up, the batch kept, once `stop` is set."""
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(RetryLater),
            wait=self._pause,
            stop=tenacity.stop_when_event_set(stop),
            sleep=tenacity.sleep_using_event(stop),
            before_sleep=self._log_retry,
            retry_error_callback=lambda _: None,  # stopped: the flush has the last word
        )
        for attempt in retrying:
            if stop.is_set():
                return  # stopped during the pause: no attempt that cannot be retried
            with attempt:
                self.send_once()
            state = attempt.retry_state
            if state.attempt_number > 1 and state.outcome and not state.outcome.failed:
                log.info(
                    "ingest reachable again after %d failed attempts; %d samples buffered",
                    state.attempt_number - 1,
                    len(self.buffer),
                    extra={"event": "recovered", "buffered": len(self.buffer)},
                )

    def flush(self) -> None:
        """One pass over the buffer, no backoff, bounded in time: the shutdown path."""
        deadline = time.monotonic() + self.config.shutdown_flush_seconds
        while len(self.buffer) and time.monotonic() < deadline:
            try:
                self.send_once()
            except RetryLater as error:
                log.warning("shutdown flush: %s", error, extra={"event": "send_failed"})
                break
        left = len(self.buffer)
        log.log(
            logging.WARNING if left else logging.INFO,
            "shutdown flush: %d samples left unsent",
            left,
            extra={"event": "flush", "unsent": left, "sent_total": self.sent_total},
        )

    def send_once(self) -> None:
        """Posts the oldest batch once. Returns when the batch is done with (sent, dropped as
        malformed, or to be split after a 413); raises `RetryLater` to send it again later."""
        batch = self.buffer.head(self.batch_size)
        if not batch:
            return
        node = batch[0].node
        try:
            status, retry_after_header, body = self._post(node, [item.sample for item in batch])
        except (OSError, http.client.HTTPException) as error:
            raise RetryLater(f"sending to ingest failed: {error}") from error

        if 200 <= status < 300:
            self._delivered(batch, body)
            return
        if status in (401, 403):
            raise TokenRefused(
                f"HTTP {status}: {body[:300].decode('utf-8', 'replace')}", status=status
            )
        if status == 413 and self.batch_size > 1:
            self.batch_size = max(1, self.batch_size // 2)
            log.warning(
                "ingest says the batch is too large: now %d samples a batch",
                self.batch_size,
                extra={"event": "batch_too_large", "batch_size": self.batch_size},
            )
            return
        if status in (408, 429) or status >= 500:
            raise RetryLater(
                f"ingest answered HTTP {status}",
                status=status,
                retry_after=_retry_after_seconds(retry_after_header),
            )
        # Any other 4xx: the request itself is wrong; sending it again would only block the
        # samples behind it.
        self.buffer.remove_through(batch[-1].seq)
        self.rejected_total += len(batch)
        log.error(
            "ingest refused a batch of %d samples (HTTP %d): dropped: %s",
            len(batch),
            status,
            body[:500].decode("utf-8", "replace"),
            extra={"event": "batch_refused", "status": status, "samples": len(batch)},
        )

    def _pause(self, retry_state: tenacity.RetryCallState) -> float:
        """Seconds to wait after a failed attempt (the policy of the module docstring)."""
        error = retry_state.outcome.exception() if retry_state.outcome else None
        if isinstance(error, TokenRefused):
            return self._token_pause(retry_state)
        delay = self._backoff(retry_state)
        if isinstance(error, RetryLater) and error.retry_after is not None:
            delay = min(self.config.backoff_max_seconds, max(delay, error.retry_after))
        return delay

    def _log_retry(self, retry_state: tenacity.RetryCallState) -> None:
        error = retry_state.outcome.exception() if retry_state.outcome else None
        assert isinstance(error, RetryLater)  # the only failure retried
        delay = retry_state.upcoming_sleep
        attempt = retry_state.attempt_number
        if isinstance(error, TokenRefused):
            log.error(
                "ingest refused the agent token (%s): check %s and TALLY_NODE_NAME;"
                " retrying in %.0f s",
                error,
                "TALLY_AGENT_TOKEN_FILE" if self.config.token_file else "TALLY_AGENT_TOKEN",
                delay,
                extra={
                    "event": "auth_failed",
                    "status": error.status,
                    "buffered": len(self.buffer),
                },
            )
            return
        log.log(
            logging.WARNING if attempt == 1 or attempt % 10 == 0 else logging.INFO,
            "%s; retrying in %.1f s (attempt %d, %d samples buffered)",
            error,
            delay,
            attempt,
            len(self.buffer),
            extra={
                "event": "send_failed",
                "status": error.status,
                "attempt": attempt,
                "retry_in": round(delay, 3),
                "buffered": len(self.buffer),
            },
        )

    def _post(self, node: str, samples: list[dict[str, Any]]) -> tuple[int, str | None, bytes]:
        """(status, Retry-After header, body) of one POST; raises on transport errors."""
        body, headers = ingest_request(node, samples, token=self._token())
        request = urllib.request.Request(
            self.config.ingest_url, data=body, method="POST", headers=headers
        )
        try:
            with urllib.request.urlopen(
                request, timeout=self.config.timeout_seconds, context=self._ssl
            ) as response:
                return response.status, response.headers.get("Retry-After"), response.read()
        except urllib.error.HTTPError as error:
            with error:
                return error.code, error.headers.get("Retry-After"), error.read()

    def _token(self) -> str:
        if self.config.token_file:
            # Read on every request: a projected or rotated Secret changes under us.
            return Path(self.config.token_file).read_text().strip()
        return self.config.token or ""

    def _delivered(self, batch: list[Queued], body: bytes) -> None:
        self.buffer.remove_through(batch[-1].seq)
        self.sent_total += len(batch)
        try:
            answer = json.loads(body) if body else {}
        except ValueError:
            answer = {}
        if not isinstance(answer, dict):
            answer = {}
        rejected = [r for r in answer.get("rejected") or [] if isinstance(r, dict)]
        if rejected:
            self.rejected_total += len(rejected)
            details = []
            for entry in rejected[:5]:
                index = entry.get("index")
                sample = (
                    batch[index].sample
                    if isinstance(index, int) and 0 <= index < len(batch)
                    else {}
                )
                details.append(
                    {
                        "uuid": sample.get("uuid"),
                        "ts": sample.get("ts"),
                        "reason": entry.get("reason"),
                    }
                )
            log.warning(
                "ingest rejected %d of %d samples (dropped, not retried); first: %s",
                len(rejected),
                len(batch),
                details,
                extra={"event": "samples_rejected", "rejected": len(rejected), "details": details},
            )
        unknown = frozenset(str(u) for u in answer.get("unknown_devices") or [])
        if unknown - self._unknown_devices:
            log.warning(
                "ingest does not know devices %s (inventory not synced yet?)",
                sorted(unknown),
                extra={"event": "unknown_devices", "devices": sorted(unknown)},
            )
        self._unknown_devices |= unknown
        log.debug(
            "sent %d samples",
            len(batch),
            extra={
                "event": "sent",
                "samples": len(batch),
                "accepted": answer.get("accepted"),
                "duplicates": answer.get("duplicates"),
                "buffered": len(self.buffer),
            },
        )


def ingest_request(
    node: str, samples: list[dict[str, Any]], *, token: str
) -> tuple[bytes, dict[str, str]]:
    """(body, headers) of the POST that delivers `samples` of `node` (`bench.ingest_http`
    sends the same)."""
    body = json.dumps({"node": node, "samples": samples}).encode()
    headers = {
        "Content-Type": "application/json",
        "Authorization": f"Bearer {token}",
        "User-Agent": "tally-agent",
    }
    return body, headers


def _retry_after_seconds(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, (parsedate_to_datetime(value) - datetime.now(UTC)).total_seconds())
    except (TypeError, ValueError):
        return None


def make_source(config: Config) -> Source:
    """The source `TALLY_AGENT_SOURCE` names; NVML is imported only when asked for."""
    if config.source == "exporter":
        from agent.exporters import PROFILES, ExporterSource, hlml_serial_buses

        nvml = None
        if config.exporter_with_nvml:
            from agent.nvml import NvmlSource

            nvml = NvmlSource(proc_root=config.proc_root)
        return ExporterSource(
            config.exporter_url or "",
            PROFILES[config.exporter_profile],
            sys_root=config.sys_root,
            nvml=nvml,
            serials=functools.partial(hlml_serial_buses, config.hlml_library_dir),
            timeout_seconds=config.timeout_seconds,
        )
    if config.source == "dcgm":
        from agent.dcgm import PrometheusSource

        token = None
        if config.prometheus_token_file:
            token = Path(config.prometheus_token_file).read_text().strip()
        return PrometheusSource(
            config.prometheus_url or "",
            token=token,
            node_label=config.prometheus_node_label,
            ca_file=config.ca_file,
            timeout_seconds=config.timeout_seconds,
        )
    from agent.nvml import NvmlSource

    return NvmlSource(proc_root=config.proc_root)


def run(config: Config, source: Source, stop: threading.Event) -> Sender:
    """Samples and sends until `stop` is set, then flushes once. Returns the sender (for its
    counters)."""
    buffer = SampleBuffer(config.buffer_samples)
    sender = Sender(config, buffer)
    # The sender stops once the sampler has: what it queues after `stop` (the read in
    # progress, the means of the windows still open) is in the last flush.
    sampled = threading.Event()
    sender_thread = threading.Thread(target=sender.run, args=(sampled,), name="sender", daemon=True)
    sender_thread.start()
    log.info(
        "agent started: node %s, source %s, every %g s, buffer %d samples, to %s",
        config.node,
        config.source,
        config.interval_seconds,
        config.buffer_samples,
        config.ingest_url,
        extra={"event": "started", "node": config.node, "source": config.source},
    )
    try:
        averager = (
            Averager(seconds=config.mean_seconds, interval=config.interval_seconds)
            if config.mean_seconds
            else None
        )
        Sampler(source, buffer, node=config.node, averager=averager).run(
            stop, config.interval_seconds
        )
    finally:
        stop.set()
        sampled.set()
        buffer.wake()
        # A send in progress when the sampler stopped, the flush, and a send begun just before
        # the flush's deadline.
        sender_thread.join(config.shutdown_flush_seconds + 2 * config.timeout_seconds + 1)
    return sender


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message and any `extra` fields."""

    _standard = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
        "message",
        "asctime",
    }

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": format_ts(datetime.fromtimestamp(record.created, UTC)),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in self._standard and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def main(argv: Sequence[str] | None = None) -> int:
    argparse.ArgumentParser(
        prog="python -m agent",
        description="Samples this node's GPUs and posts them to Tally until SIGTERM.",
        epilog=ENVIRONMENT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    ).parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    logging.basicConfig(
        level=os.environ.get("TALLY_AGENT_LOG_LEVEL", "INFO").upper(), handlers=[handler]
    )
    try:
        config = Config.from_env(os.environ)
    except ConfigError as error:
        log.error("bad configuration: %s", error, extra={"event": "config_error"})
        return 2
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    try:
        source = make_source(config)
    except Exception as error:
        # No driver, no library, Prometheus token unreadable: exit and let Kubernetes retry.
        log.error(
            "cannot open the %s source: %s",
            config.source,
            error,
            extra={"event": "source_unavailable", "source": config.source},
        )
        return 1
    try:
        run(config, source, stop)
    finally:
        source.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
