"""The admission's two services: `review_claim` (the validating webhook) decides a claim's
CREATE and reserves what it can take, atomically; `fit_alternatives` (the mutating webhook)
keeps one `firstAvailable` alternative per request, the first that fits, reserving nothing.

Each reads through `store`, weighs the claim with `decision` against the fleet's `shapes` and
the team's `budgets`, and writes through `store`.

A claim made from a template for a Pod in a gang (`inventory.gangs`) is weighed with its gang,
as its team's gang policy says (`gang_weighing.weigh_gang`). The gang is read through this process's
`gang_lookup`: the API server when Tally runs in a cluster (or KUBECONFIG names one), else
none, and claims are decided alone. A gang that cannot be read never fails an admission: the
claim is decided alone, with a warning.

A claim a controller makes for someone (a Pod's claim from a template, made by the
resource-claim controller) records on its decision the person behind it: the
`tally.dev/created-by` the workload webhook wrote on its owners, read through the same lookup,
as far as the admission's deadline allows (`claim_person`). A denied claim never reaches the
inventory, so its decision is the only place that person is kept.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.db import DatabaseError, transaction
from django.urls import get_resolver

from inventory import gangs, kube, kube_owners, owners
from inventory.models import Cluster
from inventory.owners import api_group
from inventory.services import get_cluster
from quota import services as quota_services
from quota.admission import budgets, decision, gang_weighing, plans, shapes, store
from quota.admission.plans import AdmissionState, Decision, Plan
from quota.models import GangMode, Webhook

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
    whichever `firstAvailable` alternative the scheduler gives (every one left in the claim
    must fit, and each rule holds the most any one takes there: `decision.plan_claim`), under
    any concurrency (one statement locks the team's rules and checks every limit); the
    same claim (cluster, namespace, name, and the same uid or spec) admitted twice reserves
    once, and another claim under a live reservation's name is weighed as new with that
    reservation counted (`plans.LiveReservation.made_for`); a dry run writes nothing. No
    statement after the admission's first read, and no wait for a lock, runs past
    TALLY_WEBHOOK_DB_TIMEOUT_MS (the API server waits timeoutSeconds, 3 s); nothing waits on
    the database past `deadline` (`time.monotonic()`), and no reservation is made after it
    (`store.DeadlinePassed`, an `OperationalError`). A gang's first member is admitted only
    if the whole gang fits, in the same one statement (no two gangs admitted into room for
    one); its other members draw from what it held, and a member beyond the hold (the gang
    grew) is admitted only if the rest of the gang fits too, topping the hold up
    (`gang_weighing.weigh_gang`). Members admitted alone before their gang could be read count as
    the gang's.
    """
    with (
        store.admission_deadline(deadline),
        contextlib.nullcontext() if dry_run else store.admission_session(),
        store.admission_transaction(),
    ):
        cluster = _cluster()
        namespace, name = plans.claim_name(claim)
        gang: _Gang | None = None
        created_by: str | None = None  # read once, when the decision is to be recorded
        for _ in range(_GANG_ATTEMPTS):
            state = store.admission_state(cluster=cluster.name, namespace=namespace, name=name)
            live = state.live
            if live is not None and live.made_for(claim):
                # The API server may call again for the same claim (with a new request uid):
                # same answer, nothing reserved twice.
                team = state.team
                if team is None or team.pk != live.team_id:
                    team = store.team_by_id(live.team_id)
                return Decision(allowed=True, team=team)
            # Another claim under a live reservation's name is weighed as new, with that
            # reservation still counted in its rules' usage.
            gang = gang or _gang_of(claim=claim, state=state)
            if created_by is None:
                created_by = (
                    ""
                    if dry_run
                    else claim_person(
                        claim=claim, username=username, deadline=deadline, unreadable=gang.unread
                    )
                )
            plan = _plan(cluster=cluster, claim=claim, state=state, gang=gang)
            recorded = False
            if plan.denial or dry_run or plan.team is None:
                answer = plan.decision()
                break
            if live is not None and live.claim_uid:
                # The name's reservation is a claim the sync has seen: it still exists (this
                # create then fails, the name being taken) or was deleted meanwhile. Its hold
                # stays, for only the sync can tell; the sync moves it to whichever claim has
                # the name. This one fitted with it counted.
                answer = plan.decision()
                answer.warnings.append(_UNDER_A_TAKEN_NAME.format(namespace, name))
                break
            try:
                answer, recorded = _reserve_in_place(
                    cluster=cluster,
                    claim=claim,
                    plan=plan,
                    username=username,
                    admission_uid=admission_uid,
                    at=at,
                    superseding=live is not None,
                    created_by=created_by,
                )
                break
            except store.GangHoldChanged:
                continue  # another member made the gang's hold, or it was released: again
        else:
            assert plan.team is not None and plan.gang is not None
            answer = gang_weighing.gang_changed(plan)
        if dry_run or recorded:
            return answer  # a dry run leaves nothing behind, not even its decision
        store.record(
            answer,
            namespace=namespace,
            name=name,
            username=username,
            uid=admission_uid,
            at=at,
            cluster=cluster.name,
            created_by=created_by or "",
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
    """Which firstAvailable alternative each request keeps (the first that fits the team's
    quota now; the others are removed, so the claim holds only what it takes); nothing is
    reserved.

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
        namespace, name = plans.claim_name(claim)
        state = store.admission_state(cluster=cluster.name, namespace=namespace, name=name)
        if state.live is not None:
            chosen, kept = store.admitted_patch(
                cluster=cluster.name, namespace=namespace, name=name
            )
            removed = decision.not_chosen(claim, chosen)
            # The same claim once the alternatives not chosen are out: keep them out.
            if state.live.made_for(claim, removed=removed):
                return Decision(allowed=True, team=state.team, removed=removed)
            # The same claim once narrowed as its first admission narrowed it (a create sent
            # again, unpatched): narrowed alike, whatever room its models have now that its
            # own reservation holds some. Planned again, it would be counted beside that
            # reservation, and narrowed to other models or denied.
            again = decision.narrowed_again(kept)
            selectors = {key: narrowing.selector for key, narrowing in again.items()}
            if again and state.live.made_for(claim, removed=removed, narrowed=selectors):
                return Decision(
                    allowed=True,
                    team=state.team,
                    removed=removed,
                    narrowed=again,
                    warnings=[decision.narrowing_warning(k, n) for k, n in again.items()],
                )
        gang = _gang_of(claim=claim, state=state)
        answer = _plan(cluster=cluster, claim=claim, state=state, gang=gang, narrow=True).decision()
        if not answer.allowed and not dry_run:
            store.record(
                answer,
                namespace=namespace,
                name=name,
                username=username,
                uid=admission_uid,
                at=at,
                cluster=cluster.name,
                webhook=Webhook.MUTATE,
                created_by=claim_person(
                    claim=claim, username=username, deadline=deadline, unreadable=gang.unread
                ),
            )
        return answer


def _plan(
    *,
    cluster: Cluster,
    claim: dict[str, Any],
    state: AdmissionState,
    gang: _Gang | None = None,
    narrow: bool = False,
) -> Plan:
    """Weigh `claim` as `state` read its team, with its gang (found now unless `gang` is);
    `narrow`: keeping one alternative of each firstAvailable request (`decision.plan_claim`)."""
    if gang is None:
        gang = _gang_of(claim=claim, state=state)
    gang_state = None
    if gang.ref is not None:
        namespace, _ = plans.claim_name(claim)
        gang_state = store.gang_state(cluster=cluster.name, namespace=namespace, key=gang.ref.key)
        state.credit = dict(gang_state.held) if gang_state.hold_id is not None else {}
    plan = decision.plan_claim(
        claim=claim,
        state=state,
        fleet=functools.partial(shapes.fleet_shapes, cluster=cluster),
        budget=budgets.budget_use,
        units=lambda rules: shapes.rule_units(rules, shapes.every_fleet_shapes()),
        narrow=narrow,
    )
    if gang.ref is not None and gang_state is not None:
        gang_weighing.weigh_gang(
            plan,
            gang=gang.ref,
            mode=state.gang_mode,
            state=gang_state,
            whole=functools.partial(
                _gang_demand, cluster=cluster, claim=claim, plan=plan, gang=gang
            ),
            adopted=functools.partial(_admitted_alone, cluster=cluster, claim=claim, gang=gang),
        )
    plan.warnings.extend(gang.warnings)
    return plan


_UNDER_A_TAKEN_NAME = (
    "another claim named {}/{} holds quota: this one fits beside it, and is counted once the "
    "inventory sees which of them has the name"
)


def _reserve_in_place(
    *,
    cluster: Cluster,
    claim: dict[str, Any],
    plan: Plan,
    username: str,
    admission_uid: str,
    at: datetime,
    superseding: bool,
    created_by: str = "",
) -> tuple[Decision, bool]:
    """`_reserve`, after releasing the live reservation of another claim of the same name
    when `superseding` (`quota.services.supersede_reservation`), in one transaction: a
    denial leaves that reservation as it was. Only a reservation no claim was seen for yet is
    superseded: if its claim exists after all, the sync's first sight of it gives the
    reservation back to it, with its exact hold."""
    if not superseding:
        return _reserve(
            cluster=cluster,
            claim=claim,
            plan=plan,
            username=username,
            admission_uid=admission_uid,
            at=at,
            created_by=created_by,
        )
    namespace, name = plans.claim_name(claim)
    with transaction.atomic():
        quota_services.supersede_reservation(
            cluster=cluster.name, namespace=namespace, name=name, at=at
        )
        answer, recorded = _reserve(
            cluster=cluster,
            claim=claim,
            plan=plan,
            username=username,
            admission_uid=admission_uid,
            at=at,
            created_by=created_by,
        )
        if not answer.allowed:
            transaction.set_rollback(True)
    if answer.allowed:
        answer.warnings.append(
            f"a reservation Tally held for another claim named {namespace}/{name} was "
            "replaced by this one's"
        )
    return answer, recorded


def _reserve(
    *,
    cluster: Cluster,
    claim: dict[str, Any],
    plan: Plan,
    username: str,
    admission_uid: str,
    at: datetime,
    created_by: str = "",
) -> tuple[Decision, bool]:
    """Reserve `plan.reserve` for the claim, or deny if a rule's limit no longer allows it;
    `created_by`: the person behind the claim, for its decision (`claim_person`).

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
    gang = plan.gang
    if gang is not None:
        # Members admitted before their gang could be read are the gang's from now on (the
        # plan counted them so); true whatever this claim's answer.
        store.adopt_gang_members(ids=gang.adopted, key=gang.gang.key)
    if gang is not None and ((gang.hold_id is not None and plan.reserve) or gang.counted):
        try:
            exceeded = store.reserve_gang(
                fields, plan, username=username, at=at, created_by=created_by
            )
        except store.RulesChanged:
            return decision.rules_changed(plan.team), False
        if exceeded is None:
            return admitted, True
        rule, asked = exceeded
        if not gang.whole:
            return decision.over_quota(plan, rule, asked), False
        if gang.hold_id is not None:
            return gang_weighing.gang_over_quota(plan, rule), False
        namespace, _ = plans.claim_name(claim)
        if store.gang_state(cluster=cluster.name, namespace=namespace, key=gang.gang.key).hold_id:
            # Another member of the gang admitted it meanwhile: this one draws from its hold.
            raise store.GangHoldChanged
        return gang_weighing.gang_over_quota(plan, rule), False
    if not plan.reserve:
        store.reserve_uncounted(fields)
        return admitted, False
    try:
        exceeded = store.reserve(fields, plan, username=username, created_by=created_by)
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


# --- Gangs ----------------------------------------------------------------------------------

# An admission plans again when the gang's hold changed under it (another member made it, or
# it was released); past this many plans it is denied, to be created again.
_GANG_ATTEMPTS = 3


@dataclass
class _Gang:
    """The gang of an admission's claim as found (None: none, or not looked for), the lookup
    it was read through and the warnings finding it gave."""

    ref: gangs.GangRef | None
    lookup: gangs.GangLookup | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def unread(self) -> frozenset[tuple[str, str, str]]:
        """(kind, namespace, name) of the objects finding it could not read."""
        return (
            frozenset(self.lookup.unreadable) if isinstance(self.lookup, _Watched) else frozenset()
        )


class _Watched:
    """A `GangLookup` that never raises and remembers what it could not read: a Pod the
    claim names but that cannot be read (gone, or the API server unreachable), or a reader
    that failed."""

    def __init__(self, lookup: gangs.GangLookup) -> None:
        self._lookup = lookup
        self.failures: list[str] = []
        # (kind, namespace, name) of each object that could not be read: not asked again for
        # the claim's person in the same admission (`claim_person`).
        self.unreadable: set[tuple[str, str, str]] = set()

    def get(self, namespace: str, api_version: str, kind: str, name: str) -> dict[str, Any] | None:
        return self._read(self._lookup.get, namespace, api_version, kind, name)

    def get_fresh(
        self, namespace: str, api_version: str, kind: str, name: str
    ) -> dict[str, Any] | None:
        """As `get`, past what the reader kept (a Pod recreated under its name), when the
        reader can (`gangs.FreshLookup`)."""
        fresh = getattr(self._lookup, "get_fresh", None)
        return self._read(fresh or self._lookup.get, namespace, api_version, kind, name)

    def _read(
        self,
        read: Callable[[str, str, str, str], dict[str, Any] | None],
        namespace: str,
        api_version: str,
        kind: str,
        name: str,
    ) -> dict[str, Any] | None:
        try:
            found = read(namespace, api_version, kind, name)
        except Exception as exc:  # a reader's bug or an API error: no gang, never a failure
            log.warning("reading %s %s/%s for a gang failed: %s", kind, namespace, name, exc)
            self.failures.append(f"reading {kind} {namespace}/{name} failed")
            self.unreadable.add((kind, namespace, name))
            return None
        if found is None and (kind == "Pod" or (api_group(api_version), kind) in gangs.GANG_KINDS):
            # The Pod, or the object its gang is declared by (not created or cached yet,
            # forbidden, timed out): the gang cannot be known.
            self.failures.append(f"{kind} {namespace}/{name} could not be read")
            self.unreadable.add((kind, namespace, name))
        return found


def _gang_of(*, claim: dict[str, Any], state: AdmissionState) -> _Gang:
    """The gang of the Pod `claim` was made for, when its team weighs gangs (`gangs: enforce`
    or `warn`) and this process can read them."""
    if (
        state.team is None
        or state.gang_mode == GangMode.OFF
        or gangs.claim_pod(claim) is None
        or (lookup := gang_lookup()) is None
    ):
        return _Gang(ref=None)
    watched = _Watched(lookup)
    try:
        ref = gangs.gang_of_claim(claim, watched)
    except Exception:  # never raises on any input; if it does, the claim is decided alone
        log.exception("finding the gang of a claim failed")
        ref, watched.failures = None, ["finding it failed"]
    warnings = []
    if ref is None and watched.failures:
        warnings.append(
            f"Tally could not read this claim's gang ({watched.failures[0]}): the claim is "
            "decided alone"
        )
    return _Gang(ref=ref, lookup=watched, warnings=warnings)


def _gang_demand(
    *, cluster: Cluster, claim: dict[str, Any], plan: Plan, gang: _Gang
) -> dict[int, Decimal]:
    """What the whole gang of `claim` can take on each of its team's rules, from the claim
    templates of its roles (read through the gang's lookup) or, failing them, from the claim
    (`gang_weighing.gang_demand`)."""
    assert gang.ref is not None and gang.lookup is not None
    namespace, _ = plans.claim_name(claim)
    names = {name for role in gang.ref.roles for name in role.claim_templates}
    templates: dict[str, dict[int, Decimal] | None] = {}
    rules = list(plan.rules.values())
    for name in sorted(names):
        template = gang.lookup.get(
            namespace, str(claim.get("apiVersion") or ""), "ResourceClaimTemplate", name
        )
        spec = template.get("spec") if isinstance(template, dict) else None
        claim_spec = spec.get("spec") if isinstance(spec, dict) else None
        if not isinstance(template, dict) or not isinstance(claim_spec, dict):
            templates[name] = None
            continue
        templates[name] = decision.claim_amounts(
            spec=claim_spec,
            api_version=str(template.get("apiVersion") or claim.get("apiVersion") or ""),
            chosen=None,
            rules=rules,
            fleet=shapes.fleet_shapes(cluster=cluster),
        )
    return gang_weighing.gang_demand(gang=gang.ref, own=plan.reserve, templates=templates)


# At most this many Pods are read to find a gang's members admitted alone (`_admitted_alone`):
# the webhook's time is short, and such members are few (a gang's first few, at most).
_ADOPTION_READS = 32


def _admitted_alone(*, cluster: Cluster, claim: dict[str, Any], gang: _Gang) -> plans.Adopted:
    """The members of the gang of `claim` that were admitted alone, before the gang could be
    read: the latest live reservations of the namespace made for Pods with no gang (at most
    `_ADOPTION_READS`), whose Pod is in the gang as read now."""
    assert gang.ref is not None and gang.lookup is not None
    namespace, name = plans.claim_name(claim)
    ids: list[int] = []
    amounts: dict[int, Decimal] = {}
    for candidate in store.gangless_pod_claims(
        cluster=cluster.name, namespace=namespace, name=name, limit=_ADOPTION_READS
    ):
        made_for = {
            "metadata": {"namespace": namespace, "ownerReferences": candidate.owner_references}
        }
        try:
            ref = gangs.gang_of_claim(made_for, gang.lookup)
        except Exception:  # as in `_gang_of`: never fails an admission
            log.exception("finding the gang of an admitted claim failed")
            continue
        if ref is None or ref.key != gang.ref.key:
            continue
        ids.append(candidate.id)
        for rule_id, amount in candidate.amounts.items():
            amounts[rule_id] = amounts.get(rule_id, Decimal(0)) + amount
    return plans.Adopted(ids=tuple(ids), amounts=amounts)


# --- The person behind a controller's claim ---------------------------------------------------

# An owner is read for a claim's person only while this much is left before the admission's
# deadline: the longest one read waits (the webhook reader's connect and read timeouts) and
# time for the statements still to come. Past it, only what the reader keeps is used: the
# person is unknown rather than the answer late.
PERSON_READ_SECONDS = sum(kube_owners.WEBHOOK_READ_TIMEOUT_SECONDS) + 0.25


class _OwnersInTime:
    """The owners of a claim (`owners.OwnerLookup`) through the admission's lookup (the gang
    lookup: the same cache, timeouts and pauses), reading nothing once the admission's
    `deadline` is nearer than `PERSON_READ_SECONDS` (then only what the reader keeps). Never
    raises: what it cannot read is None (unknown); an owner the API server said is not there
    is `owners.GONE`, as the sync's reader answers."""

    def __init__(
        self,
        lookup: gangs.GangLookup,
        *,
        deadline: float | None,
        unreadable: Collection[tuple[str, str, str]] = (),
    ) -> None:
        self._lookup = lookup
        self._deadline = deadline
        self._unreadable = unreadable

    def owner(self, namespace: str, reference: owners.OwnerReference) -> owners.Owner | None:
        api_version = str(reference.get("apiVersion") or "")
        kind, name = str(reference["kind"]), str(reference["name"])
        if (kind, namespace, name) in self._unreadable:
            return None  # just failed, finding the gang: not asked again
        try:
            if self._deadline is None or time.monotonic() < self._deadline - PERSON_READ_SECONDS:
                obj = self._lookup.get(namespace, api_version, kind, name)
            elif isinstance(self._lookup, kube_owners.GangReader):
                kept, obj = self._lookup.cached(namespace, api_version, kind, name)
                if not kept:
                    return None
            else:
                return None
            if obj is not None:
                return owners.Owner.of(obj)
            said_absent = getattr(self._lookup, "said_absent", None)
            if said_absent is not None and said_absent(namespace, api_version, kind, name):
                return owners.GONE
        except Exception as exc:  # a reader's bug or an API error: the person is unknown
            log.warning(
                "reading %s %s/%s for a claim's person failed: %s", kind, namespace, name, exc
            )
        return None


def claim_person(
    *,
    claim: dict[str, Any],
    username: str,
    deadline: float | None,
    unreadable: Collection[tuple[str, str, str]] = (),
) -> str:
    """The person behind `claim` when a controller (TALLY_WORKLOAD_CONTROLLERS) made it for
    someone, as the inventory would name it (`owners.claim_creator`): the nearest
    `tally.dev/created-by` of its owners (the Pod of a template's claim, then the Pod's Job or
    ReplicaSet), read through `gang_lookup` while `deadline` allows, else the labels that name
    a person. "" when the requester is the person (it is the decision's `username`), when
    nothing names one, or when the owners cannot be read (none to read from, gone, forbidden,
    timed out, no time left): never raises, never delays the answer past the deadline. The
    objects of `unreadable` ((kind, namespace, name): finding the claim's gang just failed to
    read them) are not asked for."""
    controllers = settings.TALLY_WORKLOAD_CONTROLLERS
    if not username or not owners.is_controller(username, controllers):
        return ""
    metadata = claim.get("metadata")
    metadata = metadata if isinstance(metadata, dict) else {}
    references = metadata.get("ownerReferences")
    namespace, _ = plans.claim_name(claim)
    try:
        resolution = None
        if owners.needs_lookup(references) and (lookup := gang_lookup()) is not None:
            resolution = owners.resolve_job(
                namespace=namespace,
                owner_references=references,
                lookup=_OwnersInTime(lookup, deadline=deadline, unreadable=unreadable),
                creator_labels=settings.TALLY_CREATED_BY_LABELS,
            )
        return owners.claim_creator(
            recorded=username,
            owner_references=references,
            labels=metadata.get("labels"),
            resolution=resolution,
            creator_labels=settings.TALLY_CREATED_BY_LABELS,
            controllers=controllers,
        )
    except Exception:  # never fails an admission: the person is unknown
        log.exception(
            "finding the person behind claim %s/%s failed", namespace, metadata.get("name")
        )
        return ""


_lookups: dict[str, gangs.GangLookup | None] = {}


def gang_lookup() -> gangs.GangLookup | None:
    """Where this process reads Pods and the objects that declare gangs: the API server
    (`inventory.kube_owners.GangReader`, cached) when Tally runs in a cluster or KUBECONFIG names
    one, else nowhere (None: no gangs, every claim decided alone). Made once per process."""
    if "lookup" not in _lookups:
        _lookups["lookup"] = _api_server_lookup()
    return _lookups["lookup"]


def use_gang_lookup(lookup: gangs.GangLookup | None) -> None:
    """Read gangs through `lookup` in this process from now on (None: no gangs)."""
    _lookups["lookup"] = lookup


def _api_server_lookup() -> gangs.GangLookup | None:
    if not (os.environ.get("KUBERNETES_SERVICE_HOST") or os.environ.get("KUBECONFIG")):
        return None
    try:
        return kube_owners.GangReader(
            kube.api_client(retries=0), request_timeout=kube_owners.WEBHOOK_READ_TIMEOUT_SECONDS
        )
    except kube.KubeError as exc:
        log.warning("gangs cannot be read, claims are decided alone: %s", exc)
        return None


def forget_caches() -> None:
    """Drop what this process remembers for admissions: the cluster, the fleet's shapes, the
    budgets and the gang lookup (tests; after an import that changed the fleet in this
    process)."""
    _clusters.clear()
    _lookups.clear()
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
