"""The mutating webhook the API server calls on the creation (and update) of workloads in team
namespaces: it records who made them (`quota.workloads`).

Thin edge, as `quota.admission.views`: parse the AdmissionReview (a body that is none gets
HTTP 400 with the reason), decide, answer. Unlike the claim webhooks it touches no database
(it reads the owner of what a controller creates from the API server) and never denies: its
webhook fails open (`failurePolicy: Ignore`), so an object it cannot read, or a failure of
its own, is an admission with a warning, never a 500; a workload is then attributed by its
labels (`TALLY_CREATED_BY_LABELS`) or not at all.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from core import metrics
from core.logging import PARSED_REVIEW
from inventory import kube_owners
from inventory.owners import OwnerLookup
from quota import workloads
from quota.admission import service
from quota.admission.views import BadReview, answer, parse_review

log = logging.getLogger(__name__)
WEBHOOK = "workloads"
FAILED = "Tally did not record who created this object (an error; see its logs)"


def owner_lookup() -> OwnerLookup | None:
    """Where this webhook reads the owners of what controllers create: the API server,
    through the claim webhook's reader (`service.gang_lookup`: cached, with the webhook's
    short timeouts), when Tally reads one; else nowhere (None)."""
    lookup = service.gang_lookup()
    return (
        kube_owners.WorkloadOwnerReader(lookup)
        if isinstance(lookup, kube_owners.GangReader)
        else None
    )


def respond(request: dict[str, Any]) -> dict[str, Any]:
    """The AdmissionReview answering `request` (as `parse_review` gives it): always an
    admission, with the patch that records the creator. Never raises."""
    uid = request["uid"]
    try:
        attribution = workloads.attribute(
            request=request,
            kinds=frozenset(settings.TALLY_WORKLOAD_KINDS),
            controllers=settings.TALLY_WORKLOAD_CONTROLLERS,
            owners=owner_lookup(),
        )
    except Exception:
        log.exception("admission %s: could not record the workload's creator", uid)
        metrics.WEBHOOK_DECISIONS.labels(WEBHOOK, "error", "").inc()
        return answer(uid, allowed=True, warnings=[FAILED])
    if attribution.result == workloads.REPLACED:
        # Someone named another creator than themselves: worth finding in the logs.
        user_info = request.get("userInfo")
        log.warning(
            "admission %s: %s %s/%s by %s: the creator it named was replaced (%s)",
            uid,
            workloads.kind_key(request.get("kind")),
            request.get("namespace"),
            request.get("name"),
            user_info.get("username") if isinstance(user_info, dict) else None,
            "; ".join(attribution.warnings),
        )
    metrics.WEBHOOK_DECISIONS.labels(WEBHOOK, attribution.result, "").inc()
    return answer(uid, allowed=True, warnings=attribution.warnings, patch=attribution.patch)


@csrf_exempt
@require_POST
def mutate(request: HttpRequest) -> HttpResponse:
    """`POST /admission/workloads/mutate`: write `tally.dev/created-by` on a workload."""
    with metrics.WEBHOOK_LATENCY.labels(WEBHOOK).time():
        try:
            # Parsed already by the request-id middleware, unless it could not be.
            review = (
                parse_review(request.body, getattr(request, PARSED_REVIEW))
                if hasattr(request, PARSED_REVIEW)
                else parse_review(request.body)
            )
        except BadReview as exc:
            return HttpResponse(
                f"bad AdmissionReview: {exc}\n", status=400, content_type="text/plain"
            )
        return HttpResponse(orjson.dumps(respond(review)), content_type="application/json")
