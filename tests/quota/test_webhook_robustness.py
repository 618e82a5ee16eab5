"""The webhooks on input the API server may send and input it never would.

- Every decision either webhook makes on a CREATE reaches the decision log once: a denial of
  the mutating webhook (the API server then never calls the validating one) as well as every
  decision of the validating one.
- Anything the API server can send fits the records (a service account's username is longer
  than 253 characters), and only a database that cannot be reached may take the fail-open
  path: a statement the database refuses is a denial, never an admission that reserved nothing.
- Malformed input never gets a 500: a body that is no AdmissionReview gets 400 with the reason,
  a malformed claim a denial naming the field.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.conf import settings
from django.db import DataError, IntegrityError, InternalError, OperationalError, ProgrammingError
from django.test import Client

from quota.admission import store
from quota.management.commands.review_claims import review as review_claim_command
from quota.models import AdmissionDecision, QuotaRule, Reservation
from tests.quota.fixtures import claim, gpu_request, make_team, post, review

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fleet")]

VALIDATE, MUTATE = "/admission/resourceclaims", "/admission/resourceclaims/mutate"
WEBHOOKS = pytest.mark.parametrize("path", [VALIDATE, MUTATE], ids=["validate", "mutate"])
# A service account's username: "system:serviceaccount:" + a namespace (63) + ":" + a name
# (253), 338 characters.
LONG_USERNAME = f"system:serviceaccount:{'n' * 63}:{'s' * 253}"


def _answer(client: Client, body: Any, path: str = VALIDATE) -> dict[str, Any]:
    response = post(client, body, path)
    assert response.status_code == 200, response.content
    answer: dict[str, Any] = response.json()["response"]
    return answer


def _full_team() -> None:
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 2}])
    QuotaRule.objects.filter(name="all-gpus").update(in_use=2)


# --- Finding 3: the mutating webhook's denials are recorded -----------------------------------


def test_a_denial_by_the_mutating_webhook_is_recorded(client: Client) -> None:
    _full_team()
    answer = _answer(client, review(claim("big", [gpu_request(1)]), uid="m-1"), MUTATE)
    assert answer["allowed"] is False
    decision = AdmissionDecision.objects.get()
    assert (decision.uid, decision.namespace, decision.name) == ("m-1", "research", "big")
    assert (decision.webhook, decision.allowed, decision.username) == ("mutate", False, "alice")
    assert decision.message == answer["status"]["message"]
    assert decision.team is not None and decision.team.slug == "research"


def test_a_create_is_recorded_once_whichever_webhook_decides(client: Client) -> None:
    """The API server's CREATE (as `review_claims` sends it): the mutating webhook, then the
    validating one unless the mutating one denied."""
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 2}])

    def send(path: str, body: dict[str, Any]) -> dict[str, Any]:
        return _answer(client, body, path)

    fits = review_claim_command(send, claim("fits", [gpu_request(2)]), username="a", dry_run=False)
    over = review_claim_command(send, claim("over", [gpu_request(1)]), username="a", dry_run=False)
    assert (fits.allowed, over.allowed) == (True, False)
    recorded = AdmissionDecision.objects.order_by("pk").values_list("name", "webhook", "allowed")
    assert list(recorded) == [("fits", "validate", True), ("over", "mutate", False)]
    # Both inserts (the reserving statement's and a denial's) name the webhook's cluster.
    clusters = AdmissionDecision.objects.values_list("cluster", flat=True)
    assert set(clusters) == {settings.TALLY_CLUSTER_NAME}


def test_the_mutating_webhook_records_nothing_it_allows_or_a_dry_run(client: Client) -> None:
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 2}])
    assert _answer(client, review(claim("fits", [gpu_request(1)])), MUTATE)["allowed"] is True
    denied = _answer(client, review(claim("big", [gpu_request(3)]), dry_run=True), MUTATE)
    assert denied["allowed"] is False
    assert not AdmissionDecision.objects.exists()


# --- Finding 5: what the API server sends fits; only an outage fails open ---------------------


@pytest.mark.parametrize("fail_open", [False, True], ids=["fail-closed", "fail-open"])
def test_a_service_accounts_long_username_is_admitted_and_reserved(
    client: Client, settings: Any, fail_open: bool
) -> None:
    settings.TALLY_WEBHOOK_FAIL_OPEN = fail_open
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 2}])
    answer = _answer(client, review(claim("c", [gpu_request(1)]), username=LONG_USERNAME))
    assert answer == {"uid": answer["uid"], "allowed": True}
    assert Reservation.objects.get().username == LONG_USERNAME
    assert AdmissionDecision.objects.get().username == LONG_USERNAME
    assert QuotaRule.objects.get().in_use == 1
    # Over quota, the same user is denied (and recorded), not "database unavailable".
    over = _answer(client, review(claim("big", [gpu_request(1000)]), username=LONG_USERNAME))
    assert over["allowed"] is False
    assert over["status"]["reason"] == "QuotaExceeded"


def test_owner_references_of_any_length_fit(client: Client) -> None:
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 2}])
    made = claim("pod-gpu", [gpu_request(1)])
    owner = {"apiVersion": "v1", "kind": "K" * 300, "name": "p" * 300, "uid": "u"}
    made["metadata"]["ownerReferences"] = [{**owner, "controller": True}]
    answer = _answer(client, review(made, username="system:kube-controller-manager"))
    assert answer["allowed"] is True
    reservation = Reservation.objects.get()
    assert (reservation.owner_kind, reservation.owner_name) == ("K" * 300, "p" * 300)


@pytest.mark.parametrize("error", [DataError, IntegrityError, ProgrammingError, InternalError])
def test_a_statement_the_database_refuses_is_a_denial_even_failing_open(
    client: Client, settings: Any, monkeypatch: pytest.MonkeyPatch, error: type[Exception]
) -> None:
    settings.TALLY_WEBHOOK_FAIL_OPEN = True
    _full_team()

    def refused(sql: str, params: list[Any]) -> list[tuple[Any, ...]]:
        raise error("refused")

    monkeypatch.setattr(store, "fetch_prepared", refused)
    answer = _answer(client, review(claim("big", [gpu_request(1000)])))
    assert answer["allowed"] is False
    assert answer["status"]["reason"] != "ServiceUnavailable"
    assert not Reservation.objects.exists()


def test_an_outage_may_still_fail_open(
    client: Client, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings.TALLY_WEBHOOK_FAIL_OPEN = True
    _full_team()

    def unreachable(sql: str, params: list[Any]) -> list[tuple[Any, ...]]:
        raise OperationalError("connection refused")

    monkeypatch.setattr(store, "fetch_prepared", unreachable)
    answer = _answer(client, review(claim("c", [gpu_request(1)])))
    assert answer["allowed"] is True
    assert answer["warnings"] == ["Tally could not check quota (database unavailable)"]


@pytest.mark.parametrize("controller", [True, False], ids=["in-text", "in-json"])
def test_a_value_postgresql_cannot_store_is_a_denial_even_failing_open(
    client: Client, settings: Any, controller: bool
) -> None:
    """The database refuses a NUL, in text (the controller's name is a column) or in JSON
    (every owner reference is kept): a clear denial, nothing reserved."""
    settings.TALLY_WEBHOOK_FAIL_OPEN = True
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 2}])
    made = claim("c", [gpu_request(1)])
    owner = {"apiVersion": "v1", "kind": "Pod", "name": "nul\x00", "uid": "u"}
    made["metadata"]["ownerReferences"] = [{**owner, "controller": controller}]
    answer = _answer(client, review(made, username="system:kube-controller-manager"))
    assert answer["allowed"] is False
    assert answer["status"]["reason"] == "Invalid"
    assert "cannot store" in answer["status"]["message"]
    assert not Reservation.objects.exists()
    assert QuotaRule.objects.get().in_use == 0


# --- Finding 9: malformed input -----------------------------------------------------------------


def _body(count: str) -> bytes:
    """A review of a one-request claim whose count is `count`, as JSON text."""
    return (
        json.dumps(review(claim("c", [gpu_request(1)]), uid="u"))
        .replace('"count": 1', f'"count": {count}')
        .encode()
    )


@WEBHOOKS
@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (_body("9" * 5000), "not valid JSON"),
        (_body("1e400"), "not valid JSON"),
        (b'{"request": ' * 10_000 + b"{}" + b"}" * 10_000, "not valid JSON"),
        (b'{"request": ' * 100 + b"{}" + b"}" * 100, "nested deeper than"),
        (b'{"request": {"uid": "' + b"u" * 100 + b'"}}', "request.uid"),
    ],
    ids=["5000-digits", "past-a-double", "10000-deep", "100-deep", "long-uid"],
)
def test_a_body_that_is_no_admission_review_gets_400_with_the_reason(
    client: Client, path: str, body: bytes, reason: str
) -> None:
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 2}])
    if reason == "request.uid":
        body = json.dumps(review(claim("c", [gpu_request(1)]), uid="u" * 100)).encode()
    response = post(client, body, path)
    assert response.status_code == 400, response.content
    assert reason in response.content.decode()
    assert not Reservation.objects.exists()


@WEBHOOKS
@pytest.mark.parametrize(
    ("count", "problem"),
    [
        ('"2"', "must be an integer, not a string"),
        ("2.0", "must be an integer, not float"),
        ("1e25", "must be an integer, not float"),
        ("-1", "must be at least 1"),
        ("0", "must be at least 1"),
        ("18446744073709551615", "must be at most 65536"),
        ("65537", "must be at most 65536"),
        ("true", "must be an integer, not a boolean"),
    ],
)
def test_a_claims_count_must_be_a_sensible_integer(
    client: Client, settings: Any, path: str, count: str, problem: str
) -> None:
    settings.TALLY_WEBHOOK_FAIL_OPEN = True
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 2, "mode": "warn"}])
    answer = _answer(client, _body(count), path)
    assert answer["allowed"] is False
    assert answer["status"]["reason"] == "Invalid"
    assert answer["status"]["message"] == (
        f"cannot read the claim: spec.devices.requests[0].exactly.count: {problem}"
    )
    assert not Reservation.objects.exists()


def test_the_largest_count_allowed_is_reserved_on_a_warn_rule(client: Client) -> None:
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 2, "mode": "warn"}])
    answer = _answer(client, _body("65536"))
    assert answer["allowed"] is True
    assert QuotaRule.objects.get().in_use == 65536


def _with(request_fields: dict[str, Any], claim_fields: dict[str, Any]) -> dict[str, Any]:
    body = review(claim("c", [gpu_request(1)]), uid="u")
    body["request"].update(request_fields)
    for key, value in claim_fields.items():
        target = body["request"]["object"]
        *parents, last = key.split(".")
        for parent in parents:
            target = target[parent]
        if value is _DELETE:
            del target[last]
        else:
            target[last] = value
    return body


_DELETE = object()


@WEBHOOKS
@pytest.mark.parametrize(
    ("request_fields", "claim_fields", "message"),
    [
        ({}, {"spec": _DELETE}, "cannot read the claim: spec: is required"),
        ({}, {"spec": "x"}, "cannot read the claim: spec: is required"),
        (
            {},
            {"spec.devices.requests": {"name": "gpu"}},
            "cannot read the claim: spec.devices.requests: must be a list, not a mapping",
        ),
        (
            {},
            {"spec.devices.requests": [{"name": 5, "exactly": {"deviceClassName": "x"}}]},
            "cannot read the claim: spec.devices.requests[0].name: must be a string, not int",
        ),
        ({}, {"metadata.name": 5}, "request.object.metadata.name: must be a string"),
        ({}, {"metadata.name": "n" * 254}, "request.object.metadata.name: must be at most 253"),
        ({}, {"metadata.namespace": ["a"]}, "request.object.metadata.namespace: must be a string"),
        (
            {"namespace": "n" * 64},
            {"metadata.namespace": _DELETE},
            "request.object.metadata.namespace: must be at most 63",
        ),
        ({}, {"metadata": "x"}, "request.object.metadata: must be a mapping"),
        ({"userInfo": {"username": 5}}, {}, "request.userInfo.username: must be a string"),
        ({"userInfo": "alice"}, {}, "request.userInfo: must be a mapping"),
        ({"dryRun": "false"}, {}, "request.dryRun: must be a boolean"),
    ],
)
def test_a_malformed_claim_is_denied_naming_the_field(
    client: Client,
    settings: Any,
    path: str,
    request_fields: dict[str, Any],
    claim_fields: dict[str, Any],
    message: str,
) -> None:
    settings.TALLY_WEBHOOK_FAIL_OPEN = True
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 2, "mode": "warn"}])
    answer = _answer(client, _with(request_fields, claim_fields), path)
    assert answer["uid"] == "u"
    assert answer["allowed"] is False
    assert answer["status"]["reason"] == "Invalid"
    assert answer["status"]["message"].startswith(message), answer
    assert not Reservation.objects.exists()
