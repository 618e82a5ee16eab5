"""A new web worker gets ready before it serves: the fleet's shapes loaded and the device
classes' and quota rules' selectors evaluated on them."""

from __future__ import annotations

import gc
import logging
import runpy
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from django.test import Client

from inventory.models import Cluster
from quota.admission import service, shapes
from tests.quota.fixtures import claim, decide, gpu_request, make_team

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fleet")]
H100 = 'device.attributes["gpu.nvidia.com"].productName.startsWith("NVIDIA H100")'
MIG_1G = 'device.attributes["gpu.nvidia.com"].profile == "1g.5gb"'
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def cold() -> None:
    """As in a process that has just started."""
    service.forget_caches()


def _rules() -> None:
    make_team(
        [
            {"name": "h100", "device_class": "gpu.nvidia.com", "selector": H100, "limit": 4},
            {"name": "mig-1g", "device_class": "mig.nvidia.com", "selector": MIG_1G, "limit": 2},
            {"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 8},
        ]
    )


def _expected_pairs() -> set[tuple[str, int]]:
    fleet = shapes.fleet_shapes(cluster=Cluster.objects.get(name="default"))
    expressions = {H100, MIG_1G} | {
        expression for exprs in fleet.class_selectors.values() for expression in exprs
    }
    return {(expression, shape_id) for expression in expressions for shape_id in fleet.shapes}


def test_a_warmed_worker_knows_every_rule_and_class_selector_on_every_shape(
    settings: Any, client: Client
) -> None:
    settings.TALLY_WARM_UP_SECONDS = 10
    _rules()
    assert not shapes._matches
    service.warm_up_worker()
    expected = _expected_pairs()
    assert len(expected) > 20
    assert expected <= set(shapes._matches)

    # The first admission then evaluates nothing new: its class's and its rules' selectors
    # are all known on every shape.
    known = dict(shapes._matches)
    assert decide(client, claim("c", [gpu_request(1)]))["allowed"] is True
    assert shapes._matches == known


def test_without_it_the_first_admission_evaluates_them(settings: Any, client: Client) -> None:
    _rules()
    assert decide(client, claim("c", [gpu_request(1)]))["allowed"] is True
    assert len(shapes._matches) > 0


def test_no_warm_up_when_it_is_given_no_time(settings: Any) -> None:
    settings.TALLY_WARM_UP_SECONDS = 0
    _rules()
    service.warm_up_worker()
    assert not shapes._matches


def test_the_warm_up_stops_at_its_deadline() -> None:
    _rules()
    cluster = Cluster.objects.get(name="default")
    assert shapes.warm_up(cluster=cluster, seconds=-1) == 0
    assert shapes.warm_up(cluster=cluster, seconds=10) == len(_expected_pairs())


def test_a_database_it_cannot_reach_leaves_the_worker_serving(
    settings: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings.TALLY_WARM_UP_SECONDS = 10
    settings.TALLY_CLUSTER_NAME = "elsewhere"  # not cached: the warm-up must ask the database

    def unreachable(*args: Any, **kwargs: Any) -> Any:
        from django.db import OperationalError

        raise OperationalError("connection refused")

    monkeypatch.setattr(connection, "ensure_connection", unreachable)
    with caplog.at_level(logging.WARNING, logger="quota.admission.service"):
        service.warm_up_worker()  # does not raise
    assert "warm-up skipped: database unavailable" in caplog.text
    assert not shapes._matches


def test_gunicorn_warms_each_worker_it_starts(settings: Any) -> None:
    """deploy/gunicorn.conf.py's post_worker_init hook is the warm-up."""
    settings.TALLY_WARM_UP_SECONDS = 10
    _rules()
    conf = runpy.run_path(str(REPO / "deploy" / "gunicorn.conf.py"))
    frozen = gc.get_freeze_count()
    try:
        conf["post_worker_init"](None)
        # What the worker holds once warm is kept out of the cyclic collector's full walks.
        assert gc.get_freeze_count() > frozen
    finally:
        gc.unfreeze()
    assert _expected_pairs() <= set(shapes._matches)
