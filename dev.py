#!/usr/bin/env python3
"""Tally's two set-up commands, for a fresh machine with only Python 3.11+.

    python3 dev.py serve [PORT]   # venv + install + migrate + demo + web server and worker
    python3 dev.py test [ARGS]    # venv + install + lint, types, docs site and tests (ARGS: pytest)

Each creates `.venv/` and installs the project into it when that has not happened yet (or
`pyproject.toml` changed since), so either can be run first. Unless `DATABASE_URL` names a
PostgreSQL server, each starts the embedded one (data in `var/postgres/`, see
`db/embedded.py`) for its children and stops it on the way out. Only the standard library is
used here, because this file runs before anything is installed.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PYTHON = BIN / "python"
STAMP = VENV / ".tally-installed"


def run(*args: str | Path, env: dict[str, str] | None = None) -> None:
    print("+", " ".join(str(a) for a in args), flush=True)
    subprocess.run([str(a) for a in args], cwd=ROOT, env=env, check=True)


def ensure_venv() -> None:
    """Create the virtual environment and install the project with its dev extras, once."""
    if sys.version_info < (3, 11):  # noqa: UP036 - dev.py runs under any python3
        sys.exit(f"Tally needs Python 3.11 or newer; this is {sys.version.split()[0]}")
    wanted = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if STAMP.exists() and STAMP.read_text() == wanted and PYTHON.exists():
        return
    print(
        "+ installing Tally and its pinned dependencies into .venv (the first time: a minute "
        "or two; again only when pyproject.toml changes)",
        flush=True,
    )
    if not PYTHON.exists():
        run(sys.executable, "-m", "venv", VENV)
    # pip's own progress: one line per package it collects, with its download bars.
    run(PYTHON, "-m", "pip", "install", "--quiet", "--upgrade", "pip")
    run(PYTHON, "-m", "pip", "install", "--progress-bar", "on", "-e", ".[dev]")
    STAMP.write_text(wanted)


@contextmanager
def embedded_postgres() -> Iterator[None]:
    """Unless `DATABASE_URL` names a server, start the embedded PostgreSQL server (or find it
    running), name it in `DATABASE_URL` for every child, and stop it at the end if started here."""
    if os.environ.get("DATABASE_URL") or os.environ.get("DATABASE_URL_FILE"):
        yield
        return
    helper = [str(PYTHON), "-m", "db.embedded"]
    running = subprocess.run([*helper, "url"], cwd=ROOT, capture_output=True, text=True)
    if running.returncode == 0:
        os.environ["DATABASE_URL"] = running.stdout.strip()
        print("+ using the embedded PostgreSQL server already running in var/postgres", flush=True)
        yield
        return
    print("+ starting the embedded PostgreSQL 18 server in var/postgres ...", end=" ", flush=True)
    began = time.monotonic()
    try:
        started = subprocess.run(
            [*helper, "start"], cwd=ROOT, stdout=subprocess.PIPE, text=True, check=True
        )
        os.environ["DATABASE_URL"] = started.stdout.strip()
        print(f"ready in {time.monotonic() - began:.1f} s", flush=True)
        yield
    finally:
        print("+ stopping the embedded PostgreSQL server", flush=True)
        subprocess.run([*helper, "stop"], cwd=ROOT, check=False)


def _exit_on_signal(signum: int, _frame: object) -> None:
    # SIGTERM and SIGHUP end dev.py as Ctrl-C does: children and the database stopped first.
    raise SystemExit(128 + signum)


def serve(argv: list[str]) -> int:
    """Migrate, load the demo fleet and users, then run the web server and a Celery worker."""
    port = argv[0] if argv else os.environ.get("PORT", "8000")
    env = {**os.environ, "DEBUG": os.environ.get("DEBUG", "true")}
    # The demo's simulated agents report every 10 minutes (`demo.usage`): five weeks of two
    # clusters at the default 2-minute hold would be 2 million samples and minutes to load.
    env.setdefault("TALLY_SAMPLE_HOLD_SECONDS", "600")
    manage: list[str | Path] = [PYTHON, "manage.py"]
    run(*manage, "migrate", "--noinput", env=env)
    run(*manage, "load_demo", env=env)
    children = [
        subprocess.Popen(
            [
                str(PYTHON),
                "-m",
                "celery",
                "-A",
                "config",
                "worker",
                "--beat",
                "--loglevel=INFO",
                "--concurrency=1",
            ],
            cwd=ROOT,
            env=env,
            start_new_session=True,
        ),
        # runserver's autoreloader runs the server in a child of its own: each child leads a
        # process group, and the group is stopped, so no server is left holding the port.
        subprocess.Popen(
            [*map(str, manage), "runserver", f"127.0.0.1:{port}"],
            cwd=ROOT,
            env=env,
            start_new_session=True,
        ),
    ]
    time.sleep(2)
    print(
        f"\nTally is running at http://127.0.0.1:{port}/\n"
        "  team lead:  lead-vision / lead-vision   (also lead-nlp, lead-speech, lead-recsys,\n"
        "              lead-research; the password is the username)\n"
        "  finance:    finance / finance            API: /api/v1/  docs: /api/docs/\n"
        f"  operator:   operator / operator          admin: http://127.0.0.1:{port}/admin/\n"
        "  Ctrl-C stops the web server and the worker.\n",
        flush=True,
    )
    try:
        while all(child.poll() is None for child in children):
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        stop(children)
    return 0


def stop(children: list[subprocess.Popen[bytes]]) -> None:
    """Ask the children to stop (SIGINT), give them 10 s; slow ones, or all of them when
    Ctrl-C comes again at any moment of this, are killed. They are gone before the embedded
    database stops."""
    try:
        for child in children:
            _signal_group(child, signal.SIGINT)
        for child in children:
            child.wait(timeout=10)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        for child in children:
            _signal_group(child, signal.SIGKILL)
        for child in children:
            child.wait()
    for child in children:
        # What a child left behind in its group (the reloader's server).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)


def _signal_group(child: subprocess.Popen[bytes], signum: int) -> None:
    """Send `signum` to the process group `child` leads (started with `start_new_session`),
    which holds what it started; to `child` alone when it leads none."""
    try:
        os.killpg(child.pid, signum)
    except ProcessLookupError:
        if child.poll() is None:
            child.send_signal(signum)


def test(argv: list[str]) -> int:
    """Lint, format check, type check, build the documentation site (warnings are errors), then
    the whole pytest suite; non-zero when any fails."""
    env = {**os.environ, "SECRET_KEY": os.environ.get("SECRET_KEY", "tests-only-not-secret")}
    # Quiets mkdocs-material's notice about its successor (a banner about the theme, not a page).
    env["NO_MKDOCS_2_WARNING"] = "1"
    # The site is built to be checked, not kept: into a folder removed at the end.
    with tempfile.TemporaryDirectory(prefix="tally-site-") as site:
        for step in (
            [BIN / "ruff", "check", "."],
            [BIN / "ruff", "format", "--check", "."],
            [BIN / "mypy", "."],
            [BIN / "mkdocs", "build", "--strict", "--quiet", "--site-dir", site],
        ):
            print("+", " ".join(map(str, step)), flush=True)
            if subprocess.run([str(s) for s in step], cwd=ROOT, env=env).returncode:
                return 1
    print("+ pytest", *argv, flush=True)
    return subprocess.run([str(PYTHON), "-m", "pytest", *argv], cwd=ROOT, env=env).returncode


def main() -> int:
    commands = {"serve": serve, "test": test}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        if len(sys.argv) >= 2:
            print(f"dev.py: unknown command {sys.argv[1]!r}; use serve or test", file=sys.stderr)
        print(__doc__, file=sys.stderr)
        return 2
    ensure_venv()
    for name in ("SIGTERM", "SIGHUP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), _exit_on_signal)
    with embedded_postgres():
        return commands[sys.argv[1]](sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
