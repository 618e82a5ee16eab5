"""Rate cards, periods, statements, their late-data marks and week reports: what usage costs.

The usage they price (samples, `UsageHour`) is metering's (`metering.models`). Hours are
Decimal hours of GPU time; money is Decimal, rounded once per statement line.
"""

from __future__ import annotations

from django.db import models
from django.db.models import Q

from billing.periods import period_label
from billing.units import hours_label
from inventory.models import SHARE_DIGITS, SHARE_PLACES, Unit
from teams.models import Team

# What a rate is the price of: a GPU-hour, or an hour of one MIG slice (a profile's own card).
GPU_HOUR, SLICE_HOUR = "GPU-hour", "slice-hour"


def unit_hour(unit: str) -> str:
    """One hour of one `unit` (`inventory.models.Unit`), as rates name it: `GPU-hour`,
    `TPU chip-hour`, `Gaudi card-hour`, `accelerator-hour`."""
    return hours_label(unit).removesuffix("s")


class RateCard(models.Model):
    """A price per GPU-hour for a model from a date on; or, with a MIG profile, the price of an
    hour of one slice of that profile (without one, a slice pays its share of its GPU's)."""

    product_name = models.CharField(max_length=253)
    profile = models.CharField(max_length=64, blank=True)  # empty: whole GPUs, and MIG by share
    per_gpu_hour = models.DecimalField(max_digits=12, decimal_places=4)
    idle_factor = models.DecimalField(max_digits=5, decimal_places=4, default=1)
    currency = models.CharField(max_length=3)
    valid_from = models.DateField()
    valid_until = models.DateField(null=True, blank=True)  # exclusive

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["product_name", "profile", "currency", "valid_from"], name="ratecard_unique"
            ),
            models.CheckConstraint(
                condition=Q(idle_factor__gte=0) & Q(idle_factor__lte=1), name="ratecard_idle_factor"
            ),
        ]

    def __str__(self) -> str:
        return self.describe(Unit.GPU)

    def describe(self, unit: str) -> str:
        """The card with its price per hour of `unit`, the unit of its model's devices
        (`TPU chip-hour`), or per slice-hour for a profile's card. `str()` cannot look the
        unit up and names a GPU-hour."""
        model = f"{self.product_name} {self.profile}".strip()
        per = SLICE_HOUR if self.profile else unit_hour(unit)
        return f"{model}: {self.per_gpu_hour} {self.currency}/{per} from {self.valid_from}"

    @property
    def rate_unit(self) -> str:
        """An hour of one slice for a MIG profile's card; else a GPU-hour (a MIG device without
        its profile's card pays its share of its GPU's price)."""
        return SLICE_HOUR if self.profile else GPU_HOUR


class Period(models.Model):
    """A billing period `[start, end)`; closing it freezes its statements."""

    start = models.DateTimeField(unique=True)
    end = models.DateTimeField()
    closed_at = models.DateTimeField(null=True, blank=True)
    closed_by = models.CharField(max_length=253, blank=True)

    def __str__(self) -> str:
        return f"{self.start:%Y-%m-%d}..{self.end:%Y-%m-%d}"

    @property
    def is_closed(self) -> bool:
        return self.closed_at is not None

    @property
    def label(self) -> str:
        """How people and the commands name it: `2026-11`, `2026-W47` (`period_label`)."""
        return period_label(self.start, self.end)


class UsageChange(models.Model):
    """An hour whose usage rows were written (inserted, changed or deleted) since the
    statements that count them were last frozen: the "late data since close" mark of the
    period that holds it. `version` is a number from a sequence, never given twice: raised by
    every write of the hour's rows.

    Written by the database itself, in the transaction that writes the usage rows (the
    triggers of migration 0009 on `billing_usagehour`), so no writer can change a closed
    period's usage without marking it, whatever its path. A refresh reads a closed period's
    usage only while the period holds marks; the close of the open period that billed the
    adjustments for them deletes the marks it read, each only if its `version` is still the
    one read, so a mark made meanwhile survives (`billing.late_data`).
    """

    hour = models.DateTimeField(primary_key=True)
    version = models.BigIntegerField()

    def __str__(self) -> str:
        return f"{self.hour:%Y-%m-%d %H:00} (v{self.version})"


# Money as stored: three digits after the point hold every currency's minor unit (the dinars'
# fils are thousandths; most are cents, the yen none), amounts being rounded to it first.
MONEY_DIGITS, MONEY_PLACES = 17, 3


class Statement(models.Model):
    """What a team owes for a period, per currency. Frozen once the period is closed."""

    team = models.ForeignKey(Team, on_delete=models.PROTECT, related_name="statements")
    period = models.ForeignKey(Period, on_delete=models.PROTECT, related_name="statements")
    currency = models.CharField(max_length=3)
    total = models.DecimalField(max_digits=MONEY_DIGITS, decimal_places=MONEY_PLACES, default=0)
    computed_at = models.DateTimeField()
    # The total as of `baseline_at`, at most an hour before the last refresh: what a refresh's
    # total is compared with to see a jump (`billing.shock`). Null: not refreshed yet.
    baseline_total = models.DecimalField(
        max_digits=MONEY_DIGITS, decimal_places=MONEY_PLACES, default=0
    )
    baseline_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["team", "period", "currency"], name="statement_unique"),
        ]

    def __str__(self) -> str:
        # The admin's title: the total, rounded for people, is on the page itself.
        return f"{self.team} {self.period} ({self.currency})"


class LineKind(models.TextChoices):
    USAGE = "usage", "usage"
    ADJUSTMENT = "adjustment", "adjustment"


class StatementLine(models.Model):
    """One model's usage and charge; or an adjustment (late data, or added by finance).

    Hours are hours of `unit` (GPU-hours, TPU chip-hours, Gaudi card-hours; the columns say
    `gpu`), and `rate` the price of one such hour. `gpu_share` is set on a line priced by a
    MIG profile's own rate card, whose rate is the price of an hour of one slice: the slice's
    share of its GPU, so that amount = rate x (allocated - (1 - idle_factor) x idle) /
    gpu_share.
    """

    statement = models.ForeignKey(Statement, on_delete=models.CASCADE, related_name="lines")
    kind = models.CharField(max_length=16, choices=LineKind.choices, default=LineKind.USAGE)
    product_name = models.CharField(max_length=253)
    profile = models.CharField(max_length=64, blank=True)
    unit = models.CharField(max_length=16, choices=Unit.choices, default=Unit.GPU)
    allocated_gpu_hours = models.DecimalField(max_digits=16, decimal_places=6)
    utilised_gpu_hours = models.DecimalField(max_digits=16, decimal_places=6)
    idle_gpu_hours = models.DecimalField(max_digits=16, decimal_places=6)
    unmeasured_gpu_hours = models.DecimalField(max_digits=16, decimal_places=6)
    rate = models.DecimalField(max_digits=12, decimal_places=4, null=True, blank=True)
    idle_factor = models.DecimalField(max_digits=5, decimal_places=4, null=True, blank=True)
    gpu_share = models.DecimalField(
        max_digits=SHARE_DIGITS, decimal_places=SHARE_PLACES, null=True, blank=True
    )
    amount = models.DecimalField(max_digits=MONEY_DIGITS, decimal_places=MONEY_PLACES)
    # Adjustments: the closed period they correct (or none, for finance's own), and why.
    corrects_period = models.ForeignKey(
        Period, on_delete=models.PROTECT, null=True, blank=True, related_name="corrections"
    )
    reason = models.TextField(blank=True)
    created_by = models.CharField(max_length=253, blank=True)

    def __str__(self) -> str:
        return f"{self.statement}: {self.kind} {self.product_name}".rstrip()

    @property
    def rate_unit(self) -> str:
        """What `rate` is the price of: an hour of one slice when `gpu_share` is set, else an
        hour of the line's unit (`GPU-hour`, `TPU chip-hour`, `Gaudi card-hour`)."""
        return SLICE_HOUR if self.gpu_share else unit_hour(self.unit)

    @property
    def hours_label(self) -> str:
        """What the line's hours are: `GPU-hours`, `TPU chip-hours`, `Gaudi card-hours`."""
        return hours_label(self.unit)


class WeekReport(models.Model):
    """A team's week report emailed to its leads, once: the row is inserted (one per team and
    week, by the constraint) and locked before the email goes, and marked sent in the same
    transaction, so a beat run twice or two racing workers send it once
    (`billing.week_mail.send_week_report`)."""

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="week_reports")
    week_start = models.DateTimeField()
    sent_at = models.DateTimeField(null=True, blank=True)
    recipients = models.JSONField(default=list, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["team", "week_start"], name="weekreport_unique"),
        ]

    def __str__(self) -> str:
        return f"{self.team} week of {self.week_start:%Y-%m-%d}"
