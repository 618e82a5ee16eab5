"""The reservation invariant under concurrency, on the real PostgreSQL.

For every enforce rule, reservations plus allocations never exceed the limit; a claim
admitted twice reserves once; a dry run reserves nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.utils import timezone

from inventory.services import get_cluster
from quota.admission import service, store
from quota.models import QuotaRule, Reservation, ReservationLine
from tests.quota.fixtures import claim, gpu_request, make_team, post, review

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("fleet"),
]
A100 = [{"cel": {"expression": "device.attributes['gpu.nvidia.com'].productName.contains('A100')"}}]


def race(calls: list[Callable[[], Any]], workers: int = 40) -> list[Any]:
    def run(call: Callable[[], Any]) -> Any:
        try:
            return call()
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(run, calls))


def admit(body: dict[str, Any], **kwargs: Any) -> Callable[[], bool]:
    def call() -> bool:
        response = post(Client(), review(body, **kwargs))
        assert response.status_code == 200, response.content
        allowed: bool = response.json()["response"]["allowed"]
        return allowed

    return call


def test_200_admissions_racing_for_the_last_10_gpus_admit_exactly_10() -> None:
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 100}])
    QuotaRule.objects.update(in_use=90)
    results = race([admit(claim(f"c{i}", [gpu_request(1, selectors=A100)])) for i in range(200)])
    assert results.count(True) == 10
    assert QuotaRule.objects.get().in_use == 100
    assert Reservation.objects.count() == ReservationLine.objects.count() == 10


def test_a_request_denied_by_one_rule_leaves_the_other_untouched() -> None:
    make_team(
        [
            {"name": "tight", "device_class": "gpu.nvidia.com", "limit": 5},
            {"name": "loose", "device_class": "gpu.nvidia.com", "limit": 100},
        ]
    )
    results = race([admit(claim(f"c{i}", [gpu_request(1, selectors=A100)])) for i in range(60)])
    assert results.count(True) == 5
    in_use = dict(QuotaRule.objects.values_list("name", "in_use"))
    assert in_use == {"tight": Decimal(5), "loose": Decimal(5)}
    assert ReservationLine.objects.filter(rule__name="loose").count() == 5


def test_a_claim_replayed_concurrently_reserves_once() -> None:
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 100}])
    body = claim("replayed", [gpu_request(2, selectors=A100)])
    results = race([admit(body, uid=f"uid-{i}") for i in range(30)])
    assert all(results)
    assert Reservation.objects.count() == 1
    assert QuotaRule.objects.get().in_use == 2


def test_concurrent_dry_runs_leave_nothing_behind() -> None:
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 3}])
    results = race(
        [admit(claim(f"d{i}", [gpu_request(1, selectors=A100)]), dry_run=True) for i in range(40)]
    )
    assert all(results)
    assert Reservation.objects.count() == 0
    assert QuotaRule.objects.get().in_use == 0


def _planned(name: str, count: int) -> tuple[Any, Any, dict[str, Any]]:
    """A claim's plan as the webhook makes it before reserving (usage read at that moment)."""
    cluster = get_cluster("default")
    body = claim(name, [gpu_request(count, selectors=A100)])
    state = store.admission_state(cluster=cluster.name, namespace="research", name=name)
    return cluster, service._plan(cluster=cluster, claim=body, state=state), body


def _reserve(cluster: Any, plan: Any, body: dict[str, Any]) -> tuple[Any, bool]:
    """Reserve what `plan` says, as the webhook does after planning."""
    return service._reserve(
        cluster=cluster,
        claim=body,
        plan=plan,
        username="alice",
        admission_uid="u",
        at=timezone.now(),
    )


def test_a_claim_planned_before_another_took_the_last_gpus_is_denied_with_usage_as_it_is() -> None:
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 10}])
    cluster, plan, body = _planned("late", 2)
    assert plan.denial == ""  # 0 of 10 in use when it was planned
    QuotaRule.objects.update(in_use=9)  # meanwhile another admission took 9
    decision, recorded = _reserve(cluster, plan, body)
    assert not decision.allowed and not recorded
    assert "9 GPUs in use, 2 GPUs requested, limit 10 GPUs" in decision.message
    assert QuotaRule.objects.get().in_use == 9
    assert Reservation.objects.count() == ReservationLine.objects.count() == 0


def test_a_rule_deleted_while_a_claim_is_admitted_denies_it_asking_to_create_it_again() -> None:
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 10}])
    cluster, plan, body = _planned("orphan", 1)
    QuotaRule.objects.all().delete()
    decision, _ = _reserve(cluster, plan, body)
    assert not decision.allowed and decision.reason == "Conflict"
    assert "quota rules changed" in decision.message
    assert Reservation.objects.count() == 0


def test_the_webhook_statements_are_prepared_once_per_connection() -> None:
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 100}])
    for index in range(6):
        assert admit(claim(f"p{index}", [gpu_request(1, selectors=A100)]))()
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*), sum(generic_plans + custom_plans) FROM pg_prepared_statements"
        )
        statements, executions = cursor.fetchone()
    # The usage read (which also sets the webhook's timeouts on the session) and the
    # reservation (which sets the session's own back): prepared once each, run every time.
    assert statements == 2
    assert executions == 12
