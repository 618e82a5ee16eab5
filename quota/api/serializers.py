"""Teams, quota rules and admission decisions as the API shows them: read-only."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from config.api import ReadOnlyModelSerializer
from quota.models import AdmissionDecision, QuotaRule, Team
from quota.selectors import visible_teams


@extend_schema_field(OpenApiTypes.STR)
class VisibleTeamField(serializers.SlugRelatedField[Team]):
    """A team named by slug, among the teams the requesting user may see (others: invalid)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(slug_field="slug", **kwargs)

    def get_queryset(self) -> QuerySet[Team]:
        return visible_teams(user=self.context["request"].user)

    def to_internal_value(self, data: Any) -> Team:
        # PostgreSQL refuses NUL in text: answer "no such team" rather than a database error.
        if isinstance(data, str) and "\x00" in data:
            self.fail("does_not_exist", slug_name=self.slug_field, value=data)
        return super().to_internal_value(data)


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
        )
        extra_kwargs = {
            "in_use": {"help_text": "What live (reserved and allocated) claims hold, in `unit`."}
        }


class AdmissionDecisionSerializer(ReadOnlyModelSerializer):
    team: serializers.SlugRelatedField[Team] = serializers.SlugRelatedField(
        slug_field="slug", read_only=True, allow_null=True
    )
    warnings = serializers.ListField(child=serializers.CharField(), read_only=True)

    class Meta:
        model = AdmissionDecision
        fields = (
            "id",
            "at",
            "uid",
            "namespace",
            "name",
            "username",
            "team",
            "allowed",
            "dry_run",
            "message",
            "warnings",
        )
