"""A ledger that is always true: a rule's usage is a recount of the live reservations and
allocations, whatever the order of claims, syncs and policy changes, and rules bind devices,
not device class names."""

from __future__ import annotations

import logging
import textwrap
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from decimal import Decimal
from io import StringIO
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.db import connection
from django.test import Client
from django.urls import reverse
from prometheus_client import REGISTRY

from inventory import services as inventory_services
from inventory.dumps import iter_objects
from quota import services
from quota.admission.service import review_claim
from quota.admission.shapes import forget_fleet_shapes
from quota.models import QuotaRule, Reservation, ReservationLine, ReservationState
from quota.policy import apply_policy, load_policy
from quota.tasks import reconcile_quotas
from teams.models import Team, TeamNamespace
from tests.fixtures import DRA
from tests.quota.fixtures import AT, mig_device, nvidia_gpu, nvidia_slice

pytestmark = pytest.mark.django_db

H100 = 'device.attributes["gpu.nvidia.com"].productName.startsWith("NVIDIA H100")'
A100 = 'device.attributes["gpu.nvidia.com"].productName.startsWith("NVIDIA A100")'
NVIDIA = "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com']"


def device_class(name: str, expression: str, extended: str = "") -> dict[str, Any]:
    spec: dict[str, Any] = {"selectors": [{"cel": {"expression": expression}}]}
    if extended:
        spec["extendedResourceName"] = extended
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": spec,
    }


# Classes a cluster's admin may add, selecting devices that the NVIDIA driver's classes select
# too: an extended-resource class for whole H100s, one for 1g.5gb MIG devices, and another name
# for the GPUs bound to vfio-pci.
ALIASES = [
    device_class(
        "gpu-h100.example.com",
        f"{NVIDIA}.type == 'gpu' && {NVIDIA}.productName.startsWith('NVIDIA H100')",
        extended="example.com/h100",
    ),
    device_class(
        "mig-1g-5gb.gpu.nvidia.com",
        f"{NVIDIA}.type == 'mig' && {NVIDIA}.profile == '1g.5gb'",
        extended="nvidia.com/mig-1g.5gb",
    ),
    device_class("gpu-vfio.example.com", "device.attributes['gpu.nvidia.com'].type == 'vfio'"),
]


def vfio_gpu(index: int) -> dict[str, Any]:
    gpu = nvidia_gpu(index, "vm-a", "NVIDIA H100 80GB HBM3", "80Gi")
    gpu["name"] = f"gpu-vfio-{index}"
    gpu["attributes"]["type"] = {"string": "vfio"}
    return gpu


def ledger_fleet_objects() -> list[dict[str, Any]]:
    """Eight whole H100s, two A100s, MIG devices of an A100, two H100s bound to vfio-pci, the
    NVIDIA driver's classes and the aliases."""
    h100 = [nvidia_gpu(i, "h100-a", "NVIDIA H100 80GB HBM3", "80Gi") for i in range(8)]
    a100 = [nvidia_gpu(i, "a100-a", "NVIDIA A100-SXM4-80GB", "80Gi") for i in range(2)]
    migs = [
        mig_device("gpu-0-mig-1g5gb-19-0", "GPU-mig-0", "1g.5gb", "4864Mi", 14),
        mig_device("gpu-0-mig-1g5gb-19-1", "GPU-mig-0", "1g.5gb", "4864Mi", 14),
        mig_device("gpu-0-mig-1g5gb-19-2", "GPU-mig-0", "1g.5gb", "4864Mi", 14),
        mig_device("gpu-0-mig-3g20gb-9-4", "GPU-mig-0", "3g.20gb", "19968Mi", 42),
    ]
    return [
        *iter_objects(DRA / "deviceclasses-nvidia.yaml"),
        *ALIASES,
        nvidia_slice("h100-a", h100),
        nvidia_slice("a100-a", a100),
        nvidia_slice("mig-a", migs),
        nvidia_slice("vm-a", [vfio_gpu(0), vfio_gpu(1)]),
    ]


@pytest.fixture(autouse=True)
def ledger_fleet() -> None:
    forget_fleet_shapes()
    report = inventory_services.import_snapshot(
        cluster=inventory_services.get_cluster(settings.TALLY_CLUSTER_NAME),
        objects=ledger_fleet_objects(),
        at=AT,
    )
    assert report.errors == []


Quota = tuple[str, str, str, Any]  # name, device class, selector, GPUs


def team(slug: str = "vision", namespaces: tuple[str, ...] = ("vision",), *quotas: Quota) -> Any:
    return {"slug": slug, "namespaces": list(namespaces), "quotas": list(quotas)}


def policy(*teams: dict[str, Any]) -> str:
    """A policy file of `teams` (see `team`)."""
    lines = ["teams:"]
    for spec in teams:
        lines += [
            f"- slug: {spec['slug']}",
            f"  name: {spec['slug'].title()}",
            f"  namespaces: [{', '.join(spec['namespaces'])}]",
            "  quotas:" if spec["quotas"] else "  quotas: []",
        ]
        for name, device_class_name, selector, gpus in spec["quotas"]:
            lines += [f"  - name: {name}", f"    deviceClass: {device_class_name}"]
            if selector:
                lines.append(f"    selector: '{selector}'")
            lines.append(f"    gpus: {gpus}")
    return "\n".join(lines) + "\n"


def apply(text: str, *, prune: bool = False) -> Any:
    return apply_policy(
        policy=load_policy(textwrap.dedent(text)), prune=prune, actor="tester", dry_run=False
    )


def claim_body(
    name: str, namespace: str, *, count: int = 1, device_class: str = "gpu.nvidia.com"
) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "devices": {
                "requests": [
                    {"name": "gpu", "exactly": {"deviceClassName": device_class, "count": count}}
                ]
            }
        },
    }


def admit(name: str, namespace: str, **kwargs: Any) -> bool:
    """Whether the validating webhook admits the claim (reserving what it can take)."""
    return review_claim(claim=claim_body(name, namespace, **kwargs), at=AT).allowed


def seen(
    name: str,
    namespace: str,
    devices: list[tuple[str, str]],
    *,
    device_class: str = "gpu.nvidia.com",
    count: int | None = None,
) -> None:
    """The sync sees the claim, allocated `devices` (pool, device) or pending when empty."""
    body = claim_body(name, namespace, count=count or len(devices) or 1, device_class=device_class)
    body["metadata"]["uid"] = f"uid-{namespace}-{name}"
    if devices:
        body["status"] = {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": "gpu", "driver": "gpu.nvidia.com", "pool": pool, "device": d}
                        for pool, d in devices
                    ]
                }
            }
        }
    report = inventory_services.apply_watch_event(
        cluster=inventory_services.get_cluster(settings.TALLY_CLUSTER_NAME),
        event_type="ADDED",
        obj=body,
        at=AT + timedelta(minutes=1),
    )
    assert report.errors == []


def hold_h100s(namespace: str, how_many: int = 8, *, device_class: str = "gpu.nvidia.com") -> None:
    for index in range(how_many):
        seen(f"train-{index}", namespace, [("h100-a", f"gpu-{index}")], device_class=device_class)


def in_use(team: str) -> dict[str, Decimal]:
    return {
        name: value.normalize()
        for name, value in QuotaRule.objects.filter(team__slug=team).values_list("name", "in_use")
    }


def metric(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


def assert_ledger_true() -> None:
    """Every rule's usage is the sum of its live lines and a recount changes nothing."""
    drifted = [count for count in services.reconcile_usage(at=AT, fix=False) if count.drifted]
    assert drifted == []


@pytest.fixture
def ops_client() -> Client:
    user = get_user_model().objects.create_superuser("ops-admin", "ops@example.com", "x")
    client = Client()
    client.force_login(user)
    return client


def inline(prefix: str, total: int = 0, initial: int = 0) -> dict[str, Any]:
    return {
        f"{prefix}-TOTAL_FORMS": total,
        f"{prefix}-INITIAL_FORMS": initial,
        f"{prefix}-MIN_NUM_FORMS": 0,
        f"{prefix}-MAX_NUM_FORMS": 1000,
    }


H100_RULE: Quota = ("h100", "gpu.nvidia.com", H100, 8)
ALL_GPUS: Quota = ("gpus", "gpu.nvidia.com", "", 16)
VISION_H100 = team("vision", ("vision",), H100_RULE)


# --- Finding 1: usage does not depend on the order of events ----------------------------------


def test_a_policy_applied_after_the_sync_counts_the_claims_already_allocated() -> None:
    hold_h100s("vision")  # Tally installed on a running cluster, synced before any policy

    apply(policy(VISION_H100))

    assert in_use("vision") == {"h100": 8}
    reservations = Reservation.objects.filter(namespace="vision")
    assert {r.state for r in reservations} == {ReservationState.ALLOCATED}
    assert reservations.count() == 8
    assert not admit("more", "vision")  # 8 of 8 H100s held: the next one is denied
    assert_ledger_true()


def test_a_rule_added_later_counts_what_the_team_holds() -> None:
    apply(policy(team()))
    hold_h100s("vision")
    assert admit("before", "vision")  # no rule yet: admitted, held as a reservation
    seen("before", "vision", [])  # pending

    apply(policy(VISION_H100))

    assert in_use("vision") == {"h100": 9}  # 8 allocated, 1 reserved
    assert not admit("more", "vision")
    assert_ledger_true()


def test_a_changed_selector_recounts_the_rule() -> None:
    apply(policy(team("vision", ("vision",), ("h100", "gpu.nvidia.com", A100, 8))))
    hold_h100s("vision")
    assert in_use("vision") == {"h100": 0}  # the rule counts A100s

    apply(policy(VISION_H100))

    assert in_use("vision") == {"h100": 8}
    assert not admit("more", "vision")
    assert_ledger_true()


def test_a_changed_device_class_recounts_the_rule() -> None:
    apply(policy(team("vision", ("vision",), ("h100", "mig.nvidia.com", "", 8))))
    hold_h100s("vision")
    assert in_use("vision") == {"h100": 0}

    apply(policy(team("vision", ("vision",), ("h100", "gpu.nvidia.com", "", 8))))

    assert in_use("vision") == {"h100": 8}
    assert not admit("more", "vision")
    assert_ledger_true()


def test_a_namespace_moved_to_another_team_counts_for_its_new_team() -> None:
    apply(policy(team("vision", ("vision", "shared"), H100_RULE), team("nlp", ("nlp",), H100_RULE)))
    hold_h100s("shared")
    assert (in_use("vision"), in_use("nlp")) == ({"h100": 8}, {"h100": 0})

    apply(policy(VISION_H100, team("nlp", ("nlp", "shared"), H100_RULE)))

    assert (in_use("vision"), in_use("nlp")) == ({"h100": 0}, {"h100": 8})
    assert set(
        Reservation.objects.filter(namespace="shared").values_list("team__slug", flat=True)
    ) == {"nlp"}
    assert not admit("more", "nlp")  # nlp holds 8 of 8
    assert admit("more", "vision")  # vision holds none now
    assert_ledger_true()


def test_the_webhook_decides_a_moved_namespace_by_its_current_owner_only() -> None:
    """Ownership is dated (issue 33): the namespace's past owner is kept, and the webhook's
    read must take only the current one's rules."""
    apply(policy(team("vision", ("vision", "shared"), H100_RULE), team("nlp", ("nlp",), H100_RULE)))
    hold_h100s("vision")  # vision holds 8 of its 8; nlp none of its 8
    apply(policy(VISION_H100, team("nlp", ("nlp", "shared"), H100_RULE)))

    assert admit("more", "shared")  # nlp's namespace now, and nlp has room
    assert not admit("more", "vision")  # vision is full
    assert in_use("nlp") == {"h100": 1}
    assert_ledger_true()


def test_a_namespace_added_to_a_team_adopts_its_allocated_claims() -> None:
    apply(policy(VISION_H100))
    hold_h100s("vision-dev", 3)
    assert in_use("vision") == {"h100": 0}

    apply(policy(team("vision", ("vision", "vision-dev"), H100_RULE)))

    assert in_use("vision") == {"h100": 3}
    assert_ledger_true()


def test_a_reserved_claim_is_recounted_from_its_spec_when_a_rule_changes() -> None:
    apply(policy(team("vision", ("vision",), ALL_GPUS)))
    assert admit("pending", "vision", count=2)
    seen("pending", "vision", [], count=2)  # the sync sees it, not yet allocated

    apply(policy(team("vision", ("vision",), ALL_GPUS, ("h100", "gpu.nvidia.com", H100, 1))))

    # A policy change may put a rule past its limit; admissions are denied until it is under.
    assert in_use("vision") == {"gpus": 2, "h100": 2}
    assert not admit("more", "vision")
    assert_ledger_true()


def test_a_reservation_the_sync_has_not_seen_is_recounted_when_it_does() -> None:
    apply(policy(team("vision", ("vision",), ALL_GPUS)))
    assert admit("early", "vision", count=2)
    # A rule added before the sync saw the claim: the claim's requests are not known yet, so
    # its reservation keeps the lines it has ...
    apply(policy(team("vision", ("vision",), ALL_GPUS, H100_RULE)))
    assert in_use("vision") == {"gpus": 2, "h100": 0}

    seen("early", "vision", [], count=2)  # ... until the sync sees it

    assert in_use("vision") == {"gpus": 2, "h100": 2}
    assert_ledger_true()


def test_a_lower_limit_is_allowed_but_then_admissions_are_denied() -> None:
    apply(policy(VISION_H100))
    hold_h100s("vision", 4)

    apply(policy(team("vision", ("vision",), ("h100", "gpu.nvidia.com", H100, 2))))

    assert in_use("vision") == {"h100": 4}
    assert not admit("more", "vision")
    assert_ledger_true()


def test_a_deleted_namespace_counts_for_no_team() -> None:
    apply(policy(team("vision", ("vision", "old"), H100_RULE)))
    hold_h100s("old", 2)
    assert in_use("vision") == {"h100": 2}

    apply(policy(VISION_H100), prune=True)

    assert in_use("vision") == {"h100": 0}
    assert_ledger_true()


def test_a_rule_added_in_the_admin_counts_what_the_team_holds(ops_client: Client) -> None:
    apply(policy(team()))
    hold_h100s("vision")
    vision = Team.objects.get(slug="vision")

    response = ops_client.post(
        reverse("admin:quota_quotarule_add"),
        {"team": vision.pk, "name": "h100", "device_class": "gpu.nvidia.com", "selector": H100,
         "unit": "gpus", "limit": "8", "mode": "enforce"},
    )  # fmt: skip

    assert response.status_code == 302, response.content
    assert in_use("vision") == {"h100": 8}
    assert not admit("more", "vision")
    assert_ledger_true()


def test_a_selector_changed_in_the_admin_recounts_the_rule(ops_client: Client) -> None:
    apply(policy(team("vision", ("vision",), ("h100", "gpu.nvidia.com", A100, 8))))
    hold_h100s("vision")
    rule = QuotaRule.objects.get()

    response = ops_client.post(
        reverse("admin:quota_quotarule_change", args=[rule.pk]),
        {"name": "h100", "device_class": "gpu.nvidia.com", "selector": H100, "unit": "gpus",
         "limit": "8", "mode": "enforce"},
    )  # fmt: skip

    assert response.status_code == 302, response.content
    assert in_use("vision") == {"h100": 8}
    assert_ledger_true()


def test_a_namespace_added_in_the_admin_adopts_its_allocated_claims(ops_client: Client) -> None:
    apply(policy(VISION_H100))
    hold_h100s("vision-dev", 3)
    vision = Team.objects.get(slug="vision")
    namespace = TeamNamespace.objects.get(namespace="vision")
    rule = QuotaRule.objects.get()
    data = {
        "slug": "vision",
        "name": "Vision",
        "cost_centre": "",
        **inline("namespaces", total=2, initial=1),
        "namespaces-0-id": namespace.pk,
        "namespaces-0-team": vision.pk,
        "namespaces-0-namespace": "vision",
        "namespaces-1-team": vision.pk,
        "namespaces-1-namespace": "vision-dev",
        **inline("memberships"),
        **inline("rules", total=1, initial=1),
        "rules-0-id": rule.pk,
        "rules-0-team": vision.pk,
        "rules-0-name": "h100",
        "rules-0-device_class": "gpu.nvidia.com",
        "rules-0-selector": H100,
        "rules-0-unit": "gpus",
        "rules-0-limit": "8",
        "rules-0-mode": "enforce",
    }

    response = ops_client.post(reverse("admin:teams_team_change", args=[vision.pk]), data)

    assert response.status_code == 302, response.context and response.context["errors"]
    assert in_use("vision") == {"h100": 3}
    assert_ledger_true()


# --- Finding 2: rules bind devices, not device class names ------------------------------------


def test_an_extended_resource_class_for_the_same_gpus_is_counted_and_denied_when_full() -> None:
    apply(policy(VISION_H100))

    for index in range(8):
        assert admit(f"alias-{index}", "vision", device_class="gpu-h100.example.com")

    assert in_use("vision") == {"h100": 8}
    assert not admit("alias-more", "vision", device_class="gpu-h100.example.com")
    assert not admit("direct", "vision")
    assert_ledger_true()


def test_claims_allocated_through_an_alias_class_are_counted() -> None:
    apply(policy(VISION_H100))

    hold_h100s("vision", device_class="gpu-h100.example.com")

    assert in_use("vision") == {"h100": 8}
    assert not admit("more", "vision")
    assert_ledger_true()


def test_another_class_for_the_vfio_gpus_is_counted() -> None:
    apply(policy(team("vision", ("vision",), ("vm", "vfio.gpu.nvidia.com", "", 2))))

    assert admit("vm-0", "vision", device_class="gpu-vfio.example.com")
    assert admit("vm-1", "vision", device_class="vfio.gpu.nvidia.com")

    assert in_use("vision") == {"vm": 2}
    assert not admit("vm-2", "vision", device_class="gpu-vfio.example.com")
    assert_ledger_true()


def test_an_extended_resource_class_for_mig_devices_is_counted() -> None:
    apply(policy(team("vision", ("vision",), ("mig", "mig.nvidia.com", "", "0.3"))))

    assert admit("mig-0", "vision", device_class="mig-1g-5gb.gpu.nvidia.com")
    assert admit("mig-1", "vision", device_class="mig-1g-5gb.gpu.nvidia.com")

    assert in_use("vision") == {"mig": Decimal("0.285714")}  # two 1g of seven
    assert not admit("mig-2", "vision", device_class="mig-1g-5gb.gpu.nvidia.com")
    assert_ledger_true()


def test_a_rule_does_not_count_devices_its_class_does_not_select() -> None:
    # The rule's class narrows what it covers: MIG devices are not whole GPUs.
    apply(policy(team("vision", ("vision",), ("gpus", "gpu.nvidia.com", "", 1))))

    assert admit("mig-0", "vision", device_class="mig.nvidia.com")
    assert admit("vm-0", "vision", device_class="vfio.gpu.nvidia.com")

    assert in_use("vision") == {"gpus": 0}


# --- Reconciliation -----------------------------------------------------------------------------


def test_reconcile_check_reports_drift_and_fix_repairs_it(caplog: Any) -> None:
    apply(policy(VISION_H100))
    hold_h100s("vision", 3)
    rule = QuotaRule.objects.get()
    QuotaRule.objects.filter(pk=rule.pk).update(in_use=5)  # a bug, or a hand edit
    ReservationLine.objects.filter(reservation__name="train-0").delete()
    fixed_before = metric("tally_quota_drift_fixed_total")

    out = StringIO()
    with pytest.raises(CommandError) as caught:
        call_command("reconcile_quotas", "--check", stdout=out)

    assert caught.value.returncode == 1
    assert out.getvalue().splitlines() == [
        f"quota rule vision/h100 (id {rule.pk}): stored in_use 5, recounted 3 (1 line differs)"
    ]
    assert QuotaRule.objects.get().in_use == 5  # --check writes nothing
    assert metric("tally_quota_drift_rules") == 1

    with caplog.at_level(logging.WARNING, logger="quota.services"):
        out = StringIO()
        call_command("reconcile_quotas", stdout=out)
    assert "drift fixed" in out.getvalue()
    assert "vision/h100" in caplog.text and "stored in_use 5, recounted 3" in caplog.text
    assert QuotaRule.objects.get().in_use == 3
    assert ReservationLine.objects.filter(reservation__name="train-0").count() == 1
    assert metric("tally_quota_drift_fixed_total") == fixed_before + 1

    out = StringIO()
    call_command("reconcile_quotas", "--check", stdout=out)
    assert out.getvalue().splitlines() == ["1 quota rule recounted: no drift"]
    assert metric("tally_quota_drift_rules") == 0


def test_the_reconcile_task_fixes_drift_and_is_scheduled() -> None:
    apply(policy(VISION_H100))
    hold_h100s("vision", 2)
    QuotaRule.objects.update(in_use=0)

    assert reconcile_quotas.apply().get() == 1

    assert in_use("vision") == {"h100": 2}
    assert any(
        entry["task"] == "quota.tasks.reconcile_quotas"
        for entry in settings.CELERY_BEAT_SCHEDULE.values()
    )


# --- Under concurrency ----------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_policy_changes_racing_admissions_and_the_sync_neither_deadlock_nor_drift() -> None:
    rules = (ALL_GPUS, ("h100", "gpu.nvidia.com", H100, 100))
    apply(policy(team("vision", ("vision",), *rules)))
    hold_h100s("vision", 2)
    changes = [
        policy(team("vision", ("vision",), ALL_GPUS, ("h100", "gpu.nvidia.com", selector, 100)))
        for selector in (A100, H100, "", H100)
    ]

    def admission(index: int) -> Callable[[], bool]:
        return lambda: admit(f"racing-{index}", "vision")

    def change(text: str) -> Callable[[], Any]:
        return lambda: apply(text)

    def sync(index: int) -> Callable[[], None]:
        return lambda: seen(f"train-{index}", "vision", [("h100-a", f"gpu-{index}")])

    calls: list[Callable[[], Any]] = [admission(i) for i in range(24)]
    calls[3::6] = [change(text) for text in changes]
    calls[5::12] = [sync(i) for i in range(2)]

    def run(call: Callable[[], Any]) -> Any:
        try:
            return call()
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=12) as pool:
        list(pool.map(run, calls))  # any error (a deadlock, a lock timeout) fails the test

    admitted = Reservation.objects.filter(name__startswith="racing-").values_list("name", flat=True)
    for name in admitted:
        seen(name, "vision", [])  # an admission planned before a change is recounted here
    assert_ledger_true()
    assert in_use("vision")["gpus"] == 2 + len(admitted)
