"""Version numbers compared as versions (`inventory.version_numbers`): the spellings the
drivers publish and the ones operators copy from nvidia-smi are one version."""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError
from hypothesis import given
from hypothesis import strategies as st

from inventory.version_numbers import (
    VersionError,
    parse_version,
    same_version,
    validate_version_text,
    version_error,
    version_key,
)


@pytest.mark.parametrize(
    ("published", "written"),
    [
        # What the NVIDIA DRA driver publishes, and what nvidia-smi prints.
        ("580.82.7", "580.82.07"),
        ("580.95.5", "580.95.05"),
        ("580.126.9", "580.126.09"),
        ("13.0.0", "13.0"),
        ("13.0.0", "13"),
        ("570.172.8", "570.172.08"),
        ("6.12.12", "6.12.12"),  # the AMD MI300X driver
        ("1.0.0+build.5", "1.0.0"),  # semver: build metadata does not rank
    ],
)
def test_driver_and_nvidia_smi_spellings_are_one_version(published: str, written: str) -> None:
    assert same_version(published, written)
    assert parse_version(published) == parse_version(written)


@pytest.mark.parametrize(
    ("older", "newer"),
    [
        ("580.82.07", "580.126.9"),
        ("580.95.5", "580.126.9"),
        ("12.8.0", "13.0"),
        ("13.0", "13.0.1"),
        ("1.0.0-rc.1", "1.0.0"),
        ("1.0.0-alpha", "1.0.0-alpha.1"),
        ("1.0.0-alpha.1", "1.0.0-beta"),
        ("1.0.0-2", "1.0.0-rc"),  # numeric identifiers rank below alphanumeric ones
    ],
)
def test_versions_order_numerically(older: str, newer: str) -> None:
    assert parse_version(older) < parse_version(newer)
    assert version_key(older) < version_key(newer)
    assert not same_version(older, newer)


@pytest.mark.parametrize(
    "text", ["580.82.x", "v580.82.7", "13.", ".13", "580..82", "latest", "1" * 65]
)
def test_what_is_no_version_is_named_as_such(text: str) -> None:
    with pytest.raises(VersionError, match="is not a version"):
        parse_version(text)
    assert "is not a version" in version_error(text)
    with pytest.raises(ValidationError):
        validate_version_text(text)


def test_empty_pins_nothing_and_is_no_error() -> None:
    assert version_error("") == "" and version_error("  ") == ""
    validate_version_text("")


def test_text_that_is_no_version_equals_only_itself() -> None:
    # A driver's free-form version string is compared as text, and sorts before versions.
    assert same_version("R580 branch", "R580 branch")
    assert not same_version("R580 branch", "580")
    assert version_key("R580 branch") < version_key("0.0.1")


components = st.lists(st.integers(min_value=0, max_value=10_000), min_size=1, max_size=5)
identifiers = st.one_of(
    st.integers(min_value=0, max_value=99).map(str),
    st.sampled_from(["alpha", "beta", "rc", "x-1", "7z"]),
)


@st.composite
def spellings(draw: st.DrawFn) -> tuple[str, tuple[int, ...], tuple[str, ...]]:
    """A version written with any leading zeros and trailing zero components, and what it is:
    its release without trailing zeros and its pre-release identifiers."""
    release = draw(components)
    text = ".".join("0" * draw(st.integers(0, 2)) + str(part) for part in release)
    text += ".0" * draw(st.integers(0, 2))
    pre = tuple(draw(st.lists(identifiers, max_size=3)))
    if pre:
        text += "-" + ".".join(pre)
    if draw(st.booleans()):
        text += "+build." + str(draw(st.integers(0, 9)))
    meaning = list(release)
    while meaning and meaning[-1] == 0:
        meaning.pop()
    return text, tuple(meaning), tuple(str(int(p)) if p.isdigit() else p for p in pre)


@given(spellings(), spellings())
def test_equal_exactly_when_normal_forms_are_equal(
    a: tuple[str, tuple[int, ...], tuple[str, ...]],
    b: tuple[str, tuple[int, ...], tuple[str, ...]],
) -> None:
    left, right = parse_version(a[0]), parse_version(b[0])
    assert (left == right) == (left.normal == right.normal) == (a[1:] == b[1:])
    assert same_version(a[0], b[0]) == (left == right)
    if left == right:
        assert hash(left) == hash(right)


@given(spellings(), spellings(), spellings())
def test_order_is_total_on_parsed_versions(
    a: tuple[str, ...], b: tuple[str, ...], c: tuple[str, ...]
) -> None:
    x, y, z = (parse_version(str(v[0])) for v in (a, b, c))
    # Exactly one of <, ==, > holds, and < is transitive.
    assert [x < y, x == y, x > y].count(True) == 1
    assert (x <= y) == (x < y or x == y)
    if x < y and y < z:
        assert x < z
    assert (version_key(x.text) < version_key(y.text)) == (x < y)


@given(spellings())
def test_the_normal_form_parses_to_the_same_version(a: tuple[str, ...]) -> None:
    version = parse_version(str(a[0]))
    assert parse_version(version.normal) == version
