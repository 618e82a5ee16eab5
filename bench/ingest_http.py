"""Benchmark: the agents' samples through HTTP, JSON and gunicorn as deployed, against a floor.

    SECRET_KEY=x .venv/bin/python -m bench.ingest_http [--gpus 1000] [--steps 250]
        [--batch 500] [--workers 2] [--threads 4] [--clients 12] [--rounds 4] [--keep]

Creates a fresh PostgreSQL database (`BENCH_DATABASE_URL`, default
postgres://postgres@127.0.0.1:5432/tally_bench_ingest_http), migrates it, imports a simulated
whole-GPU fleet of `--gpus` GPUs (8 a node), each allocated by a claim of its own
(`bench.billing`'s fleet), and issues each node's agent its token. Each node's samples
(`--steps` a GPU, `--interval` seconds apart, ending a minute ago, with the GPU's process)
are made by the agent's own code (`agent.readings.GpuReading.as_sample`) and cut into the
requests the agent sends (`agent.runner.ingest_request`: one node, at most `--batch` samples,
the same JSON body, headers and bearer token, one connection each).

gunicorn serves them as the image does (`deploy/gunicorn.conf.py`: its worker class and
hooks; `--workers` and `--threads`, the deployment's 2 and 4 by default), with the
deployment's `TALLY_LISTENERS` (the ingest on a listener of its own), JSON logs and metrics
files, and `bench.ingest_settings`:
the project's settings and URLs plus `POST /ingest/floor`, which takes the same requests
through the same stack (listener, middleware, token lookup, JSON parse, the batch's shape:
`metering.views.read_batch`) and stores nothing. After a warm-up (each node's first request,
to both), the floor and `POST /ingest/samples` take `--rounds` turns each at full speed
(`--clients` connections), alternately, so the machine's drift weighs on both alike; then
samples/s of each, their ratio, and the CPU a sample costs. Checks: every request answered
200, every sample accepted once (none a duplicate, none rejected), and the samples table
holds exactly the samples sent, each device's at the times sent.

The database is dropped at the end unless `--keep`. See docs/benchmarks/ingest-http.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from agent.readings import GpuReading, ProcessReading
from agent.runner import INGEST_PATH, ingest_request
from bench.billing import GPUS_PER_NODE, Gpu, _load_fleet
from bench.database import fresh_database
from bench.driver import (
    CpuMeter,
    Leg,
    Run,
    drive,
    drive_alternately,
    free_port,
    start_gunicorn,
    stop,
    wait_until_idle,
)
from bench.inventory import _database_name

DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/tally_bench_ingest_http"
FLOOR_PATH = "/ingest/floor"  # bench.ingest_urls.FLOOR_PATH, without loading Django here
TARGET_SAMPLES_PER_S = 30_000.0
# The deployment's listeners (deploy/base/web.yaml), the ingest's port replaced by the bench's.
LISTENERS = "8443=/admission/,{port}=/ingest/,9090=/metrics"

Check = tuple[str, bool, str]


@dataclass(frozen=True)
class Request:
    """One POST an agent sends: its node, body, headers and how many samples it carries."""

    node: str
    body: bytes
    headers: Mapping[str, str]
    samples: int


def requests(
    gpus: list[Gpu], tokens: dict[str, str], *, steps: int, interval: int, end: datetime, batch: int
) -> list[list[Request]]:
    """Each node's requests as its agent sends them, oldest first: its GPUs' readings at
    `steps` times `interval` seconds apart up to `end`, in the order they are read, cut into
    batches of at most `batch`. Returned round by round: every node's first request, then
    every node's second, ... (agents send side by side)."""
    rng = random.Random("ingest_http/samples")
    by_node: dict[str, list[Gpu]] = {}
    for gpu in gpus:
        by_node.setdefault(gpu.node, []).append(gpu)
    level = {gpu.uuid: rng.choice((0.0, 15.0, 45.0, 70.0, 95.0)) for gpu in gpus}
    times = [end - timedelta(seconds=interval * (steps - 1 - step)) for step in range(steps)]
    rounds: list[list[Request]] = []
    for node, node_gpus in by_node.items():
        samples = []
        for ts in times:
            for gpu in node_gpus:
                util = round(min(100.0, max(0.0, level[gpu.uuid] + rng.uniform(-5, 5))), 1)
                memory = 20_000_000_000 + int(util * 500_000_000)
                process = ProcessReading(
                    pid=gpu.pid,
                    pod_uid=gpu.pod_uid,
                    container_id=gpu.container_id,
                    gpu_util=util,
                    mem_used_bytes=memory - 600_000_000,
                )
                reading = GpuReading(
                    uuid=gpu.uuid, ts=ts, gpu_util=util, mem_used_bytes=memory,
                    processes=(process,), util_source="utilization_rates",
                )  # fmt: skip
                samples.append(reading.as_sample())
        for index, first in enumerate(range(0, len(samples), batch)):
            chunk = samples[first : first + batch]
            body, headers = ingest_request(node, chunk, token=tokens[node])
            if index == len(rounds):
                rounds.append([])
            rounds[index].append(Request(node, body, headers, len(chunk)))
    return rounds


def _issue_tokens(nodes: set[str]) -> dict[str, str]:
    from inventory import services as inventory_services
    from metering.services import issue_agent_token

    cluster = inventory_services.get_cluster("default")
    return {node: issue_agent_token(cluster=cluster, node=node, actor="bench") for node in nodes}


def _answered(run: Run, sent: list[Request], *, stored: bool) -> tuple[int, list[Check]]:
    """Samples in the requests answered 200 with the answer expected (`stored`: every sample
    accepted, none a duplicate or rejected; else the floor's, nothing accepted), and the
    check that every request was."""
    samples = bad = 0
    for request, raw in zip(sent, run.responses, strict=True):
        if raw is None:
            continue
        head, _, body = raw.partition(b"\r\n\r\n")
        try:
            answer = json.loads(body)
            ok = head.startswith(b"HTTP/1.1 200") and (
                answer["accepted"] == (request.samples if stored else 0)
                and answer["duplicates"] == 0
                and answer["rejected"] == []
                and answer["unknown_devices"] == []
            )
        except (ValueError, KeyError, TypeError):
            ok = False
        if ok:
            samples += request.samples
        else:
            bad += 1
            if bad <= 3:
                print(f"  {run.label}: unexpected answer {raw[:400]!r}", flush=True)
    expected = "200, every sample accepted once" if stored else "200, nothing accepted"
    check = (
        f"{run.label}: answers as expected {len(sent) - bad - run.unfinished} of {len(sent)} "
        f"requests" + (f" ({dict(run.errors)})" if run.errors else ""),
        bad == 0 and not run.errors and run.completed == len(sent),
        expected,
    )
    return samples, [check]


def _stored(sent: list[Request], gpus: list[Gpu], *, steps: int, times: set[int]) -> list[Check]:
    """The samples table holds exactly what was sent: as many rows, each device's `steps`
    at the times sent."""
    from django.db.models import Count, Max, Min

    from metering.models import Sample

    wait_until_idle()
    rows = Sample.objects.count()
    per_device = dict(Sample.objects.values_list("device_uuid").annotate(n=Count("id")).order_by())
    span = Sample.objects.aggregate(first=Min("ts_ms"), last=Max("ts_ms"))
    distinct_times = Sample.objects.values("ts_ms").distinct().count()
    wrong = sum(1 for gpu in gpus if per_device.get(gpu.uuid) != steps)
    strangers = set(per_device) - {gpu.uuid for gpu in gpus}
    sent_samples = sum(request.samples for request in sent)
    return [
        (f"samples stored {rows:,}", rows == sent_samples, f"== samples sent {sent_samples:,}"),
        (f"devices without exactly {steps} samples {wrong}, others {len(strangers)}",
         wrong == 0 and not strangers, "0, 0"),
        (f"sample times stored {distinct_times} from {span['first']} to {span['last']}",
         distinct_times == len(times) and span["first"] == min(times)
         and span["last"] == max(times), f"the {len(times)} sent"),
    ]  # fmt: skip


def _line(label: str, run: Run, samples: int) -> str:
    per_k = {name: 1e6 * seconds / max(samples, 1) for name, seconds in sorted(run.cpu.items())}
    cpu = ", ".join(f"{name} {ms:.1f}" for name, ms in per_k.items())
    return (
        f"  {label:<8} {samples / run.wall if run.wall else 0:>9,.0f} samples/s  "
        f"{run.throughput:6.0f} req/s  p50 {run.percentile(0.5):6.1f} ms  "
        f"p99 {run.percentile(0.99):6.1f} ms  CPU ms per 1,000 samples: {cpu}; "
        f"others {100 * run.others:.0f}% of the machine"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ingest_http", description=__doc__)
    parser.add_argument("--gpus", type=int, default=1000, help="GPUs, 8 a node (default 1000)")
    parser.add_argument("--steps", type=int, default=250, help="samples a GPU (default 250)")
    parser.add_argument("--interval", type=int, default=10, help="seconds between samples")
    parser.add_argument(
        "--batch", type=int, default=500, help="samples a request at most (the agent's 500)"
    )
    parser.add_argument("--workers", type=int, default=2, help="gunicorn workers (deployed: 2)")
    parser.add_argument("--threads", type=int, default=4, help="threads a worker (deployed: 4)")
    parser.add_argument("--clients", type=int, default=12, help="concurrent connections")
    parser.add_argument("--rounds", type=int, default=4, help="turns each, alternately")
    parser.add_argument("--time-limit", type=float, default=120.0, help="seconds a turn at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the database")
    args = parser.parse_args(argv)
    if min(args.gpus, args.steps, args.interval, args.batch, args.workers, args.threads) < 1:
        parser.error("--gpus, --steps, --interval, --batch, --workers, --threads: at least 1")
    if args.clients < 1 or args.rounds < 1:
        parser.error("--clients and --rounds: at least 1")

    with fresh_database(parser, DEFAULT_URL, keep=args.keep) as url:
        # The samples end a minute ago (well inside the accepted skew and age); the claims
        # hold the GPUs from before the first.
        end = datetime.now(UTC).replace(second=0, microsecond=0) - timedelta(minutes=1)
        start = end - timedelta(seconds=args.interval * args.steps)
        gpus = _load_fleet(args.gpus, seed=args.seed, at=start)
        tokens = _issue_tokens({gpu.node for gpu in gpus})
        rounds = requests(
            gpus, tokens, steps=args.steps, interval=args.interval, end=end, batch=args.batch
        )
        if len(rounds) < 2:
            parser.error("every node's samples fit one request: more --steps or a lower --batch")
        warm, measured = rounds[0], [request for turn in rounds[1:] for request in turn]
        samples = sum(request.samples for request in measured)
        print(
            f"requests: {len(gpus) // GPUS_PER_NODE or 1} nodes' agents, {len(measured):,} "
            f"requests of <= {args.batch} samples ({samples:,} samples, "
            f"{sum(len(r.body) for r in measured) / max(samples, 1):.0f} bytes of JSON each) "
            f"measured after {len(warm)} to warm up",
            flush=True,
        )
        gc.collect()
        gc.freeze()  # the set-up's objects are kept: collections need not look at them again
        return _measure(args, url, gpus, warm=warm, measured=measured, end=end)


def _measure(
    args: argparse.Namespace,
    url: str,
    gpus: list[Gpu],
    *,
    warm: list[Request],
    measured: list[Request],
    end: datetime,
) -> int:
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="tally-bench-ingest-"))
    log = (workdir / "gunicorn.log").open("wb")
    # As deployed (deploy/base): JSON logs at info (a line a request), the metrics kept in
    # files for the workers to share.
    environ = {
        "TALLY_LISTENERS": LISTENERS.format(port=port),
        "LOG_FORMAT": "json",
        "LOG_LEVEL": "info",
        "PROMETHEUS_MULTIPROC_DIR": str(workdir / "prometheus"),
    }
    print(f"gunicorn's output: {log.name}", flush=True)
    process = start_gunicorn(
        url, workers=args.workers, threads=args.threads, port=port, app="config.wsgi:application",
        settings="bench.ingest_settings", deployed=True, environ=environ, log=log,
    )  # fmt: skip
    load = [os.getloadavg()[0]]
    try:
        meter = CpuMeter(process.pid, _database_name(url))
        kw: dict[str, Any] = {"clients": args.clients, "limit_s": args.time_limit}
        print("warm-up (not measured):", flush=True)
        for label, path in (("floor", FLOOR_PATH), ("ingest", INGEST_PATH)):
            drive(label, port, path, [r.body for r in warm], rate=None, meter=meter,
                  headers=[r.headers for r in warm], **kw)  # fmt: skip
        print(f"measured: full speed, {args.rounds} turns each, alternately", flush=True)
        load.append(os.getloadavg()[0])
        bodies, headers = [r.body for r in measured], [r.headers for r in measured]
        floor, stored = drive_alternately(
            [
                Leg("floor", port, FLOOR_PATH, bodies, meter, headers=headers),
                Leg("ingest", port, INGEST_PATH, bodies, meter, headers=headers),
            ],
            rounds=args.rounds,
            **kw,
        )
        load.append(os.getloadavg()[0])
    finally:
        stop(process)
        log.close()
        print("gunicorn stopped", flush=True)
    floor_samples, checks = _answered(floor, measured, stored=False)
    ingest_samples, ingest_checks = _answered(stored, measured, stored=True)
    times = {
        int((end - timedelta(seconds=args.interval * step)).timestamp() * 1000)
        for step in range(args.steps)
    }
    checks += ingest_checks + _stored([*warm, *measured], gpus, steps=args.steps, times=times)

    floor_rate = floor_samples / floor.wall if floor.wall else 0.0
    ingest_rate = ingest_samples / stored.wall if stored.wall else 0.0
    ratio = ingest_rate / floor_rate if floor_rate else 0.0
    cores = os.cpu_count() or 1
    print()
    print(_line("floor", floor, floor_samples))
    print(_line("ingest", stored, ingest_samples))
    for label, run, count in (("floor", floor, floor_samples), ("ingest", stored, ingest_samples)):
        cpu = sum(run.cpu.values())
        if cpu:
            print(
                f"  {label}: {1e6 * cpu / max(count, 1):.0f} ms CPU per 1,000 samples (client, "
                f"gunicorn, its database backends): at most ~{cores * count / cpu:,.0f} "
                f"samples/s on {cores} cores"
            )
    print(
        f"  load average (1 min) {load[0]:.1f} at gunicorn's start, {load[1]:.1f} before the "
        f"measured turns, {load[2]:.1f} after; {cores} cores; "
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC"
    )
    checks = [
        (f"ingest {ingest_rate:,.0f} samples/s, floor {floor_rate:,.0f} samples/s, ratio "
         f"{ratio:.2f}", ingest_rate >= TARGET_SAMPLES_PER_S,
         f">= {TARGET_SAMPLES_PER_S:,.0f} samples/s"),
        *checks,
    ]  # fmt: skip
    print()
    for text, passed, target in checks:
        print(f"{'PASS' if passed else 'FAIL'}  {text}  (target {target})")
    # gunicorn's log is kept where something was wrong with what it answered or stored.
    if all(passed for _, passed, _ in checks[1:]):
        shutil.rmtree(workdir)
    else:
        print(f"kept: {workdir}")
    return 0 if all(passed for _, passed, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
