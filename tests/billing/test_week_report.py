"""The week report: a team's week to the hour and cent (per person, per job, idle claims,
budget, changes from the week before), its email (locmem backend), and that it is sent once
per team and week, even when beat runs twice or two workers race.

The scenario's usage rows are written by hand (as the rollup would write them) so that every
figure is known: week of Monday 2026-11-16, compared with the week of 2026-11-09.

- ana, `Job/train-ana`: an H100 held Monday 00:00-24:00, 75% busy each hour (24 h, 18 busy),
  and a 3g.40gb slice of an A100 (3/7 of it) Thursday 08:00-18:00: 5 hours busy, 1 hour
  unmeasured, 4 idle. The week before: the H100 10 hours, half busy.
- ben, `StatefulSet/nb`: an H100 held 30 hours from Tuesday 00:00: 2 hours half busy, then 28
  idle.
- H100: 2.80 USD per GPU-hour, idle at half price; the 3g.40gb profile: 1.00 USD per
  slice-hour, idle at 40%.
"""

from __future__ import annotations

import csv
import io
import json
import re
import threading
import time
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core import mail
from django.core.mail.backends.locmem import EmailBackend as LocmemBackend
from django.core.management import CommandError, call_command
from django.db import connection
from django.test import override_settings

from billing.models import RateCard, WeekReport
from billing.week import (
    WEEK_CSV_COLUMNS,
    WeekError,
    last_complete_week,
    parse_week_start,
    week_csv_rows,
)
from billing.week_mail import send_week_report
from frontend.tasks import send_week_reports
from frontend.week import week_report
from inventory.models import Allocation
from metering.models import UsageHour
from quota.models import Budget
from teams.api import write_csv
from teams.models import Membership, Role, Team, TeamNamespace
from tests.factories import (
    AllocationFactory,
    DeviceFactory,
    MigDeviceFactory,
    NodeFactory,
    owner_of,
)

H = 3_600_000
SLICE_SHARE = Decimal("0.428571")
SLICE_HOUR_MS = 1_542_856  # an hour of the slice in GPU-milliseconds: 3_600_000 x 0.428571
WEEK = datetime(2026, 11, 16, tzinfo=UTC)
NOW = datetime(2026, 11, 24, 10, 0, tzinfo=UTC)  # Tuesday after the week


def _rows(
    allocation: Allocation,
    *,
    user: str,
    job: str,
    first: datetime,
    hours: list[tuple[int, int, int]],
) -> list[UsageHour]:
    """Consecutive hours from `first`: (allocated, utilised, unmeasured) ms each."""
    device = allocation.device
    assert device is not None and owner_of(allocation) is not None
    return [
        UsageHour(
            hour=first + timedelta(hours=n),
            allocation=allocation,
            cluster_id=allocation.cluster_id,
            device_uuid=device.meter_id,
            product_name=device.product_name,
            profile=device.profile,
            gpu_share=device.gpu_share,
            namespace=allocation.claim.namespace,
            claim_name=allocation.claim.name,
            team=owner_of(allocation),
            job=job,
            username=user,
            allocated_gpu_ms=allocated,
            utilised_gpu_ms=utilised,
            unmeasured_gpu_ms=unmeasured,
        )
        for n, (allocated, utilised, unmeasured) in enumerate(hours)
    ]


def _lead(team: Team, username: str, email: str, role: str = Role.LEAD) -> User:
    user = User.objects.create_user(username=username, email=email)
    Membership.objects.create(team=team, user=user, role=role)
    return user


@pytest.fixture
def week_scenario(db: None) -> Team:
    return build_week_scenario()


def build_week_scenario() -> Team:
    team = Team.objects.create(slug="vision", name="Vision")
    other = Team.objects.create(slug="nlp", name="Natural Language")
    TeamNamespace.objects.create(team=team, namespace="vision")
    _lead(team, "lead_a", "lead-a@example.com")
    _lead(team, "lead_a2", "lead-a2@example.com")
    _lead(team, "member_a", "member-a@example.com", role=Role.MEMBER)
    _lead(team, "lead_no_mail", "")
    _lead(other, "lead_b", "lead-b@example.com")
    seen = WEEK - timedelta(days=30)
    node = NodeFactory(name="gpu-h100-1", first_seen=seen)
    h100_a, h100_b = (
        DeviceFactory(node=node, first_seen=seen),
        DeviceFactory(node=node, first_seen=seen),
    )
    a100 = DeviceFactory(
        node=NodeFactory(name="gpu-a100-1", cluster=node.cluster, first_seen=seen),
        product_name="NVIDIA A100-SXM4-80GB",
        first_seen=seen,
    )
    mig = MigDeviceFactory(parent=a100, profile="3g.40gb", gpu_share=SLICE_SHARE, first_seen=seen)
    start, end = WEEK - timedelta(days=7), WEEK + timedelta(days=4)

    def held(device: Any, claim: str) -> Allocation:
        allocation = AllocationFactory.create(
            device=device,
            claim__namespace="vision",
            claim__name=claim,
            start=start,
            end=end,
            team=team,
        )
        return allocation

    ana_gpu, ben_gpu, ana_slice = (
        held(h100_a, "ana-train"),
        held(h100_b, "ben-notebook"),
        held(mig, "ana-mig"),
    )
    assert ana_slice.device_share == SLICE_SHARE
    slice_hours = [(SLICE_HOUR_MS, SLICE_HOUR_MS, 0)] * 5 + [(SLICE_HOUR_MS, 0, SLICE_HOUR_MS)]
    slice_hours += [(SLICE_HOUR_MS, 0, 0)] * 4
    UsageHour.objects.bulk_create(
        [
            *_rows(
                ana_gpu,
                user="ana",
                job="Job/train-ana",
                first=WEEK,
                hours=[(H, H * 3 // 4, 0)] * 24,
            ),
            *_rows(
                ana_gpu,
                user="ana",
                job="Job/train-ana",
                first=WEEK - timedelta(days=7),
                hours=[(H, H // 2, 0)] * 10,
            ),
            *_rows(
                ben_gpu,
                user="ben",
                job="StatefulSet/nb",
                first=WEEK + timedelta(days=1),
                hours=[(H, H // 2, 0)] * 2 + [(H, 0, 0)] * 28,
            ),
            *_rows(
                ana_slice,
                user="ana",
                job="Job/train-ana",
                first=WEEK + timedelta(days=3, hours=8),
                hours=slice_hours,
            ),
            # Outside both weeks: counted by neither.
            *_rows(
                ben_gpu,
                user="ben",
                job="StatefulSet/nb",
                first=WEEK + timedelta(days=7),
                hours=[(H, 0, 0)] * 3,
            ),
        ]
    )
    RateCard.objects.create(
        product_name="NVIDIA H100 80GB HBM3",
        per_gpu_hour=Decimal("2.80"),
        idle_factor=Decimal("0.5"),
        currency="USD",
        valid_from=date(2026, 1, 1),
    )
    RateCard.objects.create(
        product_name="NVIDIA A100-SXM4-80GB",
        profile="3g.40gb",
        per_gpu_hour=Decimal("1.00"),
        idle_factor=Decimal("0.4"),
        currency="USD",
        valid_from=date(2026, 1, 1),
    )
    Budget.objects.create(team=team, gpu_hours=Decimal(200), mode="soft")
    return team


def test_the_week_to_the_hour_and_cent(week_scenario: Team) -> None:
    report = week_report(team=week_scenario, start=WEEK, now=NOW)
    assert report.complete and report.last_day == date(2026, 11, 22)

    [total] = report.totals
    assert (total.week.allocated, total.week.utilised, total.week.idle, total.week.unmeasured) == (
        Decimal("58.29"),
        Decimal("21.14"),
        Decimal("36.71"),
        Decimal("0.43"),
    )
    # 58.29 GPU-hours: 24 + 30 + 10 slice-hours of 3/7 of a GPU (4.285711).
    assert total.week.allocated_ms == 54 * H + 10 * SLICE_HOUR_MS
    # 58.80 (ana's H100: 2.80 x (24 - 6/2)) + 43.40 (ben's: 2.80 x (30 - 29/2)) + 7.60 (the
    # slice: 1.00 x (10 - 0.6 x 4) slice-hours, its GPU-hours over 0.428571).
    assert total.week.cost == {"USD": Decimal("109.80")}
    assert total.week.idle_cost == {"USD": Decimal("50.60")}  # 8.40 + 40.60 + 1.60
    assert total.week.utilisation == Decimal("36.5")  # 21.142856 of 57.857140 measured
    assert (total.previous.allocated, total.previous.cost) == (
        Decimal("10.00"),
        {"USD": Decimal("21.00")},
    )
    assert total.allocated_change == "+48.29" and total.cost_change == "+88.80 USD"

    people = {row.name: row for row in report.people}
    assert [row.name for row in report.people] == ["ben", "ana"]  # most allocated first
    ana, ben = people["ana"], people["ben"]
    assert (ana.week.allocated, ana.week.utilised, ana.week.idle, ana.week.unmeasured) == (
        Decimal("28.29"),
        Decimal("20.14"),
        Decimal("7.71"),
        Decimal("0.43"),
    )
    assert ana.week.cost == {"USD": Decimal("66.40")}
    assert ana.previous.cost == {"USD": Decimal("21.00")} and ana.cost_change == "+45.40 USD"
    assert (ben.week.allocated, ben.week.utilised, ben.week.idle) == (
        Decimal("30.00"),
        Decimal("1.00"),
        Decimal("29.00"),
    )
    assert ben.week.cost == {"USD": Decimal("43.40")} and ben.previous.allocated == 0
    jobs = {row.name: row for row in report.jobs}
    assert set(jobs) == {"Job/train-ana", "StatefulSet/nb"}
    assert jobs["Job/train-ana"].week.cost == ana.week.cost
    assert jobs["StatefulSet/nb"].week.allocated_ms == ben.week.allocated_ms == 30 * H

    longest, second = report.idle_claims
    assert (longest.claim_name, longest.username, longest.longest_hours) == (
        "ben-notebook",
        "ben",
        28,
    )
    assert longest.idle_from == datetime(2026, 11, 17, 2, tzinfo=UTC)
    assert longest.idle_until == datetime(2026, 11, 18, 6, tzinfo=UTC)
    assert longest.figures.idle_cost == {"USD": Decimal("40.60")}
    # The unmeasured hour is no idle hour: it breaks the slice's run, which is the last 4.
    assert (second.claim_name, second.longest_hours) == ("ana-mig", 4)
    assert second.idle_from == datetime(2026, 11, 19, 14, tzinfo=UTC)
    assert second.figures.idle_cost == {"USD": Decimal("1.60")}  # 1.00 x 0.4 x 4 slice-hours

    budget = report.budget
    assert budget is not None and budget.period_label == "2026-11"
    assert budget.used == Decimal("68.29")  # both weeks, in November up to the 23rd
    assert (budget.percent, budget.week_used, budget.week_share) == (
        Decimal(34),
        Decimal("58.29"),
        Decimal("46.67"),  # 200 x 7/30
    )
    assert budget.projected == Decimal("93.12")  # 68.285711 over 22 days of 30


def test_the_week_before_is_its_own_week(week_scenario: Team) -> None:
    report = week_report(team=week_scenario, start=WEEK - timedelta(days=7), now=NOW)
    assert [row.name for row in report.people] == ["ana"]
    assert report.people[0].week.cost == {"USD": Decimal("21.00")}
    assert report.idle_claims == []  # half busy is not idle


def test_any_seven_days(week_scenario: Team) -> None:
    """A week from Tuesday: ben's 30 hours and the slice, not ana's Monday."""
    report = week_report(team=week_scenario, start=WEEK + timedelta(days=1), now=NOW)
    assert [row.name for row in report.people] == ["ben", "ana"]
    assert report.people[0].week.allocated == Decimal("33.00")  # and the 3 idle hours after
    assert report.people[1].week.allocated == Decimal("4.29")


def test_week_start_parsing() -> None:
    assert last_complete_week(NOW) == WEEK
    assert last_complete_week(datetime(2026, 11, 23, 0, 0, tzinfo=UTC)) == WEEK
    assert parse_week_start(None, now=NOW) == WEEK
    assert parse_week_start("2026-11-18", now=NOW) == datetime(2026, 11, 18, tzinfo=UTC)
    with pytest.raises(WeekError, match=r"start: '2026-13-01' is not a day"):
        parse_week_start("2026-13-01", now=NOW)
    with pytest.raises(WeekError, match=r"start: 2026-11-25 is in the future"):
        parse_week_start("2026-11-25", now=NOW)


def test_csv_rows(week_scenario: Team) -> None:
    report = week_report(team=week_scenario, start=WEEK, now=NOW)
    out = io.StringIO()
    write_csv(out, columns=WEEK_CSV_COLUMNS, rows=week_csv_rows(report))
    rows = list(csv.DictReader(io.StringIO(out.getvalue())))
    by_name = {(row["section"], row["name"]): row for row in rows}
    assert by_name["person", "ana"]["cost"] == "66.40"
    assert by_name["person", "ana"]["previous_cost"] == "21.00"
    assert by_name["job", "StatefulSet/nb"]["idle_hours"] == "29.00"
    assert by_name["total", ""]["allocated_hours"] == "58.29"
    assert by_name["idle_claim", "vision/ben-notebook"]["longest_idle_hours"] == "28"


def test_the_email_to_the_leads(week_scenario: Team, settings: Any) -> None:
    settings.TALLY_PORTAL_URL = "https://tally.example.com/"
    report = week_report(team=week_scenario, start=WEEK, now=NOW)
    row = send_week_report(report=report, now=NOW)
    assert row is not None and row.sent_at == NOW
    [message] = mail.outbox
    # The team's leads with an address; not its members, not another team's lead.
    assert message.to == ["lead-a2@example.com", "lead-a@example.com"]
    assert row.recipients == message.to
    assert message.subject == "Tally week report: Vision, 2026-11-16 to 2026-11-22"
    body = message.body
    assert "https://tally.example.com/teams/vision/week/?start=2026-11-16" in body
    assert "GPU-hours: allocated 58.29 (+48.29), utilised 21.14 (+16.14), idle 36.71" in body
    assert "billed: 109.80 USD (+88.80 USD), of which idle time 50.60 USD" in body
    assert "ben: 30.00 / 1.00 / 29.00 / 0.00 GPU-hours; 43.40 USD; +30.00" in body
    assert "ana: 28.29 / 20.14 / 7.71 / 0.43 GPU-hours; 66.40 USD; +18.29" in body
    assert "StatefulSet/nb: 30.00 / 1.00 / 29.00 / 0.00 GPU-hours; 43.40 USD" in body
    assert (
        "vision/ben-notebook (ben): idle 28 h in a row from 2026-11-17 02:00 UTC; "
        "idle 29.00 GPU-hours in the week, billed 40.60 USD for it"
    ) in body
    assert "68.29 of 200 GPU-hours used in 2026-11 by the week's end (34%, soft)" in body
    assert "&" not in body.replace("&amp;", "")  # plain text, nothing escaped
    [(filename, content, mimetype)] = message.attachments
    assert filename == "tally-vision-week-2026-11-16.csv" and mimetype == "text/csv"
    assert "person,ana,gpu,GPU-hours,28.29,20.14,7.71,0.43,72.3,66.40" in content


def test_sent_once(week_scenario: Team) -> None:
    report = week_report(team=week_scenario, start=WEEK, now=NOW)
    assert send_week_report(report=report, now=NOW) is not None
    assert send_week_report(report=report, now=NOW + timedelta(hours=1)) is None
    assert len(mail.outbox) == 1
    assert WeekReport.objects.get().sent_at == NOW


def test_a_week_not_over_is_not_sent(week_scenario: Team) -> None:
    report = week_report(team=week_scenario, start=WEEK, now=WEEK + timedelta(days=3))
    with pytest.raises(WeekError, match="sent once the week is over"):
        send_week_report(report=report, now=WEEK + timedelta(days=3))
    assert mail.outbox == [] and not WeekReport.objects.exists()


class FailingBackend(LocmemBackend):
    """A mail server that refuses everything."""

    def send_messages(self, messages: Any) -> int:
        raise ConnectionRefusedError("the mail server is down")


def test_a_failed_email_is_tried_again(week_scenario: Team) -> None:
    report = week_report(team=week_scenario, start=WEEK, now=NOW)
    with (
        override_settings(EMAIL_BACKEND=f"{__name__}.FailingBackend"),
        pytest.raises(ConnectionRefusedError),
    ):
        send_week_report(report=report, now=NOW)
    assert not WeekReport.objects.exists()  # rolled back: the next run sends it
    assert send_week_report(report=report, now=NOW) is not None
    assert len(mail.outbox) == 1


def test_the_beat_task_sends_last_week_once(week_scenario: Team, settings: Any) -> None:
    settings.TALLY_WEEK_REPORT_HOUR = 6
    monday = WEEK + timedelta(days=7)
    assert send_week_reports(now=(monday + timedelta(hours=5, minutes=50)).isoformat()) == []
    assert mail.outbox == []
    sent = send_week_reports(now=(monday + timedelta(hours=6, minutes=50)).isoformat())
    assert sent == ["nlp", "vision"]  # nlp's lead gets nlp's week (empty), vision's theirs
    assert send_week_reports(now=(monday + timedelta(hours=7, minutes=50)).isoformat()) == []
    assert send_week_reports(now=NOW.isoformat()) == []  # Tuesday: the same week, sent
    assert sorted(message.to[0] for message in mail.outbox) == [
        "lead-a2@example.com",
        "lead-b@example.com",
    ]
    assert WeekReport.objects.filter(week_start=WEEK).count() == 2


class SlowBackend(LocmemBackend):
    """Locmem, slow to answer, so that two senders overlap while one is sending."""

    def send_messages(self, messages: Any) -> int:
        time.sleep(0.5)
        return super().send_messages(messages)


@pytest.mark.django_db(transaction=True)
def test_racing_workers_send_once() -> None:
    """Four workers (beat run twice, a retry) send the same week at once: one email."""
    team = build_week_scenario()
    report = week_report(team=team, start=WEEK, now=NOW)
    barrier = threading.Barrier(4)
    results: list[Any] = []
    errors: list[BaseException] = []

    def send() -> None:
        try:
            barrier.wait()
            results.append(send_week_report(report=report, now=NOW))
        except BaseException as error:  # reported by the test
            errors.append(error)
        finally:
            connection.close()

    with override_settings(EMAIL_BACKEND=f"{__name__}.SlowBackend"):
        threads = [threading.Thread(target=send) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    assert errors == []
    assert len(mail.outbox) == 1
    assert sum(result is not None for result in results) == 1
    assert WeekReport.objects.filter(team=team, sent_at__isnull=False).count() == 1


def test_hours_without_a_rate_card_are_counted_not_priced(week_scenario: Team) -> None:
    RateCard.objects.filter(profile="").delete()
    report = week_report(team=week_scenario, start=WEEK, now=NOW)
    [total] = report.totals
    assert total.week.allocated == Decimal("58.29")
    assert total.week.cost == {"USD": Decimal("7.60")}  # the slice's card only
    assert total.week.unpriced == Decimal("54.00")
    ben = next(row for row in report.people if row.name == "ben")
    assert ben.week.cost == {} and ben.week.cost_text == "—"
    send_week_report(report=report, now=NOW)
    assert "54.00 GPU-hours of models without a rate card" in mail.outbox[0].body


# --- manage.py week_report (issue 35, item 9) ---------------------------------------------------


def _command(*args: str) -> str:
    out = io.StringIO()
    call_command("week_report", *args, stdout=out)
    return out.getvalue()


def test_the_command_prints_the_week_as_text_csv_and_json(week_scenario: Team) -> None:
    report = week_report(team=week_scenario, start=WEEK, now=NOW)
    text = _command("--team", "vision", "--week", "2026-W47")
    assert text.startswith(f"{week_scenario.name}: the week from 2026-11-16 00:00 UTC")
    assert "allocated 58.29 (+48.29)" in text and "ben-notebook" in text
    # CSV: the email's attachment, byte for byte.
    expected = io.StringIO()
    write_csv(expected, columns=WEEK_CSV_COLUMNS, rows=week_csv_rows(report))
    assert _command("--team", "vision", "--start", "2026-11-16", "--format", "csv") == (
        expected.getvalue()
    )
    shown = json.loads(_command("--team", "vision", "--week", "2026-W47", "--format", "json"))
    assert (shown["team"], shown["start"], shown["end"]) == (
        "vision",
        "2026-11-16T00:00:00Z",
        "2026-11-23T00:00:00Z",
    )
    rows = {(row["section"], row["name"]): row for row in shown["rows"]}
    assert rows["total", ""]["allocated_hours"] == "58.29"
    assert rows["person", "ana"]["previous_allocated_hours"] == "10.00"
    assert shown["budget"]["period_label"] == "2026-11"
    # --start with its --end: the same week.
    assert (
        _command(
            "--team", "vision", "--start", "2026-11-16", "--end", "2026-11-23", "--format", "csv"
        )
        == expected.getvalue()
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--team", "nope"], "--team: no team 'nope'"),
        (["--team", "vision", "--week", "2026-47"], "--week: '2026-47' is not an ISO week"),
        (["--team", "vision", "--week", "2026-W47", "--start", "2026-11-16"], "not both"),
        (["--team", "vision", "--start", "2026-13-01"], "--start: '2026-13-01' is not a day"),
        (["--team", "vision", "--start", "9999-12-31"], "--start: '9999-12-31' is out of range"),
        (["--team", "vision", "--end", "2026-11-23"], "--end: give --start too"),
        (["--team", "vision", "--start", "2999-01-04"], "--start: 2999-01-04 is in the future"),
        (
            ["--team", "vision", "--start", "2026-11-16", "--end", "2026-11-09"],
            "--end: the window is reversed",
        ),
        (
            ["--team", "vision", "--start", "2026-11-16", "--end", "2026-11-16"],
            "--end: the window is empty",
        ),
        (
            ["--team", "vision", "--start", "2026-11-16", "--end", "2026-11-20"],
            "--end: a week report covers seven days: from 2026-11-16, --end is 2026-11-23",
        ),
    ],
)
def test_the_command_exits_2_naming_the_bad_option(
    week_scenario: Team, args: list[str], message: str
) -> None:
    with pytest.raises(CommandError, match=re.escape(message)) as caught:
        _command(*args)
    assert caught.value.returncode == 2
