"""Fixtures of the sync tests: `devtools.fake_kube` serving, and the real client talking to it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devtools.fake_kube import FakeKube
from inventory import kube, services
from inventory.models import Cluster


@pytest.fixture
def fake() -> Iterator[FakeKube]:
    with FakeKube(max_lifetime_seconds=60) as server:
        yield server


@pytest.fixture
def kubeconfig(fake: FakeKube, tmp_path: Path) -> Path:
    return fake.write_kubeconfig(tmp_path / "kubeconfig")


@pytest.fixture
def api_client(kubeconfig: Path) -> Iterator[Any]:
    client = kube.api_client(kubeconfig=str(kubeconfig))
    yield client
    client.close()


@pytest.fixture
def cluster() -> Cluster:
    return services.get_cluster("lab")
