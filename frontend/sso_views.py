"""The single sign-on pages: mozilla-django-oidc's views, with the provider's endpoints from
`teams.oidc` and every failure a page that says what went wrong (never a 500): a provider that
cannot be reached, a state this browser did not start (tampered, replayed or foreign), a
sign-in the provider or Tally refused. Answer 404 while single sign-on is not configured."""

from __future__ import annotations

import logging
from typing import Any

import requests
from django.core.exceptions import SuspiciousOperation
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.generic import View
from mozilla_django_oidc.views import OIDCAuthenticationCallbackView, OIDCAuthenticationRequestView

from teams import oidc

log = logging.getLogger(__name__)

UNAVAILABLE = "The identity provider cannot be reached just now: try again in a minute."
FOREIGN_STATE = (
    "This answer from the identity provider belongs to no sign-in this browser started (it "
    "was changed, used already, or started elsewhere). Start again from the login page."
)
REFUSED = (
    "The identity provider did not confirm who you are, or gave no username Tally can use. "
    "Start again from the login page; if it fails again, ask your platform operators."
)


def sign_in_failed(request: HttpRequest, reason: str, *, status: int) -> HttpResponse:
    return render(request, "registration/sso_failed.html", {"reason": reason}, status=status)


class SignInView(OIDCAuthenticationRequestView):
    """Starts a sign-in: to the provider's authorization endpoint."""

    def __init__(self, **kwargs: Any) -> None:
        View.__init__(self, **kwargs)  # the parent reads the endpoint here: at the sign-in instead
        self.OIDC_RP_CLIENT_ID = self.get_settings("OIDC_RP_CLIENT_ID")

    @property
    def OIDC_OP_AUTH_ENDPOINT(self) -> str:  # the library's attribute name
        return oidc.endpoint("authorization_endpoint")

    def get(self, request: HttpRequest) -> HttpResponse:
        if not oidc.is_enabled():
            raise Http404("single sign-on is not configured")
        try:
            response: HttpResponse = super().get(request)
        except oidc.ProviderUnavailable as exc:
            log.warning("sso: %s", exc)
            return sign_in_failed(request, UNAVAILABLE, status=502)
        return response


class CallbackView(OIDCAuthenticationCallbackView):
    """The provider's answer: the user signed in and sent home, or a page saying why not."""

    def get(self, request: HttpRequest) -> HttpResponse:
        if not oidc.is_enabled():
            raise Http404("single sign-on is not configured")
        try:
            response: HttpResponse = super().get(request)
        except SuspiciousOperation as exc:
            log.warning("sso: callback refused: %s", exc)
            return sign_in_failed(request, FOREIGN_STATE, status=400)
        except oidc.ProviderUnavailable as exc:
            log.warning("sso: %s", exc)
            return sign_in_failed(request, UNAVAILABLE, status=502)
        except requests.HTTPError as exc:
            # The token endpoint refused the code (expired, replayed, another client's).
            log.warning("sso: the provider refused the code: %s", exc)
            return sign_in_failed(request, REFUSED, status=403)
        except requests.RequestException as exc:
            log.warning("sso: the provider cannot be reached: %s", exc)
            return sign_in_failed(request, UNAVAILABLE, status=502)
        return response

    def login_failure(self) -> HttpResponse:
        error = self.request.GET.get("error")
        if error:
            log.info(
                "sso: the provider answered %s: %s",
                error,
                self.request.GET.get("error_description", ""),
            )
            if error == "access_denied":
                return sign_in_failed(
                    self.request, "You declined the sign-in at the identity provider.", status=403
                )
        if "oidc_states" not in self.request.session:
            return sign_in_failed(self.request, FOREIGN_STATE, status=400)
        return sign_in_failed(self.request, REFUSED, status=403)
