"""What an admission sets on its PostgreSQL transaction: timeouts and commit durability."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.test import Client

from tests.quota.fixtures import claim, decide, gpu_request, make_team

# Not a transactional test: the admission's savepoint runs inside the test's transaction, so
# what it set with set_config(..., true) is still visible on the connection afterwards.
pytestmark = [pytest.mark.postgres, pytest.mark.django_db, pytest.mark.usefixtures("fleet")]


def _show(name: str) -> str:
    with connection.cursor() as cursor:
        cursor.execute(f"SHOW {name}")
        value: str = cursor.fetchone()[0]
        return value


@pytest.mark.parametrize(("durable", "expected"), [(True, "on"), (False, "off")])
def test_an_admission_bounds_its_waits_and_commits_as_configured(
    client: Client, settings: Any, durable: bool, expected: str
) -> None:
    settings.TALLY_WEBHOOK_DB_TIMEOUT_MS = 1234
    settings.TALLY_WEBHOOK_SYNCHRONOUS_COMMIT = durable
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 10}])
    assert decide(client, claim("c", [gpu_request(1)]))["allowed"] is True
    assert _show("statement_timeout") == "1234ms"
    assert _show("lock_timeout") == "1234ms"
    assert _show("synchronous_commit") == expected
