"""Tenancy: teams, who belongs to them, the namespaces they own, and the audit trail.

The bottom of the apps: every other app may read these; this app reads none of them.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models


class Team(models.Model):
    """A tenant: the unit quotas, budgets and statements are kept for."""

    slug = models.SlugField(max_length=63, unique=True)
    name = models.CharField(max_length=200)
    cost_centre = models.CharField(max_length=100, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.slug


class Role(models.TextChoices):
    LEAD = "lead", "team lead"
    MEMBER = "member", "member"


class Membership(models.Model):
    """A user's role in a team."""

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships"
    )
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["team", "user"], name="membership_unique"),
        ]

    def __str__(self) -> str:
        return f"{self.user} ({self.role} of {self.team})"


class TeamNamespace(models.Model):
    """A Kubernetes namespace and the team that owns it; a namespace has one owner."""

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="namespaces")
    namespace = models.CharField(max_length=63, unique=True)

    def __str__(self) -> str:
        return self.namespace


class AuditEntry(models.Model):
    """A change to a team, membership, namespace or rule: who, when, before and after."""

    at = models.DateTimeField(db_index=True)
    actor = models.CharField(max_length=253)
    action = models.CharField(max_length=16)  # create, update, delete
    object_type = models.CharField(max_length=63)
    object_repr = models.CharField(max_length=253)
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)

    class Meta:
        verbose_name_plural = "audit entries"

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M} {self.actor} {self.action} {self.object_repr}"
