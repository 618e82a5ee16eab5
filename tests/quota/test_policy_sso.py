"""The policy file's `sso.groups` (quota/policy.py) and what a sign-in grants from it
(teams/sso.py): checked with path-named errors, applied and audited, re-evaluated at each
sign-in, and kept apart from what the file's own `leads:`/`members:` and the admin decide."""

from __future__ import annotations

import textwrap
import threading
from typing import Any

import pytest
from django.contrib.auth.models import Group, User
from django.db import connection, transaction

from quota.policy import PolicyError, apply_policy, load_policy
from teams.models import AuditEntry, Membership, Role, SsoGroupRole, Team
from teams.selectors import FINANCE_GROUP, OPERATORS_GROUP, user_role
from teams.sso import apply_sso_groups

pytestmark = pytest.mark.django_db

TEAMS = """
teams:
- slug: vision
  name: Vision
  namespaces: [vision]
  leads: [file-lead]
- slug: speech
  name: Speech
  namespaces: [speech]
"""
MAPPING = (
    TEAMS
    + """
sso:
  groups:
  - {group: vision-leads, team: vision, role: lead}
  - {group: vision-all, team: vision, role: member}
  - {group: finops, role: finance}
  - {group: platform, role: operator}
"""
)


def apply_text(text: str, *, prune: bool = False) -> Any:
    return apply_policy(policy=load_policy(textwrap.dedent(text)), prune=prune, actor="tester")


def errors_of(text: str) -> list[str]:
    with pytest.raises(PolicyError) as caught:
        load_policy(textwrap.dedent(text))
    return list(caught.value.errors)


def test_every_bad_line_is_named_by_its_path() -> None:
    errors = errors_of(
        TEAMS
        + """
sso:
  groups:
  - {group: a, team: vision, role: boss}
  - {group: b, role: lead}
  - {group: c, team: nowhere, role: member}
  - {group: d, team: vision, role: finance}
  - {group: "", role: operator}
  - {team: vision, role: lead, colour: blue}
  - {group: e, team: vision, role: lead}
  - {group: e, team: vision, role: lead}
  - {group: f, team: [vision], role: lead}
  - {group: [g], role: [lead]}
"""
    )
    assert errors == [
        "sso.groups[0].role: must be one of lead, member, finance, operator, got 'boss'",
        "sso.groups[1].team: required: a lead is one of a team",
        "sso.groups[2].team: no team 'nowhere' in `teams` (declared: speech, vision)",
        "sso.groups[3].team: not allowed: finance is a role across every team",
        "sso.groups[4].group: must not be empty",
        "sso.groups[5]: unknown key 'colour'",
        "sso.groups[5].group: required",
        "sso.groups[7]: the same line as sso.groups[6]",
        "sso.groups[8].team: must be a team's slug, got list",
        "sso.groups[9].group: must be a string, got list",
        "sso.groups[9].role: must be one of lead, member, finance, operator, got ['lead']",
    ]
    assert errors_of(TEAMS + "sso: {groups: finops}\n") == ["sso.groups: must be a list, got str"]
    assert errors_of(TEAMS + "sso: [a]\n") == ["sso: must be a mapping, got list"]


def test_the_mapping_is_applied_audited_and_idempotent() -> None:
    report = apply_text(MAPPING)
    assert sorted(str(row) for row in SsoGroupRole.objects.all()) == [
        "finops → finance",
        "platform → operator",
        "vision-all → member of vision",
        "vision-leads → lead of vision",
    ]
    assert AuditEntry.objects.filter(object_type="SSO group role", action="create").count() == 4
    assert sum(1 for line in report.changes if line.startswith("created SSO group role")) == 4
    assert not apply_text(MAPPING).changed


def test_a_line_the_file_drops_is_kept_without_prune_and_deleted_with_it() -> None:
    apply_text(MAPPING)
    fewer = TEAMS + "sso:\n  groups:\n  - {group: finops, role: finance}\n"
    report = apply_text(fewer)
    assert SsoGroupRole.objects.count() == 4
    assert any("kept SSO group role platform → operator" in note for note in report.notes)
    apply_text(fewer, prune=True)
    assert [str(row) for row in SsoGroupRole.objects.all()] == ["finops → finance"]
    # Without `sso:` the stored mapping is not the file's to change.
    apply_text(TEAMS, prune=True)
    assert SsoGroupRole.objects.count() == 1


def test_prune_keeps_the_memberships_single_sign_on_gave() -> None:
    apply_text(MAPPING)
    signed_in = User.objects.create_user("ana")
    apply_sso_groups(user=signed_in, groups=["vision-leads"], actor="sso:ana")
    apply_text(MAPPING, prune=True)
    assert Membership.objects.filter(user=signed_in, role=Role.LEAD).exists()
    assert Membership.objects.filter(user__username="file-lead").exists()


def test_a_sign_in_grants_the_mapped_roles_and_takes_those_no_longer_given() -> None:
    apply_text(MAPPING)
    user = User.objects.create_user("ana")
    apply_sso_groups(user=user, groups=["vision-all", "vision-leads", "finops"], actor="sso:ana")
    assert {m.team.slug: m.role for m in Membership.objects.filter(user=user)} == {
        "vision": Role.LEAD  # lead wins over member
    }
    assert set(user.groups.values_list("name", flat=True)) == {FINANCE_GROUP}
    assert user_role(User.objects.get(pk=user.pk)) == "finance"

    entries = apply_sso_groups(user=user, groups=["vision-all"], actor="sso:ana")
    assert Membership.objects.get(user=user).role == Role.MEMBER
    assert not user.groups.exists()
    assert {(e.object_type, e.action) for e in entries} == {
        ("membership", "update"),
        ("user", "update"),
    }
    assert apply_sso_groups(user=user, groups=["vision-all"], actor="sso:ana") == []

    apply_sso_groups(user=user, groups=["platform"], actor="sso:ana")
    assert not Membership.objects.filter(user=user).exists()
    assert user_role(User.objects.get(pk=user.pk)) == "operator"


def test_what_the_mapping_does_not_name_is_left_alone() -> None:
    apply_text(TEAMS + "sso:\n  groups:\n  - {group: vision-leads, team: vision, role: lead}\n")
    user = User.objects.create_user("ana")
    speech = Team.objects.get(slug="speech")
    Membership.objects.create(team=speech, user=user, role=Role.LEAD)
    finance, _ = Group.objects.get_or_create(name=FINANCE_GROUP)
    user.groups.add(finance)
    apply_sso_groups(user=user, groups=[], actor="sso:ana")
    # The admin's membership of speech is not a sign-in's; no line gives finance or operator.
    assert Membership.objects.filter(user=user, team=speech, role=Role.LEAD).exists()
    assert user.groups.filter(name=FINANCE_GROUP).exists()
    assert not user.groups.filter(name=OPERATORS_GROUP).exists()


def test_a_sign_in_never_takes_what_the_file_gave() -> None:
    apply_text(MAPPING)
    user = User.objects.get(username="file-lead")
    assert apply_sso_groups(user=user, groups=["anything"], actor="sso:file-lead") == []
    assert Membership.objects.filter(user=user, role=Role.LEAD, granted_by_sso=False).exists()


def test_the_file_declaring_a_signed_in_member_makes_the_membership_its_own() -> None:
    apply_text(MAPPING)
    user = User.objects.create_user("ana")
    apply_sso_groups(user=user, groups=["vision-leads"], actor="sso:ana")
    apply_text(MAPPING.replace("leads: [file-lead]", "leads: [file-lead, ana]"))
    assert Membership.objects.get(user=user).granted_by_sso is False
    apply_sso_groups(user=user, groups=[], actor="sso:ana")
    assert Membership.objects.filter(user=user, role=Role.LEAD).exists()


def test_what_sign_ins_gave_goes_when_the_mapping_no_longer_gives_it() -> None:
    apply_text(MAPPING)
    user = User.objects.create_user("ana")
    apply_sso_groups(user=user, groups=["vision-leads"], actor="sso:ana")
    apply_text(TEAMS + "sso: {groups: []}\n", prune=True)
    assert SsoGroupRole.objects.count() == 0
    apply_sso_groups(user=user, groups=["vision-leads"], actor="sso:ana")
    assert not Membership.objects.filter(user=user).exists()


def _hold_in_thread(work: Any) -> tuple[threading.Thread, threading.Event, threading.Event]:
    """Run `work` in a transaction of its own connection and keep it open (its locks and
    uncommitted rows held) until the returned `release` is set."""
    holds, release = threading.Event(), threading.Event()

    def run() -> None:
        try:
            with transaction.atomic():
                work()
                holds.set()
                release.wait(10)
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    assert holds.wait(10)
    return thread, holds, release


def _run_in_thread(work: Any, errors: list[BaseException]) -> threading.Thread:
    """Start `work` on a connection of its own; what it raises goes to `errors`."""

    def run() -> None:
        try:
            work()
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _apply_in_thread(text: str, errors: list[BaseException]) -> threading.Thread:
    return _run_in_thread(lambda: apply_text(text), errors)


@pytest.mark.django_db(transaction=True)
def test_two_sign_ins_of_one_user_at_once_apply_one_after_the_other() -> None:
    apply_text(MAPPING)
    user = User.objects.create_user("ana")
    first_thread, _, release = _hold_in_thread(
        lambda: apply_sso_groups(user=user, groups=["vision-leads"], actor="sso:ana")
    )
    errors: list[BaseException] = []
    second_thread = _run_in_thread(
        lambda: apply_sso_groups(user=user, groups=["vision-leads"], actor="sso:ana"), errors
    )
    second_thread.join(0.5)
    assert second_thread.is_alive()  # waiting for the first sign-in to commit
    release.set()
    first_thread.join(10)
    second_thread.join(10)
    # It then saw the first's membership: no second insert, no unique violation.
    assert errors == []
    assert Membership.objects.filter(user=user).count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_file_naming_a_user_while_they_sign_in_makes_their_membership_its_own() -> None:
    apply_text(MAPPING)
    user = User.objects.create_user("ana")
    # Ana signs in: her sign-in gives her a vision membership and has not committed yet when
    # the file naming her a lead of vision is applied.
    signing_in, _, release = _hold_in_thread(
        lambda: apply_sso_groups(user=user, groups=["vision-all"], actor="sso:ana")
    )
    errors: list[BaseException] = []
    applying = _apply_in_thread(MAPPING.replace("[file-lead]", "[file-lead, ana]"), errors)
    applying.join(0.5)
    assert applying.is_alive()  # waiting for the sign-in, on ana's row
    release.set()
    signing_in.join(10)
    applying.join(20)
    # The apply saw the sign-in's membership and made it the file's: no unique violation.
    assert errors == []
    membership = Membership.objects.get(user=user)
    assert (membership.role, membership.granted_by_sso) == (Role.LEAD, False)
    assert AuditEntry.objects.filter(object_type="membership", action="update").exists()


@pytest.mark.django_db(transaction=True)
def test_a_file_naming_a_user_a_sign_in_is_creating_takes_that_user() -> None:
    apply_text(MAPPING)
    created = _hold_in_thread(lambda: User.objects.create_user("ben"))
    signing_in, _, release = created
    errors: list[BaseException] = []
    applying = _apply_in_thread(MAPPING.replace("[file-lead]", "[file-lead, ben]"), errors)
    applying.join(0.5)
    assert applying.is_alive()  # its insert of ben waits for the sign-in's
    release.set()
    signing_in.join(10)
    applying.join(20)
    assert errors == []
    user = User.objects.get(username="ben")
    assert not user.has_usable_password()
    assert Membership.objects.get(user=user).role == Role.LEAD


@pytest.mark.django_db(transaction=True)
def test_a_sign_in_creating_a_user_the_file_is_creating_signs_that_user_in() -> None:
    from teams.oidc import OidcBackend

    apply_text(MAPPING)
    applying, _, release = _hold_in_thread(
        lambda: apply_text(MAPPING.replace("[file-lead]", "[file-lead, cara]"))
    )
    found: list[Any] = []
    errors: list[BaseException] = []

    def sign_in() -> None:
        try:
            found.append(OidcBackend().create_user({"preferred_username": "cara"}))
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    signing_in = threading.Thread(target=sign_in)
    signing_in.start()
    signing_in.join(0.5)
    assert signing_in.is_alive()  # its insert waits for the apply's
    release.set()
    applying.join(10)
    signing_in.join(20)
    assert errors == []
    assert [user.pk for user in found] == [User.objects.get(username="cara").pk]
