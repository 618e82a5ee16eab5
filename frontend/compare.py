"""The portal's "Did it help?" page: two windows of a team or of the fleet compared, the change
in utilisation split into workload mix, the jobs' own efficiency, and jobs entering and
leaving (`billing.compare`), with the jobs that moved it most.

Tenancy as on the other pages: no role is a 403, a team the user may not see a 404, the fleet
is for finance and operators (403 to leads). The query parameters are the API's
(`/api/v1/compare/`), whose CSV the page links to; bad ones are shown on the form (400).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any
from urllib.parse import urlencode

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse, QueryDict
from django.shortcuts import render
from django.urls import reverse
from django.utils import timezone

from billing.api.compare import FLEET_ROLES
from billing.compare import (
    WINDOW_PARAMETERS,
    CompareInputError,
    compare_windows,
    job_rows,
    parse_parameters,
    summary,
)
from frontend import selectors
from frontend.views import forbidden, not_found
from inventory.models import Unit
from inventory.profiles import unit_label
from metering.moments import MOMENT_HELP
from teams.models import Team

PLACES = 2
JOBS_SHOWN = 50
DEFAULT_DAYS = 7
PART_LABELS = {
    "mix": "Workload mix",
    "efficiency": "Jobs' own efficiency",
    "entering": "Jobs entering",
    "leaving": "Jobs leaving",
}
PART_HELP = {
    "mix": "which of the jobs present in both windows ran, and how much",
    "efficiency": "the same jobs using their devices better or worse",
    "entering": "jobs measured only in the after window",
    "leaving": "jobs measured only in the before window",
}


def default_parameters(now: datetime) -> dict[str, str]:
    """The last `DEFAULT_DAYS` whole UTC days against the `DEFAULT_DAYS` before them."""
    today = now.astimezone(UTC).date()
    days = [today - timedelta(days=DEFAULT_DAYS * n) for n in (2, 1, 0)]
    return {
        "before_start": days[0].isoformat(),
        "before_end": days[1].isoformat(),
        "after_start": days[1].isoformat(),
        "after_end": days[2].isoformat(),
    }


def signed(value: Decimal | None) -> str:
    """Points with their sign (+1.25, -0.50, 0.00), or an en dash for none."""
    if value is None:
        return "\N{EN DASH}"
    return f"{value:+f}" if value else f"{value:f}"


@dataclass(frozen=True)
class PartLine:
    name: str
    label: str
    help: str
    points: str
    # Bar width in percent of the largest part's magnitude, and its direction.
    width: int
    negative: bool


def _parts(head: dict[str, Any]) -> list[PartLine]:
    shown = head["parts_pp"]
    largest = max((abs(value) for value in shown.values() if value is not None), default=0)
    return [
        PartLine(
            name=name,
            label=label,
            help=PART_HELP[name],
            points=signed(shown[name]),
            width=int(abs(shown[name]) * 100 / largest) if largest and shown[name] else 0,
            negative=bool(shown[name] is not None and shown[name] < 0),
        )
        for name, label in PART_LABELS.items()
    ]


def verdict(head: dict[str, Any]) -> str:
    """One sentence: did the jobs get better (or worse), or did the work change?"""
    change, parts = head["change_pp"], head["parts_pp"]
    if change is None:
        return "There is no change to explain: a window has no measured hours."
    efficiency = parts["efficiency"]
    workload = parts["mix"] + parts["entering"] + parts["leaving"]
    if not change and not efficiency and not workload:
        return "Utilisation did not change."
    moved = "rose" if change > 0 else "fell" if change < 0 else "did not change overall"
    jobs = f"the same jobs used their devices {'better' if efficiency > 0 else 'worse'}"
    work = "the work changed: which jobs ran, and how much"
    if abs(efficiency) == abs(workload):
        cause = f"as much because {jobs} ({signed(efficiency)} points) as because {work}"
    elif abs(efficiency) > abs(workload):
        cause = f"mostly because {jobs} ({signed(efficiency)} points)"
    else:
        cause = f"mostly because {work} ({signed(workload)} points)"
    return f"Utilisation {moved} ({signed(change)} points), {cause}."


def _scopes(teams: list[Team], role: str) -> list[tuple[str, str]]:
    """The scopes the form offers: (value, label), the fleet first where allowed."""
    named = [(team.slug, team.name) for team in teams]
    return ([("", "Fleet (every team)")] if role in FLEET_ROLES else []) + named


@login_required
def compare(request: HttpRequest) -> HttpResponse:
    role = selectors.portal_role(request.user)
    if role is None:
        return forbidden(request, "You lead no team, so there is nothing to compare.")
    teams = selectors.team_list(user=request.user)
    scopes = _scopes(teams, role)
    params = _parameters(request.GET, scopes=scopes, now=timezone.now())
    slug = params["team"]
    team: Team | None = None
    if slug:
        # Among the teams the user may see, already read: any other text (another team's
        # slug, or no slug at all) is a team not found, never a query.
        team = next((team for team in teams if team.slug == slug), None)
        if team is None:
            return not_found(request)
    elif role not in FLEET_ROLES:
        return forbidden(request, "Only finance and operators can compare the fleet.")
    context: dict[str, Any] = {
        "params": params,
        "scopes": scopes,
        "units": [(unit, unit_label(unit)) for unit in Unit.values],
        "moment_help": MOMENT_HELP,
        "errors": {},
        "fieldsets": _fieldsets(params, {}),
    }
    try:
        before, after, unit = parse_parameters(params)
    except CompareInputError as exc:
        context.update(errors=exc.errors, fieldsets=_fieldsets(params, exc.errors))
        return render(request, "frontend/compare.html", context, status=400)
    comparison = compare_windows(team=team, before=before, after=after, unit=unit)
    head = summary(comparison, PLACES)
    rows = job_rows(comparison, PLACES)
    api = {name: value for name, value in params.items() if value}
    context.update(
        {
            "team": team,
            "head": head,
            "head_windows": [("Before", head["before"]), ("After", head["after"])],
            "verdict": verdict(head),
            "parts": _parts(head) if head["change_pp"] is not None else [],
            "change": signed(head["change_pp"]),
            "jobs": [_job(row) for row in rows[:JOBS_SHOWN]],
            "jobs_total": len(rows),
            "csv_url": f"{reverse('api-compare')}?{urlencode({**api, 'format': 'csv'})}",
        }
    )
    return render(request, "frontend/compare.html", context)


def _parameters(
    query: QueryDict, *, scopes: list[tuple[str, str]], now: datetime
) -> dict[str, str]:
    """The query's parameters; with no window given, the default windows; with no team
    given, the first scope offered (the fleet, or the user's first team)."""
    given = {name: query.get(name, "") for name in (*WINDOW_PARAMETERS, "unit")}
    if not any(given[name] for name in WINDOW_PARAMETERS):
        given.update(default_parameters(now))
    default_team = scopes[0][0] if scopes else ""
    return {
        "team": query.get("team", default_team),
        **given,
        "unit": given["unit"] or Unit.GPU.value,
    }


def _fieldsets(params: dict[str, str], errors: dict[str, str]) -> list[dict[str, Any]]:
    """The window bounds as the form shows them: per window, each bound's value and error."""
    labels = {"start": "From", "end": "Until (exclusive)"}
    return [
        {
            "legend": side.capitalize(),
            "fields": [
                {
                    "name": name,
                    "label": labels[bound],
                    "value": params[name],
                    "error": errors.get(name, ""),
                }
                for bound in ("start", "end")
                for name in [f"{side}_{bound}"]
            ],
        }
        for side in ("before", "after")
    ]


def _job(row: dict[str, Any]) -> dict[str, Any]:
    moved = row["entering_pp"] + row["leaving_pp"] if row["change_pp"] is not None else None
    return {
        **row,
        "mix": signed(row["mix_pp"]),
        "efficiency": signed(row["efficiency_pp"]),
        "moved": signed(moved),
        "change": signed(row["change_pp"]),
    }
