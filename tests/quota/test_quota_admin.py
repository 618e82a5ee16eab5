"""Quota admin: edits are audited as the admin user, selectors checked, services' rows read-only."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse

from quota.models import Budget, QuotaRule, ReservationLine
from teams.models import AuditEntry, Team, TeamNamespace
from tests.quota.factories import (
    MembershipFactory,
    QuotaRuleFactory,
    ReservationFactory,
    TeamFactory,
    TeamNamespaceFactory,
)

pytestmark = pytest.mark.django_db

SELECTOR = 'device.attributes["gpu.nvidia.com"].productName.startsWith("NVIDIA H100")'


@pytest.fixture
def ops_client() -> Client:
    user = get_user_model().objects.create_superuser("ops-admin", "ops@example.com", "x")
    client = Client()
    client.force_login(user)
    return client


def rule_form(rule: QuotaRule, **changes: Any) -> dict[str, Any]:
    return {
        "name": rule.name,
        "device_class": rule.device_class,
        "selector": rule.selector,
        "unit": rule.unit,
        "limit": str(rule.limit),
        "mode": rule.mode,
        **changes,
    }


def hold(rule: QuotaRule, amount: int) -> None:
    """A live reservation of the rule's team holds `amount` on it (a claim not yet seen)."""
    namespace = TeamNamespaceFactory.create(team=rule.team)
    reservation = ReservationFactory.create(team=rule.team, namespace=namespace.namespace)
    ReservationLine.objects.create(reservation=reservation, rule=rule, amount=amount)
    QuotaRule.objects.filter(pk=rule.pk).update(in_use=amount)


def inline_management(prefix: str, total: int = 0, initial: int = 0) -> dict[str, Any]:
    return {
        f"{prefix}-TOTAL_FORMS": total,
        f"{prefix}-INITIAL_FORMS": initial,
        f"{prefix}-MIN_NUM_FORMS": 0,
        f"{prefix}-MAX_NUM_FORMS": 1000,
    }


def test_editing_a_rule_limit_is_audited(ops_client: Client) -> None:
    rule = QuotaRuleFactory.create(team__slug="vision", name="h100", selector=SELECTOR)
    hold(rule, 3)
    url = reverse("admin:quota_quotarule_change", args=[rule.pk])
    assert ops_client.get(url).status_code == 200

    response = ops_client.post(url, rule_form(rule, limit="16"))

    assert response.status_code == 302, response.content
    rule.refresh_from_db()
    assert (rule.limit, rule.in_use) == (16, 3)
    entry = AuditEntry.objects.get()
    assert (entry.actor, entry.action, entry.object_type, entry.object_repr) == (
        "ops-admin",
        "update",
        "quota rule",
        "vision/h100",
    )
    assert entry.before is not None
    assert entry.after is not None
    assert (entry.before["limit"], entry.after["limit"]) == ("8.000000", "16.000000")
    assert entry.before["selector"] == SELECTOR


def test_saving_an_unchanged_rule_writes_no_entry(ops_client: Client) -> None:
    rule = QuotaRuleFactory.create()
    url = reverse("admin:quota_quotarule_change", args=[rule.pk])

    assert ops_client.post(url, rule_form(rule)).status_code == 302

    assert not AuditEntry.objects.exists()


def test_a_bad_selector_is_a_form_error(ops_client: Client) -> None:
    rule = QuotaRuleFactory.create()
    url = reverse("admin:quota_quotarule_change", args=[rule.pk])

    response = ops_client.post(url, rule_form(rule, selector="device.driver =="))

    assert response.status_code == 200
    errors = response.context["adminform"].form.errors
    assert errors["selector"][0].startswith("bad CEL: syntax error in CEL selector")
    assert "bad CEL" in response.content.decode()
    rule.refresh_from_db()
    assert rule.selector == ""
    assert not AuditEntry.objects.exists()


def test_the_unit_stays_while_in_use(ops_client: Client) -> None:
    rule = QuotaRuleFactory.create()
    QuotaRule.objects.filter(pk=rule.pk).update(in_use=1)
    url = reverse("admin:quota_quotarule_change", args=[rule.pk])

    response = ops_client.post(url, rule_form(rule, unit="memory"))

    assert response.status_code == 200
    assert "unit" in response.context["adminform"].form.errors


def test_adding_a_rule_is_audited(ops_client: Client) -> None:
    team = TeamFactory.create(slug="vision")
    url = reverse("admin:quota_quotarule_add")
    form = {"team": team.pk, "name": "h100", "device_class": "gpu.nvidia.com"}

    response = ops_client.post(
        url, {**form, "selector": SELECTOR, "unit": "gpus", "limit": "4", "mode": "warn"}
    )

    assert response.status_code == 302, response.content
    entry = AuditEntry.objects.get()
    assert (entry.action, entry.object_repr, entry.before) == ("create", "vision/h100", None)
    assert entry.after is not None
    assert entry.after["mode"] == "warn"


def test_team_inlines_are_audited(ops_client: Client) -> None:
    team = TeamFactory.create(slug="vision", name="Vision")
    namespace = TeamNamespaceFactory.create(team=team, namespace="vision")
    membership = MembershipFactory.create(team=team, user__username="alice")
    url = reverse("admin:teams_team_change", args=[team.pk])
    data = {
        "slug": "vision",
        "name": "Vision Research",
        "cost_centre": "",
        **inline_management("namespaces", total=2, initial=1),
        "namespaces-0-id": namespace.pk,
        "namespaces-0-team": team.pk,
        "namespaces-0-namespace": "vision",
        "namespaces-0-DELETE": "on",
        "namespaces-1-team": team.pk,
        "namespaces-1-namespace": "vision-dev",
        **inline_management("memberships", total=1, initial=1),
        "memberships-0-id": membership.pk,
        "memberships-0-team": team.pk,
        "memberships-0-user": membership.user.pk,
        "memberships-0-role": "lead",
        **inline_management("rules"),
    }

    response = ops_client.post(url, data)

    assert response.status_code == 302, response.context and response.context["errors"]
    assert list(TeamNamespace.objects.values_list("namespace", flat=True)) == ["vision-dev"]
    entries = set(AuditEntry.objects.values_list("actor", "action", "object_type", "object_repr"))
    assert entries == {
        ("ops-admin", "update", "team", "vision"),
        # Released, not deleted: ownership is dated, the hours it owned stay the team's.
        ("ops-admin", "update", "team namespace", "vision"),
        ("ops-admin", "create", "team namespace", "vision-dev"),
        ("ops-admin", "update", "membership", "alice (lead of vision)"),
    }


def test_deleting_a_team_audits_what_goes_with_it(ops_client: Client) -> None:
    rule = QuotaRuleFactory.create(team__slug="vision", name="h100")
    TeamNamespaceFactory.create(team=rule.team, namespace="vision")
    Budget.objects.create(team=rule.team, gpu_hours=100, mode="hard")
    url = reverse("admin:teams_team_delete", args=[rule.team.pk])

    response = ops_client.post(url, {"post": "yes"})

    assert response.status_code == 302
    assert not Team.objects.exists() and not Budget.objects.exists()
    assert list(
        AuditEntry.objects.order_by("pk").values_list("action", "object_type", "object_repr")
    ) == [
        ("delete", "team namespace", "vision"),
        ("delete", "quota rule", "vision/h100"),
        ("delete", "budget", "vision: 100 GPU-hours (hard)"),
        ("delete", "team", "vision"),  # the team, last
    ]


def test_a_budget_is_set_through_the_service_and_audited(ops_client: Client) -> None:
    """The admin sets a budget through `quota.services.set_budget`, as `apply_policy` does:
    created, changed (its unit too) and saved unchanged, each change audited once as the admin
    user."""
    team = TeamFactory.create(slug="vision")
    add = reverse("admin:quota_budget_add")
    response = ops_client.post(
        add, {"team": team.pk, "gpu_hours": "100", "mode": "hard", "unit": "gpu"}
    )
    assert response.status_code == 302, response.content
    budget = Budget.objects.get()
    change = reverse("admin:quota_budget_change", args=[budget.pk])
    assert response["Location"].startswith(reverse("admin:quota_budget_changelist"))

    changed = {"gpu_hours": "250.5", "mode": "soft", "unit": "tpu"}
    assert ops_client.post(change, changed).status_code == 302
    assert ops_client.post(change, changed).status_code == 302

    budget.refresh_from_db()
    assert (budget.team, budget.gpu_hours, budget.mode, budget.unit) == (
        team,
        Decimal("250.5"),
        "soft",
        "tpu",
    )
    entries = AuditEntry.objects.order_by("pk")
    assert [(e.actor, e.action, e.object_type) for e in entries] == [
        ("ops-admin", "create", "budget"),
        ("ops-admin", "update", "budget"),
    ]
    assert (entries[1].before or {})["gpu_hours"] == "100.000"
    assert (entries[1].after or {})["mode"] == "soft"
    assert ((entries[1].before or {})["unit"], (entries[1].after or {})["unit"]) == ("gpu", "tpu")
    # A unit that is none of the profiles' is refused by the form, naming the field.
    refused = ops_client.post(change, {**changed, "unit": "npu"})
    assert refused.status_code == 200
    assert refused.context["adminform"].form.errors["unit"]


def test_in_use_is_read_only(ops_client: Client) -> None:
    rule = QuotaRuleFactory.create()
    hold(rule, 2)
    url = reverse("admin:quota_quotarule_change", args=[rule.pk])

    response = ops_client.post(url, rule_form(rule, in_use="0", limit="9"))

    assert response.status_code == 302
    rule.refresh_from_db()
    assert (rule.limit, rule.in_use) == (9, 2)
    form = ops_client.get(url).context["adminform"].form
    assert "in_use" not in form.fields
    assert "team" not in form.fields


@pytest.mark.parametrize(
    "model",
    ["teams_auditentry", "quota_admissiondecision", "quota_reservation", "quota_reservationline"],
)
def test_services_rows_are_read_only(ops_client: Client, model: str) -> None:
    assert ops_client.get(reverse(f"admin:{model}_changelist")).status_code == 200
    assert ops_client.get(reverse(f"admin:{model}_add")).status_code == 403


def test_changelists_render(ops_client: Client) -> None:
    QuotaRuleFactory.create(team__slug="vision")
    for model in ("teams_team", "quota_quotarule", "quota_budget"):
        response = ops_client.get(reverse(f"admin:{model}_changelist"))
        assert response.status_code == 200
    response = ops_client.get(reverse("admin:quota_quotarule_changelist"), {"q": "vision"})
    assert response.context["cl"].result_count == 1


def test_operators_release_expired_reservations_from_the_admin(ops_client: Client) -> None:
    from datetime import timedelta

    from django.utils import timezone

    from quota.models import Reservation
    from teams.models import Team

    team = Team.objects.create(slug="ops-team", name="Ops")
    now = timezone.now()
    stale = Reservation.objects.create(
        cluster="default",
        namespace="ns",
        name="ghost",
        team=team,
        created_at=now,
        expires_at=now - timedelta(minutes=1),
    )
    fresh = Reservation.objects.create(
        cluster="default",
        namespace="ns",
        name="coming",
        team=team,
        created_at=now,
        expires_at=now + timedelta(minutes=10),
    )
    response = ops_client.post(
        "/admin/quota/reservation/",
        {"action": "expire_stale", "_selected_action": [stale.pk, fresh.pk]},
        follow=True,
    )
    assert response.status_code == 200
    assert "1 expired reservation(s) released" in response.content.decode()
    stale.refresh_from_db()
    fresh.refresh_from_db()
    assert (stale.state, fresh.state) == ("released", "reserved")
