"""The policy file's schema, declared with pydantic: each section a model whose fields say
what they take, and `problems` turns pydantic's errors into the file's own messages, each
named by its path (`teams[2].quotas[0].selector: bad CEL: ...`).

The models check each value on its own (shapes, keys, strings and their Kubernetes maxima,
slugs, namespace and user names, CEL selectors, limits, quantities, dates, the rate cards' own
rules); what spans the file (a slug, namespace or rule name given twice, overlapping rate
cards, SSO lines naming a team the file does not declare) is `quota.policy.loading`'s, which
also reads what the checks need from the database (the present device classes, passed in the
validation context as `device_classes`).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from datetime import date, datetime
from decimal import ROUND_DOWN, Decimal, InvalidOperation
from typing import Annotated, Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError as DjangoValidationError
from django.core.validators import validate_slug
from django.db import models
from kubernetes.utils import parse_quantity
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from billing.rates import rate_card_value_errors
from inventory.models import Unit as DeviceUnit
from inventory.profiles import UNITS
from quota.models import GangMode, Mode, Unit
from quota.rules import selector_error
from teams.models import SSO_TEAM_ROLES, SsoRole

# A Kubernetes namespace name: a DNS-1123 label.
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")
# QuotaRule.limit is NUMERIC(24, 6).
_LIMIT_DIGITS, _LIMIT_PLACES = 24, 6
# The longest idle stretch an alert may wait for: a month of hours (the rollup keeps them all,
# but the evaluation reads this many hours of every claim).
IDLE_ALERT_MAX_HOURS = 744
# An identity provider's group names are its own: any string, within SsoGroupRole.group.
_SSO_GROUP_MAX_LENGTH = 255
_BUDGET_MODES = ("hard", "soft")

# The error type of the file's own messages; `_AT` names a key below the value checked.
_PROBLEM = "policy"
_AT = "policy_at"


def problem(message: str) -> PydanticCustomError:
    """An error with the file's own message (no template: the message is taken as is)."""
    return PydanticCustomError(_PROBLEM, "{problem}", {"problem": message})


def problem_at(key: str, message: str) -> PydanticCustomError:
    """An error of the model's key `key`, found by a check of the model as a whole."""
    return PydanticCustomError(_AT, "{problem}", {"problem": message, "key": key})


def kind(value: Any) -> str:
    return "nothing" if value is None else type(value).__name__


# --- From pydantic's errors to the file's messages --------------------------------------------


def path_of(loc: tuple[Any, ...]) -> str:
    """`("teams", 2, "quotas", 0, "selector")` -> `teams[2].quotas[0].selector`."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def problems(exc: ValidationError, *, at: tuple[Any, ...] = ()) -> list[str]:
    """The file's messages for `exc`, raised validating the value at `at` in the file."""
    found = []
    for error in _as_written(exc.errors()):
        loc = (*at, *error["loc"])
        kind_of = error["type"]
        context = error.get("ctx") or {}
        if kind_of == "extra_forbidden":
            found.append(f"{path_of(loc[:-1]) or '(top level)'}: unknown key {loc[-1]!r}")
        elif kind_of == "missing":
            found.append(f"{path_of(loc)}: required")
        elif kind_of in ("model_type", "dict_type", "model_attributes_type"):
            found.append(
                f"{path_of(loc) or '(top level)'}: must be a mapping, got {kind(error['input'])}"
            )
        elif kind_of == "list_type":
            found.append(f"{path_of(loc)}: must be a list, got {kind(error['input'])}")
        elif kind_of == _AT:
            found.append(f"{path_of((*loc, context['key']))}: {context['problem']}")
        elif kind_of == _PROBLEM:
            found.append(f"{path_of(loc) or '(top level)'}: {context['problem']}")
        else:  # pydantic's own wording: a check this schema does not phrase itself
            found.append(f"{path_of(loc) or '(top level)'}: {error['msg']}")
    return found


def _as_written(errors: list[Any]) -> list[Any]:
    """`errors` in the order the file's checks have always reported them: a mapping's unknown
    keys, then its missing ones, before anything else found in it (pydantic reports them after
    its fields)."""
    locs = [tuple(error["loc"]) for error in errors]

    def key(index: int) -> tuple[int, int, int]:
        rank = {"extra_forbidden": 0, "missing": 1}.get(errors[index]["type"])
        if rank is None:
            return (index, 2, index)
        owner = locs[index][:-1]
        first = next(i for i, loc in enumerate(locs) if loc[: len(owner)] == owner)
        return (first, rank, index)

    return [errors[index] for index in sorted(range(len(errors)), key=key)]


def _with(exc: ValidationError | None, more: list[InitErrorDetails], title: str) -> None:
    """Raise `exc`'s errors and `more` together (nothing when there are none)."""
    details: list[InitErrorDetails] = []
    for error in exc.errors() if exc is not None else []:
        context = error.get("ctx") or {}
        if error["type"] in (_PROBLEM, _AT):
            error_type: Any = PydanticCustomError(error["type"], "{problem}", context)
        else:
            error_type = error["type"]
        detail: InitErrorDetails = {
            "type": error_type,
            "loc": error["loc"],
            "input": error["input"],
        }
        if context and not isinstance(error_type, PydanticCustomError):
            detail["ctx"] = context
        details.append(detail)
    details += more
    if details:
        raise ValidationError.from_exception_data(title, details)


# --- Values -----------------------------------------------------------------------------------


def text(max_length: int) -> Callable[[Any], str]:
    """A string of at most `max_length` characters (Kubernetes' and the columns' maxima)."""

    def check(value: Any) -> str:
        if not isinstance(value, str):
            raise problem(f"must be a string, got {kind(value)}")
        if len(value) > max_length:
            raise problem(f"longer than {max_length} characters")
        return value

    return check


def _slug(value: str) -> str:
    if value:
        try:
            validate_slug(value)
        except DjangoValidationError:
            raise problem(f"{value!r} is not a slug (letters, digits, - and _)") from None
    return value


def _namespace(value: Any) -> str:
    value = text(10**6)(value)
    if len(value) > 63 or not _DNS_LABEL.match(value):
        raise problem(f"{value!r} is not a Kubernetes namespace name")
    return value


def _username(value: Any) -> str:
    value = text(10**6)(value)
    user_model = get_user_model()
    field = user_model._meta.get_field(user_model.USERNAME_FIELD)
    assert isinstance(field, models.Field)
    try:
        field.run_validators(value)
    except DjangoValidationError as exc:
        raise problem(f"{value!r} is not a valid username: {' '.join(exc.messages)}") from None
    return value


def _not_none(expected: str) -> Callable[[Any], Any]:
    """A key given with no value (`budget:`) is refused, not taken as absent."""

    def check(value: Any) -> Any:
        if value is None:
            raise problem(f"must be {expected}, got nothing")
        return value

    return check


def fitting(number: Decimal, value: Any, *, digits: int, places: int) -> Decimal:
    """`number` if it is finite and fits NUMERIC(digits, places) without rounding."""
    if not number.is_finite():
        raise problem(f"must be a finite number, got {value!r}")
    if abs(number) >= Decimal(10) ** (digits - places):
        raise problem(f"{value!r} is too large")
    if number != number.quantize(Decimal(1).scaleb(-places), rounding=ROUND_DOWN):
        raise problem(f"{value!r} has more than {places} decimal places")
    return number


def decimal(
    value: Any, *, digits: int, places: int, expected: str = "a number", strings: bool = True
) -> Decimal:
    """A YAML number (or, with `strings`, a string such as "2.50") that fits NUMERIC(digits,
    places) exactly; decimals from strings keep every digit a float would round away."""
    if isinstance(value, bool) or not isinstance(
        value, (int, float, str) if strings else int | float
    ):
        raise problem(f"must be {expected}, got {value!r}")
    try:
        number = Decimal(str(value).strip())
    except InvalidOperation:
        raise problem(f"{value!r} is not a number") from None
    return fitting(number, value, digits=digits, places=places)


def positive(number: Decimal, value: Any) -> Decimal:
    if number <= 0:
        raise problem(f"must be positive, got {value!r}")
    return number


def _gpus(value: Any) -> Decimal:
    """A positive number of GPU-equivalents."""
    number = decimal(
        value,
        digits=_LIMIT_DIGITS,
        places=_LIMIT_PLACES,
        expected="a positive number",
        strings=False,
    )
    return positive(number, value)


def _memory(value: Any) -> Decimal:
    """A positive Kubernetes quantity of bytes."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise problem(f"must be a quantity such as 640Gi, got {value!r}")
    try:
        quantity = parse_quantity(value)
    except (ValueError, InvalidOperation):
        raise problem(f"{value!r} is not a Kubernetes quantity (such as 640Gi)") from None
    if quantity.is_finite() and quantity != quantity.to_integral_value():
        raise problem(f"{value!r} is not a whole number of bytes")
    return positive(fitting(quantity, value, digits=_LIMIT_DIGITS, places=_LIMIT_PLACES), value)


def _date(value: Any) -> date:
    """A YAML date (2026-01-01) or an ISO 8601 date string; not a timestamp."""
    if isinstance(value, str):
        try:
            return date.fromisoformat(value)
        except ValueError:
            raise problem(f"{value!r} is not a date (YYYY-MM-DD)") from None
    if isinstance(value, date) and not isinstance(value, datetime):
        return value
    raise problem(f"must be a date (YYYY-MM-DD), got {value!r}")


def _one_of(values: list[str] | tuple[str, ...], message: str) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if value not in values:
            raise problem(message.format(choices=", ".join(values), value=value))
        return str(value)

    return check


def _rate_value(field: str, check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """`check`, then the rate cards' own rule for `field` (`rate_card_value_errors`)."""

    def both(value: Any) -> Any:
        parsed = check(value)
        error = rate_card_value_errors({field: parsed}).get(field)
        if error:
            raise problem(error)
        return parsed

    return both


class _Section(BaseModel):
    """A mapping of the file: its keys are these fields' (aliases), no other."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=False)


# --- Sections ---------------------------------------------------------------------------------


class RuleModel(_Section):
    """One of a team's `quotas`."""

    name: Annotated[str, BeforeValidator(lambda v: _slug(text(63)(v)))]
    device_class: Annotated[str, BeforeValidator(text(253))] = Field(alias="deviceClass")
    selector: Annotated[str, BeforeValidator(text(100_000))] = ""
    mode: Annotated[
        str, BeforeValidator(_one_of(Mode.values, "must be one of {choices}, got {value!r}"))
    ] = Mode.ENFORCE.value
    gpus: Annotated[Decimal | None, BeforeValidator(_gpus)] = None
    memory: Annotated[Decimal | None, BeforeValidator(_memory)] = None

    @field_validator("device_class")
    @classmethod
    def _present_class(cls, value: str, info: ValidationInfo) -> str:
        present = (info.context or {}).get("device_classes")
        if value and present is not None and value not in present:
            close = difflib.get_close_matches(value, sorted(present), n=1, cutoff=0.9)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise problem(f"unknown device class {value!r}{hint}")
        return value

    @field_validator("selector")
    @classmethod
    def _compiles(cls, value: str) -> str:
        error = selector_error(value)
        if error is not None:
            raise problem(error)
        return value.strip()

    @model_validator(mode="wrap")
    @classmethod
    def _one_quantity(cls, data: Any, handler: ModelWrapValidatorHandler[RuleModel]) -> RuleModel:
        more: list[InitErrorDetails] = []
        if isinstance(data, dict) and ("gpus" in data) == ("memory" in data):
            more.append(
                {"type": problem("set exactly one of gpus or memory"), "loc": (), "input": data}
            )
        try:
            rule = handler(data)
        except ValidationError as exc:
            _with(exc, more, cls.__name__)
            raise
        _with(None, more, cls.__name__)
        return rule

    @property
    def unit(self) -> Unit:
        return Unit.GPUS if self.gpus is not None else Unit.MEMORY

    @property
    def limit(self) -> Decimal:
        limit = self.gpus if self.gpus is not None else self.memory
        assert limit is not None
        return limit


class BudgetModel(_Section):
    """A team's `budget`: hours of one unit per billing period."""

    mode: Annotated[
        str, BeforeValidator(_one_of(_BUDGET_MODES, "must be hard or soft, got {value!r}"))
    ]
    unit: Annotated[
        str, BeforeValidator(_one_of(UNITS, "must be one of {choices}, got {value!r}"))
    ] = DeviceUnit.GPU
    # Budget.gpu_hours is NUMERIC(14, 3).
    gpu_hours: Annotated[
        Decimal, BeforeValidator(lambda v: positive(decimal(v, digits=14, places=3), v))
    ] = Field(alias="gpuHours")


def _percent(value: Any) -> Decimal:
    # IdleAlertPolicy.below_percent is NUMERIC(5, 2): 100 at most.
    percent = positive(decimal(value, digits=5, places=2), value)
    if percent > 100:
        raise problem(f"must be at most 100, got {value!r}")
    return percent


def _hours(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise problem(f"must be a whole number of hours, got {value!r}")
    if not 1 <= value <= IDLE_ALERT_MAX_HOURS:
        raise problem(f"must be from 1 to {IDLE_ALERT_MAX_HOURS} hours, got {value}")
    return value


class IdleAlertModel(_Section):
    """A team's `idleAlert`: alert a claim utilised below `belowPercent` for `forHours`."""

    below_percent: Annotated[Decimal, BeforeValidator(_percent)] = Field(alias="belowPercent")
    for_hours: Annotated[int, BeforeValidator(_hours)] = Field(alias="forHours")
    # False: `idleAlert: off`, which no key of the file sets (`off`).
    _enabled: bool = PrivateAttr(default=True)

    @property
    def enabled(self) -> bool:
        return self._enabled

    @classmethod
    def off(cls) -> IdleAlertModel:
        """`idleAlert: off`: never alerted (the defaults kept for the pages)."""
        model = cls.model_construct(
            below_percent=Decimal(settings.TALLY_IDLE_ALERT_DEFAULT_BELOW_PERCENT),
            for_hours=max(settings.TALLY_IDLE_ALERT_DEFAULT_FOR_HOURS, 1),
        )
        model._enabled = False
        return model


def _idle_alert(value: Any) -> Any:
    # YAML reads an unquoted `off` as false.
    if value is False or value == "off":
        return IdleAlertModel.off()
    if not isinstance(value, dict):
        raise problem(f"must be a mapping or off, got {kind(value)}")
    return value


def _gangs(value: Any) -> str | None:
    if value is None:
        return None  # `gangs:` with no value: not declared
    if value is False:
        return GangMode.OFF.value  # YAML 1.1 reads an unquoted `off` as false
    if value not in GangMode.values:
        raise problem(f"must be enforce, warn or off, got {value!r}")
    return str(value)


def _narrow_to_fit(value: Any) -> bool | None:
    if value is None:
        return None  # `narrowToFit:` with no value: not declared
    if not isinstance(value, bool):
        raise problem(f"must be true or false, got {kind(value)}")
    return value


Namespace = Annotated[str, BeforeValidator(_namespace)]
Username = Annotated[str, BeforeValidator(_username)]


class TeamModel(_Section):
    """One of `teams`."""

    slug: Annotated[str, BeforeValidator(lambda v: _slug(text(63)(v)))]
    name: Annotated[str, BeforeValidator(text(200))]
    cost_centre: Annotated[str, BeforeValidator(text(100))] = Field(default="", alias="costCentre")
    namespaces: list[Namespace] = []
    leads: list[Username] = []
    members: list[Username] = []
    quotas: list[RuleModel] = []
    budget: Annotated[BudgetModel | None, BeforeValidator(_not_none("a mapping"))] = None
    gangs: Annotated[str | None, BeforeValidator(_gangs)] = None
    narrow_to_fit: Annotated[bool | None, BeforeValidator(_narrow_to_fit)] = Field(
        default=None, alias="narrowToFit"
    )
    idle_alert: Annotated[IdleAlertModel | None, BeforeValidator(_idle_alert)] = Field(
        default=None, alias="idleAlert"
    )


# A rate entry's key for each of RateCard's fields.
RATE_KEY_OF = {
    "product_name": "productName",
    "profile": "profile",
    "currency": "currency",
    "per_gpu_hour": "perGpuHour",
    "idle_factor": "idleFactor",
    "valid_from": "from",
    "valid_until": "until",
}


class RateModel(_Section):
    """One of `rates`: a price per GPU-hour over `[from, until)`."""

    product_name: Annotated[str, BeforeValidator(_rate_value("product_name", text(253)))] = Field(
        alias="productName"
    )
    profile: Annotated[str, BeforeValidator(_rate_value("profile", text(64)))] = ""
    # RateCard.per_gpu_hour is NUMERIC(12, 4).
    per_gpu_hour: Annotated[
        Decimal,
        BeforeValidator(_rate_value("per_gpu_hour", lambda v: decimal(v, digits=12, places=4))),
    ] = Field(alias="perGpuHour")
    idle_factor: Annotated[
        Decimal,
        BeforeValidator(_rate_value("idle_factor", lambda v: decimal(v, digits=6, places=4))),
    ] = Field(default=1, alias="idleFactor", validate_default=True)
    currency: Annotated[str, BeforeValidator(_rate_value("currency", text(64)))]
    valid_from: Annotated[date, BeforeValidator(_date)] = Field(alias="from")
    valid_until: Annotated[date | None, BeforeValidator(_date)] = Field(default=None, alias="until")

    @model_validator(mode="wrap")
    @classmethod
    def _dates(cls, data: Any, handler: ModelWrapValidatorHandler[RateModel]) -> RateModel:
        """`until` after `from`, checked whatever else is wrong with the entry."""
        more: list[InitErrorDetails] = []
        if isinstance(data, dict):
            dates = {field: _date_or_none(data.get(key)) for field, key in _DATE_KEYS.items()}
            for field, message in rate_card_value_errors(dates).items():
                more.append(
                    {"type": problem_at(RATE_KEY_OF[field], message), "loc": (), "input": data}
                )
        try:
            rate = handler(data)
        except ValidationError as exc:
            _with(exc, more, cls.__name__)
            raise
        _with(None, more, cls.__name__)
        return rate


_DATE_KEYS = {"valid_from": "from", "valid_until": "until"}


def _date_or_none(value: Any) -> date | None:
    try:
        return _date(value)
    except PydanticCustomError:
        return None


class SsoGroupModel(_Section):
    """One of `sso.groups`: the identity provider's group that gives a role (in a team)."""

    group: Annotated[str, BeforeValidator(text(_SSO_GROUP_MAX_LENGTH))]
    role: Annotated[
        SsoRole, BeforeValidator(_one_of(SsoRole.values, "must be one of {choices}, got {value!r}"))
    ]
    team: str | None = None

    @field_validator("group")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise problem("must not be empty")
        return value

    @field_validator("team", mode="before")
    @classmethod
    def _slug_text(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, str):
            raise problem(f"must be a team's slug, got {kind(value)}")
        return value

    @model_validator(mode="after")
    def _team_for_role(self) -> SsoGroupModel:
        if self.role in SSO_TEAM_ROLES and self.team is None:
            raise problem_at("team", f"required: a {self.role} is one of a team")
        if self.role not in SSO_TEAM_ROLES and self.team is not None:
            raise problem_at("team", f"not allowed: {self.role} is a role across every team")
        return self


class SsoModel(_Section):
    """The `sso` section."""

    groups: list[Any]


class DocumentModel(_Section):
    """The file's top level; each list's items and the `sso`, `drivers` and `versions`
    sections are checked one by one after it (`quota.policy.loading`), so that one bad entry
    does not hide the file-wide checks of the others."""

    rates: Annotated[list[Any] | None, BeforeValidator(_not_none("a list"))] = None
    drivers: Any = None
    versions: Any = None
    teams: list[Any]
    sso: Any = None
