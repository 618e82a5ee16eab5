"""The admission webhooks the Kubernetes API server calls on every ResourceClaim CREATE.

Thin edges: parse the AdmissionReview, call one service (`service.review_claim`, or
`service.fit_alternatives` for the mutating webhook), answer. Every well-formed review gets
a well-formed answer that echoes its uid; a body that is no AdmissionReview (not JSON, nested
past `core.inputs`' limit, a number past a double) gets HTTP 400 with the reason, and a
claim that is malformed a denial naming the field. Nothing here answers 500.

Only a database that cannot be reached in time (an `OperationalError` or `InterfaceError`:
refused, gone, timed out, past the deadline) may be an admission, with a warning, when
`TALLY_WEBHOOK_FAIL_OPEN` is set; otherwise it is a clear denial within the deadline. A
statement the database refuses (a value it cannot store, a bug) is always a denial: failing
open then would admit, reserving nothing, a claim that would be refused again and again.
"""

from __future__ import annotations

import base64
import json
import logging
import time
from typing import Any

import orjson
from django.conf import settings
from django.db import DataError, InterfaceError, OperationalError
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST
from jsonpatch import JsonPointer

from core import metrics
from core.inputs import BadInput, parse_json
from core.logging import PARSED_REVIEW
from quota.admission import patches, service
from quota.admission.plans import NARROWED_ANNOTATION, Decision

log = logging.getLogger(__name__)
API_VERSION = "admission.k8s.io/v1"
REMOVED_ANNOTATION = "tally.dev/removed-alternatives"
# The API server's request uids are UUIDs (36 characters); the records keep 64.
MAX_UID_LENGTH = 64
# Kubernetes' longest: a namespace is a DNS label, a name a DNS subdomain.
MAX_LENGTHS = {"namespace": 63, "name": 253, "generateName": 253}


class BadReview(ValueError):
    """The body is not an AdmissionReview; the message says what is wrong."""


class BadClaim(ValueError):
    """The review is of a claim the webhooks cannot read; the message names the field."""


_UNPARSED = object()


def parse_review(body: bytes, parsed: Any = _UNPARSED) -> dict[str, Any]:
    """The review's `request`, checked for the fields the answer depends on.

    `parsed` is the body already parsed as JSON (the request-id middleware reads the uid).
    """
    try:
        review = parse_json(body) if parsed is _UNPARSED else parsed
    except BadInput as exc:
        raise BadReview(str(exc)) from None
    if not isinstance(review, dict):
        raise BadReview("body must be a JSON object (an AdmissionReview)")
    if review.get("kind") != "AdmissionReview":
        raise BadReview(f"kind must be AdmissionReview, not {review.get('kind')!r}")
    if review.get("apiVersion") != API_VERSION:
        raise BadReview(f"apiVersion must be {API_VERSION}, not {review.get('apiVersion')!r}")
    request = review.get("request")
    if not isinstance(request, dict):
        raise BadReview("request is missing or not an object")
    if not isinstance(request.get("uid"), str) or not request["uid"]:
        raise BadReview("request.uid is missing or not a string")
    if len(request["uid"]) > MAX_UID_LENGTH:
        raise BadReview(f"request.uid is longer than {MAX_UID_LENGTH} characters")
    return request


def answer(
    uid: str,
    *,
    allowed: bool,
    message: str = "",
    reason: str = "",
    warnings: list[str] | None = None,
    patch: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The AdmissionReview that answers the request `uid` (a mutation: with `patch`, the
    operations of a JSON Patch, RFC 6902)."""
    response: dict[str, Any] = {"uid": uid, "allowed": allowed}
    if not allowed:
        response["status"] = {"code": 403, "reason": reason or "Forbidden", "message": message}
    if warnings:
        # The API server caps a warning at 256 characters.
        response["warnings"] = [w if len(w) <= 256 else w[:253] + "..." for w in warnings]
    if patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(orjson.dumps(patch)).decode()
    return {"apiVersion": API_VERSION, "kind": "AdmissionReview", "response": response}


def _is_claim_create(request: dict[str, Any]) -> bool:
    resource = request.get("resource") if isinstance(request.get("resource"), dict) else {}
    assert isinstance(resource, dict)
    return (
        request.get("operation") == "CREATE"
        and resource.get("group") == "resource.k8s.io"
        and resource.get("resource") == "resourceclaims"
        and not request.get("subResource")
    )


def _review(http_request: HttpRequest, *, mutate: bool) -> HttpResponse:
    # The API server gives up timeoutSeconds after it sent the review; counted from here.
    deadline = time.monotonic() + settings.TALLY_WEBHOOK_DEADLINE_MS / 1000
    webhook = "mutate" if mutate else "validate"
    with _child(metrics.WEBHOOK_LATENCY, webhook).time():
        try:
            request = parse_review(
                http_request.body, getattr(http_request, PARSED_REVIEW, _UNPARSED)
            )
        except BadReview as exc:
            return HttpResponse(
                f"bad AdmissionReview: {exc}\n", status=400, content_type="text/plain"
            )
        body = orjson.dumps(respond(request, mutate=mutate, deadline=deadline))
        return HttpResponse(body, content_type="application/json")


def _count(webhook: str, result: str, rule: str = "") -> None:
    _child(metrics.WEBHOOK_DECISIONS, webhook, result, rule).inc()


_children: dict[tuple[Any, ...], Any] = {}


def _child(metric: Any, *labels: str) -> Any:
    """`metric.labels(*labels)`, looked up once per process (every admission counts itself)."""
    key = (metric, *labels)
    child = _children.get(key)
    if child is None:
        child = _children[key] = metric.labels(*labels)
    return child


def respond(
    request: dict[str, Any], *, mutate: bool = False, deadline: float | None = None
) -> dict[str, Any]:
    """The AdmissionReview answering `request` (a review's request, as `parse_review` gives it).

    What the validating (or, with `mutate`, the mutating) webhook answers; `manage.py
    review_claims` calls it in-process. `deadline` (`time.monotonic()`; by default
    TALLY_WEBHOOK_DEADLINE_MS from now): nothing is reserved, or waited for, after it. Never
    raises: a database that cannot be reached is a denial (an admission with a warning when
    `TALLY_WEBHOOK_FAIL_OPEN` is set).
    """
    webhook = "mutate" if mutate else "validate"
    uid = request["uid"]
    if not _is_claim_create(request):
        return answer(uid, allowed=True)
    try:
        claim, username, dry_run = _claim_of(request)
    except BadClaim as exc:
        # Not recorded: what it names cannot be stored as sent (the API server sends none).
        log.warning("admission %s: denied, unreadable: %s", uid, exc)
        _count(webhook, "denied")
        return answer(uid, allowed=False, reason="Invalid", message=str(exc))
    if deadline is None:
        deadline = time.monotonic() + settings.TALLY_WEBHOOK_DEADLINE_MS / 1000
    review = service.fit_alternatives if mutate else service.review_claim
    try:
        decision = review(
            claim=claim,
            username=username,
            dry_run=dry_run,
            admission_uid=uid,
            at=timezone.now(),
            deadline=deadline,
        )
    except (OperationalError, InterfaceError) as exc:
        log.error("admission %s: database unavailable: %s", uid, exc)
        _count(webhook, "error")
        if settings.TALLY_WEBHOOK_FAIL_OPEN:
            return answer(
                uid, allowed=True, warnings=["Tally could not check quota (database unavailable)"]
            )
        return answer(
            uid,
            allowed=False,
            reason="ServiceUnavailable",
            message="Tally cannot check quota right now (its database is unavailable); try again",
        )
    except DataError as exc:
        # A value of the claim the database cannot store (a NUL character): the same claim
        # would be refused every time, so it is denied, saying why.
        problem = str(exc).strip().splitlines()[0] if str(exc).strip() else "invalid data"
        log.warning("admission %s: the database refused the claim's data: %s", uid, problem)
        _count(webhook, "error")
        return answer(
            uid,
            allowed=False,
            reason="Invalid",
            message=f"Tally cannot store this claim: {problem}",
        )
    except Exception:
        log.exception("admission %s: unexpected error", uid)
        _count(webhook, "error")
        return answer(
            uid,
            allowed=False,
            reason="InternalError",
            message="Tally failed to check quota; see its logs",
        )
    _count(webhook, "allowed" if decision.allowed else "denied", decision.rule)
    if mutate:
        return _mutation(uid, request["object"], decision)
    return answer(
        uid,
        allowed=decision.allowed,
        message=decision.message,
        reason=decision.reason,
        warnings=decision.warnings,
    )


def _claim_of(request: dict[str, Any]) -> tuple[dict[str, Any], str, bool]:
    """The claim of a CREATE review (its namespace and name filled in from the request when
    it has none), the user who sent it and whether it is a dry run; `BadClaim` names the
    field the API server would never send so (the mutating webhook sees a claim before the
    API server validates it)."""
    claim = request.get("object")
    if not isinstance(claim, dict):
        raise BadClaim("request.object is not a ResourceClaim")
    metadata = claim.get("metadata")
    if metadata is None:
        claim = {**claim, "metadata": {}}
    elif not isinstance(metadata, dict):
        raise BadClaim(f"request.object.metadata: must be a mapping, not {_kind(metadata)}")
    if not claim.get("apiVersion"):
        # The API server always sends it; a claim written without one is read as the version
        # the review names (`request.kind`).
        kind = request.get("kind")
        if isinstance(kind, dict) and kind.get("group") and kind.get("version"):
            claim["apiVersion"] = f"{kind['group']}/{kind['version']}"
    claim["metadata"].setdefault("namespace", request.get("namespace") or "default")
    claim["metadata"].setdefault("name", request.get("name") or "")
    for key, longest in MAX_LENGTHS.items():
        value = claim["metadata"].get(key)
        if value is not None and not isinstance(value, str):
            raise BadClaim(f"request.object.metadata.{key}: must be a string, not {_kind(value)}")
        if value is not None and len(value) > longest:
            raise BadClaim(f"request.object.metadata.{key}: must be at most {longest} characters")
    user_info = request.get("userInfo")
    if user_info is None:
        user_info = {}
    elif not isinstance(user_info, dict):
        raise BadClaim(f"request.userInfo: must be a mapping, not {_kind(user_info)}")
    username = user_info.get("username")
    if username is not None and not isinstance(username, str):
        raise BadClaim(f"request.userInfo.username: must be a string, not {_kind(username)}")
    dry_run = request.get("dryRun")
    if dry_run is not None and not isinstance(dry_run, bool):
        raise BadClaim(f"request.dryRun: must be a boolean, not {_kind(dry_run)}")
    return claim, username or "", dry_run is True


def _kind(value: Any) -> str:
    """A JSON value's type, in the words of `inventory.dra`'s messages."""
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), "a number" if isinstance(value, int | float) else "null"
    )


def _mutation(uid: str, claim: dict[str, Any], decision: Decision) -> dict[str, Any]:
    if not decision.allowed:
        return answer(
            uid,
            allowed=False,
            message=decision.message,
            reason=decision.reason,
            warnings=decision.warnings,
        )
    if not decision.removed and not decision.narrowed:
        return answer(uid, allowed=True, warnings=decision.warnings)
    operations = patches.spec_operations(
        claim,
        removed=decision.removed,
        narrowed={key: narrowing.selector for key, narrowing in decision.narrowed.items()},
    )
    annotations = {}
    if decision.removed:
        annotations[REMOVED_ANNOTATION] = json.dumps(decision.removed, sort_keys=True)
    if decision.narrowed:
        annotations[NARROWED_ANNOTATION] = json.dumps(
            {name: list(narrowing.models) for name, narrowing in decision.narrowed.items()},
            sort_keys=True,
        )
    operations.extend(_annotate(claim, annotations))
    warnings = [
        *decision.warnings,
        *(
            f"request {name!r}: alternatives {', '.join(alts)} removed: only the first "
            "alternative that fits the team's quota is kept, and it alone holds quota"
            for name, alts in decision.removed.items()
        ),
    ]
    return answer(uid, allowed=True, warnings=warnings, patch=operations)


def _annotate(claim: dict[str, Any], annotations: dict[str, str]) -> list[dict[str, Any]]:
    """The patch operations that set `annotations` on `claim`: they must apply to the object
    as sent, whichever of its metadata and annotations it has."""
    metadata = claim.get("metadata")
    if not isinstance(metadata, dict):
        return [{"op": "add", "path": "/metadata", "value": {"annotations": annotations}}]
    if not isinstance(metadata.get("annotations"), dict):
        return [{"op": "add", "path": "/metadata/annotations", "value": annotations}]
    # Each annotation's JSON Pointer (RFC 6901 escapes its "/").
    return [
        {"op": "add", "path": JsonPointer.from_parts(["metadata", "annotations", key]).path,
         "value": value}
        for key, value in annotations.items()
    ]  # fmt: skip


@csrf_exempt
@require_POST
def validate(request: HttpRequest) -> HttpResponse:
    """`POST /admission/resourceclaims`: deny claims past their team's quota; reserve the rest."""
    return _review(request, mutate=False)


@csrf_exempt
@require_POST
def mutate(request: HttpRequest) -> HttpResponse:
    """`POST /admission/resourceclaims/mutate`: drop firstAvailable alternatives over quota;
    narrow claims to the models that fit, for teams that ask for it."""
    return _review(request, mutate=True)
