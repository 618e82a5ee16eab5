"""`manage.py` answers a configuration or database problem in one line, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from django.db import connection
from psycopg import sql

from db.embedded import postgres_url

REPO = Path(__file__).resolve().parent.parent


def manage(*args: str, **environment: str | None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DEBUG": "true"}
    for name, value in environment.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_one_line(result: subprocess.CompletedProcess[str], *, code: int, says: str) -> None:
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert says in result.stderr


@pytest.fixture
def empty_database(django_db_blocker: pytest.FixtureRequest) -> Iterator[str]:
    """A database on the test server with no tables: an installation before `migrate`."""
    with django_db_blocker.unblock():  # type: ignore[attr-defined]
        server = {**connection.settings_dict, "NAME": "postgres"}
    name = f"tally_empty_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(postgres_url(server), autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield postgres_url({**server, "NAME": name})
    finally:
        with psycopg.connect(postgres_url(server), autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.mark.parametrize(
    "command",
    [
        ["fleet_report"],
        ["statement", "--team", "vision", "--period", "2026-11"],
        ["run_billing", "--period", "2026-11"],
        ["load_demo"],
        ["create_agent_token", "--node", "gpu-1"],
        ["apply_policy", "docs/policy.example.yaml"],
        ["review_claims", "docs/examples", "--namespace", "vision"],
        ["reconcile_quotas"],
        ["api_token", "list", "finance"],
    ],
)
def test_a_command_before_migrate_says_to_migrate(empty_database: str, command: list[str]) -> None:
    result = manage(*command, DATABASE_URL=empty_database)
    assert_one_line(result, code=1, says="run `python manage.py migrate` first")


def test_an_unreachable_database_is_named() -> None:
    result = manage("fleet_report", DATABASE_URL="postgres://tally@127.0.0.1:1/tally")
    assert_one_line(result, code=1, says="cannot use the database")


@pytest.mark.parametrize(
    ("environment", "says"),
    [
        ({"DEBUG": "maybe"}, "DEBUG='maybe' is not a boolean"),
        ({"DEBUG": None, "SECRET_KEY": None}, "export DEBUG=true"),
        ({"DATABASE_URL": "mysql://x@localhost/tally"}, "DATABASE_URL must name a PostgreSQL"),
    ],
)
def test_a_bad_environment_is_named(environment: dict[str, str | None], says: str) -> None:
    result = manage("fleet_report", **environment)
    assert_one_line(result, code=2, says=says)


def test_traceback_on_request() -> None:
    result = manage("fleet_report", "--traceback", DEBUG="maybe")
    assert result.returncode != 0
    assert "Traceback" in result.stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--help"], "[billing]"),
        (["help", "run_billing"], "--period PERIOD"),
        (["ingest_samples", "--help"], "mem_used_bytes"),
    ],
)
def test_help_needs_no_secret_and_no_database(args: list[str], says: str) -> None:
    """A newcomer reads the help before setting anything: no secret, no database (and none
    started: the URL would fail to connect)."""
    result = manage(*args, DEBUG=None, SECRET_KEY=None, SECRET_KEY_FILE=None, DATABASE_URL=None)
    assert result.returncode == 0, result.stderr
    assert says in result.stdout
    assert "Started the embedded PostgreSQL" not in result.stderr
