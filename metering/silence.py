"""Metering engines that answer with nothing: not believed at once, never in silence.

A Prometheus-compatible engine that answers "success" with no series (a selector that matches
nothing after a relabelling, a tenant header pointing at an empty tenant, a remote write that
stopped) looks like every device idle-less and unmeasured: the rollup would bill each hour at
full price as unmeasured and nothing would say why. So a window in which the engine gave no
reading of any device a cluster held is a silence:

- while its hours ended less than TALLY_PROMETHEUS_SILENCE_GRACE_SECONDS ago, the cluster's
  hours are held back as for an engine that did not answer (`EngineSilent`): left as they
  were, marked, and asked again by the next runs;
- after that, they are billed unmeasured, as the engine said;
- either way each run that finds it logs a warning, counts its hours
  (`tally_metering_silent_hours{cluster, outcome}`) and raises an operator alert (one per
  cluster, kind `metering_silent`) which resolves once no run has found the cluster silent
  for an hour (`silence_alerts`, evaluated by beat with the other alerts).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings

from core import metrics
from metering.hours import MS_PER_HOUR, epoch_ms, hour_at
from teams.alerts import RaisedAlert, SyncReport, operator_recipients, raise_alert, resolve_missing
from teams.models import Alert, AlertKind, AlertState

log = logging.getLogger(__name__)

# How long a silence alert stays firing after the last run that found the cluster silent.
ALERT_FRESH = timedelta(hours=1)


@dataclass(frozen=True)
class Silence:
    """A window `[start_ms, end_ms)` in which the engine at `url` answered with no reading of
    any of the `devices` meter ids `cluster` held; `pending` while within the grace."""

    cluster: str
    url: str
    devices: int
    start_ms: int
    end_ms: int
    pending: bool

    @property
    def hours(self) -> int:
        return (self.end_ms - 1) // MS_PER_HOUR - self.start_ms // MS_PER_HOUR + 1

    def describe(self) -> str:
        start = hour_at(self.start_ms // MS_PER_HOUR)
        outcome = (
            "its hours stay pending and are asked again (TALLY_PROMETHEUS_SILENCE_GRACE_SECONDS)"
            if self.pending
            else "past the grace (TALLY_PROMETHEUS_SILENCE_GRACE_SECONDS): billed unmeasured"
        )
        return (
            f"cluster {self.cluster}: {self.url} answered with no reading of any of the "
            f"{self.devices} device(s) held in {self.hours} hour(s) from "
            f"{start:%Y-%m-%d %H:%M} UTC; {outcome}"
        )


def silence(
    *, cluster: str, url: str, devices: int, start_ms: int, end_ms: int, now: datetime | None
) -> Silence:
    """The silence of `cluster` in the window, pending while the window ended within the grace
    of `now` (never, without a `now`: a check that bills nothing)."""
    grace_ms = settings.TALLY_PROMETHEUS_SILENCE_GRACE_SECONDS * 1000
    pending = now is not None and end_ms > epoch_ms(now) - grace_ms
    return Silence(
        cluster=cluster,
        url=url,
        devices=devices,
        start_ms=start_ms,
        end_ms=end_ms,
        pending=pending,
    )


def report(silences: list[Silence], *, now: datetime) -> None:
    """Warn of each silence, count its hours and raise (or refresh) its cluster's alert."""
    if not silences:
        return
    recipients = tuple(operator_recipients())
    for found in silences:
        log.warning("metering: %s", found.describe())
        outcome = "pending" if found.pending else "unmeasured"
        metrics.METERING_SILENT_HOURS.labels(cluster=found.cluster, outcome=outcome).inc(
            found.hours
        )
        raise_alert(
            spec=RaisedAlert(
                kind=AlertKind.METERING_SILENT,
                key=found.cluster,
                subject=f"Metering engine has no data for cluster {found.cluster}",
                description=found.describe(),
                labels={"cluster": found.cluster, "outcome": outcome},
                recipients=recipients,
            ),
            now=now,
        )


def silence_alerts(*, now: datetime) -> SyncReport:
    """Resolve the silence alerts no run has refreshed for `ALERT_FRESH` (the rollup raises
    them as it finds silences); the others stay firing."""
    firing = Alert.objects.filter(kind=AlertKind.METERING_SILENT, state=AlertState.FIRING)
    live = list(firing.filter(last_seen__gte=now - ALERT_FRESH))
    resolved = resolve_missing(
        kind=AlertKind.METERING_SILENT, live_keys={alert.key for alert in live}, now=now
    )
    return SyncReport(raised=[], ongoing=live, resolved=resolved)
