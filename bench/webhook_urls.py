"""The project's URLs plus `POST /admission/noop`, the floor `bench.webhook` measures against.

The no-op endpoint goes through the same gunicorn worker, middleware stack and URL resolver as
the real webhook and reads the body the same way (`json.loads`, once), then answers "allowed"
without touching the database: what is left is the cost of the stack itself.
"""

from __future__ import annotations

import json

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import path
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from config.urls import urlpatterns as project_urlpatterns
from core.logging import PARSED_REVIEW


@csrf_exempt
@require_POST
def noop(request: HttpRequest) -> HttpResponse:
    # As the webhook does: the body the request-id middleware parsed, else parse it here.
    review = getattr(request, PARSED_REVIEW, None) or json.loads(request.body)
    return JsonResponse(
        {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "response": {"uid": review["request"]["uid"], "allowed": True},
        }
    )


urlpatterns = [path("admission/noop", noop, name="admission-noop"), *project_urlpatterns]
