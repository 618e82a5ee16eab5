"""Reads of quota's own tables outside the webhook (which reads through `quota.admission`)."""

from __future__ import annotations

from quota.models import QuotaRule
from teams.models import Team


def team_rules(*, team: Team) -> list[QuotaRule]:
    """The team's quota rules, oldest first (the order the webhook locks them in)."""
    return list(QuotaRule.objects.filter(team=team).order_by("pk"))
