"""`dev.py serve` stopping its children: Ctrl-C once asks them, again at any moment kills them,
and no traceback either way."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from types import ModuleType

from tests.conftest import REPO

# Children that ignore SIGINT, as a worker finishing a long task does. Each says "ready" once
# its handler is set, so that no SIGINT reaches it before (which would end it).
STUBBORN = (
    "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "print('ready', flush=True); time.sleep(60)"
)
# A child that stops on SIGINT (Python's own handler, set before its code runs).
OBEDIENT = "import time; print('ready', flush=True); time.sleep(60)"


def load_dev() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dev", REPO / "dev.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ready_children(code: str, count: int) -> list[subprocess.Popen[bytes]]:
    """`count` children running `code`, returned once each has said "ready" (its handlers
    set), however long a busy machine takes to start them."""
    children = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE) for _ in range(count)
    ]
    try:
        for child in children:
            assert child.stdout is not None
            line = child.stdout.readline()  # at the latest, EOF when the child exits
            assert line == b"ready\n", f"child said {line!r}, exit code {child.poll()}"
    except BaseException:
        for child in children:
            child.kill()
            child.wait()
        closed(children)
        raise
    return children


def closed(children: list[subprocess.Popen[bytes]]) -> None:
    for child in children:
        if child.stdout is not None:
            child.stdout.close()


def stubborn_children(count: int) -> list[subprocess.Popen[bytes]]:
    return ready_children(STUBBORN, count)


def test_ctrl_c_again_while_stopping_kills_the_children() -> None:
    dev = load_dev()
    children = stubborn_children(2)
    # The second Ctrl-C, while the first child is being waited for.
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    began = time.monotonic()
    dev.stop(children)
    closed(children)
    assert time.monotonic() - began < 5
    assert all(child.returncode == -signal.SIGKILL for child in children)


def test_children_that_stop_on_sigint_are_not_killed() -> None:
    dev = load_dev()
    children = ready_children(OBEDIENT, 1)
    dev.stop(children)
    closed(children)
    assert children[0].returncode != -signal.SIGKILL


# A child that starts a server of its own, as runserver's autoreloader does, says the
# server's pid, and stops on SIGINT without stopping it.
LEAVES_A_SERVER = (
    "import subprocess, sys, time; "
    "server = subprocess.Popen([sys.executable, '-c', "
    "'import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(60)']); "
    "print(server.pid, flush=True); time.sleep(60)"
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone but for its exit status.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_what_a_child_started_is_stopped_with_it() -> None:
    """runserver's server runs in a child of the reloader: stopping the reloader alone left it
    holding the port. Each child leads its group, and the group is stopped."""
    dev = load_dev()
    child = subprocess.Popen(
        [sys.executable, "-c", LEAVES_A_SERVER], stdout=subprocess.PIPE, start_new_session=True
    )
    assert child.stdout is not None
    server = int(child.stdout.readline())
    try:
        dev.stop([child])
        deadline = time.monotonic() + 10
        while _alive(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(server)
    finally:
        child.stdout.close()
        if _alive(server):
            os.kill(server, signal.SIGKILL)
