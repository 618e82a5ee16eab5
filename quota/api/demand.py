"""Pending demand (issue 20): the live claims that hold no device, the queue behind every
scheduling complaint, per claim and summed per team and device class.

Leads see their teams' rows; finance and operators every team's, and those of namespaces of
no team (team ""). Rows are worked out per request (`quota.pending`), then filtered and
ordered in Python; like every list, they page and export as CSV.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from django.utils import timezone
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers
from rest_framework.filters import BaseFilterBackend
from rest_framework.request import Request
from rest_framework.response import Response

from inventory.api.views import CLUSTER_PARAMETER, RowOrderingFilter, requested_cluster
from quota.pending import PendingClaim, pending_claims, pending_demand
from teams.api import TallyViewSet

UNITS_HELP = (
    "Of the unit (gpu, tpu, gaudi, accelerator): a whole device 1, a MIG device its share of "
    "its GPU, as the admission webhook counts it."
)


class RowFilter(BaseFilterBackend):
    """Equality filters over rows (dicts), one per name in the view's `row_filters`: a value
    that no row has gives an empty list, never an error."""

    def filter_queryset(self, request: Request, queryset: Any, view: Any) -> Any:
        wanted = {
            name: request.query_params[name]
            for name in view.row_filters
            if name in request.query_params
        }
        return [row for row in queryset if all(row[k] == v for k, v in wanted.items())]

    def get_schema_operation_parameters(self, view: Any) -> list[dict[str, Any]]:
        return [
            {
                "name": name,
                "required": False,
                "in": "query",
                "description": f"Only rows whose {name} is this.",
                "schema": {"type": "string"},
            }
            for name in view.row_filters
        ]


class PendingClaimSerializer(serializers.Serializer[Any]):
    cluster = serializers.CharField()
    namespace = serializers.CharField()
    claim = serializers.CharField()
    team = serializers.CharField(allow_blank=True, help_text='The namespace\'s team; "" none.')
    job = serializers.CharField(allow_blank=True, help_text='Its workload ("Kind/name").')
    waiting_since = serializers.DateTimeField(
        help_text="Created, or last released its devices, whichever is later."
    )
    waited_seconds = serializers.IntegerField()
    request = serializers.CharField(allow_blank=True)
    device_class = serializers.CharField(allow_blank=True)
    unit = serializers.CharField(allow_blank=True)
    devices = serializers.IntegerField()
    units = serializers.DecimalField(max_digits=15, decimal_places=6, help_text=UNITS_HELP)
    models = serializers.ListField(
        child=serializers.CharField(), help_text="Models of the devices it could be given."
    )
    problem = serializers.CharField(
        allow_blank=True, help_text="Why its requests could not be read; empty when they could."
    )


class PendingDemandSerializer(serializers.Serializer[Any]):
    team = serializers.CharField(allow_blank=True)
    device_class = serializers.CharField(allow_blank=True)
    unit = serializers.CharField(allow_blank=True)
    models = serializers.ListField(child=serializers.CharField())
    claims = serializers.IntegerField()
    devices = serializers.IntegerField()
    units = serializers.DecimalField(max_digits=15, decimal_places=6, help_text=UNITS_HELP)
    longest_wait_seconds = serializers.IntegerField()


def claim_rows(claims: Sequence[PendingClaim]) -> list[dict[str, Any]]:
    """One row per request of each claim (one empty row for a claim whose requests could not
    be read), in the claims' order."""
    rows = []
    for claim in claims:
        common = {
            "cluster": claim.cluster,
            "namespace": claim.namespace,
            "claim": claim.name,
            "team": claim.team,
            "job": claim.job,
            "waiting_since": claim.waiting_since,
            "waited_seconds": claim.waited_seconds,
            "problem": claim.problem,
        }
        for request in claim.requests:
            rows.append(
                {
                    **common,
                    "request": request.name,
                    "device_class": request.device_class,
                    "unit": request.unit,
                    "devices": request.devices,
                    "units": request.units,
                    "models": list(request.models),
                }
            )
        if not claim.requests:
            empty = {"request": "", "device_class": "", "unit": "", "devices": 0, "units": 0}
            rows.append({**common, **empty, "models": []})
    return rows


class RowViewSet(mixins.ListModelMixin, TallyViewSet):
    """A list of rows (dicts) worked out in Python: filtered by `row_filters`, ordered by
    `ordering_fields`, paged, in JSON or CSV; `?cluster=` narrows it to one cluster."""

    filter_backends = [RowFilter, RowOrderingFilter]
    row_filters: tuple[str, ...] = ()
    query_parameters = ("cluster",)

    @extend_schema(parameters=[CLUSTER_PARAMETER])
    def list(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().list(request, *args, **kwargs)


@extend_schema(tags=["inventory"])
class PendingClaimViewSet(RowViewSet):
    """Live claims holding no device, one row per request: how long each has waited and
    what it asks for. Longest waiting first unless `ordering` says otherwise."""

    serializer_class = PendingClaimSerializer
    row_filters = ("team", "namespace", "device_class", "unit")
    ordering_fields = ["waited_seconds", "team", "namespace", "claim", "device_class", "units"]

    def get_queryset(self) -> Any:
        return claim_rows(
            pending_claims(
                user=self.request.user,
                now=timezone.now(),
                cluster=requested_cluster(self.request),
            )
        )


@extend_schema(tags=["inventory"])
class PendingDemandViewSet(RowViewSet):
    """Pending claims summed per team, device class and unit: claims, devices, units and the
    longest wait."""

    serializer_class = PendingDemandSerializer
    row_filters = ("team", "device_class", "unit")
    ordering_fields = ["team", "device_class", "claims", "devices", "units", "longest_wait_seconds"]

    def get_queryset(self) -> Any:
        return [
            {**asdict(row), "models": list(row.models)}
            for row in pending_demand(
                user=self.request.user,
                now=timezone.now(),
                cluster=requested_cluster(self.request),
            )
        ]
