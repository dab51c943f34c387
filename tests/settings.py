"""Settings for the test suite: the project's settings with test-friendly environment defaults.

Tests run against real PostgreSQL and Redis: embedded ones under `.data/test`
unless DATABASE_URL / REDIS_URL point elsewhere.
"""

import os
from pathlib import Path

os.environ.setdefault("DJANGO_DEBUG", "1")
os.environ.setdefault("INFERPLANE_DATA_DIR", str(Path(__file__).resolve().parent.parent / ".data" / "test"))
os.environ.setdefault("INFERPLANE_API_KEY_CACHE_S", "1")

from controlplane.settings import *  # noqa: E402,F403

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # fast hashing for many test users
EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
