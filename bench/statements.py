"""Benchmark: a month's statements for a 10,000-GPU fleet from its usage rows, against one
SQL aggregate of the same rows.

    DEBUG=false SECRET_KEY=x .venv/bin/python -m bench.statements [--gpus 10000] [--teams 100]
        [--closed-months 1] [--keep]

Creates a fresh PostgreSQL database (`BENCH_DATABASE_URL`, default
postgres://postgres@127.0.0.1:5432/tally_bench_statements), migrates it, imports a simulated
whole-GPU fleet (`inventory.simulate`, H100 and H200 nodes of 8 GPUs) with every GPU allocated
by its own claim from the first of the first closed month (`--closed-months` before March
2026), charges each allocation to one of `--teams` teams and gives each model a rate card.
Then:

1. **Usage rows**: one `UsageHour` per GPU per hour of the closed months and of March (10,000
   x 744 = 7,440,000 rows for March), written by one `INSERT ... SELECT` over
   `generate_series` (utilised, idle and unmeasured parts varying by GPU and hour), then
   `VACUUM (ANALYZE)`; timed, not counted. Each closed month is then closed
   (`billing.services.close_period`: its statements computed and frozen); timed, not counted.
2. **Statements**: `billing.pricing.refresh_statements` for March: what `run_billing` does
   after its rollup, and what the close does a last time (every team's usage lines per model,
   unit, rate card and day, priced exactly, and the adjustments for data that reached the
   closed months since their close: none here), the statements and lines written. Run twice,
   the faster counted (the first also reads the rows into the cache).
3. **Floor**: one SQL aggregate of March's rows, grouped as the statements group them (team,
   model, profile, unit, day), every row fetched; run twice, the faster counted.
4. Checks: every team's statement holds exactly the allocated, utilised and unmeasured hours
   the floor's aggregate gives for it, and its total is the floor's hours priced by hand.
   Prints the figures, the ratio statements/floor and PASS/FAIL per target (statements within
   `TARGET_SECONDS`); exits 1 if any fails.
5. **Late data**: one usage row of the first closed month changed in SQL (as a rollup of a
   late sample would), and March's statements refreshed once more, timed (not counted): the
   one team's adjustment must take back exactly the change, and be its only one.

The database is dropped at the end unless `--keep`. See README.md.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections import defaultdict
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from fractions import Fraction
from typing import Any

from bench.billing import _load_fleet
from bench.database import fresh_database

DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/tally_bench_statements"
MONTH_START = datetime(2026, 3, 1, tzinfo=UTC)
MONTH_END = datetime(2026, 4, 1, tzinfo=UTC)
HOUR = timedelta(hours=1)
TARGET_SECONDS = 10.0
RATES = {"NVIDIA H100 80GB HBM3": Decimal("2.49"), "NVIDIA H200": Decimal("3.59")}
IDLE_FACTOR = Decimal("0.4")
MS_PER_HOUR = 3_600_000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.statements", description=__doc__)
    parser.add_argument("--gpus", type=int, default=10_000, help="GPUs (8 per node)")
    parser.add_argument("--teams", type=int, default=100, help="teams the GPUs are charged to")
    parser.add_argument(
        "--closed-months",
        type=int,
        default=1,
        help="closed months before March, with usage rows and frozen statements",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the database")
    args = parser.parse_args(argv)
    if args.gpus < 1 or args.teams < 1 or args.closed_months < 0:
        parser.error("--gpus and --teams must be positive, --closed-months not negative")

    os.environ.setdefault("TALLY_BILLING_PERIOD", "month")
    first = _month_start(MONTH_START, -args.closed_months)
    with fresh_database(parser, DEFAULT_URL, keep=args.keep):
        _load_fleet(args.gpus, seed=args.seed, at=first)
        return _run(teams=args.teams, first=first)


def _month_start(month: datetime, months: int) -> datetime:
    """The first of the month `months` after `month`'s (before, when negative)."""
    index = month.year * 12 + month.month - 1 + months
    return month.replace(year=index // 12, month=index % 12 + 1)


def _run(*, teams: int, first: datetime) -> int:
    from django.db import connection

    from billing.models import RateCard, Statement
    from billing.pricing import period_for, refresh_statements
    from billing.services import close_period
    from inventory.models import Allocation
    from teams.models import Team, TeamNamespace

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
    TeamNamespace.objects.bulk_create(
        TeamNamespace(team=team, namespace=team.slug) for team in made
    )
    for product, rate in RATES.items():
        RateCard.objects.create(
            product_name=product,
            per_gpu_hour=rate,
            idle_factor=IDLE_FACTOR,
            currency="USD",
            valid_from=date(2000, 1, 1),
        )
    period = period_for(MONTH_START)

    began = time.perf_counter()
    with connection.cursor() as cursor:
        # Utilised, idle and unmeasured milliseconds that vary by GPU and hour; every row
        # allocated a whole hour. Deterministic: the same rows on every run.
        cursor.execute(
            """
            INSERT INTO billing_usagehour (
                hour, allocation_id, cluster_id, device_uuid, product_name, profile, gpu_share,
                unit, namespace, claim_name, team_id, job, username,
                allocated_gpu_ms, utilised_gpu_ms, unmeasured_gpu_ms
            )
            SELECT h, a.id, a.cluster_id, a.meter_id, a.product_name, a.profile, a.gpu_share,
                   a.unit, c.namespace, c.name, o.team_id, a.job, a.username,
                   %(hour)s,
                   CASE WHEN (a.id + n) %% 11 = 0 THEN 0
                        ELSE ((a.id * 7919 + n * 104729) %% 1000) * 3000 END,
                   CASE WHEN (a.id + n) %% 11 = 0 THEN %(hour)s ELSE 0 END
            FROM inventory_allocation a
            JOIN inventory_resourceclaim c ON c.id = a.claim_id
            JOIN teams_teamnamespace o ON o.namespace = c.namespace
            CROSS JOIN generate_series(%(start)s::timestamptz, %(last)s::timestamptz,
                                       interval '1 hour') WITH ORDINALITY AS g(h, n)
            WHERE a.device_id IS NOT NULL
            """,
            {
                "hour": MS_PER_HOUR,
                "start": first,
                "last": MONTH_END - HOUR,
            },
        )
        rows = cursor.rowcount
    with connection.cursor() as cursor:
        cursor.execute("VACUUM (ANALYZE) billing_usagehour")
        cursor.execute("VACUUM (ANALYZE) inventory_allocation")
    print(
        f"usage rows: {rows:,} ({Allocation.objects.count():,} GPUs x "
        f"{(MONTH_END - first) // HOUR} hours, {teams} teams), written and analyzed "
        f"in {time.perf_counter() - began:.1f} s",
        flush=True,
    )
    closed = []
    month = first
    while month < MONTH_START:
        began = time.perf_counter()
        closed.append(period_for(month))
        close_period(period=closed[-1], actor="bench.statements")
        print(
            f"closed {closed[-1].label}: its statements computed and frozen in "
            f"{time.perf_counter() - began:.1f} s",
            flush=True,
        )
        month = _month_start(month, 1)

    runs = []
    for _ in range(2):
        began = time.perf_counter()
        statements = refresh_statements(period=period)
        runs.append(time.perf_counter() - began)
    statement_s = min(runs)
    print(
        f"statements: {len(statements)} for period {period.label}, "
        f"{', '.join(f'{s:.2f} s' for s in runs)} (faster counted)",
        flush=True,
    )

    floor_runs = []
    floor_rows: list[tuple[Any, ...]] = []
    for _ in range(2):
        began = time.perf_counter()
        with connection.cursor() as cursor:
            cursor.execute(
                """
                SELECT team_id, product_name, profile, unit,
                       (hour AT TIME ZONE 'UTC')::date AS day,
                       sum(allocated_gpu_ms), sum(utilised_gpu_ms), sum(unmeasured_gpu_ms)
                FROM billing_usagehour
                WHERE hour >= %s AND hour < %s
                GROUP BY 1, 2, 3, 4, 5
                """,
                [period.start, period.end],
            )
            floor_rows = cursor.fetchall()
        floor_runs.append(time.perf_counter() - began)
    floor_s = min(floor_runs)
    print(
        f"floor: one GROUP BY team, model, profile, unit, day: {len(floor_rows):,} rows, "
        f"{', '.join(f'{s:.2f} s' for s in floor_runs)} (faster counted)",
        flush=True,
    )

    failures = _check(floor_rows, Statement.objects.filter(period=period))
    if closed:
        failures += _late_data(period, closed[0])
    ratio = statement_s / floor_s if floor_s else float("inf")
    print(f"statements / floor: {ratio:.2f}x")
    verdict = statement_s <= TARGET_SECONDS
    print(
        f"{'PASS' if verdict else 'FAIL'}: statements in {statement_s:.2f} s "
        f"(target <= {TARGET_SECONDS:.0f} s)"
    )
    print(f"{'PASS' if not failures else 'FAIL'}: statements match the floor's figures")
    for failure in failures[:10]:
        print(f"  {failure}")
    return 0 if verdict and not failures else 1


def _late_data(period: Any, closed: Any) -> list[str]:
    """Change one usage row of the `closed` period in SQL (its utilised time made unmeasured,
    as a rollup of a late correction could), refresh `period`'s statements once more, timed,
    and check that the adjustment takes back exactly the change, for that row's team, and is
    the only one."""
    from django.db import connection

    from billing.models import LineKind, StatementLine
    from billing.pricing import refresh_statements

    with connection.cursor() as cursor:
        cursor.execute(
            """
            UPDATE billing_usagehour AS u
            SET unmeasured_gpu_ms = u.allocated_gpu_ms, utilised_gpu_ms = 0
            FROM (SELECT id, utilised_gpu_ms, unmeasured_gpu_ms FROM billing_usagehour
                  WHERE hour = %s AND utilised_gpu_ms > 0 ORDER BY id LIMIT 1) AS old
            WHERE u.id = old.id
            RETURNING u.team_id, u.product_name, old.utilised_gpu_ms,
                      u.allocated_gpu_ms - old.unmeasured_gpu_ms
            """,
            [closed.start],
        )
        team_id, product, utilised_ms, unmeasured_ms = cursor.fetchone()
    began = time.perf_counter()
    refresh_statements(period=period)
    print(
        f"late data: one row of {closed.label} changed, statements refreshed in "
        f"{time.perf_counter() - began:.2f} s (not counted)",
        flush=True,
    )
    adjustments = [
        (line.statement.team_id, line.corrects_period_id, line.product_name, line)
        for line in StatementLine.objects.filter(
            statement__period=period, kind=LineKind.ADJUSTMENT
        ).select_related("statement")
    ]
    if [entry[:3] for entry in adjustments] != [(team_id, closed.pk, product)]:
        return [f"late data: adjustments {adjustments}, wanted one of team {team_id}, {product}"]
    line = adjustments[0][3]
    # Statement lines keep hours to the millionth: the difference of two rounded totals.
    near = Decimal("0.000002")
    if (
        line.allocated_gpu_hours != 0
        or abs(line.utilised_gpu_hours + Decimal(utilised_ms) / MS_PER_HOUR) > near
        or abs(line.unmeasured_gpu_hours - Decimal(unmeasured_ms) / MS_PER_HOUR) > near
    ):
        return [f"late data: adjustment {line.__dict__} is not -{utilised_ms} ms utilised"]
    return []


def _check(floor_rows: list[tuple[Any, ...]], statements: Any) -> list[str]:
    """Each team's statement: its lines' hours are the floor's, and its total is the floor's
    hours priced here by hand (allocated less the idle discount, rounded once per line)."""
    from billing.models import LineKind, StatementLine

    expected: dict[tuple[int, str], list[int]] = defaultdict(lambda: [0, 0, 0])
    for team_id, product, _profile, _unit, _day, allocated, utilised, unmeasured in floor_rows:
        figures = expected[team_id, product]
        figures[0] += int(allocated)  # sum() of bigint is numeric
        figures[1] += int(utilised)
        figures[2] += int(unmeasured)
    failures = []
    totals: dict[int, Decimal] = defaultdict(Decimal)
    for (team_id, product), (allocated, utilised, unmeasured) in expected.items():
        idle = allocated - utilised - unmeasured
        rate = Fraction(RATES[product])
        amount = rate * (Fraction(allocated) - (1 - Fraction(IDLE_FACTOR)) * idle) / MS_PER_HOUR
        totals[team_id] += Decimal(math.floor(amount * 100 + Fraction(1, 2))) / 100  # half up
        line = StatementLine.objects.get(
            statement__team_id=team_id,
            statement__in=statements,
            product_name=product,
            kind=LineKind.USAGE,
        )
        got = (line.allocated_gpu_hours, line.utilised_gpu_hours, line.unmeasured_gpu_hours)
        want = tuple(Decimal(v) / MS_PER_HOUR for v in (allocated, utilised, unmeasured))
        if tuple(round(g, 6) for g in got) != tuple(round(w, 6) for w in want):
            failures.append(f"team {team_id} {product}: hours {got} != {want}")
    for statement in statements:
        if statement.total != totals[statement.team_id]:
            failures.append(
                f"team {statement.team_id}: total {statement.total} != {totals[statement.team_id]}"
            )
    if len(statements) != len(totals):
        failures.append(f"{len(statements)} statements for {len(totals)} teams with usage")
    return failures


if __name__ == "__main__":
    raise SystemExit(main())
