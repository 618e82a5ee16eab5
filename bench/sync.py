"""Benchmark: the sync following a watch stream of claim and slice changes on a large fleet,
and the lag it keeps, against a reader that only decodes the same stream.

    DEBUG=false SECRET_KEY=x .venv/bin/python -m bench.sync [--devices 100000] [--rate 1000]
        [--seconds 30] [--drain 120] [--keep]

Creates a fresh PostgreSQL database (`BENCH_DATABASE_URL`, default
postgres://postgres@127.0.0.1:5432/tally_bench_sync), migrates it and imports a simulated
whole-GPU fleet of `--devices` GPUs (`inventory.simulate`, 8 a node, ~60% allocated, its
history ending at the start of the current hour) with
`import_snapshot`. The same slices and claims are loaded into a local API server that speaks
list and watch (`tests.fake_kube.FakeKube`, the suite's), and the sync's state is set to its
resourceVersion, so the sync starts by watching, as a syncer does after its first list. Then:

1. The real sync (`inventory.kube.sync`, one list + watch loop per kind, through the
   `kubernetes` client, for ResourceClaim and ResourceSlice) follows the server, while a
   producer changes objects at `--rate` a second for `--seconds`: 80% claims (released, or
   allocated again to the device they held), 20% slices (the pool's generation bumped, its
   devices unchanged).
2. **Floor**: at the same time, a reader of the same two watches through the same client
   that only decodes each event (no database): how far behind the stream alone falls.
3. Every 0.2 s the lag of each is sampled: the age of the oldest change not yet applied (the
   sync: by the resourceVersion `SyncState` holds per kind; the floor: by the last event it
   decoded). After the producer stops, up to `--drain` seconds for the sync to catch up.
4. Prints the offered and applied rates (the events applied by kind, and per second from
   the producer's start until caught up or out of time), the sync's and the floor's lag
   (median, p99, max, and at the producer's end), the time to drain, and PASS/FAIL: the sync
   keeps up (its lag at the producer's end within `TARGET_LAG_SECONDS`); exits 1 if not.

The database is dropped at the end unless `--keep`. See README.md.
"""

from __future__ import annotations

import argparse
import bisect
import copy
import json
import math
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.database import fresh_database

DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/tally_bench_sync"
# The fleet's history ends now, as a live cluster's does: a change's hours are this week's,
# inside sample retention, as the sync's dirty-hour marks meet them in production.
START = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
TARGET_LAG_SECONDS = 5.0
KINDS = ("ResourceClaim", "ResourceSlice")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sync", description=__doc__)
    parser.add_argument("--devices", type=int, default=100_000, help="GPUs (8 per node)")
    parser.add_argument("--rate", type=int, default=1000, help="changes offered a second")
    parser.add_argument("--seconds", type=int, default=30, help="how long changes are offered")
    parser.add_argument("--drain", type=int, default=120, help="seconds allowed to catch up")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the database")
    args = parser.parse_args(argv)
    if args.devices < 8 or args.rate < 1 or args.seconds < 1:
        parser.error("--devices at least 8, --rate and --seconds positive")
    with fresh_database(parser, DEFAULT_URL, keep=args.keep):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from inventory import kube, services, simulate
    from inventory.models import SyncState
    from tests.fake_kube import FakeKube

    began = time.perf_counter()
    nodes = math.ceil(args.devices / 8)
    objects = list(
        simulate.generate(nodes=nodes, seed=args.seed, now=START, mix=simulate.WHOLE_GPU_MIX)
    )
    cluster = services.get_cluster("default")
    report = services.import_snapshot(cluster=cluster, objects=objects, at=START)
    if report.errors:
        raise SystemExit(f"the fleet import reported errors: {report.errors[:5]}")
    claims = [obj for obj in objects if obj["kind"] == "ResourceClaim"]
    # The producer releases and allocates again claims that hold devices.
    allocated = [claim for claim in claims if (claim.get("status") or {}).get("allocation")]
    slices = [obj for obj in objects if obj["kind"] == "ResourceSlice"]
    print(
        f"fleet: {nodes:,} nodes, {args.devices:,} GPUs, {len(slices):,} slices, "
        f"{len(claims):,} claims, imported in {time.perf_counter() - began:.1f} s",
        flush=True,
    )

    # Loading the server takes minutes at full size; it must outlive the whole run.
    with FakeKube(max_lifetime_seconds=24 * 3600) as fake, tempfile.TemporaryDirectory() as tmp:
        for obj in [*slices, *claims]:
            fake.add(obj)
        fake.compact()  # the watches start here: the loading's events are no one's business
        for kind in KINDS:
            SyncState.objects.update_or_create(
                cluster=cluster, kind=kind, defaults={"resource_version": fake.resource_version}
            )
        api_client = kube.api_client(kubeconfig=str(fake.write_kubeconfig(Path(tmp) / "kc")))
        stop = threading.Event()
        syncer = threading.Thread(
            target=kube.sync,
            kwargs={"api_client": api_client, "cluster": cluster, "kinds": KINDS, "stop": stop},
            name="sync",
            daemon=True,
        )
        floor = _Floor(fake.url, fake.resource_version)
        floor.start(stop)
        syncer.start()
        emitted = _Emitted()
        producer = threading.Thread(
            target=_produce,
            args=(fake, allocated, slices, emitted, args),
            name="producer",
            daemon=True,
        )

        def applied() -> dict[str, str]:
            return dict(
                SyncState.objects.filter(cluster=cluster, kind__in=KINDS).values_list(
                    "kind", "resource_version"
                )
            )

        before = _applied_events(cluster)
        began_applying = time.perf_counter()
        producer.start()
        samples, floor_samples, end_lag, floor_end_lag = _watch_lag(
            producer, emitted, lambda: {k: int(v or 0) for k, v in applied().items()}, floor
        )
        produced_at = time.perf_counter()
        drained = _wait_drained(emitted, applied, args.drain)
        drain_s = time.perf_counter() - produced_at
        applying_s = time.perf_counter() - began_applying
        after = _applied_events(cluster)
        stop.set()
        syncer.join(30)
        api_client.close()

    offered = emitted.count / args.seconds
    applied_events = sum(after.values()) - sum(before.values())
    print(f"offered: {emitted.count:,} changes in {args.seconds} s ({offered:,.0f}/s)")
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
    rate = applied_events / (args.seconds + drain_s) if drained else applied_events / args.seconds
    print(f"sync apply rate: ~{rate:,.0f} events/s against {offered:,.0f}/s offered")
    if emitted.count != args.rate * args.seconds:
        print(f"FAIL: the producer made {emitted.count} of {args.rate * args.seconds} changes")
        return 1
    verdict = end_lag <= TARGET_LAG_SECONDS
    print(
        f"{'PASS' if verdict else 'FAIL'}: the sync's lag at the producer's end {end_lag:.2f} s "
        f"(target <= {TARGET_LAG_SECONDS:.0f} s at {args.rate}/s offered)"
    )
    return 0 if verdict else 1


class _Emitted:
    """When each change was made, by kind, in resourceVersion order."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.versions: dict[str, list[int]] = {kind: [] for kind in KINDS}
        self.times: dict[str, list[float]] = {kind: [] for kind in KINDS}
        self.count = 0
        self.done = False

    def add(self, kind: str, version: int, at: float) -> None:
        with self.lock:
            self.versions[kind].append(version)
            self.times[kind].append(at)
            self.count += 1

    def lag(self, kind: str, applied_version: int, now: float) -> float:
        """Age of the oldest change of `kind` after `applied_version`; 0 when none."""
        with self.lock:
            i = bisect.bisect_right(self.versions[kind], applied_version)
            return now - self.times[kind][i] if i < len(self.times[kind]) else 0.0

    def last(self, kind: str) -> int:
        with self.lock:
            return self.versions[kind][-1] if self.versions[kind] else 0


def _produce(
    fake: Any,
    claims: list[dict[str, Any]],
    slices: list[dict[str, Any]],
    emitted: _Emitted,
    args: argparse.Namespace,
) -> None:
    rng = random.Random(f"{args.seed}/changes")
    held = {i: True for i in range(len(claims))}
    allocations = {i: claim["status"].get("allocation") for i, claim in enumerate(claims)}
    total = args.rate * args.seconds
    start = time.perf_counter()
    for n in range(total):
        due = start + n / args.rate
        pause = due - time.perf_counter()
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
            version = fake.modify(claim)
            emitted.add("ResourceClaim", int(version), due)
        else:
            i = rng.randrange(len(slices))
            piece = copy.deepcopy(slices[i])
            piece["spec"]["pool"]["generation"] = piece["spec"]["pool"].get("generation", 0) + 1
            slices[i] = piece
            version = fake.modify(piece)
            emitted.add("ResourceSlice", int(version), due)
    emitted.done = True


class _Floor:
    """Reads the same two watches with the same client and only decodes each event."""

    def __init__(self, url: str, resource_version: str) -> None:
        self.url = url
        self.resource_version = resource_version
        self.decoded: dict[str, int] = {kind: int(resource_version) for kind in KINDS}

    def start(self, stop: threading.Event) -> None:
        import kubernetes.client as k8s

        for kind, method in (
            ("ResourceClaim", "list_resource_claim_for_all_namespaces"),
            ("ResourceSlice", "list_resource_slice"),
        ):
            configuration = k8s.Configuration()
            configuration.host = self.url
            api = k8s.ResourceV1Api(k8s.ApiClient(configuration))
            call = getattr(api, method)
            threading.Thread(
                target=self._read, args=(kind, call, stop), daemon=True, name=f"floor-{kind}"
            ).start()

    def _read(self, kind: str, call: Callable[..., Any], stop: threading.Event) -> None:
        response = call(
            watch=True,
            resource_version=self.resource_version,
            timeout_seconds=3600,
            _preload_content=False,
        )
        buffer = b""
        try:
            for chunk in response.stream(65536):
                if stop.is_set():
                    break
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line:
                        event = json.loads(line)
                        version = event["object"]["metadata"].get("resourceVersion")
                        if version:
                            self.decoded[kind] = int(version)
        except Exception:
            if not stop.is_set():
                raise  # the stream broke while measuring: the figures would be wrong
        finally:
            response.release_conn()


def _watch_lag(
    producer: threading.Thread,
    emitted: _Emitted,
    applied: Callable[[], dict[str, int]],
    floor: _Floor,
) -> tuple[list[float], list[float], float, float]:
    samples: list[float] = []
    floor_samples: list[float] = []
    while producer.is_alive():
        time.sleep(0.2)
        now = time.perf_counter()
        versions = applied()
        samples.append(max(emitted.lag(k, versions.get(k, 0), now) for k in KINDS))
        floor_samples.append(max(emitted.lag(k, floor.decoded[k], now) for k in KINDS))
    now = time.perf_counter()
    versions = applied()
    end = max(emitted.lag(k, versions.get(k, 0), now) for k in KINDS)
    floor_end = max(emitted.lag(k, floor.decoded[k], now) for k in KINDS)
    return samples, floor_samples, end, floor_end


def _wait_drained(emitted: _Emitted, applied: Callable[[], dict[str, Any]], limit: int) -> bool:
    deadline = time.perf_counter() + limit
    while time.perf_counter() < deadline:
        versions = applied()
        if all(int(versions.get(k) or 0) >= emitted.last(k) for k in KINDS):
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
