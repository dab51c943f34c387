"""Settings for the test suite: the project's settings with test-friendly environment defaults.

Tests run against real PostgreSQL and Redis: embedded ones under `.data/test`
(`.data/test/gw0`, `gw1`... for each pytest-xdist worker) unless DATABASE_URL /
REDIS_URL point elsewhere. Each pytest run (and the child processes it starts,
which inherit INFERPLANE_TEST_RUN_ID) has its own test database and its own
Redis database, so two runs on one machine never flush each other's state.
"""

import os
import re
from pathlib import Path

os.environ.setdefault("DJANGO_DEBUG", "1")
_data_dir = Path(os.environ.setdefault("INFERPLANE_DATA_DIR", str(Path(__file__).resolve().parent.parent / ".data" / "test")))
# NOTE: each pytest-xdist worker (PYTEST_XDIST_WORKER gw0, gw1...; tests/run.sh) has embedded servers of its
# own under <data dir>/<worker>: the autouse Redis flush, the Redis restart and the local pool's agents
# would otherwise reach into the other worker's tests. Its child processes inherit the folder as is.
_worker = os.environ.get("PYTEST_XDIST_WORKER")
if _worker and _data_dir.name != _worker:
    os.environ["INFERPLANE_DATA_DIR"] = str(_data_dir / _worker)
os.environ.setdefault("INFERPLANE_API_KEY_CACHE_S", "1")
RUN_ID = os.environ.setdefault("INFERPLANE_TEST_RUN_ID", str(os.getpid()))

from controlplane.settings import *  # noqa: E402,F403
from controlplane.settings import DATABASE_URL, DATABASES, EMAIL_HOST, LOCAL_STACK, REDIS_URL  # noqa: E402

DATABASES["default"]["TEST"] = {"NAME": f"test_inferplane_{RUN_ID}"}
REDIS_URL = re.sub(r"/\d+$", f"/{int(RUN_ID) % 15 + 1}", REDIS_URL)
CELERY_BROKER_URL = CELERY_RESULT_BACKEND = REDIS_URL
CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": REDIS_URL}}



def _embedded_postgres_without_durability(url: str) -> None:
    """The test folder's embedded PostgreSQL skips fsync and waits for no WAL flush: every commit and
    every transactional test's TRUNCATE would otherwise wait on the disk. Test data only: a crash
    loses nothing a test needs. Set once (ALTER SYSTEM, reloaded), checked by the pytest process."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as connection:
        if connection.execute("SHOW fsync").fetchone()[0] == "off":
            return
        for name in ("fsync", "synchronous_commit", "full_page_writes"):
            connection.execute(f"ALTER SYSTEM SET {name} = off")
        connection.execute("SELECT pg_reload_conf()")


# NOTE: only the embedded server the settings started for this folder (child processes get DATABASE_URL
# and skip this); never a server that DATABASE_URL names.
if LOCAL_STACK and "DATABASE_URL" not in os.environ:
    _embedded_postgres_without_durability(DATABASE_URL)

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # fast hashing for many test users
# NOTE: a child process given `EMAIL_HOST` (a test's own relay on loopback: tests/test_log_privacy.py) sends through it.
EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend" if EMAIL_HOST else "django.core.mail.backends.locmem.EmailBackend"
# NOTE: the password reset's mails are sent off the request (`accounts.mail_sender`); here within it, so a test reads
# `mail.outbox` as the request returns. The tests of the sender itself turn this off.
SEND_MAIL_IN_REQUEST = True
