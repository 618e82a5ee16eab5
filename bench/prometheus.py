"""Benchmark: a day's rollup of a GPU fleet from a real Prometheus, against its floors.

    DEBUG=false SECRET_KEY=x .venv/bin/python -m bench.prometheus [--gpus 1000]
        [--interval 60] [--step 0] [--keep]

Needs Debian's `prometheus` package (prometheus and promtool) and a PostgreSQL server
(`BENCH_DATABASE_URL`, default postgres://postgres@127.0.0.1:5432/tally_bench_prometheus; the
database is dropped and created again by `bench.database.fresh_database`, as the other benches'
are, so its name must contain `bench`; dropped at the end unless `--keep`).

1. The fleet (`bench.billing`'s: 8 GPUs a node, each allocated by its own claim from the day's
   start), and a day of DCGM readings per GPU every `--interval` seconds, written as
   OpenMetrics, backfilled with `promtool tsdb create-blocks-from openmetrics` and served by
   `prometheus` on a free local port (timed, not counted).
2. **Rollup from Prometheus**: `metering.rollup.rollup_hours` over the day's 24 hours with
   `TALLY_METERING_SOURCE=prometheus` (and `TALLY_PROMETHEUS_STEP_SECONDS=--step`).
3. **Engine floor**: the same queries alone (`metering.prometheus.fetch`, every hour of every
   metric), answered and parsed, nothing written: what any client of the engine must pay. Asked
   once before the rollup too, not counted, so that both meet an engine whose blocks are read.
4. **Samples path**: the same readings ingested as samples (`metering.ingest.ingest`, not timed)
   and the same hours rolled up from them (`TALLY_METERING_SOURCE=samples`), timed; with
   `--step 0` the two rollups' rows are checked equal.
5. Prints the figures and the ratios rollup/engine floor and rollup/samples rollup.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from datetime import UTC, datetime, timedelta
from pathlib import Path

from bench.database import fresh_database

DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/tally_bench_prometheus"
DAY = datetime(2026, 3, 2, tzinfo=UTC)  # a Monday, long past
METRIC = "DCGM_FI_DEV_GPU_UTIL"
# Issue 38: the rollup from a real Prometheus at most 1.5x the same queries answered and parsed.
TARGET_RATIO = 1.5


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.prometheus", description=__doc__)
    parser.add_argument("--gpus", type=int, default=1000, help="GPUs (8 per node), all allocated")
    parser.add_argument("--interval", type=int, default=60, help="seconds between readings")
    parser.add_argument("--step", type=int, default=0, help="TALLY_PROMETHEUS_STEP_SECONDS")
    parser.add_argument("--keep", action="store_true", help="keep the database and the TSDB")
    args = parser.parse_args(argv)
    if args.gpus < 1 or args.interval < 1 or args.step < 0:
        parser.error("--gpus and --interval must be positive, --step at least 0")
    binaries = shutil.which("prometheus"), shutil.which("promtool")
    if not all(binaries):
        parser.error("needs prometheus and promtool (apt-get install prometheus)")
    with fresh_database(parser, DEFAULT_URL, keep=args.keep):
        workdir = Path(tempfile.mkdtemp(prefix="tally-bench-prometheus-"))
        server: subprocess.Popen[bytes] | None = None
        try:
            from bench.billing import _load_fleet

            uuids = [gpu.uuid for gpu in _load_fleet(args.gpus, seed=0, at=DAY)]
            started = time.perf_counter()
            points = _write_day(workdir / "day.om", uuids, args.interval)
            subprocess.run(
                [str(binaries[1]), "tsdb", "create-blocks-from", "openmetrics",
                 str(workdir / "day.om"), str(workdir / "tsdb")],
                check=True, capture_output=True,
            )  # fmt: skip
            (workdir / "day.om").unlink()
            engine, server = _serve(str(binaries[0]), workdir)
            print(
                f"engine: {points:,} readings ({len(uuids):,} GPUs every {args.interval} s for a "
                f"day) backfilled and served in {time.perf_counter() - started:.1f} s",
                flush=True,
            )
            return _run(engine, uuids, interval=args.interval, step=args.step)
        finally:
            if server is not None:
                server.terminate()
                server.wait(timeout=60)
            if args.keep:
                print(f"kept: TSDB in {workdir}")
            else:
                shutil.rmtree(workdir, ignore_errors=True)


def _utilisation(index: int, step: int) -> int:
    return (index * 37 + step * 13 + (step * step) % 7) % 101


def _steps(interval: int) -> range:
    # From a hold before the day to its end.
    return range(-(600 // interval) - 1, 86400 // interval)


def _write_day(path: Path, uuids: list[str], interval: int) -> int:
    written = 0
    base = int(DAY.timestamp())
    with path.open("w") as out:
        out.write(f"# TYPE {METRIC} gauge\n")
        for index, uuid in enumerate(uuids):
            labels = f'{METRIC}{{gpu="{index % 8}",UUID="{uuid}",Hostname="node-{index // 8}"}}'
            out.writelines(
                f"{labels} {_utilisation(index, step)} {base + step * interval}.250\n"
                for step in _steps(interval)
            )
            written += len(_steps(interval))
        out.write("# EOF\n")
    return written


def _serve(binary: str, workdir: Path) -> tuple[str, subprocess.Popen[bytes]]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    (workdir / "prometheus.yml").write_text("global:\n  scrape_interval: 1h\n")
    server = subprocess.Popen(
        [binary, f"--storage.tsdb.path={workdir / 'tsdb'}", "--storage.tsdb.retention.time=100y",
         f"--web.listen-address=127.0.0.1:{port}", f"--config.file={workdir / 'prometheus.yml'}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=1) as response:
                if response.status == 200:
                    return url, server
        except OSError:
            time.sleep(0.1)
    raise SystemExit("prometheus did not become ready")


def _run(engine: str, uuids: list[str], *, interval: int, step: int) -> int:
    from django.test import override_settings

    from metering import ingest, prometheus, rollup
    from metering.hours import epoch_ms
    from metering.ingest import SampleRow
    from metering.models import UsageHour

    hours = [DAY + timedelta(hours=n) for n in range(24)]
    now = DAY + timedelta(days=2)
    source = override_settings(
        TALLY_METERING_SOURCE="prometheus",
        TALLY_PROMETHEUS_URL=engine,
        TALLY_PROMETHEUS_STEP_SECONDS=step,
        TALLY_PROMETHEUS_TIMEOUT_SECONDS=600,
    )

    def rows() -> list[tuple[int, datetime, int, int, int]]:
        return list(
            UsageHour.objects.order_by("allocation_id", "hour").values_list(
                "allocation_id", "hour", "allocated_gpu_ms", "utilised_gpu_ms", "unmeasured_gpu_ms"
            )
        )

    with source:
        conf = prometheus.config()
        client = prometheus.Engine(conf, conf.url)

        def engine_floor() -> int:
            fetched = 0
            for exporter in conf.exporters:
                for metric in exporter.metrics:
                    for series in prometheus.fetch(
                        client, exporter, metric, extra="",
                        start_ms=epoch_ms(DAY) - 120_000, end_ms=epoch_ms(DAY + timedelta(days=1)),
                    ):  # fmt: skip
                        fetched += len(series.points)
            return fetched

        # Not counted: the engine's first answers read its blocks from disk, which whichever
        # ran first paid for alone (the rollup, until 7 December 2026).
        engine_floor()
        started = time.perf_counter()
        written = rollup.rollup_hours(hours=hours, now=now)
        from_engine = time.perf_counter() - started
        from_engine_rows = rows()
        started = time.perf_counter()
        fetched = engine_floor()
        floor = time.perf_counter() - started
    print(f"rollup from Prometheus (step {step} s): {written:,} rows in {from_engine:.2f} s")
    print(f"engine floor (the same queries, answered and parsed): {fetched:,} readings in "
          f"{floor:.2f} s; rollup / floor = {from_engine / floor:.2f}x; load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip

    base = epoch_ms(DAY)
    for index, uuid in enumerate(uuids):
        samples = [
            SampleRow(uuid, base + step_ * interval * 1000 + 250, float(_utilisation(index, step_)),
                      None, None)
            for step_ in _steps(interval)
        ]  # fmt: skip
        ingest.ingest(node="bench", samples=samples, received_at=now)
    with override_settings(TALLY_METERING_SOURCE="samples"):
        started = time.perf_counter()
        rollup.rollup_hours(hours=hours, now=now)
        from_samples = time.perf_counter() - started
    same = rows() == from_engine_rows
    print(
        f"rollup from samples: {from_samples:.2f} s; from Prometheus / from samples = "
        f"{from_engine / from_samples:.2f}x; rows equal: {same}",
        flush=True,
    )
    ratio = from_engine / floor
    fast = ratio <= TARGET_RATIO
    print(
        f"{'PASS' if fast else 'FAIL'}  rollup from Prometheus / engine floor {ratio:.2f}x  "
        f"(target <= {TARGET_RATIO:g}x)"
    )
    if not step:
        print(f"{'PASS' if same else 'FAIL'}  rows equal to the rollup from samples  (target yes)")
    return 0 if fast and (same or step) else 1


if __name__ == "__main__":
    raise SystemExit(main())
