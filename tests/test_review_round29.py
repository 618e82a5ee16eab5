"""Review round 29: defects found in what the last two sessions changed, each shown by a test
that failed until it was mended, through the real views (the portal, `/ingest/samples`) and
settings checks.

- An agent token records GPU instances (`MigInstance`) under any parent GPU it names, so the
  Prometheus source sends another cluster's DCGM MIG readings to the token's device.
- A snooze lifted, or set, by a team's lead reaches the alerts another team now has under the
  same key (a namespace moved between teams): a write on the other team's alert.
- TALLY_PROMETHEUS_URLS with a space or control character passes the settings check, and the
  rollup then fails on `http.client.InvalidURL`, not a startup error naming the variable.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client, override_settings
from django.urls import reverse
from django.utils import timezone

from inventory.models import Device
from metering import prometheus
from metering.hours import epoch_ms
from metering.models import MigInstance
from metering.services import issue_agent_token
from teams.alerts import RaisedAlert, raise_alert
from teams.models import Alert, AlertKind, AlertState
from tests.api.cast import Cast, cast
from tests.factories import ClusterFactory, DeviceFactory, MigDeviceFactory, NodeFactory

__all__ = ["cast"]

T0 = (timezone.now() - timedelta(days=1)).replace(minute=0, second=0, microsecond=0)
A100 = "NVIDIA A100-SXM4-40GB"


# --- GPU instances recorded under a parent GPU the device does not belong to -----------------


def _a100_with_one_slice(cluster: str, node: str) -> tuple[Device, Device]:
    """An A100 on `node` of `cluster` and its 1g.5gb MIG device."""
    host = NodeFactory.create(cluster=ClusterFactory.create(name=cluster), name=node)
    gpu = DeviceFactory.create(node=host, name="gpu-0", product_name=A100)
    mig = MigDeviceFactory.create(parent=gpu, name="gpu-0-mig-1g5gb-19-0", profile="1g.5gb")
    return gpu, mig


@pytest.mark.django_db
def test_an_agent_token_cannot_claim_another_clusters_gpu_instance() -> None:
    _, own = _a100_with_one_slice("cluster-a", "a-node")
    their_gpu, theirs = _a100_with_one_slice("cluster-b", "b-node")
    token = issue_agent_token(cluster=own.cluster, node="a-node", actor="ops")
    # The token's own, known MIG device, sent as GPU instance 9 of cluster B's A100.
    samples = [
        {
            "uuid": own.meter_id,
            "ts": (T0 + timedelta(minutes=minute)).isoformat(),
            "gpu_util": 1.0,
            "parent_uuid": their_gpu.uuid,
            "gpu_instance_id": 9,
        }
        for minute in range(60)
    ]
    response = Client().post(
        "/ingest/samples",
        data=json.dumps({"node": "a-node", "samples": samples}),
        content_type="application/json",
        headers={"Authorization": f"Bearer {token}"},
    )
    assert response.status_code == 200, response.content

    # Cluster B's engine: its A100's GPU instance 9 (the 1g.5gb slice), read at 10:30.
    start, end = epoch_ms(T0), epoch_ms(T0 + timedelta(hours=1))
    identities = prometheus._identities(Device.objects.filter(pk=theirs.pk), start, end)
    [dcgm] = [exporter for exporter in prometheus.config().exporters if exporter.name == "dcgm"]
    series = prometheus.Series(
        labels={"UUID": their_gpu.uuid, "GPU_I_ID": "9", "GPU_I_PROFILE": "1g.5gb"},
        points=[(start + 30 * 60_000, 50.0)],
    )
    [meter], _ = prometheus.match_series(dcgm, [series], identities, start)
    assert meter is not None
    reading_goes_to = meter if isinstance(meter, str) else meter.meter_at(start + 30 * 60_000)
    assert reading_goes_to == theirs.meter_id  # today: own.meter_id, cluster A's device
    assert not MigInstance.objects.filter(parent_uuid=their_gpu.uuid).exists()


# --- Snoozes reach another team's alerts of the same key --------------------------------------

KEY = "prod/shared-ns/train-0/uid-1"


def _idle_alert(team: Any, state: str, **fields: Any) -> Alert:
    now = timezone.now()
    return Alert.objects.create(
        kind=AlertKind.IDLE_CLAIM,
        key=KEY,
        team=team,
        subject="Idle claim shared-ns/train-0",
        state=state,
        first_seen=now - timedelta(days=2),
        last_seen=now - timedelta(days=1) if state == AlertState.RESOLVED else now,
        resolved_at=now - timedelta(days=1) if state == AlertState.RESOLVED else None,
        **fields,
    )


def _lead(cast: Cast, who: str) -> Client:
    client = Client()
    client.force_login(getattr(cast, who))
    return client


@pytest.mark.django_db
def test_a_lead_lifting_their_alert_leaves_another_teams_snooze(cast: Cast) -> None:
    # The claim's namespace was alpha's (the resolved alert), then moved to beta, where the
    # claim went idle again and beta's lead snoozed it for a day.
    old = _idle_alert(cast.alpha, AlertState.RESOLVED)
    until = timezone.now() + timedelta(hours=24)
    theirs = _idle_alert(cast.beta, AlertState.FIRING, snoozed_until=until, snoozed_by="lb")
    response = _lead(cast, "lead_a").post(
        reverse("alert-snooze", args=["alpha", old.pk]), {"hours": "0"}
    )
    assert response.status_code == 302
    theirs.refresh_from_db()
    assert (theirs.snoozed_until, theirs.snoozed_by) == (until, "lb")


@pytest.mark.django_db
def test_a_snooze_set_by_one_team_does_not_silence_another_teams_alert(cast: Cast) -> None:
    old = _idle_alert(cast.alpha, AlertState.RESOLVED)
    response = _lead(cast, "lead_a").post(
        reverse("alert-snooze", args=["alpha", old.pk]), {"hours": "168"}
    )
    assert response.status_code == 302
    # The namespace is beta's now; the claim goes idle again.
    spec = RaisedAlert(
        kind=AlertKind.IDLE_CLAIM, key=KEY, subject="Idle claim shared-ns/train-0", team=cast.beta
    )
    alert, created = raise_alert(spec=spec, now=timezone.now())
    assert created and alert.team_id == cast.beta.pk
    assert alert.snoozed_until is None  # today: alpha's lead's week


# --- TALLY_PROMETHEUS_URLS --------------------------------------------------------------------


@pytest.mark.parametrize(
    "urls",
    [
        "gpu-east=http://prom east:9090",  # a space in the host
        "gpu-east=http://prom-east:9090/prom etheus",  # a space in the path
        "gpu-east=http://prom\x01east:9090",  # a control character
    ],
)
def test_a_url_with_a_space_or_control_character_is_a_settings_error(urls: str) -> None:
    with override_settings(
        TALLY_METERING_SOURCE="samples,gpu-east=prometheus", TALLY_PROMETHEUS_URLS=urls
    ):
        errors = [str(error.msg) for error in prometheus.check_settings()]
    assert len(errors) == 1, errors  # today: none, the value passes
    assert "TALLY_PROMETHEUS_URLS" in errors[0] and "gpu-east" in errors[0]
