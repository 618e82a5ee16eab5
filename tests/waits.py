"""Waiting in a test for what another thread or process is to do: it goes on as soon as that
is done, and fails, saying what it waited for, once `seconds` have passed."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(
    condition: Callable[[], object], what: str | Callable[[], str], *, seconds: float
) -> None:
    """Returns as soon as `condition()` holds; fails with `what` (or what `what()` says at
    that moment) if it does not within `seconds`."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            described = what if isinstance(what, str) else what()
            raise AssertionError(f"not within {seconds:g} s: {described}")
        time.sleep(0.01)
