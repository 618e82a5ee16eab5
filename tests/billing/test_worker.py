"""Billing tasks through a real Celery worker and the real Redis broker."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from django.db.models import Sum
from django.utils import timezone

from billing import tasks
from billing.models import Period, RateCard, Statement
from metering.dirty import mark_dirty
from metering.models import UsageHour
from teams.models import Team, TeamNamespace
from tests.billing.test_chargeback import SLICE, T10, claim, load_dump, send_samples

pytestmark = [pytest.mark.redis, pytest.mark.django_db(transaction=True)]


def an_hour_at_25_percent(folder: Path) -> None:
    """The H100 held by team vision's claim for 10:00-11:00, sampled at 25% every minute."""
    team = Team.objects.create(slug="vision", name="Vision")
    TeamNamespace.objects.create(team=team, namespace="vision")
    load_dump(folder, [SLICE, claim("train", "gpu-0", T10)], T10)
    load_dump(folder, [claim("train", "gpu-0", T10, allocated=False)], T10 + timedelta(hours=1))
    send_samples("GPU-H", T10, 60, 25.0)


def test_the_rollup_task_runs_in_a_worker_and_twice_changes_nothing(
    worker: None, tmp_path: Path
) -> None:
    an_hour_at_25_percent(tmp_path)
    assert T10.isoformat() in tasks.rollup_pending.delay().get(timeout=60)
    first = UsageHour.objects.aggregate(Sum("utilised_gpu_ms"))
    assert first["utilised_gpu_ms__sum"] == 900_000  # an hour at 25%
    # Delivered twice, with the hour marked again meanwhile (a late duplicate batch does that).
    mark_dirty(hours={T10}, at=timezone.now())
    assert T10.isoformat() in tasks.rollup_pending.delay().get(timeout=60)
    assert UsageHour.objects.aggregate(Sum("utilised_gpu_ms")) == first
    assert UsageHour.objects.count() == 1


def test_beat_s_rollup_and_period_close_run_in_a_worker(worker: None, tmp_path: Path) -> None:
    RateCard.objects.create(
        product_name="NVIDIA H100 80GB HBM3",
        per_gpu_hour=Decimal("2.50"),
        idle_factor=Decimal("0.4"),
        currency="USD",
        valid_from=date(2026, 1, 1),
    )
    an_hour_at_25_percent(tmp_path)
    # The hours the sync and the samples marked are rolled up (and the hour just ended).
    done = tasks.rollup_pending.delay().get(timeout=60)
    assert T10.isoformat() in done
    assert UsageHour.objects.aggregate(Sum("utilised_gpu_ms"))["utilised_gpu_ms__sum"] == 900_000
    # TALLY_CLOSE_PERIOD_DAY is 3: on the 2nd of November October stays open; on the 3rd it
    # closes, once; the task is idempotent.
    on_the_2nd = datetime(2026, 11, 2, 23, 20, tzinfo=UTC).isoformat()
    on_the_3rd = datetime(2026, 11, 3, 0, 20, tzinfo=UTC).isoformat()
    assert tasks.close_previous_period.delay(on_the_2nd).get(timeout=60) is None
    assert not Period.objects.filter(closed_at__isnull=False).exists()
    assert tasks.close_previous_period.delay(on_the_3rd).get(timeout=60) == "2026-10"
    assert tasks.close_previous_period.delay(on_the_3rd).get(timeout=60) is None
    october = Period.objects.get(start=datetime(2026, 10, 1, tzinfo=UTC))
    assert october.closed_by == "celery beat (TALLY_CLOSE_PERIOD_DAY)"
    (statement,) = Statement.objects.filter(period=october)
    (line,) = statement.lines.all()
    # An hour held, a quarter of it at work, all measured: 0.75 h idle.
    # 2.50 x (1 - 0.6 x 0.75) = 1.375, half-up to 1.38.
    assert (line.allocated_gpu_hours, line.idle_gpu_hours) == (Decimal(1), Decimal("0.75"))
    assert (line.amount, statement.total) == (Decimal("1.38"), Decimal("1.38"))
