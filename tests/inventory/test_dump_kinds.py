"""`sync_inventory --from-file --kinds`: a dump is a full snapshot of the kinds it holds and of
those named, so a cluster whose last claims went is not left with them live.

`kubectl get resourceclaims -A -o yaml` of a cluster with no claims prints an empty `List`,
the same as a dump that never asked for claims: the operator says which kinds it covers."""

from __future__ import annotations

import io
import json
from datetime import UTC, datetime
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from inventory.models import Allocation, ResourceClaim
from tests.inventory.test_kube_sync import claim, resource_slice

pytestmark = pytest.mark.django_db

BEFORE = "2026-11-30T12:00:00Z"
AFTER = "2026-11-30T13:00:00Z"


def dump(tmp_path: Path, name: str, *items: dict) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": list(items)}))
    return path


def sync(path: Path, *args: str) -> None:
    call_command("sync_inventory", "--from-file", str(path), *args, stdout=io.StringIO())


def test_a_dump_without_claims_releases_them_only_where_kinds_names_them(tmp_path: Path) -> None:
    held = claim("train", node="node-a", device="gpu-0")
    sync(dump(tmp_path, "held.json", resource_slice("node-a"), held), "--at", BEFORE)
    assert ResourceClaim.objects.filter(released_at__isnull=True).count() == 1

    slices_only = dump(tmp_path, "slices.json", resource_slice("node-a"))
    # Without --kinds the dump says nothing of claims: the claim stays live.
    sync(slices_only, "--at", AFTER)
    assert ResourceClaim.objects.filter(released_at__isnull=True).count() == 1

    sync(slices_only, "--at", AFTER, "--kinds", "ResourceClaim")

    (gone,) = ResourceClaim.objects.all()
    assert gone.released_at == datetime(2026, 11, 30, 13, tzinfo=UTC)
    (allocation,) = Allocation.objects.all()
    assert allocation.end == datetime(2026, 11, 30, 13, tzinfo=UTC)


def test_an_unknown_kind_with_from_file_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    path = dump(tmp_path, "held.json", resource_slice("node-a"))
    with pytest.raises(CommandError, match=r"unknown kind.*Pods"):
        sync(path, "--kinds", "Pods")
    assert not ResourceClaim.objects.exists()
