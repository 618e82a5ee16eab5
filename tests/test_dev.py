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
