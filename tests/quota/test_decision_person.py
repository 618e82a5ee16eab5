"""The person behind a denied template claim (issue 35, finding 1): the claim webhook reads
the `tally.dev/created-by` of the claim's Pod and of the Pod's Job when it decides, through its
cached reader of the API server, and records it on the decision, so the team page, the
decision log and the API name the person and not the resource-claim controller, though the
claim never exists. A read that fails leaves the controller, never the claim unanswered.

The API server is the project's fake (`devtools.fake_kube`), read with the real client."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from html import unescape
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from devtools.fake_kube import FakeKube, RecordedRequest
from inventory import kube, kube_owners
from inventory.owners import CREATED_BY_ANNOTATION
from quota.admission import service
from quota.models import AdmissionDecision, GangMode, GangPolicy, Webhook
from quota.selectors import with_people
from teams.models import Membership, Role
from tests.factories import ResourceClaimFactory
from tests.quota.fixtures import admit, claim, decide, gpu_request, make_team

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fleet")]

CONTROLLER = "system:serviceaccount:kube-system:resource-claim-controller"
NAMESPACE = "research"
DENIED = 'quota rule "all-gpus" (enforce) would be exceeded'
# The reader's (connect, read) timeouts here: a Pod the fake answers later than this is a
# timeout, quickly.
READ_TIMEOUT = (0.5, 0.3)


@pytest.fixture
def fake() -> Iterator[FakeKube]:
    with FakeKube(max_lifetime_seconds=60) as server:
        yield server


@pytest.fixture
def reader(fake: FakeKube, tmp_path: Path) -> Iterator[kube_owners.GangReader]:
    """The webhook reads the fake API server with the real client, as in a cluster."""
    api_client = kube.api_client(
        kubeconfig=str(fake.write_kubeconfig(tmp_path / "kubeconfig")), retries=0
    )
    objects = kube_owners.GangReader(api_client, request_timeout=READ_TIMEOUT)
    service.use_gang_lookup(objects)
    yield objects
    service.forget_caches()
    api_client.close()


@pytest.fixture
def team() -> Any:
    return make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 2}])


def _job(name: str, creator: str) -> dict[str, Any]:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "uid": f"uid-job-{name}",
            "annotations": {CREATED_BY_ANNOTATION: creator},
        },
    }


def _owned_by(owner: dict[str, Any], obj: dict[str, Any]) -> dict[str, Any]:
    obj["metadata"]["ownerReferences"] = [
        {
            "apiVersion": owner["apiVersion"],
            "kind": owner["kind"],
            "name": owner["metadata"]["name"],
            "uid": owner["metadata"]["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    return obj


def _pod(job: dict[str, Any], name: str) -> dict[str, Any]:
    """A Pod of `job`; it carries no creator of its own: the walk finds its Job's."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "uid": f"uid-pod-{name}"},
        "spec": {},
    }
    return _owned_by(job, pod)


def _template_claim(pod: dict[str, Any], gpus: int, suffix: str = "x7k2p") -> dict[str, Any]:
    """The claim the resource-claim controller makes from a template for `pod`."""
    body = claim(f"{pod['metadata']['name']}-gpu-{suffix}", [gpu_request(gpus)])
    return _owned_by(pod, body)


def _alices_pod(fake: FakeKube) -> dict[str, Any]:
    job = _job("train", "alice")
    pod = _pod(job, "train-0")
    fake.add(job)
    fake.add(pod)
    return pod


def _operator_and_lead(team: Any) -> tuple[Any, Any]:
    users = get_user_model().objects
    operator = users.create_user("op", is_superuser=True, is_staff=True)
    lead = users.create_user("lead")
    Membership.objects.create(team=team, user=lead, role=Role.LEAD)
    return operator, lead


def _shown_person(team: Any, decision: AdmissionDecision) -> tuple[str, str, str]:
    """The decision's person on the team page (the lead's), the decision log and the API."""
    operator, lead = _operator_and_lead(team)
    page = Client()
    page.force_login(lead)
    html = page.get(reverse("team", args=[team.slug])).content.decode()
    objections = html.split('id="objections"')[1].split("</section>")[0]
    row = next(r for r in objections.split("<tr>") if decision.name in r)
    cell = row.split('data-label="Person">')[1].split("</td>")[0]
    on_team_page = " ".join(unescape(re.sub(r"<[^>]+>", " ", cell)).split())
    log = Client()
    log.force_login(operator)
    logged = next(d for d in log.get(reverse("decisions")).context["page"] if d.pk == decision.pk)
    api = APIClient()
    api.force_authenticate(lead)
    rows = api.get("/api/v1/decisions/", {"team": team.slug}).json()["results"]
    person = next(r["person"] for r in rows if r["id"] == decision.pk)
    return on_team_page, logged.person, person


@pytest.mark.usefixtures("reader")
@pytest.mark.parametrize(("send", "webhook"), [(admit, Webhook.MUTATE), (decide, Webhook.VALIDATE)])
def test_a_denied_template_claim_names_the_person_of_its_pods_job(
    client: Client, fake: FakeKube, team: Any, send: Any, webhook: Webhook
) -> None:
    """Denied by the mutating webhook (both webhooks called) or the validating one."""
    pod = _alices_pod(fake)
    answer = send(client, _template_claim(pod, gpus=3), username=CONTROLLER)
    assert not answer["allowed"] and DENIED in answer["status"]["message"]
    decision = AdmissionDecision.objects.get()
    assert (decision.webhook, decision.username, decision.created_by) == (
        webhook,
        CONTROLLER,
        "alice",
    )
    on_team_page, logged, api = _shown_person(team, decision)
    assert on_team_page == f"alice via {CONTROLLER}"
    assert logged == api == "alice"


@pytest.mark.usefixtures("reader")
def test_an_admitted_template_claim_records_its_person_too(
    client: Client, fake: FakeKube, team: Any
) -> None:
    """The reserving statement records the decision of an admitted claim: with its person."""
    pod = _alices_pod(fake)
    assert decide(client, _template_claim(pod, gpus=1), username=CONTROLLER)["allowed"]
    decision = AdmissionDecision.objects.get()
    assert (decision.allowed, decision.created_by) == (True, "alice")


@pytest.mark.usefixtures("reader")
@pytest.mark.parametrize("gangs", [GangMode.ENFORCE, GangMode.OFF])
def test_the_pods_and_jobs_reads_are_kept_for_the_next_claims(
    client: Client, fake: FakeKube, team: Any, gangs: GangMode
) -> None:
    """Finding the gang (when the team weighs gangs) and the person read the Pod and its Job
    once, through the same cache, for every claim of the Pod."""
    GangPolicy.objects.create(team=team, mode=gangs)
    pod = _alices_pod(fake)
    for suffix in ("aaaaa", "bbbbb", "ccccc"):
        answer = admit(client, _template_claim(pod, 3, suffix), username=CONTROLLER)
        assert not answer["allowed"]
    assert set(AdmissionDecision.objects.values_list("created_by", flat=True)) == {"alice"}
    assert (len(fake.reads("Pod")), len(fake.reads("Job"))) == (1, 1)


@pytest.mark.usefixtures("reader")
def test_a_pod_that_is_not_there_leaves_the_controller(
    client: Client, fake: FakeKube, team: Any
) -> None:
    job = _job("train", "alice")
    fake.add(job)  # its Pod is gone (404)
    answer = admit(client, _template_claim(_pod(job, "train-0"), gpus=3), username=CONTROLLER)
    assert not answer["allowed"] and DENIED in answer["status"]["message"]
    decision = AdmissionDecision.objects.get()
    assert decision.created_by == ""
    assert [r.status for r in fake.reads("Pod")] == [404] and fake.reads("Job") == []
    on_team_page, logged, api = _shown_person(team, decision)
    assert on_team_page == logged == api == CONTROLLER


@pytest.mark.usefixtures("reader")
@pytest.mark.parametrize("gangs", [GangMode.ENFORCE, GangMode.OFF])
def test_a_pod_read_that_times_out_leaves_the_controller_and_the_answer_in_time(
    client: Client, fake: FakeKube, team: Any, gangs: GangMode
) -> None:
    """The Pod is read once (a read that just failed finding the gang is not made again)."""
    pod = _alices_pod(fake)

    def slow_pods(request: RecordedRequest) -> None:
        if request.read is not None and request.read[0] == "Pod":
            time.sleep(READ_TIMEOUT[1] + 0.7)

    GangPolicy.objects.create(team=team, mode=gangs)
    fake.on_request = slow_pods
    started = time.monotonic()
    answer = admit(client, _template_claim(pod, gpus=3), username=CONTROLLER)
    took = time.monotonic() - started
    assert not answer["allowed"] and DENIED in answer["status"]["message"]
    assert took < settings.TALLY_WEBHOOK_DEADLINE_MS / 1000
    decision = AdmissionDecision.objects.get()
    assert decision.created_by == "" and fake.reads("Job") == []
    assert len(fake.reads("Pod")) == 1
    on_team_page, logged, api = _shown_person(team, decision)
    assert on_team_page == logged == api == CONTROLLER


def test_no_read_starts_when_the_deadline_is_near_but_what_is_kept_is_used(
    fake: FakeKube, reader: kube_owners.GangReader
) -> None:
    pod = _alices_pod(fake)
    body = _template_claim(pod, gpus=3)
    near = time.monotonic() + service.PERSON_READ_SECONDS / 2
    assert service.claim_person(claim=body, username=CONTROLLER, deadline=near) == ""
    assert fake.reads("Pod") == [] and fake.reads("Job") == []
    later = time.monotonic() + 10
    assert service.claim_person(claim=body, username=CONTROLLER, deadline=later) == "alice"
    near = time.monotonic() + service.PERSON_READ_SECONDS / 2
    assert service.claim_person(claim=body, username=CONTROLLER, deadline=near) == "alice"
    assert (len(fake.reads("Pod")), len(fake.reads("Job"))) == (1, 1)


@pytest.mark.usefixtures("reader")
def test_a_claim_made_by_a_person_names_that_person_with_no_read(
    client: Client, fake: FakeKube, team: Any
) -> None:
    """A person is who made their claim, whatever its owners say: nothing is read for it (the
    team weighs no gangs, which would read the Pod)."""
    GangPolicy.objects.create(team=team, mode=GangMode.OFF)
    pod = _alices_pod(fake)
    answer = admit(client, _template_claim(pod, gpus=3), username="bob")
    assert not answer["allowed"]
    decision = AdmissionDecision.objects.get()
    assert (decision.username, decision.created_by) == ("bob", "")
    assert fake.reads("Pod") == []
    on_team_page, logged, api = _shown_person(team, decision)
    assert on_team_page == logged == api == "bob"


def test_with_no_api_server_a_template_claim_is_still_answered(client: Client, team: Any) -> None:
    """Outside a cluster (no lookup) the person is unknown: the controller is shown."""
    service.use_gang_lookup(None)
    body = _template_claim(_pod(_job("train", "alice"), "train-0"), gpus=3)
    answer = admit(client, body, username=CONTROLLER)
    assert not answer["allowed"]
    assert AdmissionDecision.objects.get().created_by == ""


def test_the_person_read_at_admission_comes_before_the_inventorys(team: Any) -> None:
    """What the webhook read when it decided is the decision's own record; what the sync
    found on a claim of that name later is used only where it read nothing (older decisions,
    owners unreadable then), and the requester where neither names anyone."""
    now = timezone.now()
    fields = {"at": now, "namespace": NAMESPACE, "username": CONTROLLER, "team": team}
    recorded = AdmissionDecision.objects.create(
        uid="a", name="a-gpu", allowed=True, created_by="alice", **fields
    )
    found = AdmissionDecision.objects.create(uid="b", name="b-gpu", allowed=True, **fields)
    unknown = AdmissionDecision.objects.create(uid="c", name="c-gpu", allowed=False, **fields)
    for name in ("a-gpu", "b-gpu"):
        ResourceClaimFactory(namespace=NAMESPACE, name=name, created_by="maria", first_seen=now)
    decisions = with_people(AdmissionDecision.objects.all())
    people = {d.pk: d.person for d in decisions}  # type: ignore[attr-defined]
    assert people == {recorded.pk: "alice", found.pk: "maria", unknown.pk: CONTROLLER}
