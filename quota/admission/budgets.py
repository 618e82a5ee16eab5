"""What the webhook knows of budgets, cached per process.

A budget is in hours of one unit (GPU-hours, TPU chip-hours, Gaudi card-hours), and only the
team's hours of that unit count toward it. Hours move slowly: a worker reads the budgets (one
query for all teams) and a team's hours at most every TALLY_BUDGET_CACHE_SECONDS; a team
without a budget costs nothing. The period is the stored one holding now, else the configured
one (`period_holding`): stored periods of another length, after TALLY_BILLING_PERIOD changed,
never make admission fail, and admission never creates a period.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from django.conf import settings
from django.utils import timezone

from billing.pricing import period_holding
from billing.selectors import team_gpu_hours
from quota.admission.plans import BudgetUse
from quota.models import Budget
from teams.models import Team


@dataclass
class _Budgets:
    """Every team's budget, read in one query, and the use of those asked about."""

    expires: float
    budgets: dict[int, Budget]
    used: dict[int, BudgetUse] = field(default_factory=dict)


_budgets: list[_Budgets] = []


def budget_use(team: Team) -> BudgetUse | None:
    """The team's budget and the hours of its unit the team has used in the period holding
    now (None: it has no budget), as of at most TALLY_BUDGET_CACHE_SECONDS ago."""
    if not _budgets or _budgets[0].expires < time.monotonic():
        budgets = {budget.team_id: budget for budget in Budget.objects.all()}
        expires = time.monotonic() + settings.TALLY_BUDGET_CACHE_SECONDS
        _budgets[:] = [_Budgets(expires=expires, budgets=budgets)]
    cache = _budgets[0]
    use = cache.used.get(team.pk)
    if use is None:
        budget = cache.budgets.get(team.pk)
        if budget is None:
            return None
        now = timezone.now()
        period = period_holding(now)
        use = cache.used[team.pk] = BudgetUse(
            hours=budget.gpu_hours,
            unit=budget.unit,
            mode=budget.mode,
            used=team_gpu_hours(team=team, period=period, now=now, unit=budget.unit),
            period=period.label,
        )
    return use


def forget_budgets() -> None:
    """Drop what this process remembers of budgets (tests; a changed budget)."""
    _budgets.clear()
