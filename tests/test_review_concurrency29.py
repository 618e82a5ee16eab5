"""Review of concurrency and failure handling, round 29: the fleet shape counts and the
webhook's refresher, late-data and dirty-hour marks, the sync's watch batches, alert locking.

Each test states what should hold; each failed, for the reason its docstring gives, until the
defect was mended.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from django.db import OperationalError, connection
from django.test import override_settings
from django.utils import timezone

from inventory import kube, services
from inventory.dumps import iter_objects
from inventory.models import Cluster, ResourceClaim
from teams import alerts
from teams.alert_delivery import deliver_pending
from teams.models import Alert, AlertDelivery, AlertKind, AlertState, DeliveryState
from tests.billing.test_late_data_marks import Connection, blocked
from tests.fake_kube import FakeKube
from tests.inventory.test_gangs import FIXTURES, Clock, named, serve


@pytest.fixture
def fake() -> Iterator[FakeKube]:
    with FakeKube(max_lifetime_seconds=60) as server:
        yield server


@pytest.fixture
def api_client(fake: FakeKube, tmp_path: Path) -> Iterator[Any]:
    client = kube.api_client(kubeconfig=str(fake.write_kubeconfig(tmp_path / "kubeconfig")))
    yield client
    client.close()


@pytest.fixture
def cluster() -> Cluster:
    return services.get_cluster("lab")


# --- A watch batch the database fails: the claim's owners are not followed on the retry -------

CLAIM = "train-workers-0-0-x7k2p-gpus-4m8rt"
RESOURCE_VERSION = "7"  # the batch's last


def _claim_event(objects: list[dict[str, Any]]) -> services.WatchEvent:
    """The claim's ADDED event as the watch delivers it (a fresh object each delivery)."""
    obj = copy.deepcopy(named(objects, CLAIM))
    obj["kind"] = "ResourceClaim"
    return services.WatchEvent(event_type="ADDED", obj=obj, at=timezone.now())


def _stored_claim() -> tuple[str, str | None]:
    claim = ResourceClaim.objects.select_related("gang").get(name=CLAIM)
    return claim.job, claim.gang.key if claim.gang else None


@pytest.mark.django_db
def test_a_batch_the_database_failed_records_the_claims_job_and_gang_when_applied_again(
    fake: FakeKube, api_client: Any, cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The database fails while the batch is applied (after its Pods were read); the watch
    resumes from the last stored resourceVersion and the same event comes again, seconds
    later. The claim is to be stored as if it had applied the first time."""
    objects = list(iter_objects(FIXTURES / "jobset.yaml"))
    serve(fake, objects)

    # What the claim gets when nothing fails, in another cluster.
    other = services.get_cluster("control")
    kube.KindSync(
        api_client=api_client,
        cluster=other,
        resource=kube.RESOURCES["ResourceClaim"],
        clock=Clock(),
    )._apply([_claim_event(objects)], RESOURCE_VERSION)
    expected = _stored_claim()
    ResourceClaim.objects.filter(cluster=other).delete()
    assert expected[1] is not None  # the JobSet's gang

    clock = Clock()
    loop = kube.KindSync(
        api_client=api_client,
        cluster=cluster,
        resource=kube.RESOURCES["ResourceClaim"],
        clock=clock,
    )
    apply = services.apply_watch_events
    calls: list[int] = []

    def failing_once(**kwargs: Any) -> services.SyncReport:
        calls.append(len(kwargs["events"]))
        if len(calls) == 1:
            raise OperationalError("the server closed the connection unexpectedly")
        return apply(**kwargs)

    monkeypatch.setattr(services, "apply_watch_events", failing_once)
    with pytest.raises(OperationalError):
        loop._apply([_claim_event(objects)], RESOURCE_VERSION)
    clock.now += 0.05  # the backoff's pause, then the watch from the stored resourceVersion
    loop._apply([_claim_event(objects)], RESOURCE_VERSION)

    assert _stored_claim() == expected


# --- A snooze lifted while the key fires again ------------------------------------------------

IDLE = alerts.RaisedAlert(kind=AlertKind.IDLE_CLAIM, key="lab/ml/train", subject="train is idle")


@pytest.mark.django_db(transaction=True)
def test_a_snooze_lifted_while_the_key_fires_again_is_lifted_for_the_new_alert() -> None:
    """The key's alert resolved while snoozed; an evaluation raises the key again (a new row,
    inheriting the snooze) while a lead lifts the snooze of the key. Whatever the order, the
    snooze is lifted: the new alert's firing notification goes out now."""
    now = timezone.now()
    first, _ = alerts.raise_alert(spec=IDLE, now=now)
    alerts.resolve_missing(kind=AlertKind.IDLE_CLAIM, live_keys=[], now=now)
    alerts.snooze_alert(alert=first, until=now + timedelta(hours=4), actor="lead")

    raising = Connection(lambda: alerts.raise_alert(spec=IDLE, now=now + timedelta(minutes=5)))
    assert raising.done_work.wait(timeout=10)
    lifting, pid, errors = _lifting(first)  # lifted for the whole key
    blocked(lifting, lambda: pid[0] if pid else 0)
    assert lifting.is_alive(), f"the lift did not wait for the raise: {errors}"
    raising.end()
    lifting.join(timeout=30)
    assert errors == []

    again = Alert.objects.get(kind=AlertKind.IDLE_CLAIM, key=IDLE.key, state=AlertState.FIRING)
    assert again.pk != first.pk
    assert again.snoozed_until is None


def _lifting(alert: Alert) -> tuple[threading.Thread, list[int], list[BaseException]]:
    """A lead lifting the snooze of `alert`'s key, on a connection of its own."""
    pid: list[int] = []
    errors: list[BaseException] = []

    def lift() -> None:
        try:
            pid.append(connection.cursor().connection.info.backend_pid)
            alerts.snooze_alert(alert=alert, until=None, actor="lead")
        except BaseException as exc:  # reported by the caller
            errors.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=lift)
    thread.start()
    return thread, pid, errors


@pytest.mark.django_db(transaction=True)
def test_two_leads_lifting_one_keys_snooze_through_two_of_its_alerts_both_succeed() -> None:
    """The key's resolved alert and its firing one both carry the snooze. While an evaluation
    updates the firing one (holding its row), one lead lifts the snooze from the firing alert
    on the team page and another from the resolved one in the admin. Both succeed."""
    now = timezone.now()
    first, _ = alerts.raise_alert(spec=IDLE, now=now)
    alerts.resolve_missing(kind=AlertKind.IDLE_CLAIM, live_keys=[], now=now)
    alerts.snooze_alert(alert=first, until=now + timedelta(hours=4), actor="lead")
    firing, created = alerts.raise_alert(spec=IDLE, now=now + timedelta(minutes=5))
    assert created and firing.snoozed_until is not None  # inherited

    evaluation = Connection(lambda: alerts.raise_alert(spec=IDLE, now=now + timedelta(minutes=10)))
    assert evaluation.done_work.wait(timeout=10)
    on_page, page_pid, page_errors = _lifting(firing)
    blocked(on_page, lambda: page_pid[0] if page_pid else 0)
    in_admin, admin_pid, admin_errors = _lifting(first)
    blocked(in_admin, lambda: admin_pid[0] if admin_pid else 0)
    evaluation.end()
    on_page.join(timeout=20)
    in_admin.join(timeout=20)

    assert [*page_errors, *admin_errors] == []
    assert not Alert.objects.filter(key=IDLE.key, snoozed_until__isnull=False).exists()


# --- A snooze made while a delivery run works through what it found due ---------------------


class HeldReceiver:
    """An Alertmanager receiver on 127.0.0.1 that holds the first POST until `release`."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.arrived = threading.Event()
        self.release = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                receiver.keys.append(body["alerts"][0]["labels"]["tally_key"])
                receiver.arrived.set()
                receiver.release.wait(timeout=10)
                self.send_response(200)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.django_db(transaction=True)
def test_an_alert_snoozed_while_a_delivery_run_works_is_not_notified() -> None:
    """A run finds two alerts' firing notifications due and sends the first (a slow receiver);
    meanwhile a lead snoozes the second. Its notification waits for the snooze to end."""
    receiver = HeldReceiver()
    now = timezone.now()
    try:
        with override_settings(TALLY_ALERT_WEBHOOK_URLS=[receiver.url]):
            for key in ("first", "second"):
                alerts.raise_alert(
                    spec=alerts.RaisedAlert(kind=AlertKind.IDLE_CLAIM, key=key, subject=key),
                    now=now,
                )
            second = Alert.objects.get(key="second")
            errors: list[BaseException] = []

            def deliver() -> None:
                try:
                    deliver_pending(now=now)
                except BaseException as exc:  # reported below
                    errors.append(exc)
                finally:
                    connection.close()

            run = threading.Thread(target=deliver)
            run.start()
            assert receiver.arrived.wait(timeout=10)  # the first alert's POST, held
            alerts.snooze_alert(alert=second, until=now + timedelta(hours=4), actor="lead")
            receiver.release.set()
            run.join(timeout=30)
            assert not errors
    finally:
        receiver.close()

    assert receiver.keys == ["first"]
    webhook = AlertDelivery.objects.get(alert=second, channel="webhook")
    assert webhook.state == DeliveryState.PENDING
