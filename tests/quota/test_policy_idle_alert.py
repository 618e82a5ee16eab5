"""A team's idle-alert threshold in the policy file (`idleAlert`): checked with errors naming
their path, applied audited, kept or pruned like the team's other settings."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest

from quota.policy import PolicyError, apply_policy, load_policy
from teams.models import AuditEntry, IdleAlertPolicy, Team

pytestmark = pytest.mark.django_db

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "policy.example.yaml"

TEAM = """\
teams:
- slug: vision
  name: Vision
  leads: [lead-vision]
"""


def policy_text(idle_alert: str | None) -> str:
    return TEAM + (f"  idleAlert: {idle_alert}\n" if idle_alert is not None else "")


def errors_of(idle_alert: str) -> list[str]:
    with pytest.raises(PolicyError) as raised:
        load_policy(policy_text(idle_alert))
    return raised.value.errors


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (
            "{belowPercent: 0, forHours: 4}",
            ["teams[0].idleAlert.belowPercent: must be positive, got 0"],
        ),
        (
            "{belowPercent: 150, forHours: 4}",
            ["teams[0].idleAlert.belowPercent: must be at most 100, got 150"],
        ),
        (
            "{belowPercent: 5.125, forHours: 4}",
            ["teams[0].idleAlert.belowPercent: 5.125 has more than 2 decimal places"],
        ),
        (
            "{belowPercent: lots, forHours: 4}",
            ["teams[0].idleAlert.belowPercent: 'lots' is not a number"],
        ),
        (
            "{belowPercent: 5, forHours: 2.5}",
            ["teams[0].idleAlert.forHours: must be a whole number of hours, got 2.5"],
        ),
        (
            "{belowPercent: 5, forHours: '4'}",
            ["teams[0].idleAlert.forHours: must be a whole number of hours, got '4'"],
        ),
        (
            "{belowPercent: 5, forHours: 0}",
            ["teams[0].idleAlert.forHours: must be from 1 to 744 hours, got 0"],
        ),
        (
            "{belowPercent: 5, forHours: 1000}",
            ["teams[0].idleAlert.forHours: must be from 1 to 744 hours, got 1000"],
        ),
        ("{belowPercent: 5}", ["teams[0].idleAlert.forHours: required"]),
        (
            "{belowPercent: 5, forHours: 4, for_hours: 4}",
            ["teams[0].idleAlert: unknown key 'for_hours'"],
        ),
        ("5", ["teams[0].idleAlert: must be a mapping or off, got int"]),
    ],
)
def test_a_bad_idle_alert_is_an_error_naming_its_path(value: str, expected: list[str]) -> None:
    assert errors_of(value) == expected


def test_every_error_of_the_section_is_reported_at_once() -> None:
    assert errors_of("{belowPercent: -1, forHours: 0}") == [
        "teams[0].idleAlert.belowPercent: must be positive, got -1",
        "teams[0].idleAlert.forHours: must be from 1 to 744 hours, got 0",
    ]


def test_the_idle_alert_is_applied_audited_and_again_changes_nothing() -> None:
    policy = load_policy(policy_text("{belowPercent: 5, forHours: 4}"))
    report = apply_policy(policy=policy, prune=False, actor="ops")

    stored = IdleAlertPolicy.objects.get(team__slug="vision")
    assert (stored.below_percent, stored.for_hours) == (Decimal("5.00"), 4)
    assert "created idle alert policy vision: below 5% for 4 h" in report.changes
    assert AuditEntry.objects.filter(object_type="idle alert policy", action="create").count() == 1
    assert not apply_policy(policy=policy, prune=False, actor="ops").changed

    changed = apply_policy(
        policy=load_policy(policy_text("{belowPercent: 2.5, forHours: 8}")),
        prune=False,
        actor="ops",
    )
    assert changed.changes == [
        "updated idle alert policy vision: below 2.5% for 8 h: "
        "below_percent '5.00' → '2.50', for_hours 4 → 8"
    ]


def test_an_undeclared_idle_alert_is_kept_without_prune_and_deleted_with_it() -> None:
    apply_policy(
        policy=load_policy(policy_text("{belowPercent: 5, forHours: 4}")), prune=False, actor="ops"
    )
    without = load_policy(policy_text(None))

    kept = apply_policy(policy=without, prune=False, actor="ops")
    assert IdleAlertPolicy.objects.count() == 1
    assert any("kept idle alert policy vision" in note for note in kept.notes)

    apply_policy(policy=without, prune=True, actor="ops")
    assert IdleAlertPolicy.objects.count() == 0
    assert AuditEntry.objects.filter(object_type="idle alert policy", action="delete").count() == 1


def test_a_pruned_team_takes_its_idle_alert_with_it_audited() -> None:
    apply_policy(
        policy=load_policy(policy_text("{belowPercent: 5, forHours: 4}")), prune=False, actor="ops"
    )
    apply_policy(policy=load_policy("teams: []\n"), prune=True, actor="ops")
    assert not Team.objects.exists()
    assert AuditEntry.objects.filter(object_type="idle alert policy", action="delete").count() == 1


def test_the_example_file_declares_an_idle_alert() -> None:
    policy = load_policy(EXAMPLE.read_text())
    declared = [team.idle_alert for team in policy.teams if team.idle_alert is not None]
    assert declared and all(spec.for_hours >= 1 for spec in declared)


def test_idle_alert_off_is_kept_as_off_and_back_on_with_a_rule() -> None:
    """`idleAlert: off` (YAML's false, or the string) turns the team's alerts off, which
    without a row would be the default rule's; a rule later turns them back on."""
    report = apply_policy(policy=load_policy(policy_text("off")), prune=False, actor="ops")
    assert "created idle alert policy vision: off" in report.changes
    assert not IdleAlertPolicy.objects.get(team__slug="vision").enabled
    assert not apply_policy(
        policy=load_policy(policy_text("'off'")), prune=False, actor="ops"
    ).changed
    apply_policy(
        policy=load_policy(policy_text("{belowPercent: 5, forHours: 4}")), prune=False, actor="ops"
    )
    assert IdleAlertPolicy.objects.get(team__slug="vision").enabled
