"""A database connection's socket notices a server that stops answering: keepalives on an
idle connection, and tcp_user_timeout for data the server never acknowledges, set from the
settings (DATABASE_KEEPALIVES_*, DATABASE_TCP_USER_TIMEOUT_MS) on the socket itself."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from django.db import connection

REPO = Path(__file__).resolve().parents[2]
# Linux's socket option numbers (netinet/tcp.h); Python names only some of them.
TCP_USER_TIMEOUT = getattr(socket, "TCP_USER_TIMEOUT", 18)


def _options(**environment: str) -> dict[str, object]:
    """The database OPTIONS the settings make of `environment`."""
    code = (
        "import json; from django.conf import settings; "
        "print(json.dumps(settings.DATABASES['default']['OPTIONS']))"
    )
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("DATABASE_")},
        "DJANGO_SETTINGS_MODULE": "config.settings",
        "DATABASE_URL": "postgres://tally@db.example:5432/tally",
        "SECRET_KEY": "x",
        **environment,
    }
    result = subprocess.run(
        [sys.executable, "-c", "import django; django.setup(); " + code],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    options: dict[str, object] = json.loads(result.stdout)
    return options


def test_the_options_come_from_the_settings() -> None:
    defaults = _options()
    assert {key: defaults[key] for key in defaults if key.startswith(("keepalives", "tcp_"))} == {
        "keepalives": 1,
        "keepalives_idle": 5,
        "keepalives_interval": 1,
        "keepalives_count": 3,
        "tcp_user_timeout": 5000,
    }
    chosen = _options(
        DATABASE_KEEPALIVES_IDLE="30",
        DATABASE_KEEPALIVES_INTERVAL="5",
        DATABASE_KEEPALIVES_COUNT="4",
        DATABASE_TCP_USER_TIMEOUT_MS="0",
    )
    assert (
        chosen["keepalives_idle"],
        chosen["keepalives_interval"],
        chosen["keepalives_count"],
        chosen["tcp_user_timeout"],
    ) == (30, 5, 4, 0)


@pytest.mark.django_db
def test_the_connections_socket_has_them() -> None:
    connection.ensure_connection()
    with socket.socket(fileno=os.dup(connection.connection.fileno())) as sock:
        if sock.family == socket.AF_UNIX:
            pytest.skip("a Unix socket has no TCP options (the embedded server)")
        options = connection.settings_dict["OPTIONS"]
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert (
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == (options["keepalives_idle"])
        )
        assert (
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL)
            == (options["keepalives_interval"])
        )
        assert (
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == (options["keepalives_count"])
        )
        assert (
            sock.getsockopt(socket.IPPROTO_TCP, TCP_USER_TIMEOUT) == (options["tcp_user_timeout"])
        )
