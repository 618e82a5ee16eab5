"""Settings for `bench.ingest_http`'s gunicorn: the project's own, plus the ingest floor."""

from config.settings import *  # noqa: F403

ROOT_URLCONF = "bench.ingest_urls"
