"""Benchmark: a cold `sync_inventory --from-file` of a 100,000-device fleet, against its floor.

    DEBUG=true SECRET_KEY=x .venv/bin/python -m bench.inventory [--devices 100000] [--keep]

Creates a fresh PostgreSQL database (`BENCH_DATABASE_URL`, default
postgres://postgres@127.0.0.1:5432/tally_bench), migrates it, writes a simulated dump of
whole-GPU nodes (8 devices and one ResourceSlice each) and imports it in a subprocess,
measuring wall time and peak RSS. The floor is the same rows loaded the fastest way
PostgreSQL offers: the tables the import wrote are exported with `COPY ... TO STDOUT`,
truncated, and loaded back with one binary `COPY ... FROM STDIN` per table. See README.md.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/tally_bench"
TARGET_IMPORT_SECONDS = 60.0
TARGET_PEAK_MIB = 500.0
TARGET_RATIO = 5.0
# Written only by triggers on other tables (inventory/migrations/0007_node_shape_counts.py).
TRIGGER_KEPT = frozenset({"inventory_nodeshapecount"})


@dataclass
class Measurement:
    import_seconds: float
    # CPU seconds (user + system) of the import's process: steadier than its wall time on a
    # machine shared with other jobs (PostgreSQL's share is not in it).
    import_cpu_seconds: float
    peak_mib: float
    floor_seconds: float
    rows: dict[str, int]

    @property
    def ratio(self) -> float:
        return self.import_seconds / self.floor_seconds if self.floor_seconds else math.inf


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.inventory", description=__doc__)
    parser.add_argument("--devices", type=int, default=100_000, help="GPUs (8 per node)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the database and the dump")
    args = parser.parse_args(argv)
    if args.devices < 8:
        parser.error("--devices must be 8 or more")

    url = os.environ.get("BENCH_DATABASE_URL", DEFAULT_URL)
    database = _database_name(url)
    if "bench" not in database:
        # The database is dropped and created again: never point this at real data.
        parser.error(f"BENCH_DATABASE_URL names {database!r}; its name must contain 'bench'")
    os.environ["DATABASE_URL"] = url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    sys.path.insert(0, str(REPO))

    print(f"database {database}: creating and migrating", flush=True)
    _recreate_database(url)
    import django

    django.setup()
    from django.core.management import call_command

    # In this process, so that RUSAGE_CHILDREN sees the import alone.
    call_command("migrate", verbosity=0)

    nodes = math.ceil(args.devices / 8)
    workdir = Path(tempfile.mkdtemp(prefix="tally-bench-"))
    dump = workdir / "fleet.json"
    try:
        objects = _write_dump(dump, nodes=nodes, seed=args.seed)
        print(f"dump: {nodes} nodes, {objects} objects, {dump.stat().st_size / 2**20:.1f} MiB")
        reader_seconds = _time_reader(dump)
        print(f"reading the dump alone: {reader_seconds:.1f} s")
        result = _measure(url, dump, workdir)
    finally:
        if args.keep:
            print(f"kept: {dump} and database {database}")
        else:
            for path in workdir.iterdir():
                path.unlink()
            workdir.rmdir()
    if not args.keep:
        _drop_database(url)
    return _report(result, expected_devices=nodes * 8)


def _measure(url: str, dump: Path, workdir: Path) -> Measurement:
    env = {**os.environ, "DATABASE_URL": url}
    command = [sys.executable, "manage.py", "sync_inventory", "--from-file", str(dump)]
    print("import:", " ".join(command[1:]), flush=True)
    started = time.perf_counter()
    completed = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    import_seconds = time.perf_counter() - started
    # Linux reports ru_maxrss in KiB: the largest child waited for, here the import only.
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    peak_mib = usage.ru_maxrss / 1024
    import_cpu_seconds = usage.ru_utime + usage.ru_stime
    sys.stdout.write(completed.stdout)
    if completed.returncode:
        sys.stderr.write(completed.stderr[-4000:])
        raise SystemExit(f"the import failed (exit status {completed.returncode})")
    rows = _row_counts(url)
    floor_seconds = _floor(url, rows, workdir)
    return Measurement(import_seconds, import_cpu_seconds, peak_mib, floor_seconds, rows)


def _floor(url: str, rows: dict[str, int], workdir: Path) -> float:
    """Seconds to load the tables' rows back with one binary COPY each, indexes in place."""
    import psycopg

    # Parents first. Tables that triggers keep (the per-node shape counts) are filled by the
    # devices' COPY as they are by the import's, so loading them back too would count twice.
    tables = [table for table, count in rows.items() if count and table not in TRIGGER_KEPT]

    with psycopg.connect(_conninfo(url)) as connection, connection.cursor() as cursor:
        for table in tables:
            with (
                open(workdir / f"{table}.copy", "wb") as out,
                cursor.copy(_sql("COPY {} TO STDOUT (FORMAT binary)", table)) as copy,
            ):
                for block in copy:
                    out.write(block)
        cursor.execute(_sql("TRUNCATE {} CASCADE", *rows))
        connection.commit()
        started = time.perf_counter()
        for table in tables:
            with (
                open(workdir / f"{table}.copy", "rb") as source,
                cursor.copy(_sql("COPY {} FROM STDIN (FORMAT binary)", table)) as copy,
            ):
                while block := source.read(1 << 20):
                    copy.write(block)
        connection.commit()
        return time.perf_counter() - started


def _row_counts(url: str) -> dict[str, int]:
    """Rows per project table, parents before children."""
    import psycopg
    from django.apps import apps

    tables = [model._meta.db_table for model in _models_in_dependency_order(apps)]
    with psycopg.connect(_conninfo(url)) as connection, connection.cursor() as cursor:
        counts = {}
        for table in tables:
            cursor.execute(_sql("SELECT count(*) FROM {}", table))
            row = cursor.fetchone()
            counts[table] = row[0] if row else 0
    return counts


def _models_in_dependency_order(apps: Any) -> list[Any]:
    # Every table of the project: the import also writes what other apps keep of the
    # inventory (billing's hours to roll up again, quota's reservations of adopted claims).
    models = [
        model
        for label in ("inventory", "quota", "billing")
        for model in apps.get_app_config(label).get_models()
    ]
    ordered: list[Any] = []
    while models:
        for model in models:
            parents = {
                field.related_model
                for field in model._meta.concrete_fields
                if field.is_relation and field.related_model is not model
            }
            if all(parent in ordered or parent not in models for parent in parents):
                ordered.append(model)
                models.remove(model)
                break
        else:
            raise RuntimeError(f"circular foreign keys among {models}")
    return ordered


def _write_dump(path: Path, *, nodes: int, seed: int) -> int:
    from inventory import simulate

    started = time.perf_counter()
    with open(path, "w", encoding="utf-8") as stream:
        count = simulate.write_dump(
            simulate.generate(nodes=nodes, seed=seed, mix=simulate.WHOLE_GPU_MIX), stream
        )
    print(f"dump written in {time.perf_counter() - started:.1f} s", flush=True)
    return count


def _time_reader(path: Path) -> float:
    from inventory.dumps import iter_objects

    started = time.perf_counter()
    for _ in iter_objects(path):
        pass
    return time.perf_counter() - started


def _report(result: Measurement, *, expected_devices: int) -> int:
    print()
    for table, count in result.rows.items():
        if count:
            print(f"  {table:<28} {count:>9,} rows")
    devices = result.rows.get("inventory_device", 0)
    checks = [
        (f"import {result.import_seconds:.1f} s", result.import_seconds <= TARGET_IMPORT_SECONDS,
         f"<= {TARGET_IMPORT_SECONDS:.0f} s"),
        (f"peak RSS {result.peak_mib:.0f} MiB", result.peak_mib <= TARGET_PEAK_MIB,
         f"<= {TARGET_PEAK_MIB:.0f} MiB"),
        (f"floor (COPY) {result.floor_seconds:.1f} s, import/floor {result.ratio:.1f}x",
         result.ratio <= TARGET_RATIO, f"<= {TARGET_RATIO:.0f}x"),
        (f"devices imported {devices:,}", devices == expected_devices, f"== {expected_devices:,}"),
    ]  # fmt: skip
    print()
    print(
        f"import CPU (its process, user + system) {result.import_cpu_seconds:.1f} s; load "
        f"average {os.getloadavg()[0]:.1f}"
    )
    for text, passed, target in checks:
        print(f"{'PASS' if passed else 'FAIL'}  {text}  (target {target})")
    return 0 if all(passed for _, passed, _ in checks) else 1


def _database_name(url: str) -> str:
    return url.rsplit("/", 1)[-1].split("?", 1)[0]


def _conninfo(url: str, database: str | None = None) -> str:
    """`url` as psycopg takes it (postgres:// URLs work as they are), maybe for another db."""
    if database is None:
        return url
    base, _, rest = url.rpartition("/")
    query = rest.partition("?")[2]
    return f"{base}/{database}" + (f"?{query}" if query else "")


def _recreate_database(url: str) -> None:
    _drop_database(url)
    _admin(url, "CREATE DATABASE {}")


def _drop_database(url: str) -> None:
    _admin(url, "DROP DATABASE IF EXISTS {} WITH (FORCE)")


def _admin(url: str, template: str) -> None:
    """Run `template` about the bench database from the server's `postgres` database."""
    import psycopg

    with psycopg.connect(_conninfo(url, "postgres"), autocommit=True) as connection:
        connection.execute(_sql(template, _database_name(url)))


def _sql(template: str, *names: str) -> Any:
    """`template` with its one `{}` filled by the quoted identifiers `names`."""
    from psycopg import sql

    return sql.SQL(template).format(sql.SQL(", ").join(map(sql.Identifier, names)))


if __name__ == "__main__":
    sys.exit(main())
