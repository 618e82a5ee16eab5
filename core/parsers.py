"""The API's JSON parser: request bodies read through `core.inputs`, bounded in size and
depth, so that a body nested thousands deep or holding an integer of thousands of digits is a
400 with a reason, never a 500 (DRF's own parser lets the stdlib's `RecursionError` through).

A helper of the project package: it imports Django, DRF and `core.inputs`, never an app.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import IO, Any

from django.conf import settings
from rest_framework import renderers, status
from rest_framework.exceptions import APIException, ParseError
from rest_framework.parsers import BaseParser

from core.inputs import BadInput, parse_json


class RequestTooLarge(APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_detail = "The request body is too large."
    default_code = "request_too_large"


class JsonParser(BaseParser):
    """`application/json` bodies of at most DATA_UPLOAD_MAX_MEMORY_SIZE bytes (413 beyond:
    DRF reads the stream itself, so Django's own check of that limit never runs), parsed by
    `core.inputs.parse_json` (400 naming the problem). JSON is UTF-8 (RFC 8259)."""

    media_type = "application/json"
    renderer_class = renderers.JSONRenderer

    def parse(
        self,
        stream: IO[Any],
        media_type: str | None = None,
        parser_context: Mapping[str, Any] | None = None,
    ) -> Any:
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        body = stream.read() if limit is None else stream.read(limit + 1)
        if limit is not None and len(body) > limit:
            raise RequestTooLarge(f"The request body is larger than {limit} bytes.")
        try:
            return parse_json(body)
        except BadInput as exc:
            raise ParseError(f"JSON parse error - {exc}") from None
