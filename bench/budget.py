"""Benchmark: a team's budget use as the webhook reads it (`team_gpu_hours`), against one SQL
aggregate of the team's usage rows in the period.

    DEBUG=false SECRET_KEY=x .venv/bin/python -m bench.budget [--gpus 1000] [--teams 4]
        [--history-days 90] [--jobs-a-day 12] [--marked-hours-ago 24] [--keep]

Creates a fresh PostgreSQL database (`BENCH_DATABASE_URL`, default
postgres://postgres@127.0.0.1:5432/tally_bench_budget), migrates it and imports a simulated
whole-GPU fleet (`inventory.simulate`) whose GPUs are each held by an open claim from the
first of March 2026, charged to one of `--teams` teams. Then, in SQL (timed, not counted):

- history: `--jobs-a-day` ended allocations a GPU a day over the `--history-days` before
  March, and over March up to the hour before now (2026-03-16 14:30 UTC): the allocations a
  budget read must not scan (a month of a busy fleet, and the months before);
- usage rows: one per allocation and hour of March up to two hours before now, as the rollup
  writes them; beat's rollup recorded as having run then, and three hours of March
  marked for rollup again (late data).

Measured, each run 30 times and the median counted:
1. **Budget**: `billing.selectors.team_gpu_hours` for the first team: its usage rows where whole,
   and the allocations over the hours marked, the hour just ended and the current one;
2. **Floor**: one `SUM(allocated_gpu_ms)` over the team's usage rows in March (the one
   statement of a read from rows alone, which undercounts the hours not rolled up).
Checks that the budget equals the team's allocations' held time over March counted in Python.
Prints the figures and the ratio budget/floor, PASS when within `TARGET_RATIO`; exits 1 if not.
The database is dropped at the end unless `--keep`. See README.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from bench.billing import _load_fleet
from bench.database import fresh_database

DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/tally_bench_budget"
MONTH_START = datetime(2026, 3, 1, tzinfo=UTC)
NOW = datetime(2026, 3, 16, 14, 30, tzinfo=UTC)
HOUR = timedelta(hours=1)
RUNS = 30
TARGET_RATIO = 2.0
MS_PER_HOUR = 3_600_000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.budget", description=__doc__)
    parser.add_argument("--gpus", type=int, default=1000, help="GPUs (8 per node)")
    parser.add_argument("--teams", type=int, default=4, help="teams the GPUs are charged to")
    parser.add_argument("--history-days", type=int, default=90, help="days of ended jobs")
    parser.add_argument("--jobs-a-day", type=int, default=12, help="ended jobs a GPU a day")
    parser.add_argument(
        "--marked-hours-ago",
        type=int,
        default=24,
        help="the first of three hours marked for rollup again, this many hours before now",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the database")
    args = parser.parse_args(argv)
    if min(args.gpus, args.teams, args.jobs_a_day) < 1 or args.history_days < 0:
        parser.error("--gpus, --teams and --jobs-a-day must be positive")
    with fresh_database(parser, DEFAULT_URL, keep=args.keep):
        _load_fleet(args.gpus, seed=args.seed, at=MONTH_START)
        return _run(
            teams=args.teams,
            history_days=args.history_days,
            jobs=args.jobs_a_day,
            marked_hours_ago=args.marked_hours_ago,
        )


def _run(*, teams: int, history_days: int, jobs: int, marked_hours_ago: int) -> int:
    from django.db import connection

    from billing.pricing import period_for
    from billing.selectors import team_gpu_hours
    from inventory.models import Allocation, Unit
    from metering import rollup
    from metering.dirty import mark_dirty
    from metering.models import DirtyHour
    from teams.models import Team

    made = Team.objects.bulk_create(
        Team(slug=f"team-{i:03d}", name=f"Team {i:03d}") for i in range(teams)
    )
    # Each claim's namespace owned by one of the teams since always (`teams.ownership`).
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE inventory_resourceclaim "
            "SET namespace = 'team-' || lpad((id %% %s)::text, 3, '0')",
            [teams],
        )
        cursor.execute(
            "INSERT INTO teams_teamnamespace (team_id, namespace) "
            "SELECT id, slug FROM teams_team WHERE id = ANY(%s)",
            [[team.pk for team in made]],
        )
    period = period_for(NOW)
    rolled_through = NOW.replace(minute=0) - 2 * HOUR
    began = time.perf_counter()
    job = timedelta(days=1) / jobs
    with connection.cursor() as cursor:
        # Ended jobs of each GPU: back to back, each a day's share long, charged as its open one.
        cursor.execute(
            """
            INSERT INTO inventory_allocation (
                cluster_id, claim_id, request, driver, pool, device_name, share_id,
                consumed_capacity, start, "end", job, username, meter_id, unit,
                product_name, profile, device_share, gpu_share, device_id
            )
            SELECT a.cluster_id, a.claim_id, a.request, a.driver, a.pool, a.device_name,
                   a.share_id, a.consumed_capacity, s, s + make_interval(secs => %(job)s),
                   a.job, a.username, a.meter_id, a.unit, a.product_name,
                   a.profile, a.device_share, a.gpu_share, a.device_id
            FROM inventory_allocation a
            CROSS JOIN generate_series(
                %(first)s::timestamptz, %(last)s::timestamptz, make_interval(secs => %(job)s)
            ) AS s
            WHERE a."end" IS NULL
            """,
            {
                "job": job.total_seconds(),
                "first": MONTH_START - timedelta(days=history_days),
                "last": NOW - HOUR - job,
            },
        )
        history = cursor.rowcount
        # As the rollup writes them: each allocation's part of each hour, up to the hour the
        # rollup ran through.
        cursor.execute(
            """
            INSERT INTO billing_usagehour (
                hour, allocation_id, cluster_id, device_uuid, product_name, profile, gpu_share,
                unit, namespace, claim_name, team_id, job, username,
                allocated_gpu_ms, utilised_gpu_ms, unmeasured_gpu_ms
            )
            SELECT h, a.id, a.cluster_id, a.meter_id, a.product_name, a.profile, a.gpu_share,
                   a.unit, c.namespace, c.name, o.team_id, a.job, a.username, held, 0, held
            FROM inventory_allocation a
            JOIN inventory_resourceclaim c ON c.id = a.claim_id
            JOIN teams_teamnamespace o ON o.namespace = c.namespace
            CROSS JOIN LATERAL generate_series(
                date_trunc('hour', GREATEST(a.start, %(start)s)),
                LEAST(COALESCE(a."end", %(through)s), %(through)s) - interval '1 millisecond',
                interval '1 hour'
            ) AS h
            CROSS JOIN LATERAL (
                SELECT CAST(round(extract(epoch FROM
                    LEAST(COALESCE(a."end", %(through)s), %(through)s, h + interval '1 hour')
                    - GREATEST(a.start, h)) * 1000 * a.gpu_share) AS bigint) AS held
            ) AS part
            WHERE a.start < %(through)s AND (a."end" IS NULL OR a."end" > %(start)s)
            """,
            {"start": MONTH_START, "through": rolled_through + HOUR},
        )
        rows = cursor.rowcount
        cursor.execute("VACUUM (ANALYZE) inventory_allocation")
        cursor.execute("VACUUM (ANALYZE) billing_usagehour")
    rollup.record_rolled_through(rolled_through)
    # The fleet's import marked its first hour, which beat would have rolled up long since;
    # late samples have marked three hours of yesterday instead.
    DirtyHour.objects.all().delete()
    late = NOW.replace(minute=0) - timedelta(hours=marked_hours_ago)
    mark_dirty(hours={late + h * HOUR for h in range(3)}, at=NOW)
    print(
        f"history: {history:,} ended allocations; {rows:,} usage rows for March to "
        f"{rolled_through:%d %H:%M}; in {time.perf_counter() - began:.1f} s",
        flush=True,
    )

    team = made[0]

    def budget() -> Decimal:
        return team_gpu_hours(team=team, period=period, now=NOW, unit=Unit.GPU)

    def floor() -> Decimal:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT COALESCE(SUM(allocated_gpu_ms), 0) FROM billing_usagehour "
                "WHERE team_id = %s AND unit = %s AND hour >= %s AND hour < %s",
                [team.pk, Unit.GPU, period.start, period.end],
            )
            (total,) = cursor.fetchone()
        return Decimal(total) / MS_PER_HOUR

    figures = {}
    for name, read in (("budget", budget), ("floor", floor)):
        read()  # the cache warmed
        seconds = []
        for _ in range(RUNS):
            started = time.perf_counter()
            value = read()
            seconds.append(time.perf_counter() - started)
        figures[name] = (statistics.median(seconds), value)

    held = Decimal(0)
    for start, end, share in Allocation.objects.filter(
        claim__namespace=team.slug, unit=Unit.GPU, device__isnull=False, start__lt=NOW
    ).values_list("start", "end", "gpu_share"):
        since, until = max(start, period.start), min(end or NOW, NOW)
        if since < until:
            held += Decimal((until - since) // timedelta(milliseconds=1)) * share
    expected = held / MS_PER_HOUR
    (budget_seconds, used), (floor_seconds, floor_hours) = figures["budget"], figures["floor"]
    ratio = budget_seconds / floor_seconds
    exact = abs(used - expected) < Decimal("0.001")
    print(
        f"budget: {used:.3f} GPU-hours in {budget_seconds * 1000:.2f} ms "
        f"(the allocations held {expected:.3f}: {'equal' if exact else 'DIFFERENT'})"
    )
    print(f"floor:  {floor_hours:.3f} GPU-hours in the usage rows, {floor_seconds * 1000:.2f} ms")
    passed = exact and ratio <= TARGET_RATIO
    print(
        f"ratio budget/floor: {ratio:.2f} (target <= {TARGET_RATIO}) {'PASS' if passed else 'FAIL'}"
    )
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
