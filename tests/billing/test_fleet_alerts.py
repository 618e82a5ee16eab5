"""Stranded-gang and undocumented-version-outlier alerts (issue 20, items 3 and 5), raised and
resolved by the same evaluation as idle claims (billing.alerts)."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.core import mail
from django.test import override_settings
from django.utils import timezone

from billing.alerts import evaluate_alerts, run_alerts
from billing.models import RateCard
from inventory.models import Cluster, Device, Gang, VersionDeviation
from teams.models import Alert, AlertKind
from tests.api.cast import cast
from tests.factories import DeviceFactory, NodeFactory
from tests.inventory.test_stranded import H100, MONDAY, NOW, Week, hold, member_claim, week
from tests.inventory.test_versions import OLD_HOST, PAIR_A, gpus, mixed_fleet

__all__ = ["cast", "mixed_fleet", "week"]

pytestmark = pytest.mark.django_db


def firing(kind: AlertKind) -> dict[str, Alert]:
    return {alert.key: alert for alert in Alert.objects.filter(kind=kind, state="firing")}


def test_stranded_gangs_are_alerted_to_their_teams_leads_and_resolve_when_whole(
    week: Week,
) -> None:
    RateCard.objects.create(
        product_name=H100, per_gpu_hour=Decimal("2.50"), currency="EUR", valid_from=MONDAY.date()
    )
    week.cast.lead_a.email = "la@example.com"
    week.cast.lead_a.save()

    run = run_alerts(now=NOW)

    alerts = firing(AlertKind.STRANDED_GANG)
    assert sorted(alerts) == ["week/alpha/JobSet/train", "week/beta/JobSet/small"]
    train = alerts["week/alpha/JobSet/train"]
    assert (train.team, train.recipients) == (week.cast.alpha, ["la"])
    assert train.subject == "Stranded gang alpha/JobSet/train: 1 of 2 members hold 8 GPUs"
    assert "1 hold 8 devices (8 GPUs) while 1 wait or are missing" in train.description
    assert "since 2026-11-23 00:00 UTC (168 h 0 min)" in train.description
    assert "Held so far: 1344 GPU-hours, 3360.00 EUR at list price." in train.description
    assert train.labels == {
        "cluster": "week",
        "namespace": "alpha",
        "gang": "JobSet/train",
        "source": "jobset",
        "unit": "gpu",
    }
    assert alerts["week/beta/JobSet/small"].recipients == ["lb"]
    assert run.summary()["stranded_gang"] == {"raised": 2, "firing": 2, "resolved": 0}
    assert [m.to for m in mail.outbox] == [["la@example.com"]]  # lb has no address

    # Worker 1 of `train` starts: the gang is whole, its alert resolves; `small` stays, and
    # `blip`, partial for 30 minutes by now, is stranded too.
    later = NOW + timedelta(minutes=10)
    worker1 = member_claim(Gang.objects.get(key="JobSet/train"), "train-1")
    node = week.gpus[0].node
    for _ in range(8):
        hold(worker1, DeviceFactory.create(node=node), NOW + timedelta(minutes=5))
    evaluate_alerts(now=later)
    assert sorted(firing(AlertKind.STRANDED_GANG)) == [
        "week/alpha/JobSet/blip",
        "week/beta/JobSet/small",
    ]
    train.refresh_from_db()
    assert (train.state, train.resolved_at) == ("resolved", later)


@override_settings(TALLY_OPERATOR_EMAILS=["gpu-oncall@example.com"])
def test_an_undocumented_outlier_node_is_alerted_until_documented_and_again_once_expired(
    mixed_fleet: Cluster,
) -> None:
    gpus(NodeFactory.create(cluster=mixed_fleet, name="dgx-canary"), 8, OLD_HOST)
    now = timezone.now()

    run_alerts(now=now)

    [alert] = firing(AlertKind.VERSION_OUTLIER).values()
    assert (alert.key, alert.team, alert.recipients) == (
        "prod/dgx-canary",
        None,
        ["gpu-oncall@example.com"],
    )
    assert alert.subject == (
        "Undocumented driver version on prod/dgx-canary: driver 570.172.8, CUDA 12.8.0"
    )
    assert (
        "- 8 NVIDIA H100 80GB HBM3 on driver 570.172.8, CUDA 12.8.0 (baseline driver 580.82.7, "
        "CUDA 13.0.0" in alert.description
    )
    [message] = mail.outbox
    assert message.to == ["gpu-oncall@example.com"]

    # Documented: resolved.
    expires = now + timedelta(days=14)
    VersionDeviation.objects.create(
        cluster=mixed_fleet,
        node_name="dgx-canary",
        driver_version=OLD_HOST[0],
        reason="canary for the 570 branch",
        owner="gpu-platform",
        expires_at=expires,
    )
    evaluate_alerts(now=now + timedelta(minutes=5))
    assert firing(AlertKind.VERSION_OUTLIER) == {}
    alert.refresh_from_db()
    assert alert.state == "resolved"

    # The deviation expires: the node is an outlier again, a new alert.
    evaluate_alerts(now=expires + timedelta(seconds=1))
    [again] = firing(AlertKind.VERSION_OUTLIER).values()
    assert again.key == "prod/dgx-canary" and again.pk != alert.pk

    # Fixed (upgraded to the baseline): resolved.
    Device.objects.filter(node__name="dgx-canary").update(
        driver_version=PAIR_A[0], cuda_driver_version=PAIR_A[1]
    )
    evaluate_alerts(now=expires + timedelta(minutes=5))
    assert firing(AlertKind.VERSION_OUTLIER) == {}
