"""`{{ warning.since|since_when }}`: since when a sync warning has been true, as the CLI says
it ("since 2026-12-04 10:00 UTC (3 h)"), so the fleet page and `fleet_report` read alike."""

from __future__ import annotations

from django import template
from django.utils import timezone

from inventory.checks import describe_since

register = template.Library()


@register.filter
def since_when(since: str) -> str:
    return describe_since(since, now=timezone.now())
