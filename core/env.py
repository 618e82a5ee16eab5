"""Read settings from environment variables, with `*_FILE` variants for mounted secrets.

Every reader fails with `ImproperlyConfigured` naming the variable when its value is bad, so a
misconfigured pod stops at start-up instead of serving with a surprising default.

Written here rather than taken from django-environ (`FileAwareEnv`), which lets `NAME_FILE`
silently win over `NAME` when both are set, keeps a secret file's trailing newline, and fails
on an unreadable file with a bare OSError that does not name the variable (issue 37).
"""

from __future__ import annotations

import os
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def get_str(name: str, default: str | None = None) -> str | None:
    """The value of `name`, or the contents of the file named by `name_FILE`, or `default`.

    Setting both is an error: which one wins would be a guess.
    """
    value = os.environ.get(name)
    file_name = os.environ.get(f"{name}_FILE")
    if value is not None and file_name is not None:
        raise ImproperlyConfigured(f"{name} and {name}_FILE are both set; set only one")
    if file_name is not None:
        try:
            return Path(file_name).read_text().strip()
        except OSError as exc:
            raise ImproperlyConfigured(
                f"{name}_FILE={file_name!r} cannot be read: {exc.strerror}"
            ) from exc
    return default if value is None else value


def get_bool(name: str, default: bool) -> bool:
    value = get_str(name)
    if value is None:
        return default
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name}={value!r} is not a boolean (use true or false)")


def get_int(
    name: str, default: int, *, minimum: int | None = None, maximum: int | None = None
) -> int:
    value = get_str(name)
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name}={value!r} is not an integer") from exc
    if minimum is not None and number < minimum:
        raise ImproperlyConfigured(f"{name}={number} must be at least {minimum}")
    if maximum is not None and number > maximum:
        raise ImproperlyConfigured(f"{name}={number} must be at most {maximum}")
    return number


def get_list(name: str, default: list[str]) -> list[str]:
    value = get_str(name)
    if value is None:
        return default
    return [item.strip() for item in value.split(",") if item.strip()]


def get_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    value = (get_str(name) or default).strip().lower()
    if value not in choices:
        raise ImproperlyConfigured(f"{name}={value!r} must be one of {', '.join(choices)}")
    return value
