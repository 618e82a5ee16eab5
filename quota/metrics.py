"""Quota's metrics read from the database at scrape time (see `core.metrics`)."""

from __future__ import annotations

from collections.abc import Iterator

from django.db.models import Count
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from quota.models import Reservation, ReservationState


class ReservationCollector(Collector):
    """`tally_reservations_outstanding{state}`: reservations not yet released, from the database.

    One `GROUP BY state` over the unreleased rows (the state column is small and the released
    ones are filtered out), run at scrape time.
    """

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "tally_reservations_outstanding",
            "Quota reservations held and not yet released, by state.",
            labels=["state"],
        )
        counts = dict(
            Reservation.objects.exclude(state=ReservationState.RELEASED)
            .values_list("state")
            .annotate(count=Count("pk"))
            .order_by()
            .values_list("state", "count")
        )
        for state in (ReservationState.RESERVED, ReservationState.ALLOCATED):
            family.add_metric([state.value], counts.get(state.value, 0))
        yield family
