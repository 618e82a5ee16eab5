"""Single sign-on through a real OpenID Provider (tests/oidc/provider.py: node-oidc-provider).

A real HTTP client (requests, with its own cookies per host like a browser) walks the whole
flow: Tally's "Sign in with SSO", the provider's login and consent pages, the callback, and the
portal page the user lands on, against Django's live server. The provider's users and their
groups are tests/oidc/users.json; the policy file's `sso.groups` maps them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from html import unescape
from typing import Any
from urllib.parse import parse_qs, urlencode, urljoin, urlsplit

import pytest
import requests
from axes.models import AccessAttempt
from django.contrib.auth.models import User
from pytest_django.fixtures import SettingsWrapper
from pytest_django.live_server_helper import LiveServer

from frontend.sso_views import FOREIGN_STATE, REFUSED
from quota.policy import apply_policy, load_policy
from teams import oidc
from teams.models import Membership, Role, Team
from teams.selectors import FINANCE_GROUP
from tests.oidc.provider import Provider, running_provider

pytestmark = pytest.mark.django_db(transaction=True)

POLICY = """
teams:
- slug: vision
  name: Vision
  namespaces: [vision]
- slug: speech
  name: Speech
  namespaces: [speech]
sso:
  groups:
  - {group: ml-vision-leads, team: vision, role: lead}
  - {group: ml-speech-leads, team: speech, role: lead}
  - {group: finops, role: finance}
"""


@pytest.fixture(scope="session")
def provider(live_server: LiveServer) -> Iterator[Provider]:
    with running_provider(
        redirect_uri=f"{live_server.url}/oidc/callback/", logout_uri=f"{live_server.url}/login/"
    ) as running:
        yield running


@pytest.fixture
def sso(provider: Provider, settings: SettingsWrapper) -> Provider:
    settings.TALLY_OIDC_ISSUER = provider.issuer
    settings.OIDC_RP_CLIENT_ID = provider.client_id
    settings.OIDC_RP_CLIENT_SECRET = provider.client_secret
    settings.AUTHENTICATION_BACKENDS = [*settings.AUTHENTICATION_BACKENDS, "teams.oidc.OidcBackend"]
    oidc._metadata.clear()
    apply_policy(policy=load_policy(POLICY), prune=False, actor="test")
    return provider


def submit(browser: requests.Session, page: requests.Response, **fields: str) -> requests.Response:
    """Post the page's form (the provider's login or consent form) as a browser would."""
    match = re.search(r'<form[^>]*action="([^"]+)"[^>]*method="post"', page.text)
    assert match, page.text
    hidden = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)"', page.text))
    return browser.post(urljoin(page.url, unescape(match.group(1))), data={**hidden, **fields})


def sign_in(live_server: LiveServer, login: str, *, callback: Any = None) -> requests.Response:
    """From Tally's login page through the provider's login and consent, back to Tally.

    `callback`, when given, rewrites the callback URL the provider sends the browser to."""
    browser = requests.Session()
    login_page = browser.get(f"{live_server.url}/login/")
    assert "Sign in with SSO" in login_page.text
    provider_login = browser.get(f"{live_server.url}/oidc/authenticate/")
    assert 'name="login"' in provider_login.text, provider_login.text
    consent = submit(browser, provider_login, login=login, password="any")
    if callback is None:
        response = submit(browser, consent)
    else:
        answer = browser.post(
            urljoin(consent.url, _form_action(consent)),
            data={"prompt": "consent"},
            allow_redirects=False,
        )
        # Follow the provider's redirects up to (not into) Tally's callback.
        while not answer.headers["Location"].startswith(live_server.url):
            answer = browser.get(
                urljoin(answer.url, answer.headers["Location"]), allow_redirects=False
            )
        response = browser.get(callback(answer.headers["Location"]))
    response.session = browser  # type: ignore[attr-defined]
    return response


def _form_action(page: requests.Response) -> str:
    match = re.search(r'<form[^>]*action="([^"]+)"', page.text)
    assert match, page.text
    return unescape(match.group(1))


def test_a_lead_signs_in_and_lands_on_the_team_page_with_the_role_of_the_groups_claim(
    live_server: LiveServer, sso: Provider
) -> None:
    landed = sign_in(live_server, "vision-lead")
    assert landed.status_code == 200
    assert urlsplit(landed.url).path == "/teams/vision/"
    user = User.objects.get(username="vision-lead")  # created at the first sign-in
    assert user.email == "vision-lead@example.com"
    assert not user.has_usable_password()
    roles = {m.team.slug: (m.role, m.granted_by_sso) for m in Membership.objects.filter(user=user)}
    assert roles == {"vision": (Role.LEAD, True)}
    # Again: the same user, nothing more.
    again = sign_in(live_server, "vision-lead")
    assert urlsplit(again.url).path == "/teams/vision/"
    assert User.objects.filter(username="vision-lead").count() == 1


def test_a_role_the_groups_no_longer_give_is_taken_at_the_next_sign_in(
    live_server: LiveServer, sso: Provider
) -> None:
    # An earlier sign-in made `stranger` speech's lead; the provider now puts them in no group
    # the mapping names.
    stranger = User.objects.create_user("stranger")
    speech = Team.objects.get(slug="speech")
    Membership.objects.create(team=speech, user=stranger, role=Role.LEAD, granted_by_sso=True)
    landed = sign_in(live_server, "stranger")
    # A user whose groups map to no team: a page that says so, not a 500.
    assert landed.status_code == 403
    assert "No team to show" in landed.text
    assert "sso.groups" in landed.text
    assert not Membership.objects.filter(user=stranger).exists()


def test_finance_comes_from_the_groups_claim(live_server: LiveServer, sso: Provider) -> None:
    landed = sign_in(live_server, "finops")
    assert landed.status_code == 200
    assert urlsplit(landed.url).path == "/"
    assert User.objects.get(username="finops").groups.filter(name=FINANCE_GROUP).exists()
    assert "vision" in landed.text and "speech" in landed.text


def test_a_tampered_state_is_refused(live_server: LiveServer, sso: Provider) -> None:
    def tamper(url: str) -> str:
        parts = urlsplit(url)
        query = {key: values[0] for key, values in parse_qs(parts.query).items()}
        query["state"] = query["state"][:-1] + ("A" if query["state"][-1] != "A" else "B")
        return f"{parts.scheme}://{parts.netloc}{parts.path}?{urlencode(query)}"

    refused = sign_in(live_server, "vision-lead", callback=tamper)
    assert refused.status_code == 400
    assert unescape(refused.text).count(FOREIGN_STATE) == 1
    assert not User.objects.filter(username="vision-lead").exists()


def test_a_state_from_another_browser_is_refused(live_server: LiveServer, sso: Provider) -> None:
    stolen: list[str] = []

    def keep(url: str) -> str:
        stolen.append(url)
        return f"{live_server.url}/login/"

    sign_in(live_server, "vision-lead", callback=keep)
    # Another browser (no sign-in started there) presents the genuine code and state.
    refused = requests.get(stolen[0])
    assert refused.status_code == 400
    assert FOREIGN_STATE in unescape(refused.text)
    assert not User.objects.filter(username="vision-lead").exists()


def test_a_username_tally_cannot_use_is_refused_with_a_page(
    live_server: LiveServer, sso: Provider
) -> None:
    refused = sign_in(live_server, "bad-name")
    assert refused.status_code == 403
    assert REFUSED in unescape(refused.text)
    assert not User.objects.filter(username="no spaces allowed").exists()
    # Counted as a failed login from the address (no username), without the code and state.
    (attempt,) = AccessAttempt.objects.all()
    assert attempt.username is None and attempt.path_info == "/oidc/callback/"
    assert "code=********************" in attempt.get_data
    assert "state=********************" in attempt.get_data


def test_logout_ends_the_provider_session_too(live_server: LiveServer, sso: Provider) -> None:
    landed = sign_in(live_server, "vision-lead")
    browser: requests.Session = landed.session  # type: ignore[attr-defined]
    page = browser.get(f"{live_server.url}/logout/")  # its button posts the form
    csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)
    assert csrf, page.text
    out = browser.post(
        f"{live_server.url}/logout/",
        data={"csrfmiddlewaretoken": csrf.group(1)},
        headers={"Referer": f"{live_server.url}/"},
        allow_redirects=False,
    )
    assert out.status_code == 302
    assert out.headers["Location"].startswith(f"{sso.issuer}/session/end?")
    assert "id_token_hint=" in out.headers["Location"]
    assert browser.get(f"{live_server.url}/", allow_redirects=False).status_code == 302


def test_without_an_issuer_there_is_no_sso(client: Any, settings: SettingsWrapper) -> None:
    settings.TALLY_OIDC_ISSUER = ""
    assert client.get("/oidc/authenticate/").status_code == 404
    assert client.get("/oidc/callback/?code=x&state=y").status_code == 404
    assert "Sign in with SSO" not in client.get("/login/").content.decode()


def test_an_unreachable_provider_is_a_page_not_a_500(
    client: Any, settings: SettingsWrapper
) -> None:
    with running_provider(redirect_uri="http://x/", logout_uri="http://x/") as gone:
        issuer = gone.issuer
    oidc._metadata.clear()
    settings.TALLY_OIDC_ISSUER = issuer
    settings.OIDC_RP_CLIENT_ID = "tally"
    settings.OIDC_TIMEOUT = 2
    response = client.get("/oidc/authenticate/")
    assert response.status_code == 502
    assert "cannot be reached" in response.content.decode()
