"""Settings, all from the environment (twelve-factor), with a zero-setup SQLite default.

GPUPROXY_DATA_DIR   where the SQLite file and the generated secret key live (default ./var)
DATABASE_URL        postgres://user:pass@host:port/db switches to PostgreSQL (psycopg 3, pooled);
                    sqlite:////abs/path.sqlite3 names another SQLite file (default: the data dir's)
GPUPROXY_SECRET_KEY Django's secret key; else one is generated once into the data dir
GPUPROXY_DEBUG      1 turns DEBUG on; never in production
GPUPROXY_LOG_LEVEL  DEBUG|INFO|WARNING|ERROR (default INFO)
GPUPROXY_ALLOWED_HOSTS host names answered besides the default ones (any IP address, localhost
                    and *.localhost, this machine's names, the --listen name), comma-separated:
                    `gpu.example.com`, `.example.com` for a domain and its subdomains, `*` for
                    any; any other Host gets 400 (DNS rebinding; gpuproxy/proxy/exposure.py)
GPUPROXY_CORS_ORIGINS origins (scheme://host[:port]) whose pages may call the management paths
                    (/api/*, /logs*, /running, /upstream/*, ...) and, while no API key is
                    defined, /v1/*; comma-separated, `*` for any (docs/security.md)
GPUPROXY_MAX_BODY_MB  largest request body accepted by the proxy (default 32), in MiB (the
                    GPUPROXY_MAX_BODY_BYTES setting); checked at the edge (gpuproxy/proxy/edge.py)
                    from Content-Length before the body is read (413, also instead of
                    `100 Continue`) and as a chunked body arrives
GPUPROXY_HEADER_TIMEOUT_SECONDS the request line and headers must arrive within this many
                    seconds of their first byte (default 30), else 408 and the connection
                    closes; bodies and responses are never timed (an inference takes minutes)
GPUPROXY_SHUTDOWN_GRACE_SECONDS on SIGTERM/SIGINT, how long requests in flight may finish
                    before the upstreams stop (default 30); new and queued requests get 503
                    `shutting_down` meanwhile, and a second signal ends the wait at once
GPUPROXY_NODE       this box's name in a fleet (default: the host name, or its first label when
                    the whole name is too long): letters, digits, `.`, `-`, `_`, at most 63
                    characters; one `serve` per node per database, and every activity row and
                    model event carries it (`node`); a bad value stops the start
GPUPROXY_FLEET_SECONDS how often this node's serve rewrites its row of the fleet view
                    (`activity_node`: heartbeat, loaded models, queues, in flight; default 1,
                    at least 0.05); 0 turns the publisher off. On SQLite it never runs: a
                    fleet shares one PostgreSQL database
GPUPROXY_FLEET_DOWN_SECONDS a node whose heartbeat is older than this is shown down in the
                    fleet view (default 3; docs/fleet.md)
GPUPROXY_FLEET_KEY  a secret shared by every node of a fleet (at least 16 characters; in
                    Kubernetes a Secret): it turns forwarding between nodes on, and a request
                    another node forwarded carries it. Unset: no node forwards, and a request
                    that carries one is refused (docs/fleet.md, "Forwarding between nodes")
GPUPROXY_FLEET_MARGIN forward a request for a model this node serves when another node that
                    serves it has at least this many fewer requests waiting (default 4; `off`:
                    only models this node does not serve are forwarded)
GPUPROXY_ADVERTISE  the URL the other nodes reach this one at (e.g. http://10.0.0.5:8080);
                    default: http:// and the --listen address when it is a concrete one, else
                    this machine's host name and the --listen port
GPUPROXY_LOCK_CHECK_SECONDS how often the one-proxy-per-node lock's own connection is
                    checked, and the lock re-taken after a database outage (default 1); the
                    same check makes /health say `degraded` while the database is unreachable
GPUPROXY_TRUSTED_PROXIES reverse proxies (IPs and CIDR networks, comma-separated) whose
                    X-Forwarded-For/Forwarded headers name the client in the activity log
                    (gpuproxy/proxy/client_ip.py); none by default: the TCP peer is the client
"""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlsplit

from django.core.exceptions import ImproperlyConfigured

from scheduling.nodes import NODE_NAME, NODE_NAME_RULE

BASE_DIR = Path(__file__).resolve().parent.parent


def env_bool(name: str, default: str = "0") -> bool:
    value = os.environ.get(name, default).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ImproperlyConfigured(f"{name}={value!r} is not a boolean; use 1 or 0")


def env_int(name: str, default: str, *, minimum: int | None = None) -> int:
    value = os.environ.get(name, default)
    try:
        number = int(value)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={value!r} is not an integer") from None
    if minimum is not None and number < minimum:
        raise ImproperlyConfigured(f"{name}={value!r} must be at least {minimum}")
    return number


def env_float(name: str, default: str, *, minimum: float = 0.0) -> float:
    value = os.environ.get(name, default)
    try:
        number = float(value)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={value!r} is not a number of seconds") from None
    if not minimum <= number < float("inf"):  # also refuses nan
        raise ImproperlyConfigured(f"{name}={value!r} must be a finite number of seconds, "
                                   f"at least {minimum:g}")
    return number


def env_list(name: str) -> list[str]:
    return [v.strip() for v in os.environ.get(name, "").split(",") if v.strip()]


def env_networks(name: str) -> tuple:
    """IP addresses and CIDR networks, comma-separated; a bad one stops the start."""
    from gpuproxy.proxy.client_ip import parse_trusted

    value = os.environ.get(name, "")
    try:
        return parse_trusted(value)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name}={value!r}: {exc}") from None


def env_node(name: str = "GPUPROXY_NODE", hostname: str | None = None) -> str:
    """This box's name in a fleet. It keys the one-instance lock and marks every activity
    row, so a bad value stops the start rather than being mangled into a name nobody chose;
    a host name too long for one is taken up to its first dot (`gpu1.lab.example` -> `gpu1`)
    only when the whole does not fit."""
    value = os.environ.get(name)
    if value is not None:
        if not NODE_NAME.fullmatch(value):
            raise ImproperlyConfigured(
                f"{name}={value!r} is not a node name: use {NODE_NAME_RULE} "
                f"(e.g. {name}=gpu-box-1), or unset it to use the host name")
        return value
    host = socket.gethostname() if hostname is None else hostname
    for candidate in (host, host.split(".", 1)[0]):
        if NODE_NAME.fullmatch(candidate):
            return candidate
    raise ImproperlyConfigured(
        f"this machine's host name {host!r} is not a node name ({NODE_NAME_RULE}): "
        f"set {name} to one, e.g. {name}=gpu-box-1")


def sqlite_database(path: Path | str) -> dict:
    return {
        "ENGINE": "django_prometheus.db.backends.sqlite3",  # django_db_* series
        "NAME": path,
        # WAL: the activity writer's commits no longer wait for a full sync, and readers
        # (admin, /api/activity) do not block it (BENCHMARKS.md).
        "OPTIONS": {"timeout": 20,
                    "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL"},
    }


def database_from_url(url: str) -> dict:
    """Parse DATABASE_URL without a dependency: PostgreSQL, or a SQLite file by its path."""
    parts = urlsplit(url)
    if parts.scheme == "sqlite":
        # dj-database-url's spelling: sqlite:///relative.sqlite3, sqlite:////absolute.sqlite3
        path = unquote(parts.path)[1:]
        if parts.netloc or not path:
            raise ImproperlyConfigured(
                f"DATABASE_URL {url!r} names no SQLite file; write sqlite:////abs/path.sqlite3 "
                "(four slashes for an absolute path)")
        return sqlite_database(path)
    if parts.scheme not in ("postgres", "postgresql", "pgsql"):
        raise ImproperlyConfigured(
            f"DATABASE_URL scheme {parts.scheme!r} is not supported; use postgres://user@host/db "
            "or unset DATABASE_URL for the SQLite default"
        )
    options: dict = dict(parse_qsl(parts.query))
    options["pool"] = {"min_size": 1, "max_size": 8, "timeout": 10}
    return {
        "ENGINE": "django_prometheus.db.backends.postgresql",  # django_db_* series
        "NAME": unquote(parts.path.lstrip("/")) or "postgres",
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "",
        "PORT": str(parts.port or ""),
        # Django refuses pooling together with persistent connections, and its docs
        # say persistent connections should be off under ASGI.
        "CONN_MAX_AGE": 0,
        "OPTIONS": options,
    }


DATA_DIR = Path(os.environ.get("GPUPROXY_DATA_DIR", "var")).resolve()
DATA_DIR.mkdir(parents=True, exist_ok=True)


def _refuse_placeholder(name: str, value: str) -> None:
    """deploy/kubernetes/secret.yaml ships `REPLACE-WITH-...` values: applied unedited, every
    fleet would share one published key, which proves nothing and signs anyone's session."""
    if value.startswith("REPLACE-"):
        raise ImproperlyConfigured(
            f"{name} is still the placeholder of the example Secret: make a real one with "
            f"`openssl rand -hex 32` and give the same value to every node")


def env_secret_key(name: str = "GPUPROXY_SECRET_KEY") -> str:
    """Django's secret key from the environment, "" when unset (then one is generated)."""
    value = os.environ.get(name, "")
    _refuse_placeholder(name, value)
    return value


def _secret_key() -> str:
    if key := env_secret_key():
        return key
    path = DATA_DIR / "secret_key"
    if not path.exists():
        # O_EXCL: two processes starting at once must agree on one key.
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "w") as fh:
                fh.write(secrets.token_urlsafe(50))
    key = path.read_text().strip()
    if not key:
        raise ImproperlyConfigured(f"{path} is empty; delete it to generate a new secret key")
    return key


SECRET_KEY = _secret_key()
DEBUG = env_bool("GPUPROXY_DEBUG")
# The Host allow-list is gpuproxy/proxy/exposure.py's, applied in front of Django and the proxy
# consumer alike (it allows any IP address, which ALLOWED_HOSTS cannot say); Django's own
# check would see the same Host after it.
ALLOWED_HOSTS = ["*"]
GPUPROXY_ALLOWED_HOSTS = [h.lower() for h in env_list("GPUPROXY_ALLOWED_HOSTS")]
GPUPROXY_CORS_ORIGINS = env_list("GPUPROXY_CORS_ORIGINS")
# Peers whose forwarding headers are believed (the activity row's client_ip).
GPUPROXY_TRUSTED_PROXIES = env_networks("GPUPROXY_TRUSTED_PROXIES")

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "django_prometheus",
    "gpuproxy",
    "scheduling",
    "activity",
    "dashboard",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "gpuproxy.urls"
ASGI_APPLICATION = "gpuproxy.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
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

if os.environ.get("DATABASE_URL"):
    DATABASES = {"default": database_from_url(os.environ["DATABASE_URL"])}
else:
    DATABASES = {"default": sqlite_database(DATA_DIR / "gpuproxy.sqlite3")}

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = DATA_DIR / "static"

LOG_LEVEL = os.environ.get("GPUPROXY_LOG_LEVEL", "INFO").upper()
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "line": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"},
    },
    "handlers": {
        "stdout": {"class": "logging.StreamHandler", "stream": "ext://sys.stdout",
                   "formatter": "line"},
        "proxylog": {"class": "gpuproxy.upstream.logbuffer.ProxyLogHandler", "formatter": "line"},
    },
    "loggers": {
        "gpuproxy": {"handlers": ["stdout", "proxylog"], "level": LOG_LEVEL, "propagate": False},
        "scheduling": {"handlers": ["stdout", "proxylog"], "level": LOG_LEVEL,
                       "propagate": False},
        "activity": {"handlers": ["stdout", "proxylog"], "level": LOG_LEVEL, "propagate": False},
        "django": {"handlers": ["stdout"], "level": "WARNING"},
    },
}

# Largest request body the proxy accepts (413 above it); images and audio need room.
GPUPROXY_MAX_BODY_BYTES = env_int("GPUPROXY_MAX_BODY_MB", "32") * 1024 * 1024
# A client that trickles its request head holds a connection; bodies and answers are not timed.
GPUPROXY_HEADER_TIMEOUT = env_float("GPUPROXY_HEADER_TIMEOUT_SECONDS", "30", minimum=0.1)
GPUPROXY_SHUTDOWN_GRACE = env_float("GPUPROXY_SHUTDOWN_GRACE_SECONDS", "30")
GPUPROXY_NODE = env_node()
GPUPROXY_LOCK_CHECK = env_float("GPUPROXY_LOCK_CHECK_SECONDS", "1", minimum=0.05)
GPUPROXY_FLEET_SECONDS = env_float("GPUPROXY_FLEET_SECONDS", "1")
if 0 < GPUPROXY_FLEET_SECONDS < 0.05:  # 0 is off; a tighter loop would only load the database
    raise ImproperlyConfigured(f"GPUPROXY_FLEET_SECONDS={GPUPROXY_FLEET_SECONDS:g}: give 0 (off) "
                               "or at least 0.05 seconds")
GPUPROXY_FLEET_DOWN_SECONDS = env_float("GPUPROXY_FLEET_DOWN_SECONDS", "3", minimum=0.1)


def env_fleet_key(name: str = "GPUPROXY_FLEET_KEY") -> str:
    """The fleet's shared secret, "" when unset. A short one could be guessed by anyone who
    can reach a node, and would then let them claim any caller's name and priority."""
    value = os.environ.get(name, "")
    _refuse_placeholder(name, value)
    if value and (len(value) < 16 or not value.isprintable() or not value.isascii()):
        raise ImproperlyConfigured(
            f"{name} must be at least 16 printable ASCII characters (it was {len(value)} "
            f"long); e.g. {name}=$(openssl rand -hex 32), the same on every node")
    return value


def env_margin(name: str = "GPUPROXY_FLEET_MARGIN", default: str = "4") -> int | None:
    """Requests fewer waiting elsewhere before a local model's request is forwarded; None:
    off. At least 1: with 0, two nodes with equal queues would forward to each other."""
    value = os.environ.get(name, default).strip().lower()
    if value == "off":
        return None
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise ImproperlyConfigured(f"{name}={value!r}: give a whole number of requests, at "
                                   "least 1 (e.g. 4), or off")
    return number


def env_advertise(name: str = "GPUPROXY_ADVERTISE") -> str:
    """The URL the other nodes forward to, "" for the default derived from --listen."""
    value = os.environ.get(name, "").strip().rstrip("/")
    if not value:
        return ""
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path or (
            parts.query or parts.username or parts.password):
        raise ImproperlyConfigured(f"{name}={value!r} is not a base URL: give scheme, host "
                                   "and port only, e.g. http://10.0.0.5:8080")
    return value


GPUPROXY_FLEET_KEY = env_fleet_key()
GPUPROXY_FLEET_MARGIN = env_margin()
GPUPROXY_ADVERTISE = env_advertise()
# How often the running proxy checks the definitions' fingerprint (saves it was not told of).
GPUPROXY_RELOAD_SECONDS = env_float("GPUPROXY_RELOAD_SECONDS", "2", minimum=0.01)
# A streaming request that waits gets an SSE comment this often, so idle timeouts do not cut it.
GPUPROXY_STREAM_KEEPALIVE = env_float("GPUPROXY_STREAM_KEEPALIVE_SECONDS", "15", minimum=0.01)
# Activity rows held in memory while the database is away; over it, the oldest are dropped.
GPUPROXY_ACTIVITY_BUFFER = env_int("GPUPROXY_ACTIVITY_BUFFER", "100000", minimum=1)
