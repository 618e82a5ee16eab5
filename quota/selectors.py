"""Reads for quota decisions: the fleet as device shapes, and teams' rules and usage."""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, TypeVar

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, DatabaseError, connection, connections
from django.db.models import Count, QuerySet

from inventory.models import Cluster, Device, DeviceClass, DeviceShape
from quota import cel
from quota.models import Membership, QuotaRule, Reservation, Role, Team, TeamNamespace

T = TypeVar("T")


@dataclass(frozen=True)
class Shape:
    """One distinct device shape of the fleet, as selectors and quota amounts see it."""

    id: int
    driver: str
    kind: str
    gpu_share: Decimal
    memory_bytes: int | None
    # Consumable capacity (KEP-5075): several claims may each take a share of one device.
    shareable: bool
    view: cel.DeviceShape

    @classmethod
    def from_row(cls, row: DeviceShape, *, memory_bytes: int | None) -> Shape:
        """The shape as selectors see it, from its stored row."""
        return cls(
            id=row.pk,
            driver=row.driver,
            kind=row.kind,
            gpu_share=row.gpu_share,
            memory_bytes=memory_bytes,
            shareable=row.allow_multiple_allocations,
            view=cel.DeviceShape.from_device(
                driver=row.driver,
                attributes=row.attributes,
                capacity=row.capacity,
                allow_multiple_allocations=row.allow_multiple_allocations,
            ),
        )


@dataclass
class FleetShapes:
    """The shapes present in a cluster, and how many devices of each sit on each node."""

    shapes: dict[int, Shape] = field(default_factory=dict)
    # node id -> shape id -> present devices; for `allocationMode: All`.
    per_node: dict[int, dict[int, int]] = field(default_factory=dict)
    class_selectors: dict[str, list[str]] = field(default_factory=dict)
    loaded_at: float = 0.0
    version: int | None = None  # the cluster's fleet version this was loaded at
    _derived: dict[tuple[Any, ...], Any] = field(default_factory=dict, repr=False)

    def derived(self, key: tuple[Any, ...], compute: Callable[[], T]) -> T:
        """`compute()`, once per `key` while this snapshot of the fleet is in use (the shapes a
        request could be given, what its devices count on a rule, the most on one node)."""
        try:
            value: T = self._derived[key]
        except KeyError:
            value = self._derived[key] = compute()
        return value

    def match(self, expression: str, shape: Shape) -> bool:
        """Whether `expression` selects devices of `shape`; a bad expression selects none.

        Remembered per (expression, shape id) by the process, across snapshots: a shape row
        never changes once written, so a selector is evaluated once per shape, however many
        requests ask and however often the fleet is reloaded.
        """
        key = (expression, shape.id)
        result = _matches.get(key)
        if result is None:
            try:
                result = cel.compile_selector(expression).matches(shape.view)
            except cel.CELError:
                result = False
            _matches[key] = result
        return result

    def candidates(self, device_class: str, selectors: tuple[str, ...]) -> list[Shape]:
        """The shapes a request of `device_class` with `selectors` could be given."""
        return self.derived(
            ("candidates", device_class, selectors),
            functools.partial(self._select, device_class, selectors),
        )

    def _select(self, device_class: str, selectors: tuple[str, ...]) -> list[Shape]:
        class_selectors = self.class_selectors.get(device_class)
        if class_selectors is None:
            return []  # a class the inventory does not know selects nothing
        expressions = [*class_selectors, *selectors]
        return [
            shape
            for shape in self.shapes.values()
            if all(self.match(expression, shape) for expression in expressions)
        ]


_cache: dict[int, FleetShapes] = {}
_cache_lock = threading.Lock()
_matches: dict[tuple[str, int], bool] = {}
# Expressions x shapes stays small (rules and request selectors repeat); a process that has
# seen this many distinct pairs starts afresh rather than grow without bound.
MAX_REMEMBERED_MATCHES = 200_000


def fleet_shapes(*, cluster: Cluster) -> FleetShapes:
    """The cluster's present device shapes, as of at most TALLY_SHAPE_CACHE_SECONDS ago.

    A webhook worker serves from memory. Every TALLY_SHAPE_CACHE_SECONDS it reads the
    cluster's fleet version (one row), and only when a sync has changed the fleet since does
    it load it again: the shapes (dozens), devices counted per node and shape, and the device
    classes.
    """
    now = time.monotonic()
    cached = _cache.get(cluster.pk)
    if cached is not None and now - cached.loaded_at < settings.TALLY_SHAPE_CACHE_SECONDS:
        return cached
    with _cache_lock:
        cached = _cache.get(cluster.pk)
        if cached is not None and now - cached.loaded_at < settings.TALLY_SHAPE_CACHE_SECONDS:
            return cached
        version = (
            Cluster.objects.filter(pk=cluster.pk).values_list("fleet_version", flat=True).first()
        )
        if cached is not None and cached.version == version:
            cached.loaded_at = now
            return cached
        fleet = FleetShapes(loaded_at=now, version=version)
        per_node: dict[int, dict[int, int]] = defaultdict(dict)
        present_shapes: set[int] = set()
        for node_id, shape_id, devices in (
            Device.objects.filter(cluster=cluster, gone_at__isnull=True, shape__isnull=False)
            .values_list("node_id", "shape_id")
            .annotate(devices=Count("id"))
            .order_by()
        ):
            present_shapes.add(shape_id)
            if node_id is not None:
                per_node[node_id][shape_id] = devices
        for row in DeviceShape.objects.filter(pk__in=present_shapes):
            fleet.shapes[row.pk] = Shape.from_row(row, memory_bytes=_memory(row.capacity))
        fleet.per_node = dict(per_node)
        fleet.class_selectors = dict(
            DeviceClass.objects.filter(cluster=cluster, gone_at__isnull=True).values_list(
                "name", "selectors"
            )
        )
        if len(_matches) > MAX_REMEMBERED_MATCHES:
            _matches.clear()
        _cache[cluster.pk] = fleet
        return fleet


def warm_up(*, cluster: Cluster, seconds: float) -> int:
    """Load the cluster's fleet shapes and evaluate every device class's and quota rule's
    selector against each shape, at most `seconds` long: what a new process's first
    admissions would otherwise pay (hundreds of milliseconds for the first one). Returns how
    many (selector, shape) pairs it evaluated.

    Selectors that claims themselves carry are not known beforehand; each costs its first
    claim one evaluation per shape, as before.
    """
    deadline = time.monotonic() + seconds
    fleet = fleet_shapes(cluster=cluster)
    expressions = {e for selectors in fleet.class_selectors.values() for e in selectors}
    expressions.update(
        QuotaRule.objects.exclude(selector="").values_list("selector", flat=True).distinct()
    )
    evaluated = 0
    for expression in sorted(expressions):
        for shape in fleet.shapes.values():
            if time.monotonic() > deadline:
                return evaluated
            fleet.match(expression, shape)
            evaluated += 1
    return evaluated


def forget_fleet_shapes() -> None:
    """Drop the cache (tests, and after an import that changed the fleet in this process)."""
    with _cache_lock:
        _cache.clear()
        _matches.clear()


def _memory(capacity: dict[str, dict[str, str]]) -> int | None:
    from kubernetes.utils import parse_quantity

    for name, entry in capacity.items():
        if name.rsplit("/", 1)[-1] in ("memory", "addressableMemory") and "value" in entry:
            return int(parse_quantity(entry["value"]))
    return None


@dataclass
class AdmissionState:
    """What one admission reads from the database, in one query: the namespace's team with its
    rules and their current usage, and the team of a live reservation already made for the
    same claim (a create the API server sent again)."""

    team: Team | None
    rules: list[RuleUsage]
    replayed_team_id: int | None


@dataclass(slots=True)
class RuleUsage:
    """A quota rule as one admission reads it: its definition and its usage at that moment.

    A plain record rather than a `QuotaRule` instance: the webhook builds a few for every
    request, and a model instance costs several times more to make.
    """

    pk: int
    name: str
    device_class: str
    selector: str
    unit: str
    limit: Decimal
    mode: str
    in_use: Decimal


# The timeouts an admission's statements run with, in this order. Its commit durability
# (synchronous_commit) is no session setting: see `Ending`.
SESSION_SETTINGS = ("statement_timeout", "lock_timeout")


@dataclass
class _Session:
    """The webhook's settings for one admission, and what the session had before them."""

    wanted: tuple[str, str]
    local: bool  # for the transaction (behind a transaction pooler), not the session
    # synchronous_commit for the commit of each statement that writes; None within a
    # caller's transaction, whose commit is not the admission's to make less durable.
    durability: str | None
    # The session's own values while the webhook's are set on it: the admission's last
    # statement (or, failing that, `admission_session` on its way out) sets them back.
    own: tuple[str, str] | None = None


_SESSION: ContextVar[_Session | None] = ContextVar("tally_session", default=None)


@contextmanager
def admission_session(*, timeout: str, synchronous_commit: str) -> Iterator[None]:
    """Within it, `admission_state` (the admission's first statement) also sets the statement
    and lock timeouts of the statements after it, and each statement that writes sets the
    durability of its own commit (PostgreSQL; `statement_ending`).

    The admission runs in autocommit, each statement atomic on its own, so the settings are
    set on the session, with no round trip of their own, and the admission's last statement
    sets the session's own values back (`statement_ending`). Whatever way the admission ends,
    the connection never keeps the webhook's settings: if they are still set here, they are
    set back (a round trip), or the connection is closed. With DATABASE_TRANSACTION_POOLING
    the admission has a transaction, and they are its own.
    """
    session = _Session(
        wanted=(timeout, timeout),
        local=settings.DATABASE_TRANSACTION_POOLING,
        durability=(None if connections[DEFAULT_DB_ALIAS].in_atomic_block else synchronous_commit),
    )
    token = _SESSION.set(session)
    try:
        yield
    finally:
        _SESSION.reset(token)
        if session.own is not None:
            _set_back(session.own)


@dataclass(frozen=True)
class Ending:
    """What a statement that writes sets as it ends, and the parameters for it, in order:

    - `restore`: the session's own settings, set back (`restore_columns`, two parameters;
      call `restored` once the statement ran), when this statement may end the admission and
      they are still to set back;
    - `durable`: the synchronous_commit of its own commit (`durability_column`, one
      parameter). It is set for the statement's own transaction (`set_config(..., true)`), so
      it holds until that transaction commits, which in autocommit is right after the
      statement, and goes with it. A session setting would not do: the admission's last
      statement sets the session's own back as it ends, before its commit.
    """

    restore: bool
    durable: bool
    params: tuple[str, ...]


def statement_ending(*, wait_for_disk: bool = True) -> Ending:
    """What the next statement that writes sets as it ends (nothing outside an admission).

    Without `wait_for_disk` (a statement whose loss in a database crash costs no quota state)
    its commit does not wait for the disk, whatever the admission's durability.
    """
    session = _SESSION.get()
    own = session.own if session is not None else None
    durability = session.durability if session is not None else None
    if durability is not None and not wait_for_disk:
        durability = "off"
    return Ending(
        restore=own is not None,
        durable=durability is not None,
        params=(*(own or ()), *(() if durability is None else (durability,))),
    )


def durability_column() -> str:
    """The SQL that sets the commit durability of the statement's transaction (one parameter)."""
    return "set_config('synchronous_commit', %s, true)"


def restored() -> None:
    """The session's own settings are back (a statement `statement_ending` set up ran)."""
    session = _SESSION.get()
    if session is not None:
        session.own = None


def restore_columns() -> str:
    """The SQL that sets the session's own settings back, from two parameters."""
    return ", ".join(f"set_config('{name}', %s, false)" for name in SESSION_SETTINGS)


def _set_back(own: tuple[str, str]) -> None:
    db = connections[DEFAULT_DB_ALIAS]
    if db.connection is None:
        return  # closed already, and the settings with it
    try:
        with db.wrap_database_errors:
            db.connection.execute(f"SELECT {restore_columns()}", list(own))
    except DatabaseError:
        # The connection is no use now (the database went away, or the caller's transaction
        # failed): it goes, and with it the settings.
        with contextlib.suppress(DatabaseError):
            db.close()


@functools.cache
def _admission_state_sql(*, with_settings: bool, local: bool = False) -> str:
    """The admission's read (made once per process and kind); with the webhook's
    settings: set on the session, the session's own values read first (columns 12-13), or
    (`local`) set for the transaction."""
    quote = connection.ops.quote_name
    team, owner, rule, reservation = (
        quote(model._meta.db_table) for model in (Team, TeamNamespace, QuotaRule, Reservation)
    )
    # One row to hang the rest on, made once per statement (a subquery with volatile functions
    # is not flattened): the session's settings for the admission's next statements, when
    # there are some.
    own = ", ".join(
        f"current_setting('{name}') AS {name}" if on_postgresql() else f"NULL AS {name}"
        for name in SESSION_SETTINGS
    )
    scope = "true" if local else "false"
    sets = ", ".join(f"set_config('{name}', %s, {scope})" for name in SESSION_SETTINGS)
    # Read before they are set: the select list is evaluated in order.
    driver = f"SELECT {own}, {sets}" if with_settings else f"SELECT {own}"
    return f"""
SELECT t.id, t.slug, t.name,
       r.id, r.name, r.device_class, r.selector, r.unit, r.{quote("limit")}, r.mode, r.in_use,
       (SELECT v.team_id FROM {reservation} v
        WHERE v.cluster = %s AND v.namespace = %s AND v.name = %s AND NOT (v.state = 'released')
        LIMIT 1),
       {", ".join(f"o.{name}" for name in SESSION_SETTINGS)}
FROM ({driver}) o
LEFT JOIN {owner} n ON n.namespace = %s
LEFT JOIN {team} t ON t.id = n.team_id
LEFT JOIN {rule} r ON r.team_id = t.id
ORDER BY r.id
"""


def admission_state(*, cluster: str, namespace: str, name: str) -> AdmissionState:
    """The team owning `namespace`, its rules (ordered by id, usage as of now) and, when the
    claim `namespace/name` of `cluster` is already admitted, that reservation's team id.

    One round trip with no ORM on the webhook's path.
    """
    session = _SESSION.get() if on_postgresql() else None
    if session is not None and session.own is not None:
        session = None  # set already (an admission reads once; this is a second read)
    rows = fetch_prepared(
        _admission_state_sql(
            with_settings=session is not None,
            local=session is not None and session.local,
        ),
        [cluster, namespace, name, *(session.wanted if session else ()), namespace],
    )
    if session is not None and not session.local:
        session.own = (rows[0][12], rows[0][13])
    team: Team | None = None
    rules: list[RuleUsage] = []
    replayed: int | None = rows[0][11] if rows else None
    for row in rows:
        if row[0] is None:
            continue
        if team is None:
            team = _team(row[0], row[1], row[2])
        if row[3] is not None:
            rules.append(
                RuleUsage(
                    pk=row[3],
                    name=row[4],
                    device_class=row[5],
                    selector=row[6],
                    unit=row[7],
                    limit=_decimal(row[8]),
                    mode=row[9],
                    in_use=_decimal(row[10]),
                )
            )
    return AdmissionState(team=team, rules=rules, replayed_team_id=replayed)


_teams: dict[tuple[int, str, str], Team] = {}


def _team(pk: int, slug: str, name: str) -> Team:
    """The team as read, one instance per (id, slug, name) in the process: a model instance
    costs more to make than the rest of the read (teams are few; a renamed one is a new key)."""
    key = (pk, slug, name)
    team = _teams.get(key)
    if team is None:
        if len(_teams) > 10_000:
            _teams.clear()
        team = _teams[key] = Team(pk=pk, slug=slug, name=name)
        team._state.adding, team._state.db = False, DEFAULT_DB_ALIAS
    return team


@functools.cache
def on_postgresql() -> bool:
    """Whether the database is PostgreSQL: fixed for the process, read once (each read of
    `connection.vendor` goes through Django's thread-local connection proxy)."""
    return bool(connections[DEFAULT_DB_ALIAS].vendor == "postgresql")


def fetch_prepared(sql: str, params: list[Any]) -> list[tuple[Any, ...]]:
    """Run one statement of the webhook's path and fetch its rows.

    On PostgreSQL it runs as a prepared statement of the connection (server-side binding,
    `prepare=True`): planned once per connection instead of once per request, and without the
    ORM's cursor wrapper. Errors are Django's `DatabaseError`s, as from any other query. Set
    `DATABASE_PREPARED_STATEMENTS=false` behind a pooler that cannot keep them (PgBouncer in
    transaction mode before 1.21).
    """
    # The connection wrapper itself, looked up once: each attribute read through Django's
    # `connection` proxy is a thread-local lookup.
    db = connections[DEFAULT_DB_ALIAS]
    if not on_postgresql() or not settings.DATABASE_PREPARED_STATEMENTS:
        with db.cursor() as cursor:
            cursor.execute(sql, params)
            return list(cursor.fetchall())
    import psycopg

    db.ensure_connection()
    with db.wrap_database_errors:
        # One server-side-binding cursor per psycopg connection, kept on Django's wrapper and
        # replaced when Django reconnects (its own cursors bind client-side and cannot
        # prepare; making one each time costs more than the statement).
        raw = db.connection
        prepared: Any = getattr(db, "_tally_prepared_cursor", None)
        if prepared is None or prepared.connection is not raw or prepared.closed:
            prepared = psycopg.Cursor(raw)
            db._tally_prepared_cursor = prepared  # type: ignore[attr-defined]
        prepared.execute(sql, params, prepare=True)
        rows: list[tuple[Any, ...]] = prepared.fetchall()
        return rows


def _decimal(value: Any) -> Decimal:
    # PostgreSQL gives Decimal; SQLite a float or int, whose shortest repr is the stored value.
    return value if isinstance(value, Decimal) else Decimal(str(value))


def team_for_namespace(*, namespace: str) -> Team | None:
    owner = TeamNamespace.objects.select_related("team").filter(namespace=namespace).first()
    return owner.team if owner else None


def team_rules(*, team: Team) -> list[QuotaRule]:
    return list(QuotaRule.objects.filter(team=team).order_by("pk"))


# Tenancy: the one place that decides who sees which team.

OPERATORS_GROUP = "operators"
FINANCE_GROUP = "finance"


def user_role(user: Any) -> str | None:
    """`operator` (superusers and the operators group), `finance`, `lead`, or None.

    Members who lead no team have no role: they see nothing in the portal or the API. The
    answer is remembered on the user object, which lives for one request.
    """
    try:
        role: str | None = user._tally_role
        return role
    except AttributeError:
        pass
    role = _role(user)
    # An object that takes no attributes is simply asked again next time.
    with contextlib.suppress(AttributeError):
        user._tally_role = role
    return role


def _role(user: Any) -> str | None:
    if not getattr(user, "is_authenticated", False) or not user.is_active:
        return None
    if user.is_superuser or user.groups.filter(name=OPERATORS_GROUP).exists():
        return "operator"
    if user.groups.filter(name=FINANCE_GROUP).exists():
        return "finance"
    if Membership.objects.filter(user=user, role=Role.LEAD).exists():
        return "lead"
    return None


def visible_teams(*, user: Any) -> QuerySet[Team]:
    """The teams whose usage, quotas and statements `user` may read."""
    role = user_role(user)
    if role in ("operator", "finance"):
        return Team.objects.all()
    if role == "lead":
        return Team.objects.filter(memberships__user=user, memberships__role=Role.LEAD).distinct()
    return Team.objects.none()
