"""A driver profile spec that `validate_spec` accepts is one every later sync accepts.

The policy file (and the admin) store what `validate_spec` returns in `DriverProfile.spec`, a
PostgreSQL JSON column; each sync reads it back and checks it again (`ProfileBook`). A spec
that passed the first check and fails the second (a capacity `equals: true` that reads back as
"True", NaN that PostgreSQL cannot store) would be applied and then silently ignored.
"""

from __future__ import annotations

import textwrap
from datetime import date
from typing import Any

import pytest
from django.db import transaction
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inventory import profiles
from inventory.models import DriverProfile
from quota.policy import PolicyError, load_policy

pytestmark = pytest.mark.django_db
DRIVER = "npu.example.com"

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.dates(min_value=date(2000, 1, 1), max_value=date(2100, 1, 1)),
    st.sampled_from(
        [
            *profiles.UNITS,
            *profiles.SHARE_RULES,
            "accelerator",
            "other",
            "0",
            "16Gi",
            "1.5",
            "1e3Ki",
            "NaN",
            "Infinity",
            "sNaN",
            "9e999999Ei",
            "lots",
            " memory ",
            "a\x00b",
            "",
        ]
    ),
)
VALUES = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(st.one_of(st.text(max_size=6), st.integers()), children, max_size=3),
    max_leaves=6,
)
EXCLUSIONS = st.lists(
    st.dictionaries(
        st.sampled_from(["attribute", "capacity", "equals", "other"]),
        st.one_of(SCALARS, st.sampled_from(["memory", "model"])),
        max_size=3,
    ),
    max_size=3,
)
KEYS = st.sampled_from(sorted(profiles.SPEC_KEYS))
SPECS = st.dictionaries(
    st.one_of(KEYS, KEYS, KEYS, st.text(max_size=6), st.integers(0, 3)),
    st.one_of(VALUES, EXCLUSIONS, st.lists(st.text(min_size=1, max_size=6), max_size=3)),
    max_size=5,
)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(spec=SPECS)
def test_any_spec_validate_spec_accepts_the_sync_accepts(spec: dict[Any, Any]) -> None:
    try:
        clean = profiles.validate_spec(spec, f"drivers.{DRIVER}")
    except profiles.ProfileError as exc:
        message = str(exc)
        assert message.startswith("drivers.") and "\n" not in message
        return
    assert profiles.validate_spec(clean) == clean  # checking it again changes nothing
    with transaction.atomic():
        DriverProfile.objects.create(driver=DRIVER, spec=clean, source="policy")
        book = profiles.ProfileBook.load()
        stored = book.get(DRIVER)
        transaction.set_rollback(True)
    assert book.errors == []
    assert stored == profiles.effective_profile(DRIVER, clean, "policy")


@pytest.mark.parametrize(
    ("entry", "error"),
    [
        (
            "{capacity: memory, equals: true}",
            "drivers.npu.example.com.exclude[0].equals: True is not a quantity",
        ),
        (
            "{capacity: memory, equals: .nan}",
            "drivers.npu.example.com.exclude[0].equals: nan is not a finite quantity",
        ),
        (
            "{capacity: memory, equals: .inf}",
            "drivers.npu.example.com.exclude[0].equals: inf is not a finite quantity",
        ),
        (
            "{attribute: healthy, equals: .nan}",
            "drivers.npu.example.com.exclude[0].equals: must be a string, integer or boolean",
        ),
        (
            "{attribute: since, equals: 2026-01-01}",
            "drivers.npu.example.com.exclude[0].equals: must be a string, integer or boolean",
        ),
        (
            "{attribute: index, equals: 99999999999999999999}",
            "drivers.npu.example.com.exclude[0].equals: 99999999999999999999 is out of range",
        ),
        ('{attribute: "a\\0b", equals: 1}', "drivers.npu.example.com.exclude[0].attribute: must"),
        ("{1: memory, equals: 0}", "drivers.npu.example.com.exclude[0][1]: a key must be"),
    ],
)
def test_the_policy_file_refuses_what_the_sync_would_naming_the_key(entry: str, error: str) -> None:
    text = f"teams: []\ndrivers:\n  {DRIVER}:\n    exclude: [{entry}]\n"
    with pytest.raises(PolicyError) as caught:
        load_policy(textwrap.dedent(text))
    assert len(caught.value.errors) == 1
    assert caught.value.errors[0].startswith(error), caught.value.errors


def test_numbers_are_stored_as_quantities_the_sync_reads_back_the_same() -> None:
    clean = profiles.validate_spec(
        {"exclude": [{"capacity": "memory", "equals": 0.1}, {"attribute": "ok", "equals": True}]}
    )
    assert clean["exclude"] == [
        {"capacity": "memory", "equals": "0.1"},
        {"attribute": "ok", "equals": True},
    ]
