"""The portal's pages: thin views over `frontend.selectors` and the inventory's reports.

Every page needs a login. As in the API, a user with no role gets 403 everywhere, a team that
`visible_teams` does not show (or that does not exist) is 404, so its existence is not
revealed, and fleet pages are 403 to non-operators. The portal renders its own 404.html and
403.html for these answers (Django shows its debug pages instead of raised 404s when DEBUG is
on).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from functools import wraps
from typing import Any, Protocol
from urllib.parse import urlencode

from django import forms
from django.conf import settings
from django.contrib import messages
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.templatetags.static import static
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST

from billing.idle import below_percent_of, idle_policy_of
from billing.statement_csv import statement_csv_filename, write_statement_csv
from billing.stranded import priced_stranded_gangs
from billing.windows import Window, WindowError, parse_window
from frontend import clusters, selectors
from inventory import checks
from inventory import selectors as fleet
from inventory.models import Cluster
from inventory.profiles import unit_label
from metering.hours import HOUR, hour_start
from quota import pending
from quota.selectors import (
    NO_TEAM,
    OUTCOMES,
    DecisionFilter,
    decision_clusters,
    filter_decisions,
    team_objections,
    visible_decisions,
    with_people,
)
from teams import oidc
from teams.alerts import may_snooze, may_snooze_team, snooze_alert
from teams.api import API_PREFIX, write_csv
from teams.models import Alert, Team

USAGE_WINDOWS = (7, 30)
# The longest waiting pending claims a page lists (the API lists them all).
PENDING_CLAIMS_SHOWN = 25
DECISIONS_PER_PAGE = 50
# The team page lists this many of the team's most recent denials and warnings.
TEAM_OBJECTIONS = 10
# Rows of a per-person or per-job CSV the team page links to (the API's largest page).
BILLING_CSV_ROWS = 1000
# The snoozes the team page offers (the API takes any number of hours up to a week); 0 lifts one.
SNOOZE_CHOICES = ((4, "4 hours"), (24, "a day"), (168, "a week"))


class _View(Protocol):
    def __call__(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse: ...


class _TeamView(Protocol):
    def __call__(
        self, request: HttpRequest, team: Team, *args: Any, **kwargs: Any
    ) -> HttpResponse: ...


def not_found(request: HttpRequest) -> HttpResponse:
    """The portal's 404 page, whatever DEBUG says."""
    return render(request, "404.html", status=404)


def forbidden(request: HttpRequest, reason: str) -> HttpResponse:
    """The portal's 403 page with `reason`, whatever DEBUG says."""
    return render(request, "403.html", {"exception": reason}, status=403)


# The reason a CSRF failure gives, whatever Django's own reason was (it is logged).
CSRF_REASON = "Your session's form token is missing or expired: reload the page and try again."


def csrf_failure(request: HttpRequest, reason: str = "") -> HttpResponse:
    """`CSRF_FAILURE_VIEW`: JSON under /api/, the portal's 403 page elsewhere."""
    if request.path.startswith(API_PREFIX):
        return JsonResponse({"detail": f"CSRF check failed: {CSRF_REASON}"}, status=403)
    return forbidden(request, CSRF_REASON)


class LoginView(auth_views.LoginView):
    """Django's password login, offering "Sign in with SSO" when single sign-on is configured."""

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context: dict[str, Any] = super().get_context_data(**kwargs)
        context["sso_enabled"] = oidc.is_enabled()
        return context


class LogoutView(auth_views.LogoutView):
    """Django's (a POST logs out), with a page on GET whose button posts: a typed or followed
    /logout/ link gets a form, not an empty 405. Not logged in: to the login page. A single
    sign-on user is then sent to the identity provider to end its session too."""

    http_method_names = ["get", "post", "options"]

    def get(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if not request.user.is_authenticated:
            return redirect("login")
        return render(request, "registration/logout.html")

    def post(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        provider_logout = oidc.provider_logout_url(request)  # before the session is gone
        response: HttpResponse = super().post(request, *args, **kwargs)
        return redirect(provider_logout) if provider_logout else response


def operator_required(view: _View) -> _View:
    """Login first (anonymous users go to the login page), then operators only (403)."""

    @wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if not selectors.is_operator(request.user):
            return forbidden(request, "Only operators can see the fleet.")
        return view(request, *args, **kwargs)

    return login_required(wrapper)


def team_required(view: _TeamView) -> _View:
    """Login first, then the team of the URL's `slug` passed as `team`: 403 to a user with no
    role, 404 when the user may not see the team or there is none."""

    @wraps(view)
    def wrapper(request: HttpRequest, slug: str, *args: Any, **kwargs: Any) -> HttpResponse:
        if selectors.portal_role(request.user) is None:
            return forbidden(request, "You lead no team, so there is no team page to show.")
        team = selectors.visible_team(user=request.user, slug=slug)
        if team is None:
            return not_found(request)
        return view(request, team, *args, **kwargs)

    return login_required(wrapper)


@login_required
def home(request: HttpRequest) -> HttpResponse:
    role = selectors.portal_role(request.user)
    teams = selectors.team_list(user=request.user)
    if role is None:
        return render(request, "frontend/no_team.html", status=403)
    if role == "lead" and len(teams) == 1:
        return redirect("team", slug=teams[0].slug)
    return render(request, "frontend/home.html", {"teams": teams, "role": role})


@team_required
def team(request: HttpRequest, team: Team) -> HttpResponse:
    scope = clusters.cluster_scope(request)
    if scope.error:
        return clusters.bad_request(request, scope.error)
    days = 30 if request.GET.get("days") == "30" else 7
    now = timezone.now()
    since, until = selectors.usage_window(now=now, days=days)
    claims, claims_total = selectors.live_claims(team=team, cluster=scope.chosen)
    usage_units = selectors.daily_usage_by_unit(team=team, since=since, until=until)
    # The chart draws the first unit (GPUs when the team used any); tables show every unit.
    usage = usage_units[0]
    burn = selectors.budget_burn(team=team, now=now)
    idle_below = below_percent_of(team)
    # Whole hours, as the API's CSV takes them: the hour under way is in both.
    billing = selectors.team_billing(team=team, since=since, until=hour_start(now) + HOUR)
    alerts, alerts_total = selectors.firing_alerts(team=team)
    objections, objections_total = team_objections(
        team=team,
        limit=TEAM_OBJECTIONS,
        cluster=scope.chosen.name if scope.chosen is not None else None,
    )
    chart_data: dict[str, Any] = {
        "usage": {
            "labels": [day.day.isoformat() for day in usage.days],
            "allocated": [float(day.allocated) for day in usage.days],
            "utilised": [float(day.utilised) for day in usage.days],
        },
    }
    if burn is not None:
        chart_data["burn"] = {
            "labels": [day.day.isoformat() for day in burn.days],
            "remaining": [None if d.remaining is None else float(d.remaining) for d in burn.days],
            "ideal": [float(day.ideal) for day in burn.days],
        }
    context = {
        "team": team,
        "days": days,
        "windows": USAGE_WINDOWS,
        "since": since,
        "rules": selectors.quota_usage(team=team),
        "burn": burn,
        "usage": usage.days,
        "usage_unit": usage,
        "usage_units": usage_units,
        "idle": selectors.idle_cost(team=team, since=since, until=until, cards=billing.cards),
        "billing": billing,
        "billing_csv": _billing_csv_links(team=team, since=since, until=billing.until),
        "idle_now": selectors.idle_now(team=team, now=now, below_percent=idle_below),
        "idle_below_percent": idle_below,
        "idle_rule": idle_policy_of(team),
        "idle_default_on": bool(settings.TALLY_IDLE_ALERT_DEFAULT_FOR_HOURS),
        "wasters": selectors.top_wasters(team=team, since=since, until=until),
        "claims": claims,
        "claims_total": claims_total,
        "statements": selectors.team_statements(team=team),
        "alerts": alerts,
        "alerts_total": alerts_total,
        "objections": objections,
        "objections_total": objections_total,
        "decision_retention_days": settings.TALLY_DECISION_RETENTION_DAYS,
        "may_snooze": bool(alerts) and may_snooze_team(user=request.user, team_id=team.pk),
        "snooze_choices": SNOOZE_CHOICES,
        "now": now,
        "chart_data": chart_data,
        **_queue_context(request, now=now, team=team, cluster=scope.chosen),
        **clusters.context(request, scope),
    }
    return render(request, "frontend/team.html", context)


@require_POST
@team_required
def snooze(request: HttpRequest, team: Team, alert_id: int) -> HttpResponse:
    """Snooze one of the team's alerts for one of `SNOOZE_CHOICES` (`0` lifts it): the team
    page's buttons, as `POST /api/v1/alerts/{id}/snooze/`. Back to the team page, saying what
    was done or what was wrong with the request."""
    alert = Alert.objects.filter(pk=alert_id, team=team).first()
    if alert is None:
        return not_found(request)
    if not may_snooze(user=request.user, alert=alert):
        return forbidden(request, "Only the team's leads and operators may snooze its alerts.")
    given = request.POST.get("hours", "")
    offered = {str(hours): hours for hours, _ in ((0, ""), *SNOOZE_CHOICES)}
    back = reverse("team", args=[team.slug]) + "#alerts-heading"
    if given not in offered:
        choices = ", ".join(str(hours) for hours, _ in SNOOZE_CHOICES)
        messages.error(request, f"hours: must be 0 (lift) or one of {choices}, not {given[:20]!r}")
        return redirect(back)
    hours = offered[given]
    until = timezone.now() + timedelta(hours=hours) if hours else None
    snooze_alert(alert=alert, until=until, actor=request.user.get_username())
    if until is None:
        messages.success(request, f"Lifted the snooze of “{alert.subject}”.")
    else:
        messages.success(request, f"Snoozed “{alert.subject}” until {until:%Y-%m-%d %H:%M} UTC.")
    return redirect(back)


def _billing_csv_links(*, team: Team, since: datetime, until: datetime) -> dict[str, str]:
    """The API's CSV of the page's per-person and per-job tables (the same window)."""
    query = urlencode(
        {
            "team": team.slug,
            "start": since.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "end": until.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "format": "csv",
            "page_size": BILLING_CSV_ROWS,
        }
    )
    return {
        "people": f"{reverse('billed-people-list')}?{query}",
        "jobs": f"{reverse('billed-jobs-list')}?{query}",
    }


@team_required
def statement_csv(request: HttpRequest, team: Team, period_id: int) -> HttpResponse:
    """The team's statements of a period as CSV: the API's statement CSV, by the same writer
    (`billing.statement_csv`), one row per line of each currency's statement."""
    found = selectors.statement_csv_lines(team=team, period_id=period_id)
    if found is None:
        return not_found(request)
    period, lines = found
    name = statement_csv_filename(team_slug=team.slug, period_label=period.label)
    response = HttpResponse(content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{name}"'
    write_statement_csv(response, lines)
    return response


def csv_attachment(
    filename: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]
) -> HttpResponse:
    """A CSV download of `rows` under `columns` (`teams.api.write_csv`: formulas neutralised)."""
    response = HttpResponse(content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    write_csv(response, columns=columns, rows=rows)
    return response


def _queue_context(
    request: HttpRequest, *, now: datetime, cluster: Cluster | None = None, team: Team | None = None
) -> dict[str, Any]:
    """Pending demand and stranded gangs (issue 20), for the fleet page (every team: the team
    column shown) or one team's page."""
    claims = pending.pending_claims(user=request.user, now=now, cluster=cluster, team=team)
    return {
        "pending_demand": clusters.demand_by_cluster(claims),
        "pending_claims": claims[:PENDING_CLAIMS_SHOWN],
        "pending_total": len(claims),
        "stranded": priced_stranded_gangs(user=request.user, now=now, cluster=cluster, team=team),
        "stranded_minutes": settings.TALLY_STRANDED_GANG_MINUTES,
        "show_team": team is None,
    }


@operator_required
def fleet_overview(request: HttpRequest) -> HttpResponse:
    scope = clusters.cluster_scope(request)
    if scope.error:
        return clusters.bad_request(request, scope.error)
    cluster = scope.chosen or selectors.fleet_scope()
    versions = fleet.version_matrix(cluster=cluster)
    outliers = set(versions["outlier_nodes"])
    spread = fleet.fragmentation(cluster=cluster)
    nodes = [{**node, "outlier": node["node"] in outliers} for node in spread["nodes"]]
    context = {
        "versions": versions,
        # Read back from the cluster: what is applied, not what was meant to be.
        "taints": fleet.version_taint_state(cluster=cluster),
        "own_cluster": settings.TALLY_CLUSTER_NAME,
        "spread": spread,
        "nodes": nodes,
        "partial_free": [
            (share, unit_label(unit)) for unit, share in spread["partial_free_by_unit"].items()
        ],
        "capacity": clusters.capacity(cluster=cluster, multi=scope.multi),
        "sync_warnings": checks.sync_warnings(cluster=cluster),
        "show_cluster": cluster is None,
        **_queue_context(request, now=timezone.now(), cluster=cluster),
        **clusters.context(request, scope),
    }
    return render(request, "frontend/fleet.html", context)


@operator_required
def deviations(request: HttpRequest) -> HttpResponse:
    """The deviation register: every documented deviation, soonest to expire first, with the
    state of its taint as the cluster holds it."""
    cluster = selectors.fleet_scope()
    context = {
        "deviations": fleet.deviation_register(cluster=cluster),
        "show_cluster": cluster is None,
        "now": timezone.now(),
    }
    return render(request, "frontend/deviations.html", context)


@operator_required
def decisions(request: HttpRequest) -> HttpResponse:
    """The decision log, newest first, filtered by team, outcome, time and (once there is more
    than one) cluster, 50 a page; a filter that does not parse is said so and filters
    nothing."""
    form = DecisionFilterForm(request.GET)
    by = form.cleaned() if form.is_valid() else DecisionFilter()
    chosen = filter_decisions(visible_decisions(user=request.user), by=by)
    page = Paginator(chosen, DECISIONS_PER_PAGE).get_page(request.GET.get("page"))
    with_people(page.object_list)
    query = request.GET.copy()
    query.pop("page", None)
    context = {
        "page": page,
        "form": form,
        "filters": query.urlencode(),
        "show_cluster": "cluster" in form.fields,
    }
    return render(request, "frontend/decisions.html", context)


class DecisionFilterForm(forms.Form):
    """The decision log's filters, as `GET` parameters: team slug (`-`: no team), outcome,
    cluster (only once there is more than one), and a window `[start, end)` in UTC read by
    the API's parser (`billing.windows`), so the page and `/api/v1/decisions/` take the same
    window and refuse the same ones."""

    team = forms.ChoiceField(required=False)
    outcome = forms.ChoiceField(
        required=False,
        choices=[("", "any"), *((outcome, outcome) for outcome in OUTCOMES)],
    )
    start = forms.CharField(
        required=False,
        label="Start (UTC)",
        widget=forms.DateInput(attrs={"type": "date"}),
    )
    end = forms.CharField(
        required=False,
        label="End (UTC, exclusive)",
        widget=forms.DateInput(attrs={"type": "date"}),
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        teams = Team.objects.order_by("slug").values_list("slug", flat=True)
        team = self.fields["team"]
        assert isinstance(team, forms.ChoiceField)
        team.choices = [
            ("", "any"),
            *((slug, slug) for slug in teams),
            (NO_TEAM, "no team"),
        ]
        clusters = decision_clusters()
        if len(clusters) > 1:
            self.fields["cluster"] = forms.ChoiceField(
                required=False, choices=[("", "any"), *((name, name) for name in clusters)]
            )

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        try:
            cleaned["window"] = parse_window(cleaned, with_period=False)
        except WindowError as exc:
            for name, reason in exc.errors.items():
                self.add_error(name, reason)
        return cleaned

    def cleaned(self) -> DecisionFilter:
        data = self.cleaned_data
        window: Window = data["window"]
        return DecisionFilter(
            team=data.get("team") or "",
            outcome=data.get("outcome") or "",
            cluster=data.get("cluster") or "",
            start=window.start,
            end=window.end,
        )


@require_GET
def favicon(request: HttpRequest) -> HttpResponse:
    """`/favicon.ico`, which browsers ask of every page without an icon link (the admin's, the
    API's): the portal's icon, by its static (hashed, cached) URL. Public: it says nothing."""
    return redirect(static("frontend/favicon.ico"))
