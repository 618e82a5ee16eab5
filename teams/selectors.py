"""Reads of tenancy: the one place that decides who sees which team."""

from __future__ import annotations

import contextlib
from typing import Any

from django.db.models import QuerySet

from teams.models import Membership, Role, Team, TeamNamespace


def team_for_namespace(*, namespace: str) -> Team | None:
    owner = TeamNamespace.objects.select_related("team").filter(namespace=namespace).first()
    return owner.team if owner else None


OPERATORS_GROUP = "operators"
FINANCE_GROUP = "finance"


def user_role(user: Any) -> str | None:
    """`operator` (superusers and the operators group), `finance`, `lead`, or None.

    Members who lead no team have no role: they see nothing in the portal or the API. The
    answer is remembered on the user object, which lives for one request.
    """
    try:
        role: str | None = user._tally_role
        return role
    except AttributeError:
        pass
    role = _role(user)
    # An object that takes no attributes is simply asked again next time.
    with contextlib.suppress(AttributeError):
        user._tally_role = role
    return role


def _role(user: Any) -> str | None:
    if not getattr(user, "is_authenticated", False) or not user.is_active:
        return None
    if user.is_superuser or user.groups.filter(name=OPERATORS_GROUP).exists():
        return "operator"
    if user.groups.filter(name=FINANCE_GROUP).exists():
        return "finance"
    if Membership.objects.filter(user=user, role=Role.LEAD).exists():
        return "lead"
    return None


def visible_teams(*, user: Any) -> QuerySet[Team]:
    """The teams whose usage, quotas and statements `user` may read."""
    role = user_role(user)
    if role in ("operator", "finance"):
        return Team.objects.all()
    if role == "lead":
        return Team.objects.filter(memberships__user=user, memberships__role=Role.LEAD).distinct()
    return Team.objects.none()
