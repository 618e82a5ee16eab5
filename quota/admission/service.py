"""The admission's two services: `review_claim` (the validating webhook) decides a claim's
CREATE and reserves what it can take, atomically; `fit_alternatives` (the mutating webhook)
says which `firstAvailable` alternatives fit, reserving nothing.

Each reads through `store`, weighs the claim with `decision` against the fleet's `shapes` and
the team's `budgets`, and writes through `store`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import DatabaseError
from django.urls import get_resolver

from inventory.models import Cluster
from inventory.services import get_cluster
from quota.admission import budgets, decision, shapes, store
from quota.admission.decision import AdmissionState, Decision, Plan
from quota.models import Webhook

log = logging.getLogger(__name__)


def review_claim(
    *,
    claim: dict[str, Any],
    username: str = "",
    dry_run: bool = False,
    admission_uid: str = "",
    at: datetime,
    deadline: float | None = None,
) -> Decision:
    """Decide the CREATE of `claim` and, unless `dry_run`, reserve what it can take.

    Guarantees: for every enforce rule, reservations plus allocations never exceed the limit,
    under any concurrency (one statement locks the team's rules and checks every limit); the
    same claim (cluster, namespace, name) admitted twice reserves once; a dry run writes
    nothing. No statement after the admission's first read, and no wait for a lock, runs past
    TALLY_WEBHOOK_DB_TIMEOUT_MS (the API server waits timeoutSeconds, 3 s); nothing waits on
    the database past `deadline` (`time.monotonic()`), and no reservation is made after it
    (`store.DeadlinePassed`, an `OperationalError`).
    """
    with (
        store.admission_deadline(deadline),
        contextlib.nullcontext() if dry_run else store.admission_session(),
        store.admission_transaction(),
    ):
        cluster = _cluster()
        namespace, name = decision.claim_name(claim)
        state = store.admission_state(cluster=cluster.name, namespace=namespace, name=name)
        if state.replayed_team_id is not None:
            # The API server may call again for the same claim (with a new uid): same answer,
            # nothing reserved twice.
            team = state.team
            if team is None or team.pk != state.replayed_team_id:
                team = store.team_by_id(state.replayed_team_id)
            return Decision(allowed=True, team=team)
        plan = _plan(cluster=cluster, claim=claim, state=state)
        recorded = False
        if plan.denial or dry_run or plan.team is None:
            answer = plan.decision()
        else:
            answer, recorded = _reserve(
                cluster=cluster,
                claim=claim,
                plan=plan,
                username=username,
                admission_uid=admission_uid,
                at=at,
            )
        if dry_run or recorded:
            return answer  # a dry run leaves nothing behind, not even its decision
        store.record(
            answer, namespace=namespace, name=name, username=username, uid=admission_uid, at=at
        )
        return answer


def fit_alternatives(
    *,
    claim: dict[str, Any],
    username: str = "",
    dry_run: bool = False,
    admission_uid: str = "",
    at: datetime,
    deadline: float | None = None,
) -> Decision:
    """Which firstAvailable alternatives fit the team's quota now; nothing is reserved.

    A denial is recorded (unless `dry_run`): the API server calls this webhook first and,
    when it denies, never calls the validating one, which records every other decision. A
    claim already admitted (the API server sends a retried create to this webhook first)
    keeps the alternatives its reservation chose: planned again, it would be counted beside
    its own reservation and not fit. Nothing waits on the database past `deadline`.
    """
    with (
        store.admission_deadline(deadline),
        contextlib.nullcontext() if dry_run else store.admission_session(timeouts=False),
        store.admission_transaction(),
    ):
        cluster = _cluster()
        namespace, name = decision.claim_name(claim)
        state = store.admission_state(cluster=cluster.name, namespace=namespace, name=name)
        if state.replayed_team_id is not None:
            chosen = store.chosen_alternatives(cluster=cluster.name, namespace=namespace, name=name)
            return Decision(
                allowed=True, team=state.team, removed=decision.not_chosen(claim, chosen)
            )
        answer = _plan(cluster=cluster, claim=claim, state=state).decision()
        if not answer.allowed and not dry_run:
            store.record(
                answer,
                namespace=namespace,
                name=name,
                username=username,
                uid=admission_uid,
                at=at,
                webhook=Webhook.MUTATE,
            )
        return answer


def _plan(*, cluster: Cluster, claim: dict[str, Any], state: AdmissionState) -> Plan:
    return decision.plan_claim(
        claim=claim,
        state=state,
        fleet=functools.partial(shapes.fleet_shapes, cluster=cluster),
        budget=budgets.budget_use,
    )


def _reserve(
    *,
    cluster: Cluster,
    claim: dict[str, Any],
    plan: Plan,
    username: str,
    admission_uid: str,
    at: datetime,
) -> tuple[Decision, bool]:
    """Reserve `plan.reserve` for the claim, or deny if a rule's limit no longer allows it.

    Returns the decision and whether it was recorded already (an `AdmissionDecision`).
    """
    assert plan.team is not None
    fields = decision.reservation_fields(
        cluster=cluster.name,
        claim=claim,
        plan=plan,
        username=username,
        admission_uid=admission_uid,
        at=at,
    )
    admitted = plan.decision()
    if not plan.reserve:
        store.reserve_uncounted(fields)
        return admitted, False
    try:
        exceeded = store.reserve(fields, plan, username=username)
    except store.RulesChanged:
        return decision.rules_changed(plan.team), False
    if exceeded is None:
        return admitted, True
    rule, asked = exceeded
    return decision.over_quota(plan, rule, asked), False


_clusters: dict[str, Cluster] = {}


def _cluster() -> Cluster:
    """This deployment's cluster, looked up once per process (it is never renamed)."""
    name = settings.TALLY_CLUSTER_NAME
    if name not in _clusters:
        _clusters[name] = get_cluster(name)
    return _clusters[name]


def forget_caches() -> None:
    """Drop what this process remembers for admissions: the cluster, the fleet's shapes and
    the budgets (tests; after an import that changed the fleet in this process)."""
    _clusters.clear()
    shapes.forget_fleet_shapes()
    budgets.forget_budgets()


def warm_up_worker() -> None:
    """Get a new web worker ready before it serves: the URLconf imported (the API's modules
    with it: ~0.2 s), the fleet's shapes loaded and the device classes' and quota rules'
    selectors evaluated on them (`shapes.warm_up`), at most TALLY_WARM_UP_SECONDS long
    (0: not at all). gunicorn calls it in each worker it starts (deploy/gunicorn.conf.py), at
    start-up and each time `max_requests` recycles one.

    Never stops the worker from serving: a database that cannot be reached is logged, and
    the first admissions do the work, as they would have.
    """
    seconds = settings.TALLY_WARM_UP_SECONDS
    if seconds <= 0:
        return
    started = time.monotonic()
    try:
        get_resolver().url_patterns  # noqa: B018 (imports the URLconf)
        pairs = shapes.warm_up(cluster=_cluster(), seconds=seconds)
    except DatabaseError as exc:
        log.warning("warm-up skipped: database unavailable: %s", exc)
        return
    except Exception:
        log.exception("warm-up failed; the first admissions will do the work")
        return
    log.info(
        "warm-up: %d selector and device shape pairs evaluated in %.2f s",
        pairs,
        time.monotonic() - started,
    )
