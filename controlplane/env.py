"""Typed access to environment variables.

Every setting the control plane reads from the environment goes through these
helpers, so a bad value fails loudly at start-up instead of misbehaving later.
`SETTINGS_ENV_VARS` collects every name read, which the README's configuration
table and the infra manifests are checked against.
"""

from __future__ import annotations

import ipaddress
import math
import os
from decimal import Decimal, InvalidOperation
from urllib.parse import parse_qs, unquote, urlparse

from django.core.exceptions import ImproperlyConfigured

SETTINGS_ENV_VARS: set[str] = set()


class ImproperlyConfiguredEnv(ImproperlyConfigured, ValueError):
    """An environment variable holds a value that cannot be used, or is missing where it must be set."""


def _raw(name: str) -> str | None:
    SETTINGS_ENV_VARS.add(name)
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    return value.strip()


def env_str(name: str, default: str | None = None) -> str | None:
    value = _raw(name)
    return default if value is None else value


def env_bool(name: str, default: bool = False) -> bool:
    value = _raw(name)
    if value is None:
        return default
    lowered = value.lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ImproperlyConfiguredEnv(f"{name} must be a boolean (1/0, true/false, yes/no, on/off), not {value!r}")


def env_choice(name: str, default: str, *, choices: tuple[str, ...]) -> str:
    value = _raw(name)
    if value is None:
        return default
    if value.lower() not in choices:
        raise ImproperlyConfiguredEnv(f"{name} must be one of {', '.join(choices)}, not {value!r}")
    return value.lower()


def env_int(name: str, default: int, *, minimum: int | None = None, maximum: int | None = None) -> int:
    value = _raw(name)
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        raise ImproperlyConfiguredEnv(f"{name} must be an integer, not {value!r}") from None
    if minimum is not None and number < minimum:
        raise ImproperlyConfiguredEnv(f"{name} must be at least {minimum}, not {number}")
    if maximum is not None and number > maximum:
        raise ImproperlyConfiguredEnv(f"{name} must be at most {maximum}, not {number}")
    return number


def env_float(name: str, default: float, *, minimum: float | None = None) -> float:
    value = _raw(name)
    if value is None:
        return default
    try:
        number = float(value)
    except ValueError:
        raise ImproperlyConfiguredEnv(f"{name} must be a number, not {value!r}") from None
    # NOTE: `float` reads "nan" and "inf", which pass every bound (`nan < minimum` is False) and turn off what they time
    if not math.isfinite(number):
        raise ImproperlyConfiguredEnv(f"{name} must be a finite number, not {value!r}")
    if minimum is not None and number < minimum:
        raise ImproperlyConfiguredEnv(f"{name} must be at least {minimum}, not {number}")
    return number


def env_decimal(name: str, default: str) -> Decimal:
    value = _raw(name) or default
    try:
        return Decimal(value)
    except InvalidOperation:
        raise ImproperlyConfiguredEnv(f"{name} must be a decimal number, not {value!r}") from None


def env_list(name: str, default: list[str] | None = None) -> list[str]:
    value = _raw(name)
    if value is None:
        return list(default or [])
    return [item.strip() for item in value.split(",") if item.strip()]


def env_aws_account_ids(name: str) -> frozenset[str]:
    """Comma-separated AWS account ids, twelve digits each (`111122223333,444455556666`); unset means none."""
    ids = env_list(name)
    for item in ids:
        if not (len(item) == 12 and item.isascii() and item.isdigit()):
            raise ImproperlyConfiguredEnv(f"{name} must list 12-digit AWS account ids, comma-separated, not {item!r}")
    return frozenset(ids)


def env_networks(name: str, default: str = "") -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """Comma-separated CIDRs (`10.20.0.0/16,fd00:20::/64`), each strict (no host bits set); unset means `default`."""
    networks = []
    for item in env_list(name, [item for item in default.split(",") if item]):
        try:
            networks.append(ipaddress.ip_network(item))
        except ValueError:
            raise ImproperlyConfiguredEnv(f"{name} must list networks as CIDRs (10.20.0.0/16), comma-separated, "
                                          f"not {item!r}") from None
    return tuple(networks)


def env_host_ports(name: str) -> tuple[tuple[str, int], ...]:
    """Comma-separated `host:port` addresses (`node-2:6379,[fd00::3]:6379`); unset means none."""
    addresses = []
    for item in env_list(name):
        host, separator, port = item.rpartition(":")
        bracketed = host.startswith("[") and host.endswith("]")
        host = host[1:-1] if bracketed else host
        # NOTE: an IPv6 host only in brackets: `fd00::3` (its port forgotten) would read as the host `fd00:` on port 3
        if (not separator or not host or (":" in host) != bracketed or not (port.isascii() and port.isdigit())
                or not 0 < int(port) < 65536):
            raise ImproperlyConfiguredEnv(f"{name} must list addresses as host:port, comma-separated, not {item!r}")
        addresses.append((host, int(port)))
    return tuple(addresses)


def env_counts(name: str) -> dict[str, int]:
    """`name=count,name=count` (e.g. `h100=2,a100=4`) as a dict; unset means empty."""
    counts = {}
    for item in env_list(name):
        key, separator, value = item.partition("=")
        if not separator or not key.strip() or not value.strip().isdigit():
            raise ImproperlyConfiguredEnv(f"{name} must read like 'h100=2,a100=4', not {item!r}")
        counts[key.strip()] = int(value)
    return counts


def env_spend_ceilings(name: str, default: str) -> tuple[tuple[Decimal, Decimal | None], ...]:
    """`paid:ceiling,...` in USD (e.g. `0:100,50:500,5000:none`): an organisation that has paid at least `paid` in total
    may spend at most `ceiling` a month (`none`: no ceiling; `billing.standing.spend_ceiling`). The first step starts
    at 0, steps rise strictly, and a ceiling never falls as the paid total rises: `none` only last."""
    value = _raw(name) or default
    steps: list[tuple[Decimal, Decimal | None]] = []
    for item in value.split(","):
        paid_text, separator, ceiling_text = item.strip().partition(":")
        try:
            paid = Decimal(paid_text.strip())
            ceiling = None if ceiling_text.strip().lower() == "none" else Decimal(ceiling_text.strip())
        except InvalidOperation:
            paid = ceiling = Decimal("NaN")
        if not separator or not paid.is_finite() or paid < 0 or (ceiling is not None and (
                not ceiling.is_finite() or ceiling < 0)):
            raise ImproperlyConfiguredEnv(f"{name} must read like '0:100,50:500,5000:none' (paid USD:monthly ceiling "
                                          f"USD or none), not {item.strip()!r} in {value!r}")
        steps.append((paid, ceiling))
    if steps[0][0] != 0:
        raise ImproperlyConfiguredEnv(f"{name} must start at 0 paid (the ceiling of an organisation that paid nothing), "
                                      f"not {value!r}")
    for (paid_before, ceiling_before), (paid, ceiling) in zip(steps, steps[1:], strict=False):
        if paid <= paid_before:
            raise ImproperlyConfiguredEnv(f"{name} must list its paid totals rising, not {value!r}")
        if ceiling_before is None or (ceiling is not None and ceiling < ceiling_before):
            raise ImproperlyConfiguredEnv(f"{name} must not lower a ceiling as the paid total rises (none: last), "
                                          f"not {value!r}")
    return tuple(steps)


# libpq's options every PostgreSQL connection gets unless `DATABASE_URL` sets them (README, "Configuration"): a connect
# gives up after `connect_timeout` s, and an established TCP session whose peer went silent (a failover, a partition:
# no RST) is found dead by keepalives after ~60 s idle, or after `tcp_user_timeout` ms of unacknowledged data, instead
# of hanging every request handed it (libpq's defaults: no connect timeout, the kernel's 2-hour keepalive, no user
# timeout). NOTE: a Unix socket ignores the TCP ones.
DATABASE_CONNECTION_DEFAULTS = {
    "connect_timeout": "5",
    "keepalives": "1",
    "keepalives_idle": "30",
    "keepalives_interval": "10",
    "keepalives_count": "3",
    "tcp_user_timeout": "30000",
}


def parse_database_url(url: str) -> dict:
    """Turn `postgresql://user:pass@host:port/name?host=/socket/dir` into Django's DATABASES entry, with libpq's
    `DATABASE_CONNECTION_DEFAULTS` where the URL does not set them."""
    parsed = urlparse(url)
    if parsed.scheme not in {"postgres", "postgresql", "pgsql"}:
        raise ImproperlyConfiguredEnv(f"DATABASE_URL must be a postgresql:// URL, not {parsed.scheme or url!r}")
    name = unquote(parsed.path.lstrip("/"))
    if not name:
        raise ImproperlyConfiguredEnv("DATABASE_URL must name a database")
    query = {key: values[-1] for key, values in parse_qs(parsed.query).items()}
    host = query.pop("host", None) or parsed.hostname or ""
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": name,
        "USER": unquote(parsed.username or ""),
        "PASSWORD": unquote(parsed.password or ""),
        "HOST": host,
        "PORT": str(parsed.port or ""),
        "OPTIONS": DATABASE_CONNECTION_DEFAULTS | query,
    }
