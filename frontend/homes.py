"""The home page per role (issue 35, finding 7): finance's shows the money and its periods
(`frontend.finance`), operators' a summary of the fleet with links to its pages, above the
team list; a lead's is `frontend.views.home` (its team, or the list of its teams)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone

from billing.stranded import priced_stranded_gangs
from frontend import finance, selectors, views
from inventory import selectors as fleet
from inventory.models import Cluster
from quota import pending
from quota.selectors import DENIED, outcome_filter, visible_decisions

# The window of the operators' home's count of denials.
DENIALS_HOURS = 24


@dataclass(frozen=True)
class ClusterSummary:
    """One cluster's capacity per unit (rows of `capacity_by_model` summed)."""

    cluster: Cluster
    units: list[dict[str, Any]]


def cluster_summaries() -> list[ClusterSummary]:
    """Each cluster's units, allocated and free, per unit (GPUs, TPU chips...)."""
    summaries = []
    for cluster in Cluster.objects.order_by("name"):
        per_unit: dict[str, dict[str, Any]] = {}
        for row in fleet.capacity_by_model(cluster=cluster):
            unit = per_unit.setdefault(
                row["unit"],
                {"label": row["unit_label"], "units": 0, "allocated": 0, "free": 0},
            )
            unit["units"] += row["gpus"]
            unit["allocated"] += row["allocated"]
            unit["free"] += row["free"]
        summaries.append(ClusterSummary(cluster, list(per_unit.values())))
    return summaries


def operator_home(request: HttpRequest, teams: list[Any]) -> HttpResponse:
    now = timezone.now()
    since = now - timedelta(hours=DENIALS_HOURS)
    decisions = visible_decisions(user=request.user)
    context = {
        "role": "operator",
        "teams": teams,
        "clusters": cluster_summaries(),
        "pending_total": len(pending.pending_claims(user=request.user, now=now)),
        "stranded_total": len(priced_stranded_gangs(user=request.user, now=now)),
        "denials": decisions.filter(outcome_filter(DENIED), at__gte=since).count(),
        "denials_hours": DENIALS_HOURS,
    }
    return render(request, "frontend/home.html", context)


@login_required
def home(request: HttpRequest) -> HttpResponse:
    role = selectors.portal_role(request.user)
    if role == finance.FINANCE:
        return finance.finance_home(request, selectors.team_list(user=request.user))
    if role == "operator":
        return operator_home(request, selectors.team_list(user=request.user))
    return views.home(request)
