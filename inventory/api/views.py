"""The fleet as finance and operators see it: capacity, driver versions, fragmentation.

Fleet-wide figures say nothing about one team, and reveal the whole fleet, so team leads are
not let in (403).
"""

from __future__ import annotations

from typing import Any

from django.shortcuts import get_object_or_404
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import filters, mixins
from rest_framework.exceptions import NotFound
from rest_framework.generics import GenericAPIView
from rest_framework.renderers import BrowsableAPIRenderer, JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response

from inventory.api.serializers import (
    CapacitySerializer,
    DeviationRegisterSerializer,
    FleetReportSerializer,
)
from inventory.models import Cluster
from inventory.selectors import capacity_by_model, deviation_register, fleet_report
from teams.api import FinanceOrOperator, OrderingFilter, StrictQueryParameters, TallyViewSet

CLUSTER_PARAMETER = OpenApiParameter(
    "cluster", str, description="One cluster by name; all clusters when absent."
)


def requested_cluster(request: Request) -> Cluster | None:
    """`?cluster=NAME` (404 when there is none by that name), or None for all clusters."""
    name = request.query_params.get("cluster")
    if not name:
        return None
    if "\x00" in name:  # no such name; PostgreSQL would refuse the query
        raise NotFound("No cluster by that name.")
    return get_object_or_404(Cluster, name=name)


@extend_schema(tags=["inventory"])
class FleetSummaryView(StrictQueryParameters, GenericAPIView[Any]):
    """The fleet report: capacity by model, the driver/CUDA matrix and its outlier nodes, and
    how the free GPUs are fragmented."""

    permission_classes = [FinanceOrOperator]
    serializer_class = FleetReportSerializer
    filter_backends = []
    query_parameters = ("cluster",)
    renderer_classes = [JSONRenderer, BrowsableAPIRenderer]

    @extend_schema(parameters=[CLUSTER_PARAMETER])
    def get(self, request: Request) -> Response:
        return Response(self.get_serializer(fleet_report(cluster=requested_cluster(request))).data)


class RowOrderingFilter(OrderingFilter):
    """`?ordering=` over a list of rows (dicts), by the view's `ordering_fields`: names checked
    as for a queryset (an unknown one is a 400 naming the allowed), then a stable sort."""

    def filter_queryset(self, request: Request, queryset: Any, view: Any) -> Any:
        # DRF's plain names (the parent's F() expressions are for querysets).
        terms = filters.OrderingFilter.get_ordering(self, request, queryset, view)
        rows = list(queryset)
        for term in reversed(terms or []):
            name = term.removeprefix("-")
            rows.sort(key=lambda row: row[name], reverse=term.startswith("-"))
        return rows


@extend_schema(tags=["inventory"])
class CapacityViewSet(mixins.ListModelMixin, TallyViewSet):
    """Physical units per unit and model (GPUs, TPU chips, Gaudi cards): how many, allocated,
    free, MIG devices, and the capacity they make in their unit (`equivalents`)."""

    permission_classes = [FinanceOrOperator]
    serializer_class = CapacitySerializer
    filter_backends = [RowOrderingFilter]
    query_parameters = ("cluster",)
    ordering_fields = [
        "unit",
        "product_name",
        "gpus",
        "allocated",
        "free",
        "mig_devices",
        "equivalents",
    ]

    @extend_schema(parameters=[CLUSTER_PARAMETER])
    def list(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().list(request, *args, **kwargs)

    def get_queryset(self) -> Any:
        return capacity_by_model(cluster=requested_cluster(self.request))


@extend_schema(tags=["inventory"])
class DeviationViewSet(mixins.ListModelMixin, TallyViewSet):
    """The deviation register: nodes and pools allowed another driver/CUDA pair, why, whose,
    until when, and the state of their taint as read from the cluster; the active ones first,
    soonest to expire first, then the expired ones."""

    permission_classes = [FinanceOrOperator]
    serializer_class = DeviationRegisterSerializer
    filter_backends = [RowOrderingFilter]
    query_parameters = ("cluster",)
    ordering_fields = ["expires_at", "cluster", "node_name", "owner"]

    @extend_schema(parameters=[CLUSTER_PARAMETER])
    def list(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().list(request, *args, **kwargs)

    def get_queryset(self) -> Any:
        return deviation_register(cluster=requested_cluster(self.request))
