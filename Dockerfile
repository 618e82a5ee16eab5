# syntax=docker/dockerfile:1
# Tally's one image: web (default), worker, beat, sync, agent and migrate (see deploy/README.md).
#
#   docker build -t ghcr.io/tally-dev/tally:0.1.0 .
#
# Stage 1 builds the project and its pinned dependencies into a virtualenv; stage 2 copies only
# that virtualenv onto a slim base: no compiler, no pip cache, no source tree.

ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential \
 && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/tally
ENV PATH=/opt/tally/bin:$PATH
WORKDIR /src
# Dependencies first, so a code change does not reinstall them.
COPY pyproject.toml README.md ./
RUN python - <<'PY' > /tmp/requirements.txt
import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))
PY
RUN pip install -r /tmp/requirements.txt
COPY config ./config
COPY core ./core
COPY db ./db
COPY teams ./teams
COPY inventory ./inventory
COPY metering ./metering
COPY billing ./billing
COPY quota ./quota
COPY frontend ./frontend
COPY demo ./demo
COPY agent ./agent
RUN pip install --no-deps . \
 && python - <<'PY'
# Fail the build, not the pod, when package data (templates, static files) did not install.
import pathlib, frontend
root = pathlib.Path(frontend.__file__).parent
missing = [d for d in ("templates", "static") if not (root / d).is_dir()]
assert not missing, f"frontend/{missing} not in the installed package: see pyproject package-data"
PY
# Static files are collected at build time; whitenoise serves them from the image.
RUN DEBUG=false SECRET_KEY=build-only CELERY_BROKER_URL=memory:// \
    DATABASE_URL=postgres://build-only@127.0.0.1:1/unused \
    DJANGO_SETTINGS_MODULE=config.settings django-admin collectstatic --noinput \
 && python -m compileall -q /opt/tally
COPY deploy/gunicorn.conf.py deploy/entrypoint.sh /opt/tally/etc/

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="tally" \
      org.opencontainers.image.description="Multi-tenant GPU quota and chargeback for Kubernetes DRA"
ENV PATH=/opt/tally/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    DJANGO_SETTINGS_MODULE=config.settings
COPY --from=build /opt/tally /opt/tally
RUN groupadd --system --gid 10001 tally \
 && useradd --system --uid 10001 --gid tally --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin tally \
 && chmod 0555 /opt/tally/etc/entrypoint.sh
USER 10001:10001
WORKDIR /tmp
EXPOSE 8000 8443 8444 9090
ENTRYPOINT ["/opt/tally/etc/entrypoint.sh"]
CMD ["web"]
