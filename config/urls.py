from django.contrib import admin
from django.urls import include, path

from metering import views as metering_views
from quota import workload_views
from quota.admission import views as admission_views
from teams.login import AdminLoginForm

admin.site.site_header = "Tally administration"
admin.site.site_title = "Tally admin"
admin.site.index_title = "Teams, quotas, inventory and billing"
# A username longer than the user model allows is a form error, not a 500 (teams/login.py).
admin.site.login_form = AdminLoginForm

urlpatterns = [
    # The API server's calls first: every ResourceClaim CREATE resolves these.
    path("admission/resourceclaims", admission_views.validate, name="admission-validate"),
    path("admission/resourceclaims/mutate", admission_views.mutate, name="admission-mutate"),
    # Who created a workload (Pods and what makes them), for claims made from its templates.
    path("admission/workloads/mutate", workload_views.mutate, name="admission-workloads"),
    path("ingest/samples", metering_views.ingest_samples, name="ingest-samples"),
    path("admin/", admin.site.urls),
    path("api/", include("config.api_urls")),
    path("", include("config.ops_urls")),
    path("", include("frontend.urls")),
]

# JSON under /api/, Django's pages elsewhere.
handler404 = "teams.api.not_found"
handler500 = "teams.api.server_error"
