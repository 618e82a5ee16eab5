"""Issue 34: the fleet page tells the truth about taints (read back from the cluster, through
the real client against the fake API server) and links the deviation register, which the
portal and /api/v1/ show to the right people only."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.conf import LazySettings
from django.contrib.auth.models import Group, User
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from kubernetes import client as k8s
from rest_framework.test import APIClient

from inventory import kube, taints
from inventory.models import Cluster, VersionBaseline, VersionDeviation
from teams.models import Membership, Role, Team
from teams.selectors import FINANCE_GROUP, OPERATORS_GROUP
from tests.deploy.fake_api import FakeApi
from tests.factories import ClusterFactory, DeviceFactory, NodeFactory

pytestmark = pytest.mark.django_db

OLD = {"driver_version": "570.172.8", "cuda_driver_version": "12.8.0"}
H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch, settings: LazySettings) -> Iterator[FakeApi]:
    """The cluster Tally runs in, `prod`, served by the fake API server."""
    settings.TALLY_CLUSTER_NAME = "prod"
    with FakeApi() as fake:
        monkeypatch.setattr(kube, "api_client", lambda **_: fake.api_client())
        yield fake


@pytest.fixture
def cluster() -> Cluster:
    """Four H100 nodes on 580.82.7 / 13.0.0; dgx-canary on 570.172.8; vm-1 publishes none."""
    cluster = ClusterFactory.create(name="prod")
    for name in ("dgx-0", "dgx-1", "dgx-2", "dgx-3"):
        DeviceFactory.create_batch(2, node=NodeFactory.create(cluster=cluster, name=name))
    DeviceFactory.create_batch(
        2, node=NodeFactory.create(cluster=cluster, name="dgx-canary"), **OLD
    )
    DeviceFactory.create_batch(
        2,
        node=NodeFactory.create(cluster=cluster, name="vm-1"),
        driver_version="",
        cuda_driver_version="",
    )
    return cluster


def user(name: str, *, group: str | None = None, lead_of: Team | None = None) -> User:
    created = User.objects.create_user(username=name)
    if group:
        created.groups.add(Group.objects.get_or_create(name=group)[0])
    if lead_of:
        Membership.objects.create(team=lead_of, user=created, role=Role.LEAD)
    return created


def portal(who: User) -> Client:
    client = Client()
    client.force_login(who)
    return client


def document_canary(cluster: Cluster, *, days: int = 14, node: str = "dgx-canary") -> None:
    VersionDeviation.objects.create(
        cluster=cluster,
        node_name=node,
        driver_version="570.172.08",
        reason="canary for the 570 branch",
        owner="gpu-platform",
        expires_at=timezone.now() + timedelta(days=days),
    )


def test_the_fleet_page_reads_the_taint_state_from_the_cluster(
    api: FakeApi, cluster: Cluster
) -> None:
    operator = portal(user("ops", group=OPERATORS_GROUP))

    before = operator.get(reverse("fleet"))
    [(target, state)] = before.context["taints"].rows
    assert (target.node, state) == ("dgx-canary", "planned, not applied")
    assert "planned, not applied" in before.content.decode()

    taints.apply_version_taints(cluster=cluster, api_client=api.api_client())
    after = operator.get(reverse("fleet"))

    [(target, state)] = after.context["taints"].rows
    assert state == "applied"
    assert 'class="taint-state"><span class="badge badge-ok">applied' in after.content.decode()


def test_rules_the_limit_holds_are_shown_held_read_or_not(
    api: FakeApi, cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A typo (508 for 580) would make every H100 node an outlier.
    VersionBaseline.objects.create(cluster=cluster, driver_version="508.82.7")
    operator = portal(user("ops", group=OPERATORS_GROUP))

    read = operator.get(reverse("fleet")).context["taints"]
    assert {state for _, state in read.rows} == {"held by the limit"} and len(read.rows) == 5

    def unreachable(**_: object) -> None:
        raise kube.KubeError("cannot load the Kubernetes configuration")

    monkeypatch.setattr(kube, "api_client", unreachable)
    unread = operator.get(reverse("fleet")).context["taints"]
    assert unread.error and {state for _, state in unread.rows} == {"held by the limit"}


def test_an_unreadable_cluster_says_the_taint_state_is_unknown(
    cluster: Cluster, settings: LazySettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings.TALLY_CLUSTER_NAME = "prod"

    def unreachable(**_: object) -> None:
        raise kube.KubeError("cannot load the Kubernetes configuration")

    monkeypatch.setattr(kube, "api_client", unreachable)
    page = portal(user("ops", group=OPERATORS_GROUP)).get(reverse("fleet")).content.decode()
    assert "Taint state unknown: the cluster's DeviceTaintRules could not be read" in page
    assert "unknown: the cluster could not be read" in page


def test_an_api_server_that_does_not_answer_is_said_so_not_a_500(
    cluster: Cluster, settings: LazySettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings.TALLY_CLUSTER_NAME = "prod"
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]

    def nowhere(**_: object) -> k8s.ApiClient:
        configuration = k8s.Configuration()
        configuration.host = f"http://127.0.0.1:{port}"
        configuration.retries = 0
        return k8s.ApiClient(configuration)

    monkeypatch.setattr(kube, "api_client", nowhere)
    operator = portal(user("ops", group=OPERATORS_GROUP))

    response = operator.get(reverse("fleet"))

    assert response.status_code == 200
    assert response.context["taints"].error
    assert "could not be read" in response.content.decode()
    register = operator.get(reverse("fleet-deviations"))
    assert register.status_code == 200


def test_the_banner_and_the_outlier_count_agree_and_unknown_is_apart(
    api: FakeApi, cluster: Cluster
) -> None:
    operator = portal(user("ops", group=OPERATORS_GROUP))
    undocumented = operator.get(reverse("fleet"))
    assert undocumented.context["versions"]["outlier_gpus"] == 2
    assert "2 outlier GPUs</strong> on 1 node" in undocumented.content.decode()

    document_canary(cluster)
    documented = operator.get(reverse("fleet"))

    page = documented.content.decode()
    [h100] = documented.context["versions"]["models"]
    # Green banner, and the model's outlier count says 0 with it; the 2 are documented.
    assert (h100["outlier_gpus"], h100["documented_gpus"]) == (0, 2)
    assert 'class="notice notice-ok" role="status" id="version-banner"' in page
    assert '<td data-label="Outlier GPUs" class="num outlier-gpus">0</td>' in page
    assert documented.context["versions"]["unknown_nodes"] == ["vm-1"]
    assert '<code class="unknown-node">vm-1</code>' in page
    assert reverse("fleet-deviations") in page
    # No claim of a taint the cluster does not hold.
    assert "kept out of general scheduling (taint" not in page


def test_the_deviation_register_lists_expiring_first_with_taint_state(
    api: FakeApi, cluster: Cluster
) -> None:
    document_canary(cluster, days=30)
    document_canary(cluster, days=3, node="dgx-gone")
    document_canary(cluster, days=-1, node="dgx-expired")
    taints.apply_version_taints(cluster=cluster, api_client=api.api_client())

    response = portal(user("ops", group=OPERATORS_GROUP)).get(reverse("fleet-deviations"))

    rows = [
        (row["node_name"], row["documented_gpus"], row["taint_state"])
        for row in response.context["deviations"]
    ]
    assert rows == [
        ("dgx-gone", 0, "no taint: it documents no GPU off its baseline"),
        ("dgx-canary", 2, "applied"),
        ("dgx-expired", 0, "expired: its GPUs are outliers again"),
    ]
    assert "canary for the 570 branch" in response.content.decode()


def test_the_register_is_for_operators_in_the_portal_and_finance_too_in_the_api(
    api: FakeApi, cluster: Cluster
) -> None:
    document_canary(cluster)
    team = Team.objects.create(slug="vision", name="Vision")
    lead, finance, operator = (
        user("lead", lead_of=team),
        user("fin", group=FINANCE_GROUP),
        user("ops", group=OPERATORS_GROUP),
    )
    for who, status in ((lead, 403), (finance, 403), (operator, 200)):
        assert portal(who).get(reverse("fleet-deviations")).status_code == status
    anonymous = Client().get(reverse("fleet-deviations"))
    assert anonymous.status_code == 302 and "/login/" in anonymous["Location"]

    url = "/api/v1/inventory/deviations/"
    tries: list[tuple[User | None, int]] = [
        (None, 401),
        (lead, 403),
        (finance, 200),
        (operator, 200),
    ]
    for caller, status in tries:
        client = APIClient()
        if caller is not None:
            client.force_authenticate(caller)
        assert client.get(url).status_code == status, caller
    client = APIClient()
    client.force_authenticate(finance)
    [row] = client.get(url).json()["results"]
    assert (row["node_name"], row["driver_version"], row["owner"], row["taint_state"]) == (
        "dgx-canary",
        "570.172.08",
        "gpu-platform",
        "planned, not applied",
    )
    assert client.get(url, {"cluster": "nope"}).status_code == 404


def test_the_registers_queries_do_not_grow_with_its_rows(
    api: FakeApi, cluster: Cluster, django_assert_max_num_queries: Any
) -> None:
    finance = APIClient()
    finance.force_authenticate(user("fin", group=FINANCE_GROUP))
    url = "/api/v1/inventory/deviations/"
    document_canary(cluster)
    with django_assert_max_num_queries(10):
        assert len(finance.get(url).json()["results"]) == 1
    for index in range(20):
        document_canary(cluster, days=index + 1, node=f"dgx-{index}")
    with django_assert_max_num_queries(10):
        assert len(finance.get(url).json()["results"]) == 21
