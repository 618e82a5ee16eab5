"""Teams, quota rules and admission decisions as the API shows them: read-only."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from inventory.models import Unit as DeviceUnit
from inventory.profiles import unit_label
from quota.admission.shapes import FleetShapes, every_fleet, rule_units
from quota.models import AdmissionDecision, QuotaRule, Unit
from quota.selectors import with_people
from teams.api import ReadOnlyModelSerializer
from teams.models import Team


class TeamSerializer(ReadOnlyModelSerializer):
    namespaces = serializers.ManyRelatedField(
        child_relation=serializers.SlugRelatedField(read_only=True, slug_field="namespace"),
        read_only=True,
    )
    leads = serializers.SerializerMethodField(help_text="Usernames of the team's leads.")

    class Meta:
        model = Team
        fields = ("slug", "name", "cost_centre", "namespaces", "leads")

    @extend_schema_field(serializers.ListField(child=serializers.CharField()))
    def get_leads(self, team: Team) -> list[str]:
        # Filled by the viewset's prefetch (`lead_memberships`): no query per team.
        return [membership.user.get_username() for membership in team.lead_memberships]  # type: ignore[attr-defined]


class QuotaRuleSerializer(ReadOnlyModelSerializer):
    team: serializers.SlugRelatedField[Team] = serializers.SlugRelatedField(
        slug_field="slug", read_only=True
    )
    usage_fraction = serializers.DecimalField(
        max_digits=30,
        decimal_places=6,
        read_only=True,
        allow_null=True,
        help_text="in_use / limit; null when the limit is 0.",
    )
    device_unit = serializers.SerializerMethodField(
        help_text="What one device counts on the rule: gpu, tpu (chips), gaudi (cards), or "
        "accelerator when the devices it covers differ (a GPU-equivalent of each)."
    )
    unit_label = serializers.SerializerMethodField(
        help_text='How `limit` and `in_use` read: "GPUs", "TPU chips", "Gaudi cards", '
        '"accelerators", or "bytes" for a memory rule.'
    )

    class Meta:
        model = QuotaRule
        fields = (
            "id",
            "team",
            "name",
            "device_class",
            "selector",
            "unit",
            "limit",
            "in_use",
            "mode",
            "usage_fraction",
            "device_unit",
            "unit_label",
        )
        extra_kwargs = {
            "in_use": {"help_text": "What live (reserved and allocated) claims hold, in `unit`."}
        }

    @extend_schema_field(serializers.ChoiceField(choices=DeviceUnit.choices))
    def get_device_unit(self, rule: QuotaRule) -> str:
        # The fleets are read once per response (see `every_fleet`), not per rule.
        fleets: list[FleetShapes] | None = self.context.get("fleets")
        if fleets is None:
            fleets = self.context["fleets"] = every_fleet()
        return rule_units([rule], fleets)[rule.pk]

    def get_unit_label(self, rule: QuotaRule) -> str:
        if rule.unit == Unit.MEMORY:
            return "bytes"
        return unit_label(self.get_device_unit(rule))


class _DecisionsWithPeople(serializers.ListSerializer[Any]):
    """A page of decisions, their people found in one query (`with_people`)."""

    def to_representation(self, data: Any) -> list[Any]:
        return super().to_representation(with_people(data.all() if hasattr(data, "all") else data))


class AdmissionDecisionSerializer(ReadOnlyModelSerializer):
    team: serializers.SlugRelatedField[Team] = serializers.SlugRelatedField(
        slug_field="slug", read_only=True, allow_null=True
    )
    warnings = serializers.ListField(child=serializers.CharField(), read_only=True)
    person = serializers.CharField(
        read_only=True,
        help_text="Who made the claim: `username`, unless a controller made it for someone "
        "(a Pod's claim from a template), then the person the workload webhook recorded "
        "(`tally.dev/created-by`) on the claim's Pod or its Job, as the claim webhook read it "
        "when it decided (denied claims too), or as the inventory found it later; the "
        "controller where neither could tell.",
    )

    class Meta:
        model = AdmissionDecision
        list_serializer_class = _DecisionsWithPeople
        fields = (
            "id",
            "at",
            "uid",
            "namespace",
            "name",
            "username",
            "person",
            "team",
            "cluster",
            "webhook",
            "allowed",
            "dry_run",
            "message",
            "warnings",
        )
