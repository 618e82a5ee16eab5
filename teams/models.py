"""Tenancy: teams, who belongs to them, the namespaces they own, the audit trail, and alerts.

The bottom of the apps: every other app may read these; this app reads none of them.
"""

from __future__ import annotations

from decimal import Decimal

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
    # Given by the identity provider's groups at a sign-in (teams.sso), not by the policy file
    # or the admin: the next sign-in takes it when the groups no longer give it, and
    # `apply_policy --prune` leaves it. The file declaring the user makes it the file's.
    granted_by_sso = models.BooleanField(default=False)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["team", "user"], name="membership_unique"),
        ]

    def __str__(self) -> str:
        return f"{self.user} ({self.role} of {self.team})"


class SsoRole(models.TextChoices):
    """What a group of the identity provider makes its members: a team's lead or member, or
    finance or operator across every team (the `finance` and `operators` Django groups)."""

    LEAD = "lead", "team lead"
    MEMBER = "member", "member"
    FINANCE = "finance", "finance"
    OPERATOR = "operator", "operator"


# The roles that are a team's; the others are Tally-wide.
SSO_TEAM_ROLES = (SsoRole.LEAD, SsoRole.MEMBER)


class SsoGroupRole(models.Model):
    """One line of the policy file's `sso.groups`: members of the identity provider's group
    `group` get `role` (in `team` for lead and member) at each single sign-on login."""

    group = models.CharField(max_length=255)
    role = models.CharField(max_length=16, choices=SsoRole.choices)
    team = models.ForeignKey(
        Team, on_delete=models.CASCADE, null=True, blank=True, related_name="sso_group_roles"
    )

    class Meta:
        verbose_name = "SSO group role"
        constraints = [
            models.UniqueConstraint(
                fields=["group", "role", "team"],
                name="sso_group_role_unique",
                nulls_distinct=False,
            ),
            models.CheckConstraint(
                condition=models.Q(role__in=["lead", "member"], team__isnull=False)
                | models.Q(role__in=["finance", "operator"], team__isnull=True),
                name="sso_group_role_team_iff_team_role",
            ),
        ]

    def __str__(self) -> str:
        where = f" of {self.team}" if self.team_id else ""
        return f"{self.group} → {self.role}{where}"


class CurrentOwnerships(models.Manager["TeamNamespace"]):
    """The ownerships in force now (`valid_until` null): what quotas, the webhook and the
    pages mean by "the team's namespaces". Billing reads every dated row, through
    `TeamNamespace.dated` (`teams.ownership`)."""

    def get_queryset(self) -> models.QuerySet[TeamNamespace]:
        return super().get_queryset().filter(valid_until__isnull=True)


class TeamNamespace(models.Model):
    """A team's ownership of a Kubernetes namespace over `[valid_from, valid_until)`.

    Dated so that an hour of usage is charged to the team that owned the namespace in that
    hour, and a later move or release never changes who paid for an hour before it
    (`teams.ownership`, the only writer). Both bounds are hour starts; `valid_from` null: since
    before ownership was dated (the rows of an install before migration 0004) or, for a
    namespace's first owner while no billing period was closed, since the beginning.
    `valid_until` null: owned now; at most one such row per namespace. Rows are never deleted
    but with their team (a team with usage cannot be deleted)."""

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="namespaces")
    namespace = models.CharField(max_length=63)
    valid_from = models.DateTimeField(null=True, blank=True)
    valid_until = models.DateTimeField(null=True, blank=True)

    # Every row, dated; `objects` (the current ones) is the default manager, which reverse
    # relations (`team.namespaces`) and the admin use.
    dated = models.Manager()
    objects = CurrentOwnerships()

    class Meta:
        base_manager_name = "dated"
        default_manager_name = "objects"
        constraints = [
            models.UniqueConstraint(
                fields=["namespace"],
                condition=models.Q(valid_until__isnull=True),
                name="teamnamespace_one_owner_now",
            ),
            models.CheckConstraint(
                condition=models.Q(valid_from__isnull=True)
                | models.Q(valid_until__isnull=True)
                | models.Q(valid_until__gte=models.F("valid_from")),
                name="teamnamespace_valid_order",
            ),
        ]
        indexes = [models.Index(fields=["namespace", "valid_from"], name="teamnamespace_dated")]

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


class IdleAlertPolicy(models.Model):
    """When a team's claims count as idle (the policy file's `idleAlert`): utilised below
    `below_percent` of allocated in every one of the last `for_hours` rolled-up hours. A team
    with none has the default rule (`billing.idle.idle_policies`)."""

    team = models.OneToOneField(Team, on_delete=models.CASCADE, related_name="idle_alert_policy")
    below_percent = models.DecimalField(max_digits=5, decimal_places=2)
    for_hours = models.PositiveIntegerField()
    # False: `idleAlert: off`, the team is never alerted of idle claims (without a row it gets
    # the default rule, TALLY_IDLE_ALERT_DEFAULT_*); `below_percent` still says where its pages
    # draw the line.
    enabled = models.BooleanField(default=True, db_default=True)

    class Meta:
        verbose_name_plural = "idle alert policies"
        constraints = [
            models.CheckConstraint(
                condition=models.Q(below_percent__gt=0) & models.Q(below_percent__lte=100),
                name="idlealertpolicy_percent",
            ),
            models.CheckConstraint(
                condition=models.Q(for_hours__gte=1), name="idlealertpolicy_hours"
            ),
        ]

    def __str__(self) -> str:
        if not self.enabled:
            return f"{self.team}: off"
        percent = f"{Decimal(self.below_percent).normalize():f}"
        return f"{self.team}: below {percent}% for {self.for_hours} h"


class AlertKind(models.TextChoices):
    IDLE_CLAIM = "idle_claim", "idle claim"
    STRANDED_GANG = "stranded_gang", "stranded gang"
    VERSION_OUTLIER = "version_outlier", "version outlier"
    METERING_SILENT = "metering_silent", "metering engine silent"
    BILL_SHOCK = "bill_shock", "bill shock"


class AlertState(models.TextChoices):
    FIRING = "firing", "firing"
    RESOLVED = "resolved", "resolved"


class Alert(models.Model):
    """One stretch of a condition (an idle claim, a stranded gang, an outlier node) from when it
    was first seen until it resolved. `key` names the thing it is about, stably across
    evaluations (`cluster/namespace/claim-uid`): at most one firing row per kind and key, a new
    row when it fires again after resolving. `team` is null for fleet-wide alerts."""

    kind = models.CharField(max_length=32, choices=AlertKind.choices)
    key = models.CharField(max_length=1100)
    team = models.ForeignKey(
        Team, on_delete=models.SET_NULL, null=True, blank=True, related_name="alerts"
    )
    subject = models.CharField(max_length=300)
    description = models.TextField(blank=True)
    labels = models.JSONField(default=dict, blank=True)
    # Usernames and email addresses, as raised; resolved to addresses when sent.
    recipients = models.JSONField(default=list, blank=True)
    state = models.CharField(max_length=16, choices=AlertState.choices, default=AlertState.FIRING)
    first_seen = models.DateTimeField()
    last_seen = models.DateTimeField()
    resolved_at = models.DateTimeField(null=True, blank=True)
    # Until then nothing is sent for it; carried over to the key's next alert while it lasts.
    snoozed_until = models.DateTimeField(null=True, blank=True)
    snoozed_by = models.CharField(max_length=253, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["kind", "key"],
                condition=models.Q(state="firing"),
                name="alert_one_firing_per_key",
            ),
        ]
        indexes = [models.Index(fields=["state", "kind"], name="alert_state_kind")]

    def __str__(self) -> str:
        return f"{self.kind} {self.key} ({self.state})"


class DeliveryState(models.TextChoices):
    PENDING = "pending", "pending"
    SENT = "sent", "sent"
    FAILED = "failed", "failed (gave up)"
    # Not sent, by design: no address to send to, or resolved/snoozed before it went out.
    SKIPPED = "skipped", "skipped"


class AlertDelivery(models.Model):
    """One notification of one alert's event (firing or resolved) on one channel: `email`, or
    the Alertmanager webhook at `target`. Made once (unique), sent until it succeeds or runs
    out of attempts, so a receiver that fails gets it later and never twice."""

    alert = models.ForeignKey(Alert, on_delete=models.CASCADE, related_name="deliveries")
    event = models.CharField(max_length=16, choices=AlertState.choices)
    channel = models.CharField(max_length=16)  # email | webhook
    target = models.CharField(max_length=2000, blank=True)  # the webhook's URL
    state = models.CharField(
        max_length=16, choices=DeliveryState.choices, default=DeliveryState.PENDING
    )
    attempts = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField()
    sent_at = models.DateTimeField(null=True, blank=True)
    # What went out (the addresses, or the webhook's status) or the last error.
    detail = models.TextField(blank=True)

    class Meta:
        verbose_name_plural = "alert deliveries"
        constraints = [
            models.UniqueConstraint(
                fields=["alert", "event", "channel", "target"], name="alertdelivery_once"
            ),
        ]
        indexes = [
            models.Index(
                fields=["next_attempt_at"],
                condition=models.Q(state="pending"),
                name="alertdelivery_pending",
            )
        ]

    def __str__(self) -> str:
        return f"{self.alert}: {self.event} by {self.channel} {self.target}".rstrip()
