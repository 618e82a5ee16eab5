"""The admission's database work: its read, its reservation and its record, the session
settings they run with and the deadline they keep. The only module of the webhook that writes
SQL or touches the PostgreSQL session (its statements run prepared, through `db.prepared`).

An admission is two statements in autocommit, each atomic on its own: `admission_state` reads
the team's rules and usage (and, within `admission_session`, sets the webhook's timeouts on
the session for the statements after it), then `reserve` (one statement that locks the rules
in id order, checks every enforce limit and inserts the reservation, its lines and the
decision) or `record` (the decision alone). The last of them sets the session's own values
back as it ends, so no other request ever runs with the webhook's. Behind a pooler that lends
connections per transaction (DATABASE_TRANSACTION_POOLING) an admission is one transaction,
and the settings are local to it.

A gang's member takes one more read (`gang_state`: its gang's hold and what its members hold)
and reserves through `reserve_gang`, one statement as `reserve` is, that also makes the gang's
hold or draws from it (topping it up for a gang that grew), taking the hold's locks after the
rules', as every writer does. Weighing a whole gang also reads the namespace's reservations
recorded in no gang (`gangless_pod_claims`), and records those that turn out to be the gang's
members (`adopt_gang_members`: a statement that changes no usage).

Within `admission_deadline` nothing waits on the database past the admission's deadline, and
no reservation is made after it, however late the database gets the statement.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.db import (
    DEFAULT_DB_ALIAS,
    DatabaseError,
    IntegrityError,
    OperationalError,
    connection,
    connections,
    transaction,
)

from db.postgresql import deadline
from db.prepared import fetch_prepared
from quota import ledger
from quota.admission.plans import (
    AdmissionState,
    Decision,
    GangState,
    LiveReservation,
    Plan,
    Rule,
    RuleSnapshot,
)
from quota.models import (
    AdmissionDecision,
    GangMode,
    GangPolicy,
    GangReservation,
    GangReservationLine,
    Mode,
    NarrowingPolicy,
    QuotaRule,
    Reservation,
    ReservationLine,
    ReservationState,
    Webhook,
)
from teams.models import Team, TeamNamespace

# The timeouts an admission's statements run with, in this order. Its commit durability
# (synchronous_commit) is no session setting: see `Ending`.
SESSION_SETTINGS = ("statement_timeout", "lock_timeout")


class RulesChanged(Exception):
    """A rule the plan counted on was deleted while the claim was being admitted."""


class DeadlinePassed(OperationalError):
    """The database did not answer the admission by its deadline, or got its reservation
    after it: to the API server, which has given up by then, it was unreachable. Nothing was
    reserved."""


@dataclass
class _Deadline:
    """An admission's deadline: by this process's clock (`time.monotonic()`) and, once the
    admission's read has seen the database's clock, by the database's (seconds since the
    epoch)."""

    at: float
    on_server: float | None = None


_DEADLINE: ContextVar[_Deadline | None] = ContextVar("tally_deadline", default=None)


@contextmanager
def admission_deadline(at: float | None) -> Iterator[None]:
    """Nothing within it waits on the database past `at` (`time.monotonic()`; None: no
    deadline), and no reservation is made after it.

    Two guards, for the two ways a database can be late. Past `at` the connection's socket is
    shut down (`db.postgresql.deadline`): a statement still waiting (the admission's first
    read included, which has no statement_timeout yet) fails at once as `DeadlinePassed`, and
    the connection is closed. And the reserving statement checks the database's own clock
    against the deadline after it has taken its locks: one the database gets late (held by
    the network, a server that stalled) reserves nothing. The deadline on the database's
    clock comes from the admission's read, which reads that clock: no two clocks need agree.
    """
    if at is None:
        yield
        return
    db = connections[DEFAULT_DB_ALIAS]
    db.ensure_connection()
    token = _DEADLINE.set(_Deadline(at=at))
    watch: deadline.Watch | None = None
    try:
        with deadline.deadline(db.connection, at=at) as watch:
            try:
                yield
            except DatabaseError as exc:
                if watch.expired and not isinstance(exc, DeadlinePassed):
                    raise DeadlinePassed(
                        f"no answer from the database by the admission's deadline ({exc})"
                    ) from exc
                raise
    finally:
        _DEADLINE.reset(token)
        # Read once the watch is over: its socket is shut down, whether or not a statement
        # was waiting on it then, and the connection is no use.
        if watch is not None and watch.expired:
            with contextlib.suppress(DatabaseError):
                db.close()


@dataclass
class _Session:
    """The webhook's settings for one admission, and what the session had before them."""

    wanted: tuple[str, str] | None  # None: the session's own timeouts (an admission that reads)
    local: bool  # for the transaction (behind a transaction pooler), not the session
    # synchronous_commit for the commit of each statement that writes; None within a
    # caller's transaction, whose commit is not the admission's to make less durable.
    durability: str | None
    # The session's own values while the webhook's are set on it: the admission's last
    # statement (or, failing that, `admission_session` on its way out) sets them back.
    own: tuple[str, str] | None = None


_SESSION: ContextVar[_Session | None] = ContextVar("tally_session", default=None)


@contextmanager
def admission_session(*, timeouts: bool = True) -> Iterator[None]:
    """Within it, `admission_state` (the admission's first statement) also sets the statement
    and lock timeouts (TALLY_WEBHOOK_DB_TIMEOUT_MS) of the statements after it, and each
    statement that writes sets the durability of its own commit
    (TALLY_WEBHOOK_SYNCHRONOUS_COMMIT; `statement_ending`). For an admission that may write
    (dry runs only read). Without `timeouts` (the mutating webhook, which at most records a
    denial: it locks nothing) the session's timeouts are left as they are, so that an
    admission that only reads needs no statement to set them back.

    The admission runs in autocommit, each statement atomic on its own, so the settings are
    set on the session, with no round trip of their own, and the admission's last statement
    sets the session's own values back (`statement_ending`). Whatever way the admission ends,
    the connection never keeps the webhook's settings: if they are still set here, they are
    set back (a round trip), or the connection is closed. With DATABASE_TRANSACTION_POOLING
    the admission has a transaction, and they are its own.
    """
    timeout = f"{int(settings.TALLY_WEBHOOK_DB_TIMEOUT_MS)}ms"
    synchronous_commit = "on" if settings.TALLY_WEBHOOK_SYNCHRONOUS_COMMIT else "off"
    session = _Session(
        wanted=(timeout, timeout) if timeouts else None,
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


def admission_transaction() -> contextlib.AbstractContextManager[Any]:
    """An admission needs no transaction of its own: its read and the one statement that
    reserves (checking every limit against the usage at that moment) are each atomic, so it
    runs in autocommit, two round trips (BEGIN, COMMIT) fewer. It takes one behind a pooler
    that lends connections per transaction (its timeouts must stay in a transaction), and
    within a caller's transaction (a savepoint, so that a failed statement leaves the
    caller's transaction usable)."""
    if (
        not settings.DATABASE_TRANSACTION_POOLING
        and not connections[DEFAULT_DB_ALIAS].in_atomic_block
    ):
        return contextlib.nullcontext()
    return transaction.atomic()


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


# --- The read -------------------------------------------------------------------------------


@functools.cache
def _admission_state_sql(*, with_settings: bool, local: bool = False) -> str:
    """The admission's read (made once per process and kind); with the webhook's
    settings: set on the session, the session's own values read first (columns 12-13), or
    (`local`) set for the transaction. Column 11: the live reservation under the claim's
    name (its team id, claim uid and spec digest; NULL: none). Column 15: the team's gang
    policy (NULL: none); column 16: whether its claims are narrowed to fit (NULL: no policy)."""
    quote = connection.ops.quote_name
    team, owner, rule, reservation, gangs, narrowing = (
        quote(model._meta.db_table)
        for model in (Team, TeamNamespace, QuotaRule, Reservation, GangPolicy, NarrowingPolicy)
    )
    # One row to hang the rest on, made once per statement (a subquery with volatile functions
    # is not flattened): the database's clock, and the session's settings for the admission's
    # next statements, when there are some.
    own = ", ".join(f"current_setting('{name}') AS {name}" for name in SESSION_SETTINGS)
    # (Seconds since the epoch: a float is read much faster than a timestamp, on every row.)
    own += ", extract(epoch FROM clock_timestamp())::float8 AS clock"
    scope = "true" if local else "false"
    sets = ", ".join(f"set_config('{name}', %s, {scope})" for name in SESSION_SETTINGS)
    # Read before they are set: the select list is evaluated in order.
    driver = f"SELECT {own}, {sets}" if with_settings else f"SELECT {own}"
    return f"""
SELECT t.id, t.slug, t.name,
       r.id, r.name, r.device_class, r.selector, r.unit, r.{quote("limit")}, r.mode, r.in_use,
       (SELECT ARRAY[v.team_id::text, v.claim_uid, v.spec_digest] FROM {reservation} v
        WHERE v.cluster = %s AND v.namespace = %s AND v.name = %s AND NOT (v.state = 'released')
        LIMIT 1),
       {", ".join(f"o.{name}" for name in SESSION_SETTINGS)}, o.clock, g.mode, w.narrow_to_fit
FROM ({driver}) o
LEFT JOIN {owner} n ON n.namespace = %s AND n.valid_until IS NULL
LEFT JOIN {team} t ON t.id = n.team_id
LEFT JOIN {gangs} g ON g.team_id = t.id
LEFT JOIN {narrowing} w ON w.team_id = t.id
LEFT JOIN {rule} r ON r.team_id = t.id
ORDER BY r.id
"""


def admission_state(*, cluster: str, namespace: str, name: str) -> AdmissionState:
    """The team owning `namespace`, its rules (ordered by id, usage as of now), its gang
    policy and, when a claim `namespace/name` of `cluster` is already admitted, its live
    reservation (`LiveReservation`: which claim it was made for, and its team).

    One round trip with no ORM on the webhook's path.
    """
    session = _SESSION.get()
    wanted = session.wanted if session is not None and session.own is None else None
    # (Set already when `own` is: an admission reads once; this is a second read.)
    rows = fetch_prepared(
        _admission_state_sql(
            with_settings=wanted is not None,
            local=bool(session and wanted and session.local),
        ),
        [cluster, namespace, name, *(wanted or ()), namespace],
    )
    if session is not None and wanted is not None and not session.local:
        session.own = (rows[0][12], rows[0][13])
    limit = _DEADLINE.get()
    if limit is not None:
        # The deadline by the database's clock: the time it read (column 14) is no later
        # than now, so what was left then is at least what is left now.
        limit.on_server = rows[0][14] + (limit.at - time.monotonic())
    team: Team | None = None
    rules: list[RuleSnapshot] = []
    found = rows[0][11] if rows else None
    live = (
        LiveReservation(team_id=int(found[0]), claim_uid=found[1], spec_digest=found[2])
        if found
        else None
    )
    for row in rows:
        if row[0] is None:
            continue
        if team is None:
            team = _team(row[0], row[1], row[2])
        if row[3] is not None:
            rules.append(
                RuleSnapshot(
                    pk=row[3],
                    name=row[4],
                    device_class=row[5],
                    selector=row[6],
                    unit=row[7],
                    limit=row[8],
                    mode=row[9],
                    in_use=row[10],
                )
            )
    return AdmissionState(
        team=team,
        rules=rules,
        live=live,
        gang_mode=(rows[0][15] if rows else None) or GangMode.ENFORCE.value,
        narrow_to_fit=bool(rows[0][16]) if rows else False,
    )


@functools.cache
def _gang_state_sql() -> str:
    quote = connection.ops.quote_name
    hold, hold_line, reservation, line = (
        quote(model._meta.db_table)
        for model in (GangReservation, GangReservationLine, Reservation, ReservationLine)
    )
    return f"""
SELECT 'hold', g.id, h.rule_id, h.amount
FROM {hold} g LEFT JOIN {hold_line} h ON h.gang_reservation_id = g.id
WHERE g.cluster = %s AND g.namespace = %s AND g.key = %s AND NOT (g.state = 'released')
UNION ALL
SELECT 'members', NULL, l.rule_id, sum(l.amount)
FROM {reservation} v JOIN {line} l ON l.reservation_id = v.id
WHERE v.cluster = %s AND v.namespace = %s AND v.gang_key = %s AND NOT (v.state = 'released')
GROUP BY l.rule_id
"""


def gang_state(*, cluster: str, namespace: str, key: str) -> GangState:
    """The live hold of the gang `key` in `namespace` of `cluster` (its id and what it holds,
    by rule) and what the gang's live members hold, by rule: one round trip."""
    hold_id: int | None = None
    held: dict[int, Decimal] = {}
    members: dict[int, Decimal] = {}
    for kind, row_id, rule_id, amount in fetch_prepared(
        _gang_state_sql(), [cluster, namespace, key, cluster, namespace, key]
    ):
        if kind == "hold":
            hold_id = row_id
            if rule_id is not None:
                held[rule_id] = amount
        elif rule_id is not None:
            members[rule_id] = amount
    return GangState(hold_id=hold_id, held=held, members=members)


@functools.cache
def _gangless_sql() -> str:
    quote = connection.ops.quote_name
    reservation, line = (quote(model._meta.db_table) for model in (Reservation, ReservationLine))
    return f"""
SELECT v.id, v.owner_references, l.rule_id, l.amount
FROM (
    SELECT id, owner_references FROM {reservation}
    WHERE cluster = %s AND namespace = %s AND NOT (state = 'released') AND gang_key = ''
      AND owner_kind = 'Pod' AND name <> %s
    ORDER BY created_at DESC, id DESC LIMIT %s
) v LEFT JOIN {line} l ON l.reservation_id = v.id
"""


@dataclass(frozen=True)
class Gangless:
    """A live reservation of a claim made for a Pod, recorded with no gang: its id, its
    claim's owner references and what it holds, by rule."""

    id: int
    owner_references: list[Any]
    amounts: dict[int, Decimal]


def gangless_pod_claims(*, cluster: str, namespace: str, name: str, limit: int) -> list[Gangless]:
    """The live reservations of claims made for Pods in `namespace` of `cluster` that record
    no gang, but the claim `name`'s: at most `limit` of them, the latest first. One round
    trip."""
    found: dict[int, Gangless] = {}
    for row_id, owners, rule_id, amount in fetch_prepared(
        _gangless_sql(), [cluster, namespace, name, limit]
    ):
        if row_id not in found:
            references = json.loads(owners) if isinstance(owners, str) else owners
            found[row_id] = Gangless(
                id=row_id,
                owner_references=references if isinstance(references, list) else [],
                amounts={},
            )
        if rule_id is not None:
            found[row_id].amounts[rule_id] = amount
    return list(found.values())


def adopt_gang_members(*, ids: tuple[int, ...], key: str) -> None:
    """Record the live reservations `ids` (admitted alone, before their gang could be read)
    as members of the gang `key`; one that found a gang meanwhile keeps it. It changes no
    usage: what they hold stays theirs, now counted as the gang's."""
    if not ids:
        return
    table = connection.ops.quote_name(Reservation._meta.db_table)
    fetch_prepared(
        f"UPDATE {table} SET gang_key = %s WHERE id = ANY(%s) AND gang_key = '' "
        "AND NOT (state = 'released') RETURNING id",
        [key, list(ids)],
    )


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


def team_by_id(pk: int) -> Team | None:
    """The team of a reservation made earlier (a replayed claim's), as stored now."""
    return Team.objects.filter(pk=pk).first()


def admitted_patch(*, cluster: str, namespace: str, name: str) -> tuple[Any, Any]:
    """What the mutating webhook's patch made of the claim whose live reservation this is, as
    stored: the alternatives it kept, by request, and the selectors it added to narrow it
    (`Reservation.narrowed`); (None, None) when there is none."""
    found = (
        Reservation.objects.filter(cluster=cluster, namespace=namespace, name=name)
        .exclude(state=ReservationState.RELEASED)
        .values_list("chosen", "narrowed")
        .first()
    )
    return found if found is not None else (None, None)


# --- The writes -----------------------------------------------------------------------------

# The columns of `AdmissionDecision` both of the webhook's inserts write, in this order.
_DECISION_COLUMNS = (
    "at, uid, namespace, name, username, webhook, team_id, allowed, dry_run, message, warnings, "
    "cluster, created_by"
)


def record(
    decision: Decision,
    *,
    namespace: str,
    name: str,
    username: str,
    uid: str,
    at: datetime,
    cluster: str,
    webhook: Webhook = Webhook.VALIDATE,
    created_by: str = "",
) -> None:
    """Keep a webhook's answer for operators, for a decision whose claim holds no quota (one
    that does is recorded by the statement that reserves it): a denial, a namespace no team
    owns, a claim no rule limits. `created_by`: the person behind a controller's claim
    (`AdmissionDecision.created_by`). A prepared INSERT, the admission's last statement. Its
    commit does not wait for the disk: a database crash may lose the last such rows, never
    state that quota depends on.
    """
    team_id = decision.team.pk if decision.team is not None else None
    # The admission's last statement: it sets the session's own settings back.
    ending = statement_ending(wait_for_disk=False)
    fetch_prepared(
        _record_sql(restore=ending.restore, durability=ending.durable),
        [at, uid, namespace, name, username, webhook.value, team_id, decision.allowed,
         decision.message, json.dumps(decision.warnings), cluster, created_by, *ending.params],
    )  # fmt: skip
    if ending.restore:
        restored()


@functools.cache
def _record_sql(*, restore: bool, durability: bool) -> str:
    """The decision's insert (made once per kind), setting the session's own settings back
    after it (`restore`, from two more parameters) and the durability of its commit
    (`durability`, one more)."""
    table = connection.ops.quote_name(AdmissionDecision._meta.db_table)
    returning = [
        "id",
        *([restore_columns()] if restore else []),
        *([durability_column()] if durability else []),
    ]
    return (
        f"INSERT INTO {table} ({_DECISION_COLUMNS}) "
        "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, false, %s, %s::jsonb, %s, %s) "
        f"RETURNING {', '.join(returning)}"
    )


def reserve_uncounted(fields: dict[str, Any]) -> None:
    """The reservation of an admitted claim that no rule limits: nothing to count, but the
    sync follows the claim from it. A claim admitted before (a retried create) keeps the
    reservation it has."""
    try:
        with transaction.atomic():
            Reservation.objects.create(**fields)
    except IntegrityError:
        pass


_RESERVATION_COLUMNS = (
    "cluster",
    "namespace",
    "name",
    "team_id",
    "state",
    "username",
    "owner_kind",
    "owner_name",
    "owner_references",
    "chosen",
    "admission_uid",
    "created_at",
    "expires_at",
    "gang_key",
    "spec_digest",
    "narrowed",
)
# Those of them stored as JSON.
_JSON_COLUMNS = ("owner_references", "chosen", "narrowed")
# Their placeholders, in the order of `_RESERVATION_COLUMNS`.
_RESERVATION_VALUES = ", ".join(
    "%s::jsonb" if column in _JSON_COLUMNS else "%s" for column in _RESERVATION_COLUMNS
)


def _reservation_params(fields: dict[str, Any]) -> list[Any]:
    """The values of `_RESERVATION_VALUES`, from a reservation's `fields`."""
    return [
        json.dumps(fields[column]) if column in _JSON_COLUMNS else fields[column]
        for column in _RESERVATION_COLUMNS
    ]


def _server_deadline() -> float:
    """The admission's deadline on the database's clock, for a reserving statement; outside
    `admission_deadline`, none (to_timestamp('Infinity') is 'infinity')."""
    limit = _DEADLINE.get()
    return limit.on_server if limit is not None and limit.on_server is not None else math.inf


def _endings(*, restore: bool, durability: bool) -> str:
    """The extra columns of a reserving statement: with `restore`, the session's own settings
    set back when it admits (two parameters; a denied claim's decision is recorded by the
    next statement, which sets them back then); with `durability`, its commit's durability
    (one parameter)."""
    return (
        ",\n       CASE WHEN verdict.outcome = 'fits' THEN ARRAY[" + restore_columns() + "] END"
        if restore
        else ""
    ) + (f",\n       {durability_column()}" if durability else "")


def _recorded_cte() -> str:
    """The CTE that records an admitted claim's decision (nine parameters:
    `_decision_params`) when the statement's verdict is 'fits'."""
    decision = connection.ops.quote_name(AdmissionDecision._meta.db_table)
    return f"""recorded AS (
    INSERT INTO {decision} ({_DECISION_COLUMNS})
    SELECT %s, %s, %s, %s, %s, '{Webhook.VALIDATE.value}', %s, true, false, '', %s::jsonb, %s, %s
    FROM verdict WHERE verdict.outcome = 'fits'
    RETURNING id
)"""


def _decision_params(
    fields: dict[str, Any], plan: Plan, username: str, created_by: str
) -> list[Any]:
    return [
        fields["created_at"],
        fields["admission_uid"],
        fields["namespace"],
        fields["name"],
        username,
        fields["team_id"],
        json.dumps(plan.warnings),
        fields["cluster"],
        created_by,
    ]


@functools.cache
def _reserve_sql(rules: int, *, restore: bool, durability: bool) -> str:
    """The reserving statement for `rules` rules (made once per shape); with `restore`, it
    sets the session's own settings back (two more parameters) when it admits, as the last
    thing it evaluates, after every lock it takes; with `durability`, it sets the durability
    of its commit (one more).

    Its `outcome`: 'fits' (reserved), 'over' (a rule's limit does not allow it), 'gone' (a
    rule was deleted), 'late' (the admission's deadline, on the database's clock, passed
    before it had its locks: nothing reserved). CASE tests them in this order, so the clock
    is read after every lock is taken, and the commit follows at once (autocommit)."""
    quote = connection.ops.quote_name
    rule, reservation = (quote(model._meta.db_table) for model in (QuotaRule, Reservation))
    limit = quote("limit")
    values = ", ".join(["(%s::bigint, %s::numeric, %s::boolean)"] * rules)
    return f"""
WITH asked(rule_id, amount, enforce) AS (VALUES {values}),
locked AS (
    SELECT r.id, r.name, r.in_use, r.{limit} FROM {rule} r
    WHERE r.id IN (SELECT rule_id FROM asked) ORDER BY r.id FOR UPDATE
),
over AS (
    SELECT l.id, l.name, l.in_use, l.{limit}, a.amount
    FROM asked a JOIN locked l ON l.id = a.rule_id
    WHERE a.enforce AND l.in_use + a.amount > l.{limit} ORDER BY l.id LIMIT 1
),
verdict AS (
    SELECT CASE
        WHEN (SELECT count(*) FROM locked) <> (SELECT count(*) FROM asked) THEN 'gone'
        WHEN EXISTS (SELECT 1 FROM over) THEN 'over'
        WHEN clock_timestamp() >= to_timestamp(%s::float8) THEN 'late'
        ELSE 'fits'
    END AS outcome
),
kept AS (
    INSERT INTO {reservation} ({", ".join(_RESERVATION_COLUMNS)}, claim_uid, released_at)
    SELECT {_RESERVATION_VALUES}, '', NULL
    FROM verdict WHERE verdict.outcome = 'fits'
    ON CONFLICT (cluster, namespace, name) WHERE NOT (state = 'released') DO NOTHING
    RETURNING id
),
{ledger.counted_cte(source="asked a", amount="a.amount")},
{ledger.lines_cte(source="asked a", amount="a.amount")},
{_recorded_cte()}
SELECT verdict.outcome, over.id, over.in_use, over.amount,
       (SELECT count(*) FROM counted), (SELECT count(*) FROM lines),
       (SELECT count(*) FROM recorded){_endings(restore=restore, durability=durability)}
FROM verdict LEFT JOIN over ON true
"""


def reserve(
    fields: dict[str, Any], plan: Plan, *, username: str, created_by: str = ""
) -> tuple[Rule, Decimal] | None:
    """Lock the plan's rules (in id order), check every enforce limit against their current
    usage, insert the reservation `fields` (once per claim), add its amounts to the rules,
    insert its lines and record the decision, all in one statement: one round trip. Returns
    None when it fits, else the first rule it would take past its limit (its usage as found)
    and what the claim asks of it; raises `RulesChanged` when a rule has gone, and
    `DeadlinePassed` when the admission's deadline passed before it had its locks (it
    reserved nothing).

    A claim admitted meanwhile by another call (the same create sent again) makes the insert
    do nothing, and with it the rest: it reserves once and the answer is the same.
    `created_by`: the person behind a controller's claim, recorded on the decision.
    """
    params: list[Any] = []
    for rule_id in sorted(plan.reserve):
        params += [rule_id, plan.reserve[rule_id], plan.rules[rule_id].mode == Mode.ENFORCE]
    params += [
        _server_deadline(),
        *_reservation_params(fields),
        *_decision_params(fields, plan, username, created_by),
    ]
    ending = statement_ending()  # set back when it admits: then it is the admission's last
    [(outcome, over_id, in_use, amount, *_)] = fetch_prepared(
        _reserve_sql(len(plan.reserve), restore=ending.restore, durability=ending.durable),
        [*params, *ending.params],
    )
    return _reserved(outcome, over_id, in_use, amount, plan=plan, ending=ending)


def _reserved(
    outcome: str,
    over_id: int | None,
    in_use: Decimal,
    amount: Decimal,
    *,
    plan: Plan,
    ending: Ending,
) -> tuple[Rule, Decimal] | None:
    """What a reserving statement's outcome means (see `reserve`)."""
    if outcome == "fits":
        if ending.restore:
            restored()
        return None
    if outcome == "gone":
        raise RulesChanged
    if outcome == "late":
        raise DeadlinePassed("the reservation reached the database after the deadline")
    assert over_id is not None
    rule = plan.rules[over_id]
    rule.in_use = in_use
    return rule, amount


# --- Gangs ----------------------------------------------------------------------------------


class GangHoldChanged(Exception):
    """The gang's hold the plan counted on changed meanwhile: another member made it first,
    or it was released. The admission plans again from what is stored now."""


@functools.cache
def _gang_reserve_sql(rules: int, *, draw: bool, restore: bool, durability: bool) -> str:
    """The reserving statement of a gang's member for `rules` rules, as `_reserve_sql` (its
    outcomes, the order of its locks and clock, `restore` and `durability`) with the gang's
    hold:

    - `draw`: the member draws from the live hold (its id, locked after the rules, then its
      lines; and the hold's new expiry): on each rule the member's line moves from the hold
      to its reservation and the usage changes by `counted` (0 for a share the hold covers;
      what tops the hold up for a gang that grew), which goes to the hold and is weighed
      against the limit; a hold topped up keeps its members to come longer. Outcome 'nohold'
      when the hold is no longer live, or no longer has what the plan counted on;
    - else the first member of a gang admitted whole: the whole gang's demand (`counted`) is
      weighed and counted, the member's own (`line`, NULL: none on that rule) is its
      reservation's, and the rest is held by a new hold (six more parameters). A hold another
      member made meanwhile violates the unique live hold: the statement fails whole.
    """
    quote = connection.ops.quote_name
    rule, reservation, hold, hold_line = (
        quote(model._meta.db_table)
        for model in (QuotaRule, Reservation, GangReservation, GangReservationLine)
    )
    limit = quote("limit")
    if draw:
        values = ", ".join(
            ["(%s::bigint, %s::numeric, %s::numeric, %s::numeric, %s::boolean)"] * rules
        )
        asked = f"asked(rule_id, line, counted, expected, enforce) AS (VALUES {values})"
        # Locked after the rules (verdict asks for them in that order), as every writer of a
        # hold does. On each rule the member's line comes from the hold, and `counted` (what
        # the usage changes by) goes to it: the hold then keeps `after`, which cannot be
        # negative (the hold shrank since it was read: 'nohold', planned again). A top-up was
        # weighed on the hold as read (`expected`, NULL for a draw): it must be unchanged.
        split = f"""hold AS (
    SELECT g.id FROM {hold} g WHERE g.id = %s AND NOT (g.state = 'released') FOR UPDATE
),
held AS (
    SELECT h.rule_id, h.amount FROM {hold_line} h
    WHERE h.gang_reservation_id IN (SELECT id FROM hold) FOR UPDATE
),
split AS (
    SELECT a.rule_id, a.line, a.enforce, a.counted, a.expected, COALESCE(h.amount, 0) AS held,
           COALESCE(h.amount, 0) + a.counted - COALESCE(a.line, 0) AS after
    FROM asked a LEFT JOIN held h ON h.rule_id = a.rule_id
)"""
        weighed = "s.enforce AND s.counted > 0"
        no_hold = (
            "WHEN NOT EXISTS (SELECT 1 FROM hold) OR EXISTS (SELECT 1 FROM split WHERE after < 0"
            " OR expected <> held) THEN 'nohold'\n        "
        )
        # A hold topped up for members to come keeps them TALLY_GANG_RESERVATION_SECONDS
        # more, for the gang's size as read now (two parameters: the new expiry, the size).
        holding = f"""{ledger.hold_lines_drawn_cte()},
refreshed AS (
    UPDATE {hold} g SET expires_at = GREATEST(g.expires_at, %s), size = %s FROM kept, hold
    WHERE g.id = hold.id AND EXISTS (SELECT 1 FROM split WHERE after > held)
    RETURNING g.id
)"""
    else:
        values = ", ".join(["(%s::bigint, %s::numeric, %s::numeric, %s::boolean)"] * rules)
        asked = f"asked(rule_id, counted, line, enforce) AS (VALUES {values})"
        split = "split AS (SELECT rule_id, line, enforce, counted FROM asked)"
        weighed = "s.enforce"
        no_hold = ""
        holding = f"""made AS (
    INSERT INTO {hold} (cluster, namespace, key, source, size, team_id, state, created_at,
                        expires_at, released_at)
    SELECT %s, %s, %s, %s, %s, %s, '{ReservationState.RESERVED.value}', %s, %s, NULL FROM kept
    RETURNING id
),
{ledger.hold_lines_made_cte()}"""
    return f"""
WITH {asked},
locked AS (
    SELECT r.id, r.name, r.in_use, r.{limit} FROM {rule} r
    WHERE r.id IN (SELECT rule_id FROM asked) ORDER BY r.id FOR UPDATE
),
{split},
over AS (
    SELECT l.id, l.name, l.in_use, l.{limit}, s.counted AS amount
    FROM split s JOIN locked l ON l.id = s.rule_id
    WHERE {weighed} AND l.in_use + s.counted > l.{limit} ORDER BY l.id LIMIT 1
),
verdict AS (
    SELECT CASE
        WHEN (SELECT count(*) FROM locked) <> (SELECT count(*) FROM asked) THEN 'gone'
        {no_hold}WHEN EXISTS (SELECT 1 FROM over) THEN 'over'
        WHEN clock_timestamp() >= to_timestamp(%s::float8) THEN 'late'
        ELSE 'fits'
    END AS outcome
),
kept AS (
    INSERT INTO {reservation} ({", ".join(_RESERVATION_COLUMNS)}, claim_uid, released_at)
    SELECT {_RESERVATION_VALUES}, '', NULL
    FROM verdict WHERE verdict.outcome = 'fits'
    ON CONFLICT (cluster, namespace, name) WHERE NOT (state = 'released') DO NOTHING
    RETURNING id
),
{holding},
{ledger.counted_cte(source="split s", amount="s.counted", skip_zero=True)},
{ledger.lines_cte(source="split s", amount="s.line", skip_null=True)},
{_recorded_cte()}
SELECT verdict.outcome, over.id, over.in_use, over.amount,
       (SELECT count(*) FROM counted), (SELECT count(*) FROM lines),
       (SELECT count(*) FROM recorded){_endings(restore=restore, durability=durability)}
FROM verdict LEFT JOIN over ON true
"""


def reserve_gang(
    fields: dict[str, Any], plan: Plan, *, username: str, at: datetime, created_by: str = ""
) -> tuple[Rule, Decimal] | None:
    """Reserve for a gang's member (`plan.gang`), in one statement that takes its locks as
    `reserve` does: drawing from the gang's hold (`plan.gang.hold_id`; topping it up by
    `plan.gang.counted` for a gang that grew), or, for the first member of a gang admitted
    whole, reserving the whole gang's demand and holding what is not the member's; a hold
    made or topped up keeps it until TALLY_GANG_RESERVATION_SECONDS after `at`.

    Returns None when it fits (a claim admitted meanwhile reserves nothing more), else the
    first rule the gang, or what the member takes beyond the hold, would take past its limit,
    and what it asks of it. Raises `GangHoldChanged` when the hold is no longer live, or
    another member made one first (nothing reserved: plan again), and as `reserve` does.
    """
    gang = plan.gang
    assert gang is not None
    draw = gang.hold_id is not None
    params: list[Any] = []
    if draw:
        rule_ids = sorted(set(plan.reserve) | set(gang.counted))
        for rule_id in rule_ids:
            params += [
                rule_id,
                plan.reserve.get(rule_id),
                gang.counted.get(rule_id, Decimal(0)),
                gang.held.get(rule_id, Decimal(0)) if gang.whole else None,
                plan.rules[rule_id].mode == Mode.ENFORCE,
            ]
        params.append(gang.hold_id)
    else:
        rule_ids = sorted(gang.counted)
        for rule_id in rule_ids:
            params += [
                rule_id,
                gang.counted[rule_id],
                plan.reserve.get(rule_id),
                plan.rules[rule_id].mode == Mode.ENFORCE,
            ]
    params += [_server_deadline(), *_reservation_params(fields)]
    if draw:
        params += [at + timedelta(seconds=settings.TALLY_GANG_RESERVATION_SECONDS), gang.gang.size]
    else:
        params += [
            fields["cluster"],
            fields["namespace"],
            gang.gang.key,
            gang.gang.source,
            gang.gang.size,
            fields["team_id"],
            at,
            at + timedelta(seconds=settings.TALLY_GANG_RESERVATION_SECONDS),
        ]
    params += _decision_params(fields, plan, username, created_by)
    ending = statement_ending()
    sql = _gang_reserve_sql(
        len(rule_ids), draw=draw, restore=ending.restore, durability=ending.durable
    )
    try:
        with _own_savepoint():
            [(outcome, over_id, in_use, amount, *_)] = fetch_prepared(
                sql, [*params, *ending.params]
            )
    except IntegrityError as exc:
        if _constraint(exc) == "gangreservation_unique_live":
            raise GangHoldChanged from exc
        raise
    if outcome == "nohold":
        raise GangHoldChanged
    return _reserved(outcome, over_id, in_use, amount, plan=plan, ending=ending)


def _own_savepoint() -> contextlib.AbstractContextManager[Any]:
    """A statement that may fail on a constraint runs in a savepoint within a transaction, so
    that the transaction stays usable; in autocommit it is atomic on its own."""
    if connections[DEFAULT_DB_ALIAS].in_atomic_block:
        return transaction.atomic()
    return contextlib.nullcontext()


def _constraint(exc: IntegrityError) -> str | None:
    """The name of the constraint a statement violated, as PostgreSQL reports it."""
    diag = getattr(exc.__cause__, "diag", None)
    return getattr(diag, "constraint_name", None)
