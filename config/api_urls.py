"""The REST API under /api/: v1 for finance, the OpenAPI schema and its browsable docs."""

from django.urls import URLPattern, URLResolver, include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView
from rest_framework.routers import DefaultRouter

from billing.api import views as billing
from inventory.api import views as inventory
from quota.api import views as quota

router = DefaultRouter()
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
router.register("inventory/capacity", inventory.CapacityViewSet, basename="inventory-capacity")

urlpatterns: list[URLPattern | URLResolver] = [
    path("v1/inventory/summary/", inventory.FleetSummaryView.as_view(), name="inventory-summary"),
    path("v1/", include(router.urls)),
    path("schema/", SpectacularAPIView.as_view(), name="api-schema"),
    path("docs/", SpectacularRedocView.as_view(url_name="api-schema"), name="api-docs"),
]
