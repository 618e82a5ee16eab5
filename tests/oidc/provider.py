"""A real OpenID Provider for the single sign-on tests: node-oidc-provider (tests/oidc/
provider.mjs, pinned in tests/oidc/package.json), installed here with `npm install` on first
use (no lock file is written: tests/oidc/.npmrc) and started on a free loopback port.

Without node or npm the tests that need it skip, saying why; with TALLY_OIDC_TESTS=required
(as `.ci/run` sets) they fail instead, so CI never passes without them.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
START_SECONDS = 20
INSTALL_SECONDS = 300


@dataclass(frozen=True)
class Provider:
    issuer: str
    client_id: str
    client_secret: str


def unavailable(reason: str) -> None:
    """Skip, or fail where the provider is required."""
    if os.environ.get("TALLY_OIDC_TESTS") == "required":
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)


def node_ready() -> str:
    """The path of node, with the provider's packages installed next to provider.mjs."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        unavailable("node and npm are needed for the OpenID Provider of the SSO tests (Node 20+)")
    assert node is not None and npm is not None
    if not (HERE / "node_modules" / "oidc-provider").is_dir():
        result = subprocess.run(
            [npm, "install", "--no-save", "--no-audit", "--no-fund"],
            cwd=HERE,
            capture_output=True,
            text=True,
            timeout=INSTALL_SECONDS,
            check=False,
        )
        if result.returncode != 0:
            unavailable(f"npm install in {HERE} failed: {result.stderr[-2000:]}")
    return node


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def running_provider(*, redirect_uri: str, logout_uri: str) -> Iterator[Provider]:
    """The provider, serving until the block ends, with one client for `redirect_uri`."""
    node = node_ready()
    port = free_port()
    provider = Provider(
        issuer=f"http://127.0.0.1:{port}", client_id="tally", client_secret="tally-test-secret"
    )
    args = [provider.client_id, provider.client_secret, redirect_uri, logout_uri]
    process = subprocess.Popen(
        [node, str(HERE / "provider.mjs"), str(port), *args],
        cwd=HERE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert process.stdout is not None
        deadline = time.monotonic() + START_SECONDS
        output = []
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line and process.poll() is not None:
                break
            output.append(line)
            if line.strip() == "listening":
                break
        else:
            pytest.fail(f"the OpenID Provider did not start: {''.join(output)}")
        if process.poll() is not None:
            pytest.fail(f"the OpenID Provider exited: {''.join(output)}")
        # Its log read on, so that a full pipe never stalls it.
        threading.Thread(target=output.extend, args=(process.stdout,), daemon=True).start()
        yield provider
    finally:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
