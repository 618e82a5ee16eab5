"""`manage.py meter_prometheus [--hour 2026-11-10T09:00Z]`: check the Prometheus metering source.

Reads the settings (`TALLY_METERING_SOURCE`, `TALLY_PROMETHEUS_*`) as the rollup does, asks the
engine for one hour (default: the hour just ended) what the rollup would ask, and prints, per
device held then in a cluster the engine meters, how many readings it gave and over what
span, then the devices it gave none for and the series it could not match to a device (a MIG
instance whose GPU has two of its profile, an AMD GPU on a node the inventory does not know),
and a warning for a cluster it gave no reading of at all (`metering.silence`).
Writes nothing. Exits non-zero on a bad setting or an engine that does not answer.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from inventory.models import Cluster
from metering import prometheus
from metering.hours import HOUR, epoch_ms, hour_at, hour_start
from metering.moments import within_range
from metering.rollup import held_allocations


class Command(BaseCommand):
    help = (
        "Check the Prometheus metering source: its settings, and what the engine answers for "
        "one hour (readings per metered device, devices without any, series not matched)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--hour",
            help="An ISO 8601 instant in the hour to check (default: the hour just ended).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            conf = prometheus.config()
        except ImproperlyConfigured as error:
            raise CommandError(str(error)) from error
        if not conf.used:
            self.stdout.write("TALLY_METERING_SOURCE meters no cluster from Prometheus.")
            return
        if options["hour"]:
            try:
                moment = datetime.fromisoformat(options["hour"].replace("Z", "+00:00"))
            except ValueError as error:
                raise CommandError(f"--hour: {options['hour']!r} is not ISO 8601") from error
            if moment.tzinfo is None:
                raise CommandError("--hour: give a timezone (2026-11-10T09:00Z)")
            try:
                start = hour_start(within_range(moment, options["hour"]))
            except ValueError as error:
                raise CommandError(f"--hour: {error}") from error
        else:
            start = hour_start(timezone.now()) - HOUR
        end = start + HOUR
        try:
            readings = prometheus.window_readings(
                held=held_allocations(start, end), start_ms=epoch_ms(start), end_ms=epoch_ms(end)
            )
        except prometheus.EngineUnavailable as error:
            raise CommandError(f"the engine did not answer: {error}") from error
        self.stdout.write(f"hour {start.isoformat()}:")
        for cluster in Cluster.objects.order_by("name").values_list("name", flat=True):
            if conf.source(cluster) == "prometheus":
                self.stdout.write(f"  cluster {cluster}: asked at {conf.url_for(cluster)}")
        if readings is None:
            self.stdout.write("  no device of a cluster it meters was held then.")
            return
        for meter_id in sorted(readings.metered):
            points = readings.points.get(meter_id, [])
            if points:
                first, last = (_at(points[0][0]), _at(points[-1][0]))
                self.stdout.write(f"  {meter_id}: {len(points)} readings, {first} to {last}")
            else:
                self.stdout.write(f"  {meter_id}: no readings (its hours are unmeasured)")
        for why in sorted(set(readings.unmatched)):
            self.stdout.write(f"  not matched: {why}")
        for found in readings.silences:
            self.stderr.write(f"warning: {found.describe()}")


def _at(ms: int) -> str:
    moment = hour_at(0) + timedelta(milliseconds=ms)
    return moment.astimezone(UTC).strftime("%H:%M:%S")
