"""The read replica (DATABASE_REPLICA_URL): GET pages of the portal and the API read from it,
writes and transactions stay on the primary, migrations run on the primary only.

The suite runs without DATABASE_REPLICA_URL, so the `replica` fixture adds the alias the way
settings make it (`config.settings._replica_database`) for the test database, and sets it up
as Django's test runner sets up a TEST MIRROR: a second connection to the same database. It is
read-only (as settings make it), so a write misrouted to it would fail. The tests commit
(transactional), since the replica's connection sees only committed rows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from urllib.parse import quote

import pytest
from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections, transaction
from django.test import Client
from django.test.utils import CaptureQueriesContext
from pytest_django import DjangoDbBlocker
from pytest_django.fixtures import SettingsWrapper

from config.readonly import PIN_COOKIE, replica_reads, serves_replica_reads
from config.routers import REPLICA, ReplicaRouter
from config.settings import _replica_database
from teams.models import Team
from tests.api.cast import Cast, Seeded, cast, seeded
from tests.conftest import REPO

__all__ = ["cast", "seeded"]

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", REPLICA])


def url_of(settings_dict: dict[str, object]) -> str:
    """A postgres:// URL for the server and database of a Django database's settings."""
    host = quote(str(settings_dict["HOST"] or ""), safe="")
    port = f":{settings_dict['PORT']}" if settings_dict["PORT"] else ""
    user = quote(str(settings_dict["USER"] or ""), safe="")
    password = quote(str(settings_dict["PASSWORD"] or ""), safe="")
    credentials = f"{user}:{password}@" if password else f"{user}@"
    return f"postgres://{credentials}{host}{port}/{settings_dict['NAME']}"


@pytest.fixture(scope="module")
def replica_alias(django_db_setup: None, django_db_blocker: DjangoDbBlocker) -> Iterator[str]:
    """The alias, added before the tests' database set-up so that they may declare it."""
    with django_db_blocker.unblock():
        default = connections[DEFAULT_DB_ALIAS]
        made = _replica_database(url_of(default.settings_dict))
        connections.settings[REPLICA] = {**default.settings_dict, **made}
        connections[REPLICA].creation.set_as_test_mirror(default.settings_dict)
    try:
        yield REPLICA
    finally:
        connections[REPLICA].close()
        del connections[REPLICA]
        del connections.settings[REPLICA]


@pytest.fixture
def replica(replica_alias: str, transactional_db: None, settings: SettingsWrapper) -> str:
    """The replica alias with the router and the middleware on, as DATABASE_REPLICA_URL sets."""
    settings.DATABASE_ROUTERS = ["config.routers.ReplicaRouter"]
    middleware = list(settings.MIDDLEWARE)
    middleware.insert(
        middleware.index("config.webhook_auth.WebhookCallerMiddleware") + 1,
        "config.readonly.ReplicaReadsMiddleware",
    )
    settings.MIDDLEWARE = middleware
    return replica_alias


def statements(queries: CaptureQueriesContext, verb: str) -> list[str]:
    """The SQL of the captured queries that begin with `verb` (SELECT, UPDATE, ...)."""
    return [
        query["sql"]
        for query in queries.captured_queries
        if query["sql"].lstrip().upper().startswith(verb)
    ]


def test_a_portal_page_reads_through_the_replica(replica: str, cast: Cast) -> None:
    client = Client()
    client.force_login(cast.lead_a)
    with (
        CaptureQueriesContext(connections[replica]) as on_replica,
        CaptureQueriesContext(connections[DEFAULT_DB_ALIAS]) as on_primary,
    ):
        response = client.get(f"/teams/{cast.alpha.slug}/")
    assert response.status_code == 200
    assert cast.alpha.name in response.content.decode()
    # The session, the user and the page's own reads all came from the replica.
    assert any("teams_team" in sql for sql in statements(on_replica, "SELECT"))
    assert any("django_session" in sql for sql in statements(on_replica, "SELECT"))
    assert statements(on_primary, "SELECT") == []


def test_an_api_get_reads_through_the_replica(replica: str, cast: Cast) -> None:
    with (
        CaptureQueriesContext(connections[replica]) as on_replica,
        CaptureQueriesContext(connections[DEFAULT_DB_ALIAS]) as on_primary,
    ):
        response = cast.client("lead_a").get("/api/v1/teams/")
    assert response.status_code == 200
    assert [team["slug"] for team in response.json()["results"]] == ["alpha"]
    assert any("teams_team" in sql for sql in statements(on_replica, "SELECT"))
    assert statements(on_primary, "SELECT") == []


def test_a_post_writes_to_the_primary_and_pins_the_next_reads_there(
    replica: str, seeded: Seeded, settings: SettingsWrapper
) -> None:
    client = seeded.cast.client("finance")
    with (
        CaptureQueriesContext(connections[replica]) as on_replica,
        CaptureQueriesContext(connections[DEFAULT_DB_ALIAS]) as on_primary,
    ):
        response = client.post(f"/api/v1/periods/{seeded.last.pk}/close/")
    assert response.status_code == 200, response.content
    assert response.json()["is_closed"] is True
    assert statements(on_primary, "UPDATE")
    # Everything the write read, it read on the primary (inside its transaction or not).
    assert on_replica.captured_queries == []
    seeded.last.refresh_from_db()
    assert seeded.last.is_closed
    # The writer's next read goes to the primary, whatever the replica's lag.
    cookie = response.cookies[PIN_COOKIE]
    assert int(cookie["max-age"]) == settings.DATABASE_REPLICA_PIN_SECONDS
    with CaptureQueriesContext(connections[replica]) as after_write:
        assert client.get(f"/api/v1/periods/{seeded.last.pk}/").json()["is_closed"] is True
    assert after_write.captured_queries == []
    # Without the cookie (another reader), the same page reads from the replica.
    with CaptureQueriesContext(connections[replica]) as other_reader:
        other = seeded.cast.client("finance").get(f"/api/v1/periods/{seeded.last.pk}/")
        assert other.json()["is_closed"] is True
    assert statements(other_reader, "SELECT")


def test_the_admin_webhooks_and_probes_never_read_the_replica(replica: str, cast: Cast) -> None:
    cast.operator.is_staff = cast.operator.is_superuser = True
    cast.operator.save()
    client = Client()
    client.force_login(cast.operator)
    with CaptureQueriesContext(connections[replica]) as on_replica:
        assert client.get("/admin/teams/team/").status_code == 200
        assert client.get("/readyz").status_code in (200, 503)
    assert on_replica.captured_queries == []
    for path in ("/admin/", "/admission/resourceclaims", "/ingest/samples", "/metrics", "/healthz"):
        assert not serves_replica_reads(path), path
    for path in ("/", "/fleet/", "/teams/alpha/", "/api/v1/usage/"):
        assert serves_replica_reads(path), path


def test_reads_inside_a_transaction_or_outside_a_marked_request_use_the_primary(
    replica: str,
) -> None:
    router = ReplicaRouter()
    assert router.db_for_read(Team) == DEFAULT_DB_ALIAS
    with replica_reads():
        assert router.db_for_read(Team) == REPLICA
        assert Team.objects.all().db == REPLICA
        with transaction.atomic():
            assert router.db_for_read(Team) == DEFAULT_DB_ALIAS
            assert Team.objects.all().db == DEFAULT_DB_ALIAS
        with replica_reads(False):
            assert router.db_for_read(Team) == DEFAULT_DB_ALIAS
        assert router.db_for_write(Team) == DEFAULT_DB_ALIAS
    assert router.allow_migrate(DEFAULT_DB_ALIAS, "teams")
    assert not router.allow_migrate(REPLICA, "teams")


def test_the_replica_refuses_writes(replica: str) -> None:
    with pytest.raises(DatabaseError, match="read-only transaction"):
        Team.objects.using(replica).create(slug="nope", name="Nope", cost_centre="CC-0")


PRIMARY_URL = "postgres://tally:s%40cret@tally-db-rw.tally.svc:5432/tally"


def settings_with(**environment: str) -> subprocess.CompletedProcess[str]:
    """Tally's settings, loaded in a new process with DATABASE_URL (never connected to) and
    `environment` (DATABASE_REPLICA_URL unset unless given), as JSON on stdout."""
    script = (
        "import json, django; django.setup(); from django.conf import settings as s; "
        "print(json.dumps({'aliases': sorted(s.DATABASES), "
        "'replica': s.DATABASES.get('replica', {}), 'routers': s.DATABASE_ROUTERS, "
        "'middleware': s.MIDDLEWARE}, default=str))"
    )
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("DATABASE_URL", "DATABASE_REPLICA_"))
    }
    env.update(DJANGO_SETTINGS_MODULE="config.settings", SECRET_KEY="x", DATABASE_URL=PRIMARY_URL)
    env.update(environment)
    return subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True
    )


def test_without_a_replica_url_there_is_one_database_and_no_router() -> None:
    result = settings_with()
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert (shown["aliases"], shown["routers"]) == (["default"], [])
    assert "config.readonly.ReplicaReadsMiddleware" not in shown["middleware"]


def test_a_replica_url_adds_the_alias_the_router_and_the_middleware() -> None:
    # The overlay's URL: hosts only; the credentials and the database are DATABASE_URL's.
    result = settings_with(
        DATABASE_REPLICA_URL="postgresql://tally-db-ro.tally.svc,tally-db-rw.tally.svc:5432/"
        "?target_session_attrs=prefer-standby",
    )
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["aliases"] == ["default", "replica"]
    assert shown["routers"] == ["config.routers.ReplicaRouter"]
    replica = shown["replica"]
    assert replica["HOST"] == "tally-db-ro.tally.svc,tally-db-rw.tally.svc"
    assert (replica["USER"], replica["PASSWORD"], replica["NAME"]) == ("tally", "s@cret", "tally")
    assert replica["TEST"]["MIRROR"] == "default"
    assert replica["OPTIONS"]["target_session_attrs"] == "prefer-standby"
    assert replica["OPTIONS"]["options"] == "-c default_transaction_read_only=on"
    # Before the session and the user are loaded, so their reads are routed too.
    middleware = shown["middleware"]
    assert middleware.index("config.readonly.ReplicaReadsMiddleware") < middleware.index(
        "django.contrib.sessions.middleware.SessionMiddleware"
    )
    # A URL with credentials of its own keeps them.
    own = settings_with(DATABASE_REPLICA_URL="postgres://reader:pw@replica:5432/copy")
    assert own.returncode == 0, own.stderr
    replica = json.loads(own.stdout)["replica"]
    assert (replica["USER"], replica["PASSWORD"], replica["NAME"]) == ("reader", "pw", "copy")


@pytest.mark.parametrize(
    ("environment", "says"),
    [
        ({"DATABASE_REPLICA_URL": "mysql://x@db/tally"}, "DATABASE_REPLICA_URL must name a"),
        ({"DATABASE_REPLICA_PIN_SECONDS": "-1"}, "DATABASE_REPLICA_PIN_SECONDS=-1 must be at"),
    ],
)
def test_a_bad_replica_setting_is_named(environment: dict[str, str], says: str) -> None:
    result = settings_with(**environment)
    assert result.returncode != 0
    assert says in result.stderr
