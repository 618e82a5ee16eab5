from django.contrib import admin
from django.http import HttpRequest, HttpResponse
from django.urls import include, path

from quota import admission


def healthz(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok", content_type="text/plain")


urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/", include("config.api_urls")),
    path("healthz", healthz),
    path("admission/resourceclaims", admission.validate, name="admission-validate"),
    path("admission/resourceclaims/mutate", admission.mutate, name="admission-mutate"),
    path("", include("frontend.urls")),
]
