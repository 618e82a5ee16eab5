"""Teams, quota rules and the webhook's decisions: read-only, scoped to the user's teams."""

from __future__ import annotations

from decimal import Decimal

from django.db.models import Case, DecimalField, F, Prefetch, QuerySet, Value, When
from drf_spectacular.utils import extend_schema
from rest_framework import mixins

from quota.api.filtersets import AdmissionDecisionFilterSet, QuotaRuleFilterSet, TeamFilterSet
from quota.api.serializers import (
    AdmissionDecisionSerializer,
    QuotaRuleSerializer,
    TeamSerializer,
)
from quota.models import AdmissionDecision, QuotaRule
from quota.selectors import visible_decisions
from teams.api import AnyRole, TallyViewSet, TeamScopedViewSet
from teams.models import Membership, Role, Team, TeamNamespace


@extend_schema(tags=["teams"])
class TeamViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, TeamScopedViewSet):
    """The teams you may see, with their namespaces and leads."""

    serializer_class = TeamSerializer
    filterset_class = TeamFilterSet
    lookup_field = "slug"
    lookup_value_regex = r"[-a-zA-Z0-9_]+"
    ordering_fields = ("slug", "name", "cost_centre")
    ordering = ("slug",)

    def scope(self, teams: QuerySet[Team]) -> QuerySet[Team]:
        return teams.prefetch_related(
            Prefetch("namespaces", queryset=TeamNamespace.objects.order_by("namespace")),
            Prefetch(
                "memberships",
                queryset=Membership.objects.filter(role=Role.LEAD)
                .select_related("user")
                .order_by("user__username"),
                to_attr="lead_memberships",
            ),
        )


@extend_schema(tags=["quota"])
class QuotaRuleViewSet(mixins.ListModelMixin, TeamScopedViewSet):
    """Quota rules of your teams: the limit, what live claims hold, and the fraction used."""

    serializer_class = QuotaRuleSerializer
    filterset_class = QuotaRuleFilterSet
    ordering_fields = ("team", "name", "device_class", "limit", "in_use", "usage_fraction")
    ordering = ("team", "name")
    ordering_aliases = {"team": "team__slug"}

    def scope(self, teams: QuerySet[Team]) -> QuerySet[QuotaRule]:
        # PostgreSQL divides numerics exactly to 16 significant digits or more; the serializer
        # shows six places.
        fraction: DecimalField[Decimal, Decimal] = DecimalField()
        return (
            QuotaRule.objects.filter(team__in=teams)
            .select_related("team")
            .annotate(
                usage_fraction=Case(
                    When(limit=0, then=Value(None, output_field=fraction)),
                    default=F("in_use") / F("limit"),
                    output_field=fraction,
                )
            )
        )


@extend_schema(tags=["quota"])
class AdmissionDecisionViewSet(mixins.ListModelMixin, TallyViewSet):
    """The webhook's decisions, newest first: operators and finance see all (namespaces of no
    team too), leads those of their teams (`?team=` another team is a 404); each with the
    person behind the claim and the cluster whose API server asked."""

    serializer_class = AdmissionDecisionSerializer
    filterset_class = AdmissionDecisionFilterSet
    permission_classes = [AnyRole]
    ordering_fields = ("at", "namespace", "name", "team", "cluster", "allowed")
    ordering = ("-at", "-id")
    ordering_aliases = {"team": "team__slug"}

    def get_queryset(self) -> QuerySet[AdmissionDecision]:
        return visible_decisions(user=self.request.user)
