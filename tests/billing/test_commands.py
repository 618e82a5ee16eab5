"""`run_billing` and `statement`, as finance and operators run them, on the chargeback scenario
(figures worked out by hand in tests/billing/test_chargeback.py)."""

from __future__ import annotations

import json
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone
from pytest_django.fixtures import SettingsWrapper

from billing import periods
from billing.models import Period, RateCard
from metering import rollup
from metering.models import UsageHour
from teams.models import Team
from tests.billing.test_chargeback import T10, scenario, send_samples

pytestmark = pytest.mark.django_db
__all__ = ["scenario"]

H100 = {
    "product_name": "NVIDIA H100 80GB HBM3",
    # 9000 s held; 5430 s at work, 1740 s unmeasured, 1830 s idle.
    "allocated_gpu_hours": "2.500000",
    "utilised_gpu_hours": "1.508333",
    "idle_gpu_hours": "0.508333",
    "unmeasured_gpu_hours": "0.483333",
    "rate": "2.5000",
    # 2.50 x (2.5 - 0.6 x 1830/3600) = 5.4875 -> 5.49
    "amount": "5.49",
    "idle_factor": "0.4000",
    "unit": "GPU-hour",
    "hours": "GPU-hours",
    "gpu_share": None,
    "kind": "usage",
    "profile": "",
    "corrects_period": None,
    "reason": "",
}
MIG = {
    "product_name": "NVIDIA A100-SXM4-80GB",
    # 3,600,000 ms x 3/7 (0.428571) = 1,542,856 GPU-ms, never measured.
    "allocated_gpu_hours": "0.428571",
    "utilised_gpu_hours": "0.000000",
    "idle_gpu_hours": "0.000000",
    "unmeasured_gpu_hours": "0.428571",
    "rate": "1.2000",
    # 1.20 x 1542856/3600000 = 0.514285... -> 0.51
    "amount": "0.51",
    "idle_factor": "0.4000",
    "unit": "GPU-hour",
    "hours": "GPU-hours",
    "gpu_share": None,
    "kind": "usage",
    "profile": "",
    "corrects_period": None,
    "reason": "",
}


def run(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


def statement_json(*args: str) -> Any:
    return json.loads(run("statement", "--team", "vision", "--format", "json", *args))


def usage_rows() -> list[tuple[Any, ...]]:
    return sorted(
        UsageHour.objects.values_list(
            "hour", "device_uuid", "allocated_gpu_ms", "utilised_gpu_ms", "unmeasured_gpu_ms"
        )
    )


def test_run_billing_then_the_statement_to_the_cent(scenario: Team) -> None:
    UsageHour.objects.all().delete()  # nothing rolled up yet: run_billing does it
    output = run("run_billing", "--period", "2026-10")
    assert output.splitlines()[0].startswith(
        "Period 2026-10 (2026-10-01 00:00..2026-11-01 00:00 UTC): 744 hours rolled up "
        "(4 usage rows)"
    )
    assert "1 statement for 1 team; total 6.00 USD" in output
    assert output.splitlines()[-1] == (
        "Period 2026-10 has ended but is open: Celery beat closes it on its next hourly run; to "
        "close it now, run `python manage.py run_billing --period 2026-10 --close`."
    )
    assert statement_json("--period", "2026-10") == {
        "team": "vision",
        "period": "2026-10",
        "currency": "USD",
        "lines": [MIG, H100],
        "total": "6.00",
    }


def test_rerunning_run_billing_changes_nothing(scenario: Team) -> None:
    run("run_billing", "--period", "2026-10")
    rows, statement = usage_rows(), statement_json("--period", "2026-10")
    run("run_billing", "--period", "2026-10")
    assert (usage_rows(), statement_json("--period", "2026-10")) == (rows, statement)


def test_close_freezes_and_a_second_close_says_when_and_by_whom(scenario: Team) -> None:
    output = run("run_billing", "--period", "2026-10", "--close", "--actor", "finance")
    october = Period.objects.get(start=T10.replace(day=1, hour=0))
    assert october.closed_by == "finance"
    assert f"Closed 2026-10 at {october.closed_at:%Y-%m-%d %H:%M} UTC by finance" in output
    frozen = statement_json("--period", "2026-10")
    assert frozen["total"] == "6.00"
    for args in (("--close",), ()):
        with pytest.raises(CommandError) as raised:
            run("run_billing", "--period", "2026-10", *args)
        assert str(raised.value) == (
            "period 2026-10 (2026-10-01..2026-11-01) is already closed, at "
            f"{october.closed_at:%Y-%m-%d %H:%M} UTC by finance; its statements are frozen and "
            "late data for it is billed as adjustments in the next open period"
        )
    october.refresh_from_db()
    assert october.closed_by == "finance"
    assert statement_json("--period", "2026-10") == frozen


def test_late_data_shows_as_an_adjustment_line_in_the_next_period(scenario: Team) -> None:
    run("run_billing", "--period", "2026-10", "--close")
    # Samples for the H100's unmeasured half hour (11:01-11:30) arrive late: it was idle.
    send_samples("GPU-H", T10 + timedelta(minutes=61), 29, 0.0)
    run("run_billing", "--period", "2026-11")
    november = statement_json("--period", "2026-11")
    # 1740 s moved from unmeasured to idle: 2.50 x (2.5 - 0.6 x 3570/3600) = 4.7625 -> 4.76,
    # against the 5.49 billed: -0.73.
    assert november == {
        "team": "vision",
        "period": "2026-11",
        "currency": "USD",
        "lines": [
            {
                **H100,
                "allocated_gpu_hours": "0.000000",
                "utilised_gpu_hours": "0.000000",
                "idle_gpu_hours": "0.483333",
                "unmeasured_gpu_hours": "-0.483333",
                "amount": "-0.73",
                "kind": "adjustment",
                "corrects_period": "2026-10",
                "reason": "late data for 2026-10-01..2026-11-01",
            }
        ],
        "total": "-0.73",
    }
    assert statement_json("--period", "2026-10")["total"] == "6.00"


def test_several_currencies_need_a_currency_for_json(scenario: Team) -> None:
    RateCard.objects.filter(product_name="NVIDIA A100-SXM4-80GB").update(currency="EUR")
    output = run("run_billing", "--period", "2026-10")
    assert "2 statements for 1 team; total 0.51 EUR; 5.49 USD" in output
    with pytest.raises(CommandError) as raised:
        statement_json("--period", "2026-10")
    assert str(raised.value) == (
        "team vision has statements in EUR, USD for 2026-10: pick one with --currency"
    )
    euro = statement_json("--period", "2026-10", "--currency", "eur")
    assert (euro["currency"], euro["lines"], euro["total"]) == ("EUR", [MIG], "0.51")
    with pytest.raises(CommandError) as raised:
        statement_json("--period", "2026-10", "--currency", "JPY")
    assert str(raised.value) == "team vision has no JPY statement for 2026-10; it has EUR, USD"
    text = run("statement", "--team", "vision", "--period", "2026-10")
    assert "), period 2026-10 (2026-10-01..2026-11-01 UTC), EUR" in text
    assert "), period 2026-10 (2026-10-01..2026-11-01 UTC), USD" in text


def test_the_text_statement_is_a_table(scenario: Team) -> None:
    run("run_billing", "--period", "2026-10")
    text = run("statement", "--team", "vision", "--period", "2026-10")
    lines = text.splitlines()
    assert lines[0] == (
        "Statement: team vision (Vision), period 2026-10 (2026-10-01..2026-11-01 UTC), USD"
    )
    assert lines[1].startswith("open: changes as data arrives until the period is closed")
    header, mig, h100, total = lines[3:7]
    assert header.split() == [
        "kind", "product", "profile", "hours", "allocated", "utilised", "idle", "unmeasured",
        "efficiency", "rate", "idle", "factor", "amount", "note",
    ]  # fmt: skip
    # Efficiency: utilised over measured time, 5430 / (9000 - 1740) s.
    assert h100.split() == [
        "usage", "NVIDIA", "H100", "80GB", "HBM3", "GPU-hours", "2.500000", "1.508333", "0.508333",
        "0.483333", "74.8%", "2.5000", "0.4000", "5.49",
    ]  # fmt: skip
    assert mig.split()[-4:] == [
        "0.428571",
        "1.2000",
        "0.4000",
        "0.51",
    ]  # nothing measured: no efficiency
    assert total.split() == ["total", "6.00", "USD"]


def test_weekly_periods(scenario: Team, settings: SettingsWrapper) -> None:
    settings.TALLY_BILLING_PERIOD = "week"
    with pytest.raises(CommandError) as raised:
        run("run_billing", "--period", "2026-10")
    assert str(raised.value) == (
        "'2026-10' names a month, but billing periods are weeks (TALLY_BILLING_PERIOD=week): "
        "give the period as 2026-W47"
    )
    output = run("run_billing", "--period", "2026-W42", "--close")
    assert output.startswith(
        "Period 2026-W42 (2026-10-12 00:00..2026-10-19 00:00 UTC): 168 hours rolled up"
    )
    statement = statement_json("--period", "2026-W42")
    assert (statement["period"], statement["lines"], statement["total"]) == (
        "2026-W42",
        [MIG, H100],
        "6.00",
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--period", "2026-13"], "'2026-13' is not a month: month must be in 1..12"),
        (["--period", "Nov 2026"], "'Nov 2026' is not a period; billing periods are months"),
        (["--period", "2026-W47"], "'2026-W47' names a week, but billing periods are months"),
    ],
)
def test_run_billing_refuses_bad_period_text(args: list[str], message: str) -> None:
    with pytest.raises(CommandError) as raised:
        run("run_billing", *args)
    assert str(raised.value).startswith(message)
    assert not Period.objects.exists()


def test_run_billing_refuses_a_future_period_and_closing_an_open_one() -> None:
    now = timezone.now()
    current = periods.period_label(*periods.period_bounds(now))
    following_start, following_end = periods.period_bounds(periods.period_bounds(now)[1])
    following = periods.period_label(following_start, following_end)
    with pytest.raises(CommandError) as raised:
        run("run_billing", "--period", following)
    assert str(raised.value) == (
        f"period {following} has not started yet: it starts {following_start:%Y-%m-%d} 00:00 UTC"
    )
    with pytest.raises(CommandError) as raised:
        run("run_billing", "--period", current, "--close")
    assert str(raised.value) == (
        f"period {current} cannot be closed before it ends, at {following_start:%Y-%m-%d} 00:00 UTC"
    )
    assert not Period.objects.exists()
    # The current period itself can be billed so far.
    assert f"Period {current} is open" in run("run_billing", "--period", current)


def test_statement_errors_say_what_to_do(scenario: Team) -> None:
    Team.objects.create(slug="nlp", name="NLP")
    with pytest.raises(CommandError) as raised:
        run("statement", "--team", "speech", "--period", "2026-10")
    assert str(raised.value) == "no team 'speech'; teams: nlp, vision"
    with pytest.raises(CommandError) as raised:
        run("statement", "--team", "vision", "--period", "2026-10")
    assert str(raised.value) == (
        "no statements for 2026-10 yet: run `python manage.py run_billing --period 2026-10` first"
    )
    with pytest.raises(CommandError, match="'2026/10' is not a period"):
        run("statement", "--team", "vision", "--period", "2026/10")
    run("run_billing", "--period", "2026-10")
    with pytest.raises(CommandError) as raised:
        run("statement", "--team", "nlp", "--period", "2026-10")
    assert str(raised.value) == (
        "nlp has no usage or adjustments in 2026-10 (open, priced as data arrives): "
        "there is no statement to show"
    )


def test_a_priced_period_with_nothing_billed_says_so_not_to_run_billing(scenario: Team) -> None:
    assert "(0 usage rows)" in run("run_billing", "--period", "2026-09", "--close")
    with pytest.raises(CommandError) as raised:
        run("statement", "--team", "vision", "--period", "2026-09")
    assert str(raised.value) == (
        "vision has no usage or adjustments in 2026-09 (closed): there is no statement to show"
    )


def test_a_period_of_another_length_than_those_stored_names_the_stored_one(
    scenario: Team, settings: SettingsWrapper
) -> None:
    run("run_billing", "--period", "2026-10")
    settings.TALLY_BILLING_PERIOD = "week"
    with pytest.raises(CommandError) as raised:
        run("statement", "--team", "vision", "--period", "2026-W42")
    assert str(raised.value) == (
        "no period 2026-W42: periods here are stored as months, not weeks "
        "(TALLY_BILLING_PERIOD=week), and 2026-10 (2026-10-01..2026-11-01) overlaps it; ask for "
        "2026-10 with TALLY_BILLING_PERIOD=month"
    )
    # What it would otherwise have suggested is refused.
    with pytest.raises(CommandError, match="the period length cannot change"):
        run("run_billing", "--period", "2026-W42")
    settings.TALLY_BILLING_PERIOD = "month"
    assert statement_json("--period", "2026-10")["period"] == "2026-10"


def test_run_billing_rolls_up_hours_marked_for_earlier_periods(scenario: Team) -> None:
    """Late data for a closed period is rolled up by run_billing of an open one, so that the
    adjustment is there without waiting for beat."""
    run("run_billing", "--period", "2026-10", "--close")
    send_samples("GPU-H", T10 + timedelta(minutes=61), 29, 0.0)  # marks 11:00 of October
    rollup.rollup_hours(hours=[T10.replace(hour=12)], now=T10 + timedelta(days=1))  # unrelated
    output = run("run_billing", "--period", "2026-11", "--verbosity", "2")
    assert "  vision: -0.73 USD" in output
