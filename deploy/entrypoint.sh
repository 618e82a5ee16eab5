#!/bin/sh
# The image's entrypoint: the first argument names the process, the rest go to it.
#   web (default)  gunicorn config.wsgi with deploy/gunicorn.conf.py (TLS, listeners, metrics)
#   worker         the Celery worker          beat     the Celery beat scheduler
#   sync           manage.py sync_inventory   agent    the node agent (python -m agent)
#   migrate        manage.py migrate          manage   any manage.py command
# Anything else is run as given (e.g. `sh`), for debugging.
set -eu
role="${1:-web}"
[ "$#" -gt 0 ] && shift
case "$role" in
  web)     exec gunicorn --config /opt/tally/etc/gunicorn.conf.py config.wsgi "$@" ;;
  worker)  exec celery --app config worker --loglevel "${LOG_LEVEL:-info}" "$@" ;;
  # The schedule is in the database (CELERY_BEAT_SCHEDULER), edited in the admin: no file.
  beat)    exec celery --app config beat --loglevel "${LOG_LEVEL:-info}" "$@" ;;
  sync)    exec django-admin sync_inventory "$@" ;;
  agent)   exec python -m agent "$@" ;;
  migrate) exec django-admin migrate --noinput "$@" ;;
  manage)  exec django-admin "$@" ;;
  *)       exec "$role" "$@" ;;
esac
