"""A week end to end on PostgreSQL (issue 19, "## Tests"): workloads created through the
workload webhook by several people, the objects the controllers make from them served by
`devtools.fake_kube` and imported by the real sync, claims made from templates charged through
their owners, a week of samples sent to the agents' endpoint, the rollup, the statements, and
then per person and per job figures to the hour and the cent, by the API (JSON and CSV), the
week report and its page, and the statement they add up to.

The week of Monday 2026-11-02 (2026-W45), team `vision` (namespace `team-a`), three H100s
(node-a: gpu-0, gpu-1; node-b: gpu-0), one rate card: 2.40 USD per GPU-hour, idle at half
price. The agents send a sample at :00, :20 and :40 of each hour, each held for 20 minutes
(TALLY_SAMPLE_HOLD_SECONDS=1200), so a measured hour's utilisation is the mean of its three.

- A, alice's Deployment `serve` (replica 1) on node-a/gpu-0, Monday 00:00 to the next Monday
  00:00: 168 h at 25% (20, 25, 30), except Saturday, when node-a's agent sent nothing: 24 h
  unmeasured. 36 h utilised, 108 idle, 24 unmeasured.
- B, bob's Job `train` (bob forged alice's name on it; the webhook put his back) on
  node-a/gpu-1, Tuesday 00:00 to Thursday 12:30: 60 h at 90% (100, 80, 90), then 12:00-12:30
  with two samples at 90% (12:00 held 20 min, 12:20 held to the release at 12:30): 27 min
  utilised. 60.5 h: 54.45 utilised, 6.05 idle.
- C, alice's Deployment `serve` (replica 2) on node-b/gpu-0, Wednesday 00:00 to Sunday 00:00
  (96 h): Wednesday and Thursday at 50% (40, 50, 60); Friday 00:00-10:00 at 0%; 10:00-14:00
  nothing (node-b's agent down): 4 h unmeasured; 14:00-24:00 at 50%; Saturday at 5% (not an
  idle hour: idle is below the team's percent, 5 by default). 30.2 h utilised, 61.8 idle, 4
  unmeasured; its longest idle run is Friday's 10 hours at 0%.

By hand, at 2.40 USD (utilised, unmeasured) and 1.20 USD (idle) per GPU-hour:

- alice (A + C): 264 h allocated, 66.2 utilised, 169.8 idle, 28 unmeasured:
  158.88 + 203.76 + 67.20 = 429.84 USD (idle at list price: 407.52).
- bob (B): 60.5 h, 54.45 utilised, 6.05 idle, 0 unmeasured: 130.68 + 7.26 = 137.94 USD
  (idle at list price: 14.52).
- The team: 324.5 h, 120.65 utilised, 175.85 idle, 28 unmeasured: 2.40 x (324.5 - 0.5 x
  175.85) = 567.78 USD = 429.84 + 137.94, the November statement's total.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import time_machine
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse

from billing import pricing
from billing.models import RateCard, Statement
from billing.week import WEEK_CSV_COLUMNS
from devtools.fake_kube import FakeKube
from frontend.week import week_report
from inventory import kube, kube_sync, services
from inventory.models import Allocation, Cluster, Device, ResourceClaim
from metering.hours import HOUR
from metering.models import UsageHour
from metering.rollup import rollup_hours
from metering.services import issue_agent_token
from teams.models import Membership, Role, Team, TeamNamespace
from tests.inventory.test_kube_sync import claim, resource_slice
from tests.quota.test_workloads import (
    CREATED_BY,
    NAMESPACE,
    REPLICASET_CONTROLLER,
    admitted,
    creator_at,
    from_template,
    made_by,
    pod_template,
    workload,
)

pytestmark = pytest.mark.django_db

MONDAY = datetime(2026, 11, 2, tzinfo=UTC)
TUESDAY, WEDNESDAY = MONDAY + timedelta(days=1), MONDAY + timedelta(days=2)
THURSDAY_1230 = MONDAY + timedelta(days=3, hours=12, minutes=30)
SUNDAY = MONDAY + timedelta(days=6)
NEXT_MONDAY = MONDAY + timedelta(days=7)
RECEIVED = NEXT_MONDAY + timedelta(minutes=5)  # the agents' batches, after the week
NOW = NEXT_MONDAY + timedelta(days=1, hours=10)  # Tuesday after: the reports are read
H100 = "NVIDIA H100 80GB HBM3"
DEPLOYMENT_CONTROLLER = "system:serviceaccount:kube-system:deployment-controller"
JOB_CONTROLLER = "system:serviceaccount:kube-system:job-controller"
PEOPLE = "/api/v1/billed/people/"
JOBS = "/api/v1/billed/jobs/"
WINDOW = {"start": "2026-11-02", "end": "2026-11-09"}

Obj = dict[str, Any]


# The scenario -------------------------------------------------------------------------------


def _template_claim(pod: Obj, suffix: str, *, node: str, device: str) -> Obj:
    """The claim the resource-claim controller makes for `pod` from its template, allocated."""
    made = claim(f"{pod['metadata']['name']}-gpu-{suffix}", node=node, device=device)
    made["metadata"]["annotations"] = {"resource.kubernetes.io/pod-claim-name": "gpu"}
    made["metadata"]["ownerReferences"] = [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": pod["metadata"]["name"],
            "uid": pod["metadata"]["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    return made


class Scenario:
    """The workloads as the webhook left them, and the objects the controllers made."""

    def __init__(self, client: Client) -> None:
        self.warnings: dict[str, list[str]] = {}
        # alice creates a Deployment; the Deployment controller makes its ReplicaSet (with
        # the Deployment's annotations and template), the ReplicaSet controller its Pods.
        deployment, self.warnings["deployment"] = admitted(
            client,
            workload("apps/v1", "Deployment", "serve", {"replicas": 2, "template": pod_template()}),
            username="alice",
        )
        deployment["metadata"]["uid"] = "uid-deployment-serve"
        self.deployment = deployment
        replica_set = from_template(
            "ReplicaSet", "apps/v1", "serve-5d8f", {"metadata": deployment["metadata"]}
        )
        replica_set["spec"] = {"replicas": 2, "template": deployment["spec"]["template"]}
        replica_set, self.warnings["replica_set"] = admitted(
            client, made_by(deployment, replica_set), username=DEPLOYMENT_CONTROLLER
        )
        self.replica_set = replica_set
        self.serve_pods = []
        for name in ("serve-5d8f-x2kq9", "serve-5d8f-y7w4m"):
            pod = made_by(
                replica_set, from_template("Pod", "v1", name, replica_set["spec"]["template"])
            )
            pod, self.warnings[name] = admitted(client, pod, username=REPLICASET_CONTROLLER)
            self.serve_pods.append(pod)
        # bob creates a Job that names alice as its creator, on it and on its template.
        forged = workload(
            "batch/v1", "Job", "train", {"template": pod_template(**{CREATED_BY: "alice"})}
        )
        forged["metadata"]["annotations"] = {CREATED_BY: "alice"}
        job, self.warnings["job"] = admitted(client, forged, username="bob")
        job["metadata"]["uid"] = "uid-job-train"
        self.job = job
        train_pod = made_by(job, from_template("Pod", "v1", "train-h8zxc", job["spec"]["template"]))
        self.train_pod, self.warnings["train-h8zxc"] = admitted(
            client, train_pod, username=JOB_CONTROLLER
        )
        self.claim_a = _template_claim(self.serve_pods[0], "q2wfx", node="node-a", device="gpu-0")
        self.claim_b = _template_claim(self.train_pod, "m4tzr", node="node-a", device="gpu-1")
        self.claim_c = _template_claim(self.serve_pods[1], "k9plb", node="node-b", device="gpu-0")


def _sync(api_client: Any, cluster: Cluster, at: datetime, *kinds: str) -> None:
    """One list of `kinds` by the real sync, at `at` (when allocations start and end)."""
    with time_machine.travel(at, tick=False):
        reports = kube_sync.sync(api_client=api_client, cluster=cluster, kinds=kinds, once=True)
    assert all(report.errors == [] for report in reports.values()), reports


def _hourly(first_hour: int, hours: int, utils: tuple[float, ...]) -> list[tuple[datetime, float]]:
    """Samples at :00, :20, :40 (as many as `utils` has) of `hours` hours from hour
    `first_hour` of the week."""
    return [
        (MONDAY + (first_hour + hour) * HOUR + timedelta(minutes=20 * index), util)
        for hour in range(hours)
        for index, util in enumerate(utils)
    ]


def _samples(meter_id: str, readings: list[tuple[datetime, float]]) -> list[Obj]:
    return [{"uuid": meter_id, "ts": ts.isoformat(), "gpu_util": util} for ts, util in readings]


def _send(client: Client, token: str, node: str, samples: list[Obj]) -> None:
    """A node's agent's batch, to the endpoint, with its token."""
    with time_machine.travel(RECEIVED, tick=False):
        response = client.post(
            "/ingest/samples",
            data={"node": node, "samples": samples},
            content_type="application/json",
            headers={"Authorization": f"Bearer {token}"},
        )
    assert response.status_code == 200, response.content
    body = response.json()
    assert (body["accepted"], body["duplicates"], body["rejected"]) == (len(samples), 0, [])
    assert body["unknown_devices"] == []


@pytest.fixture
def fake() -> Iterator[FakeKube]:
    with FakeKube(max_lifetime_seconds=120) as server:
        yield server


@pytest.fixture
def api_client(fake: FakeKube, tmp_path: Path) -> Iterator[Any]:
    client = kube.api_client(kubeconfig=str(fake.write_kubeconfig(tmp_path / "kubeconfig")))
    yield client
    client.close()


@pytest.fixture
def week(client: Client, fake: FakeKube, api_client: Any, settings: Any) -> Scenario:
    """The whole week: admitted, synced, sampled, rolled up and priced."""
    settings.TALLY_SAMPLE_HOLD_SECONDS = 1200
    team = Team.objects.create(slug="vision", name="Vision")
    TeamNamespace.objects.create(team=team, namespace=NAMESPACE)
    lead = User.objects.create_user("lena")
    Membership.objects.create(team=team, user=lead, role=Role.LEAD)
    Membership.objects.create(team=team, user=User.objects.create_user("alice"))
    RateCard.objects.create(
        product_name=H100,
        per_gpu_hour=Decimal("2.40"),
        idle_factor=Decimal("0.5"),
        currency="USD",
        valid_from=date(2026, 1, 1),
    )
    scenario = Scenario(client)
    cluster = services.get_cluster("lab")

    # Monday 00:00: the slices, and alice's first replica's claim.
    fake.add(resource_slice("node-a", "gpu-0", "gpu-1"))
    fake.add(resource_slice("node-b", "gpu-0"))
    fake.add(scenario.replica_set)
    fake.add(scenario.serve_pods[0])
    fake.add(scenario.claim_a)
    _sync(api_client, cluster, MONDAY, "ResourceSlice", "ResourceClaim")
    # Tuesday 00:00: bob's Job, its Pod and claim.
    fake.add(scenario.job)
    fake.add(scenario.train_pod)
    fake.add(scenario.claim_b)
    _sync(api_client, cluster, TUESDAY, "ResourceClaim")
    # Wednesday 00:00: alice's second replica.
    fake.add(scenario.serve_pods[1])
    fake.add(scenario.claim_c)
    _sync(api_client, cluster, WEDNESDAY, "ResourceClaim")
    # Released: bob's claim Thursday 12:30, the second replica's Sunday 00:00, the first's
    # at the week's end (its Pods are gone with them, as the controllers delete them).
    for at, released, pod in (
        (THURSDAY_1230, scenario.claim_b, scenario.train_pod),
        (SUNDAY, scenario.claim_c, scenario.serve_pods[1]),
        (NEXT_MONDAY, scenario.claim_a, scenario.serve_pods[0]),
    ):
        fake.delete("ResourceClaim", released["metadata"]["name"], namespace=NAMESPACE)
        fake.delete("Pod", pod["metadata"]["name"], namespace=NAMESPACE)
        _sync(api_client, cluster, at, "ResourceClaim")

    meter = {
        (node, name): meter_id
        for node, name, meter_id in Device.objects.values_list("node__name", "name", "meter_id")
    }
    # A: all week at 25%, but Saturday (hours 120-143), when node-a's agent was down.
    a_readings = _hourly(0, 120, (20, 25, 30)) + _hourly(144, 24, (20, 25, 30))
    # B: Tuesday 00:00 (hour 24) to Thursday 12:00 (hour 84) at 90%, then 12:00-12:30.
    b_readings = _hourly(24, 60, (100, 80, 90)) + _hourly(84, 1, (90, 90))
    node_a = _samples(meter["node-a", "gpu-0"], a_readings) + _samples(
        meter["node-a", "gpu-1"], b_readings
    )
    node_b = _samples(
        meter["node-b", "gpu-0"],
        _hourly(48, 48, (40, 50, 60))  # Wednesday and Thursday
        + _hourly(96, 10, (0, 0, 0))  # Friday 00:00-10:00; nothing 10:00-14:00
        + _hourly(110, 10, (40, 50, 60))  # Friday 14:00-24:00
        + _hourly(120, 24, (5, 5, 5)),  # Saturday
    )
    for node, samples in (("node-a", node_a), ("node-b", node_b)):
        with time_machine.travel(RECEIVED, tick=False):
            token = issue_agent_token(cluster=cluster, node=node, actor="ops")
        _send(client, token, node, samples)

    rollup_hours(hours=[MONDAY + hour * HOUR for hour in range(7 * 24)], now=RECEIVED)
    with time_machine.travel(RECEIVED, tick=False):
        pricing.refresh_statements(period=pricing.period_for(MONDAY))
    return scenario


def _lead() -> Client:
    client = Client()
    client.force_login(User.objects.get(username="lena"))
    return client


@pytest.fixture
def clock() -> Iterator[None]:
    with time_machine.travel(NOW, tick=False):
        yield


# The person behind every GPU-hour -----------------------------------------------------------


def test_the_webhook_and_the_sync_charge_each_hour_to_who_made_the_workload(
    week: Scenario,
) -> None:
    assert creator_at(week.deployment) == creator_at(week.deployment, "spec", "template") == "alice"
    assert creator_at(week.replica_set) == "alice"
    assert [creator_at(pod) for pod in week.serve_pods] == ["alice", "alice"]
    # The forged name is replaced by the requester's, on the Job and its template, and said so.
    assert creator_at(week.job) == creator_at(week.job, "spec", "template") == "bob"
    assert creator_at(week.train_pod) == "bob"
    # One warning: the Job and its template named the same person.
    assert week.warnings["job"] == [
        f"{CREATED_BY} names the user who creates the object: set to 'bob', not 'alice'"
    ]
    assert all(not warnings for name, warnings in week.warnings.items() if name != "job")

    claims = ResourceClaim.objects.order_by("name").values_list("name", "created_by", "job")
    assert list(claims) == [
        ("serve-5d8f-x2kq9-gpu-q2wfx", "alice", "Deployment/serve"),
        ("serve-5d8f-y7w4m-gpu-k9plb", "alice", "Deployment/serve"),
        ("train-h8zxc-gpu-m4tzr", "bob", "Job/train"),
    ]
    allocations = Allocation.objects.order_by("start").values_list(
        "claim__name", "device__node__name", "device__name", "claim__namespace", "username", "job",
        "start", "end",
    )  # fmt: skip
    assert list(allocations) == [
        ("serve-5d8f-x2kq9-gpu-q2wfx", "node-a", "gpu-0", NAMESPACE, "alice", "Deployment/serve",
         MONDAY, NEXT_MONDAY),
        ("train-h8zxc-gpu-m4tzr", "node-a", "gpu-1", NAMESPACE, "bob", "Job/train",
         TUESDAY, THURSDAY_1230),
        ("serve-5d8f-y7w4m-gpu-k9plb", "node-b", "gpu-0", NAMESPACE, "alice", "Deployment/serve",
         WEDNESDAY, SUNDAY),
    ]  # fmt: skip
    # Every usage row carries its person: none of the week's GPU-hours is nobody's.
    assert set(UsageHour.objects.values_list("username", flat=True)) == {"alice", "bob"}
    assert UsageHour.objects.count() == 168 + 61 + 96


# Per person and per job, billed --------------------------------------------------------------

FIGURES = ("allocated_gpu_hours", "utilised_gpu_hours", "idle_gpu_hours", "unmeasured_gpu_hours")
MONEY = ("billed_utilised", "billed_idle", "billed_unmeasured", "billed", "idle_at_list_price")
# By hand (see the module's docstring): hours, then USD.
ALICE = ("264", "66.2", "169.8", "28", "158.88", "203.76", "67.20", "429.84", "407.52")
BOB = ("60.5", "54.45", "6.05", "0", "130.68", "7.26", "0.00", "137.94", "14.52")


def _figures(row: dict[str, Any]) -> tuple[str, ...]:
    return (
        *(f"{Decimal(row[name]).normalize():f}" for name in FIGURES),
        *(row[name] for name in MONEY),
    )


def _get(client: Client, url: str, **query: str) -> Any:
    response = client.get(url, {**WINDOW, **query})
    assert response.status_code == 200, response.content
    return response


def test_per_person_and_per_job_to_the_hour_and_the_cent(week: Scenario, clock: None) -> None:
    client = _lead()
    people = _get(client, PEOPLE).json()["results"]
    assert {row["username"]: _figures(row) for row in people} == {"alice": ALICE, "bob": BOB}
    assert [row["username"] for row in people] == ["alice", "bob"]  # most billed first
    assert {(row["team"], row["unit"], row["currency"]) for row in people} == {
        ("vision", "gpu", "USD")
    }
    jobs = _get(client, JOBS).json()["results"]
    assert {row["job"]: (_figures(row), row["usernames"]) for row in jobs} == {
        "Deployment/serve": (ALICE, ["alice"]),
        "Job/train": (BOB, ["bob"]),
    }

    # The CSV has the JSON's rows and figures.
    for url, rows, key in ((PEOPLE, people, "username"), (JOBS, jobs, "job")):
        response = _get(client, url, format="csv")
        assert response["Content-Type"].startswith("text/csv")
        table = list(csv.DictReader(io.StringIO(response.content.decode())))
        assert {row[key]: _figures(row) for row in table} == {
            row[key]: _figures(row) for row in rows
        }

    # The people's billed totals add up to the statement: one line, the week's hours.
    statement = Statement.objects.get(team__slug="vision")
    assert (statement.period.start, statement.currency) == (
        datetime(2026, 11, 1, tzinfo=UTC),
        "USD",
    )
    assert statement.total == Decimal("567.78")
    assert sum(Decimal(row["billed"]) for row in people) == statement.total
    assert sum(Decimal(row["billed"]) for row in jobs) == statement.total
    (line,) = statement.lines.all()
    assert (
        line.product_name,
        line.allocated_gpu_hours,
        line.utilised_gpu_hours,
        line.unmeasured_gpu_hours,
        line.amount,
    ) == (H100, Decimal("324.5"), Decimal("120.65"), Decimal("28"), Decimal("567.78"))

    # Rolling the week up and pricing it again changes nothing.
    with time_machine.travel(RECEIVED, tick=False):
        rollup_hours(hours=[MONDAY + hour * HOUR for hour in range(7 * 24)], now=RECEIVED)
        pricing.refresh_statements(period=statement.period)
    assert Statement.objects.get(pk=statement.pk).total == Decimal("567.78")
    assert _get(client, PEOPLE).json()["results"] == people
    # alice is a member, not a lead: the team's money is not hers to read.
    member = Client()
    member.force_login(User.objects.get(username="alice"))
    assert member.get(PEOPLE, WINDOW).status_code == 403


# The week report ------------------------------------------------------------------------------


def test_the_week_report_and_its_page(week: Scenario, clock: None) -> None:
    team = Team.objects.get(slug="vision")
    report = week_report(team=team, start=MONDAY, now=NOW)
    usd = "USD"

    def shown(row: Any) -> tuple[Any, ...]:
        figures = row.week
        return (
            row.name,
            figures.allocated,
            figures.utilised,
            figures.idle,
            figures.unmeasured,
            figures.utilisation,
            figures.cost,
            figures.idle_cost,
            row.previous.allocated,
        )

    d = Decimal
    assert [shown(row) for row in report.totals] == [
        ("", d("324.50"), d("120.65"), d("175.85"), d("28.00"), d("40.7"),
         {usd: d("567.78")}, {usd: d("211.02")}, d("0.00")),
    ]  # fmt: skip
    assert [shown(row) for row in report.people] == [
        ("alice", d("264.00"), d("66.20"), d("169.80"), d("28.00"), d("28.1"),
         {usd: d("429.84")}, {usd: d("203.76")}, d("0.00")),
        ("bob", d("60.50"), d("54.45"), d("6.05"), d("0.00"), d("90.0"),
         {usd: d("137.94")}, {usd: d("7.26")}, d("0.00")),
    ]  # fmt: skip
    assert [(row.name, row.week.cost) for row in report.jobs] == [
        ("Deployment/serve", {usd: d("429.84")}),
        ("Job/train", {usd: d("137.94")}),
    ]
    # C's Friday morning at 0% is its longest idle run (Saturday at 5% is not below 5%); A
    # (25%) and B (90%) are never idle.
    (idle,) = report.idle_claims
    assert (idle.claim_name, idle.username, idle.job, idle.longest_hours, idle.idle_from) == (
        "serve-5d8f-y7w4m-gpu-k9plb", "alice", "Deployment/serve", 10, MONDAY + timedelta(days=4)
    )  # fmt: skip
    # C: 2.40 x (96 - 0.5 x 61.8).
    assert (idle.figures.allocated, idle.figures.idle, idle.figures.cost) == (
        d("96.00"), d("61.80"), {usd: d("156.24")}
    )  # fmt: skip

    client = _lead()
    page = client.get(reverse("team-week", args=["vision"]) + "?start=2026-11-02")
    assert page.status_code == 200
    html = page.content.decode()
    assert "the week from Mon 2 Nov 2026" in html
    assert "567.78 USD" in html
    people = html[html.index('id="week-people"') : html.index('id="jobs-heading"')]
    assert people.index(">alice<") < people.index(">bob<")
    assert "429.84 USD" in people and "137.94 USD" in people and "169.80" in people
    idle_part = html[html.index('id="week-idle"') :]
    assert "serve-5d8f-y7w4m-gpu-k9plb" in idle_part and "10 h" in idle_part

    response = client.get(reverse("team-week-csv", args=["vision"]) + "?start=2026-11-02")
    assert response.status_code == 200
    table = list(csv.reader(io.StringIO(response.content.decode())))
    assert tuple(table[0]) == WEEK_CSV_COLUMNS
    rows = {(row[0], row[1]): dict(zip(WEEK_CSV_COLUMNS, row, strict=True)) for row in table[1:]}
    wanted = ("allocated_hours", "utilised_hours", "idle_hours", "unmeasured_hours", "cost")
    assert {key: tuple(row[name] for name in wanted) for key, row in rows.items()} == {
        ("total", ""): ("324.50", "120.65", "175.85", "28.00", "567.78"),
        ("person", "alice"): ("264.00", "66.20", "169.80", "28.00", "429.84"),
        ("person", "bob"): ("60.50", "54.45", "6.05", "0.00", "137.94"),
        ("job", "Deployment/serve"): ("264.00", "66.20", "169.80", "28.00", "429.84"),
        ("job", "Job/train"): ("60.50", "54.45", "6.05", "0.00", "137.94"),
        ("idle_claim", "team-a/serve-5d8f-y7w4m-gpu-k9plb"): (
            "96.00", "30.20", "61.80", "4.00", "156.24"
        ),
    }  # fmt: skip
