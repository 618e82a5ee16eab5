"""Query filters for teams, quota rules and admission decisions."""

from __future__ import annotations

import django_filters
from django.db.models import QuerySet
from rest_framework.exceptions import NotFound

from billing.api.filtersets import WindowFilterSet
from billing.windows import WINDOW_PERIOD_HELP
from quota.models import AdmissionDecision, QuotaRule
from quota.selectors import OUTCOMES, outcome_filter
from teams.api import TeamSlugFilter
from teams.models import Team, TeamNamespace
from teams.selectors import visible_teams


class TeamFilterSet(django_filters.FilterSet):
    namespace = django_filters.CharFilter(label="A namespace the team owns", method="owning")

    def owning(self, queryset: QuerySet[Team], name: str, value: str) -> QuerySet[Team]:
        """Teams owning `value` now: a join would match its past owners too (ownership is
        dated, `teams.ownership`)."""
        return queryset.filter(
            pk__in=TeamNamespace.objects.filter(namespace=value).values("team_id")
        )

    class Meta:
        model = Team
        fields = ("cost_centre",)


class QuotaRuleFilterSet(django_filters.FilterSet):
    team = TeamSlugFilter()

    class Meta:
        model = QuotaRule
        fields = ("device_class", "unit", "mode")


class AdmissionDecisionFilterSet(WindowFilterSet):
    """Decisions made in the window (`start`/`end`, or a `period`)."""

    date_field = "at"
    window_period = True
    period = django_filters.CharFilter(method="in_window", label=WINDOW_PERIOD_HELP)
    team = django_filters.CharFilter(
        method="filter_team",
        label="Team slug: one of the teams you may see (another is a 404, as if there were none)",
    )
    cluster = django_filters.CharFilter(
        label="The cluster whose API server asked, by name (empty: decisions of unknown cluster)"
    )
    outcome = django_filters.ChoiceFilter(
        choices=[(outcome, outcome) for outcome in OUTCOMES],
        method="filter_outcome",
        label="denied, warned (admitted with a warning) or allowed, as the portal names them",
    )

    def filter_team(
        self, queryset: QuerySet[AdmissionDecision], name: str, value: str
    ) -> QuerySet[AdmissionDecision]:
        if not value:
            return queryset
        # PostgreSQL refuses NUL in text: no such team, rather than a database error.
        user = self.request.user if self.request is not None else None
        if "\x00" in value or not visible_teams(user=user).filter(slug=value).exists():
            raise NotFound(f"No team {value!r} that you may see.")
        return queryset.filter(team__slug=value)

    def filter_outcome(
        self, queryset: QuerySet[AdmissionDecision], name: str, value: str
    ) -> QuerySet[AdmissionDecision]:
        return queryset.filter(outcome_filter(value)) if value else queryset

    class Meta:
        model = AdmissionDecision
        fields = ("namespace", "username", "allowed", "dry_run")
