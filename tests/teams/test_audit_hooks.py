"""The audit trail knows the apps above teams only through what they register: quota's
relations off a team and its unaudited fields come from quota's `ready`, not from names
written into teams (issue 37)."""

from __future__ import annotations

import ast
from decimal import Decimal
from pathlib import Path

import pytest

from quota.models import Budget, GangPolicy, QuotaRule
from teams import audit
from teams.models import AuditEntry, Team
from tests.quota.factories import QuotaRuleFactory, TeamFactory

AUDIT = Path(audit.__file__)


def test_teams_names_none_of_quotas_relations_or_fields() -> None:
    strings = {
        node.value
        for node in ast.walk(ast.parse(AUDIT.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }
    assert strings.isdisjoint({"rules", "budget", "gang_policy", "in_use"})


def test_quota_registers_its_relations_off_a_team_and_its_unaudited_field() -> None:
    children = audit.audited_children(Team)
    assert {"rules", "budget", "gang_policy"} <= set(children)
    # Teams' own first, as before any app registered.
    assert children[:2] == ("namespaces", "memberships")


def test_registering_twice_keeps_one() -> None:
    before = audit.audited_children(Team)
    audit.register_children(Team, "rules")
    assert audit.audited_children(Team) == before


@pytest.mark.django_db
def test_a_rules_usage_is_in_no_snapshot() -> None:
    rule = QuotaRuleFactory.create()
    QuotaRule.objects.filter(pk=rule.pk).update(in_use=2)
    rule.refresh_from_db()
    assert "in_use" not in audit.snapshot(rule)
    assert "limit" in audit.snapshot(rule)


@pytest.mark.django_db
def test_deleting_a_team_audits_quotas_children_one_by_one() -> None:
    team = TeamFactory.create(slug="vision")
    QuotaRuleFactory.create(team=team, name="h100")
    Budget.objects.create(team=team, gpu_hours=Decimal(10), mode="hard")
    GangPolicy.objects.create(team=team, mode="off")

    audit.delete(actor="ops", obj=team)

    deleted = list(AuditEntry.objects.filter(action="delete").values_list("object_type", flat=True))
    assert sorted(deleted) == ["budget", "gang policy", "quota rule", "team"]
    assert deleted[-1] == "team"
