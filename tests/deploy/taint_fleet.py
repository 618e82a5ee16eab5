"""The fleet the taint tests judge (tests/deploy/conftest.py's `cluster`) and how they read back
Tally's DeviceTaintRules from the fake API server."""

from __future__ import annotations

from tests.deploy.fake_api import FakeApi

# The older pair node-old runs, in the NVIDIA DRA driver's spelling; the factory's devices run
# 580.82.7 / 13.0.0.
OLD = {"driver_version": "570.172.8", "cuda_driver_version": "12.8.0"}


def rules(api: FakeApi) -> dict[str, dict]:
    return {
        name: rule
        for name in api.names("DeviceTaintRule")
        if (rule := api.get("DeviceTaintRule", name)) is not None
    }
