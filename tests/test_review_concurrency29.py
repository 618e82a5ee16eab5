"""Review of concurrency and failure handling, round 29: alert keys raised, snoozed and lifted
at once, and notifications sent while a snooze commits. (Its watch-batch finding is tested in
tests/inventory/test_claim_rereads.py.)

Each test states what should hold; each failed, for the reason its docstring gives, until the
defect was mended.
"""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from django.db import connection
from django.test import override_settings
from django.utils import timezone

from teams import alerts
from teams.alert_delivery import deliver_pending
from teams.models import Alert, AlertDelivery, AlertKind, AlertState, DeliveryState
from tests.billing.test_late_data_marks import Connection, blocked

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
