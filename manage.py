#!/usr/bin/env python
"""Django's manage.py, answering a configuration or database problem in one line, not a
traceback (`--traceback` shows it)."""

import os
import sys


def main() -> int:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    if _asks_for_help(sys.argv):
        # Help reads no secret and no database: a newcomer may read it before setting up
        # either (nothing is signed, and no connection is made, let alone the embedded
        # server started).
        if not any(os.environ.get(name) for name in ("DEBUG", "SECRET_KEY", "SECRET_KEY_FILE")):
            os.environ["DEBUG"] = "true"
        if not (os.environ.get("DATABASE_URL") or os.environ.get("DATABASE_URL_FILE")):
            os.environ["DATABASE_URL"] = "postgres://help@127.0.0.1:1/help"
    from django.core.exceptions import ImproperlyConfigured
    from django.core.management import execute_from_command_line
    from django.db.utils import OperationalError, ProgrammingError

    try:
        execute_from_command_line(sys.argv)
    except (ImproperlyConfigured, OperationalError, ProgrammingError) as exc:
        if "--traceback" in sys.argv:
            raise
        print(f"manage.py: {_explain(exc)}", file=sys.stderr)
        return 2 if isinstance(exc, ImproperlyConfigured) else 1
    return 0


def _asks_for_help(argv: list[str]) -> bool:
    """`manage.py`, `manage.py help [COMMAND]`, `manage.py --help`, `manage.py COMMAND -h`."""
    words = argv[1:]
    return not words or words[0] in {"help", "--help", "-h"} or bool({"--help", "-h"} & set(words))


def _explain(exc: Exception) -> str:
    from django.core.exceptions import ImproperlyConfigured
    from django.db.utils import ProgrammingError

    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, ImproperlyConfigured):
        return f"{first_line} (see docs/reference/configuration.md)"
    if isinstance(exc, ProgrammingError):
        if getattr(exc.__cause__, "sqlstate", None) == "42P01":  # undefined_table
            return (
                f"the database has no Tally tables yet ({first_line}): "
                "run `python manage.py migrate` first"
            )
        return f"the database refused a statement: {first_line}"
    return f"cannot use the database: {first_line} (is DATABASE_URL right, the server up?)"


if __name__ == "__main__":
    sys.exit(main())
