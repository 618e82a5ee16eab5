"""Every metering test that wrote samples leaves the per device-hour sums equal to a recompute
from its samples (`tests.metering.sums_check`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.metering.sums_check import check_after_each_test


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[Any]:
    return (yield from check_after_each_test(item))
