"""Throwaway certificates, and the web server run as deployed: gunicorn with
deploy/gunicorn.conf.py, TLS on, a client CA, in its own process group.

`Pki` writes PEM files into a folder: a serving CA and the server's certificate for
127.0.0.1, the CA the webhook's callers come from and client certificates issued by any CA.
"""

from __future__ import annotations

import datetime
import http.client
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass, field
from ipaddress import IPv4Address
from pathlib import Path
from types import TracebackType

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

REPO = Path(__file__).resolve().parents[2]
# Settings of the process running the tests that would change what the server does.
INHERITED_SETTINGS = (
    "DATABASE_",
    "TALLY_",
    "REDIS_URL",
    "CELERY_",
    "GUNICORN_",
    "WEB_CONC",
    "TLS_",
)


@dataclass(frozen=True)
class Issued:
    """A certificate and its key, as objects and as PEM files."""

    certificate: x509.Certificate
    key: ec.EllipticCurvePrivateKey
    cert_file: Path
    key_file: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


@dataclass
class Pki:
    folder: Path
    issued: dict[str, Issued] = field(default_factory=dict)

    def ca(self, name: str) -> Issued:
        """A self-signed CA named `name`."""
        key = ec.generate_private_key(ec.SECP256R1())
        builder = self._builder(_name(name), _name(name), key).add_extension(
            x509.BasicConstraints(ca=True, path_length=None), critical=True
        )
        return self._write(name, builder.sign(key, hashes.SHA256()), key)

    def leaf(
        self, name: str, *, by: Issued, server: bool = False, dns: tuple[str, ...] = ()
    ) -> Issued:
        """A certificate for `name` (its CN) issued by the CA `by`: a server's for 127.0.0.1,
        or a client's with `dns` as its DNS subjectAltNames."""
        key = ec.generate_private_key(ec.SECP256R1())
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        names: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        if server:
            names.append(x509.IPAddress(IPv4Address("127.0.0.1")))
        builder = self._builder(_name(name), by.certificate.subject, key).add_extension(
            x509.ExtendedKeyUsage([usage]), critical=False
        )
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return self._write(name, builder.sign(by.key, hashes.SHA256()), key)

    def _builder(
        self, subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePrivateKey
    ) -> x509.CertificateBuilder:
        now = datetime.datetime.now(datetime.UTC)
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )

    def _write(
        self, name: str, certificate: x509.Certificate, key: ec.EllipticCurvePrivateKey
    ) -> Issued:
        cert_file, key_file = self.folder / f"{name}.crt", self.folder / f"{name}.key"
        cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        key_file.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        self.issued[name] = Issued(certificate, key, cert_file, key_file)
        return self.issued[name]

    def client_context(self, serving_ca: Issued, client: Issued | None) -> ssl.SSLContext:
        """What a client of the server uses: trusts `serving_ca`, presents `client`."""
        context = ssl.create_default_context(cafile=str(serving_ca.cert_file))
        if client is not None:
            context.load_cert_chain(str(client.cert_file), str(client.key_file))
        return context


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class Gunicorn:
    """gunicorn as deployed on free 127.0.0.1 ports (`listeners` of them: `ports`, the first
    also `port`); a context manager. Its log is `log`."""

    def __init__(
        self,
        folder: Path,
        *,
        environment: dict[str, str],
        arguments: tuple[str, ...] = (),
        listeners: int = 1,
    ) -> None:
        self.ports: list[int] = []
        while len(self.ports) < listeners:
            port = free_port()
            if port not in self.ports:
                self.ports.append(port)
        self.port = self.ports[0]
        self.log_path = folder / f"gunicorn-{self.port}.log"
        self.environment = {
            **{k: v for k, v in os.environ.items() if not k.startswith(INHERITED_SETTINGS)},
            "DEBUG": "false",
            "SECRET_KEY": "tests-only",
            "ALLOWED_HOSTS": "127.0.0.1",
            "GUNICORN_BIND": " ".join(f"127.0.0.1:{port}" for port in self.ports),
            **environment,
        }
        self.command = [
            sys.executable, "-m", "gunicorn", "--config", "deploy/gunicorn.conf.py",
            "--worker-tmp-dir", str(folder),  # the image's /dev/shm is Linux's only
            *arguments,
            "config.wsgi",
        ]  # fmt: skip
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def start(self) -> subprocess.Popen[bytes]:
        with open(self.log_path, "wb") as log:
            # Its own process group, so that the master and its workers stop together.
            self.process = subprocess.Popen(
                self.command,
                cwd=REPO,
                env=self.environment,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        return self.process

    def wait_until_serving(self, context: ssl.SSLContext, timeout: float = 60) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"gunicorn exited with {self.process.returncode}:\n{self.log}")
            connection = http.client.HTTPSConnection(
                "127.0.0.1", self.port, context=context, timeout=5
            )
            try:
                connection.request("GET", "/healthz")
                if connection.getresponse().status == 200:
                    return
            except OSError:
                pass  # not listening yet
            finally:
                connection.close()
            time.sleep(0.1)
        raise AssertionError(f"gunicorn did not answer /healthz within {timeout} s:\n{self.log}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def __enter__(self) -> Gunicorn:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
