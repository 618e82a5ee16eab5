"""Fixtures of the tests that talk to the fake API server (tests/deploy/fake_api.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from inventory.models import Cluster
from tests.deploy.fake_api import FakeApi
from tests.deploy.taint_fleet import OLD
from tests.factories import ClusterFactory, DeviceFactory, NodeFactory


@pytest.fixture
def api() -> Iterator[FakeApi]:
    with FakeApi() as fake:
        yield fake


@pytest.fixture
def cluster() -> Cluster:
    """Four H100 nodes: three on the baseline pair, node-old on an older driver (`OLD`)."""
    cluster = ClusterFactory.create(name="prod")
    for name in ("node-a", "node-b", "node-c"):
        DeviceFactory.create_batch(2, node=NodeFactory.create(cluster=cluster, name=name))
    DeviceFactory.create_batch(2, node=NodeFactory.create(cluster=cluster, name="node-old"), **OLD)
    return cluster
