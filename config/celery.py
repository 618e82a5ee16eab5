"""The Celery app; tasks live in each app's `tasks.py`."""

import os

from celery import Celery, signals

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

app = Celery("tally")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@signals.worker_init.connect
@signals.beat_init.connect
def _serve_metrics(**_: object) -> None:
    """Worker and beat have no web server: serve their metrics on TALLY_WORKER_METRICS_PORT."""
    port = os.environ.get("TALLY_WORKER_METRICS_PORT")
    if port:
        from config.metrics import start_metrics_server

        start_metrics_server(int(port))
