"""JSON logs that carry the request they belong to.

`RequestIdMiddleware` takes the caller's `X-Request-Id` (or makes one), answers it back in the
response header, and binds it, for the admission webhooks also the AdmissionReview's uid, to
the request's context. `RequestContextFilter` copies what is bound onto every log record, so
every line logged while serving the request, in any module, names it; `JsonFormatter` writes
one JSON object per line with those fields. Context variables, not thread-locals: each
request (thread or task) sees only its own.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from django.http import HttpRequest, HttpResponse
from pythonjsonlogger.json import JsonFormatter as _BaseJsonFormatter

from core.inputs import parse_json

REQUEST_ID_HEADER = "X-Request-Id"
ADMISSION_PREFIX = "/admission/"
# An id from outside is echoed into logs and headers: accept only a short, plain token.
_VALID_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# Larger bodies are not parsed for their uid (an AdmissionReview is a few kilobytes).
_ADMISSION_BODY_LIMIT = 1 << 20
# The request attribute that holds an AdmissionReview body once parsed.
PARSED_REVIEW = "tally_parsed_review"

_log_context: ContextVar[dict[str, str] | None] = ContextVar("tally_log_context", default=None)
request_log = logging.getLogger("tally.request")


@contextmanager
def bound(**fields: str) -> Iterator[None]:
    """`fields` on every log record within the block, then what was bound before."""
    token = _log_context.set({**(_log_context.get() or {}), **fields})
    try:
        yield
    finally:
        _log_context.reset(token)


def request_id_from(header: str | None) -> str:
    """The caller's request id when it is a plain token, else a new random one."""
    if header and _VALID_REQUEST_ID.fullmatch(header):
        return header
    return uuid.uuid4().hex


def admission_uid(request: HttpRequest) -> str | None:
    """The `request.uid` of an AdmissionReview body, or None when there is none to read."""
    if request.method != "POST" or not request.path_info.startswith(ADMISSION_PREFIX):
        return None
    try:
        if int(request.headers.get("Content-Length") or 0) > _ADMISSION_BODY_LIMIT:
            return None
        # Bounded (core.inputs): a body nested thousands deep is refused, not a crash here.
        review = parse_json(request.body)
    except ValueError:  # core.inputs.BadInput among them
        return None  # the view answers 400 with the reason
    # Parsed once, as the view would: the webhook's view reads it from here.
    setattr(request, PARSED_REVIEW, review)
    review_request = review.get("request") if isinstance(review, dict) else None
    uid = review_request.get("uid") if isinstance(review_request, dict) else None
    return uid if isinstance(uid, str) and uid else None


class RequestIdMiddleware:
    """Bind the request id (and an AdmissionReview's uid) to the request's log records.

    Logs one `tally.request` line per request, with method, path, status and duration.
    Goes first in `MIDDLEWARE`, so that the other middleware's records carry the id too.
    """

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        request_id = request_id_from(request.headers.get(REQUEST_ID_HEADER))
        fields = {"request_id": request_id}
        uid = admission_uid(request)
        if uid is not None:
            fields["admission_uid"] = uid
        started = time.perf_counter()
        with bound(**fields):
            response = self.get_response(request)
            response[REQUEST_ID_HEADER] = request_id
            request_log.info(
                "%s %s %s",
                request.method,
                request.path,
                response.status_code,
                extra={
                    "method": request.method,
                    "path": request.path,
                    "status": response.status_code,
                    "duration_ms": round((time.perf_counter() - started) * 1000, 1),
                },
            )
        return response


class RequestContextFilter(logging.Filter):
    """Copy the fields bound to the current context onto each record (never drops one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for name, value in (_log_context.get() or {}).items():
            if not hasattr(record, name):
                setattr(record, name, value)
        return True


class JsonFormatter(_BaseJsonFormatter):
    """One JSON object per line: time, level, logger, message, then any extra fields."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("fmt", "%(asctime)s %(levelname)s %(name)s %(message)s")
        kwargs.setdefault(
            "rename_fields", {"asctime": "time", "levelname": "level", "name": "logger"}
        )
        kwargs.setdefault("datefmt", "%Y-%m-%dT%H:%M:%S%z")
        super().__init__(*args, **kwargs)


def library_loggers(level: str) -> dict[str, dict[str, str]]:
    """Levels for chatty libraries' loggers, for both log formats.

    Celery's "received" and "succeeded" lines for every task run (the rollup runs each
    minute) show only at DEBUG: the tasks' own warnings and errors, and their metrics, say
    what matters.
    """
    per_task = "DEBUG" if level == "DEBUG" else "WARNING"
    return {
        "kubernetes": {"level": "WARNING"},
        "urllib3": {"level": "WARNING"},
        # django-axes: a "BEGIN" line per process, and one per login; lockouts are warnings.
        "axes": {"level": "WARNING"},
        "celery.app.trace": {"level": per_task},
        "celery.worker.strategy": {"level": per_task},
    }


def logging_config(level: str) -> dict[str, Any]:
    """The `LOGGING` dict for settings: JSON lines on stderr, with the request's fields."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"request_context": {"()": "core.logging.RequestContextFilter"}},
        "formatters": {"json": {"()": "core.logging.JsonFormatter"}},
        "handlers": {
            "console": {
                "class": "logging.StreamHandler",
                "formatter": "json",
                "filters": ["request_context"],
            }
        },
        "root": {"handlers": ["console"], "level": level},
        "loggers": {
            **library_loggers(level),
            # Gunicorn's own lines (start-up, worker exits) in the same format.
            "gunicorn.error": {"handlers": ["console"], "level": level, "propagate": False},
        },
    }


class OneLineForbidden(logging.Filter):
    """A 403 that `django.request` logs (PermissionDenied) without its traceback: a refusal is
    expected, one warning line says it (never drops one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "status_code", None) == 403:
            record.exc_info = None
            record.exc_text = None
        return True


def quiet_django(config: dict[str, Any]) -> dict[str, Any]:
    """`config` (a `LOGGING` dict) with each Django line logged once: Django's own handler on
    the "django" logger (its console, under DEBUG) is dropped, its records going to the root's
    handlers only; and 403s logged as one line (`OneLineForbidden`)."""
    return {
        **config,
        "filters": {
            **config.get("filters", {}),
            "one_line_forbidden": {"()": "core.logging.OneLineForbidden"},
        },
        "loggers": {
            **config.get("loggers", {}),
            "django": {"handlers": [], "propagate": True},
            "django.request": {"filters": ["one_line_forbidden"]},
        },
    }
