"""Settings for the test suite: the project's settings with test-friendly environment defaults.

Tests run against real PostgreSQL and Redis: embedded ones under `.data/test`
unless DATABASE_URL / REDIS_URL point elsewhere. Each pytest run (and the child
processes it starts, which inherit INFERPLANE_TEST_RUN_ID) has its own test
database and its own Redis database, so two runs on one machine never flush
each other's state.
"""

import os
import re
from pathlib import Path

os.environ.setdefault("DJANGO_DEBUG", "1")
os.environ.setdefault("INFERPLANE_DATA_DIR", str(Path(__file__).resolve().parent.parent / ".data" / "test"))
os.environ.setdefault("INFERPLANE_API_KEY_CACHE_S", "1")
RUN_ID = os.environ.setdefault("INFERPLANE_TEST_RUN_ID", str(os.getpid()))

from controlplane.settings import *  # noqa: E402,F403
from controlplane.settings import DATABASES, REDIS_URL  # noqa: E402

DATABASES["default"]["TEST"] = {"NAME": f"test_inferplane_{RUN_ID}"}
REDIS_URL = re.sub(r"/\d+$", f"/{int(RUN_ID) % 15 + 1}", REDIS_URL)
CELERY_BROKER_URL = CELERY_RESULT_BACKEND = REDIS_URL
CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": REDIS_URL}}

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # fast hashing for many test users
EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
