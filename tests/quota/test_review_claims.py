"""`manage.py review_claims`: claims in files through the webhooks, with the decisions printed."""

from __future__ import annotations

import json
import re
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.core.management import CommandError, call_command
from pytest_django.live_server_helper import LiveServer

from quota.models import AdmissionDecision, QuotaRule, Reservation
from tests.fixtures import CLAIMS
from tests.quota.fixtures import claim, gpu_request, make_team
from tests.quota.test_admission import FIXTURE_CLAIMS, H100_OR_A100, RULES, first_available

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fleet")]

# "FILE: NAMESPACE/NAME[ (template)]: ALLOWED|DENIED[ | MESSAGE][ | warning: WARNING]..."
LINE = re.compile(
    r"(?P<file>[^:]+): (?P<namespace>[^/]+)/(?P<name>\S+)(?P<template> \(template\))?: "
    r"(?P<decision>ALLOWED|DENIED)(?P<rest>.*)"
)
POLICY = """\
teams:
- slug: vision
  name: Vision
  namespaces: [vision]
  quotas:
  - name: all-gpus
    deviceClass: gpu.nvidia.com
    gpus: 2
  - name: h100
    deviceClass: gpu.nvidia.com
    selector: device.attributes["gpu.nvidia.com"].productName.startsWith("NVIDIA H100")
    gpus: 1
"""


def review_claims(*args: str) -> tuple[list[dict[str, Any]], str, str]:
    """The command's claim lines (parsed), its summary line and what it wrote to stderr."""
    out, err = StringIO(), StringIO()
    try:
        call_command("review_claims", *args, stdout=out, stderr=err)
    finally:
        print(out.getvalue(), err.getvalue())  # shown when a test fails
    *lines, summary = out.getvalue().splitlines()
    parsed = []
    for line in lines:
        match = LINE.fullmatch(line)
        assert match, line
        parts = match["rest"].split(" | ")[1:]
        parsed.append(
            {
                **match.groupdict(),
                "message": next((p for p in parts if not p.startswith("warning: ")), ""),
                "warnings": [p.removeprefix("warning: ") for p in parts if p.startswith("warning")],
            }
        )
    return parsed, summary, err.getvalue()


def write_yaml(path: Path, *objects: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump_all(objects))
    return path


def template(name: str, requests: list[dict[str, Any]], namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "metadata": {"labels": {"app": name}},
            "spec": {"devices": {"requests": requests}},
        },
    }


def test_the_fixture_claims_get_the_webhooks_decisions() -> None:
    """Every fixture claim, with the decisions and reasons the webhook tests expect."""
    make_team(RULES)
    lines, summary, errors = review_claims(str(CLAIMS), "--namespace", "research")
    decisions = {
        (Path(line["file"]).relative_to(CLAIMS).as_posix(), line["name"]): line for line in lines
    }
    assert decisions.keys() == FIXTURE_CLAIMS.keys()
    for key, expected in FIXTURE_CLAIMS.items():
        line = decisions[key]
        expected_denial = expected if isinstance(expected, str) else ""
        assert line["namespace"] == "research"
        assert line["decision"] == ("DENIED" if expected_denial else "ALLOWED"), line
        assert expected_denial in line["message"]
    template_key = ("one-gpu.yaml", "one-gpu-per-pod")
    claim_key = ("one-gpu.yaml", "single-gpu")
    assert decisions[template_key]["template"] and not decisions[claim_key]["template"]
    denied = sum(isinstance(expected, str) for expected in FIXTURE_CLAIMS.values())
    assert summary == (
        f"{len(FIXTURE_CLAIMS)} claims: {len(FIXTURE_CLAIMS) - denied} allowed, {denied} denied "
        "(dry run, nothing reserved)"
    )
    assert errors == ""
    # A dry run: nothing reserved, nothing recorded, no usage counted.
    assert not Reservation.objects.exists() and not AdmissionDecision.objects.exists()
    assert not QuotaRule.objects.exclude(in_use=0).exists()


def test_a_policy_applied_gives_denials_with_reasons_and_fallbacks(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    call_command("apply_policy", str(policy), stdout=StringIO())
    h100 = {"cel": {"expression": H100_OR_A100[0][2]}}
    claims = write_yaml(
        tmp_path / "claims.yaml",
        claim("two-h100", [gpu_request(2, selectors=[h100])], namespace="vision"),
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "ignored"}},
        template("h100-or-a100", [first_available(*H100_OR_A100)], namespace="elsewhere"),
        claim(
            "one-a100", [gpu_request(1, selectors=[{"cel": {"expression": H100_OR_A100[1][2]}}])]
        ),
    )
    QuotaRule.objects.filter(name="h100").update(in_use=1)  # the team's H100 is taken

    lines, summary, _ = review_claims(str(claims), "--namespace", "vision", "--user", "alice")

    two_h100, fallback, a100 = lines
    assert (two_h100["name"], two_h100["decision"]) == ("two-h100", "DENIED")
    assert two_h100["message"] == (
        'team "vision": quota rule "h100" (enforce) would be exceeded: '
        "1 GPU in use, 2 GPUs requested, limit 1 GPU"
    )
    # The mutating webhook drops the H100 alternative; the A100 one is admitted.
    assert (fallback["name"], fallback["template"], fallback["decision"]) == (
        "h100-or-a100",
        " (template)",
        "ALLOWED",
    )
    assert fallback["namespace"] == "vision"  # --namespace wins over the file's
    assert (
        "request 'gpu': alternatives h100 removed: only the first alternative that fits the "
        "team's quota is kept, and it alone holds quota" in fallback["warnings"]
    )
    assert (a100["name"], a100["decision"]) == ("one-a100", "ALLOWED")
    assert summary == "3 claims: 2 allowed, 1 denied (dry run, nothing reserved)"
    assert not Reservation.objects.exists()


def test_reserve_admits_for_real_so_later_claims_count_earlier_ones(tmp_path: Path) -> None:
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 2}])
    claims = write_yaml(
        tmp_path / "claims.yaml",
        template("one-gpu", [gpu_request(1)], namespace="research"),
        claim("another", [gpu_request(1)]),
        claim("one-too-many", [gpu_request(1)]),
    )
    lines, summary, _ = review_claims(str(claims), "--reserve", "--user", "alice")
    assert [line["decision"] for line in lines] == ["ALLOWED", "ALLOWED", "DENIED"]
    assert "2 GPUs in use, 1 GPU requested, limit 2 GPUs" in lines[2]["message"]
    assert summary == "3 claims: 2 allowed, 1 denied (admitted claims reserved)"
    reservations = Reservation.objects.order_by("name")
    assert [(r.name, r.username) for r in reservations] == [
        ("another", "alice"),
        ("one-gpu", "alice"),
    ]
    assert QuotaRule.objects.get().in_use == 2
    # Sent again, the same claims are replays: admitted once, nothing reserved twice.
    lines, _, _ = review_claims(str(claims), "--reserve")
    assert [line["decision"] for line in lines] == ["ALLOWED", "ALLOWED", "DENIED"]
    assert Reservation.objects.count() == 2 and QuotaRule.objects.get().in_use == 2


def test_files_that_cannot_be_read_fail_the_command_after_the_rest(tmp_path: Path) -> None:
    make_team(RULES)
    good = tmp_path / "claims" / "good.json"
    good.parent.mkdir()
    good.write_text(
        json.dumps({"apiVersion": "v1", "kind": "List", "items": [claim("c", [gpu_request(1)])]})
    )
    (tmp_path / "claims" / "broken.yaml").write_text("kind: [unclosed\n")
    (tmp_path / "claims" / "notes.txt").write_text("not read: not a .yaml/.yml/.json file")
    out, err = StringIO(), StringIO()
    with pytest.raises(CommandError, match=r"^2 file\(s\) could not be read$"):
        call_command(
            "review_claims",
            str(tmp_path / "claims"),
            str(tmp_path / "missing.yaml"),
            stdout=out,
            stderr=err,
        )
    assert "claims/good.json: research/c: ALLOWED" in out.getvalue()
    assert "1 claims: 1 allowed, 0 denied" in out.getvalue()
    assert f"error: {tmp_path / 'claims' / 'broken.yaml'}: " in err.getvalue()
    assert f"error: {tmp_path / 'missing.yaml'}: cannot read" in err.getvalue()


@pytest.mark.django_db(transaction=True)
def test_url_sends_the_reviews_to_a_running_service(
    live_server: LiveServer, tmp_path: Path
) -> None:
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 1}])
    claims = write_yaml(
        tmp_path / "claims.yaml",
        claim("fits", [gpu_request(1)]),
        claim("too-big", [gpu_request(2)]),
    )
    lines, _, _ = review_claims(str(claims), "--url", live_server.url, "--reserve")
    assert [line["decision"] for line in lines] == ["ALLOWED", "DENIED"]
    assert "1 GPU in use, 2 GPUs requested, limit 1 GPU" in lines[1]["message"]
    assert Reservation.objects.get().name == "fits"  # the service reserved it


def test_url_that_cannot_be_reached_is_an_error(tmp_path: Path) -> None:
    claims = write_yaml(tmp_path / "claims.yaml", claim("c", [gpu_request(1)]))
    with pytest.raises(CommandError, match=r"cannot reach http://127\.0\.0\.1:9/admission/"):
        call_command("review_claims", str(claims), "--url", "http://127.0.0.1:9", stdout=StringIO())


def test_files_with_no_claim_are_an_error_naming_what_they_held(tmp_path: Path) -> None:
    """Issue 35, finding 9: it said "0 claims" and exited 0, as if every claim had passed."""
    make_team(RULES)
    pods = tmp_path / "pods.yaml"
    pods.write_text(
        "apiVersion: v1\nkind: Pod\nmetadata: {name: a}\n---\n"
        "apiVersion: v1\nkind: Pod\nmetadata: {name: b}\n---\n"
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n"
    )
    out = StringIO()
    expected = (
        rf"^no ResourceClaim or ResourceClaimTemplate in {re.escape(str(pods))} "
        r"\(read: 1 ConfigMap, 2 Pod\); give the files that hold the claims to review$"
    )
    with pytest.raises(CommandError, match=expected):
        call_command("review_claims", str(pods), stdout=out, stderr=StringIO())
    assert "0 claims: 0 allowed, 0 denied" in out.getvalue()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CommandError, match=r"\(read: nothing\)"):
        call_command("review_claims", str(empty), stdout=StringIO(), stderr=StringIO())
