"""Benchmark: the quota admission webhook under gunicorn, against a no-op floor on the same stack.

    DEBUG=false SECRET_KEY=x .venv/bin/python -m bench.webhook [--requests 6000] [--clients 50]
        [--rate 300] [--workers 4] [--nodes 1250 | --nodes 1250,12500 | --scale-compare]

Creates a fresh PostgreSQL database (`BENCH_DATABASE_URL`, default
postgres://postgres@127.0.0.1:5432/tally_bench_webhook), migrates it, imports a simulated
10,000-GPU fleet (`--nodes`; `inventory.simulate`, default mix: whole H100/H200, static-MIG
A100s and partitionable H100s) and 100 teams with quota rules, then serves the project with gunicorn
(sync workers, `bench.settings`: the project's settings plus a no-op endpoint) and drives it
from one asyncio process with `--clients` concurrent connections:

1. the no-op endpoint, closed loop at full speed (the floor's throughput) and paced at `--rate`
   (the floor's latency);
2. the webhook (`POST /admission/resourceclaims`) with distinct, realistic CREATE reviews,
   paced at `--rate` (open loop: request i is due at start + i/rate, latency counted from when
   it was due), then closed loop at full speed (its throughput).

Quota state is checked after each webhook run and reset before the next.

With two inventories (`--nodes 1250,12500`, or `--scale-compare`: 10,000 and 100,000 GPUs),
each is imported in its own database (`<name>_n<nodes>`) with the same teams and rules, served
by its own gunicorn, and only the paced runs are measured: the no-op on the first and the
webhook on each, in `--rounds` turns (the same slice of the same reviews on both), then p50/p99
of each and the ratio of the larger inventory's p99 to the smaller one's (target <= 1.2).
`--fleet-changes SECONDS` changes both fleets meanwhile, as a sync does (a node's devices gone,
the one gone before back, the fleet version bumped). See README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

from bench.driver import (
    CpuMeter,
    Leg,
    Run,
    drive,
    drive_alternately,
    free_port,
    start_gunicorn,
    stop,
    wait_until_settled,
)
from bench.inventory import REPO, _conninfo, _database_name, _drop_database, _recreate_database

DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/tally_bench_webhook"
TARGET_P99_MS = 50.0
TARGET_RATIO = 1 / 3
# Issue 38: the CPU an admission costs (client, gunicorn and its database backends) at most
# twice what a no-op answer does.
TARGET_CPU_RATIO = 2.0
NODES = 1250  # x 8 = 10,000 GPUs
SCALE_NODES = (1250, 12500)  # --scale-compare: 10,000 and 100,000 GPUs
# --scale-compare: the paced webhook's p99 with the larger inventory, over the smaller one's.
TARGET_SCALE_RATIO = 1.2
TEAMS = 100
TIGHT_TEAMS = 10  # the last ten teams sit at a small quota: most of what they ask is denied
ENVIRONMENTS = ("prod", "dev", "batch")
WEBHOOK_PATH = "/admission/resourceclaims"
NOOP_PATH = "/admission/noop"
CONTROLLER = "system:serviceaccount:kube-system:resource-claim-controller"
UNAVAILABLE = "ServiceUnavailable"  # the reason of a denial when the database failed

NVIDIA = "gpu.nvidia.com"
H100 = f'device.attributes["{NVIDIA}"].productName.startsWith("NVIDIA H100")'
A100 = f'device.attributes["{NVIDIA}"].productName.startsWith("NVIDIA A100")'
# What each claim asks for, by weight; any of them may also be a dry run (DRY_RUN_SHARE).
KINDS = {
    "one-gpu": 27,
    "gpus": 15,  # 2-4 whole GPUs
    "mig": 15,  # one MIG slice by profile
    "h100": 12,  # 1-2 H100s by productName
    "first-available": 10,  # one H100, else two A100 3g.40gb MIG slices
    "template": 11,  # one GPU, made by the resource-claim controller for a Pod
    "over-quota": 10,  # 16 GPUs of a tight team: always denied
}
DRY_RUN_SHARE = 0.08
MIG_PROFILES = ("1g.10gb", "2g.20gb", "3g.40gb")


def _profile_selector(profile: str) -> str:
    return f'device.attributes["{NVIDIA}"].profile == "{profile}"'


# --- the workload ------------------------------------------------------------------------------


@dataclass
class Review:
    """One AdmissionReview to send, and what the checks need to know about it."""

    uid: str
    name: str
    team: int
    kind: str
    dry_run: bool
    gpus: int  # whole GPUs asked of gpu.nvidia.com
    mig: int  # MIG slices asked of mig.nvidia.com
    body: bytes


def _namespace(team: int, env: str) -> str:
    return f"team-{team:03d}-{env}"


def _exactly(name: str, device_class: str, count: int, *selectors: str) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": device_class, "count": count}
    if selectors:
        exactly["selectors"] = [{"cel": {"expression": s}} for s in selectors]
    return {"name": name, "exactly": exactly}


def workload(count: int, *, seed: int, prefix: str) -> list[Review]:
    """`count` CREATE reviews of distinct claims; the same seed gives the same mix and teams."""
    rng = random.Random(f"{seed}/workload")
    kinds, weights = zip(*KINDS.items(), strict=True)
    reviews = []
    for index in range(count):
        kind = rng.choices(kinds, weights)[0]
        team = (
            rng.randrange(TEAMS - TIGHT_TEAMS, TEAMS)
            if kind == "over-quota"
            else rng.randrange(TEAMS)
        )
        namespace = _namespace(team, rng.choice(ENVIRONMENTS))
        name = f"{prefix}-{index:06d}-{kind}"
        dry_run = rng.random() < DRY_RUN_SHARE
        uid = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        gpus = mig = 0
        username = f"user-{team:03d}-{rng.randrange(5)}"
        metadata: dict[str, Any] = {"name": name, "namespace": namespace}
        if kind == "one-gpu":
            requests, gpus = [_exactly("gpu", NVIDIA, 1)], 1
        elif kind == "gpus":
            gpus = rng.randint(2, 4)
            requests = [_exactly("gpus", NVIDIA, gpus)]
        elif kind == "mig":
            profile = rng.choice(MIG_PROFILES)
            requests, mig = [_exactly("mig", "mig.nvidia.com", 1, _profile_selector(profile))], 1
        elif kind == "h100":
            gpus = rng.randint(1, 2)
            requests = [_exactly("gpu", NVIDIA, gpus, H100)]
        elif kind == "first-available":
            requests = [
                {
                    "name": "gpu",
                    "firstAvailable": [
                        {"name": "h100", "deviceClassName": NVIDIA, "count": 1,
                         "selectors": [{"cel": {"expression": H100}}]},
                        {"name": "a100-mig", "deviceClassName": "mig.nvidia.com", "count": 2,
                         "selectors": [{"cel": {"expression": f"{A100} && "
                                                + _profile_selector("3g.40gb")}}]},
                    ],
                }
            ]  # fmt: skip
            gpus, mig = 1, 2
        elif kind == "template":
            requests, gpus = [_exactly("gpu", NVIDIA, 1)], 1
            username = CONTROLLER
            pod = f"job-{index:06d}-0-{rng.randrange(36**5):05x}"
            metadata["ownerReferences"] = [
                {"apiVersion": "v1", "kind": "Pod", "name": pod, "controller": True,
                 "uid": str(uuid.UUID(int=rng.getrandbits(128), version=4))}
            ]  # fmt: skip
        else:  # over-quota
            requests, gpus = [_exactly("gpus", NVIDIA, 16)], 16
        claim = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": metadata,
            "spec": {"devices": {"requests": requests}},
        }
        body = {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": uid,
                "kind": {"group": "resource.k8s.io", "version": "v1", "kind": "ResourceClaim"},
                "resource": {
                    "group": "resource.k8s.io",
                    "version": "v1",
                    "resource": "resourceclaims",
                },
                "requestKind": {
                    "group": "resource.k8s.io",
                    "version": "v1",
                    "kind": "ResourceClaim",
                },
                "requestResource": {
                    "group": "resource.k8s.io",
                    "version": "v1",
                    "resource": "resourceclaims",
                },
                "name": name,
                "namespace": namespace,
                "operation": "CREATE",
                "userInfo": {
                    "username": username,
                    "uid": str(uuid.UUID(int=rng.getrandbits(128), version=4)),
                    "groups": ["system:authenticated"],
                },
                "object": claim,
                "oldObject": None,
                "dryRun": dry_run,
                "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
            },
        }
        reviews.append(Review(uid, name, team, kind, dry_run, gpus, mig, json.dumps(body).encode()))
    return reviews


def _limits(reviews: list[Review]) -> dict[int, dict[str, Decimal]]:
    """Per team, limits sized to what the workload asks, so the denial share does not depend
    on `--requests`: every whole GPU fits the team's `gpus` rule, the H100 rule (which every
    gpu.nvidia.com request counts on, since it could be given an H100) binds at ~85% of it,
    and the MIG rule at roughly a quarter of the slices asked (GPU-equivalents)."""
    gpus: Counter[int] = Counter()
    mig: Counter[int] = Counter()
    for review in reviews:
        if not review.dry_run and review.kind != "over-quota":
            gpus[review.team] += review.gpus
            mig[review.team] += review.mig
    limits = {}
    for team in range(TEAMS):
        if team >= TEAMS - TIGHT_TEAMS:
            whole, h100, slices = Decimal(8), Decimal(4), Decimal(1)
        else:
            whole = Decimal(max(8, gpus[team]))
            h100 = Decimal(max(4, round(gpus[team] * 0.85)))
            slices = Decimal(max(1, round(mig[team] * 0.25)))
        limits[team] = {"gpus": whole, "h100": h100, "mig": slices, "memory": whole * 48 * 2**30}
    return limits


# --- setting the database up -------------------------------------------------------------------


@dataclass
class Fleet:
    """An inventory a webhook run is served with, and what its workers' shapes cache holds."""

    nodes: int
    devices: int  # published devices present
    shapes: int  # distinct device shapes
    load_s: float  # `shapes.load_fleet`: a worker's first load of the cache
    refresh_s: float  # `shapes.refreshed`: its refresh after a change of one node's devices


def _load_fleet(seed: int, nodes: int) -> Fleet:
    from django.db import connection

    from inventory import services as inventory_services
    from inventory import simulate
    from inventory.models import Device
    from quota.admission import shapes

    started = time.perf_counter()
    cluster = inventory_services.get_cluster("default")
    report = inventory_services.import_snapshot(
        cluster=cluster,
        objects=simulate.generate(nodes=nodes, seed=seed),
        at=datetime.now(UTC),
    )
    if report.errors:
        raise SystemExit(f"the fleet import reported errors: {report.errors[:5]}")
    devices = Device.objects.filter(gone_at__isnull=True).count()
    print(
        f"fleet: {nodes:,} nodes ({nodes * 8:,} GPUs, {devices:,} published devices) "
        f"imported in {time.perf_counter() - started:.1f} s",
        flush=True,
    )
    # What a webhook worker reads when its shapes cache is loaded (at start-up), and when it
    # is refreshed after a sync changed the fleet: here one node's devices gone, then back,
    # as `--fleet-changes` does. The fastest of three each.
    connection.ensure_connection()
    changes = FleetChanges(connection.connection, _drainable_nodes(connection.connection)[:3])
    loads, refreshes = [], []
    for _ in range(3):
        started = time.perf_counter()
        fleet = shapes.load_fleet(cluster=cluster)
        loads.append(time.perf_counter() - started)
        for _ in range(2):
            changes.change()
            started = time.perf_counter()
            fleet = shapes.refreshed(fleet, cluster_id=cluster.pk, version=None)
            refreshes.append(time.perf_counter() - started)
    changes.restore()
    fleet = shapes.refreshed(fleet, cluster_id=cluster.pk, version=None)
    print(
        f"shapes cache: {len(fleet.shapes)} shapes on {len(fleet.per_node):,} nodes, a worker's "
        f"first load {1000 * min(loads):.0f} ms, its refresh after one node's devices changed "
        f"{1000 * min(refreshes):.1f} ms",
        flush=True,
    )
    return Fleet(nodes, devices, len(fleet.shapes), min(loads), min(refreshes))


class FleetChanges:
    """What a sync writes when a node's devices change, on one database: each `change` marks
    the devices of the next of `nodes` gone and publishes those of the one before anew (new
    rows, as the sync makes for devices that come back), then bumps the fleet version, in one
    transaction. One node is drained at a time; `restore` brings it back."""

    def __init__(self, connection: Any, nodes: list[str]) -> None:
        from inventory.models import Cluster, Device, Node

        self.connection = connection
        self.nodes = nodes
        self.changes = 0
        self.devices = 0  # devices gone or back, all changes together
        self.drained: list[int] = []
        columns = [f.column for f in Device._meta.concrete_fields if not f.primary_key]
        copied = ", ".join(
            {"first_seen": "now()", "gone_at": "NULL"}.get(column, column) for column in columns
        )
        table, nodes_table = Device._meta.db_table, Node._meta.db_table
        self.restore_sql = (
            f"INSERT INTO {table} ({', '.join(columns)}) "
            f"SELECT {copied} FROM {table} WHERE id = ANY(%s)"
        )
        self.drain_sql = (
            f"UPDATE {table} SET gone_at = now() WHERE gone_at IS NULL AND node_id = "
            f"(SELECT id FROM {nodes_table} WHERE name = %s AND gone_at IS NULL) RETURNING id"
        )
        self.bump_sql = f"UPDATE {Cluster._meta.db_table} SET fleet_version = fleet_version + 1"

    def change(self) -> None:
        node = self.nodes[self.changes % len(self.nodes)]
        with self.connection.transaction():
            self._restore()
            self.drained = [row[0] for row in self.connection.execute(self.drain_sql, [node])]
            self.devices += len(self.drained)
            self.connection.execute(self.bump_sql)
        self.changes += 1

    def restore(self) -> None:
        with self.connection.transaction():
            self._restore()
            self.connection.execute(self.bump_sql)

    def _restore(self) -> None:
        if self.drained:
            self.connection.execute(self.restore_sql, [self.drained])
            self.devices += len(self.drained)
            self.drained = []


def _drainable_nodes(connection: Any, *, among: int = SCALE_NODES[0]) -> list[str]:
    """Names of nodes among the first `among` (present in both inventories) whose every
    device shape is on other nodes too: draining one changes counts, never which shapes
    the fleet has, so admissions decide alike whatever node is drained when."""
    from inventory.models import Device, Node

    rows = connection.execute(
        f"""
        WITH first AS (SELECT id, name FROM {Node._meta.db_table} ORDER BY id LIMIT %s),
        present AS (
            SELECT DISTINCT node_id, shape_id FROM {Device._meta.db_table}
            WHERE gone_at IS NULL AND shape_id IS NOT NULL
        ),
        rare AS (SELECT shape_id FROM present GROUP BY shape_id HAVING count(node_id) < 2)
        SELECT first.name FROM first
        WHERE EXISTS (SELECT 1 FROM present WHERE present.node_id = first.id)
        AND NOT EXISTS (
            SELECT 1 FROM present JOIN rare USING (shape_id) WHERE present.node_id = first.id
        )
        ORDER BY first.id
        """,
        [among],
    ).fetchall()
    names = [name for (name,) in rows]
    random.Random("drainable").shuffle(names)
    return names


@contextlib.contextmanager
def _using(url: str) -> Iterator[None]:
    """This process's Django connection on `url`'s database meanwhile (each gunicorn serves
    its own through DATABASE_URL); what it remembers of the fleet and rules forgotten."""
    from django.db import connection

    from quota.admission.service import forget_caches

    connection.close()
    saved = connection.settings_dict["NAME"]
    connection.settings_dict["NAME"] = _database_name(url)
    forget_caches()
    try:
        yield
    finally:
        connection.close()
        connection.settings_dict["NAME"] = saved
        forget_caches()


def _prepare(url: str, *, nodes: int, seed: int, limits: dict[int, dict[str, Decimal]]) -> Fleet:
    """A new database at `url`: migrated, a simulated fleet of `nodes` nodes imported, the
    teams and their rules made, no quota state."""
    from django.core.management import call_command

    print(f"database {_database_name(url)}: creating and migrating", flush=True)
    with _using(url):
        _recreate_database(url)
        call_command("migrate", verbosity=0)
        fleet = _load_fleet(seed, nodes)
        _load_teams(limits)
        _reset_quota_state()
    return fleet


def _load_teams(limits: dict[int, dict[str, Decimal]]) -> None:
    from quota.models import Mode, QuotaRule, Unit
    from teams.models import Team, TeamNamespace

    teams = Team.objects.bulk_create(
        Team(slug=f"team-{team:03d}", name=f"Team {team:03d}") for team in range(TEAMS)
    )
    TeamNamespace.objects.bulk_create(
        TeamNamespace(team=teams[team], namespace=_namespace(team, env))
        for team in range(TEAMS)
        for env in ENVIRONMENTS
    )
    rules = []
    for team, limit in limits.items():
        rules += [
            QuotaRule(team=teams[team], name="gpus", device_class=NVIDIA, limit=limit["gpus"]),
            QuotaRule(
                team=teams[team], name="h100", device_class=NVIDIA, selector=H100,
                limit=limit["h100"],
            ),
            QuotaRule(team=teams[team], name="mig", device_class="mig.nvidia.com",
                      limit=limit["mig"]),
        ]  # fmt: skip
        if team % 2 == 0:
            rules.append(
                QuotaRule(
                    team=teams[team], name="memory", device_class=NVIDIA, unit=Unit.MEMORY,
                    mode=Mode.WARN, limit=limit["memory"],
                )
            )  # fmt: skip
    QuotaRule.objects.bulk_create(rules)
    print(f"quota: {TEAMS} teams, {TEAMS * len(ENVIRONMENTS)} namespaces, {len(rules)} rules")


def _reset_quota_state() -> None:
    """Forget every reservation and decision, as if no claim had been admitted yet."""
    from django.db import connection

    from quota.ledger import forget_usage
    from quota.models import AdmissionDecision, QuotaRule, Reservation, ReservationLine

    wait_until_settled(AdmissionDecision._meta.db_table)
    tables = [m._meta.db_table for m in (ReservationLine, Reservation, AdmissionDecision)]
    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {', '.join(tables)}")
    forget_usage()
    with connection.cursor() as cursor:
        # The rules' row versions left by the run before (each admission updates its rules)
        # go, so that every run starts from the same tables.
        cursor.execute(f"VACUUM ANALYZE {QuotaRule._meta.db_table}")
        # Not the emptied tables: statistics that say "no rows" make the workers plan their
        # prepared lookups of reservations as scans of the whole table, kept for the run as
        # the table grows to thousands of rows (a server in service has its tables analyzed
        # with rows in them). Truncated, their size is unknown, as on a new installation.


# --- checks ------------------------------------------------------------------------------------


def _answers(run: Run, reviews: list[Review]) -> tuple[list[tuple[str, bool, str]], Counter[str]]:
    """Every review answered 200 with its uid; tallies of what was decided."""
    tally: Counter[str] = Counter()
    bad = 0
    for review, raw in zip(reviews, run.responses, strict=True):
        if raw is None:
            continue
        head, _, body = raw.partition(b"\r\n\r\n")
        try:
            response = json.loads(body)["response"]
            ok = head.startswith(b"HTTP/1.1 200") and response["uid"] == review.uid
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            bad += 1
            continue
        allowed = response["allowed"] is True
        if review.dry_run:
            tally["dry run " + ("allowed" if allowed else "denied")] += 1
        elif allowed:
            tally["admitted"] += 1
        else:
            tally["denied " + response.get("status", {}).get("reason", "?")] += 1
        if response.get("warnings"):
            tally["with warnings"] += 1
    answered = run.completed - bad
    how = f"paced {run.rate:g}/s" if run.rate else "full speed"
    checks = [
        (f"{run.label} {how}: well-formed answers {answered} of {run.completed} received",
         answered == run.completed, "all: 200, uid echoed"),
    ]  # fmt: skip
    return checks, tally


def _verify(run: Run, reviews: list[Review]) -> list[tuple[str, bool, str]]:
    from django.db.models import F, Q, Sum

    from quota.models import (
        AdmissionDecision,
        Mode,
        QuotaRule,
        Reservation,
        ReservationLine,
        ReservationState,
    )

    wait_until_settled(AdmissionDecision._meta.db_table)
    checks, tally = _answers(run, reviews)
    print(f"  {run.label} decisions: " + ", ".join(f"{k} {v}" for k, v in sorted(tally.items())))
    over = QuotaRule.objects.filter(mode=Mode.ENFORCE, in_use__gt=F("limit")).count()
    lines = dict(
        ReservationLine.objects.filter(~Q(reservation__state=ReservationState.RELEASED))
        .values_list("rule_id")
        .annotate(total=Sum("amount"))
        .order_by()
    )
    drift = sum(
        1 for pk, in_use in QuotaRule.objects.values_list("pk", "in_use")
        if in_use != lines.get(pk, Decimal(0))
    )  # fmt: skip
    live = Reservation.objects.exclude(state=ReservationState.RELEASED).count()
    dry_names = [review.name for review in reviews if review.dry_run]
    dry_reserved = Reservation.objects.filter(name__in=dry_names).count()
    decisions = AdmissionDecision.objects.count()
    label = f"{run.label} {'paced' if run.rate else 'full speed'}"
    checks += [
        (f"{label}: enforce rules over their limit {over}", over == 0, "0"),
        (f"{label}: rules whose in_use != their live lines {drift}", drift == 0, "0"),
        (f"{label}: reservations of dry runs {dry_reserved}", dry_reserved == 0, "0"),
    ]
    # Admissions the database failed (late, or down) are denied and record nothing.
    failed = tally[f"denied {UNAVAILABLE}"]
    checks.append((f"{label}: denied for want of the database {failed}", failed == 0, "0"))
    if run.completed == len(reviews):
        not_dry = sum(1 for review in reviews if not review.dry_run)
        admitted = tally["admitted"]
        checks += [
            (f"{label}: reservations {live}", live == admitted,
             f"== admitted non-dry-run requests {admitted}"),
            (f"{label}: decisions recorded {decisions}", decisions == not_dry - failed,
             f"== non-dry-run requests {not_dry} less the {failed} the database failed"),
        ]  # fmt: skip
    else:
        # Some answers never came back: compare with what the webhook recorded instead.
        recorded = AdmissionDecision.objects.filter(allowed=True, dry_run=False).count()
        checks.append(
            (f"{label}: reservations {live} ({len(reviews) - run.completed} unanswered)",
             live == recorded, f"== admissions recorded {recorded}"),
        )  # fmt: skip
    return checks


# --- main --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.webhook", description=__doc__)
    parser.add_argument("--requests", type=int, default=6000, help="per run (default 6000)")
    parser.add_argument("--clients", type=int, default=50, help="concurrent connections")
    parser.add_argument("--rate", type=float, default=300.0, help="offered req/s, paced runs")
    parser.add_argument("--workers", type=int, default=4, help="gunicorn workers (default 4)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="threads per worker: 1 serves with sync workers (default), more with gthread "
        "workers, as deploy/gunicorn.conf.py does",
    )
    parser.add_argument(
        "--time-limit", type=float, default=90.0, help="seconds per measured run at most"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=6,
        help="turns the full-speed no-op and webhook runs take, alternately (default 6)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--app",
        default="config.wsgi:application",
        help="the WSGI application gunicorn serves (to try a patched one; default %(default)s)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the database(s)")
    parser.add_argument(
        "--py-spy",
        metavar="FILE",
        help="record the workers with py-spy during the paced webhook run (speedscope JSON)",
    )
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument(
        "--nodes",
        default=str(NODES),
        help=f"nodes of the simulated fleet, 8 GPUs each (default {NODES}); two, comma-separated "
        "(1250,12500): the paced webhook's p99 on each inventory, in turns (see --scale-compare)",
    )
    sizes.add_argument(
        "--scale-compare",
        action="store_const",
        dest="nodes",
        const=",".join(map(str, SCALE_NODES)),
        help="--nodes " + ",".join(map(str, SCALE_NODES)) + ": 10,000 against 100,000 GPUs",
    )
    parser.add_argument(
        "--fleet-changes",
        type=float,
        metavar="SECONDS",
        help="with two inventories: change each fleet every SECONDS during the measured turns, "
        "as a sync does (one node's devices gone, the one gone before back, the fleet version "
        "bumped), so each worker refreshes its shapes cache (at most every "
        "TALLY_SHAPE_CACHE_SECONDS)",
    )
    args = parser.parse_args(argv)
    if (
        args.requests < 100
        or args.clients < 1
        or args.rate <= 0
        or args.workers < 1
        or args.threads < 1
    ):
        parser.error(
            "--requests >= 100, --clients >= 1, --rate > 0, --workers >= 1 and --threads >= 1"
        )
    if not 1 <= args.rounds <= args.requests // 50:
        parser.error("--rounds between 1 and --requests / 50")
    try:
        nodes = [int(count) for count in args.nodes.split(",")]
    except ValueError:
        parser.error(f"--nodes {args.nodes!r}: one or two whole numbers, comma-separated")
    if not 1 <= len(nodes) <= 2 or min(nodes) < 1 or len(set(nodes)) != len(nodes):
        parser.error(f"--nodes {args.nodes!r}: one or two different counts of at least 1")
    if len(nodes) == 2 and args.py_spy:
        parser.error("--py-spy records one server: not with two inventories")
    if args.fleet_changes is not None and (len(nodes) != 2 or args.fleet_changes <= 0):
        parser.error("--fleet-changes: seconds > 0, with two inventories (--nodes A,B)")

    url = os.environ.get("BENCH_DATABASE_URL", DEFAULT_URL)
    database = _database_name(url)
    if "bench" not in database:
        parser.error(f"BENCH_DATABASE_URL names {database!r}; its name must contain 'bench'")
    os.environ["DATABASE_URL"] = url
    os.environ["DJANGO_SETTINGS_MODULE"] = "config.settings"
    os.environ.setdefault("SECRET_KEY", "bench-only-secret-key")
    sys.path.insert(0, str(REPO))
    import django

    django.setup()
    from django.db import connection

    paced = workload(args.requests, seed=args.seed, prefix="paced")
    full = workload(args.requests, seed=args.seed, prefix="full")  # same mix, other names
    warm = workload(min(args.requests, 300), seed=args.seed + 1, prefix="warm")
    limits = _limits(paced)
    if len(nodes) == 2:
        return compare_scales(args, url, sorted(nodes), paced=paced, warm=warm, limits=limits)
    _prepare(url, nodes=nodes[0], seed=args.seed, limits=limits)
    # What the set-up left is kept for good: later collections need not look at it again.
    gc.collect()
    gc.freeze()

    port = free_port()
    process = start_gunicorn(
        url, workers=args.workers, threads=args.threads, port=port, app=args.app
    )
    checks: list[tuple[str, bool, str]] = []
    try:
        master = process.pid
        kw: dict[str, Any] = {
            "clients": args.clients,
            "meter": CpuMeter(master, database),
            "limit_s": args.time_limit,
        }
        print("warm-up (not measured):", flush=True)
        drive("noop", port, NOOP_PATH, [r.body for r in warm], rate=None, **kw)
        drive("webhook", port, WEBHOOK_PATH, [r.body for r in warm], rate=None, **kw)
        _reset_quota_state()
        print("measured:", flush=True)
        noop_bodies = [r.body for r in paced]
        floor_paced = drive("noop", port, NOOP_PATH, noop_bodies, rate=args.rate, **kw)
        checks += _answers(floor_paced, paced)[0]
        spy = _start_py_spy(master, args.py_spy, args.requests / args.rate) if args.py_spy else None
        hook_paced = drive("webhook", port, WEBHOOK_PATH, [r.body for r in paced],
                           rate=args.rate, **kw)  # fmt: skip
        if spy is not None:
            spy.wait(timeout=60)
        checks += _verify(hook_paced, paced)
        _reset_quota_state()
        meter = kw.pop("meter")
        floor, hook_full = drive_alternately(
            [
                Leg("noop", port, NOOP_PATH, noop_bodies, meter),
                Leg("webhook", port, WEBHOOK_PATH, [r.body for r in full], meter),
            ],
            rounds=args.rounds,
            **kw,
        )
        checks += _answers(floor, paced)[0] + _verify(hook_full, full)
        connection.close()
    finally:
        stop(process)
        print("gunicorn stopped", flush=True)
        if not args.keep:
            connection.close()
            _drop_database(url)
    return _report(args, checks, floor=floor, floor_paced=floor_paced, paced=hook_paced,
                   full=hook_full)  # fmt: skip


def compare_scales(
    args: argparse.Namespace,
    url: str,
    nodes: list[int],
    *,
    paced: list[Review],
    warm: list[Review],
    limits: dict[int, dict[str, Decimal]],
) -> int:
    """The paced webhook on two inventories of `nodes` nodes, each in its own database and
    served by its own gunicorn, with the same teams, rules and requests: the two take turns
    (`--rounds`), with the no-op on the first as the machine's floor, so the machine's drift
    weighs on both alike. PASS when the larger one's p99 is within TARGET_SCALE_RATIO of the
    smaller one's."""
    database = _database_name(url)
    urls = [_conninfo(url, f"{database}_n{count}") for count in nodes]
    load = [os.getloadavg()[0]]
    servers: list[subprocess.Popen[bytes]] = []
    checks: list[tuple[str, bool, str]] = []
    bodies = [r.body for r in paced]
    try:
        fleets = [
            _prepare(side, nodes=count, seed=args.seed, limits=limits)
            for side, count in zip(urls, nodes, strict=True)
        ]
        gc.collect()
        gc.freeze()
        legs = []
        for side, fleet in zip(urls, fleets, strict=True):
            port = free_port()
            servers.append(
                start_gunicorn(
                    side, workers=args.workers, threads=args.threads, port=port, app=args.app
                )
            )
            meter = CpuMeter(servers[-1].pid, _database_name(side))
            legs.append(Leg(f"{fleet.nodes * 8:,} GPUs", port, WEBHOOK_PATH, bodies, meter))
        floor = Leg("noop", legs[0].port, NOOP_PATH, bodies, legs[0].meter)
        kw: dict[str, Any] = {"clients": args.clients, "limit_s": args.time_limit}
        print("warm-up (not measured):", flush=True)
        for leg in (floor, *legs):
            drive(leg.label, leg.port, leg.path, [r.body for r in warm], rate=None,
                  meter=leg.meter, **kw)  # fmt: skip
        for side in urls:
            with _using(side):
                _reset_quota_state()
        print(f"measured: paced at {args.rate:g}/s, {args.rounds} turns each", flush=True)
        load.append(os.getloadavg()[0])
        with _fleet_changes(urls, every_s=args.fleet_changes):
            floor_run, *runs = drive_alternately(
                [floor, *legs], rounds=args.rounds, rate=args.rate, **kw
            )
        load.append(os.getloadavg()[0])
        checks += _answers(floor_run, paced)[0]
        for side, run in zip(urls, runs, strict=True):
            with _using(side):
                checks += _verify(run, paced)
    finally:
        for process in servers:
            stop(process)
        print("gunicorn stopped", flush=True)
        if not args.keep:
            for side in urls:
                _drop_database(side)
    return _report_scales(
        args, checks, fleets=fleets, legs=[floor, *legs], runs=[floor_run, *runs],
        load=(load[0], load[1], load[2]),
    )  # fmt: skip


@contextlib.contextmanager
def _fleet_changes(urls: list[str], *, every_s: float | None) -> Iterator[None]:
    """Meanwhile, every `every_s` seconds (None: never), each of `urls`' fleets changed as a
    sync changes it (`FleetChanges`: the same node's devices gone in each, the node gone
    before back, the fleet version bumped), from a thread: what makes each webhook worker
    bring its shapes cache up to date. The last node drained comes back at the end."""
    if every_s is None:
        yield
        return
    import psycopg

    stop = threading.Event()
    with contextlib.ExitStack() as stack:
        connections = [
            stack.enter_context(psycopg.connect(_conninfo(url), autocommit=True)) for url in urls
        ]
        nodes = _drainable_nodes(connections[0])
        changes = [FleetChanges(connection, nodes) for connection in connections]

        def change() -> None:
            while not stop.wait(every_s):
                for fleet in changes:
                    fleet.change()

        thread = threading.Thread(target=change, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            for fleet in changes:
                fleet.restore()
            print(
                f"  fleets changed {changes[0].changes} times, every {every_s:g} s: "
                + ", ".join(f"{fleet.devices:,}" for fleet in changes)
                + " devices gone or back",
                flush=True,
            )


def _report_scales(
    args: argparse.Namespace,
    checks: list[tuple[str, bool, str]],
    *,
    fleets: list[Fleet],
    legs: list[Leg],
    runs: list[Run],
    load: tuple[float, float, float],
) -> int:
    print()
    # No req/s: a turn's wall time ends with its slowest answer, so short turns under-report
    # the rate kept; a server that falls behind shows in the p99 (counted from when due).
    print(f"  {'paced at ' + format(args.rate, 'g') + '/s':<22} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'max ms':>8}  CPU ms/request (gunicorn, postgres); others' share")  # fmt: skip
    for leg, run in zip(legs, runs, strict=True):
        print(
            f"  {leg.label:<22} {run.percentile(0.5):8.1f} {run.percentile(0.99):8.1f} "
            f"{run.percentile(1.0):8.1f}  "
            f"{1000 * run.cpu.get('gunicorn', 0) / max(run.completed, 1):.2f}, "
            f"{1000 * run.cpu.get('postgres', 0) / max(run.completed, 1):.2f}; "
            f"{100 * run.others:.0f}% of the machine"
        )
        print(
            f"  {'':<22} p99 per turn: "
            + ", ".join(f"{turn.percentile(0.99):.1f}" for turn in leg.turns)
        )
    for fleet in fleets:
        print(
            f"  {fleet.nodes * 8:,} GPUs: {fleet.devices:,} published devices, {fleet.shapes} "
            f"shapes; a worker's shapes cache: first load {1000 * fleet.load_s:.0f} ms, "
            f"refresh after one node changed {1000 * fleet.refresh_s:.1f} ms"
        )
    print(
        f"  load average (1 min) {load[0]:.1f} before the imports, {load[1]:.1f} before the "
        f"measured turns, {load[2]:.1f} after; {os.cpu_count()} cores; "
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC"
    )
    small, large = runs[1], runs[2]
    ratio = large.percentile(0.99) / small.percentile(0.99)
    checks = [
        (f"webhook p99 with {fleets[1].nodes * 8:,} GPUs {large.percentile(0.99):.1f} ms / with "
         f"{fleets[0].nodes * 8:,} GPUs {small.percentile(0.99):.1f} ms = {ratio:.2f}",
         ratio <= TARGET_SCALE_RATIO, f"<= {TARGET_SCALE_RATIO:g}"),
        *checks,
    ]  # fmt: skip
    print()
    for text, passed, target in checks:
        print(f"{'PASS' if passed else 'FAIL'}  {text}  (target {target})")
    return 0 if all(passed for _, passed, _ in checks) else 1


def _start_py_spy(master: int, output: str, seconds: float) -> subprocess.Popen[bytes]:
    command = [
        str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(master),
        "--subprocesses", "--nonblocking", "--rate", "100", "--format", "speedscope",
        "--duration", str(math.ceil(seconds)), "--output", output,
    ]  # fmt: skip
    spy = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    time.sleep(1.0)  # let it attach
    return spy


def _report(
    args: argparse.Namespace,
    checks: list[tuple[str, bool, str]],
    *,
    floor: Run,
    floor_paced: Run,
    paced: Run,
    full: Run,
) -> int:
    ratio = full.throughput / floor.throughput if floor.throughput else 0.0
    print()
    print(f"  {'':<34} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8}")
    for text, run in (
        (f"no-op, paced {args.rate:g}/s", floor_paced),
        ("no-op, full speed (floor)", floor),
        (f"webhook, paced {args.rate:g}/s", paced),
        ("webhook, full speed", full),
    ):
        print(
            f"  {text:<34} {run.percentile(0.5):8.1f} {run.percentile(0.99):8.1f} "
            f"{run.throughput:8.0f}"
        )
    # Steadier than wall-clock figures on a busy machine: what one request costs in CPU.
    cores = os.cpu_count() or 1
    cpu_ms = {}
    for text, run in (("no-op", floor), ("webhook", full)):
        per_request = cpu_ms[text] = 1000 * sum(run.cpu.values()) / max(run.completed, 1)
        print(
            f"  {text} at full speed: {per_request:.2f} ms CPU per request (client, gunicorn and "
            f"its database backends), so at most ~{cores * 1000 / per_request:.0f} req/s on "
            f"{cores} cores; other processes took {100 * run.others:.0f}% of the machine"
        )
    cpu_ratio = cpu_ms["webhook"] / cpu_ms["no-op"] if cpu_ms["no-op"] else math.inf
    achieved = paced.throughput >= 0.95 * args.rate
    checks = [
        (f"webhook p99 {paced.percentile(0.99):.1f} ms at {args.rate:g} req/s offered",
         paced.percentile(0.99) < TARGET_P99_MS, f"< {TARGET_P99_MS:.0f} ms"),
        (f"webhook achieved {paced.throughput:.0f} req/s of {args.rate:g} offered", achieved,
         ">= 95% of offered"),
        (f"webhook full speed {full.throughput:.0f} req/s, floor {floor.throughput:.0f} req/s, "
         f"ratio {ratio:.2f}", ratio >= TARGET_RATIO, f">= {TARGET_RATIO:.2f}"),
        (f"webhook CPU {cpu_ms['webhook']:.2f} ms an admission, no-op {cpu_ms['no-op']:.2f} ms, "
         f"ratio {cpu_ratio:.2f}", cpu_ratio <= TARGET_CPU_RATIO, f"<= {TARGET_CPU_RATIO:g}x"),
        *checks,
    ]  # fmt: skip
    print()
    for text, passed, target in checks:
        print(f"{'PASS' if passed else 'FAIL'}  {text}  (target {target})")
    return 0 if all(passed for _, passed, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
