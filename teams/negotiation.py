"""The API's content negotiation: DRF's, with a clear error for an unknown `?format=`.

Its own module, not `teams.api`: DRF reads this setting while `rest_framework.views` is being
imported, which `teams.api` imports.
"""

from __future__ import annotations

from collections.abc import Iterable

from django.http import Http404
from rest_framework.exceptions import NotAcceptable
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.renderers import BaseRenderer
from rest_framework.request import Request


class ContentNegotiation(DefaultContentNegotiation):
    """DRF's, where a `?format=` the endpoint has no renderer for is a 406 naming the formats
    it has (DRF answers 404, as if the endpoint were missing). The error itself is JSON
    (`exception_handler`)."""

    def select_renderer(
        self, request: Request, renderers: Iterable[BaseRenderer], format_suffix: str | None = None
    ) -> tuple[BaseRenderer, str]:
        renderers = list(renderers)
        try:
            chosen: tuple[BaseRenderer, str] = super().select_renderer(
                request, renderers, format_suffix
            )
        except Http404:
            asked = format_suffix or request.query_params.get(self.settings.URL_FORMAT_OVERRIDE)
            formats = ", ".join(dict.fromkeys(str(renderer.format) for renderer in renderers))
            raise NotAcceptable(
                f"No format {asked!r} at this endpoint: ask for one of {formats}."
            ) from None
        return chosen
