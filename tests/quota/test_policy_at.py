"""A policy applied as of a moment (`apply_policy(at=...)`, issue 35 item 3: how the demo lays
down a quota change part-way through its history): its audit entries are dated then, and a
namespace moved between teams changes owner from that hour."""

from __future__ import annotations

import textwrap
from datetime import UTC, datetime
from decimal import Decimal

import pytest

from quota.policy import apply_policy, load_policy
from teams import audit
from teams.models import AuditEntry, Team, TeamNamespace

pytestmark = pytest.mark.django_db

BEFORE = """
teams:
- slug: vision
  name: Vision
  namespaces: [vision, shared]
  quotas:
  - {name: all-gpus, deviceClass: gpu.nvidia.com, gpus: 32}
- slug: nlp
  name: NLP
  namespaces: [nlp]
"""
AFTER = (
    BEFORE.replace("gpus: 32", "gpus: 24")
    .replace("[vision, shared]", "[vision]")
    .replace("[nlp]", "[nlp, shared]")
)
START = datetime(2026, 11, 2, 9, 15, tzinfo=UTC)
CUT = datetime(2026, 11, 26, 14, 40, tzinfo=UTC)


def apply(text: str, at: datetime | None) -> None:
    apply_policy(policy=load_policy(textwrap.dedent(text)), prune=True, actor="demo", at=at)


def test_a_policy_applied_as_of_a_moment_is_dated_then() -> None:
    apply(BEFORE, START)
    apply(AFTER, CUT)

    created = AuditEntry.objects.filter(action="create", object_type="team")
    assert {entry.at for entry in created} == {START}
    cut = AuditEntry.objects.get(action="update", object_type="quota rule")
    assert cut.at == CUT and cut.before is not None and cut.after is not None
    assert (Decimal(cut.before["limit"]), Decimal(cut.after["limit"])) == (32, 24)
    hour = datetime(2026, 11, 26, 14, tzinfo=UTC)
    shared = TeamNamespace.dated.filter(namespace="shared")
    assert sorted(
        [(row.team.slug, row.valid_from, row.valid_until) for row in shared],
        key=lambda row: row[1] or START,
    ) == [
        ("vision", None, hour),  # the first owner, while no period was closed: since always
        ("nlp", hour, None),
    ]


def test_without_a_moment_entries_are_dated_when_written() -> None:
    with audit.dated(START):
        team = audit.create(actor="demo", obj=Team(slug="old", name="Old"))
    apply(BEFORE, None)

    assert team.at == START
    later = AuditEntry.objects.exclude(pk=team.pk)
    assert later.exists() and all(entry.at > START for entry in later)
