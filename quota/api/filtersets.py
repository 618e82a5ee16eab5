"""Query filters for teams, quota rules and admission decisions."""

from __future__ import annotations

import django_filters

from quota.models import AdmissionDecision, QuotaRule
from teams.api import DateRangeFilterSet, TeamSlugFilter
from teams.models import Team


class TeamFilterSet(django_filters.FilterSet):
    namespace = django_filters.CharFilter(
        field_name="namespaces__namespace", label="A namespace the team owns"
    )

    class Meta:
        model = Team
        fields = ("cost_centre",)


class QuotaRuleFilterSet(django_filters.FilterSet):
    team = TeamSlugFilter()

    class Meta:
        model = QuotaRule
        fields = ("device_class", "unit", "mode")


class AdmissionDecisionFilterSet(DateRangeFilterSet):
    date_field = "at"
    team = TeamSlugFilter()

    class Meta:
        model = AdmissionDecision
        fields = ("namespace", "username", "allowed", "dry_run")
