"""The REST API under /api/: v1 for finance, the OpenAPI schema and its browsable docs.

Every path under /api/ answers JSON: an unknown one is a JSON 404 (`teams.api.unknown_endpoint`,
last here), the views' errors go through `teams.api.exception_handler`, and a crash through
`config.urls.handler500`. The schema and the docs page need a login unless
TALLY_API_DOCS_PUBLIC; the docs page is served from this deployment's static files only.
"""

from typing import Any, ClassVar

from django.conf import settings
from django.contrib.auth.views import redirect_to_login
from django.http import HttpResponseBase
from django.urls import URLPattern, URLResolver, include, path, re_path
from drf_spectacular.utils import extend_schema
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView
from rest_framework import routers
from rest_framework.permissions import AllowAny, BasePermission
from rest_framework.request import Request
from rest_framework.routers import DefaultRouter
from rest_framework.views import APIView

from billing.api import compare, focus
from billing.api import views as billing
from inventory.api import views as inventory
from quota.api import demand, stranded
from quota.api import views as quota
from teams import alerts_api
from teams.api import StrictQueryParameters, unknown_endpoint


class APIRootView(StrictQueryParameters, routers.APIRootView):
    """The API root, which takes no query parameter but `format` (`StrictQueryParameters`)."""

    filter_backends: ClassVar[list[Any]] = []


class Router(DefaultRouter):
    """DefaultRouter whose API root also lists `plain`: endpoints that are no viewset, by
    their prefix under v1 and their URL name."""

    plain: ClassVar[dict[str, str]] = {
        "inventory/summary": "inventory-summary",
        "compare": "api-compare",
    }
    APIRootView = APIRootView

    def get_api_root_view(self, api_urls: Any = None) -> Any:
        listed = {
            prefix: self.routes[0].name.format(basename=basename)
            for prefix, _viewset, basename in self.registry
        }
        return self.APIRootView.as_view(api_root_dict={**listed, **self.plain})


router = Router()
router.register("teams", quota.TeamViewSet, basename="team")
router.register("quotas", quota.QuotaRuleViewSet, basename="quota")
router.register("decisions", quota.AdmissionDecisionViewSet, basename="decision")
router.register("rate-cards", billing.RateCardViewSet, basename="rate-card")
router.register("periods", billing.PeriodViewSet, basename="period")
router.register("statements", billing.StatementViewSet, basename="statement")
router.register("statement-lines", billing.StatementLineViewSet, basename="statement-line")
router.register("adjustments", billing.AdjustmentViewSet, basename="adjustment")
router.register("usage/claims", billing.ClaimUsageViewSet, basename="usage-claims")
router.register("usage/jobs", billing.JobUsageViewSet, basename="usage-jobs")
router.register("usage/users", billing.UserUsageViewSet, basename="usage-users")
router.register("usage", billing.UsageViewSet, basename="usage")
# Per person and per job, with what the statements bill for them (issue 19, item 2).
router.register("billed/people", billing.BilledUsageViewSet, basename="billed-people")
router.register("billed/jobs", billing.BilledJobViewSet, basename="billed-jobs")
router.register("billed/unowned", billing.UnownedUsageViewSet, basename="billed-unowned")
# What the statements bill as a FOCUS 1.2 dataset, for finance's cost tools (issue 39).
router.register("billed/focus", focus.FocusViewSet, basename="billed-focus")
router.register("inventory/capacity", inventory.CapacityViewSet, basename="inventory-capacity")
router.register("inventory/deviations", inventory.DeviationViewSet, basename="inventory-deviations")
router.register("pending/claims", demand.PendingClaimViewSet, basename="pending-claims")
router.register("pending", demand.PendingDemandViewSet, basename="pending")
router.register("gangs/stranded", stranded.StrandedGangViewSet, basename="stranded-gangs")
# Idle-claim, stranded-gang and version-outlier alerts; leads snooze their team's.
router.register("alerts", alerts_api.AlertViewSet, basename="alert")


def docs_readable(request: Request) -> bool:
    """Logged-in users (session or token); anyone when TALLY_API_DOCS_PUBLIC is true."""
    return settings.TALLY_API_DOCS_PUBLIC or bool(request.user.is_authenticated)


class DocsAccess(BasePermission):
    def has_permission(self, request: Request, view: APIView) -> bool:
        return docs_readable(request)


class SchemaView(SpectacularAPIView):
    permission_classes = [DocsAccess]


class DocsView(SpectacularRedocView):
    """Redoc from the sidecar's static files, without the web fonts drf-spectacular's page
    loads from Google and with no image from Redocly's CDN: it works offline. A visitor not
    logged in is sent to the login page."""

    permission_classes = [AllowAny]  # checked in get(), to redirect rather than answer 401
    template_name = "api/redoc.html"

    @extend_schema(exclude=True)
    def get(self, request: Request, *args: Any, **kwargs: Any) -> HttpResponseBase:
        if not docs_readable(request):
            return redirect_to_login(request.get_full_path())
        response: HttpResponseBase = super().get(request, *args, **kwargs)
        # Redoc's bundle draws Redocly's logo from its CDN (an <img> in the sidebar's footer,
        # which no option turns off): the browser is told to fetch no image, font or data
        # from anywhere but here, so nothing leaves this site (the image is then left out).
        response["Content-Security-Policy"] = DOCS_CONTENT_POLICY
        return response


DOCS_CONTENT_POLICY = "img-src 'self' data:; font-src 'self' data:; connect-src 'self'"


urlpatterns: list[URLPattern | URLResolver] = [
    path(  # listed in the API root: Router.plain
        "v1/inventory/summary/", inventory.FleetSummaryView.as_view(), name="inventory-summary"
    ),
    path("v1/compare/", compare.CompareView.as_view(), name="api-compare"),  # Router.plain
    path("v1/", include(router.urls)),
    path("schema/", SchemaView.as_view(), name="api-schema"),
    path("docs/", DocsView.as_view(url_name="api-schema"), name="api-docs"),
    re_path(r"^", unknown_endpoint, name="api-unknown"),  # last: any other path under /api/
]
