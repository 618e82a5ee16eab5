"""Quota as code: `load_policy`, `apply_policy` and the `apply_policy` command."""

from __future__ import annotations

import json
import textwrap
from decimal import Decimal
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.db.models import F
from django.utils import timezone

from billing.models import RateCard
from inventory.models import DriverProfile
from quota.models import Budget, QuotaRule, ReservationLine, ReservationState, Unit
from quota.policy import PolicyError, apply_policy, load_policy
from teams import audit
from teams.models import AuditEntry, Membership, Role, Team, TeamNamespace
from tests.quota.factories import (
    DeviceClassFactory,
    QuotaRuleFactory,
    ReservationFactory,
    TeamFactory,
    TeamNamespaceFactory,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "policy.example.yaml"
GIB = 2**30

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def device_classes() -> None:
    DeviceClassFactory.create(name="gpu.nvidia.com")
    DeviceClassFactory.create(name="mig.nvidia.com")


def run(path: Path | str, *args: str) -> str:
    out = StringIO()
    call_command("apply_policy", str(path), *args, stdout=out)
    return out.getvalue()


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def apply_text(text: str, *, prune: bool = False, dry_run: bool = False) -> Any:
    return apply_policy(
        policy=load_policy(textwrap.dedent(text)), prune=prune, actor="tester", dry_run=dry_run
    )


def errors_of(text: str, *, prune: bool = False) -> list[str]:
    with pytest.raises(PolicyError) as caught:
        apply_text(text, prune=prune)
    return caught.value.errors


def database() -> dict[str, list[tuple[Any, ...]]]:
    """Everything a policy can touch, to assert that nothing was."""
    return {
        "teams": list(Team.objects.order_by("pk").values_list()),
        "namespaces": list(TeamNamespace.objects.order_by("pk").values_list()),
        "memberships": list(Membership.objects.order_by("pk").values_list()),
        "rules": list(QuotaRule.objects.order_by("pk").values_list()),
        "budgets": list(Budget.objects.order_by("pk").values_list()),
        "rate cards": list(RateCard.objects.order_by("pk").values_list()),
        "audit": list(AuditEntry.objects.order_by("pk").values_list("pk")),
        "users": list(get_user_model().objects.order_by("pk").values_list("username")),
    }


VISION = """\
teams:
- slug: vision
  name: Vision Research
  namespaces: [vision, vision-dev]
  leads: [lead-vision]
  members: [alice, bob]
  quotas:
  - name: h100
    deviceClass: gpu.nvidia.com
    gpus: 8
"""


def test_example_file_applies() -> None:
    output = run(EXAMPLE)

    assert set(Team.objects.values_list("slug", flat=True)) == {"vision", "nlp"}
    vision = Team.objects.get(slug="vision")
    assert (vision.name, vision.cost_centre) == ("Vision Research", "CC-1234")
    assert set(vision.namespaces.values_list("namespace", flat=True)) == {"vision", "vision-dev"}
    assert dict(vision.memberships.values_list("user__username", "role")) == {
        "lead-vision": Role.LEAD,
        "alice": Role.MEMBER,
        "bob": Role.MEMBER,
    }
    h100 = vision.rules.get(name="h100")
    assert h100.selector.startswith('device.attributes["gpu.nvidia.com"].productName')
    assert (h100.unit, h100.limit, h100.mode, h100.in_use) == ("gpus", 8, "enforce", 0)
    assert vision.rules.get(name="mig-small").limit == Decimal("1.5")
    assert vision.rules.get(name="mig-small").mode == "warn"
    memory = QuotaRule.objects.get(team__slug="nlp", name="gpu-memory")
    assert (memory.unit, memory.limit) == (Unit.MEMORY, 640 * GIB)
    alice = get_user_model().objects.get(username="alice")
    assert not alice.has_usable_password()
    assert "created team vision" in output
    assert "created user alice" in output
    assert "team: 2 created" in output
    assert "quota rule: 4 created" in output
    assert dict(Budget.objects.values_list("team__slug", "mode")) == {
        "vision": "hard",
        "nlp": "soft",
    }
    assert RateCard.objects.count() == 4
    assert "rate card: 4 created" in output


def test_applying_twice_changes_nothing() -> None:
    run(EXAMPLE)
    before = database()

    output = run(EXAMPLE)

    assert database() == before
    assert output.strip().splitlines()[-1].endswith("no changes")


def test_audit_entries_have_before_and_after() -> None:
    apply_text(VISION)
    created = AuditEntry.objects.get(object_type="quota rule", action="create")
    assert created.actor == "tester"
    assert created.before is None
    assert created.after is not None
    assert created.after["limit"] == "8.000000"
    assert created.after["team"] == "vision"
    assert "in_use" not in created.after
    assert AuditEntry.objects.filter(action="create").count() == 1 + 2 + 3 + 1

    report = apply_text(VISION.replace("gpus: 8", "gpus: 16").replace("[alice, bob]", "[bob]"))

    updated = AuditEntry.objects.get(object_type="quota rule", action="update")
    assert updated.before is not None
    assert updated.after is not None
    assert (updated.before["limit"], updated.after["limit"]) == ("8.000000", "16.000000")
    assert updated.at <= timezone.now()
    assert report.changes == ["updated quota rule vision/h100: limit '8.000000' → '16.000000'"]
    assert "kept membership alice (member of vision): not declared (--prune deletes it)" in (
        report.notes
    )


def test_role_change_is_an_update() -> None:
    apply_text(VISION)
    apply_text(
        VISION.replace("leads: [lead-vision]", "leads: [lead-vision, alice]").replace(
            "members: [alice, bob]", "members: [bob]"
        )
    )
    entry = AuditEntry.objects.get(object_type="membership", action="update")
    assert entry.before is not None
    assert entry.after is not None
    assert (entry.before["role"], entry.after["role"]) == ("member", "lead")


def test_without_prune_nothing_is_removed() -> None:
    run(EXAMPLE)
    before = database()

    report = apply_text(VISION.replace("[vision, vision-dev]", "[vision]"))

    after = database()
    for kind in ("teams", "namespaces", "memberships", "rules"):
        assert [row[0] for row in after[kind]] == [row[0] for row in before[kind]], kind
    assert not AuditEntry.objects.filter(action="delete").exists()
    assert "kept team nlp: not declared (--prune deletes it)" in report.notes
    # Released, not deleted: its hours stay vision's (dated ownership).
    assert "kept team namespace vision-dev: not declared (--prune releases it)" in report.notes


def test_prune_removes_what_the_file_no_longer_declares(tmp_path: Path) -> None:
    run(EXAMPLE)
    path = write(
        tmp_path,
        VISION.replace("[vision, vision-dev]", "[vision]").replace("[alice, bob]", "[alice]"),
    )

    output = run(path, "--prune")

    assert list(Team.objects.values_list("slug", flat=True)) == ["vision"]
    assert list(TeamNamespace.objects.values_list("namespace", flat=True)) == ["vision"]
    # vision-dev released, not deleted: its past hours stay vision's (dated ownership).
    released = TeamNamespace.dated.get(namespace="vision-dev")
    assert (released.team.slug, released.valid_until is not None) == ("vision", True)
    assert set(Membership.objects.values_list("user__username", flat=True)) == {
        "lead-vision",
        "alice",
    }
    assert list(QuotaRule.objects.values_list("name", flat=True)) == ["h100"]
    # The rule's selector was dropped from the file: an update, not a delete.
    assert QuotaRule.objects.get().selector == ""
    deleted = set(
        AuditEntry.objects.filter(action="delete").values_list("object_type", "object_repr")
    )
    assert deleted == {
        ("team", "nlp"),
        ("team namespace", "nlp"),
        ("membership", "lead-nlp (lead of nlp)"),
        ("membership", "carol (member of nlp)"),
        ("membership", "bob (member of vision)"),
        ("quota rule", "nlp/gpu-memory"),
        ("quota rule", "nlp/h100"),
        ("quota rule", "vision/mig-small"),
        # Not in VISION: vision's budget goes; nlp's is deleted before its team, not cascaded.
        ("budget", "vision: 2000 GPU-hours (hard)"),
        ("budget", "nlp: 1500 GPU-hours (soft)"),
        # Not in VISION either: vision's idle alert threshold goes back to none.
        ("idle alert policy", "vision: below 5% for 4 h"),
        # nlp's narrowToFit goes with its team, audited.
        ("narrowing policy", "nlp: narrow to fit on"),
    }
    assert (
        AuditEntry.objects.get(object_repr="nlp", object_type="team", action="delete").after is None
    )
    assert "team: 1 deleted" in output
    assert "quota rule: 3 deleted, 1 updated" in output
    # Users are kept: they may belong to other teams, and to history.
    assert get_user_model().objects.filter(username="carol").exists()


def test_prune_refuses_a_team_with_reservations_and_a_rule_in_use() -> None:
    run(EXAMPLE)
    nlp = Team.objects.get(slug="nlp")
    ReservationFactory.create(team=nlp)
    ReservationFactory.create(team=nlp, state=ReservationState.RELEASED)
    old = TeamFactory.create(slug="old")
    ReservationFactory.create(team=old, state=ReservationState.RELEASED)
    QuotaRule.objects.filter(team__slug="vision", name="mig-small").update(in_use=Decimal("0.5"))
    before = database()

    errors = errors_of(VISION, prune=True)

    assert errors == [
        "teams[0].quotas: rule 'mig-small' is not declared but has 0.500000 in use; "
        "a rule in use is never deleted",
        "teams: team 'nlp' is not declared but has 2 reservations (1 live), which keep their "
        "team; it is not deleted",
        "teams: team 'old' is not declared but has 1 reservation (0 live), which keep their "
        "team; it is not deleted",
    ]
    assert database() == before


def test_dry_run_writes_nothing() -> None:
    before = database()

    output = run(EXAMPLE, "--dry-run")

    assert database() == before
    assert "created team vision" in output
    assert "dry run, nothing written: " in output


def test_in_use_is_the_ledgers() -> None:
    apply_text(VISION)
    # The webhook reserves after the policy was read: a full save would write in_use back.
    rule = QuotaRule.objects.get(name="h100")
    reservation = ReservationFactory.create(team=rule.team, namespace="vision")
    ReservationLine.objects.create(reservation=reservation, rule=rule, amount=3)
    QuotaRule.objects.filter(name="h100").update(in_use=F("in_use") + 3)

    report = apply_text(VISION.replace("gpus: 8", "gpus: 10"))

    rule.refresh_from_db()
    assert (rule.limit, rule.in_use) == (10, 3)
    assert not [note for note in report.notes if "recounted" in note]  # it was true


def test_a_changed_rule_is_recounted_and_the_report_says_so() -> None:
    apply_text(VISION)
    QuotaRule.objects.filter(name="h100").update(in_use=3)  # no reservation holds it

    report = apply_text(VISION.replace("gpus: 8", "gpus: 10"))

    assert QuotaRule.objects.get(name="h100").in_use == 0
    assert "usage of quota rule vision/h100 recounted: 3 → 0" in report.notes


def test_unit_change_is_refused_while_in_use() -> None:
    apply_text(VISION)
    QuotaRule.objects.filter(name="h100").update(in_use=2)
    before = database()

    errors = errors_of(VISION.replace("gpus: 8", "memory: 80Gi"))

    assert errors == [
        "teams[0].quotas[0]: cannot change the unit of rule 'h100' from gpus to memory "
        "while 2.000000 is in use"
    ]
    assert database() == before


def test_namespace_moves_between_declared_teams() -> None:
    run(EXAMPLE)
    text = EXAMPLE.read_text().replace("[vision, vision-dev]", "[vision]")
    text = text.replace("namespaces: [nlp]", "namespaces: [nlp, vision-dev]")

    apply_text(text)

    # Dated: vision's ownership ends at this hour, nlp's begins there; never unowned between.
    moved = TeamNamespace.objects.get(namespace="vision-dev")
    assert moved.team.slug == "nlp" and moved.valid_from is not None
    ended = AuditEntry.objects.get(action="update", object_type="team namespace")
    assert ended.before is not None and ended.after is not None
    assert (ended.before["team"], ended.before["valid_until"]) == ("vision", None)
    assert ended.after["valid_until"] == moved.valid_from.isoformat()
    created = AuditEntry.objects.get(
        action="create", object_type="team namespace", object_repr="vision-dev", pk__gt=ended.pk
    )
    assert created.after is not None and created.after["team"] == "nlp"


def test_namespace_of_an_undeclared_team(tmp_path: Path) -> None:
    TeamNamespaceFactory.create(team__slug="robotics", namespace="vision-dev")
    before = database()

    with pytest.raises(CommandError) as caught:
        run(write(tmp_path, VISION))

    assert (
        "teams[0].namespaces[1]: namespace 'vision-dev' is owned by team 'robotics', which the "
        "file does not declare" in str(caught.value)
    )
    assert database() == before
    # With --prune the file is the whole truth: the namespace moves, the team goes.
    run(write(tmp_path, VISION), "--prune")
    assert TeamNamespace.objects.get(namespace="vision-dev").team.slug == "vision"
    assert not Team.objects.filter(slug="robotics").exists()


BROKEN = """\
colour: blue
rates: {}
teams:
- slug: vision
  name: Vision
  namespaces: [vision, Vision_Dev]
  leads: [lead-vision]
  members: [alice, lead-vision]
  quotaz: []
  budget: 100
  quotas:
  - name: h100
    deviceClass: gpu.nvidia.co
    selector: device.attributes["gpu.nvidia.com"].productName.startsWith(
    gpus: 8
  - name: h100
    deviceClass: gpu.nvidia.com
    gpus: 8
    memory: 80Gi
  - name: half
    deviceClass: gpu.nvidia.com
    gpus: -0.5
    mode: strict
  - name: mem
    deviceClass: gpu.nvidia.com
    memory: 80Gx
  - name: tiny
    deviceClass: gpu.nvidia.com
    gpus: 0.0000001
  - name: fraction
    deviceClass: gpu.nvidia.com
    memory: 100m
  - deviceClass: gpu.nvidia.com
    gpus: "8"
- slug: vision
  name: Vision again
  namespaces: [vision]
- slug: not a slug
- name: No slug
"""


def test_every_error_is_reported_with_its_path_and_nothing_is_applied(tmp_path: Path) -> None:
    TeamFactory.create(slug="existing")
    before = database()

    with pytest.raises(CommandError) as caught:
        run(write(tmp_path, BROKEN))

    message = str(caught.value)
    expected = [
        "(top level): unknown key 'colour'",
        "rates: must be a list, got dict",
        "teams[0]: unknown key 'quotaz'",
        "teams[0].namespaces[1]: 'Vision_Dev' is not a Kubernetes namespace name",
        "teams[0].members[1]: 'lead-vision' is already listed at teams[0].leads[0]",
        "teams[0].budget: must be a mapping, got int",
        "teams[0].quotas[0].deviceClass: unknown device class 'gpu.nvidia.co'; "
        "did you mean 'gpu.nvidia.com'?",
        "teams[0].quotas[0].selector: bad CEL: syntax error in CEL selector",
        "teams[0].quotas[1]: set exactly one of gpus or memory",
        "teams[0].quotas[2].gpus: must be positive, got -0.5",
        "teams[0].quotas[2].mode: must be one of enforce, warn, got 'strict'",
        "teams[0].quotas[3].memory: '80Gx' is not a Kubernetes quantity (such as 640Gi)",
        "teams[0].quotas[4].gpus: 1e-07 has more than 6 decimal places",
        "teams[0].quotas[5].memory: '100m' is not a whole number of bytes",
        "teams[0].quotas[6].name: required",
        "teams[0].quotas[6].gpus: must be a positive number, got '8'",
        "teams[1].slug: duplicate slug 'vision' (also teams[0])",
        "teams[1].namespaces[0]: namespace 'vision' is also claimed by teams[0].namespaces[0]",
        "teams[2].name: required",
        "teams[2].slug: 'not a slug' is not a slug",
        "teams[3].slug: required",
    ]
    for error in expected:
        assert error in message, error
    assert message.startswith(f"{write(tmp_path, BROKEN)}: ")
    assert database() == before


def test_duplicate_rule_names_are_reported() -> None:
    with pytest.raises(PolicyError) as caught:
        load_policy(VISION + "  - name: h100\n    deviceClass: gpu.nvidia.com\n    gpus: 1\n")
    assert caught.value.errors == [
        "teams[0].quotas[1].name: duplicate rule name 'h100' (also teams[0].quotas[0])"
    ]


SIXTY = "[" + ", ".join(str(i) for i in range(60)) + "]"


@pytest.mark.parametrize(
    ("selector", "problem"),
    [
        # Not a bool: it passed before, and then covered nothing.
        ("1", "must evaluate to bool or the unknown type, not int"),
        ("device.driver", "must evaluate to bool or the unknown type, not string"),
        # Within the API server's cost limit, not within Tally's.
        (f"{SIXTY}.all(x, {SIXTY}.all(y, x + y >= 0))", "is too expensive: its estimated cost"),
        ("device.attributes['gpu.nvidia.com'].type.frobnicate()", "undeclared reference to"),
    ],
)
def test_a_selector_tally_cannot_evaluate_is_a_validation_error(
    selector: str, problem: str
) -> None:
    with pytest.raises(PolicyError) as caught:
        load_policy(VISION.replace("gpus: 8", f"gpus: 8\n    selector: {json.dumps(selector)}"))
    [error] = caught.value.errors
    assert error.startswith("teams[0].quotas[0].selector: bad CEL: ")
    assert problem in error


def test_bad_selector_error_names_the_position() -> None:
    with pytest.raises(PolicyError) as caught:
        load_policy(VISION.replace("gpus: 8", "gpus: 8\n    selector: device.driver ==="))
    [error] = caught.value.errors
    assert error.startswith("teams[0].quotas[0].selector: bad CEL: ")
    assert "line 1, column" in error


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("", "the file is empty: declare `teams:` (a list)"),
        ("teams: [\n", "not valid YAML: "),
        ("teams: []\nteams: []\n", "found duplicate key 'teams'"),
        ("- slug: x\n", "(top level): must be a mapping, got list"),
        ("rates: []\n", "teams: required"),
    ],
)
def test_malformed_files(text: str, error: str) -> None:
    with pytest.raises(PolicyError) as caught:
        load_policy(text)
    assert any(error in message for message in caught.value.errors), caught.value.errors


def test_device_classes_are_not_checked_while_the_inventory_has_none() -> None:
    from inventory.models import DeviceClass

    DeviceClass.objects.all().delete()

    policy = load_policy(VISION.replace("gpu.nvidia.com", "anything.example.com"))

    assert policy.teams[0].rules[0].device_class == "anything.example.com"
    assert (
        "deviceClass: the inventory holds no device classes yet; names not checked" in policy.notes
    )


def test_gone_device_classes_are_unknown() -> None:
    from inventory.models import DeviceClass

    DeviceClass.objects.filter(name="mig.nvidia.com").update(gone_at=timezone.now())

    with pytest.raises(PolicyError) as caught:
        load_policy(VISION.replace("gpu.nvidia.com", "mig.nvidia.com"))
    assert caught.value.errors == [
        "teams[0].quotas[0].deviceClass: unknown device class 'mig.nvidia.com'"
    ]


def test_quantities() -> None:
    policy = load_policy(
        VISION.replace("gpus: 8", "memory: 1.5Ti")
        + "  - name: half\n    deviceClass: gpu.nvidia.com\n    gpus: 0.5\n"
        + "  - name: bytes\n    deviceClass: gpu.nvidia.com\n    memory: 1000000\n"
    )
    limits = {rule.name: (rule.unit, rule.limit) for rule in policy.teams[0].rules}
    assert limits == {
        "h100": (Unit.MEMORY, Decimal(3 * 2**39)),
        "half": (Unit.GPUS, Decimal("0.5")),
        "bytes": (Unit.MEMORY, Decimal(1000000)),
    }


def test_snapshot_is_json_safe() -> None:
    rule = QuotaRuleFactory.create(team__slug="vision", name="h100", limit=Decimal("0.5"))
    assert audit.snapshot(rule) == {
        "id": rule.pk,
        "team": "vision",
        "name": "h100",
        "device_class": "gpu.nvidia.com",
        "selector": "",
        "unit": "gpus",
        "limit": "0.500000",
        "mode": "enforce",
    }
    team_snapshot = audit.snapshot(rule.team)
    assert isinstance(team_snapshot["created_at"], str)


def test_record_rejects_an_unknown_action() -> None:
    team = TeamFactory.create()
    with pytest.raises(ValueError, match="unknown audit action"):
        audit.record(actor="x", action="rename", obj=team, before=None, after=None)


def test_the_example_files_commented_drivers_section_applies_as_written() -> None:
    """The example file's `drivers:` example, uncommented, is a valid policy: the comment
    documents keys the checker accepts, not a stale spelling of them."""
    text = EXAMPLE.read_text()
    block = text[text.index("# drivers:\n") :].splitlines()
    drivers = "\n".join(line.removeprefix("# ") for line in block)

    apply_text("teams: []\n" + drivers)

    profile = DriverProfile.objects.get(driver="npu.example.com")
    assert profile.spec["whole_types"] == ["npu"]
    assert profile.spec["exclude"] == [{"capacity": "hbm", "equals": "0"}]
