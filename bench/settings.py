"""Settings for `bench.webhook`'s gunicorn: the project's own, plus the bench's no-op endpoint."""

from config.settings import *  # noqa: F403

ROOT_URLCONF = "bench.webhook_urls"
