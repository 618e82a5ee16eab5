"""What the benchmarks that run Django on a database of their own share: the database named by
`BENCH_DATABASE_URL` (else the bench's default), created afresh and migrated, then dropped."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from bench.inventory import REPO, _database_name, _drop_database, _recreate_database


@contextmanager
def fresh_database(
    parser: argparse.ArgumentParser, default_url: str, *, keep: bool
) -> Iterator[str]:
    """Create the bench's database (its name must contain `bench`: it is dropped and created
    again), set Django up on it and migrate it; yield its URL; then close the connections and
    drop it unless `keep`. Prints the machine's CPUs and load first."""
    url = os.environ.get("BENCH_DATABASE_URL", default_url)
    database = _database_name(url)
    if "bench" not in database:
        # The database is dropped and created again: never point this at real data.
        parser.error(f"BENCH_DATABASE_URL names {database!r}; its name must contain 'bench'")
    os.environ["DATABASE_URL"] = url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    sys.path.insert(0, str(REPO))
    print(
        f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start",
        flush=True,
    )
    print(f"database {database}: creating and migrating", flush=True)
    _recreate_database(url)
    import django

    django.setup()
    from django.conf import settings
    from django.core.management import call_command

    if settings.DEBUG:
        print("warning: DEBUG is on; Django keeps every query, so run with DEBUG=false")
    call_command("migrate", verbosity=0)
    try:
        yield url
    finally:
        from django.db import connections

        connections.close_all()
        if keep:
            print(f"kept: database {database}")
        else:
            _drop_database(url)
