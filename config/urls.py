from django.contrib import admin
from django.urls import include, path

from billing import views as billing_views
from quota import admission

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/", include("config.api_urls")),
    path("", include("config.ops_urls")),
    path("admission/resourceclaims", admission.validate, name="admission-validate"),
    path("admission/resourceclaims/mutate", admission.mutate, name="admission-mutate"),
    path("ingest/samples", billing_views.ingest_samples, name="ingest-samples"),
    path("", include("frontend.urls")),
]
