"""The REST API under /api/: v1 for finance, the OpenAPI schema and its browsable docs."""

from django.urls import URLPattern, URLResolver

urlpatterns: list[URLPattern | URLResolver] = []
