"""What every v1 endpoint shares: roles as permissions, pagination, ordering, CSV, base
viewsets, JSON errors and the schema's error body.

Tenancy is decided once, by `teams.selectors`: a viewset for team data is a `TeamScopedViewSet`,
whose queryset starts from `visible_teams(user=...)`, so another team's object is simply not
found (404). Roles come from `user_role`, read once per request.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from typing import TYPE_CHECKING, Any, ClassVar

import django_filters
from django.conf import settings
from django.db.models import F, QuerySet
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponsePermanentRedirect,
    JsonResponse,
)
from django.urls import Resolver404, resolve
from django.views import defaults
from django.views.decorators.csrf import csrf_exempt
from django_filters.rest_framework import DjangoFilterBackend
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.plumbing import ResolvedComponent
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import filters, serializers, viewsets
from rest_framework.exceptions import ValidationError
from rest_framework.pagination import PageNumberPagination
from rest_framework.permissions import BasePermission
from rest_framework.renderers import BaseRenderer, BrowsableAPIRenderer, JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView
from rest_framework.views import exception_handler as drf_exception_handler

from core.logging import REQUEST_ID_HEADER
from teams.models import Team
from teams.selectors import user_role, visible_teams

if TYPE_CHECKING:
    from _typeshed import SupportsWrite

OPERATOR, FINANCE, LEAD = "operator", "finance", "lead"

# --- Roles ------------------------------------------------------------------------------------

_ROLE_ATTRIBUTE = "_tally_role"


def request_role(request: Request) -> str | None:
    """The user's role (`quota.selectors.user_role`), looked up once per request."""
    if not hasattr(request, _ROLE_ATTRIBUTE):
        setattr(request, _ROLE_ATTRIBUTE, user_role(request.user))
    role: str | None = getattr(request, _ROLE_ATTRIBUTE)
    return role


class RolePermission(BasePermission):
    """Lets in users whose role is one of `roles`; anonymous users get 401, others 403."""

    roles: ClassVar[frozenset[str]] = frozenset()
    message = "Your role in Tally does not allow this."

    def has_permission(self, request: Request, view: APIView) -> bool:
        return request_role(request) in self.roles


class AnyRole(RolePermission):
    """Operators, finance and team leads: everyone who may read something. Members who lead
    no team have no role and see nothing."""

    roles = frozenset({OPERATOR, FINANCE, LEAD})
    message = "You have no role in Tally (operator, finance or team lead)."


class FinanceOrOperator(RolePermission):
    roles = frozenset({OPERATOR, FINANCE})
    message = "Only finance and operators may do this."


class OperatorOrLead(RolePermission):
    roles = frozenset({OPERATOR, LEAD})
    message = "Only operators and team leads may see this."


# --- Pagination and ordering ------------------------------------------------------------------


class Pagination(PageNumberPagination):
    """`?page=` and `?page_size=` (default 100, at most 1000). The total and the next/previous
    pages also travel as headers (`X-Total-Count`, `Link`), so a CSV download can page too."""

    page_size = 100
    page_size_query_param = "page_size"
    max_page_size = 1000

    def get_paginated_response(self, data: Any) -> Response:
        response = super().get_paginated_response(data)
        assert self.page is not None
        response["X-Total-Count"] = str(self.page.paginator.count)
        links = [
            f'<{url}>; rel="{rel}"'
            for url, rel in ((self.get_next_link(), "next"), (self.get_previous_link(), "prev"))
            if url
        ]
        if links:
            response["Link"] = ", ".join(links)
        return response


class OrderingFilter(filters.OrderingFilter):
    """DRF's `?ordering=`, where a view's `ordering_aliases` give lookups public names (the
    `team` column orders by `team__slug`), so the names match the response's fields. Nulls
    sort last either way (PostgreSQL alone would put them first in a descending order). An
    unknown name is a 400 that names it and the names allowed (DRF would drop it silently)."""

    def remove_invalid_fields(
        self, queryset: QuerySet[Any], fields: Iterable[str], view: APIView, request: Request
    ) -> list[str]:
        allowed = [name for name, _ in self.get_valid_fields(queryset, view, {"request": request})]
        terms = [term for term in fields if term]
        for term in terms:
            if term.removeprefix("-") not in allowed:
                raise ValidationError(
                    {
                        self.ordering_param: [
                            f"cannot order by {term.removeprefix('-')!r}: order by one of "
                            f"{', '.join(allowed)} (a leading '-' for descending)"
                        ]
                    }
                )
        return terms

    def get_ordering(self, request: Request, queryset: QuerySet[Any], view: APIView) -> Any:
        ordering = super().get_ordering(request, queryset, view)
        if not ordering:
            return ordering
        aliases: Mapping[str, str] = getattr(view, "ordering_aliases", {})
        return [
            F(aliases.get(name, name)).desc(nulls_last=True)
            if term.startswith("-")
            else F(aliases.get(name, name)).asc(nulls_last=True)
            for term in ordering
            for name in [term.lstrip("-")]
        ]


# --- Filters ----------------------------------------------------------------------------------


def start_of_day(day: date) -> datetime:
    return datetime.combine(day, time.min, tzinfo=UTC)


class TeamSlugFilter(django_filters.CharFilter):
    """A team by slug, on the lookup path to the team (`team__slug`, `statement__team__slug`)."""

    def __init__(self, field_name: str = "team__slug", **kwargs: Any) -> None:
        super().__init__(field_name=field_name, label="Team slug", **kwargs)


# --- CSV --------------------------------------------------------------------------------------

# Cells a spreadsheet would run as a formula (OWASP "CSV injection"); numbers are left alone.
_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def serializer_columns(serializer: serializers.BaseSerializer[Any], prefix: str = "") -> list[str]:
    """The serializer's field names in order; a nested serializer's as `parent.child`."""
    columns: list[str] = []
    fields = getattr(serializer, "fields", {})
    for name, field in fields.items():
        if isinstance(field, serializers.Serializer):
            columns += serializer_columns(field, f"{prefix}{name}.")
        else:
            columns.append(f"{prefix}{name}")
    return columns


def flatten(row: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """One JSON object as one level: nested objects' values under dotted names."""
    flat: dict[str, Any] = {}
    for name, value in row.items():
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{name}."))
        else:
            flat[f"{prefix}{name}"] = value
    return flat


def csv_cell(value: Any) -> str:
    """A value as a CSV cell that no spreadsheet runs as a formula: None empty, booleans
    `true`/`false`, lists of plain values joined with `;`, other lists as JSON."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        if all(not isinstance(item, Mapping | list | tuple) for item in value):
            return ";".join(csv_cell(item) for item in value)
        return json.dumps(value, sort_keys=True, default=str)
    text = str(value)
    if text.startswith(_FORMULA_STARTS) and not _is_number(text):
        return "'" + text
    return text


def _is_number(text: str) -> bool:
    try:
        Decimal(text)
    except ArithmeticError:
        return False
    return text.strip() == text


def write_csv(
    out: SupportsWrite[str], *, columns: Sequence[str], rows: Iterable[Sequence[Any]]
) -> None:
    """The CSV writer of every export (the API's `?format=csv`, the portal's statements): a
    header of `columns`, then each row's values through `csv_cell`."""
    writer = csv.writer(out)
    writer.writerow(columns)
    writer.writerows([csv_cell(value) for value in row] for row in rows)


class CSVRenderer(BaseRenderer):
    """`?format=csv`: one row per object, with a header that depends only on the endpoint (its
    serializer's fields in order), so an empty page has the same columns as a full one."""

    media_type = "text/csv"
    format = "csv"
    charset = "utf-8"

    def render(
        self,
        data: Any,
        accepted_media_type: str | None = None,
        renderer_context: Mapping[str, Any] | None = None,
    ) -> bytes:
        context = renderer_context or {}
        response = context.get("response")
        rows: Any = data.get("results", data) if isinstance(data, Mapping) else data
        if isinstance(rows, Mapping):
            rows = [rows]
        flat = [flatten(row) for row in rows or [] if isinstance(row, Mapping)]
        columns = None
        view = context.get("view")
        if (response is None or response.status_code < 400) and hasattr(view, "get_serializer"):
            columns = serializer_columns(view.get_serializer())  # type: ignore[union-attr]
        if not columns:
            columns = list(dict.fromkeys(name for row in flat for name in row))
        buffer = io.StringIO()
        write_csv(
            buffer,
            columns=columns,
            rows=([row.get(column) for column in columns] for row in flat),
        )
        return buffer.getvalue().encode(self.charset)


# --- Serializers and viewsets -----------------------------------------------------------------


class ReadOnlyModelSerializer(serializers.ModelSerializer[Any]):
    """A model serializer no client can write through: every field is read-only."""

    def get_fields(self) -> dict[str, serializers.Field[Any, Any, Any, Any]]:
        fields = super().get_fields()
        for field in fields.values():
            field.read_only = True
        return fields


# --- Query parameters -------------------------------------------------------------------------

# The names the window parameters had before issue 35 (`billing.windows`): accepted for one
# release where the endpoint takes the new name, with `Deprecation` and `Warning` headers.
DEPRECATED_PARAMETERS = {"from": "start", "to": "end", "since": "start", "until": "end"}
# Taken by every endpoint: DRF's choice of renderer.
COMMON_PARAMETERS = frozenset({"format"})


class StrictQueryParameters(APIView):
    """A base of API views: a query parameter the endpoint does not take is a 400 naming it
    and the ones it takes, rather than silently ignored (a misspelt filter would answer with
    everything). The names taken are the declared ones, as the schema documents them: the
    filterset's filters, the other filter backends' and the paginator's parameters, the
    fields of `query_serializer` and `query_parameters` for views that read the query
    themselves, and `format`."""

    query_parameters: ClassVar[tuple[str, ...]] = ()
    query_serializer: ClassVar[type[serializers.BaseSerializer[Any]] | None] = None

    def allowed_query_parameters(self) -> set[str]:
        names = set(COMMON_PARAMETERS) | set(self.query_parameters)
        if self.query_serializer is not None:
            names |= set(self.query_serializer().fields)  # type: ignore[attr-defined]
        paginator = getattr(self, "paginator", None)
        if paginator is not None:
            names |= {p["name"] for p in paginator.get_schema_operation_parameters(self)}
        for backend in getattr(self, "filter_backends", ()):
            if issubclass(backend, DjangoFilterBackend):
                filterset = getattr(self, "filterset_class", None)
                names |= set(filterset.base_filters) if filterset is not None else set()
            else:
                names |= {p["name"] for p in backend().get_schema_operation_parameters(self)}
        return names

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)
        allowed = self.allowed_query_parameters()
        self._rename_deprecated(request, allowed)
        unknown = sorted(set(request.query_params) - allowed)
        if unknown:
            taken = ", ".join(sorted(allowed))
            raise ValidationError(
                {
                    name: [f"unknown query parameter; this endpoint takes {taken}"]
                    for name in unknown
                }
            )

    def _rename_deprecated(self, request: Request, allowed: set[str]) -> None:
        """Old names of parameters this endpoint takes, renamed to the new ones in the query
        (the filters and serializers know only the new), remembered for the headers."""
        old = [
            name
            for name in request.query_params
            if DEPRECATED_PARAMETERS.get(name) in allowed and name not in allowed
        ]
        if not old:
            return
        query = request.query_params.copy()
        for name in old:
            new = DEPRECATED_PARAMETERS[name]
            if new in query:
                raise ValidationError({name: [f"deprecated name of {new}: give {new} alone"]})
            query.setlist(new, query.pop(name))
        query._mutable = False  # as Django's own: read-only, like the query it replaces
        request._request.GET = query  # type: ignore[assignment]  # the stubs' immutable type
        self.deprecated_used = {name: DEPRECATED_PARAMETERS[name] for name in old}

    def handle_exception(self, exc: Exception) -> Response:
        # A bad value given under an old name: the error names the parameter as given.
        used: dict[str, str] = getattr(self, "deprecated_used", {})
        if used and isinstance(exc, ValidationError) and isinstance(exc.detail, dict):
            given = {new: old for old, new in used.items()}
            exc.detail = {given.get(name, name): why for name, why in exc.detail.items()}
        return super().handle_exception(exc)

    def finalize_response(
        self, request: Request, response: Response, *args: Any, **kwargs: Any
    ) -> Response:
        response = super().finalize_response(request, response, *args, **kwargs)
        used: dict[str, str] = getattr(self, "deprecated_used", {})
        if used:
            response["Deprecation"] = "true"
            response["Warning"] = ", ".join(
                f'299 - "query parameter {old} is deprecated: use {new}"'
                for old, new in used.items()
            )
        return response


class TallyViewSet(StrictQueryParameters, viewsets.GenericViewSet[Any]):
    """Paginated, filtered and ordered, in JSON or CSV; readable by anyone with a role."""

    permission_classes = [AnyRole]
    pagination_class = Pagination
    renderer_classes = [JSONRenderer, BrowsableAPIRenderer, CSVRenderer]
    filter_backends = [DjangoFilterBackend, OrderingFilter]
    ordering_aliases: ClassVar[dict[str, str]] = {}


class TeamScopedViewSet(TallyViewSet):
    """A viewset over team data: its queryset is `scope()` of the teams the user may see."""

    def get_queryset(self) -> QuerySet[Any]:
        return self.scope(visible_teams(user=self.request.user))

    def scope(self, teams: QuerySet[Team]) -> QuerySet[Any]:
        raise NotImplementedError


def bad_request(message: str) -> ValidationError:
    """A 400 whose body is `{"detail": message}`, like DRF's other errors."""
    return ValidationError({"detail": message})


def next_day(day: datetime) -> datetime | None:
    """`day` plus one day, or None past the last representable day."""
    try:
        return day + timedelta(days=1)
    except OverflowError:
        return None


@extend_schema_field(OpenApiTypes.STR)
class VisibleTeamField(serializers.SlugRelatedField[Team]):
    """A team named by slug, among the teams the requesting user may see (others: invalid)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(slug_field="slug", **kwargs)

    def get_queryset(self) -> QuerySet[Team]:
        return visible_teams(user=self.context["request"].user)

    def to_internal_value(self, data: Any) -> Team:
        # PostgreSQL refuses NUL in text: answer "no such team" rather than a database error.
        if isinstance(data, str) and "\x00" in data:
            self.fail("does_not_exist", slug_name=self.slug_field, value=data)
        return super().to_internal_value(data)


# --- Errors -----------------------------------------------------------------------------------

API_PREFIX = "/api/"


def exception_handler(exc: Exception, context: Mapping[str, Any]) -> Response | None:
    """DRF's handler, with every error body an object (a bare list of messages becomes its
    `detail`), rendered as JSON where the request asked for CSV or the schema's YAML: an error
    is never a spreadsheet row. Other exceptions fall through to `server_error`."""
    response = drf_exception_handler(exc, dict(context))
    if response is None:
        return None
    if isinstance(response.data, list):
        response.data = {"detail": " ".join(str(message) for message in response.data)}
    request = context.get("request")
    renderer = getattr(request, "accepted_renderer", None)
    if request is not None and not isinstance(renderer, JSONRenderer | BrowsableAPIRenderer):
        request.accepted_renderer = JSONRenderer()
        request.accepted_media_type = JSONRenderer.media_type
    return response


@csrf_exempt
def unknown_endpoint(request: HttpRequest) -> HttpResponse:
    """A path under /api/ that no endpoint has: a JSON 404 whatever DEBUG says. Without its
    trailing slash, a GET or HEAD of an endpoint redirects, as Django's APPEND_SLASH would (a
    catch-all path hides the endpoint from it). Exempt from the CSRF check, as every API view
    is (DRF's session authentication checks it for cookie logins): it acts on nothing, and a
    token client's POST to a path that does not exist must learn that, not "reload the
    page"."""
    detail = f"No API endpoint at {request.path}"
    path = request.path_info
    if settings.APPEND_SLASH and not path.endswith("/"):
        try:
            match = resolve(f"{path}/")
        except Resolver404:
            match = None
        if match is not None and match.func is not unknown_endpoint:
            if request.method in ("GET", "HEAD"):
                return HttpResponsePermanentRedirect(request.get_full_path(force_append_slash=True))
            detail += f"; send to {request.path}/"
    return JsonResponse({"detail": f"{detail}."}, status=404)


def not_found(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    """`handler404`: JSON under /api/, Django's page elsewhere."""
    if request.path.startswith(API_PREFIX):
        return unknown_endpoint(request)
    return defaults.page_not_found(request, exception or Http404())


def server_error(request: HttpRequest) -> HttpResponse:
    """`handler500`: JSON under /api/, Django's page elsewhere. The traceback is logged with the
    request's id, which the response's header carries."""
    if request.path.startswith(API_PREFIX):
        return JsonResponse(
            {
                "detail": "Internal server error: logged with this response's "
                f"{REQUEST_ID_HEADER} for the operators."
            },
            status=500,
        )
    return defaults.server_error(request)


# --- Schema -----------------------------------------------------------------------------------

ERROR_SCHEMA = ResolvedComponent(
    name="Error",
    type=ResolvedComponent.SCHEMA,
    object="Error",
    schema={
        "type": "object",
        "description": "An error: `detail` says what went wrong; a 400 for bad input names "
        'each field at fault instead (`{"ordering": ["cannot order by ..."]}`).',
        "properties": {"detail": {"type": "string"}},
        "additionalProperties": {"type": "array", "items": {"type": "string"}},
    },
)

ERROR_RESPONSES = {
    400: "Bad input: each field at fault, with the reason.",
    401: "Not logged in, or no valid token.",
    403: "Your role does not allow this.",
    404: "No such object, page, or endpoint.",
    429: "Too many requests: try again after `Retry-After` seconds.",
}


class TallySchema(AutoSchema):
    """drf-spectacular's schema, with the error body (`Error`, always JSON) documented on every
    operation for the codes it does not document itself."""

    def get_operation(self, *args: Any, **kwargs: Any) -> dict[str, Any] | None:
        operation: dict[str, Any] | None = super().get_operation(*args, **kwargs)
        if operation is None:
            return None
        self.registry.register_on_missing(ERROR_SCHEMA)
        responses = operation.setdefault("responses", {})
        for code, description in ERROR_RESPONSES.items():
            responses.setdefault(
                str(code),
                {
                    "description": description,
                    "content": {JSONRenderer.media_type: {"schema": ERROR_SCHEMA.ref}},
                },
            )
        return operation
