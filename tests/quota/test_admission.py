"""The validating and mutating webhooks, end to end through Django's test client."""

from __future__ import annotations

import base64
import copy
import json
from decimal import Decimal
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
from django.conf import settings
from django.test import Client
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from inventory import services as inventory_services
from inventory.dumps import iter_objects
from quota.admission.shapes import forget_fleet_shapes
from quota.admission.views import REMOVED_ANNOTATION, BadReview, parse_review
from quota.management.commands.review_claims import CLAIM_KINDS, OBJECT_FILES
from quota.models import AdmissionDecision, QuotaRule, Reservation, ReservationLine
from tests.fixtures import CLAIMS, DRA
from tests.quota.fixtures import (
    AT,
    admit,
    claim,
    decide,
    fleet_objects,
    gpu_request,
    load_yaml_objects,
    make_team,
    nvidia_gpu,
    nvidia_slice,
    post,
    review,
)

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fleet")]

H100_EXPRESSION = "device.attributes['gpu.nvidia.com'].productName == 'NVIDIA H100 80GB HBM3'"
A100_EXPRESSION = "device.attributes['gpu.nvidia.com'].productName.contains('A100')"
RULES = [
    {"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 2},
    {
        "name": "h100",
        "device_class": "gpu.nvidia.com",
        "selector": 'device.attributes["gpu.nvidia.com"].productName.startsWith("NVIDIA H100")',
        "limit": 1,
    },
    {"name": "mig", "device_class": "mig.nvidia.com", "limit": 1},
    {"name": "example", "device_class": "gpu.example.com", "limit": 1},
    {"name": "vfio", "device_class": "vfio.gpu.nvidia.com", "limit": 1},
]

# Every ResourceClaim and ResourceClaimTemplate of the project's fixtures (file under
# tests/fixtures/dra/claims, name) with the decision for a team whose rules are RULES and which
# holds nothing yet: a denial (part of its message), or what admitting it reserves on each rule.
FIXTURE_CLAIMS: dict[tuple[str, str], str | dict[str, str]] = {
    ("one-gpu.yaml", "single-gpu"): {"all-gpus": "1", "h100": "1"},  # could get an H100
    ("one-gpu.yaml", "one-gpu-per-pod"): {"all-gpus": "1", "h100": "1"},
    ("allocated.yaml", "trainer-0-gpu-4xk9w"): {"all-gpus": "1", "h100": "1"},
    ("a100-time-sliced.yaml", "a100-time-sliced"): {"all-gpus": "1"},  # never an H100
    ("first-available-v1beta1.yaml", "h100-else-a100"): {"all-gpus": "1", "h100": "1"},
    # 8Gi of an 80Gi H100 counts 0.1; an A100 cannot be shared, so all-gpus counts it whole.
    ("memory-share.yaml", "gpu-8gi"): {"all-gpus": "1", "h100": "0.1"},
    ("mig.yaml", "mig-pair"): {"mig": "0.428571"},  # 1/7 + 2/7 of an A100
    ("mig.yaml", "mig-pair-v1beta1"): {"mig": "0.428571"},
    ("mig.yaml", "mig-at-least-28-sms"): {"mig": "0.428571"},  # a 2g or a 3g: the most, 3/7
    ("example-driver.yaml", "two-selectors"): {"example": "1"},
    ("example-driver.yaml", "admin-all-gpus"): {},  # admin access holds nothing
    ("example-driver.yaml", "fallback-gpu"): {"example": "1"},
    ("example-driver.yaml", "preferred-gpu"): {"example": "1"},
    ("whole-node.yaml", "all-h100-on-a-node"): (  # the H100 node has 4
        'quota rule "all-gpus" (enforce) would be exceeded: '
        "0 GPUs in use, 4 GPUs requested, limit 2 GPUs"
    ),
    # No vfio device in the fleet yet: two whole GPUs on every rule of the NVIDIA driver (they
    # could be H100s bound to vfio), so the H100 rule, the first, denies (issue 36, finding 3).
    ("vfio-pair.yaml", "vm-two-gpus"): (
        'quota rule "h100" (enforce) would be exceeded: '
        "0 GPUs in use, 2 GPUs requested, limit 1 GPU (request"
    ),
    ("malformed-selector.yaml", "misindented-selector"): (
        "cannot read the claim: spec.devices.requests[0].exactly.selectors[0].cel: is missing"
    ),
}


def claim_to_admit(path: Path, name: str) -> dict[str, Any]:
    """The ResourceClaim `name` in `path`; for a template, the claim the resource-claim
    controller makes from it for a Pod."""
    for obj in load_yaml_objects(path):
        if obj["metadata"]["name"] != name:
            continue
        if obj["kind"] == "ResourceClaimTemplate":
            return {
                "apiVersion": obj["apiVersion"],
                "kind": "ResourceClaim",
                "metadata": {
                    "name": f"pod-{name}",
                    "namespace": obj["metadata"].get("namespace", "default"),
                    "ownerReferences": [
                        {
                            "apiVersion": "v1",
                            "kind": "Pod",
                            "name": "pod",
                            "uid": "u",
                            "controller": True,
                        }
                    ],
                },
                "spec": obj["spec"]["spec"],
            }
        return obj
    raise AssertionError(f"{name} not in {path}")


@pytest.mark.parametrize(("file", "name"), sorted(FIXTURE_CLAIMS))
def test_fixture_claims(client: Client, file: str, name: str) -> None:
    make_team(RULES)
    expected = FIXTURE_CLAIMS[(file, name)]
    body = review(claim_to_admit(CLAIMS / file, name), uid="uid-1")
    response = post(client, body)
    assert response.status_code == 200
    answer = response.json()
    assert answer["apiVersion"] == "admission.k8s.io/v1" and answer["kind"] == "AdmissionReview"
    decision = answer["response"]
    assert decision["uid"] == "uid-1"
    assert decision["allowed"] is not isinstance(expected, str), decision
    if isinstance(expected, str):
        assert expected in decision["status"]["message"]
        assert decision["status"]["code"] == 403
        expected = {}
    reserved = {rule.name: rule.in_use for rule in QuotaRule.objects.exclude(in_use=0)}
    assert reserved == {rule: Decimal(amount) for rule, amount in expected.items()}


def test_every_fixture_claim_is_in_the_list() -> None:
    """FIXTURE_CLAIMS cannot go stale: a claim or template added to the fixtures (or renamed)
    fails here until it is listed with its expected decision."""
    found = {
        (path.relative_to(CLAIMS).as_posix(), obj["metadata"]["name"])
        for path in sorted(CLAIMS.rglob("*"))
        if path.suffix in OBJECT_FILES and path.is_file()
        for obj in iter_objects(path)
        if obj.get("kind") in CLAIM_KINDS
    }
    assert sorted(found - FIXTURE_CLAIMS.keys()) == [], "fixture claims missing from the list"
    assert sorted(FIXTURE_CLAIMS.keys() - found) == [], "listed claims no longer in the fixtures"


def test_denial_names_team_rule_usage_request_and_limit(client: Client) -> None:
    make_team(RULES)
    a100 = [{"cel": {"expression": A100_EXPRESSION}}]
    assert decide(client, claim("a", [gpu_request(1, selectors=a100)]))["allowed"]
    assert decide(client, claim("b", [gpu_request(1, selectors=a100)]))["allowed"]
    denied = decide(client, claim("c", [gpu_request(1, selectors=a100)]))
    assert denied["allowed"] is False
    assert denied["status"]["message"] == (
        'team "research": quota rule "all-gpus" (enforce) would be exceeded: '
        "2 GPUs in use, 1 GPU requested, limit 2 GPUs"
    )
    assert QuotaRule.objects.get(name="all-gpus").in_use == 2
    assert AdmissionDecision.objects.filter(allowed=False).count() == 1
    # The validating webhook's denial names its cluster (issue 35), as its admissions do.
    assert set(AdmissionDecision.objects.values_list("cluster", flat=True)) == {
        settings.TALLY_CLUSTER_NAME
    }


def test_a_denial_counts_what_the_whole_claim_asks_of_the_rule(client: Client) -> None:
    make_team(RULES[:1])
    assert decide(client, claim("one", [gpu_request(1)]))["allowed"]
    two_requests = [gpu_request(1), {**gpu_request(1), "name": "second"}]
    denied = decide(client, claim("two", two_requests))
    # Not "1 GPU requested": the claim's requests together take the rule past its limit.
    assert denied["status"]["message"] == (
        'team "research": quota rule "all-gpus" (enforce) would be exceeded: '
        "1 GPU in use, 2 GPUs requested, limit 2 GPUs"
    )


def test_selector_rule_limits_only_requests_that_can_get_matching_devices(client: Client) -> None:
    make_team([*RULES[:2]])
    h100 = {"cel": {"expression": H100_EXPRESSION}}
    a100 = {
        "cel": {"expression": "device.attributes['gpu.nvidia.com'].productName.contains('A100')"}
    }
    assert decide(client, claim("h1", [gpu_request(1, selectors=[h100])]))["allowed"]
    assert not decide(client, claim("h2", [gpu_request(1, selectors=[h100])]))["allowed"]
    # An A100 request is outside the h100 rule; only all-gpus (1 of 2 used) limits it.
    assert decide(client, claim("a1", [gpu_request(1, selectors=[a100])]))["allowed"]
    assert QuotaRule.objects.get(name="h100").in_use == 1
    assert QuotaRule.objects.get(name="all-gpus").in_use == 2


def test_a_request_no_inventory_device_matches_is_counted_whole_and_says_so(
    client: Client,
) -> None:
    make_team([*RULES[:2]])
    b200 = {"cel": {"expression": H100_EXPRESSION.replace("H100", "B200")}}
    answer = decide(client, claim("b", [gpu_request(1, selectors=[b200])]))
    assert answer["allowed"]
    assert answer["warnings"] == [
        'request "gpu": no device of class "gpu.nvidia.com" matches its selectors before '
        "allocation (a uuid or index is not weighed); until it is allocated, each device it "
        "asks for counts as the most one of its class could",
        'team "research": quota rule "h100" is at 1 GPU of 1 GPU with this claim',
    ]
    # The most it could take: a whole GPU on each rule, the H100 one included.
    assert QuotaRule.objects.get(name="h100").in_use == 1
    assert QuotaRule.objects.get(name="all-gpus").in_use == 1
    assert "no device" not in str(decide(client, claim("a", [gpu_request(1)])).get("warnings"))


def test_all_mode_counts_the_most_matching_devices_on_one_node(client: Client) -> None:
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 5}])
    all_request = {
        "name": "gpu",
        "exactly": {"deviceClassName": "gpu.nvidia.com", "allocationMode": "All"},
    }
    assert decide(client, claim("all", [all_request]))["allowed"]
    assert QuotaRule.objects.get().in_use == 4  # the H100 node has 4, the A100 node 2; not 32


def test_mig_devices_count_their_share(client: Client) -> None:
    make_team([{"name": "mig", "device_class": "mig.nvidia.com", "limit": 1}])
    three_g = {"cel": {"expression": "device.attributes['gpu.nvidia.com'].profile == '3g.20gb'"}}
    assert decide(client, claim("m1", [gpu_request(2, "mig.nvidia.com", selectors=[three_g])]))[
        "allowed"
    ]
    assert QuotaRule.objects.get().in_use == Decimal("0.857142")
    assert not decide(client, claim("m2", [gpu_request(1, "mig.nvidia.com", selectors=[three_g])]))[
        "allowed"
    ]


def test_memory_rules_and_consumable_shares(client: Client) -> None:
    make_team(
        [{"name": "mem", "device_class": "gpu.nvidia.com", "unit": "memory", "limit": 100 * 2**30}]
    )
    share = gpu_request(1, capacity={"requests": {"memory": "40Gi"}})
    h100 = {
        "cel": {"expression": "device.attributes['gpu.nvidia.com'].productName.contains('H100')"}
    }
    share["exactly"]["selectors"] = [h100]
    assert decide(client, claim("s1", [share]))["allowed"]
    assert decide(client, claim("s2", [share]))["allowed"]
    denied = decide(client, claim("s3", [share]))
    assert "80Gi in use, 40Gi requested, limit 100Gi" in denied["status"]["message"]


def test_warn_rules_admit_with_a_warning_and_near_limit_warns(client: Client) -> None:
    make_team(
        [
            {"name": "soft", "device_class": "gpu.nvidia.com", "limit": 1, "mode": "warn"},
            {"name": "example", "device_class": "gpu.example.com", "limit": 5},
        ]
    )
    over = decide(client, claim("w", [gpu_request(2)]))
    assert over["allowed"]
    assert any('quota rule "soft" (warn) would be exceeded' in w for w in over["warnings"])
    near = decide(client, claim("e", [gpu_request(4, "gpu.example.com")]))
    assert near["allowed"]
    assert any('"example" is at 4 GPUs of 5 GPUs' in w for w in near["warnings"])


def test_warnings_of_several_rules_come_in_the_rules_order(client: Client) -> None:
    """Ids 7 and 8: a set of them iterates 8 first (8 hashes to the set's slot 0)."""
    team = make_team([])
    for pk, name in ((8, "later"), (7, "earlier")):
        QuotaRule.objects.create(
            pk=pk, team=team, name=name, device_class="gpu.nvidia.com", limit=Decimal(2)
        )
    warnings = decide(client, claim("both", [gpu_request(2)]))["warnings"]
    assert [w.split('"')[3] for w in warnings] == ["earlier", "later"]
    assert AdmissionDecision.objects.get(name="both").warnings == warnings


def test_the_same_claim_admitted_twice_reserves_once(client: Client) -> None:
    make_team(RULES[:1])
    body = claim("again", [gpu_request(1)])
    assert decide(client, body, uid="first")["allowed"]
    assert decide(client, body, uid="retry")["allowed"]
    assert Reservation.objects.count() == 1
    assert QuotaRule.objects.get(name="all-gpus").in_use == 1


def test_dry_run_leaves_nothing_behind(client: Client) -> None:
    make_team(RULES[:1])
    assert decide(client, claim("dry", [gpu_request(2)]), dry_run=True)["allowed"]
    assert Reservation.objects.count() == ReservationLine.objects.count() == 0
    assert AdmissionDecision.objects.count() == 0
    assert QuotaRule.objects.get(name="all-gpus").in_use == 0


def test_unowned_namespace_is_allowed_with_a_warning_or_denied(
    client: Client, settings: Any
) -> None:
    answer = decide(client, claim("x", [gpu_request(1)], namespace="nobody"))
    assert answer["allowed"] and "not owned by any team" in answer["warnings"][0]
    settings.TALLY_UNOWNED_NAMESPACES = "deny"
    answer = decide(client, claim("x", [gpu_request(1)], namespace="nobody"))
    assert not answer["allowed"]
    assert answer["status"]["message"] == "namespace 'nobody' is not owned by any team"


def test_template_claims_are_attributed_to_the_pods_controller(client: Client) -> None:
    make_team(RULES[:1])
    body = claim("pod-gpu", [gpu_request(1)])
    body["metadata"]["ownerReferences"] = [
        {"apiVersion": "v1", "kind": "Pod", "name": "train-0", "uid": "p", "controller": True}
    ]
    controller = "system:serviceaccount:kube-system:resource-claim-controller"
    assert decide(client, body, username=controller)["allowed"]
    assert decide(client, claim("mine", [gpu_request(1)]), username="alice")["allowed"]
    from_template = Reservation.objects.get(name="pod-gpu")
    assert (from_template.username, from_template.owner_kind, from_template.owner_name) == (
        "",
        "Pod",
        "train-0",
    )
    assert Reservation.objects.get(name="mine").username == "alice"


def first_available(*names_and_selectors: tuple[str, str, str]) -> dict[str, Any]:
    return {
        "name": "gpu",
        "firstAvailable": [
            {
                "name": name,
                "deviceClassName": device_class,
                "selectors": [{"cel": {"expression": expression}}],
            }
            for name, device_class, expression in names_and_selectors
        ],
    }


H100_OR_A100 = (
    ("h100", "gpu.nvidia.com", "device.attributes['gpu.nvidia.com'].productName.contains('H100')"),
    ("a100", "gpu.nvidia.com", "device.attributes['gpu.nvidia.com'].productName.contains('A100')"),
)


def test_first_available_falls_back_when_the_preferred_model_is_over_quota(client: Client) -> None:
    make_team(
        [
            *RULES[:2],
            {
                "name": "a100",
                "device_class": "gpu.nvidia.com",
                "limit": 1,
                "selector": "device.attributes['gpu.nvidia.com'].productName.contains('A100')",
            },
        ]
    )
    QuotaRule.objects.filter(name="h100").update(in_use=1)  # the team's H100 is taken
    body = claim("fallback", [first_available(*H100_OR_A100)])
    response = post(client, review(body), "/admission/resourceclaims/mutate")
    mutation = response.json()["response"]
    assert mutation["allowed"] and mutation["patchType"] == "JSONPatch"
    patch = json.loads(base64.b64decode(mutation["patch"]))
    assert patch[0] == {"op": "remove", "path": "/spec/devices/requests/0/firstAvailable/0"}
    assert patch[1]["path"] == "/metadata/annotations"
    assert json.loads(patch[1]["value"]["tally.dev/removed-alternatives"]) == {"gpu": ["h100"]}
    assert Reservation.objects.count() == 0  # mutation only reads
    # The validating webhook admits the claim as patched, and reserves on the A100 rule.
    assert decide(client, jsonpatch.apply_patch(body, patch))["allowed"]
    assert QuotaRule.objects.get(name="a100").in_use == 1
    assert QuotaRule.objects.get(name="h100").in_use == 1
    assert Reservation.objects.get().chosen == {"gpu": ["a100"]}


def test_a_create_sent_again_gets_the_same_mutation_however_full_the_team_is(
    client: Client,
) -> None:
    """The API server calls the mutating webhook before the validating one, for a retried
    create too: the claim's own reservation must not count against it there either."""
    make_team(
        [
            {"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 1},
            {"name": "h100", "device_class": "gpu.nvidia.com", "limit": 0,
             "selector": H100_OR_A100[0][2]},
        ]
    )  # fmt: skip
    body = claim("retried", [first_available(*H100_OR_A100)])
    answers = []
    for uid in ("first", "retry"):
        answers.append(post(client, review(body, uid=uid), "/admission/resourceclaims/mutate"))
        assert admit(client, body, uid=uid)["allowed"]
    first, retry = (answer.json()["response"] for answer in answers)
    assert first["allowed"] and retry["allowed"], retry
    assert retry["patch"] == first["patch"]  # the H100 alternative removed both times
    assert Reservation.objects.get().chosen == {"gpu": ["a100"]}
    assert QuotaRule.objects.get(name="all-gpus").in_use == 1


def test_first_available_is_denied_when_no_alternative_fits(client: Client) -> None:
    make_team(RULES[:2])
    QuotaRule.objects.filter(name="all-gpus").update(in_use=2)
    body = claim("none", [first_available(*H100_OR_A100)])
    for path in ("/admission/resourceclaims/mutate", "/admission/resourceclaims"):
        answer = post(client, review(body), path).json()["response"]
        assert not answer["allowed"]
        assert "none of the 2 alternatives of request 'gpu' fits" in answer["status"]["message"]


def test_malformed_bodies_get_400_with_the_reason(client: Client) -> None:
    cases = {
        b"{not json": "the body is not valid JSON",
        b"[]": "body must be a JSON object",
        json.dumps({"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1"}).encode(): (
            "request is missing"
        ),
        json.dumps({"kind": "Pod", "apiVersion": "v1"}).encode(): "kind must be AdmissionReview",
        json.dumps(
            {"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1", "request": {"uid": 5}}
        ).encode(): "request.uid is missing or not a string",
    }
    for body, reason in cases.items():
        response = post(client, body)
        assert response.status_code == 400
        assert reason in response.content.decode()


def test_a_review_of_something_unreadable_is_denied_with_the_reason(client: Client) -> None:
    make_team(RULES)
    not_a_claim = review(None, uid="u")
    answer = post(client, not_a_claim).json()["response"]
    assert answer == {
        "uid": "u",
        "allowed": False,
        "status": {
            "code": 403,
            "reason": "Invalid",
            "message": "request.object is not a ResourceClaim",
        },
    }
    bad_requests = claim("bad", [{"name": "gpu", "exactly": {"count": 1}}])
    answer = decide(client, bad_requests)
    assert answer["status"]["message"] == (
        "cannot read the claim: spec.devices.requests[0].deviceClassName: is required"
    )


def test_other_operations_pass(client: Client) -> None:
    make_team(RULES)
    answer = decide(client, claim("c", [gpu_request(5)]), operation="UPDATE")
    assert answer == {"uid": answer["uid"], "allowed": True}
    assert client.get("/admission/resourceclaims").status_code == 405


def test_the_api_servers_admission_review_is_answered(client: Client) -> None:
    """A review with every field the API server sends (options, requestKind, a user's groups)."""
    make_team(RULES)
    fixture = json.loads((DRA / "admission-review.json").read_text())
    response = post(client, fixture)
    assert response.status_code == 200
    decision = response.json()["response"]
    assert decision["uid"] == fixture["request"]["uid"]
    assert decision["allowed"] is True
    reservation = Reservation.objects.get()
    assert (reservation.namespace, reservation.name) == ("research", "a100-notebook")
    assert reservation.username == "alice@example.com"
    assert QuotaRule.objects.get(name="all-gpus").in_use == 1  # an A100: not the h100 rule
    assert QuotaRule.objects.get(name="h100").in_use == 0


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12,
)
REQUEST_FIELDS = st.dictionaries(
    st.sampled_from(
        ["uid", "operation", "resource", "object", "namespace", "name", "dryRun", "userInfo"]
    ),
    JSON_VALUES,
)
RANDOM_CLAIMS = st.fixed_dictionaries(
    {
        "apiVersion": st.sampled_from(["resource.k8s.io/v1", "resource.k8s.io/v1beta1", "x"]),
        "kind": st.just("ResourceClaim"),
        "metadata": st.fixed_dictionaries(
            {"name": st.text(max_size=5), "namespace": st.just("research")}
        ),
        "spec": st.fixed_dictionaries(
            {"devices": st.fixed_dictionaries({"requests": st.lists(JSON_VALUES, max_size=2)})}
        ),
    }
)
# firstAvailable claims whose alternatives the fleet has, some over the team's quota (the
# mutating webhook removes those), with the metadata shapes a patch has to cope with.
ALTERNATIVES = st.sampled_from(
    [
        *H100_OR_A100,
        ("example", "gpu.example.com", "device.driver == 'gpu.example.com'"),
        ("mig", "mig.nvidia.com", "device.attributes['gpu.nvidia.com'].profile == '1g.5gb'"),
    ]
)
FIRST_AVAILABLE_REQUESTS = st.builds(
    lambda name, alternatives: {**first_available(*alternatives), "name": name},
    st.sampled_from(["gpu", "gpu", "second"]),
    st.lists(ALTERNATIVES, min_size=1, max_size=3),
)
METADATA: st.SearchStrategy[dict[str, Any]] = st.fixed_dictionaries(
    {"namespace": st.just("research")},
    optional={
        "name": st.text(max_size=5),
        "annotations": st.none()
        | st.dictionaries(
            st.sampled_from(["a", "tally.dev/removed-alternatives", "x~y/z"]),
            st.text(max_size=3),
            max_size=2,
        ),
    },
)
FIRST_AVAILABLE_CLAIMS: st.SearchStrategy[dict[str, Any]] = st.fixed_dictionaries(
    {
        "apiVersion": st.sampled_from(["resource.k8s.io/v1", "resource.k8s.io/v1beta1"]),
        "kind": st.just("ResourceClaim"),
        "spec": st.builds(
            lambda requests: {"devices": {"requests": requests}},
            st.lists(FIRST_AVAILABLE_REQUESTS, min_size=1, max_size=2),
        ),
    },
    optional={"metadata": METADATA},
)


def review_bodies(claims: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Any JSON, AdmissionReviews of random requests, and reviews of `claims`."""
    return st.one_of(
        JSON_VALUES,
        st.builds(
            lambda request: {
                "apiVersion": "admission.k8s.io/v1",
                "kind": "AdmissionReview",
                "request": request,
            },
            REQUEST_FIELDS,
        ),
        st.builds(lambda obj, uid: review(obj, uid=uid), claims, st.text(min_size=1, max_size=10)),
    )


def well_formed_answer(client: Client, body: Any, path: str) -> dict[str, Any] | None:
    """The review's answer (None for a 400, which only a body that is no review gets)."""
    response = post(client, json.dumps(body), path)
    is_review = True
    try:
        parse_review(json.dumps(body).encode())
    except BadReview:
        is_review = False
    assert response.status_code == (200 if is_review else 400), response.content
    if response.status_code == 400:
        return None
    answer = response.json()
    assert answer["apiVersion"] == "admission.k8s.io/v1" and answer["kind"] == "AdmissionReview"
    decision: dict[str, Any] = answer["response"]
    assert decision["uid"] == body["request"]["uid"]
    assert isinstance(decision["allowed"], bool)
    # A crash caught by the view's last resort would hide a bug: none may happen.
    assert decision.get("status", {}).get("reason") != "InternalError", decision
    return decision


def test_admission_reviews_of_any_shape_get_a_well_formed_answer(client: Client) -> None:
    """Property: random bodies never get a 500; a 200 always echoes the uid."""
    make_team(RULES[:1])

    @hypothesis_settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=review_bodies(RANDOM_CLAIMS))
    def check(body: Any) -> None:
        well_formed_answer(client, body, "/admission/resourceclaims")

    check()


def test_mutations_of_any_shape_are_well_formed_and_their_patches_apply(client: Client) -> None:
    """Property: the mutating webhook always answers a review, echoing its uid, and a patch
    is base64 of a JSON Patch that applies to the object it was asked about."""
    make_team(RULES[:2])
    QuotaRule.objects.filter(name="h100").update(in_use=1)  # the team's H100 is taken

    @hypothesis_settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=review_bodies(st.one_of(RANDOM_CLAIMS, FIRST_AVAILABLE_CLAIMS)))
    def check(body: Any) -> None:
        original = copy.deepcopy(body)
        decision = well_formed_answer(client, body, "/admission/resourceclaims/mutate")
        if decision is None or "patch" not in decision:
            assert decision is None or "patchType" not in decision
            return
        assert decision["allowed"] is True
        assert decision["patchType"] == "JSONPatch"
        patch = json.loads(base64.b64decode(decision["patch"], validate=True))
        mutated = jsonpatch.apply_patch(original["request"]["object"], patch)
        removed = json.loads(mutated["metadata"]["annotations"][REMOVED_ANNOTATION])
        assert removed and all(removed.values()), removed
        for request in mutated["spec"]["devices"]["requests"]:
            kept = {alternative["name"] for alternative in request["firstAvailable"]}
            assert kept and not kept & set(removed.get(request["name"], [])), (request, removed)

    check()
    assert not Reservation.objects.exists()  # the mutating webhook only reads


def test_decisions_are_counted_by_result_and_rule(client: Client) -> None:
    from prometheus_client import REGISTRY

    def count(result: str, rule: str) -> float:
        labels = {"webhook": "validate", "result": result, "rule": rule}
        return REGISTRY.get_sample_value("tally_webhook_decisions_total", labels) or 0.0

    make_team(RULES)
    denied_before, allowed_before = count("denied", "h100"), count("allowed", "")
    vfio = gpu_request(2, "vfio.gpu.nvidia.com")
    assert not decide(client, claim("v", [vfio]))["allowed"]
    assert decide(client, claim("a", [gpu_request(1, "gpu.example.com")]))["allowed"]
    assert count("denied", "h100") == denied_before + 1  # two vfio GPUs could be H100s
    assert count("allowed", "") == allowed_before + 1


def test_another_claim_under_a_live_reservations_name_is_weighed_as_new(
    client: Client,
) -> None:
    """Issue 33, finding 5: the same name asking 12 GPUs, 6 in use, limit 16, was taken for a
    retry of the first claim and allowed, uncounted."""
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 16}])
    assert decide(client, claim("train", [gpu_request(6)]), uid="first")["allowed"]
    bigger = claim("train", [gpu_request(12)])
    for path in ("/admission/resourceclaims/mutate", "/admission/resourceclaims"):
        answer = post(client, review(bigger, uid="second"), path).json()["response"]
        assert not answer["allowed"], path
        assert "6 GPUs in use, 12 GPUs requested, limit 16 GPUs" in answer["status"]["message"]
    assert QuotaRule.objects.get(name="all-gpus").in_use == 6
    assert Reservation.objects.get().lines.get().amount == 6


def test_another_claim_that_fits_replaces_the_reservation_under_its_name(
    client: Client,
) -> None:
    """A claim deleted and made again differently before the sync saw it go: the new one is
    weighed with the old one counted, and, fitting, takes the name's reservation."""
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 16}])
    assert decide(client, claim("train", [gpu_request(6)]), uid="first")["allowed"]
    answer = decide(client, claim("train", [gpu_request(8)]), uid="second")
    assert answer["allowed"]
    assert "replaced by this one's" in " ".join(answer["warnings"])
    assert QuotaRule.objects.get(name="all-gpus").in_use == 8
    live = Reservation.objects.exclude(state="released").get()
    assert live.lines.get().amount == 8 and live.admission_uid == "second"
    assert Reservation.objects.filter(state="released").count() == 1


def test_the_same_claim_by_uid_is_a_retry_whatever_its_spec_says(client: Client) -> None:
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 16}])
    first = claim("train", [gpu_request(6)])
    assert decide(client, first, uid="first")["allowed"]
    Reservation.objects.update(claim_uid="claim-uid-1")  # the sync saw the claim
    again = claim("train", [gpu_request(12)])
    again["metadata"]["uid"] = "claim-uid-1"
    assert decide(client, again, uid="again")["allowed"]
    assert QuotaRule.objects.get(name="all-gpus").in_use == 6
    assert Reservation.objects.count() == 1


def test_a_retry_is_known_by_the_spec_as_stored_after_the_mutation(client: Client) -> None:
    """The validating webhook sees (and stores the digest of) the spec the mutating webhook's
    patch left; the mutating webhook sees the retry as sent, alternatives and all: it is the
    same claim once the alternatives not chosen are out, and keeps the same mutation."""
    make_team(
        [
            {"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 1},
            {"name": "h100", "device_class": "gpu.nvidia.com", "limit": 0,
             "selector": H100_OR_A100[0][2]},
        ]
    )  # fmt: skip
    body = claim("retried", [first_available(*H100_OR_A100)])
    mutate = "/admission/resourceclaims/mutate"
    first = post(client, review(body, uid="first"), mutate).json()["response"]
    patch = json.loads(base64.b64decode(first["patch"]))
    stored = jsonpatch.apply_patch(body, patch)
    assert decide(client, stored, uid="first")["allowed"]
    retry = post(client, review(body, uid="retry"), mutate).json()["response"]
    assert retry["allowed"] and retry["patch"] == first["patch"]
    assert decide(client, stored, uid="retry")["allowed"]
    assert QuotaRule.objects.get(name="all-gpus").in_use == 1
    assert Reservation.objects.count() == 1


def test_another_claim_under_the_name_of_a_claim_the_sync_saw_leaves_its_hold(
    client: Client,
) -> None:
    """A create that names a claim the inventory has seen (it exists, and this create will
    fail; or it was deleted meanwhile) is weighed beside it, and replaces nothing: only the
    sync can tell which claim has the name."""
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 16}])
    assert decide(client, claim("train", [gpu_request(6)]), uid="first")["allowed"]
    Reservation.objects.update(claim_uid="claim-uid-1")  # the sync saw the claim
    other = claim("train", [gpu_request(12)])
    other["metadata"]["uid"] = "claim-uid-2"
    denied = decide(client, other, uid="second")
    assert not denied["allowed"]
    assert "6 GPUs in use, 12 GPUs requested" in denied["status"]["message"]
    smaller = claim("train", [gpu_request(1)])
    smaller["metadata"]["uid"] = "claim-uid-3"
    answer = decide(client, smaller, uid="third")
    assert answer["allowed"] and "counted once the inventory sees" in answer["warnings"][-1]
    live = Reservation.objects.get()
    assert (live.claim_uid, live.lines.get().amount) == ("claim-uid-1", 6)
    assert QuotaRule.objects.get(name="all-gpus").in_use == 6


def test_a_reservation_with_no_spec_kept_still_tells_another_uid_apart(client: Client) -> None:
    """An adopted reservation (or one from before specs were kept) has no digest: a create
    of another uid than the claim the sync saw under its name is still no retry."""
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 16}])
    assert decide(client, claim("train", [gpu_request(6)]), uid="first")["allowed"]
    Reservation.objects.update(claim_uid="claim-uid-1", spec_digest="")
    other = claim("train", [gpu_request(12)])
    other["metadata"]["uid"] = "claim-uid-2"
    assert not decide(client, other, uid="second")["allowed"]
    again = claim("train", [gpu_request(12)])
    again["metadata"]["uid"] = "claim-uid-1"
    assert decide(client, again, uid="again")["allowed"]  # the claim the sync saw: a retry
    assert QuotaRule.objects.get(name="all-gpus").in_use == 6


def _with(*objects: dict[str, Any]) -> None:
    """The fleet with more `objects` imported."""
    forget_fleet_shapes()
    report = inventory_services.import_snapshot(
        cluster=inventory_services.get_cluster("default"),
        objects=[*fleet_objects(), *objects],
        at=AT,
    )
    assert report.errors == []


def _with_classes(*classes: tuple[str, str]) -> None:
    """The fleet with DeviceClasses (name, selector) that match none of its devices."""
    _with(
        *(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "DeviceClass",
                "metadata": {"name": name},
                "spec": {"selectors": [{"cel": {"expression": expression}}]},
            }
            for name, expression in classes
        )
    )


MIG_7G = (
    "mig-7g.80gb.nvidia.com",  # a profile not configured on any GPU yet
    "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].profile == '7g.80gb'",
)
NO_DRIVER = ("passthrough.example.com", "device.attributes['gpu.nvidia.com'].type == 'vfio'")


def test_a_class_that_matches_no_device_counts_on_its_drivers_rules(client: Client) -> None:
    """Issue 36, finding 3: a claim through a class no device matches today (a MIG profile not
    configured yet) counted 0, with no warning, and could be allocated uncounted once such
    devices appear."""
    _with_classes(MIG_7G)
    make_team([{"name": "mig", "device_class": "mig.nvidia.com", "limit": 1}])
    answer = decide(client, claim("seven", [gpu_request(1, MIG_7G[0])]))
    assert answer["allowed"]
    assert 'no device of class "mig-7g.80gb.nvidia.com" in the inventory matches it' in " ".join(
        answer["warnings"]
    )
    assert QuotaRule.objects.get(name="mig").in_use == 1
    denied = decide(client, claim("another", [gpu_request(1, MIG_7G[0])]))
    assert denied["status"]["message"] == (
        'team "research": quota rule "mig" (enforce) would be exceeded: 1 GPU in use, 1 GPU '
        'requested, limit 1 GPU (request "gpu": no device of class "mig-7g.80gb.nvidia.com" in '
        "the inventory matches it; until allocated, each device it asks for counts as a whole "
        "GPU (no memory) on every quota rule of its class and of its driver gpu.nvidia.com)"
    )


@pytest.mark.parametrize("mode", ["enforce", "warn"])
def test_a_class_that_matches_no_device_and_names_no_driver_is_refused(
    client: Client, mode: str
) -> None:
    """Nothing says which rules such a class's devices will fall under: denied, naming the
    class, where an enforce rule binds the team; admitted with a warning where none does."""
    _with_classes(NO_DRIVER)
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 8, "mode": mode}])
    answer = decide(client, claim("vm", [gpu_request(1, NO_DRIVER[0])]))
    problem = (
        'request "gpu": no device in the inventory matches class "passthrough.example.com", and '
        "its selectors name no driver, so Tally cannot tell which quota rules it would count on"
    )
    if mode == "enforce":
        assert answer["status"]["message"] == (
            problem + "; it could be given devices an enforce quota rule limits, uncounted"
        )
        assert not Reservation.objects.exists()
    else:
        assert answer["allowed"]
        assert problem + " (warn only); it counts on none" in answer["warnings"]


def test_a_denial_by_a_model_rule_says_the_claim_could_be_given_that_model(client: Client) -> None:
    """Issue 36, finding 4: any two NVIDIA GPUs were denied by a one-T4 rule while eight H100s
    were free, and the message did not say why the T4 rule applied."""
    h100 = [nvidia_gpu(i, "h100-b", "NVIDIA H100 80GB HBM3", "80Gi") for i in range(8)]
    t4s = [nvidia_gpu(i, "t4-a", "Tesla T4", "16Gi") for i in range(4)]
    _with(nvidia_slice("h100-b", h100), nvidia_slice("t4-a", t4s))
    t4 = "device.attributes['gpu.nvidia.com'].productName == 'Tesla T4'"
    make_team(
        [
            {"name": "t4", "device_class": "gpu.nvidia.com", "selector": t4, "limit": 1},
            {"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 16},
        ]
    )
    denied = decide(client, claim("any-two", [gpu_request(2)]))
    assert denied["status"]["message"] == (
        'team "research": quota rule "t4" (enforce) would be exceeded: 0 GPUs in use, 2 GPUs '
        "requested, limit 1 GPU; the rule binds Tesla T4, which request 'gpu' could be given (a "
        "selector that leaves it out of the request leaves the rule out too)"
    )
    # Asking for T4s alone, the rule is plainly the claim's own: nothing more to say.
    only_t4 = decide(
        client, claim("two-t4", [gpu_request(2, selectors=[{"cel": {"expression": t4}}])])
    )
    assert only_t4["status"]["message"].endswith("limit 1 GPU")
    not_t4 = f"!({t4})"
    h100s = gpu_request(2, selectors=[{"cel": {"expression": not_t4}}])
    assert decide(client, claim("two-h100", [h100s]))["allowed"]


def test_a_class_that_matches_no_device_counts_on_rules_of_any_driver(client: Client) -> None:
    """A rule whose class names no driver (every accelerator) may cover the devices such a
    class will match, even of a driver with no device in the inventory yet: it counts there."""
    _with_classes(("new-accel", "device.driver == 'accel.example.com'"), ("any", "true"))
    make_team([{"name": "anything", "device_class": "any", "limit": 1}])
    denied = decide(client, claim("two", [gpu_request(2, "new-accel")]))
    assert denied["status"]["message"].startswith(
        'team "research": quota rule "anything" (enforce) would be exceeded: 0 GPUs in use, '
        "2 GPUs requested, limit 1 GPU"
    )
