"""`bench.ingest_http` at a tiny size: it stores exactly the samples it sends, and its floor
endpoint is served by the bench's URLconf alone, never by the project's."""

from __future__ import annotations

import os
import subprocess
import sys

import psycopg
import pytest
from django.conf import settings
from django.urls import Resolver404, resolve

from bench.inventory import _drop_database
from db.embedded import postgres_url
from tests.conftest import REPO

GPUS, STEPS = 16, 30  # two nodes' agents, 30 readings of each GPU


def test_the_floor_is_served_by_the_bench_urlconf_only() -> None:
    from bench.ingest_urls import FLOOR_PATH

    assert resolve(FLOOR_PATH, urlconf="bench.ingest_urls").url_name == "ingest-floor"
    with pytest.raises(Resolver404):
        resolve(FLOOR_PATH)  # config.urls, as served in production
    assert resolve("/ingest/samples", urlconf="bench.ingest_urls").url_name == "ingest-samples"


def test_it_stores_exactly_the_samples_it_sends() -> None:
    database = {**settings.DATABASES["default"]}
    database["NAME"] = f"{database['NAME']}_bench_ingest_http"
    url = postgres_url(database)
    command = [
        sys.executable, "-m", "bench.ingest_http", "--gpus", str(GPUS), "--steps", str(STEPS),
        "--batch", "100", "--rounds", "2", "--clients", "4", "--keep",
    ]  # fmt: skip
    try:
        result = subprocess.run(
            command,
            cwd=REPO,
            env={**os.environ, "BENCH_DATABASE_URL": url, "DEBUG": "false"},
            capture_output=True,
            text=True,
            timeout=300,
        )
        output = result.stdout + result.stderr
        with psycopg.connect(url) as connection:
            rows = connection.execute(
                "SELECT device_uuid, count(*), count(DISTINCT ts_ms) FROM billing_sample "
                "GROUP BY device_uuid"
            ).fetchall()
            times = connection.execute(
                "SELECT count(DISTINCT ts_ms) FROM billing_sample"
            ).fetchone()
    finally:
        _drop_database(url)

    assert "samples/s" in output, output
    # Every correctness check passed; only the speed target may fail at this size.
    verdicts = [line for line in output.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert verdicts[0].startswith(("PASS  ingest", "FAIL  ingest")), output
    assert [line for line in verdicts[1:] if not line.startswith("PASS")] == [], output
    assert len(verdicts) == 6, output
    # Independently of the bench's own checks: each GPU's readings, once each, no other.
    assert len(rows) == GPUS
    assert {(count, distinct) for _, count, distinct in rows} == {(STEPS, STEPS)}
    assert times == (STEPS,)
