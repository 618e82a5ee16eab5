"""The project's URLconf with one endpoint that crashes, under /api/ and outside it: to see
what `config.urls.handler500` answers (test_surface.py)."""

from django.http import HttpRequest, HttpResponse
from django.urls import path
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from config.urls import handler404, handler500
from config.urls import urlpatterns as project_patterns


class Crash(APIView):
    permission_classes = [AllowAny]

    def get(self, request: Request) -> Response:
        raise RuntimeError("a bug")


def crash_page(request: HttpRequest) -> HttpResponse:
    raise RuntimeError("a bug")


urlpatterns = [
    path("api/v1/crash/", Crash.as_view()),
    path("crash/", crash_page),
    *project_patterns,
]

__all__ = ["handler404", "handler500", "urlpatterns"]
