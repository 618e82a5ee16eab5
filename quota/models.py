"""Quota rules and GPU-hour budgets of teams, and what admitted claims reserve.

A rule's `in_use` is the sum of the live reservation lines on it, kept in the same
transaction as the lines, so one statement that locks the team's rules decides an admission
under any concurrency: `in_use + amount <= limit`.
"""

from __future__ import annotations

from django.db import models
from django.db.models import Q

from inventory.models import Unit as DeviceUnit
from inventory.profiles import hours_label
from teams.models import Team


class Mode(models.TextChoices):
    ENFORCE = "enforce", "enforce (deny past the limit)"
    WARN = "warn", "warn (admit with a warning)"


class Unit(models.TextChoices):
    GPUS = "gpus", "GPU-equivalents"
    MEMORY = "memory", "bytes of GPU memory"


class QuotaRule(models.Model):
    """A limit on what a team's claims may hold of one device class.

    A request is limited by the rule when its class is the rule's `device_class` and the rule's
    CEL `selector` (empty: every device) matches a device the request could be given.
    """

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="rules")
    name = models.SlugField(max_length=63)
    device_class = models.CharField(max_length=253)
    selector = models.TextField(blank=True)
    unit = models.CharField(max_length=16, choices=Unit.choices, default=Unit.GPUS)
    # Device-equivalents (a MIG device or partition counts its share of its GPU, a consumable
    # share its fraction) or bytes, per `unit`. Device-equivalents are of the unit of the
    # devices the rule covers (GPUs, TPU chips, Gaudi cards; "accelerators" when they differ),
    # as messages and the API say (`quota.admission.shapes.rule_unit`).
    limit = models.DecimalField(max_digits=24, decimal_places=6)
    mode = models.CharField(max_length=16, choices=Mode.choices, default=Mode.ENFORCE)
    # Sum of the live reservation lines and live gang reservation lines on this rule; only
    # quota.ledger writes it (for quota.services and the webhook's quota.admission.store).
    in_use = models.DecimalField(max_digits=24, decimal_places=6, default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["team", "name"], name="quotarule_unique_name"),
            models.CheckConstraint(condition=Q(limit__gte=0), name="quotarule_limit_positive"),
            models.CheckConstraint(condition=Q(in_use__gte=0), name="quotarule_in_use_positive"),
        ]

    def __str__(self) -> str:
        return f"{self.team}/{self.name}"


class ReservationState(models.TextChoices):
    RESERVED = "reserved", "reserved at admission"
    ALLOCATED = "allocated", "allocated by the scheduler"
    RELEASED = "released", "released"


class Reservation(models.Model):
    """What one admitted claim holds against its team's rules, from admission to deletion.

    A claim is identified by cluster, namespace and name: a create the API server retries
    carries a new request uid but is the same claim (the same uid, or the same spec:
    `spec_digest`), and reserves once; another claim under a live reservation's name is
    weighed as new.
    """

    cluster = models.CharField(max_length=63)
    namespace = models.CharField(max_length=253)
    name = models.CharField(max_length=253)
    claim_uid = models.CharField(max_length=64, blank=True)
    # The webhook writes reservations, their lines and decisions on every admission; their
    # references are kept by Django (PROTECT, CASCADE, SET_NULL), not by foreign-key
    # constraints, whose checks at commit would key-share-lock the team's row from every
    # concurrent admission of the team (a multixact per row) for rows the same statement
    # has just read or locked.
    team = models.ForeignKey(
        Team, on_delete=models.PROTECT, related_name="reservations", db_constraint=False
    )
    state = models.CharField(
        max_length=16, choices=ReservationState.choices, default=ReservationState.RESERVED
    )
    # Who made the claim, and the object it serves (a Pod, a Job): for usage per user and job.
    # Unbounded: a username is whatever the API server's authenticators say (a service
    # account's is up to 338 characters), and the API server checks no length of an owner
    # reference's kind or name.
    username = models.TextField(blank=True)
    owner_kind = models.TextField(blank=True)
    owner_name = models.TextField(blank=True)
    owner_references = models.JSONField(default=list, blank=True)
    # Which alternative of each firstAvailable request fit, by request name.
    chosen = models.JSONField(default=dict, blank=True)
    admission_uid = models.CharField(max_length=64, blank=True)
    created_at = models.DateTimeField()
    expires_at = models.DateTimeField(null=True, blank=True)
    released_at = models.DateTimeField(null=True, blank=True)
    # The gang the claim's Pod belongs to (`inventory.gangs.GangRef.key`), "" for none: its
    # members are the live reservations of the same cluster, namespace and key. A default in
    # the database too, for the inserts of a pod of the previous version.
    gang_key = models.CharField(max_length=320, blank=True, default="", db_default="")
    # A digest of the spec admitted (`decision.spec_digest`): a create of the same name is a
    # retry only if it is the same claim (same uid, or same spec); "" before digests were kept.
    spec_digest = models.CharField(max_length=64, blank=True, default="", db_default="")
    # The selectors the mutating webhook added to the claim admitted, narrowing it to the
    # models that fit (its team's `narrowToFit`), by request ("request", or
    # "request/alternative"): {"selector": ..., "models": [...]}. A create sent again,
    # unpatched, is narrowed alike (`plans.LiveReservation.made_for`); {} for a claim not
    # narrowed. A default in the database too, for the inserts of a pod of the previous version.
    narrowed = models.JSONField(default=dict, blank=True, db_default={})

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["cluster", "namespace", "name"],
                condition=~Q(state="released"),
                name="reservation_unique_live_claim",
            ),
        ]
        indexes = [
            models.Index(fields=["state", "expires_at"], name="reservation_expiry"),
            models.Index(
                fields=["cluster", "namespace", "gang_key"],
                condition=~Q(gang_key="") & ~Q(state="released"),
                name="reservation_live_gang_member",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} ({self.state})"


class ReservationLine(models.Model):
    """The amount one reservation holds on one rule, in the rule's unit."""

    # No index of its own: the unique (reservation, rule) index leads with it.
    reservation = models.ForeignKey(
        Reservation,
        on_delete=models.CASCADE,
        related_name="lines",
        db_index=False,
        db_constraint=False,  # see Reservation.team
    )
    rule = models.ForeignKey(
        QuotaRule, on_delete=models.CASCADE, related_name="lines", db_constraint=False
    )
    amount = models.DecimalField(max_digits=24, decimal_places=6)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["reservation", "rule"], name="reservationline_unique"),
        ]

    def __str__(self) -> str:
        return f"{self.reservation}: {self.amount} on {self.rule}"


class GangMode(models.TextChoices):
    ENFORCE = "enforce", "enforce (admit a gang whole or not at all)"
    WARN = "warn", "warn (decide each claim alone; warn when its gang cannot fit whole)"
    OFF = "off", "off (decide each claim alone)"


class GangPolicy(models.Model):
    """How a team's gangs are admitted; a team without one is `enforce`d."""

    team = models.OneToOneField(Team, on_delete=models.CASCADE, related_name="gang_policy")
    mode = models.CharField(max_length=8, choices=GangMode.choices, default=GangMode.ENFORCE)

    class Meta:
        verbose_name_plural = "gang policies"

    def __str__(self) -> str:
        return f"{self.team}: gangs {self.mode}"


class NarrowingPolicy(models.Model):
    """Whether the mutating webhook may narrow a team's claims that could land on several
    models to the models whose quota rules have room (the policy file's `narrowToFit`): a
    selector is added to the request, so "any GPU" takes the free H100s instead of being
    denied by a full T4 rule. A team without one is never narrowed."""

    team = models.OneToOneField(Team, on_delete=models.CASCADE, related_name="narrowing_policy")
    narrow_to_fit = models.BooleanField(default=False)

    class Meta:
        verbose_name_plural = "narrowing policies"

    def __str__(self) -> str:
        return f"{self.team}: narrow to fit {'on' if self.narrow_to_fit else 'off'}"


class GangReservation(models.Model):
    """What a gang admitted whole holds for its members not yet admitted (the hold).

    The first member's admission reserves the whole gang's demand: the member's own share on
    its reservation, the rest here. Each later member moves its share from here to its own
    reservation, so usage does not change; a gang that grows tops it up for its new members,
    and a member released while the gang lives gives its share back here, for its replacement
    (either keeps it TALLY_GANG_RESERVATION_SECONDS more). Released when no member holds a live
    reservation any more, or when what it holds has not been drawn by `expires_at`.
    """

    cluster = models.CharField(max_length=63)
    namespace = models.CharField(max_length=253)
    key = models.CharField(max_length=320)  # `inventory.gangs.GangRef.key`
    source = models.CharField(max_length=16)  # `inventory.gangs.GangRef.source`
    size = models.PositiveIntegerField()  # pods that must run together
    team = models.ForeignKey(
        Team,
        on_delete=models.PROTECT,
        related_name="gang_reservations",
        db_constraint=False,  # see Reservation.team
    )
    # reserved (live) or released; never allocated: the members are.
    state = models.CharField(
        max_length=16, choices=ReservationState.choices, default=ReservationState.RESERVED
    )
    created_at = models.DateTimeField()
    expires_at = models.DateTimeField(null=True, blank=True)
    released_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["cluster", "namespace", "key"],
                condition=~Q(state="released"),
                name="gangreservation_unique_live",
            ),
        ]
        indexes = [models.Index(fields=["state", "expires_at"], name="gangreservation_expiry")]

    def __str__(self) -> str:
        return f"{self.namespace}/{self.key} ({self.state})"


class GangReservationLine(models.Model):
    """The amount a gang's hold keeps on one rule for its members to come, in the rule's unit."""

    gang_reservation = models.ForeignKey(
        GangReservation,
        on_delete=models.CASCADE,
        related_name="lines",
        db_index=False,  # the unique (gang_reservation, rule) index leads with it
        db_constraint=False,  # see Reservation.team
    )
    rule = models.ForeignKey(
        QuotaRule, on_delete=models.CASCADE, related_name="gang_lines", db_constraint=False
    )
    amount = models.DecimalField(max_digits=24, decimal_places=6)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["gang_reservation", "rule"], name="gangreservationline_unique"
            ),
            models.CheckConstraint(
                condition=Q(amount__gte=0), name="gangreservationline_amount_positive"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.gang_reservation}: {self.amount} on {self.rule}"


class Webhook(models.TextChoices):
    VALIDATE = "validate", "validating"
    MUTATE = "mutate", "mutating"


class AdmissionDecision(models.Model):
    """One answer of the webhooks, for operators to see what was decided and why.

    One per claim CREATE: the validating webhook records each decision it makes; the mutating
    one, which the API server calls first, records only its denials (after one the validating
    webhook is never called).
    """

    at = models.DateTimeField(db_index=True)
    uid = models.CharField(max_length=64)
    namespace = models.CharField(max_length=253)
    name = models.CharField(max_length=253)
    username = models.TextField(blank=True)  # see Reservation.username
    # Which webhook decided. A default in the database too: a pod of the previous version,
    # still serving during a rolling update, inserts decisions without it.
    webhook = models.CharField(
        max_length=8,
        choices=Webhook.choices,
        default=Webhook.VALIDATE,
        db_default=Webhook.VALIDATE,
    )
    team = models.ForeignKey(
        Team,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        db_constraint=False,  # see Reservation.team
    )
    allowed = models.BooleanField()
    dry_run = models.BooleanField(default=False)
    message = models.TextField(blank=True)
    warnings = models.JSONField(default=list, blank=True)
    # The cluster whose API server asked (the webhook's TALLY_CLUSTER_NAME), by name as
    # `Reservation.cluster`; empty where unknown: decisions made before it was recorded and
    # not matched to a reservation, or inserted by a pod of the previous version.
    cluster = models.CharField(max_length=63, blank=True, default="", db_default="")
    # The person behind a claim a controller made for someone (`username` a
    # TALLY_WORKLOAD_CONTROLLERS: a Pod's claim from a template, made by the resource-claim
    # controller): the `tally.dev/created-by` the workload webhook wrote on the claim's owners
    # (the Pod, its Job or ReplicaSet), as the webhook read them when it decided
    # (`inventory.owners.claim_creator`), so that a denied claim, which never reaches the
    # inventory, still names its person. Empty where the requester is the person, where
    # nothing named one, where the owners could not be read in time, and for decisions made
    # before it was recorded (or inserted by a pod of the previous version).
    created_by = models.TextField(blank=True, default="", db_default="")

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}: {'allowed' if self.allowed else 'denied'}"


class Budget(models.Model):
    """A team's budget per period in hours of one unit (GPU-hours, TPU chip-hours, Gaudi
    card-hours); `hard` denies new claims of devices of that unit past it.

    Hours of different units never add up, so only the team's hours of `unit` count toward
    it, and claims of devices of another unit are never weighed against it.
    """

    team = models.OneToOneField(Team, on_delete=models.CASCADE, related_name="budget")
    # Hours of `unit`, whatever it is (the name predates units other than GPUs).
    gpu_hours = models.DecimalField(max_digits=14, decimal_places=3)
    mode = models.CharField(max_length=8, choices=[("hard", "hard"), ("soft", "soft")])
    unit = models.CharField(max_length=16, choices=DeviceUnit.choices, default=DeviceUnit.GPU)

    def __str__(self) -> str:
        return f"{self.team}: {self.gpu_hours.normalize():f} {hours_label(self.unit)} ({self.mode})"
