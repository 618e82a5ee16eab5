"""Did it help? The shift-share decomposition on constructed cases whose answers are worked out
by hand, its properties (exact sums, symmetry) under hypothesis, the windows read from
PostgreSQL, and the `compare_windows` command."""

from __future__ import annotations

import csv
import io
import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from fractions import Fraction
from itertools import count
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from hypothesis import given
from hypothesis import strategies as st

from billing.compare import (
    ROW_COLUMNS,
    CompareInputError,
    Hours,
    JobKey,
    Parts,
    Presence,
    Window,
    compare_windows,
    decompose,
    job_rows,
    parse_parameters,
    parse_window,
    shown_parts,
    summary,
)
from inventory.models import Unit
from metering.hours import MS_PER_HOUR
from metering.models import UsageHour
from metering.moments import parse_moment
from teams.models import Team

H = MS_PER_HOUR
A, B, C = (JobKey(team="alpha", namespace="ml", job=f"Job/{name}") for name in "abc")


def hours(allocated: float, utilised: float, unmeasured: float = 0) -> Hours:
    return Hours(
        allocated_ms=int(allocated * H),
        utilised_ms=int(utilised * H),
        unmeasured_ms=int(unmeasured * H),
    )


def by_job(result: Any) -> dict[JobKey, Any]:
    return {job.key: job for job in result.jobs}


# --- The decomposition, by hand ----------------------------------------------------------------


def test_a_shift_of_the_mix_alone_is_all_mix() -> None:
    # A runs at 50%, B at 90%, both as before; B triples its hours. 14/20 = 70% -> 32/40 = 80%.
    result = decompose(
        {A: hours(10, 5), B: hours(10, 9)},
        {A: hours(10, 5), B: hours(30, 27)},
    )
    assert result.parts == Parts(mix=Fraction(1, 10))
    jobs = by_job(result)
    # Shares 1/2, 1/2 -> 1/4, 3/4 around a midpoint ratio of 3/4: A (mid 1/2) lost weight,
    # (1/2 - 3/4)(-1/4) = +1/16; B (9/10) gained it, (9/10 - 3/4)(1/4) = +3/80.
    assert jobs[A].parts == Parts(mix=Fraction(1, 16))
    assert jobs[B].parts == Parts(mix=Fraction(3, 80))
    assert {job.presence for job in result.jobs} == {Presence.BOTH}


def test_a_change_of_efficiency_alone_is_all_efficiency() -> None:
    # Same hours; A goes from 50% to 70%: 70% -> 80%, half the weight times 20 points.
    result = decompose(
        {A: hours(10, 5), B: hours(10, 9)},
        {A: hours(10, 7), B: hours(10, 9)},
    )
    assert result.parts == Parts(efficiency=Fraction(1, 10))
    assert by_job(result)[A].parts == Parts(efficiency=Fraction(1, 10))
    assert by_job(result)[B].parts == Parts()


def test_mix_and_efficiency_together() -> None:
    # A 50% -> 70% on 10 h; B 90% on 10 h -> 30 h. 70% -> 34/40 = 85%: +15 points.
    # efficiency: A's mid share (1/2 + 1/4)/2 = 3/8 x 1/5 = 3/40 (7.5 points);
    # mix: centre (7/10 + 17/20)/2 = 31/40; A (3/5 - 31/40)(-1/4) = 7/160,
    # B (9/10 - 31/40)(1/4) = 1/32; 7/160 + 5/160 = 3/40 (7.5 points).
    result = decompose(
        {A: hours(10, 5), B: hours(10, 9)},
        {A: hours(10, 7), B: hours(30, 27)},
    )
    assert result.parts == Parts(mix=Fraction(3, 40), efficiency=Fraction(3, 40))
    assert result.parts.total == Fraction(34, 40) - Fraction(7, 10)
    jobs = by_job(result)
    assert jobs[A].parts == Parts(mix=Fraction(7, 160), efficiency=Fraction(3, 40))
    assert jobs[B].parts == Parts(mix=Fraction(1, 32))


def test_a_job_entering_is_shown_apart() -> None:
    # A at 50% throughout; C enters with 10 h at 90%: 50% -> 14/20 = 70%, all of it C's entry,
    # C's share 1/2 x (9/10 - 1/2) = 1/5.
    result = decompose({A: hours(10, 5)}, {A: hours(10, 5), C: hours(10, 9)})
    assert result.parts == Parts(entering=Fraction(1, 5))
    assert by_job(result)[C].presence is Presence.ENTERING
    assert by_job(result)[C].parts == Parts(entering=Fraction(1, 5))
    assert by_job(result)[A].parts == Parts()


def test_a_job_leaving_is_its_entry_backwards() -> None:
    result = decompose({A: hours(10, 5), C: hours(10, 9)}, {A: hours(10, 5)})
    assert result.parts == Parts(leaving=Fraction(-1, 5))
    assert by_job(result)[C].presence is Presence.LEAVING


def test_swapping_the_windows_negates_every_part() -> None:
    before = {A: hours(10, 5), B: hours(10, 9), C: hours(4, 1)}
    after = {A: hours(10, 7), B: hours(30, 27), JobKey("alpha", "ml", "Job/d"): hours(3, 3)}
    forward, backward = decompose(before, after).parts, decompose(after, before).parts
    assert forward is not None and backward is not None
    assert backward.mix == -forward.mix and backward.efficiency == -forward.efficiency
    assert backward.entering == -forward.leaving and backward.leaving == -forward.entering
    assert forward.mix and forward.efficiency and forward.entering and forward.leaving


def test_unmeasured_hours_are_neither_utilised_nor_idle() -> None:
    # 10 h held, 4 h without samples, 3 h at work: 3 of the 6 measured hours, 50%, not 30%.
    result = decompose({A: hours(10, 3, 4)}, {A: hours(10, 6, 0)})
    assert result.before.ratio == Fraction(1, 2)
    assert result.before.idle_ms == 3 * H
    assert result.parts == Parts(efficiency=Fraction(1, 10))


def test_a_job_measured_in_one_window_only_enters_or_leaves() -> None:
    # C held devices before, but no sample came: it weighs nothing in the before ratio.
    result = decompose({A: hours(10, 5), C: hours(5, 0, 5)}, {A: hours(10, 5), C: hours(10, 9)})
    assert by_job(result)[C].presence is Presence.ENTERING
    never = decompose({C: hours(5, 0, 5), A: hours(1, 1)}, {C: hours(5, 0, 5), A: hours(1, 1)})
    assert by_job(never)[C].presence is Presence.UNMEASURED
    assert by_job(never)[C].parts == Parts()


def test_no_common_job_is_all_entry_and_exit() -> None:
    result = decompose({A: hours(10, 5)}, {B: hours(10, 9)})
    assert result.parts == Parts(entering=Fraction(9, 10), leaving=Fraction(-1, 2))


def test_a_window_without_measured_hours_has_no_change_to_split() -> None:
    result = decompose({A: hours(10, 0, 10)}, {A: hours(10, 5)})
    assert result.parts is None
    assert [job.parts for job in result.jobs] == [None]


# --- Properties ---------------------------------------------------------------------------------

KEYS = [JobKey("t", "ns", f"Job/{n}") for n in range(6)]


@st.composite
def job_hours(draw: st.DrawFn) -> Hours:
    allocated = draw(st.integers(min_value=1, max_value=10**9))
    unmeasured = draw(st.integers(min_value=0, max_value=allocated))
    utilised = draw(st.integers(min_value=0, max_value=allocated - unmeasured))
    return Hours(allocated_ms=allocated, utilised_ms=utilised, unmeasured_ms=unmeasured)


windows = st.dictionaries(st.sampled_from(KEYS), job_hours(), max_size=len(KEYS))


@given(before=windows, after=windows)
def test_the_parts_add_up_exactly_to_the_total_whichever_window_is_first(
    before: dict[JobKey, Hours], after: dict[JobKey, Hours]
) -> None:
    result = decompose(before, after)
    if result.parts is None:
        assert result.before.measured_ms == 0 or result.after.measured_ms == 0
        return
    assert result.before.ratio is not None and result.after.ratio is not None
    assert result.parts.total == result.after.ratio - result.before.ratio
    assert sum((job.parts for job in result.jobs if job.parts), Parts()) == result.parts
    backward = decompose(after, before).parts
    assert backward == Parts(
        mix=-result.parts.mix,
        efficiency=-result.parts.efficiency,
        entering=-result.parts.leaving,
        leaving=-result.parts.entering,
    )
    shown, total = shown_parts(
        [result.parts.mix, result.parts.efficiency, result.parts.entering, result.parts.leaving],
        4,
    )
    assert sum(shown) == total
    assert abs(Fraction(total) - result.parts.total) <= Fraction(1, 2 * 10**4)


@given(
    parts=st.lists(
        st.fractions(min_value=-2, max_value=2, max_denominator=10**6), min_size=1, max_size=6
    ),
    places=st.integers(min_value=0, max_value=6),
)
def test_shown_parts_add_up_to_the_shown_total(parts: list[Fraction], places: int) -> None:
    shown, total = shown_parts(parts, places)
    unit = Fraction(1, 10**places)
    assert sum(shown) == total
    assert abs(Fraction(total) - sum(parts, Fraction(0))) <= unit / 2
    assert all(abs(Fraction(s) - part) < unit for s, part in zip(shown, parts, strict=True))


# --- Input ---------------------------------------------------------------------------------------


def test_bounds_are_dates_or_whole_utc_hours() -> None:
    assert parse_moment("2026-11-02") == datetime(2026, 11, 2, tzinfo=UTC)
    assert parse_moment("2026-11-02T14:00Z") == datetime(2026, 11, 2, 14, tzinfo=UTC)
    assert parse_moment("2026-11-02T15:00+01:00") == datetime(2026, 11, 2, 14, tzinfo=UTC)
    with pytest.raises(ValueError, match="not on a whole UTC hour"):
        parse_moment("2026-11-02T14:30")
    with pytest.raises(ValueError, match="'last week' is not a UTC date"):
        parse_moment("last week")
    with pytest.raises(ValueError, match="is not a UTC date"):
        parse_moment("0001-01-01T00:00+01:00")
    with pytest.raises(ValueError, match="the window is reversed"):
        parse_window("2026-11-09", "2026-11-02")
    with pytest.raises(ValueError, match="the window is empty"):
        parse_window("2026-11-09", "2026-11-09")


def test_parameters_name_each_one_at_fault() -> None:
    with pytest.raises(CompareInputError) as caught:
        parse_parameters(
            {
                "before_start": "2026-11-09",
                "before_end": "2026-11-02",
                "after_start": "soon",
                "unit": "qpu",
            }
        )
    errors = caught.value.errors
    assert set(errors) == {"before_end", "after_start", "after_end", "unit"}
    assert "the window is reversed" in errors["before_end"]
    assert "'soon' is not" in errors["after_start"]
    assert errors["after_end"].startswith("required")
    assert "gpu, tpu" in errors["unit"]


# --- From PostgreSQL ----------------------------------------------------------------------------

MONDAY = datetime(2026, 11, 2, tzinfo=UTC)
BEFORE = Window(MONDAY, MONDAY + timedelta(days=7))
AFTER = Window(MONDAY + timedelta(days=7), MONDAY + timedelta(days=14))
_allocation_ids = count(1)


def usage(
    team: Team | None,
    hour: datetime,
    job: str,
    allocated: float,
    utilised: float,
    *,
    unmeasured: float = 0,
    namespace: str = "ml",
    claim: str = "c",
    unit: str = Unit.GPU,
) -> UsageHour:
    """A usage row as the rollup writes them (the allocation is not read by the comparison)."""
    return UsageHour.objects.create(
        hour=hour,
        allocation_id=next(_allocation_ids),
        cluster_id=1,
        device_uuid="GPU-1",
        product_name="NVIDIA H100 80GB HBM3",
        gpu_share=Decimal(1),
        unit=unit,
        namespace=namespace,
        claim_name=claim,
        team=team,
        job=job,
        username="ana",
        allocated_gpu_ms=int(allocated * H),
        utilised_gpu_ms=int(utilised * H),
        unmeasured_gpu_ms=int(unmeasured * H),
    )


@pytest.fixture
def teams(db: None) -> tuple[Team, Team]:
    return (
        Team.objects.create(slug="alpha", name="Alpha"),
        Team.objects.create(slug="beta", name="Beta"),
    )


@pytest.fixture
def scenario(teams: tuple[Team, Team]) -> tuple[Team, Team]:
    """Alpha's mix-and-efficiency case, spread over hours of each week, with what must not
    count: the hour the after window ends at, another team, TPU hours, and (fleet only) a
    namespace of no team."""
    alpha, beta = teams
    for hour, job, allocated, utilised in (
        (0, "Job/a", 6, 3),
        (30, "Job/a", 4, 2),
        (1, "Job/b", 10, 9),
    ):
        usage(alpha, BEFORE.start + timedelta(hours=hour), job, allocated, utilised)
    for hour, job, allocated, utilised in (
        (0, "Job/a", 10, 7),
        (2, "Job/b", 20, 18),
        (7 * 24 - 1, "Job/b", 10, 9),  # the last hour of the window
    ):
        usage(alpha, AFTER.start + timedelta(hours=hour), job, allocated, utilised)
    usage(alpha, AFTER.end, "Job/b", 100, 0)  # [start, end): the end is outside
    usage(alpha, BEFORE.start - timedelta(hours=1), "Job/a", 100, 0)
    usage(alpha, AFTER.start, "Job/a", 50, 0, unit=Unit.TPU)
    usage(beta, AFTER.start, "Job/a", 10, 0)
    usage(None, AFTER.start, "Pod/stray", 10, 10, namespace="default")
    return alpha, beta


def test_a_team_window_is_summed_from_its_usage_hours(scenario: tuple[Team, Team]) -> None:
    alpha, _ = scenario
    comparison = compare_windows(team=alpha, before=BEFORE, after=AFTER)
    result = comparison.decomposition
    assert result.parts == Parts(mix=Fraction(3, 40), efficiency=Fraction(3, 40))
    assert [job.key for job in result.jobs] == [
        JobKey("alpha", "ml", "Job/a"),
        JobKey("alpha", "ml", "Job/b"),
    ]
    head = summary(comparison)
    assert head["before"]["utilisation_pct"] == Decimal("70.0000")
    assert head["after"]["utilisation_pct"] == Decimal("85.0000")
    assert head["change_pp"] == Decimal("15.0000")
    assert head["parts_pp"] == {
        "mix": Decimal("7.5000"),
        "efficiency": Decimal("7.5000"),
        "entering": Decimal("0.0000"),
        "leaving": Decimal("0.0000"),
    }
    assert head["exact"] == {
        "change": "3/20",
        "mix": "3/40",
        "efficiency": "3/40",
        "entering": "0",
        "leaving": "0",
    }


def test_the_fleet_includes_every_team_and_namespaces_of_none(
    scenario: tuple[Team, Team],
) -> None:
    result = compare_windows(team=None, before=BEFORE, after=AFTER).decomposition
    keys = {job.key: job.presence for job in result.jobs}
    assert keys[JobKey("beta", "ml", "Job/a")] is Presence.ENTERING
    assert keys[JobKey("", "default", "Pod/stray")] is Presence.ENTERING
    assert result.after.allocated_ms == (10 + 20 + 10 + 10 + 10) * H


def test_other_units_are_compared_apart(scenario: tuple[Team, Team]) -> None:
    alpha, _ = scenario
    result = compare_windows(team=alpha, before=BEFORE, after=AFTER, unit=Unit.TPU)
    assert result.decomposition.parts is None  # no TPU hours before
    assert result.decomposition.after.allocated_ms == 50 * H


def test_claims_without_an_owner_are_jobs_of_their_own(teams: tuple[Team, Team]) -> None:
    alpha, _ = teams
    usage(alpha, BEFORE.start, "", 10, 5, claim="notebook-1")
    usage(alpha, BEFORE.start, "", 10, 5, claim="notebook-2")
    usage(alpha, AFTER.start, "", 10, 10, claim="notebook-1")
    jobs = by_job(compare_windows(team=alpha, before=BEFORE, after=AFTER).decomposition)
    assert jobs[JobKey("alpha", "ml", "", "notebook-1")].presence is Presence.BOTH
    assert jobs[JobKey("alpha", "ml", "", "notebook-2")].presence is Presence.LEAVING


def test_job_rows_put_the_biggest_contribution_first(teams: tuple[Team, Team]) -> None:
    alpha, _ = teams
    usage(alpha, BEFORE.start, "Job/a", 10, 5)
    usage(alpha, AFTER.start, "Job/a", 10, 5)
    usage(alpha, AFTER.start, "Job/c", 10, 9)
    rows = job_rows(compare_windows(team=alpha, before=BEFORE, after=AFTER))
    assert [(row["job"], row["kind"], row["change_pp"]) for row in rows] == [
        ("Job/c", "entering", Decimal("20.0000")),
        ("Job/a", "both", Decimal("0.0000")),
    ]
    assert list(rows[0]) == list(ROW_COLUMNS)
    assert rows[0]["after_share_pct"] == Decimal("50.0000")
    assert rows[0]["before_utilisation_pct"] is None


# --- The command ---------------------------------------------------------------------------------

WINDOW_ARGS = ["--before", "2026-11-02", "2026-11-09", "--after", "2026-11-09", "2026-11-16"]


def run(*args: str) -> str:
    out = io.StringIO()
    call_command("compare_windows", *args, stdout=out)
    return out.getvalue()


def test_the_command_prints_a_table(scenario: tuple[Team, Team]) -> None:
    text = run("--team", "alpha", *WINDOW_ARGS)
    lines = text.splitlines()
    assert lines[0] == "alpha: utilisation of GPU-hours (utilised / measured)"
    assert "70.00%" in lines[1] and "allocated 20.00 h" in lines[1]
    assert "85.00%" in lines[2] and "allocated 40.00 h" in lines[2]
    assert "+15.00 points" in lines[3]
    assert lines[4].split() == ["workload", "mix", "(jobs", "in", "both)", "+7.50"]
    assert lines[5].split()[-1] == "+7.50"
    assert lines[6].split() == ["jobs", "entering", "0.00"]
    job_lines = [line.split() for line in lines if line.strip().startswith("alpha:ml/")]
    assert [line[0] for line in job_lines] == ["alpha:ml/Job/a", "alpha:ml/Job/b"]
    assert job_lines[0][2:] == ["50.00", "70.00", "+4.38", "+7.50", "0.00", "+11.88"]
    assert job_lines[0][-1] == "+11.88"  # 7/160 + 3/40 = 0.11875, half to even
    assert job_lines[1][-1] == "+3.12"  # 1/32 = 0.03125


def test_the_command_writes_json_and_csv(scenario: tuple[Team, Team]) -> None:
    body = json.loads(run("--fleet", *WINDOW_ARGS, "--format", "json"))
    assert body["scope"] == "fleet" and body["team"] is None
    assert body["before"]["start"] == "2026-11-02T00:00:00+00:00"
    assert body["jobs"] == {"both": 2, "entering": 2, "leaving": 0, "unmeasured": 0}
    assert Fraction(body["exact"]["change"]) == sum(
        Fraction(body["exact"][name]) for name in ("mix", "efficiency", "entering", "leaving")
    )
    rows = list(
        csv.DictReader(io.StringIO(run("--team", "alpha", *WINDOW_ARGS, "--format", "csv")))
    )
    assert [row["kind"] for row in rows] == ["total", "both", "both"]
    assert rows[0]["change_pp"] == "15.0000" and rows[0]["mix_pp"] == "7.5000"
    assert rows[1]["job"] == "Job/a" and rows[1]["efficiency_pp"] == "7.5000"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--team", "nope", *WINDOW_ARGS], "--team: no team 'nope'"),
        (
            ["--team", "alpha", "--before", "2026-11-09", "2026-11-02", *WINDOW_ARGS[3:]],
            "--before: end: the window is reversed",
        ),
        (
            ["--fleet", *WINDOW_ARGS[:3], "--after", "2026-11-09T10:30", "2026-11-16"],
            "--after: start: '2026-11-09T10:30' is not on a whole UTC hour",
        ),
        (["--fleet", *WINDOW_ARGS, "--unit", "qpu"], "--unit: 'qpu' is not a unit"),
    ],
)
def test_the_command_names_what_is_wrong(
    teams: tuple[Team, Team], args: list[str], message: str
) -> None:
    with pytest.raises(CommandError, match=message):
        run(*args)


def test_a_window_without_measured_hours_says_so(teams: tuple[Team, Team]) -> None:
    alpha, _ = teams
    usage(alpha, AFTER.start, "Job/a", 10, 5)
    text = run("--team", "alpha", *WINDOW_ARGS)
    assert "n/a" in text.splitlines()[1]
    assert "No change to split: a window has no measured hours." in text


def test_overlapping_windows_count_a_shared_hour_in_each(teams: tuple[Team, Team]) -> None:
    alpha, _ = teams
    usage(alpha, AFTER.start, "Job/a", 10, 5)
    usage(alpha, AFTER.start + timedelta(hours=1), "Job/a", 10, 10)
    first_hour = Window(AFTER.start, AFTER.start + timedelta(hours=1))
    result = compare_windows(team=alpha, before=AFTER, after=first_hour).decomposition
    assert (result.before.allocated_ms, result.after.allocated_ms) == (20 * H, 10 * H)
    assert result.parts == Parts(efficiency=Fraction(-1, 4))
