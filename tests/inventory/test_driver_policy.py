"""The policy file's `drivers:` section: driver profiles as code, checked, applied, audited."""

from __future__ import annotations

import textwrap
from datetime import UTC, datetime
from typing import Any

import pytest

from inventory import services
from inventory.dumps import iter_objects
from inventory.models import Device, DriverProfile
from quota.policy import PolicyError, apply_policy, load_policy
from teams.models import AuditEntry
from tests.fixtures import DRA

pytestmark = pytest.mark.django_db

POLICY = """\
teams: []
drivers:
  npu.example.com:
    unit: accelerator
    model_attributes: [model]
  gpu.intel.com:
    exclude: []
"""


def apply_text(text: str, *, prune: bool = False, dry_run: bool = False) -> Any:
    return apply_policy(
        policy=load_policy(textwrap.dedent(text)), prune=prune, actor="tester", dry_run=dry_run
    )


def errors_of(text: str) -> list[str]:
    with pytest.raises(PolicyError) as caught:
        load_policy(textwrap.dedent(text))
    return caught.value.errors


def profiles() -> dict[str, tuple[dict[str, Any], str]]:
    return {row.driver: (row.spec, row.source) for row in DriverProfile.objects.all()}


def test_drivers_are_written_as_policy_profiles_audited_and_idempotent() -> None:
    report = apply_text(POLICY)
    assert profiles() == {
        "npu.example.com": ({"unit": "accelerator", "model_attributes": ["model"]}, "policy"),
        "gpu.intel.com": ({"exclude": []}, "policy"),
    }
    assert report.counts["driver profile"]["created"] == 2
    entries = AuditEntry.objects.filter(object_type="driver profile", action="create")
    assert sorted(entries.values_list("object_repr", flat=True)) == [
        "gpu.intel.com",
        "npu.example.com",
    ]
    assert set(entries.values_list("actor", flat=True)) == {"tester"}
    again = apply_text(POLICY)
    assert not again.changed


def test_a_changed_spec_is_an_audited_update() -> None:
    apply_text(POLICY)
    report = apply_text(POLICY.replace("unit: accelerator", "unit: tpu"))
    assert profiles()["npu.example.com"][0]["unit"] == "tpu"
    assert report.counts["driver profile"]["updated"] == 1
    assert any("npu.example.com" in line and "tpu" in line for line in report.changes)


def test_undeclared_policy_profiles_are_pruned_and_hand_written_ones_kept() -> None:
    apply_text(POLICY)
    DriverProfile.objects.create(driver="fpga.example.com", spec={}, source="admin")
    only_npu = POLICY.split("  gpu.intel.com:")[0]
    kept = apply_text(only_npu)
    assert "gpu.intel.com" in profiles()
    assert any("driver profile gpu.intel.com" in note for note in kept.notes)
    pruned = apply_text(only_npu, prune=True)
    assert set(profiles()) == {"npu.example.com", "fpga.example.com"}
    assert pruned.counts["driver profile"]["deleted"] == 1
    assert AuditEntry.objects.filter(
        object_type="driver profile", action="delete", object_repr="gpu.intel.com"
    ).exists()


def test_a_file_without_drivers_leaves_the_profiles_alone_even_when_pruning() -> None:
    apply_text(POLICY)
    report = apply_text("teams: []\n", prune=True)
    assert set(profiles()) == {"npu.example.com", "gpu.intel.com"}
    assert any(note.startswith("drivers: not declared") for note in report.notes)


def test_a_dry_run_writes_no_profile() -> None:
    report = apply_text(POLICY, dry_run=True)
    assert report.changed and profiles() == {}


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("drivers: [gpu.amd.com]", "drivers: must be a mapping of driver name to profile"),
        (
            "drivers:\n  Bad_Name: {}",
            "drivers.Bad_Name: not a DRA driver name",
        ),
        (
            "drivers:\n  npu.example.com: {unit: gpus}",
            "drivers.npu.example.com.unit: must be one of gpu, tpu, gaudi, accelerator",
        ),
        (
            "drivers:\n  npu.example.com: {share: [first-counter]}",
            "drivers.npu.example.com.share[0]: 'first-counter' is not a share rule",
        ),
        (
            "drivers:\n  npu.example.com: {exclude: [{capacity: memory, equals: lots}]}",
            "drivers.npu.example.com.exclude[0].equals: 'lots' is not a quantity",
        ),
        (
            "drivers:\n  npu.example.com: {identity: [serial]}",
            "drivers.npu.example.com.identity: is not a profile key",
        ),
        ("drivers:\n  npu.example.com: [unit]", "drivers.npu.example.com: must be a mapping"),
    ],
)
def test_bad_driver_profiles_are_refused_naming_the_path(text: str, error: str) -> None:
    errors = errors_of("teams: []\n" + text + "\n")
    assert len(errors) == 1 and errors[0].startswith(error), errors
    assert DriverProfile.objects.count() == 0


def test_an_applied_profile_changes_what_the_next_sync_counts() -> None:
    cluster = services.get_cluster("fx")
    objects = list(iter_objects(DRA / "vendors" / "intel-gpu.yaml"))
    at = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)
    services.import_snapshot(cluster=cluster, objects=objects, at=at)
    integrated = Device.objects.get(name="0000-00-02-0-0xa7a0")
    assert integrated.kind == "other"
    apply_text(POLICY)
    services.import_snapshot(cluster=cluster, objects=objects, at=at.replace(hour=9))
    integrated.refresh_from_db()
    assert (integrated.kind, integrated.unit, integrated.gpu_share) == ("gpu", "gpu", 1)
    assert integrated.meter_id.startswith("dra-")
