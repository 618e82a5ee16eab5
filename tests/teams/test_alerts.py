"""The alert channel (teams.alerts, teams.alert_delivery): raise, dedup (also racing on
PostgreSQL), resolve, snooze, the email, and the Alertmanager webhook as a real HTTP server
receives it, up or down."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core import mail
from django.db import OperationalError, connection, transaction
from django.test import Client, override_settings
from django.urls import reverse

from teams.alert_delivery import alertmanager_payload, deliver_pending, fingerprint
from teams.alerts import (
    RaisedAlert,
    operator_recipients,
    raise_alert,
    resolve_missing,
    snooze_alert,
    sync_alerts,
)
from teams.models import (
    Alert,
    AlertDelivery,
    AlertKind,
    AlertState,
    AuditEntry,
    DeliveryState,
    Team,
)
from tests.quota.factories import UserFactory

pytestmark = pytest.mark.django_db

NOW = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)
KIND = AlertKind.IDLE_CLAIM


@dataclass
class Receiver:
    """A real HTTP server on 127.0.0.1 that records each POST; answers `status`."""

    url: str
    bodies: list[dict[str, Any]] = field(default_factory=list)
    status: int = 200
    delay: float = 0.0


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    state = Receiver(url="")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers["Content-Length"])
            body = json.loads(self.rfile.read(length))
            assert self.headers["Content-Type"] == "application/json"
            state.bodies.append(body)
            time.sleep(state.delay)
            self.send_response(state.status)
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.url = f"http://127.0.0.1:{server.server_address[1]}/alerts"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()


def dead_url() -> str:
    """A URL nothing listens on: a port just bound and released."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/alerts"


@pytest.fixture
def team() -> Team:
    return Team.objects.create(slug="vision", name="Vision")


def spec(team: Team | None, key: str = "prod/vision/train-gpu/uid-1", **fields: Any) -> RaisedAlert:
    values: dict[str, Any] = {
        "kind": KIND,
        "key": key,
        "team": team,
        "subject": f"Idle claim {key}",
        "description": "Holds 8 GPUs and used 1.5% of them.",
        "labels": {"cluster": "prod", "namespace": "vision", "claim": "train-gpu"},
        "recipients": ("alice", "lead-vision", "oncall@example.com"),
    }
    values.update(fields)
    return RaisedAlert(**values)


def deliveries(alert: Alert) -> list[tuple[str, str, str, str]]:
    return sorted(alert.deliveries.values_list("event", "channel", "target", "state"))


@override_settings(TALLY_ALERT_WEBHOOK_URLS=["http://am.example/hook"])
def test_raising_twice_keeps_one_firing_alert_and_plans_its_notifications_once(
    team: Team,
) -> None:
    first, created = raise_alert(spec=spec(team), now=NOW)
    again, created_again = raise_alert(
        spec=spec(team, subject="Idle claim, still"), now=NOW + timedelta(minutes=5)
    )

    assert created and not created_again
    assert again.pk == first.pk
    stored = Alert.objects.get()
    assert (stored.state, stored.first_seen, stored.last_seen, stored.subject) == (
        AlertState.FIRING,
        NOW,
        NOW + timedelta(minutes=5),
        "Idle claim, still",
    )
    assert deliveries(stored) == [
        ("firing", "email", "", "pending"),
        ("firing", "webhook", "http://am.example/hook", "pending"),
    ]


def test_resolve_missing_resolves_only_the_keys_no_longer_live(team: Team) -> None:
    kept, _ = raise_alert(spec=spec(team, key="a"), now=NOW)
    gone, _ = raise_alert(spec=spec(team, key="b"), now=NOW)
    other_kind, _ = raise_alert(spec=spec(None, key="b", kind=AlertKind.VERSION_OUTLIER), now=NOW)

    resolved = resolve_missing(kind=KIND, live_keys={"a"}, now=NOW + timedelta(hours=1))

    assert [alert.pk for alert in resolved] == [gone.pk]
    states = dict(Alert.objects.values_list("pk", "state"))
    assert states == {kept.pk: "firing", gone.pk: "resolved", other_kind.pk: "firing"}
    gone.refresh_from_db()
    assert gone.resolved_at == NOW + timedelta(hours=1)
    # Never sent: the firing notification is dropped and no resolved one is planned.
    assert deliveries(gone) == [("firing", "email", "", "skipped")]
    # Again: nothing more to resolve.
    assert resolve_missing(kind=KIND, live_keys={"a"}, now=NOW + timedelta(hours=2)) == []


def test_an_alert_that_fires_again_after_resolving_is_a_new_row(team: Team) -> None:
    first, _ = raise_alert(spec=spec(team), now=NOW)
    resolve_missing(kind=KIND, live_keys=(), now=NOW + timedelta(hours=1))
    second, created = raise_alert(spec=spec(team), now=NOW + timedelta(hours=2))

    assert created and second.pk != first.pk
    assert list(Alert.objects.order_by("pk").values_list("state", flat=True)) == [
        "resolved",
        "firing",
    ]


def test_sync_alerts_raises_the_live_and_resolves_the_rest(team: Team) -> None:
    sync_alerts(kind=KIND, raised=[spec(team, key="a"), spec(team, key="b")], now=NOW)
    report = sync_alerts(
        kind=KIND, raised=[spec(team, key="b"), spec(team, key="c")], now=NOW + timedelta(hours=1)
    )

    assert [a.key for a in report.raised] == ["c"]
    assert [a.key for a in report.ongoing] == ["b"]
    assert [a.key for a in report.resolved] == ["a"]
    with pytest.raises(ValueError, match="of kind stranded_gang, not idle_claim"):
        sync_alerts(kind=KIND, raised=[spec(team, kind=AlertKind.STRANDED_GANG)], now=NOW)


@pytest.mark.django_db(transaction=True)
def test_two_evaluations_racing_raise_one_alert() -> None:
    """Both find no firing row and insert; the second waits on the partial unique index, fails,
    and takes the first's row: one alert, one set of notifications."""
    team = Team.objects.create(slug="race", name="Race")
    start = threading.Barrier(2)
    results: list[tuple[int, bool]] = []
    errors: list[BaseException] = []

    def evaluate(offset: int) -> None:
        try:
            with transaction.atomic():
                start.wait(timeout=10)
                alert, created = raise_alert(spec=spec(team), now=NOW + timedelta(seconds=offset))
                time.sleep(0.3)  # the other's insert runs meanwhile, and waits for this commit
            results.append((alert.pk, created))
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=evaluate, args=(n,)) for n in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)

    assert not errors
    assert len({pk for pk, _ in results}) == 1
    assert sorted(created for _, created in results) == [False, True]
    assert Alert.objects.count() == 1
    assert AlertDelivery.objects.count() == 1  # the email; no webhook URLs


@pytest.mark.django_db(transaction=True)
def test_resolving_locks_only_the_alerts_it_resolves() -> None:
    """While one evaluation resolves what is gone, another can update the alerts still live
    (its raise locks their rows): resolving never holds them."""
    team = Team.objects.create(slug="lock", name="Lock")
    live, _ = raise_alert(spec=spec(team, key="live"), now=NOW)
    gone, _ = raise_alert(spec=spec(team, key="gone"), now=NOW)
    probed: dict[str, bool] = {}

    def try_lock(pk: int) -> bool:
        try:
            with transaction.atomic():
                Alert.objects.select_for_update(nowait=True).get(pk=pk)
            return True
        except OperationalError:
            return False
        finally:
            connection.close()

    def probe() -> None:
        probed["live"], probed["gone"] = try_lock(live.pk), try_lock(gone.pk)

    with transaction.atomic():
        resolved = resolve_missing(kind=KIND, live_keys={"live"}, now=NOW)
        thread = threading.Thread(target=probe)
        thread.start()
        thread.join(timeout=30)

    assert [alert.key for alert in resolved] == ["gone"]
    assert probed == {"live": True, "gone": False}


def test_the_email_goes_to_the_recipients_addresses(team: Team) -> None:
    UserFactory.create(username="alice", email="alice@example.com")
    UserFactory.create(username="lead-vision", email="lead@example.com")
    UserFactory.create(username="no-address", email="")
    raise_alert(
        spec=spec(team, recipients=("alice", "lead-vision", "no-address", "x@y.org")), now=NOW
    )

    report = deliver_pending(now=NOW)

    [message] = mail.outbox
    assert message.subject == "[Tally] FIRING: Idle claim prod/vision/train-gpu/uid-1"
    assert message.to == ["alice@example.com", "lead@example.com", "x@y.org"]
    assert "Holds 8 GPUs and used 1.5% of them." in message.body
    assert "Team: vision" in message.body
    assert "  claim: train-gpu" in message.body
    assert "Since: 2026-12-01T09:00:00Z" in message.body
    [delivery] = AlertDelivery.objects.all()
    assert (delivery.state, delivery.attempts, delivery.sent_at) == ("sent", 1, NOW)
    assert delivery.detail == "to alice@example.com, lead@example.com, x@y.org"
    assert report.sent == [delivery.pk]

    # Sent once: a second run sends nothing.
    assert deliver_pending(now=NOW + timedelta(minutes=5)).sent == []
    assert len(mail.outbox) == 1

    resolve_missing(kind=KIND, live_keys=(), now=NOW + timedelta(hours=3))
    deliver_pending(now=NOW + timedelta(hours=3))
    assert [m.subject for m in mail.outbox][1] == (
        "[Tally] RESOLVED: Idle claim prod/vision/train-gpu/uid-1"
    )
    assert "Resolved: 2026-12-01T12:00:00Z" in mail.outbox[1].body


def test_an_alert_nobody_can_be_mailed_is_skipped_not_retried(team: Team) -> None:
    raise_alert(spec=spec(team, recipients=("ghost",)), now=NOW)
    report = deliver_pending(now=NOW)
    [delivery] = AlertDelivery.objects.all()
    assert report.skipped == [delivery.pk]
    assert (delivery.state, delivery.detail) == ("skipped", "no recipient has an email address")
    assert mail.outbox == []


def test_the_webhook_posts_alertmanager_payloads_on_raise_and_resolve_once_each(
    team: Team, receiver: Receiver
) -> None:
    with override_settings(TALLY_ALERT_WEBHOOK_URLS=[receiver.url]):
        alert, _ = raise_alert(spec=spec(team, recipients=()), now=NOW)
        deliver_pending(now=NOW)
        deliver_pending(now=NOW + timedelta(minutes=1))
        resolve_missing(kind=KIND, live_keys=(), now=NOW + timedelta(hours=2))
        deliver_pending(now=NOW + timedelta(hours=2))
        deliver_pending(now=NOW + timedelta(hours=2, minutes=1))

    firing, resolved = receiver.bodies  # exactly one of each
    labels = {
        "alertname": "TallyIdleClaim",
        "severity": "warning",
        "team": "vision",
        "cluster": "prod",
        "namespace": "vision",
        "claim": "train-gpu",
        "tally_key": "prod/vision/train-gpu/uid-1",
    }
    assert firing["version"] == "4"
    assert firing["status"] == "firing"
    assert firing["receiver"] == "tally"
    assert firing["groupKey"] == (
        '{}:{alertname="TallyIdleClaim", tally_key="prod/vision/train-gpu/uid-1"}'
    )
    [sent] = firing["alerts"]
    assert sent == {
        "status": "firing",
        "labels": labels,
        "annotations": {
            "summary": "Idle claim prod/vision/train-gpu/uid-1",
            "description": "Holds 8 GPUs and used 1.5% of them.",
        },
        "startsAt": "2026-12-01T09:00:00Z",
        "endsAt": "0001-01-01T00:00:00Z",
        "generatorURL": "",
        "fingerprint": fingerprint(labels),
    }
    assert resolved["status"] == "resolved"
    [ended] = resolved["alerts"]
    assert (ended["status"], ended["startsAt"], ended["endsAt"]) == (
        "resolved",
        "2026-12-01T09:00:00Z",
        "2026-12-01T11:00:00Z",
    )
    assert ended["fingerprint"] == sent["fingerprint"]  # Alertmanager pairs them by it
    webhook = dict(AlertDelivery.objects.filter(channel="webhook").values_list("event", "detail"))
    assert webhook == {
        "firing": f"HTTP 200 from {receiver.url}",
        "resolved": f"HTTP 200 from {receiver.url}",
    }
    alert.refresh_from_db()
    assert alertmanager_payload(alert, "resolved") == resolved


def test_the_payload_links_to_the_portal_when_its_url_is_set(team: Team) -> None:
    alert, _ = raise_alert(spec=spec(team), now=NOW)
    fleet, _ = raise_alert(spec=spec(None, key="b", kind=AlertKind.VERSION_OUTLIER), now=NOW)
    with override_settings(TALLY_PORTAL_URL="https://tally.example.com/"):
        payload = alertmanager_payload(alert, "firing")
        assert payload["externalURL"] == "https://tally.example.com"
        assert payload["alerts"][0]["generatorURL"] == (
            f"https://tally.example.com/teams/{team.slug}/"
        )
        # A fleet-wide alert (no team) links to the portal itself.
        assert alertmanager_payload(fleet, "firing")["alerts"][0]["generatorURL"] == (
            "https://tally.example.com"
        )


def test_a_dead_receiver_is_retried_later_and_never_stops_the_others(
    team: Team, receiver: Receiver
) -> None:
    dead = dead_url()
    UserFactory.create(username="alice", email="alice@example.com")
    with override_settings(
        TALLY_ALERT_WEBHOOK_URLS=[dead, receiver.url], TALLY_ALERT_DELIVERY_ATTEMPTS=3
    ):
        sync_alerts(kind=KIND, raised=[spec(team, key="a"), spec(team, key="b")], now=NOW)
        report = deliver_pending(now=NOW)

        by_target = {
            (d.alert.key, d.target or "email"): d
            for d in AlertDelivery.objects.select_related("alert")
        }
        # The dead receiver is tried once per run, then left for the next run.
        assert len(report.retrying) == 1
        tried = by_target[("a", dead)]
        assert (tried.state, tried.attempts) == ("pending", 1)
        assert tried.next_attempt_at == NOW + timedelta(minutes=1)
        assert "ConnectionRefusedError" in tried.detail or "URLError" in tried.detail
        assert (by_target[("b", dead)].state, by_target[("b", dead)].attempts) == ("pending", 0)
        # Everything else went out.
        assert len(receiver.bodies) == 2 and len(mail.outbox) == 2
        assert sorted(report.sent) == sorted(d.pk for key, d in by_target.items() if key[1] != dead)

        # "a" is not due before its next attempt; "b", never tried, is.
        assert deliver_pending(now=NOW + timedelta(seconds=30)).retrying == [
            by_target[("b", dead)].pk
        ]
        # Later runs try the dead receiver once each, until both give up after 3 attempts.
        moment = NOW + timedelta(minutes=1)
        for _ in range(10):
            run = deliver_pending(now=moment)
            assert len(run.retrying) + len(run.failed) <= 1
            moment += timedelta(hours=1)
        for key in ("a", "b"):
            by_target[(key, dead)].refresh_from_db()
            assert (by_target[(key, dead)].state, by_target[(key, dead)].attempts) == (
                "failed",
                3,
            )
        # The evaluation still runs and resolves whatever the receiver's state.
        sync_alerts(kind=KIND, raised=[], now=NOW + timedelta(hours=1))
    assert Alert.objects.filter(state="firing").count() == 0
    # Nothing was sent twice.
    assert len(receiver.bodies) == 2 and len(mail.outbox) == 2


def test_a_receiver_answering_500_gets_the_notification_once_it_recovers(
    team: Team, receiver: Receiver
) -> None:
    receiver.status = 500
    with override_settings(TALLY_ALERT_WEBHOOK_URLS=[receiver.url]):
        raise_alert(spec=spec(team, recipients=()), now=NOW)
        first = deliver_pending(now=NOW)
        receiver.status = 200
        second = deliver_pending(now=NOW + timedelta(minutes=1))
        third = deliver_pending(now=NOW + timedelta(minutes=10))

    assert len(first.retrying) == 1 and first.sent == []
    assert second.sent == first.retrying and third.sent == []
    delivery = AlertDelivery.objects.get(channel="webhook")
    assert (delivery.state, delivery.attempts) == ("sent", 2)
    assert len(receiver.bodies) == 2  # the refused one and the accepted one


def test_a_snoozed_alert_stays_quiet_until_the_snooze_ends_and_passes_it_on(
    team: Team, receiver: Receiver
) -> None:
    with override_settings(TALLY_ALERT_WEBHOOK_URLS=[receiver.url]):
        alert, _ = raise_alert(spec=spec(team, recipients=()), now=NOW)
        snooze_alert(alert=alert, until=NOW + timedelta(hours=4), actor="ops")
        deliver_pending(now=NOW + timedelta(hours=1))
        assert receiver.bodies == []

        # Resolved while snoozed: the firing notification is dropped, nothing is sent.
        resolve_missing(kind=KIND, live_keys=(), now=NOW + timedelta(hours=2))
        deliver_pending(now=NOW + timedelta(hours=2))
        assert receiver.bodies == []

        # Idle again within the snooze: the new alert inherits it.
        again, created = raise_alert(spec=spec(team, recipients=()), now=NOW + timedelta(hours=3))
        assert created and again.snoozed_until == NOW + timedelta(hours=4)
        deliver_pending(now=NOW + timedelta(hours=3))
        assert receiver.bodies == []

        # Once it ends, the firing notification goes out.
        deliver_pending(now=NOW + timedelta(hours=4))
        assert [body["status"] for body in receiver.bodies] == ["firing"]

    entry = AuditEntry.objects.get(object_type="alert")
    assert (entry.actor, entry.action) == ("ops", "update")
    assert entry.after is not None and entry.after["snoozed_by"] == "ops"


def test_lifting_a_snooze_lifts_it_for_the_key(team: Team) -> None:
    first, _ = raise_alert(spec=spec(team), now=NOW)
    snooze_alert(alert=first, until=NOW + timedelta(days=7), actor="ops")
    resolve_missing(kind=KIND, live_keys=(), now=NOW + timedelta(hours=1))
    second, _ = raise_alert(spec=spec(team), now=NOW + timedelta(hours=2))
    assert second.snoozed_until == NOW + timedelta(days=7)

    snooze_alert(alert=second, until=None, actor="ops")

    assert not Alert.objects.filter(snoozed_until__isnull=False).exists()
    third_resolved = resolve_missing(kind=KIND, live_keys=(), now=NOW + timedelta(hours=3))
    assert [a.pk for a in third_resolved] == [second.pk]
    third, _ = raise_alert(spec=spec(team), now=NOW + timedelta(hours=4))
    assert third.snoozed_until is None


def test_fleet_alerts_go_to_the_operator_emails_else_the_staff() -> None:
    UserFactory.create(username="root", is_staff=True, email="root@example.com")
    UserFactory.create(username="gone", is_staff=True, is_active=False)
    UserFactory.create(username="plain")
    assert operator_recipients() == ["root"]
    with override_settings(TALLY_OPERATOR_EMAILS=["gpu-oncall@example.com"]):
        assert operator_recipients() == ["gpu-oncall@example.com"]


@pytest.fixture
def operator_client(client: Client) -> Client:
    operator = User.objects.create_superuser("root", "root@example.com", "pw")
    client.force_login(operator)
    return client


def test_operators_snooze_and_unsnooze_from_the_admin(operator_client: Client, team: Team) -> None:
    alert, _ = raise_alert(spec=spec(team), now=NOW)
    changelist = reverse("admin:teams_alert_changelist")

    response = operator_client.post(
        changelist, {"action": "snooze_86400", "_selected_action": [alert.pk]}, follow=True
    )

    assert response.status_code == 200
    alert.refresh_from_db()
    assert alert.snoozed_by == "root"
    assert alert.snoozed_until is not None
    assert timedelta(hours=23) < alert.snoozed_until - datetime.now(UTC) <= timedelta(days=1)
    page = operator_client.get(reverse("admin:teams_alert_change", args=[alert.pk]))
    assert page.status_code == 200
    assert b"Holds 8 GPUs" in page.content

    operator_client.post(changelist, {"action": "unsnooze", "_selected_action": [alert.pk]})
    alert.refresh_from_db()
    assert (alert.snoozed_until, alert.snoozed_by) == (None, "")


def test_pending_deliveries_of_a_snoozed_alert_are_not_due(team: Team) -> None:
    alert, _ = raise_alert(spec=spec(team), now=NOW)
    snooze_alert(alert=alert, until=NOW + timedelta(hours=1), actor="ops")
    assert deliver_pending(now=NOW).sent == []
    assert AlertDelivery.objects.get().state == DeliveryState.PENDING


@pytest.mark.django_db(transaction=True)
def test_two_workers_sending_at_once_send_each_notification_once(receiver: Receiver) -> None:
    team = Team.objects.create(slug="race", name="Race")
    receiver.delay = 0.2  # each POST is slow: the other worker reaches the locked rows
    start = threading.Barrier(2)
    errors: list[BaseException] = []

    def send() -> None:
        try:
            start.wait(timeout=10)
            deliver_pending(now=NOW)
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            connection.close()

    with override_settings(TALLY_ALERT_WEBHOOK_URLS=[receiver.url]):
        for index in range(4):
            raise_alert(spec=spec(team, key=f"k{index}", recipients=()), now=NOW)
        threads = [threading.Thread(target=send) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)

    assert not errors
    assert sorted(body["alerts"][0]["labels"]["tally_key"] for body in receiver.bodies) == [
        "k0",
        "k1",
        "k2",
        "k3",
    ]
    webhooks = AlertDelivery.objects.filter(channel="webhook")
    assert sorted(webhooks.values_list("state", "attempts")) == [("sent", 1)] * 4
