"""Issue 35, finding 9: beat's runs logged only "Sending due task", never what they did. Every
task on beat's schedule logs one INFO line of what it did, with its counts."""

from __future__ import annotations

import importlib
import logging
import re
from typing import Any

import pytest
from django.apps import apps
from django.conf import settings
from django.utils.module_loading import module_has_submodule

from billing import tasks
from config.celery import app

pytestmark = pytest.mark.django_db(transaction=True)

SCHEDULED = sorted({str(entry["task"]) for entry in settings.CELERY_BEAT_SCHEDULE.values()})


@pytest.mark.parametrize("name", SCHEDULED)
def test_each_beat_task_logs_one_line_of_what_it_did(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    # By its registered name, as beat sends it: a task keeps its name when its code moves
    # (`billing.tasks.sample_retention` is `metering.tasks`'), and logs under its module.
    for config in apps.get_app_configs():  # Celery's autodiscovery, at once
        if module_has_submodule(config.module, "tasks"):
            importlib.import_module(f"{config.name}.tasks")
    task: Any = app.tasks[name]
    module = task.__module__
    with caplog.at_level(logging.INFO, logger=module):
        task.apply(throw=True)
    lines = [
        r.getMessage() for r in caplog.records if r.name == module and r.levelno >= logging.INFO
    ]
    assert len(lines) == 1, f"{name} logged {lines}"
    assert re.search(r"\d|none due", lines[0]), f"{name} logged no count: {lines[0]!r}"


def test_the_rollup_and_alert_lines_say_what_was_done(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="billing.tasks"):
        tasks.rollup_pending.apply(throw=True)
        tasks.evaluate_alerts.apply(throw=True)
    rollup, alerts = (r.getMessage() for r in caplog.records if r.name == "billing.tasks")
    assert re.fullmatch(
        r"rollup: \d+ hour\(s\) rolled up.*; open period's statements refreshed", rollup
    )
    assert alerts.startswith("alerts: idle_claim 0 raised, 0 firing, 0 resolved; ")
    assert alerts.endswith("; notifications 0 sent, 0 retrying, 0 failed")
