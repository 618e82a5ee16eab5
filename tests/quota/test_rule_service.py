"""A quota rule is saved through one service (`quota.rules.save_rule`), whoever saves it: the
policy file and the Django admin leave the same row and the same audit entry for the same
input, and refuse the same change with the same reason (issue 37)."""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from decimal import Decimal
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.db import transaction
from django.test import Client
from django.urls import reverse

from quota.admin import QuotaRuleForm
from quota.models import QuotaRule
from quota.policy import PolicyError, apply_policy, load_policy
from quota.rules import RuleError, RuleValues, save_rule
from teams.models import AuditEntry, Team
from tests.quota.factories import DeviceClassFactory, QuotaRuleFactory, TeamFactory

pytestmark = pytest.mark.django_db

ADMIN = "ops-admin"
SELECTOR = 'device.attributes["gpu.nvidia.com"].productName.startsWith("NVIDIA H100")'


@pytest.fixture(autouse=True)
def device_class() -> None:
    DeviceClassFactory.create(name="gpu.nvidia.com")


@pytest.fixture
def ops_client() -> Client:
    user = get_user_model().objects.create_superuser(ADMIN, "ops@example.com", "x")
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def team() -> Team:
    return TeamFactory.create(slug="vision", name="Vision")


def policy(*, limit: str, mode: str, selector: str, gpus: bool = True) -> str:
    quantity = f"gpus: {limit}" if gpus else f"memory: {limit}"
    return textwrap.dedent(
        f"""
        teams:
        - slug: vision
          name: Vision
          quotas:
          - name: h100
            deviceClass: gpu.nvidia.com
            selector: '{selector}'
            {quantity}
            mode: {mode}
        """
    )


def apply(text: str) -> None:
    apply_policy(policy=load_policy(text), prune=False, actor=ADMIN)


def rule_row() -> dict[str, Any]:
    row = QuotaRule.objects.values(
        "team__slug", "name", "device_class", "selector", "unit", "limit", "mode", "in_use"
    ).get(name="h100")
    return dict(row)


def _without_id(snapshot: dict[str, Any] | None) -> dict[str, Any] | None:
    # A row made, rolled back and made again takes the sequence's next id.
    return None if snapshot is None else {k: v for k, v in snapshot.items() if k != "id"}


def rule_entries() -> list[tuple[Any, ...]]:
    return [
        (*entry[:4], _without_id(entry[4]), _without_id(entry[5]))
        for entry in AuditEntry.objects.filter(object_type="quota rule")
        .order_by("pk")
        .values_list("actor", "action", "object_type", "object_repr", "before", "after")
    ]


@contextmanager
def undone() -> Iterator[None]:
    """What is written within it is rolled back at its end."""
    with transaction.atomic():
        yield
        transaction.set_rollback(True)


def both(
    by_policy: Callable[[], None], by_admin: Callable[[], Any]
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """The rule's row and its audit entries after each way of saving, from the same start."""
    with undone():
        by_policy()
        from_policy = (rule_row(), rule_entries())
    by_admin()
    return from_policy, (rule_row(), rule_entries())


def test_a_new_rule_is_the_same_row_and_entry_from_the_policy_file_and_the_admin(
    ops_client: Client, team: Team
) -> None:
    # Blanks around the selector are normalised away by both.
    selector = f"  {SELECTOR}  "

    def by_admin() -> None:
        response = ops_client.post(
            reverse("admin:quota_quotarule_add"),
            {
                "team": team.pk,
                "name": "h100",
                "device_class": "gpu.nvidia.com",
                "selector": selector,
                "unit": "gpus",
                "limit": "4.5",
                "mode": "warn",
            },
        )
        assert response.status_code == 302, response.content

    from_policy, from_admin = both(
        lambda: apply(policy(limit="4.5", mode="warn", selector=selector)), by_admin
    )

    assert from_policy == from_admin
    row, entries = from_admin
    assert (row["selector"], row["limit"], row["mode"]) == (SELECTOR, Decimal("4.5"), "warn")
    assert [entry[:4] for entry in entries] == [(ADMIN, "create", "quota rule", "vision/h100")]


def test_a_changed_rule_is_the_same_row_and_entry_from_the_policy_file_and_the_admin(
    ops_client: Client, team: Team
) -> None:
    rule = QuotaRuleFactory.create(team=team, name="h100", device_class="gpu.nvidia.com")

    def by_admin() -> None:
        response = ops_client.post(
            reverse("admin:quota_quotarule_change", args=[rule.pk]),
            {
                "name": "h100",
                "device_class": "gpu.nvidia.com",
                "selector": SELECTOR,
                "unit": "gpus",
                "limit": "16",
                "mode": "warn",
            },
        )
        assert response.status_code == 302, response.content

    from_policy, from_admin = both(
        lambda: apply(policy(limit="16", mode="warn", selector=SELECTOR)), by_admin
    )

    assert from_policy == from_admin
    row, entries = from_admin
    assert (row["limit"], row["mode"]) == (Decimal(16), "warn")
    [(_, action, _, _, before, after)] = entries
    assert action == "update"
    assert (before["limit"], after["limit"]) == ("8.000000", "16.000000")


def test_a_unit_in_use_is_kept_for_the_same_reason_by_both(ops_client: Client, team: Team) -> None:
    rule = QuotaRuleFactory.create(team=team, name="h100", device_class="gpu.nvidia.com")
    QuotaRule.objects.filter(pk=rule.pk).update(in_use=1)
    reason = "cannot change the unit of rule 'h100' from gpus to memory while 1.000000 is in use"

    with pytest.raises(PolicyError) as caught:
        apply(policy(limit="80Gi", mode="enforce", selector="", gpus=False))
    response = ops_client.post(
        reverse("admin:quota_quotarule_change", args=[rule.pk]),
        {
            "name": "h100",
            "device_class": "gpu.nvidia.com",
            "selector": "",
            "unit": "memory",
            "limit": "85899345920",
            "mode": "enforce",
        },
    )

    assert caught.value.errors == [f"teams[0].quotas[0]: {reason}"]
    assert response.status_code == 200
    assert response.context["adminform"].form.errors["unit"] == [reason]
    assert not AuditEntry.objects.filter(object_type="quota rule").exists()


def test_the_service_itself_refuses_what_its_callers_check(team: Team) -> None:
    rule = QuotaRuleFactory.create(team=team, name="h100", device_class="gpu.nvidia.com")
    values = RuleValues(
        name="h100",
        device_class="gpu.nvidia.com",
        selector="device.driver ==",
        unit="gpus",
        limit=Decimal(2),
        mode="enforce",
    )

    with pytest.raises(RuleError) as caught:
        save_rule(team=team, stored=rule, values=values, actor=ADMIN)

    assert caught.value.field == "selector"
    assert str(caught.value).startswith("bad CEL: ")
    assert QuotaRule.objects.get(pk=rule.pk).limit == 8
    assert not AuditEntry.objects.exists()


def test_a_unit_put_in_use_after_the_forms_check_is_a_message_not_a_500(
    ops_client: Client, team: Team, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim admitted between the admin form's check and the save puts the rule's unit in
    use: the service refuses it, and the admin says so with nothing saved."""
    rule = QuotaRuleFactory.create(team=team, name="h100", device_class="gpu.nvidia.com")
    checked = QuotaRuleForm.clean

    def clean_then_admitted(form: QuotaRuleForm) -> dict[str, Any]:
        cleaned = checked(form)
        QuotaRule.objects.filter(pk=rule.pk).update(in_use=1)  # the racing admission
        return cleaned

    monkeypatch.setattr(QuotaRuleForm, "clean", clean_then_admitted)
    url = reverse("admin:quota_quotarule_change", args=[rule.pk])
    response = ops_client.post(
        url,
        {
            "name": "h100",
            "device_class": "gpu.nvidia.com",
            "selector": "",
            "unit": "memory",
            "limit": "85899345920",
            "mode": "enforce",
        },
        follow=True,
    )

    assert response.status_code == 200
    shown = [str(message) for message in response.context["messages"]]
    assert shown == [
        "Nothing was saved: unit: cannot change the unit of rule 'h100' from gpus to memory "
        "while 1.000000 is in use"
    ]
    rule.refresh_from_db()
    assert rule.unit == "gpus"
    assert not AuditEntry.objects.filter(object_type="quota rule").exists()
