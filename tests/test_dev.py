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

# Children that ignore SIGINT, as a worker finishing a long task does.
STUBBORN = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(60)"


def load_dev() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dev", REPO / "dev.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stubborn_children(count: int) -> list[subprocess.Popen[bytes]]:
    children = [subprocess.Popen([sys.executable, "-c", STUBBORN]) for _ in range(count)]
    time.sleep(0.5)  # their handlers set
    return children


def test_ctrl_c_again_while_stopping_kills_the_children() -> None:
    dev = load_dev()
    children = stubborn_children(2)
    # The second Ctrl-C, while the first child is being waited for.
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    began = time.monotonic()
    dev.stop(children)
    assert time.monotonic() - began < 5
    assert all(child.returncode == -signal.SIGKILL for child in children)


def test_children_that_stop_on_sigint_are_not_killed() -> None:
    dev = load_dev()
    children = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])]
    time.sleep(0.5)
    dev.stop(children)
    assert children[0].returncode != -signal.SIGKILL
