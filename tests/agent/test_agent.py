"""The node agent against a local stdlib HTTP server playing `POST /ingest/samples`.

Everything runs on 127.0.0.1 with millisecond intervals and backoffs, so outages, retries
and shutdown are exercised for real (sockets, threads, signals) in well under a second each.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from agent import runner as agent
from agent.readings import GpuReading, ProcessReading
from tests.waits import wait_until

REPO = Path(__file__).resolve().parents[2]
T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)


@dataclass
class Reply:
    status: int = 200
    body: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)


class FakeIngest:
    """A threaded HTTP server that records every request and answers from a script.

    `script` is consumed one reply per request; once empty, `default` answers (a 2xx that
    accepts everything unless told otherwise).
    """

    def __init__(self, port: int = 0) -> None:
        self.requests: list[dict[str, Any]] = []
        self.script: list[Reply] = []
        self.default = Reply()
        ingest = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                ingest.requests.append(
                    {"path": self.path, "auth": self.headers.get("Authorization"), "body": body}
                )
                reply = ingest.script.pop(0) if ingest.script else ingest.default
                answer = reply.body
                if answer is None and reply.status < 300:
                    answer = {"accepted": len(body["samples"]), "duplicates": 0, "rejected": []}
                payload = json.dumps(answer or {}).encode()
                self.send_response(reply.status)
                for name, value in reply.headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.01,), daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def delivered(self) -> list[tuple[str, str]]:
        """(uuid, ts) of every sample in every 2xx-answered request, in arrival order."""
        return [
            (sample["uuid"], sample["ts"])
            for request in self.requests
            if request.get("ok", True)
            for sample in request["body"]["samples"]
        ]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def ingest() -> Iterator[FakeIngest]:
    server = FakeIngest()
    yield server
    server.close()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class TickingSource:
    """`devices` GPUs; each read is one second after the previous one."""

    def __init__(self, devices: int = 2) -> None:
        self.devices = devices
        self.reads = 0
        self.closed = False

    def read(self) -> list[GpuReading]:
        ts = T0 + timedelta(seconds=self.reads)
        self.reads += 1
        return [
            GpuReading(
                uuid=f"GPU-{device:04d}",
                ts=ts,
                gpu_util=float(self.reads % 101),
                mem_used_bytes=1024 * device,
                processes=(ProcessReading(7, "pod-uid", "c" * 64, 12.5, 2048),),
            )
            for device in range(self.devices)
        ]

    def close(self) -> None:
        self.closed = True


def config(url: str, **overrides: Any) -> agent.Config:
    base = agent.Config(
        url=url,
        node="gpu-node-1",
        token="s3cret",
        interval_seconds=0.02,
        buffer_samples=10_000,
        batch_size=500,
        timeout_seconds=2.0,
        backoff_initial_seconds=0.001,
        backoff_max_seconds=0.01,
        auth_retry_seconds=0.01,
        shutdown_flush_seconds=2.0,
    )
    return replace(base, **overrides)


def fill(buffer: agent.SampleBuffer, source: TickingSource, reads: int) -> list[tuple[str, str]]:
    sampler = agent.Sampler(source, buffer, node="gpu-node-1")
    produced: list[tuple[str, str]] = []
    for _ in range(reads):
        before = len(buffer)
        sampler.sample_once()
        assert len(buffer) == before + source.devices
    for item in buffer.head(len(buffer)):
        produced.append((item.sample["uuid"], item.sample["ts"]))
    return produced


def drain(sender: agent.Sender, attempts: int = 100) -> None:
    for _ in range(attempts):
        if not len(sender.buffer):
            return
        sender.send_once()
    raise AssertionError("buffer not drained")


class InstantStop(threading.Event):
    """A stop event whose waits return at once: records each pause the sender would take,
    and runs `between` in it (what happens while the agent waits)."""

    def __init__(self, between: Callable[[], object] = lambda: None) -> None:
        super().__init__()
        self.pauses: list[float] = []
        self.between = between

    def wait(self, timeout: float | None = None) -> bool:
        self.pauses.append(float(timeout or 0))
        self.between()
        return self.is_set()


def test_batches_are_posted_with_the_bearer_token(ingest: FakeIngest) -> None:
    buffer = agent.SampleBuffer(10_000)
    produced = fill(buffer, TickingSource(devices=8), reads=150)  # 1,200 samples
    sender = agent.Sender(config(ingest.url), buffer)

    drain(sender)

    assert [len(r["body"]["samples"]) for r in ingest.requests] == [500, 500, 200]
    assert {r["path"] for r in ingest.requests} == {"/ingest/samples"}
    assert {r["auth"] for r in ingest.requests} == {"Bearer s3cret"}
    assert {r["body"]["node"] for r in ingest.requests} == {"gpu-node-1"}
    assert ingest.delivered() == produced
    first = ingest.requests[0]["body"]["samples"][0]
    assert first == {
        "uuid": "GPU-0000",
        "ts": "2025-03-01T12:00:00.000Z",
        "gpu_util": 1.0,
        "mem_used_bytes": 0,
        "processes": [
            {
                "pid": 7,
                "pod_uid": "pod-uid",
                "container_id": "c" * 64,
                "gpu_util": 12.5,
                "mem_used_bytes": 2048,
            }
        ],
    }
    assert sender.sent_total == 1200


def test_outage_then_recovery_delivers_every_sample_once_in_order() -> None:
    port = free_port()  # nothing listens yet: connection refused
    buffer = agent.SampleBuffer(10_000)
    source = TickingSource(devices=3)
    sampler = agent.Sampler(source, buffer, node="gpu-node-1")
    sender = agent.Sender(config(f"http://127.0.0.1:{port}/", batch_size=4), buffer)

    for _ in range(5):
        sampler.sample_once()
        with pytest.raises(agent.RetryLater):
            sender.send_once()
    assert len(buffer) == 15

    ingest = FakeIngest(port)
    try:
        ingest.script = [Reply(503), Reply(503, headers={"Retry-After": "0"}), Reply(502)]
        for _ in range(3):
            sampler.sample_once()
            with pytest.raises(agent.RetryLater):
                sender.send_once()
        for _ in range(4):
            sampler.sample_once()
        drain(sender)

        failed = 3
        ok_requests = ingest.requests[failed:]
        delivered = [(s["uuid"], s["ts"]) for r in ok_requests for s in r["body"]["samples"]]
        expected = [
            (f"GPU-{d:04d}", f"2025-03-01T12:00:{n:02d}.000Z") for n in range(12) for d in range(3)
        ]
        assert delivered == expected
        assert len(set(delivered)) == len(delivered) == 36
        assert buffer.dropped == 0
    finally:
        ingest.close()


def test_buffer_bound_drops_oldest_and_counts(caplog: pytest.LogCaptureFixture) -> None:
    buffer = agent.SampleBuffer(5)
    sampler = agent.Sampler(TickingSource(devices=2), buffer, node="gpu-node-1")

    with caplog.at_level(logging.WARNING, logger="agent.runner"):
        for _ in range(4):  # 8 samples into room for 5
            sampler.sample_once()

    kept = buffer.head(10)
    assert len(kept) == 5
    assert [item.seq for item in kept] == [3, 4, 5, 6, 7]
    assert buffer.dropped == 3
    overflows = [r for r in caplog.records if getattr(r, "event", None) == "buffer_overflow"]
    assert [getattr(r, "dropped_total", None) for r in overflows] == [1, 3]


def test_drops_during_a_request_never_remove_unsent_samples() -> None:
    buffer = agent.SampleBuffer(4)
    buffer.extend("n", [{"uuid": f"GPU-{i}", "ts": str(i)} for i in range(4)])
    batch = buffer.head(4)
    buffer.extend("n", [{"uuid": "GPU-4", "ts": "4"}, {"uuid": "GPU-5", "ts": "5"}])  # drops 0, 1
    buffer.remove_through(batch[-1].seq)  # the batch (0-3) was delivered
    assert [item.sample["uuid"] for item in buffer.head(10)] == ["GPU-4", "GPU-5"]


def test_the_default_buffer_outlasts_a_ten_minute_outage() -> None:
    settings = agent.Config.from_env(
        {"TALLY_URL": "https://tally.tally.svc/", "TALLY_AGENT_TOKEN": "t"}
    )
    samples_in_ten_minutes = (8 + 56) * 600 / settings.interval_seconds
    assert settings.buffer_samples > samples_in_ten_minutes
    faster = agent.Config.from_env(
        {"TALLY_URL": "http://x/", "TALLY_AGENT_TOKEN": "t", "TALLY_AGENT_INTERVAL_SECONDS": "1"}
    )
    assert faster.buffer_samples > (8 + 56) * 600


def test_rejected_samples_are_logged_and_not_retried(
    ingest: FakeIngest, caplog: pytest.LogCaptureFixture
) -> None:
    buffer = agent.SampleBuffer(100)
    fill(buffer, TickingSource(devices=3), reads=1)
    ingest.script = [
        Reply(
            200,
            {
                "accepted": 2,
                "duplicates": 0,
                "rejected": [{"index": 1, "reason": "ts in the future"}],
                "unknown_devices": ["GPU-0002"],
            },
        )
    ]
    sender = agent.Sender(config(ingest.url), buffer)

    with caplog.at_level(logging.WARNING, logger="agent.runner"):
        sender.send_once()
        sender.send_once()  # nothing left to send

    assert len(ingest.requests) == 1
    assert len(buffer) == 0
    assert sender.rejected_total == 1
    rejected = next(r for r in caplog.records if getattr(r, "event", None) == "samples_rejected")
    assert getattr(rejected, "details", None) == [
        {"uuid": "GPU-0001", "ts": "2025-03-01T12:00:00.000Z", "reason": "ts in the future"}
    ]
    assert any(getattr(r, "event", None) == "unknown_devices" for r in caplog.records)


def test_auth_failure_keeps_samples_retries_slowly_and_rereads_the_token(
    ingest: FakeIngest, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("old-token\n")
    buffer = agent.SampleBuffer(100)
    fill(buffer, TickingSource(devices=2), reads=1)
    settings = config(ingest.url, token=None, token_file=str(token_file), auth_retry_seconds=30.0)
    sender = agent.Sender(settings, buffer)
    ingest.script = [Reply(401), Reply(403)]
    stop = InstantStop(between=lambda: token_file.write_text("new-token\n"))

    with caplog.at_level(logging.ERROR, logger="agent.runner"):
        sender.deliver(stop)

    assert len(stop.pauses) == 2
    assert all(27 <= pause <= 33 for pause in stop.pauses)
    assert "TALLY_AGENT_TOKEN_FILE" in caplog.records[0].getMessage()
    assert [r["auth"] for r in ingest.requests] == [
        "Bearer old-token",
        "Bearer new-token",
        "Bearer new-token",
    ]
    assert [len(r["body"]["samples"]) for r in ingest.requests] == [2, 2, 2]  # kept meanwhile
    assert len(buffer) == 0


def test_backoff_grows_with_jitter_is_capped_and_honours_retry_after(ingest: FakeIngest) -> None:
    buffer = agent.SampleBuffer(100)
    fill(buffer, TickingSource(devices=1), reads=1)
    settings = config(ingest.url, backoff_initial_seconds=1.0, backoff_max_seconds=8.0)
    sender = agent.Sender(settings, buffer)
    ingest.script = [Reply(503) for _ in range(6)] + [
        Reply(429, headers={"Retry-After": "5"}),
        Reply(503, headers={"Retry-After": "3600"}),
    ]
    stop = InstantStop()

    sender.deliver(stop)

    delays = stop.pauses
    assert len(delays) == 8
    for attempt, delay in enumerate(delays[:6]):
        backoff = min(8.0, 2.0**attempt)
        assert backoff / 2 <= delay <= backoff
    assert delays[6] >= 5.0
    assert delays[7] == 8.0  # Retry-After, capped like the backoff
    assert len(ingest.requests) == 9
    assert len(buffer) == 0


def test_delivery_stops_retrying_when_stopped(ingest: FakeIngest) -> None:
    buffer = agent.SampleBuffer(100)
    fill(buffer, TickingSource(devices=1), reads=1)
    sender = agent.Sender(config(ingest.url), buffer)
    ingest.default = Reply(503)

    def stop_at_the_third_pause() -> None:
        if len(stop.pauses) == 3:
            stop.set()

    stop = InstantStop(between=stop_at_the_third_pause)

    sender.deliver(stop)

    assert len(ingest.requests) == 3  # no attempt after the stop
    assert len(buffer) == 1


def test_too_large_halves_the_batch_and_other_client_errors_drop_it(
    ingest: FakeIngest, caplog: pytest.LogCaptureFixture
) -> None:
    buffer = agent.SampleBuffer(100)
    fill(buffer, TickingSource(devices=8), reads=1)
    sender = agent.Sender(config(ingest.url, batch_size=8), buffer)
    ingest.script = [Reply(413), Reply(400, {"detail": "node unknown"})]

    with caplog.at_level(logging.ERROR, logger="agent.runner"):
        sender.send_once()
        assert sender.batch_size == 4
        sender.send_once()  # 400: dropped, not retried
        sender.send_once()

    assert [len(r["body"]["samples"]) for r in ingest.requests] == [8, 4, 4]
    assert len(buffer) == 0
    assert sender.rejected_total == 4
    assert "node unknown" in caplog.records[0].getMessage()


def test_samples_of_several_nodes_go_in_separate_requests(ingest: FakeIngest) -> None:
    buffer = agent.SampleBuffer(100)
    reading = TickingSource(devices=1).read()[0]
    source = TickingSource()
    source.read = lambda: [  # type: ignore[method-assign]
        replace(reading, uuid="GPU-a", node="node-a"),
        replace(reading, uuid="GPU-b", node="node-b"),
        replace(reading, uuid="GPU-c"),  # no node label: the agent's own node
    ]
    agent.Sampler(source, buffer, node="gpu-node-1").sample_once()
    drain(agent.Sender(config(ingest.url), buffer))

    assert [
        (r["body"]["node"], [s["uuid"] for s in r["body"]["samples"]]) for r in ingest.requests
    ] == [
        ("node-a", ["GPU-a"]),
        ("node-b", ["GPU-b"]),
        ("gpu-node-1", ["GPU-c"]),
    ]


# How long a test waits for what the agent is to do (it goes on as soon as it is done): a
# busy machine may take seconds to start a process or schedule a thread.
WAIT_SECONDS = 30.0


def logged_event(line: str) -> object:
    """The `event` of one line of the agent's JSON log (None for any other line)."""
    try:
        entry = json.loads(line)
    except ValueError:
        return None
    return entry.get("event") if isinstance(entry, dict) else None


def test_run_samples_sends_and_flushes_on_stop(ingest: FakeIngest) -> None:
    source = TickingSource(devices=2)
    stop = threading.Event()
    ingest.script = [Reply(503), Reply(503)]  # a short outage while running
    runner = threading.Thread(target=agent.run, args=(config(ingest.url), source, stop))
    runner.start()
    try:
        # Ten reads, and the outage over (both 503s answered, a request after them) while
        # running.
        wait_until(
            lambda: source.reads >= 10 and len(ingest.requests) >= 3,
            lambda: f"10 reads, 3 requests ({source.reads} reads, {len(ingest.requests)} requests)",
            seconds=WAIT_SECONDS,
        )
        ingest.default = Reply(200)
    finally:
        stop.set()
    runner.join(timeout=WAIT_SECONDS)

    assert not runner.is_alive()
    assert source.reads >= 10
    accepted = [(s["uuid"], s["ts"]) for r in ingest.requests[2:] for s in r["body"]["samples"]]
    expected = [
        (
            f"GPU-{d:04d}",
            (T0 + timedelta(seconds=n)).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        )
        for n in range(source.reads)
        for d in range(2)
    ]
    assert accepted == expected


class ReadAtTheSignal(TickingSource):
    """A read in progress when the agent is told to stop: it returns after the signal, later
    than the sender takes to notice it (it waits on its buffer a second at a time)."""

    def __init__(self, stop: threading.Event) -> None:
        super().__init__(devices=1)
        self.stop = stop

    def read(self) -> list[GpuReading]:
        if self.reads == 2:
            self.stop.set()
            time.sleep(1.5)
        return super().read()


@pytest.mark.parametrize("mean_seconds", [None, 60.0])
def test_what_the_sampler_queues_after_the_signal_is_flushed(
    ingest: FakeIngest, mean_seconds: float | None
) -> None:
    """The read in progress at SIGTERM, and the means of the windows still open, are queued
    after the signal: the sender's last flush waits for them."""
    stop = threading.Event()
    source = ReadAtTheSignal(stop)
    sender = agent.run(config(ingest.url, mean_seconds=mean_seconds), source, stop)
    assert source.reads == 3
    if mean_seconds is None:
        assert [ts for _, ts in ingest.delivered()] == [
            f"2025-03-01T12:00:0{second}.000Z" for second in range(3)
        ]
    else:  # no window closed while running: the one mean of three readings, sent at the end
        assert [len(request["body"]["samples"]) for request in ingest.requests] == [1]
    assert len(sender.buffer) == 0


def test_sigterm_flushes_and_exits(ingest: FakeIngest, tmp_path: Path) -> None:
    """The real entry point, with the DCGM source against a tiny fake Prometheus."""
    from tests.agent.test_dcgm import FakePrometheus, vector

    prometheus = FakePrometheus(
        {
            "DCGM_FI_PROF_GR_ENGINE_ACTIVE": vector(
                [({"UUID": "GPU-abc", "Hostname": "gpu-node-7"}, "0.5")]
            )
        }
    )
    token_file = tmp_path / "token"
    token_file.write_text("file-token")
    env = {
        **os.environ,
        "TALLY_URL": ingest.url,
        "TALLY_AGENT_TOKEN_FILE": str(token_file),
        "TALLY_AGENT_SOURCE": "dcgm",
        "TALLY_PROMETHEUS_URL": prometheus.url,
        "TALLY_AGENT_INTERVAL_SECONDS": "0.05",
        "TALLY_AGENT_BACKOFF_MAX_SECONDS": "0.05",
    }
    env.pop("DJANGO_SETTINGS_MODULE", None)
    ingest.default = Reply(503)  # keep samples buffered until the flush
    process = subprocess.Popen(
        [sys.executable, "-m", "agent.runner"],
        cwd=REPO,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    # Its log, a line at a time, read as it comes (the test waits on its "started" line).
    lines: list[str] = []

    def read_log() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            lines.append(line)

    reader = threading.Thread(target=read_log, daemon=True)
    reader.start()

    def started_and_sampling() -> bool:
        if process.poll() is not None:
            reader.join(timeout=WAIT_SECONDS)  # the rest of its log
            pytest.fail(f"the agent exited with {process.returncode}:\n{''.join(lines)}")
        # "started" comes after its SIGTERM handler is set; two reads of the source (three
        # queries each) put samples in its buffer.
        started = any(logged_event(line) == "started" for line in lines)
        return started and len(prometheus.queries) >= 6

    try:
        wait_until(
            started_and_sampling,
            lambda: f"the agent started and read the source twice ({len(prometheus.queries)} "
            f"queries):\n{''.join(lines)}",
            seconds=WAIT_SECONDS,
        )
        ingest.default = Reply(200)
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=WAIT_SECONDS)
    finally:
        process.kill()
        process.wait()
        reader.join(timeout=WAIT_SECONDS)  # to the end of its log
        assert process.stderr is not None
        process.stderr.close()
        prometheus.close()
    stderr = "".join(lines)

    assert process.returncode == 0, stderr
    logs = [json.loads(line) for line in stderr.splitlines()]
    flush = next(entry for entry in logs if entry.get("event") == "flush")
    assert flush["unsent"] == 0
    assert any(entry.get("event") == "started" for entry in logs)
    delivered = [s for r in ingest.requests for s in r["body"]["samples"]]
    assert delivered
    assert {r["auth"] for r in ingest.requests} == {"Bearer file-token"}
    assert {r["body"]["node"] for r in ingest.requests} == {"gpu-node-7"}
    assert {s["gpu_util"] for s in delivered} == {50.0}


def test_agent_modules_do_not_import_django() -> None:
    code = (
        "import sys, agent.runner, agent.dcgm, agent.nvml;"
        "loaded = [m for m in sys.modules if m.split('.')[0] in ('django', 'rest_framework')];"
        "assert not loaded, loaded"
    )
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, check=True, timeout=30)


def test_help_lists_the_configuration() -> None:
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    shown = subprocess.run(
        [sys.executable, "-m", "agent", "--help"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    assert shown.stdout.startswith("usage: python -m agent")
    assert "TALLY_URL" in shown.stdout and "TALLY_AGENT_TOKEN_FILE" in shown.stdout


MINIMAL = {"TALLY_URL": "http://x/", "TALLY_AGENT_TOKEN": "t"}


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({}, "TALLY_URL"),
        ({"TALLY_URL": "tally.svc"}, "TALLY_URL"),
        ({"TALLY_URL": "http://x/"}, "TALLY_AGENT_TOKEN"),
        ({**MINIMAL, "TALLY_AGENT_TOKEN_FILE": "/f"}, "TALLY_AGENT_TOKEN"),
        (
            {"TALLY_URL": "http://x/", "TALLY_AGENT_TOKEN_FILE": "/nonexistent/token"},
            "TALLY_AGENT_TOKEN_FILE",
        ),
        ({**MINIMAL, "TALLY_AGENT_INTERVAL_SECONDS": "0"}, "TALLY_AGENT_INTERVAL_SECONDS"),
        ({**MINIMAL, "TALLY_AGENT_BUFFER_SAMPLES": "lots"}, "TALLY_AGENT_BUFFER_SAMPLES"),
        ({**MINIMAL, "TALLY_AGENT_SOURCE": "smi"}, "TALLY_AGENT_SOURCE"),
        ({**MINIMAL, "TALLY_AGENT_SOURCE": "dcgm"}, "TALLY_PROMETHEUS_URL"),
        ({**MINIMAL, "TALLY_AGENT_CA_FILE": "/nonexistent/ca.pem"}, "TALLY_AGENT_CA_FILE"),
    ],
)
def test_bad_configuration_names_the_variable(env: dict[str, str], named: str) -> None:
    with pytest.raises(agent.ConfigError, match=named):
        agent.Config.from_env(env)


def test_configuration_defaults() -> None:
    settings = agent.Config.from_env(
        {"TALLY_URL": "https://tally.tally.svc/", "TALLY_AGENT_TOKEN": "t"}
    )
    assert settings.ingest_url == "https://tally.tally.svc/ingest/samples"
    assert settings.node == socket.gethostname()
    assert (settings.interval_seconds, settings.batch_size, settings.source) == (10.0, 500, "nvml")
    assert settings.buffer_samples == 5760
