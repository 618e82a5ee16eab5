"""Issue 36: a team's claims that could land on several models narrowed, at admission, to the
models whose quota rules have room (`narrowToFit`): "any two NVIDIA GPUs" takes the free
H100s rather than being denied by a full T4 rule (Kueue's flavour choice, made by the mutating
webhook). AdmissionReviews POSTed to both webhooks through Django's test client."""

from __future__ import annotations

import base64
import json
from decimal import Decimal
from typing import Any

import jsonpatch
import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse

from inventory import dra
from inventory import services as inventory_services
from inventory.dumps import iter_objects
from inventory.services import get_cluster
from quota import cel
from quota.admission import service, shapes, store
from quota.admission.plans import NARROWED_ANNOTATION
from quota.admission.shapes import forget_fleet_shapes
from quota.models import AdmissionDecision, NarrowingPolicy, QuotaRule, Reservation, Webhook
from quota.policy import PolicyError, apply_policy, load_policy
from teams.models import AuditEntry, Team
from tests.fixtures import DRA
from tests.quota.fixtures import (
    AT,
    claim,
    decide,
    fleet_objects,
    gpu_request,
    make_team,
    nvidia_gpu,
    nvidia_slice,
    post,
    review,
)

pytestmark = pytest.mark.django_db

MUTATE = "/admission/resourceclaims/mutate"
T4 = "device.attributes['gpu.nvidia.com'].productName == 'Tesla T4'"
A100 = "device.attributes['gpu.nvidia.com'].productName.contains('A100')"
H100 = "device.attributes['gpu.nvidia.com'].productName.startsWith('NVIDIA H100')"
H100_ONLY = 'device.attributes["gpu.nvidia.com"].productName == "NVIDIA H100 80GB HBM3"'
# The fleet's A100 node and H100 node, with a node of four T4s and one of eight more H100s.
RULES = [
    {"name": "t4", "device_class": "gpu.nvidia.com", "selector": T4, "limit": 1},
    {"name": "a100", "device_class": "gpu.nvidia.com", "selector": A100, "limit": 0},
    {"name": "h100", "device_class": "gpu.nvidia.com", "selector": H100, "limit": 8},
    {"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 16},
]


@pytest.fixture(autouse=True)
def t4_and_h100_nodes(fleet: None) -> None:
    h100 = [nvidia_gpu(i, "h100-b", "NVIDIA H100 80GB HBM3", "80Gi") for i in range(8)]
    t4s = [nvidia_gpu(i, "t4-a", "Tesla T4", "16Gi") for i in range(4)]
    forget_fleet_shapes()
    report = inventory_services.import_snapshot(
        cluster=inventory_services.get_cluster("default"),
        objects=[*fleet_objects(), nvidia_slice("h100-b", h100), nvidia_slice("t4-a", t4s)],
        at=AT,
    )
    assert report.errors == []


def narrowing_team(rules: list[dict[str, Any]] = RULES, *, on: bool = True) -> Team:
    team = make_team(rules)
    NarrowingPolicy.objects.create(team=team, narrow_to_fit=on)
    return team


def mutation(client: Client, body: dict[str, Any]) -> dict[str, Any]:
    response = post(client, review(body), MUTATE)
    assert response.status_code == 200, response.content
    answer: dict[str, Any] = response.json()["response"]
    return answer


def patched(body: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    patch = json.loads(base64.b64decode(answer["patch"]))
    result: dict[str, Any] = jsonpatch.apply_patch(body, patch)
    return result


def test_any_two_gpus_are_narrowed_to_the_model_whose_rules_have_room(client: Client) -> None:
    narrowing_team()
    body = claim("any-two", [gpu_request(2)])
    answer = mutation(client, body)
    assert answer["allowed"] and answer["patchType"] == "JSONPatch"
    patch = json.loads(base64.b64decode(answer["patch"]))
    assert patch[0] == {
        "op": "add",
        "path": "/spec/devices/requests/0/exactly/selectors",
        "value": [{"cel": {"expression": H100_ONLY}}],
    }
    assert patch[1] == {
        "op": "add",
        "path": "/metadata/annotations",
        "value": {NARROWED_ANNOTATION: json.dumps({"gpu": ["NVIDIA H100 80GB HBM3"]})},
    }
    assert (
        "request 'gpu' narrowed to NVIDIA H100 80GB HBM3 (a selector added; the team narrows to "
        "fit): as sent it could be given devices that quota rules a100, t4 have no room for"
    ) in answer["warnings"]
    assert not Reservation.objects.exists()  # the mutating webhook only reads

    # The patched claim is a claim the API server reads: its request selects H100s alone.
    narrowed = patched(body, answer)
    (request,) = dra.parse_claim_requests(narrowed["spec"], narrowed["apiVersion"])
    assert request.selectors == [H100_ONLY]

    # The validating webhook weighs it as any claim with a selector: H100s, so the T4 and
    # A100 rules hold nothing, and records that it was narrowed.
    admitted = decide(client, narrowed)
    assert admitted["allowed"]
    in_use = dict(QuotaRule.objects.values_list("name", "in_use"))
    assert in_use == {"t4": 0, "a100": 0, "h100": 2, "all-gpus": 2}
    reservation = Reservation.objects.get()
    assert {line.rule.name: line.amount for line in reservation.lines.all()} == {
        "h100": Decimal(2),
        "all-gpus": Decimal(2),
    }
    recorded = AdmissionDecision.objects.get(webhook=Webhook.VALIDATE)
    assert recorded.allowed
    assert (
        "the claim was narrowed to the models that fit "
        f'({NARROWED_ANNOTATION}: {{"gpu": ["NVIDIA H100 80GB HBM3"]}})'
    ) in recorded.warnings


def test_every_model_that_fits_is_kept(client: Client) -> None:
    """The A100 rule has room too: the selector keeps both models, the T4 left out."""
    rules = [{**rule, "limit": 4} if rule["name"] == "a100" else rule for rule in RULES]
    narrowing_team(rules)
    answer = mutation(client, claim("any-two", [gpu_request(2)]))
    patch = json.loads(base64.b64decode(answer["patch"]))
    expression = patch[0]["value"][0]["cel"]["expression"]
    assert expression == (
        'device.attributes["gpu.nvidia.com"].productName == "NVIDIA A100-SXM4-80GB" || ' + H100_ONLY
    )
    assert json.loads(patch[1]["value"][NARROWED_ANNOTATION]) == {
        "gpu": ["NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3"]
    }
    narrowed = patched(claim("any-two", [gpu_request(2)]), answer)
    assert decide(client, narrowed)["allowed"]
    in_use = dict(QuotaRule.objects.values_list("name", "in_use"))
    assert in_use["t4"] == 0 and in_use["all-gpus"] == 2


def test_without_the_option_the_claim_is_denied_as_before(client: Client) -> None:
    narrowing_team(on=False)
    body = claim("any-two", [gpu_request(2)])
    for answer in (mutation(client, body), decide(client, body)):
        assert not answer["allowed"]
        assert answer["status"]["message"].startswith(
            'team "research": quota rule "t4" (enforce) would be exceeded: 0 GPUs in use, '
            "2 GPUs requested, limit 1 GPU; the rule binds Tesla T4"
        )
    assert AdmissionDecision.objects.get(webhook=Webhook.MUTATE).allowed is False


def test_a_team_without_a_narrowing_policy_is_never_narrowed(client: Client) -> None:
    make_team(RULES)
    answer = mutation(client, claim("any-two", [gpu_request(2)]))
    assert not answer["allowed"] and "patch" not in answer


def test_nothing_fitting_on_any_model_is_denied_as_before(client: Client) -> None:
    rules = [{**rule, "limit": 1} if rule["name"] == "all-gpus" else rule for rule in RULES]
    narrowing_team(rules)
    answer = mutation(client, claim("any-two", [gpu_request(2)]))
    assert not answer["allowed"]
    assert answer["status"]["message"].startswith(
        'team "research": quota rule "t4" (enforce) would be exceeded: 0 GPUs in use, '
        "2 GPUs requested, limit 1 GPU; the rule binds Tesla T4"
    )
    assert not any("narrowed" in warning for warning in answer.get("warnings", []))


def test_a_claim_that_fits_is_left_as_sent(client: Client) -> None:
    narrowing_team([rule for rule in RULES if rule["name"] != "a100"])
    answer = mutation(client, claim("one", [gpu_request(1)]))
    assert answer["allowed"] and "patch" not in answer


def test_a_v1beta1_claim_gets_the_selector_beside_its_own(client: Client) -> None:
    """v1beta1 writes a request's selectors on the request itself; one the claim has stays,
    the added one after it (all must match)."""
    narrowing_team()
    not_mig = "device.attributes['gpu.nvidia.com'].type == 'gpu'"
    body = claim(
        "beta",
        [
            {
                "name": "gpu",
                "deviceClassName": "gpu.nvidia.com",
                "count": 2,
                "selectors": [{"cel": {"expression": not_mig}}],
            }
        ],
        api_version="resource.k8s.io/v1beta1",
    )
    body["metadata"]["annotations"] = {"team.example/owner": "alice"}
    answer = mutation(client, body)
    patch = json.loads(base64.b64decode(answer["patch"]))
    assert patch[0] == {
        "op": "add",
        "path": "/spec/devices/requests/0/selectors/-",
        "value": {"cel": {"expression": H100_ONLY}},
    }
    assert patch[1]["path"] == "/metadata/annotations/tally.dev~1narrowed-to"
    narrowed = patched(body, answer)
    (request,) = dra.parse_claim_requests(narrowed["spec"], narrowed["apiVersion"])
    assert request.selectors == [not_mig, H100_ONLY]
    assert narrowed["metadata"]["annotations"]["team.example/owner"] == "alice"
    assert decide(client, narrowed)["allowed"]
    assert QuotaRule.objects.get(name="t4").in_use == 0


TEAM = """\
teams:
- slug: vision
  name: Vision
  leads: [lead-vision]
"""


def test_the_policy_file_sets_the_option_audited_and_prune_removes_it() -> None:
    policy = load_policy(TEAM + "  narrowToFit: true\n")
    report = apply_policy(policy=policy, prune=False, actor="ops")
    assert NarrowingPolicy.objects.get(team__slug="vision").narrow_to_fit is True
    assert AuditEntry.objects.filter(object_type="narrowing policy", action="create").count() == 1
    assert report.changed
    assert not apply_policy(policy=policy, prune=False, actor="ops").changed
    apply_policy(policy=load_policy(TEAM + "  narrowToFit: false\n"), prune=False, actor="ops")
    assert NarrowingPolicy.objects.get(team__slug="vision").narrow_to_fit is False
    assert AuditEntry.objects.filter(object_type="narrowing policy", action="update").count() == 1
    apply_policy(policy=load_policy(TEAM), prune=False, actor="ops")
    assert NarrowingPolicy.objects.count() == 1  # kept without --prune
    apply_policy(policy=load_policy(TEAM), prune=True, actor="ops")
    assert not NarrowingPolicy.objects.exists()


def test_a_bad_option_is_an_error_naming_its_path() -> None:
    with pytest.raises(PolicyError) as raised:
        load_policy(TEAM + "  narrowToFit: sometimes\n")
    assert raised.value.errors == ["teams[0].narrowToFit: must be true or false, got str"]


def test_the_recheck_at_reservation_names_the_model_the_rule_binds() -> None:
    """Issue 36, finding 4, under the lock: a claim that fitted when weighed, denied when the
    reservation finds a T4 rule's usage grown meanwhile, says why that rule applies to it, as
    the first weighing's denial does."""
    make_team(
        [
            {"name": "t4", "device_class": "gpu.nvidia.com", "selector": T4, "limit": 4},
            {"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 16},
        ]
    )
    cluster = get_cluster("default")
    body = claim("any-two", [gpu_request(2)])
    state = store.admission_state(cluster=cluster.name, namespace="research", name="any-two")
    plan = service._plan(cluster=cluster, claim=body, state=state)
    assert plan.denial == ""  # 0 of 4 T4s in use when it was weighed
    QuotaRule.objects.filter(name="t4").update(in_use=3)  # meanwhile another took 3
    decision, recorded = service._reserve(
        cluster=cluster, claim=body, plan=plan, username="alice", admission_uid="u", at=AT
    )
    assert not decision.allowed and not recorded
    assert decision.message == (
        'team "research": quota rule "t4" (enforce) would be exceeded: 3 GPUs in use, 2 GPUs '
        "requested, limit 4 GPUs; the rule binds Tesla T4, which request 'gpu' could be given (a "
        "selector that leaves it out of the request leaves the rule out too)"
    )
    assert not Reservation.objects.exists()


def test_the_admin_sets_the_option_audited(client: Client) -> None:
    team = make_team([])
    user = get_user_model().objects.create_superuser("ops-admin", "ops@example.com", "x")
    client.force_login(user)
    response = client.post(
        reverse("admin:quota_narrowingpolicy_add"), {"team": team.pk, "narrow_to_fit": "on"}
    )
    assert response.status_code == 302, response.content
    assert NarrowingPolicy.objects.get(team=team).narrow_to_fit is True
    entry = AuditEntry.objects.get(object_type="narrowing policy")
    assert (entry.action, entry.object_repr) == ("create", "research: narrow to fit on")
    changelist = client.get(reverse("admin:quota_narrowingpolicy_changelist"))
    assert changelist.status_code == 200


def test_a_narrowed_create_sent_again_is_narrowed_alike_and_reserves_once(client: Client) -> None:
    """The API server sends a retried create to the mutating webhook again, unpatched: while the
    kept models still have room it gets the same patch, and the validating webhook finds the
    patched claim the one it admitted (same spec): nothing reserved twice."""
    narrowing_team()
    body = claim("any-two", [gpu_request(2)])
    answers = []
    for uid in ("first", "retry"):
        answer = post(client, review(body, uid=uid), MUTATE).json()["response"]
        answers.append(answer)
        assert decide(client, patched(body, answer), uid=uid)["allowed"]
    assert answers[0]["patch"] == answers[1]["patch"]
    assert Reservation.objects.count() == 1
    assert QuotaRule.objects.get(name="h100").in_use == 2


# --- firstAvailable alternatives, each narrowed on its own ------------------------------------

A100_ONLY = 'device.attributes["gpu.nvidia.com"].productName == "NVIDIA A100-SXM4-80GB"'


def alternatives(*subrequests: dict[str, Any]) -> dict[str, Any]:
    return {"name": "accel", "firstAvailable": list(subrequests)}


def subrequest(name: str, count: int, *selectors: str) -> dict[str, Any]:
    return {
        "name": name,
        "deviceClassName": "gpu.nvidia.com",
        "count": count,
        **({"selectors": [{"cel": {"expression": s}} for s in selectors]} if selectors else {}),
    }


# Two A100s (no room: the A100 rule's limit is 0), else any two NVIDIA GPUs (no room as sent:
# they could be T4s), else one T4 (room as sent).
CHOICE = alternatives(
    subrequest("a100s", 2, A100), subrequest("any", 2), subrequest("one-t4", 1, T4)
)


def test_a_first_available_alternative_is_narrowed_in_order(client: Client) -> None:
    """The alternatives in order: two A100s fit on no model (dropped); any two NVIDIA GPUs fit
    once narrowed to the H100s (kept, the selector added to it); one T4, which fits as sent
    and which Tally kept before, comes after it, so it goes. The patch adds the selector at the
    alternative's index as sent, then removes the others; the claim holds what the kept,
    narrowed alternative takes, which is all the scheduler can now give it."""
    narrowing_team()
    body = claim("choice", [CHOICE])
    answer = mutation(client, body)
    assert answer["allowed"]
    patch = json.loads(base64.b64decode(answer["patch"]))
    assert patch[:3] == [
        {
            "op": "add",
            "path": "/spec/devices/requests/0/firstAvailable/1/selectors",
            "value": [{"cel": {"expression": H100_ONLY}}],
        },
        {"op": "remove", "path": "/spec/devices/requests/0/firstAvailable/2"},
        {"op": "remove", "path": "/spec/devices/requests/0/firstAvailable/0"},
    ]
    annotations = patch[3]["value"]
    assert json.loads(annotations[NARROWED_ANNOTATION]) == {"accel/any": ["NVIDIA H100 80GB HBM3"]}
    assert json.loads(annotations["tally.dev/removed-alternatives"]) == {
        "accel": ["a100s", "one-t4"]
    }
    assert any(w.startswith("request 'accel/any' narrowed to") for w in answer["warnings"])

    narrowed = patched(body, answer)
    (request,) = dra.parse_claim_requests(narrowed["spec"], narrowed["apiVersion"])
    assert [(alt.name, alt.selectors) for alt in request.first_available] == [("any", [H100_ONLY])]
    assert decide(client, narrowed)["allowed"]
    in_use = dict(QuotaRule.objects.values_list("name", "in_use"))
    assert in_use == {"t4": 0, "a100": 0, "h100": 2, "all-gpus": 2}
    reservation = Reservation.objects.get()
    assert reservation.chosen == {"accel": ["any"]}
    assert reservation.narrowed == {
        "accel/any": {"selector": H100_ONLY, "models": ["NVIDIA H100 80GB HBM3"]}
    }


def test_an_alternative_that_fits_as_sent_is_kept_before_a_later_one(client: Client) -> None:
    """The first alternative fits as sent: kept as without the option, nothing narrowed."""
    narrowing_team()
    body = claim("choice", [alternatives(subrequest("one-t4", 1, T4), subrequest("any", 2))])
    answer = mutation(client, body)
    patch = json.loads(base64.b64decode(answer["patch"]))
    assert patch[0] == {"op": "remove", "path": "/spec/devices/requests/0/firstAvailable/1"}
    assert NARROWED_ANNOTATION not in patch[1]["value"]


def test_first_available_is_not_narrowed_without_the_option(client: Client) -> None:
    """Off: the first alternative that fits as sent is kept, as before (the one T4)."""
    narrowing_team(on=False)
    answer = mutation(client, claim("choice", [CHOICE]))
    patch = json.loads(base64.b64decode(answer["patch"]))
    assert [op["path"] for op in patch[:2]] == [
        "/spec/devices/requests/0/firstAvailable/1",
        "/spec/devices/requests/0/firstAvailable/0",
    ]
    assert NARROWED_ANNOTATION not in patch[2]["value"]


# --- Candidates of several drivers ----------------------------------------------------------

ANY_GPU_CLASS = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "DeviceClass",
    "metadata": {"name": "any-gpu"},
    "spec": {
        "selectors": [{"cel": {"expression": 'device.driver in ["gpu.nvidia.com", "gpu.amd.com"]'}}]
    },
}
MI300X_AND_H100 = (
    '(device.driver == "gpu.amd.com" && (device.attributes["gpu.amd.com"].productName == '
    '"AMD_Instinct_MI300X_OAM")) || (device.driver == "gpu.nvidia.com" && (' + H100_ONLY + "))"
)


@pytest.fixture
def amd_too(t4_and_h100_nodes: None) -> None:
    """The fleet, AMD's two MI300X nodes besides, and a class of any NVIDIA or AMD GPU."""
    h100 = [nvidia_gpu(i, "h100-b", "NVIDIA H100 80GB HBM3", "80Gi") for i in range(8)]
    t4s = [nvidia_gpu(i, "t4-a", "Tesla T4", "16Gi") for i in range(4)]
    forget_fleet_shapes()
    report = inventory_services.import_snapshot(
        cluster=inventory_services.get_cluster("default"),
        objects=[
            *fleet_objects(),
            nvidia_slice("h100-b", h100),
            nvidia_slice("t4-a", t4s),
            *iter_objects(DRA / "vendors" / "amd-mi300x.yaml"),
            ANY_GPU_CLASS,
        ],
        at=AT,
    )
    assert report.errors == []


@pytest.mark.usefixtures("amd_too")
def test_candidates_of_two_drivers_get_a_selector_per_driver(client: Client) -> None:
    """Any two NVIDIA or AMD GPUs, the T4 and A100 rules full: narrowed to the MI300X and the
    H100, each model read where its own driver publishes it, and guarded by its driver (an
    AMD device has no gpu.nvidia.com attributes: reading one would fail its allocation)."""
    narrowing_team([*RULES, {"name": "mi300x", "device_class": "gpu.amd.com", "limit": 8}])
    body = claim("any-two", [gpu_request(2, "any-gpu")])
    answer = mutation(client, body)
    assert answer["allowed"], answer
    patch = json.loads(base64.b64decode(answer["patch"]))
    assert patch[0]["value"] == [{"cel": {"expression": MI300X_AND_H100}}]
    assert json.loads(patch[1]["value"][NARROWED_ANNOTATION]) == {
        "gpu": ["AMD_Instinct_MI300X_OAM", "NVIDIA H100 80GB HBM3"]
    }

    # Tally's CEL evaluator compiles it, and on every device of the fleet it matches or not,
    # never fails: the MI300X (whole and partitions) and the H100s, nothing else.
    selector = cel.compile_selector(MI300X_AND_H100)
    fleet = shapes.fleet_shapes(cluster=get_cluster("default"))
    outcomes = {shape.id: selector.run(shape.view) for shape in fleet.shapes.values()}
    assert all(outcome.error is None for outcome in outcomes.values())
    matched = {fleet.shapes[i].model for i, outcome in outcomes.items() if outcome.matched}
    assert matched == {"AMD_Instinct_MI300X_OAM", "NVIDIA H100 80GB HBM3"}

    narrowed = patched(body, answer)
    (request,) = dra.parse_claim_requests(narrowed["spec"], narrowed["apiVersion"])
    assert request.selectors == [MI300X_AND_H100]
    assert decide(client, narrowed)["allowed"]
    in_use = dict(QuotaRule.objects.values_list("name", "in_use"))
    assert in_use == {"t4": 0, "a100": 0, "h100": 2, "all-gpus": 2, "mi300x": 2}


# --- A create sent again after its models filled -----------------------------------------------


def test_a_create_sent_again_after_its_models_filled_is_narrowed_as_first(client: Client) -> None:
    """The A100 rule has room for exactly this claim: narrowed to the A100s and the H100s, it
    fills the A100 rule. Its client sends the create again (a timeout): weighed anew, beside
    its own reservation, it would be narrowed to the H100s alone (another selector, another
    claim to the validating webhook). It gets the first patch, and reserves nothing more."""
    rules = [{**rule, "limit": 2} if rule["name"] == "a100" else rule for rule in RULES]
    narrowing_team(rules)
    body = claim("any-two", [gpu_request(2)])
    first = post(client, review(body, uid="first"), MUTATE).json()["response"]
    assert decide(client, patched(body, first), uid="first")["allowed"]
    before = dict(QuotaRule.objects.values_list("name", "in_use"))
    assert before == {"t4": 0, "a100": 2, "h100": 2, "all-gpus": 2}

    again = post(client, review(body, uid="again"), MUTATE).json()["response"]
    assert again["allowed"] and again["patch"] == first["patch"]
    assert (
        "request 'gpu' narrowed to NVIDIA A100-SXM4-80GB, NVIDIA H100 80GB HBM3 (a selector "
        "added; the team narrows to fit), as when this claim was first admitted: a create sent "
        "again"
    ) in again["warnings"]
    assert decide(client, patched(body, again), uid="again")["allowed"]
    assert Reservation.objects.count() == 1
    assert dict(QuotaRule.objects.values_list("name", "in_use")) == before


def test_a_first_available_create_sent_again_is_narrowed_and_cut_alike(client: Client) -> None:
    """The same for an alternative narrowed: the retry gets the same selector and the same
    alternatives removed, though the H100 rule is full once the first is admitted."""
    rules = [{**rule, "limit": 2} if rule["name"] == "h100" else rule for rule in RULES]
    narrowing_team(rules)
    body = claim("choice", [CHOICE])
    first = post(client, review(body, uid="first"), MUTATE).json()["response"]
    assert decide(client, patched(body, first), uid="first")["allowed"]
    again = post(client, review(body, uid="again"), MUTATE).json()["response"]
    assert again["allowed"] and again["patch"] == first["patch"]
    assert decide(client, patched(body, again), uid="again")["allowed"]
    assert Reservation.objects.count() == 1
    assert QuotaRule.objects.get(name="h100").in_use == 2


def test_another_claim_under_the_name_is_weighed_as_new(client: Client) -> None:
    """Not the same spec once narrowed alike (it asks for three): weighed as new, its own
    narrowing, with the first claim's reservation counted."""
    narrowing_team()
    body = claim("any", [gpu_request(2)])
    first = post(client, review(body), MUTATE).json()["response"]
    assert decide(client, patched(body, first))["allowed"]
    other = claim("any", [gpu_request(3)])
    answer = post(client, review(other), MUTATE).json()["response"]
    assert answer["allowed"]
    assert "as when this claim was first admitted" not in " ".join(answer["warnings"])


def test_a_team_that_does_not_narrow_keeps_no_narrowing(client: Client) -> None:
    """A claim of a team without the option, carrying the annotation and a selector of its own
    (copied from a narrowed claim): weighed and reserved as ever, its reservation keeps no
    narrowing, and its create sent again is never patched."""
    make_team(RULES)
    body = claim("copied", [gpu_request(2, selectors=[{"cel": {"expression": H100_ONLY}}])])
    body["metadata"]["annotations"] = {NARROWED_ANNOTATION: '{"gpu": ["NVIDIA H100 80GB HBM3"]}'}
    assert decide(client, body)["allowed"]
    assert Reservation.objects.get().narrowed == {}
    again = mutation(client, claim("copied", [gpu_request(2)]))
    assert "patch" not in again


def test_a_v1beta1_alternative_is_narrowed_alike(client: Client) -> None:
    """v1beta1 writes an alternative as v1 does (its selectors on itself): the same patch
    applies, and the patched claim parses with the selector on the kept alternative."""
    narrowing_team()
    body = claim("beta", [CHOICE], api_version="resource.k8s.io/v1beta1")
    answer = mutation(client, body)
    patch = json.loads(base64.b64decode(answer["patch"]))
    assert patch[0]["path"] == "/spec/devices/requests/0/firstAvailable/1/selectors"
    narrowed = patched(body, answer)
    (request,) = dra.parse_claim_requests(narrowed["spec"], narrowed["apiVersion"])
    assert [(alt.name, alt.selectors) for alt in request.first_available] == [("any", [H100_ONLY])]
    assert decide(client, narrowed)["allowed"]
    assert QuotaRule.objects.get(name="t4").in_use == 0
