"""The cluster on the portal's pages (issue 35, finding 6): once Tally syncs more than one
cluster, every list of claims, capacity, pending demand and decisions names each row's cluster,
and `?cluster=NAME` narrows the page to one. With one cluster there is no column and no filter
(a `?cluster=` naming it changes nothing).

A decision names the cluster of the webhook that made it (`AdmissionDecision.cluster`; empty
for denials made before it was recorded).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from inventory import selectors as fleet
from inventory.models import Cluster
from inventory.profiles import unit_order
from quota.pending import PendingClaim, PendingDemand, summarize

CLUSTER_PARAMETER = "cluster"


@dataclass(frozen=True)
class ClusterScope:
    """The clusters there are, and the one `?cluster=` chose (None: all of them)."""

    names: list[str]
    chosen: Cluster | None = None
    error: str = ""

    @property
    def multi(self) -> bool:
        """Whether pages name clusters: more than one is synced."""
        return len(self.names) > 1


def cluster_scope(request: HttpRequest) -> ClusterScope:
    """The clusters and `?cluster=`'s choice; `error` says what is wrong with a name that is no
    cluster's (the page answers 400)."""
    clusters = list(Cluster.objects.order_by("name"))
    names = [cluster.name for cluster in clusters]
    given = request.GET.get(CLUSTER_PARAMETER, "")
    if not given:
        return ClusterScope(names)
    chosen = next((cluster for cluster in clusters if cluster.name == given), None)
    if chosen is None:
        known = ", ".join(names) or "none yet"
        return ClusterScope(
            names, error=f"cluster: no cluster is named {given[:63]!r} (clusters: {known})."
        )
    return ClusterScope(names, chosen if len(names) > 1 else None)


def bad_request(request: HttpRequest, reason: str) -> HttpResponse:
    """The portal's 400 page, saying what was wrong with the request."""
    return render(request, "frontend/bad_request.html", {"reason": reason}, status=400)


def context(request: HttpRequest, scope: ClusterScope) -> dict[str, Any]:
    """What the pages' cluster column and filter need (`_cluster_filter.html`): the other query
    parameters are kept as hidden fields, so filtering keeps the page's window."""
    return {
        "multi_cluster": scope.multi,
        "cluster_names": scope.names,
        "cluster_chosen": scope.chosen.name if scope.chosen is not None else "",
        "cluster_kept": [
            (key, value)
            for key, values in request.GET.lists()
            if key not in (CLUSTER_PARAMETER, "page")
            for value in values
        ],
    }


def demand_by_cluster(claims: Iterable[PendingClaim]) -> list[tuple[str, PendingDemand]]:
    """`quota.pending.summarize` per cluster: the same groups (team, device class, unit),
    each of one cluster, by cluster name."""
    per_cluster: dict[str, list[PendingClaim]] = {}
    for claim in claims:
        per_cluster.setdefault(claim.cluster, []).append(claim)
    return [
        (cluster, row) for cluster in sorted(per_cluster) for row in summarize(per_cluster[cluster])
    ]


def capacity(*, cluster: Cluster | None, multi: bool) -> list[dict[str, Any]]:
    """`inventory.selectors.capacity_by_model`, each row with its `cluster`: per cluster when
    there are several and none is chosen (rows of two clusters never add up on the page), by
    unit, then cluster, then model."""
    if cluster is not None or not multi:
        name = cluster.name if cluster is not None else ""
        return [{**row, "cluster": name} for row in fleet.capacity_by_model(cluster=cluster)]
    rows = [
        {**row, "cluster": each.name}
        for each in Cluster.objects.order_by("name")
        for row in fleet.capacity_by_model(cluster=each)
    ]
    return sorted(rows, key=lambda row: unit_order(row["unit"]))  # stable: cluster, model kept
