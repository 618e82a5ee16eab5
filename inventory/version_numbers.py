"""Version numbers as drivers publish them and operators write them, compared as versions.

Drivers publish DRA `version` attributes, which Kubernetes checks as semantic versions
(`580.82.7`, `13.0.0`); operators copy versions as `nvidia-smi` prints them (`580.82.07`, CUDA
`13.0`). Both spellings name one version, so versions are compared in a normal form: numeric
release components as integers (leading zeros dropped) with trailing zeros dropped (`13.0` is
`13.0.0`), then a semver pre-release (`-rc.1`, older than its release) compared as semver
does; build metadata (`+build.5`) is ignored, as semver ranks it. Text is kept as written, for
display.

Why not a library: `packaging` (PEP 440) agrees on the release part but refuses semver
pre-releases a driver may publish (`1.0.0-x.7.z`) and ranks `+local` parts; `semver` refuses the
operators' spellings (`13.0`, `580.82.07`). The rules fit in this module, the one owner of the
concept (`inventory.versions` judges baselines with it; the models validate with it).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any

from django.core.exceptions import ValidationError

_VERSION = re.compile(
    r"(?P<release>\d+(?:\.\d+)*)"
    r"(?:-(?P<pre>[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?"
    r"(?:\+(?P<build>[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?"
)
MAX_VERSION_LENGTH = 64
VERSION_HINT = "numbers separated by dots, e.g. 580.82.07 or 13.0 (optionally -rc.1)"


class VersionError(ValueError):
    """Text that is no version; the message says what was given and what is expected."""


@functools.total_ordering
@dataclass(frozen=True)
class Version:
    """A parsed version: equal and ordered by its normal form, whatever its spelling."""

    # Release components with trailing zeros dropped: (13,) for "13.0.0".
    release: tuple[int, ...]
    # Semver pre-release identifiers, numeric ones as (0, n, ""), others as (1, 0, text).
    pre_release: tuple[tuple[int, int, str], ...]
    text: str = field(compare=False)

    @property
    def sort_key(self) -> tuple[Any, ...]:
        # A release ranks above its pre-releases; tuples compare component by component.
        return (self.release, not self.pre_release, self.pre_release)

    @property
    def normal(self) -> str:
        """The normal form as text: "580.82.7", "13" (for 13.0.0), "1.2-rc.1"."""
        release = ".".join(str(part) for part in self.release) or "0"
        if not self.pre_release:
            return release
        return release + "-" + ".".join(text or str(number) for _, number, text in self.pre_release)

    def __lt__(self, other: Version) -> bool:
        return self.sort_key < other.sort_key


def parse_version(text: str) -> Version:
    """`text` as a Version; raises `VersionError` naming it when it is no version."""
    stripped = text.strip()
    found = _VERSION.fullmatch(stripped) if len(stripped) <= MAX_VERSION_LENGTH else None
    if found is None:
        raise VersionError(f"{text!r} is not a version ({VERSION_HINT})")
    release = [int(part) for part in found["release"].split(".")]
    while release and release[-1] == 0:
        release.pop()
    pre = tuple(
        (0, int(part), "") if part.isdigit() else (1, 0, part)
        for part in (found["pre"] or "").split(".")
        if part
    )
    return Version(release=tuple(release), pre_release=pre, text=text)


def version_error(text: str) -> str:
    """What is wrong with a version an operator wrote ("" when nothing is; empty is allowed:
    it pins nothing)."""
    if not text.strip():
        return ""
    try:
        parse_version(text)
    except VersionError as exc:
        return str(exc)
    return ""


def same_version(published: str, wanted: str) -> bool:
    """Whether two versions are one, compared in their normal form; text that is no version
    (a driver's free-form string) is equal only to the same text."""
    try:
        return parse_version(published) == parse_version(wanted)
    except VersionError:
        return published.strip() == wanted.strip()


def version_key(version: str) -> tuple[Any, ...]:
    """Sort key that orders versions numerically ("580.126.20" is newer than "580.82.07");
    text that is no version sorts before every version, by its text."""
    try:
        return (1, parse_version(version).sort_key)
    except VersionError:
        return (0, version)


def validate_version_text(value: str) -> None:
    """Model field validator: empty (pins nothing) or a version."""
    error = version_error(value)
    if error:
        raise ValidationError(error, code="invalid_version")
