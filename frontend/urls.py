"""The portal's pages (see frontend/views.py)."""

from django.contrib.auth import views as auth_views
from django.urls import URLPattern, URLResolver, path

from frontend import views

urlpatterns: list[URLPattern | URLResolver] = [
    path("login/", auth_views.LoginView.as_view(redirect_authenticated_user=True), name="login"),
    path("logout/", views.LogoutView.as_view(), name="logout"),
    path("", views.home, name="home"),
    path("teams/<slug:slug>/", views.team, name="team"),
    path(
        "teams/<slug:slug>/statements/<int:period_id>.csv",
        views.statement_csv,
        name="statement-csv",
    ),
    path("fleet/", views.fleet_overview, name="fleet"),
    path("fleet/decisions/", views.decisions, name="decisions"),
]
