"""`agent.dcgm.PrometheusSource` against a local fake of Prometheus' `/api/v1/query`.

The series carry the labels dcgm-exporter puts on them (`gpu`, `UUID`, `device`,
`modelName`, `Hostname`, and on MIG devices `GPU_I_ID`/`GPU_I_PROFILE` with the parent's
UUID), plus the `instance`/`job` labels Prometheus adds.
"""

from __future__ import annotations

import json
import threading
import urllib.parse
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from agent.dcgm import PrometheusError, PrometheusSource

AT = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)
H100 = "GPU-6a7b8c9d-0e1f-2a3b-4c5d-6e7f8a9b0c1d"
A100 = "GPU-1a2b3c4d-5e6f-7a8b-9c0d-1e2f3a4b5c6d"
T4 = "GPU-0f0f0f0f-1e1e-2d2d-3c3c-4b4b4b4b4b4b"


def vector(series: list[tuple[dict[str, str], str]], at: float = AT.timestamp()) -> dict[str, Any]:
    return {
        "status": "success",
        "data": {
            "resultType": "vector",
            "result": [
                {
                    "metric": {"instance": "10.0.3.7:9400", "job": "dcgm-exporter", **labels},
                    "value": [at, value],
                }
                for labels, value in series
            ],
        },
    }


def labels(uuid: str, gpu: int, model: str, host: str, **mig: str) -> dict[str, str]:
    return {
        "gpu": str(gpu),
        "UUID": uuid,
        "device": f"nvidia{gpu}",
        "modelName": model,
        "Hostname": host,
        "DCGM_FI_DRIVER_VERSION": "580.82.07",
        **mig,
    }


class FakePrometheus:
    """Answers `/api/v1/query?query=<metric>` from a dict of metric -> response body; a
    metric missing from it answers an empty vector, as Prometheus does."""

    def __init__(self, answers: dict[str, Any], status: int = 200) -> None:
        self.answers = answers
        self.status = status
        self.queries: list[dict[str, str]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                params = dict(urllib.parse.parse_qsl(url.query))
                params["path"] = url.path
                params["auth"] = self.headers.get("Authorization") or ""
                fake.queries.append(params)
                body = fake.answers.get(params.get("query", ""), vector([]))
                payload = json.dumps(body).encode()
                self.send_response(fake.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.01,), daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def prometheus() -> Iterator[FakePrometheus]:
    mig_1 = labels(
        A100, 1, "NVIDIA A100-SXM4-40GB", "gpu-node-2", GPU_I_ID="1", GPU_I_PROFILE="3g.20gb"
    )
    mig_13 = labels(
        A100, 1, "NVIDIA A100-SXM4-40GB", "gpu-node-2", GPU_I_ID="13", GPU_I_PROFILE="1g.5gb"
    )
    h100 = labels(H100, 0, "NVIDIA H100 80GB HBM3", "gpu-node-1")
    t4 = labels(T4, 0, "Tesla T4", "gpu-node-3")
    fake = FakePrometheus(
        {
            "DCGM_FI_PROF_GR_ENGINE_ACTIVE": vector(
                [
                    (h100, "0.423"),
                    # The same GPU again, labelled with the pod using it: one device still.
                    ({**h100, "namespace": "ml", "pod": "train-0", "container": "main"}, "0.42"),
                    (mig_1, "0.9"),
                    (mig_13, "0"),
                ]
            ),
            # Profiling counters are off on the T4: only the device-level metric exists.
            "DCGM_FI_DEV_GPU_UTIL": vector([(h100, "55"), (t4, "17")]),
            "DCGM_FI_DEV_FB_USED": vector(
                [(h100, "40960"), (mig_1, "1024"), (mig_13, "0"), (t4, "512.5")]
            ),
        }
    )
    yield fake
    fake.close()


def test_readings_per_device_with_fallback_and_memory(prometheus: FakePrometheus) -> None:
    readings = {r.uuid: r for r in PrometheusSource(prometheus.url).read(AT)}

    assert set(readings) == {H100, T4, f"{A100}::gi1", f"{A100}::gi13"}
    h100 = readings[H100]
    assert (h100.gpu_util, h100.util_source) == (42.3, "gr_engine_active")
    assert h100.mem_used_bytes == 40960 * 1024 * 1024
    assert (h100.node, h100.parent_uuid, h100.ts) == ("gpu-node-1", None, AT)
    t4 = readings[T4]
    assert (t4.gpu_util, t4.util_source) == (17.0, "gpu_util")
    assert t4.mem_used_bytes == int(512.5 * 1024 * 1024)
    mig = readings[f"{A100}::gi1"]
    assert (mig.parent_uuid, mig.gpu_instance_id, mig.mig_profile) == (A100, 1, "3g.20gb")
    assert (mig.gpu_util, mig.mem_used_bytes, mig.node) == (90.0, 1024 * 1024 * 1024, "gpu-node-2")
    assert readings[f"{A100}::gi13"].gpu_util == 0.0
    assert all(r.processes == () for r in readings.values())


def test_queries_the_instant_given_with_the_token(prometheus: FakePrometheus) -> None:
    PrometheusSource(prometheus.url + "/", token="prom-token").read(AT)

    assert {q["path"] for q in prometheus.queries} == {"/api/v1/query"}
    assert {q["query"] for q in prometheus.queries} == {
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
        "DCGM_FI_DEV_GPU_UTIL",
        "DCGM_FI_DEV_FB_USED",
    }
    assert {float(q["time"]) for q in prometheus.queries} == {AT.timestamp()}
    assert {q["auth"] for q in prometheus.queries} == {"Bearer prom-token"}


def test_without_an_instant_reads_now(prometheus: FakePrometheus) -> None:
    readings = PrometheusSource(prometheus.url, clock=lambda: AT).read()
    assert {r.ts for r in readings} == {AT}


def test_no_exporter_data_is_no_readings() -> None:
    empty = FakePrometheus({})
    try:
        assert PrometheusSource(empty.url).read(AT) == []
    finally:
        empty.close()


def test_error_response_raises() -> None:
    failing = FakePrometheus(
        {
            "DCGM_FI_PROF_GR_ENGINE_ACTIVE": {
                "status": "error",
                "errorType": "bad_data",
                "error": "invalid parameter 'time'",
            }
        },
        status=400,
    )
    try:
        with pytest.raises(PrometheusError, match="bad_data: invalid parameter"):
            PrometheusSource(failing.url).read(AT)
    finally:
        failing.close()


def test_unreachable_prometheus_raises() -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(PrometheusError):
        PrometheusSource(f"http://127.0.0.1:{port}", timeout_seconds=1).read(AT)
