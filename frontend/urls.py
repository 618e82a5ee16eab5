"""The portal's pages (see frontend/views.py)."""

from django.urls import URLPattern, URLResolver, path

from frontend import compare, finance, homes, sso_views, views
from frontend import week as week_views
from teams.login import LoginForm

urlpatterns: list[URLPattern | URLResolver] = [
    path(
        "login/",
        views.LoginView.as_view(authentication_form=LoginForm, redirect_authenticated_user=True),
        name="login",
    ),
    # Single sign-on (frontend/sso_views.py; 404 unless TALLY_OIDC_ISSUER is set). The names
    # are mozilla-django-oidc's: it reverses the callback's to build the redirect URI.
    path("oidc/authenticate/", sso_views.SignInView.as_view(), name="oidc_authentication_init"),
    path("oidc/callback/", sso_views.CallbackView.as_view(), name="oidc_authentication_callback"),
    path("logout/", views.LogoutView.as_view(), name="logout"),
    path("", homes.home, name="home"),
    # Finance's close of a billing period, and its spend trend (issue 35, finding 7).
    path("periods/<int:period_id>/close/", finance.close, name="period-close"),
    path("periods/trend.csv", finance.trend_csv, name="period-trend-csv"),
    path("favicon.ico", views.favicon, name="favicon"),
    path("teams/<slug:slug>/", views.team, name="team"),
    path(
        "teams/<slug:slug>/statements/<int:period_id>.csv",
        views.statement_csv,
        name="statement-csv",
    ),
    path("teams/<slug:slug>/alerts/<int:alert_id>/snooze/", views.snooze, name="alert-snooze"),
    path("fleet/", views.fleet_overview, name="fleet"),
    path("fleet/decisions/", views.decisions, name="decisions"),
    path("fleet/deviations/", views.deviations, name="fleet-deviations"),
    path("compare/", compare.compare, name="compare"),
    # The week report (issue 19 item 3): a team's week, and the fleet's node x hour heatmap.
    path("teams/<slug:slug>/week/", week_views.team_week, name="team-week"),
    path("teams/<slug:slug>/week.csv", week_views.team_week_csv, name="team-week-csv"),
    path("fleet/week/", week_views.fleet_week, name="fleet-week"),
    path("fleet/week.csv", week_views.fleet_week_csv, name="fleet-week-csv"),
]
