"""Reads of the webhook's admission decisions for the people who ask why: operators see them
all, leads their teams' (the API), a team's page its recent denials and warnings; each with
the person behind the claim, not the controller that created it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db.models import Q, QuerySet

from inventory.models import Cluster, ResourceClaim
from inventory.owners import is_controller
from quota.models import AdmissionDecision
from teams.models import Team
from teams.selectors import user_role, visible_teams

# What a decision came to, as the filters and the pages name it.
DENIED = "denied"
WARNED = "warned"
ALLOWED = "allowed"
OUTCOMES = (DENIED, WARNED, ALLOWED)

_OUTCOME_FILTERS = {
    DENIED: Q(allowed=False),
    WARNED: Q(allowed=True) & ~Q(warnings=[]),
    ALLOWED: Q(allowed=True),
}


@dataclass(frozen=True)
class DecisionFilter:
    """The decision log's filters; empty fields filter nothing. `team` is a slug (`NO_TEAM`
    for namespaces no team owns), `cluster` a cluster's name, `[start, end)` half-open."""

    team: str = ""
    outcome: str = ""
    cluster: str = ""
    start: datetime | None = None
    end: datetime | None = None


NO_TEAM = "-"


def visible_decisions(*, user: Any) -> QuerySet[AdmissionDecision]:
    """The decisions `user` may read, newest first: operators and finance all (namespaces of
    no team too), leads their teams', anyone else none."""
    decisions = AdmissionDecision.objects.select_related("team").order_by("-at", "-pk")
    role = user_role(user)
    if role in ("operator", "finance"):
        return decisions
    if role == "lead":
        return decisions.filter(team__in=visible_teams(user=user))
    return decisions.none()


def decision_clusters() -> list[str]:
    """The clusters a decision may name, by name: the decision log filters by one of them
    once there is more than one."""
    return list(Cluster.objects.order_by("name").values_list("name", flat=True))


def outcome_filter(outcome: str) -> Q:
    """The decisions that came to `outcome` (one of `OUTCOMES`)."""
    return _OUTCOME_FILTERS[outcome]


def filter_decisions(
    decisions: QuerySet[AdmissionDecision], *, by: DecisionFilter
) -> QuerySet[AdmissionDecision]:
    """`decisions` narrowed by `by` (see `DecisionFilter`)."""
    if by.team == NO_TEAM:
        decisions = decisions.filter(team__isnull=True)
    elif by.team:
        decisions = decisions.filter(team__slug=by.team)
    if by.outcome:
        decisions = decisions.filter(outcome_filter(by.outcome))
    if by.cluster:
        decisions = decisions.filter(cluster=by.cluster)
    if by.start is not None:
        decisions = decisions.filter(at__gte=by.start)
    if by.end is not None:
        decisions = decisions.filter(at__lt=by.end)
    return decisions


def team_objections(
    *, team: Team, limit: int, cluster: str | None = None
) -> tuple[list[AdmissionDecision], int]:
    """The team's `limit` most recent denials and warnings (of `cluster`, when given), newest
    first, each with its `person` (`with_people`), and how many there are in all (decisions
    are kept TALLY_DECISION_RETENTION_DAYS)."""
    objections = AdmissionDecision.objects.filter(team=team).filter(
        _OUTCOME_FILTERS[DENIED] | _OUTCOME_FILTERS[WARNED]
    )
    if cluster is not None:
        objections = objections.filter(cluster=cluster)
    recent = list(objections.order_by("-at", "-pk")[:limit])
    total = len(recent) if len(recent) < limit else objections.count()
    return with_people(recent), total


def with_people(decisions: Iterable[AdmissionDecision]) -> list[AdmissionDecision]:
    """`decisions`, each with `person` set: who made the claim. The requester, unless a
    controller made the claim for someone (a Pod's claim from a template is created by the
    resource-claim controller): then the person the workload webhook recorded
    (`tally.dev/created-by`) on the claim's workload, as the claim webhook read it from the
    claim's owners when it decided (`AdmissionDecision.created_by`: denied claims too), else
    as the sync found it through the claim's owners (`ResourceClaim.created_by`), where the
    claim got as far as the inventory; else still the requester, for nobody else is known.
    One query at most."""
    decisions = list(decisions)
    controllers = settings.TALLY_WORKLOAD_CONTROLLERS
    made_for_someone = {
        d.pk: d for d in decisions if not d.created_by and is_controller(d.username, controllers)
    }
    creators: dict[tuple[str, str], list[tuple[datetime, str]]] = {}
    if made_for_someone:
        names = Q()
        for decision in made_for_someone.values():
            names |= Q(namespace=decision.namespace, name=decision.name)
        found = (
            ResourceClaim.objects.filter(names)
            .exclude(created_by="")
            .values_list("namespace", "name", "first_seen", "created_by")
        )
        for namespace, name, first_seen, created_by in found:
            creators.setdefault((namespace, name), []).append((first_seen, created_by))
    for decision in decisions:
        decision.person = decision.created_by or decision.username  # type: ignore[attr-defined]
        if decision.pk in made_for_someone:
            # The claim of that name first seen after the decision: an older one of the same
            # name is another claim, made before it.
            later = sorted(
                (seen, who)
                for seen, who in creators.get((decision.namespace, decision.name), [])
                if seen >= decision.at
            )
            if later:
                decision.person = later[0][1]  # type: ignore[attr-defined]
    return decisions
