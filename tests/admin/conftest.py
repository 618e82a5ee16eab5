"""Fixtures for the admin's tests: an operator's session, a team and a statement as the demo
has them (long selectors, a memory rule in bytes, a dozen statement lines), and the headless
Chromium of the portal's tests (`tests/frontend/conftest.py`, same skip/required rules)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import User
from django.test import Client

from billing.models import LineKind, Period, Statement, StatementLine
from quota.models import QuotaRule, Unit
from teams.models import Membership, Role, Team, TeamNamespace
from tests.frontend.conftest import chromium

__all__ = ["chromium"]

TIB = 2**40
H100_SELECTOR = (
    'device.attributes["gpu.nvidia.com"].productName.startsWith("NVIDIA H100") && '
    'device.attributes["gpu.nvidia.com"].driverVersion.compareTo(semver("550.0.0")) >= 0'
)


@dataclass
class Seeded:
    team: Team
    statement: Statement
    memory_rule: QuotaRule


@pytest.fixture
def operator(db: None) -> User:
    return get_user_model().objects.create_superuser("ops-admin", "ops@example.com", "x")


@pytest.fixture
def ops_client(operator: User) -> Client:
    client = Client()
    client.force_login(operator)
    return client


def seed_admin() -> Seeded:
    team = Team.objects.create(slug="vision", name="Computer vision", cost_centre="CC-4711")
    for namespace in ("vision", "vision-training", "vision-inference-production"):
        TeamNamespace.objects.create(team=team, namespace=namespace)
    for index in range(3):
        user = get_user_model().objects.create_user(f"member-with-a-long-name-{index}")
        Membership.objects.create(
            team=team, user=user, role=Role.LEAD if index == 0 else Role.MEMBER
        )
    QuotaRule.objects.create(
        team=team, name="h100", device_class="gpu.nvidia.com", selector=H100_SELECTOR, limit=16
    )
    memory_rule = QuotaRule.objects.create(
        team=team,
        name="gpu-memory",
        device_class="gpu.nvidia.com",
        unit=Unit.MEMORY,
        limit=Decimal(2 * TIB),
        in_use=Decimal(640 * 2**30),
    )
    period = Period.objects.create(
        start=datetime(2026, 10, 1, tzinfo=UTC), end=datetime(2026, 11, 1, tzinfo=UTC)
    )
    statement = Statement.objects.create(
        team=team,
        period=period,
        currency="USD",
        total=Decimal("1388.890"),
        computed_at=datetime(2026, 11, 1, tzinfo=UTC),
    )
    for index, product in enumerate(
        ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA H200", "NVIDIA L40S") * 3
    ):
        StatementLine.objects.create(
            statement=statement,
            kind=LineKind.USAGE if index < 8 else LineKind.ADJUSTMENT,
            product_name=product,
            profile="3g.40gb" if index % 4 == 1 else "",
            allocated_gpu_hours=Decimal("123456.123456"),
            utilised_gpu_hours=Decimal("100000.654321"),
            idle_gpu_hours=Decimal("20000.000001"),
            unmeasured_gpu_hours=Decimal("3455.469134"),
            rate=Decimal("2.5000"),
            idle_factor=Decimal("0.4000"),
            gpu_share=Decimal("0.428571") if index % 4 == 1 else None,
            amount=Decimal("115.741"),
            reason=""
            if index < 8
            else "late data for 2026-09-01..2026-10-01: usage rolled up after the period closed",
            created_by="" if index < 8 else "finance-team-member@example.com",
        )
    return Seeded(team=team, statement=statement, memory_rule=memory_rule)


@pytest.fixture
def seeded(db: None) -> Seeded:
    return seed_admin()
