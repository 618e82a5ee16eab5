"""Driver profiles in the admin: specs checked as the policy file checks them, writes audited."""

from __future__ import annotations

import json

import pytest
from django.test import Client
from django.urls import reverse

from inventory import profiles
from inventory.models import DriverProfile
from teams.models import AuditEntry

pytestmark = pytest.mark.django_db
ADD = "admin:inventory_driverprofile_add"


def post(client: Client, driver: str, spec: str, url: str | None = None) -> object:
    return client.post(url or reverse(ADD), {"driver": driver, "spec": spec})


def test_an_operator_adds_and_edits_a_profile_audited(ops_client: Client) -> None:
    response = post(ops_client, "npu.example.com", '{"unit": "accelerator", "share": []}')
    assert response.status_code == 302  # type: ignore[attr-defined]
    row = DriverProfile.objects.get(driver="npu.example.com")
    assert (row.spec, row.source) == ({"unit": "accelerator", "share": []}, "admin")
    assert profiles.ProfileBook.load().get("npu.example.com").unit == "accelerator"

    change = reverse("admin:inventory_driverprofile_change", args=[row.pk])
    response = post(ops_client, "npu.example.com", '{"unit": "tpu"}', change)
    assert response.status_code == 302  # type: ignore[attr-defined]
    row.refresh_from_db()
    assert row.spec == {"unit": "tpu"}
    entries = AuditEntry.objects.filter(object_type="driver profile", object_repr=row.driver)
    assert sorted(entries.values_list("action", "actor")) == [
        ("create", "ops-admin"),
        ("update", "ops-admin"),
    ]
    listed = ops_client.get(reverse("admin:inventory_driverprofile_changelist"))
    assert listed.status_code == 200 and b"npu.example.com" in listed.content


@pytest.mark.parametrize(
    ("driver", "spec", "error"),
    [
        ("npu.example.com", '{"unit": "gpus"}', "unit: must be one of gpu, tpu, gaudi"),
        (
            "npu.example.com",
            '{"exclude": [{"capacity": "memory", "equals": true}]}',
            "exclude[0].equals: True is not a quantity",
        ),
        (
            "npu.example.com",
            '{"exclude": [{"attribute": "healthy", "equals": NaN}]}',
            "exclude[0].equals: must be a string, integer or boolean",
        ),
        ("npu.example.com", '["unit"]', "spec: must be a mapping of profile keys"),
        ("npu.example.com", "{not json", "Enter a valid JSON."),
        ("NPU_Example", "{}", "Not a DRA driver name"),
    ],
)
def test_a_bad_spec_is_a_form_error_naming_the_key(
    ops_client: Client, driver: str, spec: str, error: str
) -> None:
    response = post(ops_client, driver, spec)
    assert response.status_code == 200  # type: ignore[attr-defined]
    errors = response.context["adminform"].form.errors  # type: ignore[attr-defined]
    assert any(error in message for messages in errors.values() for message in messages), errors
    assert not DriverProfile.objects.exists()
    assert not AuditEntry.objects.filter(object_type="driver profile").exists()


def test_an_empty_spec_keeps_the_built_in_profile(ops_client: Client) -> None:
    response = post(ops_client, "gpu.amd.com", "")
    assert response.status_code == 302  # type: ignore[attr-defined]
    assert DriverProfile.objects.get(driver="gpu.amd.com").spec == {}
    assert profiles.ProfileBook.load().get("gpu.amd.com").unit == "gpu"


def test_the_stored_spec_is_the_checked_one(ops_client: Client) -> None:
    spec = {"unit": " gaudi ", "exclude": [{"capacity": "memory", "equals": 0}]}
    post(ops_client, "hpu.example.com", json.dumps(spec))
    assert DriverProfile.objects.get(driver="hpu.example.com").spec == {
        "unit": "gaudi",
        "exclude": [{"capacity": "memory", "equals": "0"}],
    }
