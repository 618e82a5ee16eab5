"""Every billing test that wrote samples leaves the per device-hour sums equal to a recompute
from its samples: the metering tests' check (`tests.metering.conftest`), for these too."""

from tests.metering.conftest import pytest_runtest_call

__all__ = ["pytest_runtest_call"]
