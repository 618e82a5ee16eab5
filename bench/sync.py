"""Benchmark: the sync following a watch stream of claim and slice changes on a large fleet,
and the lag it keeps, against a reader that only decodes the same stream.

    DEBUG=false SECRET_KEY=x .venv/bin/python -m bench.sync [--devices 100000] [--rate 1000]
        [--seconds 30] [--drain 120] [--keep]

Creates a fresh PostgreSQL database (`BENCH_DATABASE_URL`, default
postgres://postgres@127.0.0.1:5432/tally_bench_sync), migrates it and imports a simulated
whole-GPU fleet of `--devices` GPUs (`inventory.simulate`, 8 a node, ~60% allocated, its
history ending at the start of the current hour) with `import_snapshot`, then `VACUUM
(ANALYZE)`s it, as autovacuum would (off on the development server). The same slices and
claims, and the claims' Pods with their ReplicaSets and Jobs (`simulate.generate(owners=
True)`), are loaded into a local API server that speaks list, watch and get
(`devtools.fake_kube.FakeKube`, the suite's). The server and the producer run in a process of
their own, as an API server is not in the syncer's process: loaded in this one, its Python
took the sync's CPU; nor does this process keep the fleet's objects once they are served (a
syncer holds none of them, and here each full garbage collection walked them). Then:

1. The real sync (`inventory.kube_sync.sync`, one list + watch loop per kind, through the
   `kubernetes` client, for ResourceClaim and ResourceSlice) lists each kind once, reading
   every claim's owners and gang as a syncer does at its start (timed, not measured as lag),
   then watches. Once both kinds watch, a producer changes objects at `--rate` a second for
   `--seconds`: 80% claims (released, or allocated again to the device they held), 20%
   slices (the pool's generation bumped, its devices unchanged; with `--device-changes F`, a
   share F of them also change an attribute of one device, as a health or firmware change
   republishes it).
2. **Floor**: at the same time, in a third process, a reader of the same two watches through
   the same client that only decodes each event (no database): how far behind the stream
   alone falls.
3. Every 0.2 s the lag of each is sampled: the age of the oldest change not yet applied (the
   sync: by the resourceVersion `SyncState` holds per kind; the floor: by the last event it
   decoded). The processes share the changes made and the floor's progress in shared memory,
   their times on the system's monotonic clock. After the producer stops, up to `--drain`
   seconds for the sync to catch up.
4. Prints the offered and applied rates (the events applied by kind, and per second from
   the producer's start until caught up or out of time), the sync's and the floor's lag
   (median, p99, max, and at the producer's end), the time to drain, the Pods and owners
   the sync read from the server (at its list, and per claim change while measured), the
   CPU this process (the sync) and the database's backends used per 1,000 events applied
   from the producer's start until caught up, with the load average at either end, and
   PASS/FAIL: the sync keeps up (its lag at the producer's end within
   `TARGET_LAG_SECONDS`); exits 1 if not.

The database is dropped at the end unless `--keep`. See README.md.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import copy
import gc
import json
import math
import multiprocessing
import os
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import urllib3

from bench.database import fresh_database
from bench.driver import cpu_seconds, processes
from bench.inventory import _database_name

DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/tally_bench_sync"
# The fleet's history ends now, as a live cluster's does: a change's hours are this week's,
# inside sample retention, as the sync's dirty-hour marks meet them in production.
START = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
TARGET_LAG_SECONDS = 5.0
KINDS = ("ResourceClaim", "ResourceSlice")
# What the claims' owners are read as (the server's `reads`).
OWNER_KINDS = ("Pod", "ReplicaSet", "Job")
# How long the sync's first list may take (the 100,000-GPU one reads ~40,000 Pods).
LIST_LIMIT_SECONDS = 1800


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sync", description=__doc__)
    parser.add_argument("--devices", type=int, default=100_000, help="GPUs (8 per node)")
    parser.add_argument("--rate", type=int, default=1000, help="changes offered a second")
    parser.add_argument("--seconds", type=int, default=30, help="how long changes are offered")
    parser.add_argument("--drain", type=int, default=120, help="seconds allowed to catch up")
    parser.add_argument(
        "--device-changes",
        type=float,
        default=0.0,
        help="share of the slice changes that also change a device (0 to 1)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the database")
    args = parser.parse_args(argv)
    if args.devices < 8 or args.rate < 1 or args.seconds < 1:
        parser.error("--devices at least 8, --rate and --seconds positive")
    if not 0 <= args.device_changes <= 1:
        parser.error("--device-changes is a share, from 0 to 1")
    with fresh_database(parser, DEFAULT_URL, keep=args.keep) as url:
        return _run(args, database=_database_name(url))


def _run(args: argparse.Namespace, *, database: str) -> int:
    from django.db import connections

    from inventory import kube, kube_owners, kube_sync, services, simulate
    from inventory.models import SyncState

    began = time.perf_counter()
    nodes = math.ceil(args.devices / 8)
    objects = list(
        simulate.generate(
            nodes=nodes, seed=args.seed, now=START, mix=simulate.WHOLE_GPU_MIX, owners=True
        )
    )
    owned = [obj for obj in objects if obj["kind"] in OWNER_KINDS]
    fleet = [obj for obj in objects if obj["kind"] not in OWNER_KINDS]
    cluster = services.get_cluster("default")
    report = services.import_snapshot(cluster=cluster, objects=fleet, at=START)
    if report.errors:
        raise SystemExit(f"the fleet import reported errors: {report.errors[:5]}")
    imported_s = time.perf_counter() - began
    began = time.perf_counter()
    # What autovacuum does after such a load (it is off on the development server): without
    # statistics PostgreSQL plans the writer's lookups by id or name among a batch's objects as
    # scans of the whole table, which a cluster in service, its tables analyzed, never does.
    with connections["default"].cursor() as cursor:
        cursor.execute("VACUUM (ANALYZE)")
    analyzed_s = time.perf_counter() - began
    claims = [obj for obj in fleet if obj["kind"] == "ResourceClaim"]
    # The producer releases and allocates again claims that hold devices.
    allocated = [claim for claim in claims if (claim.get("status") or {}).get("allocation")]
    slices = [obj for obj in fleet if obj["kind"] == "ResourceSlice"]
    print(
        f"fleet: {nodes:,} nodes, {args.devices:,} GPUs, {len(slices):,} slices, "
        f"{len(claims):,} claims, {len(owned):,} Pods and owners, imported in "
        f"{imported_s:.1f} s, vacuumed and analyzed in {analyzed_s:.1f} s",
        flush=True,
    )

    # Forked before any thread starts, with no database connection to share.
    connections.close_all()
    context = multiprocessing.get_context("fork")
    total = args.rate * args.seconds
    changes = _Changes(context, total)
    control, server_end = context.Pipe()
    with tempfile.TemporaryDirectory() as tmp:
        kubeconfig = Path(tmp) / "kubeconfig"
        server = context.Process(
            target=_serve,
            args=(server_end, kubeconfig, changes, [*slices, *claims, *owned], allocated, slices),
            kwargs={
                "seed": args.seed,
                "rate": args.rate,
                "device_changes": args.device_changes,
            },
            name="fake-kube",
            daemon=True,
        )
        server.start()
        # The fleet's objects are the server's now. A syncer holds none of them; held here,
        # they made each of the sync's full garbage collections walk the whole fleet (~0.2 s
        # at 10,000 GPUs, every few batches).
        del objects, owned, fleet, claims, allocated, slices
        gc.collect()
        began = time.perf_counter()
        url, resource_version = control.recv()
        print(f"API server loaded in {time.perf_counter() - began:.1f} s", flush=True)
        floor = _Floor(context, url, resource_version)

        api_client = kube.api_client(kubeconfig=str(kubeconfig))
        rereads = _steady_rereads(random.Random(args.seed))
        kube_owners.RereadSchedule = rereads  # type: ignore[misc]  # the sync's loops make theirs
        stop = threading.Event()
        syncer = threading.Thread(
            target=kube_sync.sync,
            kwargs={"api_client": api_client, "cluster": cluster, "kinds": KINDS, "stop": stop},
            name="sync",
            daemon=True,
        )
        syncer.start()
        began = time.perf_counter()
        listed = _wait_listed(cluster, server)
        print(
            f"the sync's first list: {time.perf_counter() - began:.1f} s"
            + ("" if listed else f", NOT done in {LIST_LIMIT_SECONDS} s"),
            flush=True,
        )
        if not listed:
            stop.set()
            return 1

        def applied() -> dict[str, int]:
            return {
                kind: int(version or 0)
                for kind, version in SyncState.objects.filter(
                    cluster=cluster, kind__in=KINDS
                ).values_list("kind", "resource_version")
            }

        emitted = _Emitted(changes, args.rate)
        before = _applied_events(cluster)
        cpu_meter = CpuMeter(database)
        cpu_before = cpu_meter.sample()
        load_at_start = os.getloadavg()[0]
        rereads.backdating = False
        control.send("produce")
        list_reads = control.recv()
        began_applying = time.monotonic()
        samples, floor_samples, end_lag, floor_end_lag = _watch_lag(
            emitted, total, server, applied, floor
        )
        produced_at = time.monotonic()
        drained = _wait_drained(emitted, applied, args.drain)
        drain_s = time.monotonic() - produced_at
        applying_s = time.monotonic() - began_applying
        cpu = CpuMeter.spent(cpu_before, cpu_meter.sample())
        load_at_end = os.getloadavg()[0]
        after = _applied_events(cluster)
        control.send("stop")
        run_reads = control.recv()
        stop.set()
        syncer.join(30)
        api_client.close()
        floor.stop()
        server.join(30)

    offered = emitted.count / args.seconds
    applied_events = sum(after.values()) - sum(before.values())
    print(
        f"offered: {emitted.count:,} changes in {args.seconds} s ({offered:,.0f}/s; "
        f"{args.device_changes:.0%} of the slice changes change a device)"
    )
    print(
        "applied by kind: "
        + ", ".join(
            f"{kind} {after.get(kind, 0) - before.get(kind, 0):,} "
            f"of {len(emitted.versions[kind]):,}"
            for kind in KINDS
        )
        + f"; {applied_events / applying_s:,.0f} events/s over the {applying_s:.1f} s measured"
    )
    caught = f"caught up {drain_s:.1f} s later" if drained else f"NOT caught up in {drain_s:.0f} s"
    print(
        f"sync: applied {applied_events:,} events; lag during the run median "
        f"{_pct(samples, 50):.2f} s, p99 {_pct(samples, 99):.2f} s, "
        f"max {max(samples, default=0):.2f} s; at the producer's end {end_lag:.2f} s; {caught}"
    )
    print(
        f"floor (decode only): lag median {_pct(floor_samples, 50):.2f} s, p99 "
        f"{_pct(floor_samples, 99):.2f} s, at the producer's end {floor_end_lag:.2f} s"
    )
    claim_changes = len(emitted.versions["ResourceClaim"])
    steady = list_reads.get("Pod", 0) / kube_owners.GANG_REREAD_MAX_SECONDS * args.seconds
    print(
        "reads from the API server: at the first list "
        + _reads_line(list_reads)
        + "; while measured "
        + _reads_line(run_reads)
        + f" ({run_reads.get('Pod', 0) / max(claim_changes, 1):.3f} Pods a claim change; "
        f"~{steady:,.0f} Pods in {args.seconds} s in a steady state, each claim's Pod read "
        f"once every {kube_owners.GANG_REREAD_MAX_SECONDS:.0f} s)"
    )
    per_thousand = 1000 / max(applied_events, 1)
    print(
        f"CPU per 1,000 events applied: the sync's process {cpu['sync'] * per_thousand:.2f} s, "
        f"its database's backends {cpu['postgres'] * per_thousand:.2f} s; load average "
        f"{load_at_start:.1f} at the producer's start, {load_at_end:.1f} at the end"
    )
    # From the producer's start until caught up or out of time.
    rate = applied_events / (args.seconds + drain_s)
    print(f"sync apply rate: ~{rate:,.0f} events/s against {offered:,.0f}/s offered")
    if emitted.count != total:
        print(f"FAIL: the producer made {emitted.count} of {total} changes")
        return 1
    verdict = end_lag <= TARGET_LAG_SECONDS
    print(
        f"{'PASS' if verdict else 'FAIL'}: the sync's lag at the producer's end {end_lag:.2f} s "
        f"(target <= {TARGET_LAG_SECONDS:.0f} s at {args.rate}/s offered)"
    )
    return 0 if verdict else 1


def _steady_rereads(rng: random.Random) -> Any:
    """The sync's schedule of Pod re-reads (`kube_owners.RereadSchedule`) as in a syncer that has
    run a while: each read while `backdating` (the first list) is dated back by a random share
    of the wait it gets, so the claims come due spread over their waits, at the rate a
    steady state reads them (each claim's Pod once per wait), and not all at once at the
    list's time plus the wait, nor never within the run."""
    from inventory import kube_owners

    class SteadyRereads(kube_owners.RereadSchedule):
        backdating = True

        def read(self, claim: dict[str, Any], now: float, *, settled: bool) -> None:
            if type(self).backdating:
                wait = (
                    kube_owners.GANG_REREAD_MAX_SECONDS
                    if settled
                    else kube_owners.GANG_REREAD_SECONDS
                )
                now -= rng.uniform(0, wait)
            super().read(claim, now, settled=settled)

    return SteadyRereads


def _wait_listed(cluster: Any, server: Any) -> bool:
    """Wait for the sync's first list of every kind; False if it takes too long."""
    from inventory.models import SyncState

    deadline = time.monotonic() + LIST_LIMIT_SECONDS
    while time.monotonic() < deadline and server.is_alive():
        listed = SyncState.objects.filter(cluster=cluster, kind__in=KINDS, relists__gte=1)
        if listed.count() == len(KINDS):
            return True
        time.sleep(0.5)
    return False


class CpuMeter:
    """CPU seconds this process (the sync, and the lag sampling beside it) and the bench
    database's backends have used."""

    def __init__(self, database: str) -> None:
        self._marker = f" {database} ".encode()  # "postgres: 15/main: user DATABASE host ..."

    def sample(self) -> dict[str, dict[int, float]]:
        return {
            "sync": {0: time.process_time()},
            "postgres": cpu_seconds(processes(cmdline=self._marker)),
        }

    @staticmethod
    def spent(
        before: dict[str, dict[int, float]], after: dict[str, dict[int, float]]
    ) -> dict[str, float]:
        # A backend that started meanwhile counts whole; one that ended is lost (the sync's
        # connections live through the run).
        return {
            name: sum(value - before[name].get(pid, 0.0) for pid, value in now.items())
            for name, now in after.items()
        }


def _reads_line(reads: dict[str, int]) -> str:
    return ", ".join(f"{reads.get(kind, 0):,} {kind}s" for kind in OWNER_KINDS)


class _Changes:
    """The changes the producer made, in memory shared between the server's process, which
    writes them, and this one: each change's kind (an index into `KINDS`) and
    resourceVersion, how many were made, and when the first was due (`time.monotonic`, the
    same clock in every process)."""

    def __init__(self, context: Any, total: int) -> None:
        self.kinds = context.RawArray("b", max(total, 1))
        self.versions = context.RawArray("q", max(total, 1))
        self.made = context.Value("q", 0)
        self.started = context.Value("d", 0.0)

    def record(self, n: int, kind: str, version: int) -> None:
        self.kinds[n] = KINDS.index(kind)
        self.versions[n] = version
        with self.made.get_lock():
            self.made.value = n + 1


class _Emitted:
    """When each change was due, by kind, in resourceVersion order, as read from `_Changes`."""

    def __init__(self, changes: _Changes, rate: int) -> None:
        self._changes = changes
        self._rate = rate
        self.versions: dict[str, list[int]] = {kind: [] for kind in KINDS}
        self.times: dict[str, list[float]] = {kind: [] for kind in KINDS}
        self.count = 0

    def pull(self) -> None:
        """Take the changes made since the last pull."""
        with self._changes.made.get_lock():
            made = self._changes.made.value
        started = self._changes.started.value
        for n in range(self.count, made):
            kind = KINDS[self._changes.kinds[n]]
            self.versions[kind].append(self._changes.versions[n])
            self.times[kind].append(started + n / self._rate)
        self.count = made

    def lag(self, kind: str, applied_version: int, now: float) -> float:
        """Age of the oldest change of `kind` after `applied_version`; 0 when none."""
        i = bisect.bisect_right(self.versions[kind], applied_version)
        return now - self.times[kind][i] if i < len(self.times[kind]) else 0.0

    def last(self, kind: str) -> int:
        return self.versions[kind][-1] if self.versions[kind] else 0


def _serve(
    control: Connection,
    kubeconfig: Path,
    changes: _Changes,
    served: list[dict[str, Any]],
    claims: list[dict[str, Any]],
    slices: list[dict[str, Any]],
    *,
    seed: int,
    rate: int,
    device_changes: float,
) -> None:
    """The API server's process: load `served`, answer the sync, produce the changes when
    told, and report the owner reads made before and since."""
    from devtools import fake_kube

    # Loading the server takes minutes at full size; it must outlive the whole run.
    with fake_kube.FakeKube(max_lifetime_seconds=24 * 3600) as fake:
        for obj in served:
            fake.add(obj)
        fake.compact()  # the watches start here: the loading's events are no one's business
        fake.write_kubeconfig(kubeconfig)
        control.send((fake.url, fake.resource_version))
        control.recv()  # the sync has listed
        listed = _owner_reads(fake)
        control.send(listed)
        _produce(fake, claims, slices, changes, seed=seed, rate=rate, device_changes=device_changes)
        control.recv()  # measured
        since = _owner_reads(fake)
        control.send({kind: since[kind] - listed[kind] for kind in OWNER_KINDS})


def _owner_reads(fake: Any) -> dict[str, int]:
    return {kind: len(fake.reads(kind)) for kind in OWNER_KINDS}


def _produce(
    fake: Any,
    claims: list[dict[str, Any]],
    slices: list[dict[str, Any]],
    changes: _Changes,
    *,
    seed: int,
    rate: int,
    device_changes: float = 0.0,
) -> None:
    rng = random.Random(f"{seed}/changes")
    held = {i: True for i in range(len(claims))}
    allocations = {i: claim["status"].get("allocation") for i, claim in enumerate(claims)}
    total = len(changes.versions)
    start = time.monotonic()
    changes.started.value = start
    for n in range(total):
        due = start + n / rate
        pause = due - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        if rng.random() < 0.8 and claims:
            i = rng.randrange(len(claims))
            claim = copy.deepcopy(claims[i])
            if held[i]:
                claim["status"] = {}  # released
            elif allocations[i] is not None:
                # Allocated anew: the scheduler stamps the allocation with the time it made it.
                allocation = {**allocations[i], "allocationTimestamp": _now_timestamp()}
                claim["status"] = {"allocation": allocation}
            held[i] = not held[i]
            claims[i] = claim
            changes.record(n, "ResourceClaim", int(fake.modify(claim)))
        else:
            i = rng.randrange(len(slices))
            piece = copy.deepcopy(slices[i])
            piece["spec"]["pool"]["generation"] = piece["spec"]["pool"].get("generation", 0) + 1
            if device_changes and rng.random() < device_changes and piece["spec"].get("devices"):
                device = rng.choice(piece["spec"]["devices"])
                attributes = device.setdefault("attributes", {})
                attributes["bench.tally.dev/revision"] = {"int": n}
            slices[i] = piece
            changes.record(n, "ResourceSlice", int(fake.modify(piece)))


class _Floor:
    """Reads the same two watches with the same client, in a process of its own, and only
    decodes each event; the last resourceVersion decoded per kind is in shared memory."""

    def __init__(self, context: Any, url: str, resource_version: str) -> None:
        self.decoded = context.RawArray("q", [int(resource_version)] * len(KINDS))
        self._process = context.Process(
            target=self._read_all,
            args=(url, resource_version, self.decoded),
            name="floor",
            daemon=True,
        )
        self._process.start()

    def version(self, kind: str) -> int:
        return int(self.decoded[KINDS.index(kind)])

    def stop(self) -> None:
        self._process.terminate()
        self._process.join(10)

    @staticmethod
    def _read_all(url: str, resource_version: str, decoded: Any) -> None:
        import kubernetes.client as k8s

        threads = []
        for index, method in enumerate(
            ("list_resource_claim_for_all_namespaces", "list_resource_slice")
        ):
            configuration = k8s.Configuration()
            configuration.host = url
            call = getattr(k8s.ResourceV1Api(k8s.ApiClient(configuration)), method)
            threads.append(
                threading.Thread(
                    target=_Floor._read,
                    args=(call, resource_version, decoded, index),
                    name=f"floor-{KINDS[index]}",
                )
            )
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    @staticmethod
    def _read(call: Callable[..., Any], resource_version: str, decoded: Any, index: int) -> None:
        response = call(
            watch=True,
            resource_version=resource_version,
            timeout_seconds=3600,
            _preload_content=False,
        )
        buffer = b""
        # The server ends the stream when the run is over: the process is then stopped.
        with contextlib.suppress(urllib3.exceptions.HTTPError):
            for chunk in response.stream(65536):
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line:
                        event = json.loads(line)
                        version = event["object"]["metadata"].get("resourceVersion")
                        if version:
                            decoded[index] = int(version)


def _watch_lag(
    emitted: _Emitted,
    total: int,
    server: Any,
    applied: Callable[[], dict[str, int]],
    floor: _Floor,
) -> tuple[list[float], list[float], float, float]:
    samples: list[float] = []
    floor_samples: list[float] = []
    while emitted.count < total and server.is_alive():
        time.sleep(0.2)
        emitted.pull()
        now = time.monotonic()
        versions = applied()
        samples.append(max(emitted.lag(k, versions.get(k, 0), now) for k in KINDS))
        floor_samples.append(max(emitted.lag(k, floor.version(k), now) for k in KINDS))
    now = time.monotonic()
    versions = applied()
    end = max(emitted.lag(k, versions.get(k, 0), now) for k in KINDS)
    floor_end = max(emitted.lag(k, floor.version(k), now) for k in KINDS)
    return samples, floor_samples, end, floor_end


def _wait_drained(emitted: _Emitted, applied: Callable[[], dict[str, int]], limit: int) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        versions = applied()
        if all(versions.get(k, 0) >= emitted.last(k) for k in KINDS):
            return True
        time.sleep(0.2)
    return False


def _applied_events(cluster: Any) -> dict[str, int]:
    """Events the sync applied so far, by kind."""
    from inventory.models import SyncState

    return dict(
        SyncState.objects.filter(cluster=cluster, kind__in=KINDS).values_list(
            "kind", "events_applied"
        )
    )


def _now_timestamp() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _pct(values: list[float], percent: int) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[percent - 1]


if __name__ == "__main__":
    raise SystemExit(main())
