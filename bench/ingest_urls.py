"""The project's URLs plus `POST /ingest/floor`, the floor `bench.ingest_http` measures against.

Served only by `bench.ingest_settings` (never by `config.urls`): the floor authenticates the
agent's token, reads and parses the batch and checks its shape exactly as `/ingest/samples`
does (`metering.views.read_batch`, the same code), under the same listener (`/ingest/`), then
answers without validating or storing a sample: what is left is the cost of the stack, the
token lookup and the JSON.
"""

from __future__ import annotations

from django.http import HttpRequest, JsonResponse
from django.urls import path
from django.views.decorators.csrf import csrf_exempt

from config.urls import urlpatterns as project_urlpatterns
from metering.views import read_batch

FLOOR_PATH = "/ingest/floor"


@csrf_exempt
def floor(request: HttpRequest) -> JsonResponse:
    if request.method != "POST":
        return JsonResponse({"error": "use POST"}, status=405, headers={"Allow": "POST"})
    batch = read_batch(request)
    if isinstance(batch, JsonResponse):
        return batch
    # The answer's shape of a batch stored whole, none of it counted: nothing was stored.
    return JsonResponse({"accepted": 0, "duplicates": 0, "rejected": [], "unknown_devices": []})


urlpatterns = [path(FLOOR_PATH.lstrip("/"), floor, name="ingest-floor"), *project_urlpatterns]
