"""Who is charged for an hour: the team that owned its namespace in that hour (issue 33,
finding 1). Ownership is dated; a namespace's first owner takes its unowned hours in open
periods, so installing Tally on a running cluster and writing the policy afterwards bills the
same, to the cent, as the policy written first; hours no team owned are shown as unowned."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
import time_machine
from django.db import transaction
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from billing import services
from billing.models import Period, RateCard, Statement, StatementLine
from billing.selectors import unowned_usage
from inventory import services as inventory_services
from metering import ingest, rollup
from metering.hours import epoch_ms, hours_between
from metering.ingest import SampleRow
from metering.models import UsageHour
from quota.policy import apply_policy, load_policy
from teams.models import AuditEntry, Team, TeamNamespace
from teams.ownership import assign_namespace
from tests.fixtures import DRA
from tests.quota.fixtures import forget_fleet_shapes, iter_objects, nvidia_gpu, nvidia_slice

pytestmark = pytest.mark.django_db

H100 = "NVIDIA H100 80GB HBM3"
NOVEMBER = datetime(2026, 11, 1, tzinfo=UTC)
OCTOBER = datetime(2026, 10, 1, tzinfo=UTC)
CLAIMS_START = datetime(2026, 11, 10, 8, tzinfo=UTC)  # when the sync first saw the claims
BILL_AT = datetime(2026, 11, 14, tzinfo=UTC)
POLICY = """\
teams:
- slug: vision
  name: Vision
  namespaces: [vision]
- slug: nlp
  name: NLP
  namespaces: [nlp]
rates:
- productName: NVIDIA H100 80GB HBM3
  perGpuHour: "2.50"
  idleFactor: "0.4"
  currency: USD
  from: 2026-01-01
"""
# Two of vision's GPUs and one of nlp's, held since CLAIMS_START; gpu-0 measured.
CLAIMS = (("train", "vision", 0), ("serve", "vision", 1), ("bert", "nlp", 2))


def allocated_claim(name: str, namespace: str, device: int) -> dict[str, Any]:
    result = {
        "request": "gpu",
        "driver": "gpu.nvidia.com",
        "pool": "node-a",
        "device": f"gpu-{device}",
    }
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}"},
        "spec": {
            "devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]
            }
        },
        "status": {"allocation": {"devices": {"results": [result]}}},
    }


def sync_fleet() -> None:
    gpus = [nvidia_gpu(i, "node-a", H100, "80Gi") for i in range(3)]
    objects = [
        *iter_objects(DRA / "deviceclasses-nvidia.yaml"),
        nvidia_slice("node-a", gpus),
        *(allocated_claim(*spec) for spec in CLAIMS),
    ]
    report = inventory_services.import_snapshot(
        cluster=inventory_services.get_cluster("default"), objects=objects, at=CLAIMS_START
    )
    assert report.errors == []


def apply_the_policy() -> None:
    apply_policy(policy=load_policy(textwrap.dedent(POLICY)), prune=False, actor="ops")


def send_samples() -> None:
    start = epoch_ms(CLAIMS_START)
    rows = [
        SampleRow("GPU-node-a-0", start + minute * 60_000, 30.0 + minute % 50, None, None)
        for minute in range(0, 24 * 60, 5)
    ]
    ingest.ingest(node="node-a", samples=rows, received_at=CLAIMS_START + timedelta(days=1))


def bill() -> None:
    services.bill_period(period_start=NOVEMBER, now=BILL_AT)


def close_october() -> None:
    """October closed, priced by the card the policy declares (so the policy may keep it)."""
    RateCard.objects.create(
        product_name=H100,
        currency="USD",
        valid_from=date(2026, 1, 1),
        per_gpu_hour=Decimal("2.50"),
        idle_factor=Decimal("0.4"),
    )
    Period.objects.create(
        start=OCTOBER, end=NOVEMBER, closed_at=NOVEMBER + timedelta(days=2), closed_by="finance"
    )


def statements() -> dict[tuple[str, str], Decimal]:
    return {
        (statement.team.slug, statement.currency): statement.total
        for statement in Statement.objects.select_related("team")
    }


def lines() -> list[tuple[Any, ...]]:
    return sorted(
        StatementLine.objects.values_list(
            "statement__team__slug",
            "product_name",
            "allocated_gpu_hours",
            "utilised_gpu_hours",
            "unmeasured_gpu_hours",
            "amount",
        )
    )


def run(steps: list[tuple[datetime, Callable[[], None]]]) -> None:
    """Each step at its own time on the clock (the policy's ownership is dated by it)."""
    for at, step in steps:
        with time_machine.travel(at, tick=False):
            step()


def test_install_then_policy_bills_the_claims_as_policy_first_does_to_the_cent() -> None:
    """The hold-out sequence: the fleet (claims running) synced, then the policy, then samples
    and billing. Before, the claims' allocations kept no team: "0 statements for 0 teams"."""
    forget_fleet_shapes()
    with transaction.atomic():
        close_october()
        run(
            [
                (CLAIMS_START - timedelta(hours=1), apply_the_policy),
                (CLAIMS_START, sync_fleet),
                (CLAIMS_START + timedelta(days=1), send_samples),
                (BILL_AT, bill),
            ]
        )
        policy_first, policy_first_lines = statements(), lines()
        transaction.set_rollback(True)
    assert policy_first[("vision", "USD")] > 0 and policy_first[("nlp", "USD")] > 0

    forget_fleet_shapes()
    close_october()
    run(
        [
            (CLAIMS_START, sync_fleet),
            (CLAIMS_START + timedelta(days=2, minutes=17), apply_the_policy),
            (CLAIMS_START + timedelta(days=2, hours=1), send_samples),
            (BILL_AT, bill),
        ]
    )
    assert statements() == policy_first
    assert lines() == policy_first_lines
    # The first owners own from the start of the open period (October is closed).
    assert set(TeamNamespace.objects.values_list("namespace", "valid_from")) == {
        ("vision", NOVEMBER),
        ("nlp", NOVEMBER),
    }
    assert unowned_usage(period=Period.objects.get(start=NOVEMBER)) == []


STEPS = ("policy", "sync", "samples", "bill")


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(order=st.permutations(STEPS), early_bills=st.lists(st.integers(0, 3), max_size=2))
def test_the_statements_are_the_same_whatever_order_policy_sync_samples_and_billing_came_in(
    order: list[str], early_bills: list[int]
) -> None:
    """Any order of the four steps (and extra billing runs between them): after a last
    billing run, the statements are the ones of policy, sync, samples, billing."""
    actions = {
        "policy": apply_the_policy,
        "sync": sync_fleet,
        "samples": send_samples,
        "bill": bill,
    }

    def outcome(names: list[str]) -> tuple[dict[tuple[str, str], Decimal], list[tuple[Any, ...]]]:
        forget_fleet_shapes()
        with transaction.atomic():
            close_october()
            clock = CLAIMS_START + timedelta(days=2)
            for index, name in enumerate(names):
                run([(clock + timedelta(hours=index), actions[name])])
                if index in early_bills:
                    run([(clock + timedelta(hours=index, minutes=30), bill)])
            run([(BILL_AT, bill)])
            result = statements(), lines()
            transaction.set_rollback(True)
        return result

    assert outcome(list(order)) == outcome(list(STEPS))


def test_hours_of_a_closed_period_stay_unowned_and_are_shown_as_unowned_usage() -> None:
    """The claims ran through a closed October unowned: the first owner takes November's
    hours, not October's (a closed period is never changed); October's hours are shown to
    finance as unowned usage, priced at list price, and team totals plus unowned are the
    fleet's."""
    forget_fleet_shapes()
    with time_machine.travel(OCTOBER + timedelta(days=30), tick=False):
        inventory_services.import_snapshot(
            cluster=inventory_services.get_cluster("default"),
            objects=[
                *iter_objects(DRA / "deviceclasses-nvidia.yaml"),
                nvidia_slice("node-a", [nvidia_gpu(0, "node-a", H100, "80Gi")]),
                allocated_claim("train", "vision", 0),
            ],
            at=OCTOBER + timedelta(days=30),  # October 31st, 00:00: 24 hours in October
        )
    close_october()
    run([(NOVEMBER + timedelta(days=1, minutes=5), apply_the_policy), (BILL_AT, bill)])
    ownership = TeamNamespace.objects.get(namespace="vision")
    assert ownership.valid_from == NOVEMBER  # not into the closed October
    audit = AuditEntry.objects.get(
        object_type="team namespace", action="create", object_repr="vision"
    )
    assert audit.after is not None and audit.after["valid_from"].startswith("2026-11-01")
    november = UsageHour.objects.filter(hour__gte=NOVEMBER)
    assert set(november.values_list("team__slug", flat=True)) == {"vision"}
    assert sum(november.values_list("allocated_gpu_ms", flat=True)) == (
        (BILL_AT - NOVEMBER) // timedelta(milliseconds=1)
    )
    # October's hours, rolled up as beat would: nobody's, and shown as such.
    rollup.rollup_hours(hours=hours_between(OCTOBER + timedelta(days=30), NOVEMBER), now=BILL_AT)
    october = Period.objects.get(start=OCTOBER)
    unowned = unowned_usage(period=october)
    assert [(row.namespace, row.cluster, row.allocated_gpu_hours) for row in unowned] == [
        ("vision", "default", Decimal(24))
    ]
    assert (unowned[0].list_price, unowned[0].currency) == (Decimal("60.00"), "USD")
    assert unowned_usage(period=Period.objects.get(start=NOVEMBER)) == []


def test_a_move_and_a_release_never_change_who_paid_for_the_hours_before() -> None:
    vision = Team.objects.create(slug="vision", name="Vision")
    nlp = Team.objects.create(slug="nlp", name="NLP")
    start = datetime(2026, 11, 2, 10, 40, tzinfo=UTC)
    first, _ = assign_namespace(
        namespace="shared", team=vision, actor="ops", at=start, open_since=None
    )
    assert (first.valid_from, first.valid_until) == (None, None)
    _, entries = assign_namespace(
        namespace="shared", team=nlp, actor="ops", at=start + timedelta(hours=5), open_since=None
    )
    assert [entry.action for entry in entries] == ["update", "create"]
    rows = list(
        TeamNamespace.dated.order_by("pk").values_list("team__slug", "valid_from", "valid_until")
    )
    moved = datetime(2026, 11, 2, 15, tzinfo=UTC)
    assert rows == [("vision", None, moved), ("nlp", moved, None)]
    # The current owner is what quotas and pages read; the past one stays for billing.
    assert list(TeamNamespace.objects.values_list("team__slug", flat=True)) == ["nlp"]
    assert list(vision.namespaces.all()) == []
    # Assigned again to the same team: nothing written.
    assert (
        assign_namespace(
            namespace="shared", team=nlp, actor="ops", at=timezone.now(), open_since=None
        )[1]
        == []
    )
