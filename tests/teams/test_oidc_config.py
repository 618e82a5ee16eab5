"""Single sign-on's configuration: a half-configured client fails at start naming what is
missing, and the SSO tests' provider is skipped without Node, saying why, except where CI
requires it (TALLY_OIDC_TESTS=required)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _pytest.outcomes import Failed, Skipped

from tests.oidc import provider


def start_settings(**variables: str) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("TALLY_OIDC")}
    return subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"],
        env={**environment, "SECRET_KEY": "t", **variables},
        capture_output=True,
        text=True,
        check=False,
    )


def test_an_issuer_without_its_client_fails_at_start_naming_the_variable() -> None:
    result = start_settings(TALLY_OIDC_ISSUER="https://login.example.com")
    assert result.returncode != 0
    assert "TALLY_OIDC_CLIENT_ID (or TALLY_OIDC_CLIENT_ID_FILE) must be set" in result.stderr
    result = start_settings(TALLY_OIDC_ISSUER="login.example.com", TALLY_OIDC_CLIENT_ID="x")
    assert "TALLY_OIDC_ISSUER='login.example.com' is not a URL" in result.stderr


def test_a_client_secret_from_a_file_configures_sso(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    code = (
        "import django; django.setup(); from django.conf import settings; "
        "print(settings.OIDC_RP_CLIENT_SECRET, settings.AUTHENTICATION_BACKENDS[-1])"
    )
    environment = {k: v for k, v in os.environ.items() if not k.startswith("TALLY_OIDC")}
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={
            **environment,
            "SECRET_KEY": "t",
            "TALLY_OIDC_ISSUER": "https://login.example.com/",
            "TALLY_OIDC_CLIENT_ID": "tally",
            "TALLY_OIDC_CLIENT_SECRET_FILE": str(secret),
        },
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.split() == ["s3cret", "teams.oidc.OidcBackend"]


def test_without_node_the_provider_skips_or_fails_where_required(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(provider.shutil, "which", lambda name: None)
    monkeypatch.delenv("TALLY_OIDC_TESTS", raising=False)
    with pytest.raises(Skipped, match="node and npm are needed"):
        provider.node_ready()
    monkeypatch.setenv("TALLY_OIDC_TESTS", "required")
    with pytest.raises(Failed, match="node and npm are needed"):
        provider.node_ready()
