"""Operational endpoints: liveness, readiness and metrics."""

from django.http import HttpRequest, HttpResponse
from django.urls import URLPattern, URLResolver, path


def healthz(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok", content_type="text/plain")


urlpatterns: list[URLPattern | URLResolver] = [path("healthz", healthz, name="healthz")]
