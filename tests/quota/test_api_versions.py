"""The resource.k8s.io versions the webhooks read, and the answer to a claim of any other."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from django.test import Client

from quota.models import AdmissionDecision, Budget, QuotaRule, Reservation
from tests.quota.fixtures import claim, decide, gpu_request, make_team, post, review

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fleet")]

ALL_GPUS = {"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 2}
SUPPORTED = [f"resource.k8s.io/{v}" for v in ("v1", "v1beta2", "v1beta1", "v1alpha3")]


def classic_claim(name: str = "classic") -> dict[str, Any]:
    """A ResourceClaim of classic DRA (resource.k8s.io/v1alpha2): a class, no device requests."""
    return {
        "apiVersion": "resource.k8s.io/v1alpha2",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "research"},
        "spec": {"resourceClassName": "gpu.nvidia.com", "allocationMode": "WaitForFirstConsumer"},
    }


def flat_claim(api_version: str, count: int, name: str = "flat") -> dict[str, Any]:
    """A claim whose request carries its fields flat, as v1beta1 and v1alpha3 write it."""
    request = {"name": "gpu", "deviceClassName": "gpu.nvidia.com", "count": count}
    return claim(name, [request], api_version=api_version)


def names_versions(text: str, sent: str) -> None:
    assert repr(sent) in text, text
    for version in SUPPORTED:
        assert version in text, text


@pytest.mark.parametrize("path", ["/admission/resourceclaims", "/admission/resourceclaims/mutate"])
def test_classic_claim_is_denied_under_an_enforce_rule(client: Client, path: str) -> None:
    make_team([ALL_GPUS])
    response = post(client, review(classic_claim(), uid="uid-classic"), path)
    answer = response.json()["response"]
    assert answer["allowed"] is False
    assert answer["status"]["reason"] == "UnsupportedVersion"
    names_versions(answer["status"]["message"], "resource.k8s.io/v1alpha2")
    assert "all-gpus" in answer["status"]["message"]
    recorded = AdmissionDecision.objects.get(uid="uid-classic")
    assert recorded.allowed is False and recorded.team is not None
    assert recorded.webhook == ("mutate" if path.endswith("mutate") else "validate")
    assert not Reservation.objects.exists()


def test_unknown_version_with_a_readable_layout_is_still_denied(client: Client) -> None:
    # A v1-shaped request under a version Tally does not know is not guessed at.
    make_team([ALL_GPUS])
    answer = decide(client, claim("future", [gpu_request(1)], api_version="resource.k8s.io/v2"))
    assert answer["allowed"] is False
    names_versions(answer["status"]["message"], "resource.k8s.io/v2")
    assert QuotaRule.objects.get(name="all-gpus").in_use == 0


def test_classic_claim_is_allowed_with_a_warning_under_warn_rules(client: Client) -> None:
    make_team([{**ALL_GPUS, "mode": "warn"}])
    answer = decide(client, classic_claim(), uid="uid-warn")
    assert answer["allowed"] is True
    [warning] = answer["warnings"]
    names_versions(warning, "resource.k8s.io/v1alpha2")
    recorded = AdmissionDecision.objects.get(uid="uid-warn")
    assert recorded.allowed is True and recorded.warnings == [warning]
    # Admitted, counted on nothing; the sync follows it from its reservation.
    assert Reservation.objects.get(name="classic").lines.count() == 0
    assert QuotaRule.objects.get(name="all-gpus").in_use == 0


def test_classic_claim_of_a_team_without_rules_is_warned(client: Client) -> None:
    make_team([])
    answer = decide(client, classic_claim())
    assert answer["allowed"] is True
    names_versions(answer["warnings"][0], "resource.k8s.io/v1alpha2")


def test_classic_claim_in_an_unowned_namespace_is_warned(client: Client) -> None:
    obj = classic_claim()
    obj["metadata"]["namespace"] = "nobody"
    answer = decide(client, obj)
    assert answer["allowed"] is True
    assert len(answer["warnings"]) == 2, answer
    names_versions(answer["warnings"][1], "resource.k8s.io/v1alpha2")


def test_claim_without_api_version_is_read_as_the_reviews_kind(client: Client) -> None:
    make_team([ALL_GPUS])
    obj = flat_claim("resource.k8s.io/v1beta1", 1)
    del obj["apiVersion"]
    body = review(obj)
    body["request"]["kind"]["version"] = "v1beta1"
    answer = post(client, body).json()["response"]
    assert answer["allowed"] is True, answer
    assert QuotaRule.objects.get(name="all-gpus").in_use == 1


def test_claim_without_any_api_version_is_not_counted_as_v1(client: Client) -> None:
    make_team([ALL_GPUS])
    obj = claim("bare", [gpu_request(1)])
    del obj["apiVersion"]
    body = review(obj)
    del body["request"]["kind"]
    answer = post(client, body).json()["response"]
    assert answer["allowed"] is False
    assert "no apiVersion" in answer["status"]["message"]


@pytest.mark.parametrize("api_version", ["resource.k8s.io/v1alpha3", "resource.k8s.io/v1beta1"])
def test_flat_versions_are_counted(client: Client, api_version: str) -> None:
    # v1alpha3's DeviceRequest is v1beta1's: deviceClassName, count, allocationMode flat.
    make_team([ALL_GPUS])
    over = decide(client, flat_claim(api_version, 3, name="three"))
    assert over["allowed"] is False and over["status"]["reason"] == "QuotaExceeded", over
    assert decide(client, flat_claim(api_version, 2, name="two"))["allowed"] is True
    assert QuotaRule.objects.get(name="all-gpus").in_use == Decimal(2)


def test_classic_claim_past_a_hard_budget_is_denied(client: Client) -> None:
    # No enforce rule, but a spent hard budget: a claim Tally cannot read is not an exception.
    team = make_team([])
    Budget.objects.create(team=team, gpu_hours=Decimal(0), mode="hard")
    answer = decide(client, classic_claim())
    assert answer["allowed"] is False
    assert answer["status"]["reason"] == "BudgetExceeded"
