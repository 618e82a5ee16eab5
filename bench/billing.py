"""Benchmark: a week of utilisation samples ingested and rolled up, against hand-written floors.

    DEBUG=false SECRET_KEY=x .venv/bin/python -m bench.billing [--gpus 1000] [--days 7]
        [--interval 60] [--covered SECONDS] [--batch 5000] [--keep]

Creates a fresh PostgreSQL database (`BENCH_DATABASE_URL`, default
postgres://postgres@127.0.0.1:5432/tally_bench_billing), migrates it and imports a simulated
whole-GPU fleet (`inventory.simulate`, 8 GPUs a node) with `import_snapshot` at the week's
start, its simulated claims replaced by one claim per GPU allocated from the week's start, so
every GPU is allocated all week. Then:

1. **Ingest**: a sample per GPU every `--interval` seconds for `--days` days (1,000 GPUs, a
   minute, a week: 10,080,000 samples), as the agents post them (one node per request, at
   most `--batch` samples), through `metering.ingest.validate_samples` and `metering.ingest.ingest`
   (the view's two calls, minus HTTP and JSON). The sample dicts are made on the fly and that
   time is left out; samples/s counts validate + ingest only. CPU seconds are given for this
   process and for its PostgreSQL backend (and the server's background processes) from /proc.
2. `VACUUM (ANALYZE)`: what autovacuum would have done after such a load (it is off on the
   development server), then a `CHECKPOINT` (the ingest's pages written out, so the rollup
   does not wait on them); timed, not counted.
3. **Rollup**: `metering.rollup.rollup_pending`, the Celery task's rollup, over every hour
   the ingest marked (the whole period), timed; then the **floor**, one `GROUP BY device,
   hour` over the same samples, every row fetched (run twice, the faster counted). The
   rollup reads the per device-hour sums the ingest kept (`metering.hoursums`, one row a
   device and hour) for every hour that has ended, and scans no sample for them; the floor
   still scans every sample. So the rollup's cost moved to ingest (the triggers' upserts,
   counted in its samples/s), and the ratio says what the rollup costs beside one scan. The
   rollup's rows are checked: allocated GPU-hours == GPUs x hours, measured coverage ~100%
   (with `--covered S`, each sample a mean of readings over S seconds, as agents with
   `TALLY_AGENT_MEAN_SECONDS` send them: coverage S / interval, each held for no more).
4. **Compaction**: the period's day partitions made (its samples are moved out of DEFAULT,
   not counted), bytes a stored sample measured (every partition and the blocks, heap,
   TOAST and indexes, after a VACUUM), the period rolled up again (best of two), then
   `compact_samples` as beat's task runs it, bytes a sample again, and the period rolled up
   from the compacted blocks (best of two): the usage rows must be identical, the ratio of
   the two rollups at most 1.1 (both read the sums: compaction moves no sum).
5. Prints figures, ratios and PASS/FAIL per target; exits 1 if any fails, after a diagnosis
   (time per kind of statement and per COPY, EXPLAIN ANALYZE of the coverage query).

The database is dropped at the end unless `--keep`. See README.md.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import re
import shutil
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import Any

from bench.database import fresh_database
from metering.hours import MS_PER_HOUR

DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/tally_bench_billing"
WEEK_START = datetime(2026, 3, 2, tzinfo=UTC)  # a Monday, long past
GPUS_PER_NODE = 8
TARGET_SAMPLES_PER_S = 50_000.0
TARGET_ROLLUP_RATIO = 1.5  # issue 38: the rollup at most 1.5x its floor
COVERAGE_MIN = 0.999
TARGET_BYTES_PER_SAMPLE = 100  # on disk, indexes, TOAST and every sample table included
TARGET_COMPACTED_ROLLUP_RATIO = 1.1
BYTES_PER_SAMPLE = 600  # heap and indexes measured ~560 (5.2 GiB for 10M), plus WAL headroom
CLK_TCK = os.sysconf("SC_CLK_TCK")
NAMESPACES = ("vision", "nlp", "speech", "recsys", "research")


@dataclass
class Cpu:
    """CPU seconds (user + system) of this process, its PostgreSQL backend and the server's
    background processes (WAL writer, checkpointer, ...), read at one instant."""

    own: float
    backend: float
    background: float

    def __sub__(self, other: Cpu) -> Cpu:
        return Cpu(
            self.own - other.own,
            self.backend - other.backend,
            self.background - other.background,
        )


@dataclass
class Timings:
    """Wall seconds per kind of SQL statement, collected by a Django execute wrapper, and of
    COPY blocks (`timing_copies`), which include this process writing the rows."""

    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    captured: dict[str, tuple[str, Any]] = field(default_factory=dict)

    def __call__(
        self, execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any
    ) -> Any:
        kind = _statement_kind(sql)
        self.captured.setdefault(kind, (sql, params))
        started = time.perf_counter()
        try:
            return execute(sql, params, many, context)
        finally:
            self.seconds[kind] += time.perf_counter() - started
            self.calls[kind] += 1

    @contextmanager
    def timing_copies(self) -> Iterator[None]:
        """Also time every `cursor.copy(...)` block (COPY bypasses the execute wrappers)."""
        import psycopg

        original = psycopg.Cursor.copy
        timings = self

        @contextmanager
        def copy(self: psycopg.Cursor[Any], statement: Any, *args: Any, **kwargs: Any) -> Any:
            match = re.match(r"COPY (\S+)", str(statement))
            kind = f"COPY {match.group(1).strip(chr(34)) if match else '?'} (rows written too)"
            started = time.perf_counter()
            try:
                with original(self, statement, *args, **kwargs) as block:
                    yield block
            finally:
                timings.seconds[kind] += time.perf_counter() - started
                timings.calls[kind] += 1

        psycopg.Cursor.copy = copy  # type: ignore[method-assign]
        try:
            yield
        finally:
            psycopg.Cursor.copy = original  # type: ignore[method-assign]

    def print(self, total: float, indent: str = "    ") -> None:
        sql = sum(self.seconds.values())
        for kind, seconds in sorted(self.seconds.items(), key=lambda item: -item[1]):
            print(
                f"{indent}{kind:<44} {seconds:7.2f} s {100 * seconds / total:5.1f}%"
                f"  ({self.calls[kind]:,} calls)"
            )
        print(f"{indent}{'Python (outside SQL and COPY)':<44} {total - sql:7.2f} s "
              f"{100 * (total - sql) / total:5.1f}%")  # fmt: skip


def _statement_kind(sql: str) -> str:
    text = " ".join(sql.split())
    if "pg_advisory_xact_lock" in text:
        # The rollup sends its settings with its hours' locks (`db.locks.xact_lock_sql`).
        return (
            "rollup: lock the hours, settings"
            if "set_config" in text
            else "ingest: lock the devices"
        )
    if text.startswith("CREATE TEMP TABLE tally_rollup_per_hour"):
        return "rollup: coverage per device and hour"
    if text.startswith("WITH iv("):
        return "rollup: rows of whole hours (INSERT ... SELECT)"
    if text.startswith("WITH pieces"):
        return "rollup: coverage per part-hour allocation"
    if text.startswith("SELECT r.uuid, (SELECT MIN(s.ts_ms)"):
        return "ingest: the sample after each device's first"
    if text.startswith("WITH changed(id, ts_ms, gap)"):
        return "ingest: changed gaps written"
    if text.startswith("WITH r(uuid, lo, hi)"):
        return "ingest: gaps worked out again"
    if text.startswith("WITH inserted AS"):
        return "ingest: INSERT ... SELECT ON CONFLICT"
    if text.startswith("CREATE TEMP TABLE"):
        return "ingest: CREATE TEMP TABLE IF NOT EXISTS"
    if text.startswith("DELETE FROM tally_ingest_batch"):
        return "ingest: DELETE FROM batch table"
    savepoint = re.match(r"(SAVEPOINT|RELEASE SAVEPOINT|ROLLBACK TO SAVEPOINT) ", text)
    if savepoint:
        return savepoint.group(1)
    match = re.match(r'(SELECT|INSERT INTO|DELETE FROM|UPDATE)\b.*?(?:FROM )?"?(\w+)"?', text)
    if match:
        verb = match.group(1).split()[0]
        table = re.search(r'(?:FROM|INTO|UPDATE) "(\w+)"', text)
        return f"{verb} {table.group(1) if table else '?'}"
    return text[:40]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.billing", description=__doc__)
    parser.add_argument("--gpus", type=int, default=1000, help="GPUs (8 per node), all allocated")
    parser.add_argument("--days", type=int, default=7, help="days of samples and rollups")
    parser.add_argument("--interval", type=int, default=60, help="seconds between samples")
    parser.add_argument(
        "--covered",
        type=float,
        help="each sample a mean covering this many seconds (covered_seconds); default: readings",
    )
    parser.add_argument("--batch", type=int, default=5000, help="samples per ingest call")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the database")
    args = parser.parse_args(argv)
    if args.gpus < 1 or args.days < 1 or args.interval < 1 or args.batch < GPUS_PER_NODE:
        parser.error("--gpus, --days, --interval must be positive, --batch at least 8")
    if args.covered is not None and not 0 < args.covered <= args.interval:
        parser.error("--covered must be more than 0 and at most --interval")

    steps = args.days * 86400 // args.interval
    _check_disk(args.gpus * steps)
    with fresh_database(parser, DEFAULT_URL, keep=args.keep):
        gpus = _load_fleet(args.gpus, seed=args.seed)
        return _run(
            gpus,
            steps=steps,
            interval=args.interval,
            covered=args.covered,
            batch=args.batch,
            days=args.days,
        )


# --- the fleet -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Gpu:
    uuid: str
    node: str
    pod_uid: str
    container_id: str
    pid: int


def _load_fleet(count: int, *, seed: int, at: datetime = WEEK_START) -> list[Gpu]:
    from inventory import services as inventory_services
    from inventory import simulate
    from inventory.models import Allocation

    started = time.perf_counter()
    nodes = math.ceil(count / GPUS_PER_NODE)
    objects = [
        obj
        for obj in simulate.generate(nodes=nodes, seed=seed, now=at, mix=simulate.WHOLE_GPU_MIX)
        if obj["kind"] != "ResourceClaim"
    ]
    wanted = [
        (spec["pool"]["name"], entry["name"])
        for obj in objects
        if obj["kind"] == "ResourceSlice"
        for spec in [obj["spec"]]
        for entry in spec.get("devices", [])
    ][:count]
    rng = random.Random(f"{seed}/claims")
    claims = [_claim(pool, device, rng, at=at) for pool, device in wanted]
    report = inventory_services.import_snapshot(
        cluster=inventory_services.get_cluster("default"),
        objects=[*objects, *claims],
        at=at,
    )
    if report.errors:
        raise SystemExit(f"the fleet import reported errors: {report.errors[:5]}")
    allocated = Allocation.objects.filter(start=at, end__isnull=True, device__isnull=False)
    if allocated.count() != count:
        raise SystemExit(f"expected {count} allocations from the week's start, got {allocated}")
    rows = allocated.order_by("device__node__name", "device__name").values_list(
        "device__uuid", "device__node__name", "claim__uid"
    )
    gpus = [
        Gpu(uuid, node, pod_uid=uid, container_id=f"containerd://{i:064x}", pid=4000 + i)
        for i, (uuid, node, uid) in enumerate(rows)
    ]
    print(
        f"fleet: {nodes} nodes, {len(gpus):,} GPUs each allocated by its own claim from "
        f"{at:%Y-%m-%d %H:%M} UTC, imported in {time.perf_counter() - started:.1f} s",
        flush=True,
    )
    return gpus


def _claim(
    pool: str, device: str, rng: random.Random, *, at: datetime = WEEK_START
) -> dict[str, Any]:
    """A one-GPU claim in the API's shape, allocated `device` of `pool` at `at`."""
    namespace = rng.choice(NAMESPACES)
    suffix = "".join(rng.choices("bcdfghjklmnpqrstvwxz2456789", k=5))
    pod = f"train-{pool[-6:]}-{device}-{suffix}"
    pod_uid = str(_uuid(rng))
    stamp = at.strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "creationTimestamp": stamp,
            "name": f"{pod}-gpu",
            "namespace": namespace,
            "ownerReferences": [
                {"apiVersion": "v1", "controller": True, "kind": "Pod", "name": pod, "uid": pod_uid}
            ],
            "resourceVersion": str(rng.randint(10**6, 10**8)),
            "uid": str(_uuid(rng)),
        },
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "exactly": {
                            "allocationMode": "ExactCount",
                            "count": 1,
                            "deviceClassName": "gpu.nvidia.com",
                        },
                    }
                ]
            }
        },
        "status": {
            "allocation": {
                "allocationTimestamp": stamp,
                "devices": {
                    "results": [
                        {
                            "device": device,
                            "driver": "gpu.nvidia.com",
                            "pool": pool,
                            "request": "gpu",
                        }
                    ]
                },
            },
            "reservedFor": [{"name": pod, "resource": "pods", "uid": pod_uid}],
        },
    }


def _uuid(rng: random.Random) -> str:
    import uuid

    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


# --- samples ---------------------------------------------------------------------------------


def _batches(
    gpus: list[Gpu],
    *,
    steps: int,
    interval: int,
    covered: float | None,
    batch: int,
    seed: int = 0,
) -> Iterator[tuple[str, list[dict[str, Any]], datetime]]:
    """(node, samples, received_at) as the agents would post them: one node per request;
    means covering `covered` seconds where it is given.

    Time runs in blocks of `batch // GPUs-on-the-node` steps; within a block each node sends
    its samples, oldest first. Utilisation is a per-GPU level (idle, light, busy) plus noise.
    """
    rng = random.Random(f"{seed}/samples")
    by_node: dict[str, list[Gpu]] = defaultdict(list)
    for gpu in gpus:
        by_node[gpu.node].append(gpu)
    levels = {gpu.uuid: rng.choice((0.0, 15.0, 45.0, 70.0, 85.0, 95.0)) for gpu in gpus}
    noise = [rng.uniform(-10.0, 10.0) for _ in range(9973)]
    stamps = [
        (WEEK_START + timedelta(seconds=step * interval)).isoformat(timespec="milliseconds")[:-6]
        + "Z"
        for step in range(steps)
    ]
    block = max(batch // GPUS_PER_NODE, 1)
    mean = {} if covered is None else {"covered_seconds": covered}
    for first in range(0, steps, block):
        last = min(first + block, steps)
        received_at = WEEK_START + timedelta(seconds=(last - 1) * interval + 5)
        for node, node_gpus in by_node.items():
            samples = []
            for step in range(first, last):
                ts = stamps[step]
                for index, gpu in enumerate(node_gpus):
                    level = levels[gpu.uuid]
                    util = (
                        0.0
                        if not level
                        else round(
                            min(max(level + noise[(step * 31 + index) % 9973], 0.0), 100.0), 1
                        )
                    )
                    mem = 20_000_000_000 + int(util * 500_000_000)
                    samples.append(
                        {
                            "uuid": gpu.uuid,
                            "ts": ts,
                            "gpu_util": util,
                            "mem_used_bytes": mem,
                            "processes": [
                                {
                                    "pid": gpu.pid,
                                    "pod_uid": gpu.pod_uid,
                                    "container_id": gpu.container_id,
                                    "gpu_util": util,
                                    "mem_used_bytes": mem - 600_000_000,
                                }
                            ],
                            **mean,
                        }
                    )
            yield node, samples, received_at


# --- the run ---------------------------------------------------------------------------------


def _run(
    gpus: list[Gpu], *, steps: int, interval: int, covered: float | None, batch: int, days: int
) -> int:
    from django.db import connection

    from metering import ingest, rollup

    connection.ensure_connection()
    backend_pid = connection.connection.info.backend_pid
    total = len(gpus) * steps
    print(
        f"ingest: {total:,} {'samples' if covered is None else f'means over {covered:g} s'} "
        f"({len(gpus):,} GPUs x {steps:,} every {interval} s), one node per call, "
        f"<= {batch:,} a call",
        flush=True,
    )
    timings = Timings()
    validate_s = ingest_s = generate_s = own_cpu = 0.0
    accepted = calls = 0
    cpu_start = _cpu(backend_pid)
    wall_start = last_report = time.perf_counter()
    with connection.execute_wrapper(timings), timings.timing_copies():
        batches = _batches(gpus, steps=steps, interval=interval, covered=covered, batch=batch)
        while True:
            t0 = time.perf_counter()
            item = next(batches, None)
            t1 = time.perf_counter()
            generate_s += t1 - t0
            if item is None:
                break
            node, raw, received_at = item
            c1 = time.process_time()
            valid, rejected = ingest.validate_samples(raw, now=received_at)
            t2 = time.perf_counter()
            report = ingest.ingest(node=node, samples=valid, received_at=received_at)
            t3 = time.perf_counter()
            own_cpu += time.process_time() - c1
            validate_s += t2 - t1
            ingest_s += t3 - t2
            if rejected or report.duplicates or report.unknown_devices:
                raise SystemExit(f"unexpected: {rejected[:3]} {report}")
            accepted += report.accepted
            calls += 1
            if t3 - last_report > 30:
                last_report = t3
                done = validate_s + ingest_s
                print(f"  {accepted:,} samples, {accepted / done:,.0f}/s so far", flush=True)
    wall = time.perf_counter() - wall_start
    cpu = _cpu(backend_pid) - cpu_start
    measured = validate_s + ingest_s
    rate = accepted / measured
    print(
        f"ingest: {accepted:,} samples in {calls:,} calls: {measured:.1f} s "
        f"(validate {validate_s:.1f} s, ingest {ingest_s:.1f} s; making the dicts {generate_s:.1f} "
        f"s not counted; loop wall {wall:.1f} s) -> {rate:,.0f} samples/s"
    )
    busy = own_cpu + cpu.backend
    print(
        f"  CPU: this process {own_cpu:.1f} s in validate + ingest ({cpu.own:.1f} s with the "
        f"dicts made), PostgreSQL backend {cpu.backend:.1f} s, server background processes "
        f"{cpu.background:.1f} s; samples / (process + backend CPU) = {accepted / busy:,.0f}/s"
    )
    timings.print(ingest_s)

    with connection.cursor() as cursor:
        started = time.perf_counter()
        cursor.execute("VACUUM (ANALYZE) billing_sample")
        cursor.execute("ANALYZE")
        # The ingest's pages written out now, so the rollup's writes do not wait on them.
        cursor.execute("CHECKPOINT")
        vacuum_s = time.perf_counter() - started
        # The table is partitioned by day: its size is its partitions'.
        cursor.execute(
            "SELECT (SELECT count(*) FROM billing_sample), "
            "sum(pg_total_relation_size(inhrelid)), sum(pg_relation_size(inhrelid)) "
            "FROM pg_inherits WHERE inhparent = 'billing_sample'::regclass"
        )
        rows, total_bytes, heap_bytes = cursor.fetchone()
    print(
        f"VACUUM (ANALYZE), CHECKPOINT {vacuum_s:.1f} s (not counted); billing_sample "
        f"{rows:,} rows, {total_bytes / 2**30:.2f} GiB with indexes "
        f"({heap_bytes / 2**30:.2f} GiB heap)",
        flush=True,
    )

    hours = [WEEK_START + timedelta(hours=h) for h in range(days * 24)]
    now = WEEK_START + timedelta(days=days)
    rollup_timings = Timings()
    cpu_start = _cpu(backend_pid)
    started = time.perf_counter()
    with connection.execute_wrapper(rollup_timings), rollup_timings.timing_copies():
        rolled = rollup.rollup_pending(now=now, limit=len(hours))
    rollup_s = time.perf_counter() - started
    rollup_cpu = _cpu(backend_pid) - cpu_start
    print(
        f"rollup: {len(rolled)} hours in {rollup_s:.2f} s "
        f"({rollup_s / len(rolled) * 1000:.1f} ms an hour); CPU this process "
        f"{rollup_cpu.own:.1f} s, backend {rollup_cpu.backend:.1f} s (its parallel workers "
        "not counted)"
    )
    rollup_timings.print(rollup_s)

    floor_sql = (
        f"SELECT device_uuid, ts_ms / {MS_PER_HOUR} AS hour, count(*), sum(gpu_util) "
        "FROM billing_sample GROUP BY 1, 2"
    )
    floors = []
    with connection.cursor() as cursor:
        for _ in range(2):
            t0 = time.perf_counter()
            cursor.execute(floor_sql)
            groups = len(cursor.fetchall())
            floors.append(time.perf_counter() - t0)
    floor_s = min(floors)
    ratio = rollup_s / floor_s
    print(f"floor: {floor_sql}\n  {groups:,} groups in {floors[0]:.2f} s, again {floors[1]:.2f} s")

    allocated_h, coverage, usage_rows = _check_usage()
    expected_h = len(gpus) * len(hours)
    # A mean holds for the time its readings covered: the rest of its interval is unmeasured.
    expected_coverage = 1.0 if covered is None else covered / interval
    rolled_up = sorted(rolled) == hours
    checks = [
        (f"ingest {rate:,.0f} samples/s", rate >= TARGET_SAMPLES_PER_S,
         f">= {TARGET_SAMPLES_PER_S:,.0f}"),
        (f"samples stored {rows:,}", rows == total, f"== {total:,}"),
        (f"hours rolled up {len(rolled):,}", rolled_up, f"all {len(hours):,} of the period"),
        (f"rollup {rollup_s:.2f} s, floor {floor_s:.2f} s, rollup/floor {ratio:.2f}x",
         ratio <= TARGET_ROLLUP_RATIO, f"<= {TARGET_ROLLUP_RATIO:.1f}x"),
        (f"allocated {allocated_h:,.3f} GPU-h in {usage_rows:,} usage rows",
         allocated_h == expected_h, f"== {expected_h:,} = GPUs x hours"),
        (f"measured coverage {100 * coverage:.3f}%",
         COVERAGE_MIN * expected_coverage <= coverage <= expected_coverage + 1e-9,
         f"{100 * COVERAGE_MIN * expected_coverage:.1f}% to {100 * expected_coverage:.1f}%"),
    ]  # fmt: skip
    checks.extend(_compaction(hours, now))
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end (other work slows the wall times)")
    for text, passed, target in checks:
        print(f"{'PASS' if passed else 'FAIL'}  {text}  (target {target})")
    if ratio > TARGET_ROLLUP_RATIO:
        _explain_coverage(rollup_timings)
    return 0 if all(passed for _, passed, _ in checks) else 1


def _sample_bytes() -> tuple[int, int]:
    """Samples stored, and the bytes they take on disk: every partition of `billing_sample`
    and the compacted blocks, heap, TOAST and indexes (after a VACUUM, as autovacuum would)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("VACUUM (ANALYZE) billing_sample")
        cursor.execute("VACUUM (ANALYZE) metering_sampleblock")
        cursor.execute(
            "SELECT (SELECT count(*) FROM billing_sample) + (SELECT COALESCE(sum("
            "cardinality(ts_off)), 0) FROM metering_sampleblock), (SELECT sum("
            "pg_total_relation_size(inhrelid)) FROM pg_inherits WHERE inhparent = "
            "'billing_sample'::regclass) + pg_total_relation_size('metering_sampleblock')"
        )
        samples, size = cursor.fetchone()
    return int(samples), int(size)


def _usage_digest() -> str:
    """One digest of every usage row's billed figures: equal digests, the same ledger."""
    from django.db import connection

    from metering.models import UsageHour

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT md5(string_agg(concat_ws(',', hour, allocation_id, device_uuid, gpu_share, "
            "allocated_gpu_ms, utilised_gpu_ms, unmeasured_gpu_ms, team_id, namespace), ';' "
            "ORDER BY hour, allocation_id, id)), count(*) FROM " + UsageHour._meta.db_table
        )
        digest, rows = cursor.fetchone()
    return f"{digest} ({rows:,} rows)"


def _timed_rollup(hours: list[datetime], now: datetime) -> float:
    """The best of two rollups of `hours` (`rollup_hours`, every row written again)."""
    from metering import rollup

    times = []
    for _ in range(2):
        started = time.perf_counter()
        rollup.rollup_hours(hours=hours, now=now)
        times.append(time.perf_counter() - started)
    return min(times)


def _left_bloated(days: list[date]) -> bool:
    """Whether a day's partition, or DEFAULT, still holds the space of rows moved out."""

    from metering.compaction import partition_bloated

    return any(partition_bloated(day) for day in [None, *days])


def _compaction(hours: list[datetime], now: datetime) -> list[tuple[str, bool, str]]:
    """Bytes a stored sample before and after `compact_samples`, and the rollup of the period
    from `billing_sample` against the same from the compacted blocks (identical rows
    required); the checks' lines."""

    from metering.compaction import compact_samples, partition_bloated, rewrite_partition
    from metering.retention import create_day_partition

    started = time.perf_counter()
    days = sorted({hour.date() for hour in hours})
    for day in days:  # the week's samples are in DEFAULT (partitions are made around today)
        create_day_partition(day)
    while partition_bloated(None) and not rewrite_partition(None):  # the rows moved out of it
        time.sleep(1)
    print(f"\ncompaction: day partitions made for the period {time.perf_counter() - started:.1f} s")
    samples, before = _sample_bytes()
    hot_s = _timed_rollup(hours, now)
    hot_digest = _usage_digest()
    started = time.perf_counter()
    report = compact_samples(now=now + timedelta(days=3))
    compact_s = time.perf_counter() - started
    # A partition (DEFAULT too) whose rewrite could not have its lock is left bloated for
    # beat's next run; here, as many runs as it takes.
    tries = 1
    while _left_bloated(days) and tries < 24:
        time.sleep(5)
        tries += 1
        compact_samples(now=now + timedelta(days=3))
    print(f"  compact_samples runs until the partitions were rewritten: {tries}")
    stored, after = _sample_bytes()
    compacted_s = _timed_rollup(hours, now)
    digest = _usage_digest()
    per_before, per_after = before / samples, after / stored
    ratio = compacted_s / hot_s
    print(
        f"  before: {samples:,} samples in {before / 2**20:,.1f} MiB, {per_before:,.1f} "
        f"bytes a sample\n  compact_samples: {sum(report.moved.values()):,} samples into "
        f"{sum(report.blocks.values()):,} blocks in {compact_s:.1f} s "
        f"({sum(report.moved.values()) / compact_s:,.0f} samples/s)\n"
        f"  after: {stored:,} samples in {after / 2**20:,.1f} MiB, {per_after:,.1f} bytes a "
        f"sample ({before / after:.1f}x smaller)\n"
        f"  rollup of the period (best of 2): from billing_sample {hot_s:.2f} s, from the "
        f"blocks {compacted_s:.2f} s, {ratio:.2f}x\n  usage rows {hot_digest} and {digest}"
    )
    return [
        (f"bytes a stored sample {per_after:.1f} after compaction ({per_before:.1f} before)",
         per_after <= TARGET_BYTES_PER_SAMPLE, f"<= {TARGET_BYTES_PER_SAMPLE}"),
        (f"rollup from compacted days / from billing_sample {ratio:.2f}x",
         ratio <= TARGET_COMPACTED_ROLLUP_RATIO,
         f"<= {TARGET_COMPACTED_ROLLUP_RATIO}x: no slower, 10% for a shared machine's noise"),
        ("usage rows the same from compacted days", digest == hot_digest, "identical"),
        (f"samples after compaction {stored:,}", stored == samples, f"== {samples:,}"),
    ]  # fmt: skip


def _check_usage() -> tuple[float, float, int]:
    """Allocated GPU-hours, measured (not unmeasured) share of them, and rows, over all hours."""
    from django.db.models import Count, Sum

    from metering.models import UsageHour

    totals = UsageHour.objects.aggregate(
        allocated=Sum("allocated_gpu_ms"), unmeasured=Sum("unmeasured_gpu_ms"), rows=Count("id")
    )
    allocated = totals["allocated"] or 0
    coverage = 1 - (totals["unmeasured"] or 0) / allocated if allocated else 0.0
    return allocated / MS_PER_HOUR, coverage, totals["rows"]


def _explain_coverage(timings: Timings) -> None:
    """EXPLAIN ANALYZE of the coverage statement as the rollup sent it (its first run)."""
    from django.db import connection, transaction

    found = timings.captured.get("rollup: coverage per device and hour")
    if not found:
        print("diagnosis: no coverage statement seen")
        return
    sql, params = found
    sql = sql.split(" AS ", 1)[1]  # the SELECT of the CREATE TABLE ... AS
    # In a transaction with the rollup's own settings (work_mem, jit), as it ran.
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(*timings.captured["rollup: lock the hours, settings"])
        cursor.execute("EXPLAIN (ANALYZE, BUFFERS) " + sql, params)
        plan = [row[0] for row in cursor.fetchall()]
    print("\ndiagnosis: EXPLAIN (ANALYZE, BUFFERS) of the coverage statement:")
    for line in plan:
        print("  " + line)


# --- measuring -------------------------------------------------------------------------------


def _cpu(backend_pid: int) -> Cpu:
    times = os.times()
    own = times.user + times.system
    backend = _proc_cpu(backend_pid)
    background = sum(_proc_cpu(pid) for pid in _postgres_background_pids() if pid != backend_pid)
    return Cpu(own, backend, background)


def _proc_cpu(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def _postgres_background_pids() -> list[int]:
    """The server's own processes (not client backends): WAL writer, checkpointer, ..."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                text = cmdline.read().decode(errors="replace")
        except OSError:
            continue
        if text.startswith("postgres: ") and any(
            word in text
            for word in ("walwriter", "checkpointer", "background writer", "autovacuum")
        ):
            pids.append(int(entry))
    return pids


def _check_disk(samples: int) -> None:
    path = "/var/lib/postgresql" if os.path.isdir("/var/lib/postgresql") else "/"
    free = shutil.disk_usage(path).free
    needed = samples * BYTES_PER_SAMPLE
    print(f"disk: {free / 2**30:.0f} GiB free under {path}, ~{needed / 2**30:.1f} GiB needed")
    if free < 2 * needed:
        raise SystemExit("not enough free disk for this run; try fewer --gpus or --days")


if __name__ == "__main__":
    sys.exit(main())
