"""Roles from the identity provider's groups: what a single sign-on login grants.

The policy file's `sso.groups` (stored as `SsoGroupRole` rows by `quota.policy.apply_policy`)
says which group of the identity provider makes its members a team's lead or member, finance,
or operator. `apply_sso_groups` runs at every single sign-on login, so a user removed from a
group in the identity provider loses the role at their next login.

Only what sign-ins gave is theirs to take: a membership the policy file (`leads:`/`members:`)
or the admin made is left as it is (`Membership.granted_by_sso` tells them apart), and so is
the finance or operators group when no `sso.groups` line gives that role. Superusers are
operators whatever their groups.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.db import transaction

from teams import audit
from teams.models import AuditEntry, Membership, Role, SsoGroupRole, SsoRole
from teams.selectors import FINANCE_GROUP, OPERATORS_GROUP

# The Tally-wide roles and the Django group each is (teams.selectors.user_role reads them).
_WIDE_ROLES = ((SsoRole.FINANCE, FINANCE_GROUP), (SsoRole.OPERATOR, OPERATORS_GROUP))


def apply_sso_groups(*, user: Any, groups: Iterable[str], actor: str) -> list[AuditEntry]:
    """Give `user` the roles the `sso.groups` mapping grants for `groups` (the identity
    provider's claim), and take those an earlier sign-in gave that the groups no longer do.

    Guarantees: one transaction under a lock on the user's row (two logins of one user at once
    apply one after the other); every membership created, changed or deleted and every change
    of the user's finance/operators groups is audited as `actor`; applying the same groups again
    writes nothing. Lead wins over member when several groups name one team. Returns the audit
    entries written.
    """
    claimed = set(groups)
    entries: list[AuditEntry] = []
    with transaction.atomic():
        rules = list(SsoGroupRole.objects.all())
        get_user_model().objects.select_for_update().filter(pk=user.pk).first()
        given = [rule for rule in rules if rule.group in claimed]
        entries += _apply_team_roles(user=user, given=given, actor=actor)
        entries += _apply_wide_roles(user=user, rules=rules, given=given, actor=actor)
    return entries


def _apply_team_roles(*, user: Any, given: list[SsoGroupRole], actor: str) -> list[AuditEntry]:
    wanted: dict[int, str] = {}
    for rule in given:
        if rule.team_id is not None and wanted.get(rule.team_id) != Role.LEAD:
            wanted[rule.team_id] = Role.LEAD if rule.role == SsoRole.LEAD else Role.MEMBER
    held = {
        membership.team_id: membership
        for membership in Membership.objects.select_related("team", "user").filter(user=user)
    }
    entries: list[AuditEntry] = []
    for team_id in sorted(wanted.keys() | held.keys()):
        membership, role = held.get(team_id), wanted.get(team_id)
        if membership is None:
            assert role is not None  # a team neither held nor wanted is not in the loop
            new = Membership(team_id=team_id, user=user, role=role, granted_by_sso=True)
            entries.append(audit.create(actor=actor, obj=new))
        elif not membership.granted_by_sso:
            continue  # the policy file's or the admin's: not a sign-in's to change
        elif role is None:
            entries += audit.delete(actor=actor, obj=membership)
        elif membership.role != role:
            before = audit.snapshot(membership)
            membership.role = role
            if (entry := audit.update(actor=actor, obj=membership, before=before)) is not None:
                entries.append(entry)
    return entries


def _apply_wide_roles(
    *, user: Any, rules: list[SsoGroupRole], given: list[SsoGroupRole], actor: str
) -> list[AuditEntry]:
    before = sorted(user.groups.values_list("name", flat=True))
    for role, group_name in _WIDE_ROLES:
        if not any(rule.role == role for rule in rules):
            continue  # no line gives this role: not the identity provider's to take away
        group, _ = Group.objects.get_or_create(name=group_name)
        if any(rule.role == role for rule in given):
            user.groups.add(group)
        else:
            user.groups.remove(group)
    after = sorted(user.groups.values_list("name", flat=True))
    if after == before:
        return []
    return [
        audit.record(
            actor=actor,
            action="update",
            obj=user,
            before={"groups": before},
            after={"groups": after},
        )
    ]
