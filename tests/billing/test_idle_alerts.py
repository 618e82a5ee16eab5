"""Idle-claim alerts (issue 19, item 5): from samples through the rollup to an alert to the
claim's user and the team's leads; deduplicated, resolved when the claim computes again or is
released; unmeasured and missing hours never idle; the idle GPU-hours metric."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
import time_machine
from django.conf import settings
from django.core import mail
from django.db import connection
from django.test import override_settings
from prometheus_client import CollectorRegistry, generate_latest

from billing.alerts import evaluate_alerts, run_alerts
from billing.idle import IdleCollector, idle_claims
from billing.models import RateCard
from billing.tasks import evaluate_alerts as evaluate_alerts_task
from inventory.models import Allocation, Cluster, Device
from metering import ingest, rollup
from metering.hours import MS_PER_HOUR, epoch_ms
from metering.ingest import SampleRow
from metering.models import UsageHour
from teams.models import Alert, AlertDelivery, AlertKind, IdleAlertPolicy, Team
from tests.api.cast import Cast, cast
from tests.factories import (
    AllocationFactory,
    ClusterFactory,
    DeviceFactory,
    ResourceClaimFactory,
    owner_of,
)

__all__ = ["cast"]

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 11, 30, 6, 0, tzinfo=UTC)
H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture
def cluster() -> Cluster:
    return ClusterFactory.create(name="prod")


@pytest.fixture
def alpha(cast: Cast) -> Team:
    """Alpha alerts below 5% for 4 hours; its lead and member have addresses."""
    IdleAlertPolicy.objects.create(team=cast.alpha, below_percent=Decimal(5), for_hours=4)
    for user, address in ((cast.lead_a, "la@example.com"), (cast.member_a, "ma@example.com")):
        user.email = address
        user.save()
    return cast.alpha


def claim_holding(
    cluster: Cluster, team: Team, name: str, gpus: int, *, user: str = "ma", start: datetime = T0
) -> list[Allocation]:
    claim = ResourceClaimFactory.create(cluster=cluster, namespace=team.slug, name=name)
    return [
        AllocationFactory.create(
            claim=claim,
            device=DeviceFactory.create(node__cluster=cluster, product_name=H100),
            cluster=cluster,
            start=start,
            team=team,
            username=user,
            job=f"Job/{name}",
        )
        for _ in range(gpus)
    ]


def samples(devices: list[Device], start: datetime, hours: int, util: float) -> None:
    """A sample a minute of each device, at `util` percent, as the agents send them."""
    rows = [
        SampleRow(device.uuid, epoch_ms(start) + minute * 60_000, util, None, None)
        for device in devices
        for minute in range(hours * 60)
    ]
    ingest.ingest(node="node-a", samples=rows, received_at=start)


def roll(start: datetime, hours: int) -> None:
    rollup.rollup_hours(
        hours=[start + timedelta(hours=h) for h in range(hours)],
        now=start + timedelta(hours=hours, minutes=5),
    )


def devices_of(allocations: list[Allocation]) -> list[Device]:
    return [a.device for a in allocations if a.device is not None]


def test_a_claim_idle_for_the_teams_hours_is_alerted_once_then_resolved_when_it_computes(
    cast: Cast, alpha: Team, cluster: Cluster
) -> None:
    idle = claim_holding(cluster, alpha, "notebook-gpu", 2)
    busy = claim_holding(cluster, alpha, "train-gpu", 1)
    # Beta sets no idle alert: its idle claim is nobody's alert.
    beta_idle = claim_holding(cluster, cast.beta, "beta-gpu", 1, user="lb")
    RateCard.objects.create(
        product_name=H100,
        per_gpu_hour=Decimal("2.50"),
        idle_factor=Decimal("0.4"),
        currency="USD",
        valid_from=T0.date(),
    )
    samples(devices_of(idle), T0, 5, 1.0)
    samples(devices_of(busy), T0, 5, 80.0)
    samples(devices_of(beta_idle), T0, 5, 0.0)
    roll(T0, 5)
    now = T0 + timedelta(hours=5, minutes=10)

    run = run_alerts(now=now)

    [alert] = Alert.objects.all()
    assert alert.kind == AlertKind.IDLE_CLAIM
    claim = idle[0].claim
    assert alert.key == f"prod/alpha/notebook-gpu/{claim.uid}"
    assert alert.team == alpha
    assert alert.recipients == ["ma", "la"]
    assert alert.subject == "Idle claim alpha/notebook-gpu: 2 GPUs under 5% for 4 h"
    assert alert.labels == {
        "cluster": "prod",
        "namespace": "alpha",
        "claim": "notebook-gpu",
        "job": "Job/notebook-gpu",
        "user": "ma",
        "unit": "gpu",
    }
    # The last 4 rolled-up hours (07:00 to 11:00): 8 GPU-hours held, 1% used.
    assert "used 1.00% of them from 2026-11-30 07:00 to 2026-11-30 11:00 UTC" in alert.description
    # Idle hours are billed at the idle factor: 7.92 x 2.50 x 0.4.
    assert "7.92 idle GPU-hours, billed 7.92 USD." in alert.description
    assert run.summary()["idle_claim"] == {"raised": 1, "firing": 1, "resolved": 0}
    [message] = mail.outbox
    assert message.to == ["la@example.com", "ma@example.com"]
    assert (
        message.subject == "[Tally] FIRING: Idle claim alpha/notebook-gpu: 2 GPUs under 5% for 4 h"
    )
    assert "User: ma. Job: Job/notebook-gpu." in message.body

    # Evaluated again (beat every few minutes): the same alert, nothing sent again.
    again = run_alerts(now=now + timedelta(minutes=5))
    assert again.summary()["idle_claim"] == {"raised": 0, "firing": 1, "resolved": 0}
    assert Alert.objects.count() == 1 and len(mail.outbox) == 1

    # It computes in the next hour: resolved, and the resolution mailed once.
    samples(devices_of(idle), T0 + timedelta(hours=5), 1, 90.0)
    roll(T0 + timedelta(hours=5), 1)
    later = run_alerts(now=T0 + timedelta(hours=6, minutes=10))
    assert later.summary()["idle_claim"] == {"raised": 0, "firing": 0, "resolved": 1}
    alert.refresh_from_db()
    assert (alert.state, alert.resolved_at) == ("resolved", T0 + timedelta(hours=6, minutes=10))
    assert [m.subject.split(":")[0] for m in mail.outbox] == ["[Tally] FIRING", "[Tally] RESOLVED"]
    run_alerts(now=T0 + timedelta(hours=6, minutes=15))
    assert len(mail.outbox) == 2


def usage(
    allocation: Allocation, hour: datetime, *, utilised: float, unmeasured: float = 0
) -> None:
    """A usage row as the rollup writes it: `utilised` and `unmeasured` as shares of the hour."""
    UsageHour.objects.create(
        hour=hour,
        allocation=allocation,
        cluster=allocation.cluster,
        device_uuid=allocation.meter_id,
        product_name=H100,
        gpu_share=Decimal(1),
        unit="gpu",
        namespace=allocation.claim.namespace,
        claim_name=allocation.claim.name,
        team=owner_of(allocation),
        job=allocation.job,
        username=allocation.username,
        allocated_gpu_ms=MS_PER_HOUR,
        utilised_gpu_ms=round(MS_PER_HOUR * utilised),
        unmeasured_gpu_ms=round(MS_PER_HOUR * unmeasured),
    )


def hours_of(allocation: Allocation, shares: list[tuple[float, float]]) -> None:
    for index, (utilised, unmeasured) in enumerate(shares):
        usage(allocation, T0 + timedelta(hours=index), utilised=utilised, unmeasured=unmeasured)


NOW = T0 + timedelta(hours=4, minutes=30)  # rolled up to 10:00: the window is 06:00-10:00


def idle_names() -> list[str]:
    return [claim.claim_name for claim in idle_claims(now=NOW)]


def test_only_hours_measured_idle_below_the_threshold_count(alpha: Team, cluster: Cluster) -> None:
    cases: dict[str, list[tuple[float, float]]] = {
        "just-under": [(0.0499, 0)] * 4,
        "at-threshold": [(0.05, 0)] * 4,  # not under 5%
        "one-busy-hour": [(0.01, 0), (0.01, 0), (0.5, 0), (0.01, 0)],
        # Unmeasured time is not known idle: 0% measured of a half-measured hour is 50% busy.
        "unmeasured": [(0.0, 0.5)] * 4,
        "all-dark": [(0.0, 1.0)] * 4,
        "dark-edge": [(0.0, 0.04)] * 4,  # 4% unmeasured, nothing used: still under 5%
        "too-short": [(0.0, 0)] * 3,  # held 3 of the 4 hours
    }
    for name, shares in cases.items():
        (allocation,) = claim_holding(cluster, alpha, name, 1)
        hours_of(allocation, shares)
    # A missing hour (not rolled up, or not held) is never idle either.
    (gap,) = claim_holding(cluster, alpha, "gap", 1)
    for index in (0, 1, 3):
        usage(gap, T0 + timedelta(hours=index), utilised=0.0)
    # Rolled up to 10:00 (the hour before now's, 10:00-11:00, is not rolled up yet).

    assert idle_names() == ["dark-edge", "just-under"]


def test_a_released_claim_and_a_team_without_a_policy_resolve(
    cast: Cast, alpha: Team, cluster: Cluster
) -> None:
    (allocation,) = claim_holding(cluster, alpha, "idle-gpu", 1)
    hours_of(allocation, [(0.0, 0)] * 4)
    evaluate_alerts(now=NOW)
    assert Alert.objects.filter(state="firing").count() == 1

    Allocation.objects.filter(pk=allocation.pk).update(end=NOW)
    evaluate_alerts(now=NOW + timedelta(minutes=5))
    assert Alert.objects.get().state == "resolved"

    (second,) = claim_holding(cluster, alpha, "idle-2-gpu", 1)
    hours_of(second, [(0.0, 0)] * 4)
    evaluate_alerts(now=NOW + timedelta(minutes=10))
    assert Alert.objects.filter(state="firing").count() == 1
    IdleAlertPolicy.objects.filter(team=alpha).delete()
    evaluate_alerts(now=NOW + timedelta(minutes=15))
    assert not Alert.objects.filter(state="firing").exists()


def test_each_team_uses_its_own_window(cast: Cast, alpha: Team, cluster: Cluster) -> None:
    IdleAlertPolicy.objects.create(team=cast.beta, below_percent=Decimal("50"), for_hours=2)
    (alpha_claim,) = claim_holding(cluster, alpha, "a-gpu", 1)
    (beta_claim,) = claim_holding(cluster, cast.beta, "b-gpu", 1, user="lb")
    # 30% used: idle by beta's 50%, not by alpha's 5%; beta's only for its last 2 hours.
    hours_of(alpha_claim, [(0.3, 0)] * 4)
    hours_of(beta_claim, [(0.9, 0), (0.9, 0), (0.3, 0), (0.3, 0)])

    [found] = idle_claims(now=NOW)

    assert (found.claim_name, found.since, found.until) == (
        "b-gpu",
        T0 + timedelta(hours=2),
        T0 + timedelta(hours=4),
    )
    assert (found.utilised_percent, found.idle_unit_hours) == (Decimal("30.00"), Decimal("1.4"))
    assert found.usernames == ("lb",)


def test_no_usage_rolled_up_means_no_idle_claims(alpha: Team, cluster: Cluster) -> None:
    claim_holding(cluster, alpha, "new-gpu", 1)
    assert idle_claims(now=NOW) == []


@override_settings(TALLY_ALERT_WEBHOOK_URLS=[])
def test_the_metric_counts_idle_gpu_hours_per_team_over_the_last_day(
    cast: Cast, alpha: Team, cluster: Cluster
) -> None:
    (a,) = claim_holding(cluster, alpha, "a-gpu", 1)
    (b,) = claim_holding(cluster, cast.beta, "b-gpu", 1, user="lb")
    hours_of(a, [(0.25, 0.25)] * 4)  # half of each hour idle: 2 GPU-hours
    hours_of(b, [(1.0, 0)] * 4)  # none
    # Older than the last 24 rolled-up hours: not counted.
    usage(a, T0 - timedelta(days=2), utilised=0.0)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(IdleCollector(clock=lambda: NOW))

    text = generate_latest(registry).decode()

    assert 'tally_idle_unit_hours{team="alpha",unit="gpu"} 2.0' in text
    assert 'tally_idle_unit_hours{team="beta",unit="gpu"} 0.0' in text


def test_beat_runs_the_evaluation_as_a_task(alpha: Team, cluster: Cluster) -> None:
    (allocation,) = claim_holding(cluster, alpha, "idle-gpu", 1)
    now = datetime.now(UTC)
    hour = now.replace(minute=0, second=0, microsecond=0)
    for index in range(1, 5):
        usage(allocation, hour - timedelta(hours=index), utilised=0.0)

    # The task reads the clock itself: frozen at `now`, so that an hour boundary passed after
    # `hour` was taken cannot move the four idle hours out of the task's last four.
    with time_machine.travel(now, tick=False):
        result = evaluate_alerts_task.apply().get()

    assert json.loads(json.dumps(result)) == {
        "idle_claim": {"raised": 1, "firing": 1, "resolved": 0},
        "stranded_gang": {"raised": 0, "firing": 0, "resolved": 0},
        "version_outlier": {"raised": 0, "firing": 0, "resolved": 0},
        "metering_silent": {"raised": 0, "firing": 0, "resolved": 0},
        "sent": 1,
        "retrying": 0,
        "failed": 0,
    }
    assert settings.CELERY_BEAT_SCHEDULE["alerts-evaluate"]["task"] == (
        "billing.tasks.evaluate_alerts"
    )


def in_threads(count: int, work: Callable[[], object]) -> list[BaseException]:
    """Run `work` in `count` threads started together, each on its own connection; errors."""
    start = threading.Barrier(count)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            start.wait(timeout=10)
            work()
        except BaseException as exc:  # reported by the caller
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return errors


@pytest.mark.django_db(transaction=True)
def test_concurrent_evaluations_raise_each_idle_claim_once() -> None:
    team = Team.objects.create(slug="race", name="Race")
    IdleAlertPolicy.objects.create(team=team, below_percent=Decimal(5), for_hours=4)
    cluster = ClusterFactory.create(name="prod")
    for index in range(6):
        (allocation,) = claim_holding(cluster, team, f"idle-{index}", 1)
        hours_of(allocation, [(0.0, 0)] * 4)

    errors = in_threads(4, lambda: evaluate_alerts(now=NOW))

    assert not errors
    assert Alert.objects.filter(state="firing").count() == 6
    assert Alert.objects.count() == 6
    assert AlertDelivery.objects.count() == 6  # one email each, planned once
