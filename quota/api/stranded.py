"""Stranded gangs (issue 20): gangs some of whose members hold devices while the others wait
or are missing, for longer than TALLY_STRANDED_GANG_MINUTES, with what they hold and what
that has cost (`billing.stranded`).

Leads see their teams' gangs; finance and operators every team's, and those of namespaces of
no team (team "").
"""

from __future__ import annotations

from typing import Any

from django.utils import timezone
from drf_spectacular.utils import extend_schema
from rest_framework import serializers

from billing.stranded import PricedGang, priced_stranded_gangs
from inventory.api.views import requested_cluster
from metering.hours import MS_PER_HOUR
from quota.api.demand import RowViewSet


class HoursField(serializers.DecimalField):
    """Hours of a unit, to the millionth."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(max_digits=24, decimal_places=6, **kwargs)


class CostSerializer(serializers.Serializer[Any]):
    currency = serializers.CharField()
    amount = serializers.CharField(
        help_text="A decimal string to the currency's minor unit (5.49 USD, 500 JPY)."
    )


class HeldSerializer(serializers.Serializer[Any]):
    product_name = serializers.CharField(allow_blank=True)
    profile = serializers.CharField(allow_blank=True)
    unit = serializers.CharField(allow_blank=True)
    devices = serializers.IntegerField(help_text="Held now.")
    unit_hours = HoursField(help_text="Held since the gang was partial.")


class StrandedGangSerializer(serializers.Serializer[Any]):
    cluster = serializers.CharField()
    namespace = serializers.CharField()
    gang = serializers.CharField(help_text='Its key, e.g. "JobSet/train".')
    # A field named like Field.source: DRF moves declared fields off the class, so it works.
    source = serializers.CharField(  # type: ignore[assignment]
        help_text="What declares it (jobset, workload, ...)."
    )
    team = serializers.CharField(allow_blank=True)
    size = serializers.IntegerField(help_text="Pods that must run together.")
    members_holding = serializers.IntegerField(help_text="Pods holding devices.")
    members_present = serializers.IntegerField(help_text="Pods with a live claim.")
    devices_held = serializers.IntegerField()
    units_held = serializers.DecimalField(
        max_digits=15, decimal_places=6, help_text="The held devices' shares of their unit."
    )
    unit = serializers.CharField(allow_blank=True)
    stranded_since = serializers.DateTimeField(help_text="Partial without a break since.")
    stranded_seconds = serializers.IntegerField()
    unit_hours = HoursField(help_text="Unit-hours (GPU-hours for GPUs) held since it was partial.")
    costs = CostSerializer(
        many=True,
        help_text="Those hours at today's rate cards' full price, per currency.",
    )
    unpriced_unit_hours = HoursField(help_text="Hours of models no rate card prices.")
    held = HeldSerializer(many=True)


def gang_row(priced: PricedGang) -> dict[str, Any]:
    gang = priced.gang
    return {
        "cluster": gang.cluster,
        "namespace": gang.namespace,
        "gang": gang.key,
        "source": gang.source,
        "team": gang.team,
        "size": gang.size,
        "members_holding": gang.members_holding,
        "members_present": gang.members_present,
        "devices_held": gang.devices_held,
        "units_held": gang.units_held,
        "unit": gang.unit,
        "stranded_since": gang.stranded_since,
        "stranded_seconds": gang.stranded_seconds,
        "unit_hours": priced.unit_hours,
        "costs": [
            {"currency": currency, "amount": f"{amount:f}"}
            for currency, amount in priced.cost.items()
        ],
        "unpriced_unit_hours": priced.unpriced_unit_hours,
        "held": [
            {
                "product_name": line.product_name,
                "profile": line.profile,
                "unit": line.unit,
                "devices": line.devices,
                "unit_hours": line.unit_ms / MS_PER_HOUR,
            }
            for line in gang.held
        ],
    }


@extend_schema(tags=["inventory"])
class StrandedGangViewSet(RowViewSet):
    """Gangs partial for longer than TALLY_STRANDED_GANG_MINUTES: members holding and
    present, devices held, the unit-hours they have held since and what that has cost.
    Longest stranded first unless `ordering` says otherwise."""

    serializer_class = StrandedGangSerializer
    row_filters = ("team", "namespace", "unit")
    ordering_fields = [
        "stranded_seconds",
        "team",
        "namespace",
        "gang",
        "devices_held",
        "unit_hours",
    ]

    def get_queryset(self) -> Any:
        return [
            gang_row(priced)
            for priced in priced_stranded_gangs(
                user=self.request.user,
                now=timezone.now(),
                cluster=requested_cluster(self.request),
            )
        ]
