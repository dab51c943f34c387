"""Checks shared by the providers' `template_errors`: unknown fields, URLs, names, port ranges.

A template is staff input that reaches a process's argv, a machine's boot script or a pod spec:
every field is checked for its shape, and a field no provider knows is an error rather than
silently ignored (a typo such as `subnet` for `subnets` would otherwise launch in the wrong place).
"""

from __future__ import annotations

import re
from urllib.parse import urlparse

# Identifiers that reach a shell script or an API call: no spaces, quotes, `$` or `;`.
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+=-]{0,254}$")


def unknown_field_errors(template, known: tuple[str, ...]) -> dict[str, list[str]]:
    if not isinstance(template, dict):
        return {"template": ["An object of the provider's template fields."]}
    return {
        f"template.{name}": [f"Unknown field for this provider (known: {', '.join(known)})."]
        for name in template
        if name not in known
    }


def url_errors(value) -> list[str]:
    if not isinstance(value, str):
        return ["A URL (http or https)."]
    parsed = urlparse(value)
    if parsed.scheme not in ("http", "https") or not parsed.hostname or any(c.isspace() for c in value):
        return ["A URL (http or https) with a host."]
    return []


def name_errors(value, what: str) -> list[str]:
    if not isinstance(value, str) or not _SAFE_NAME.match(value):
        return [f"{what}: letters, digits and . _ : / @ + = - only."]
    return []


def parse_port_range(value) -> tuple[int, int]:
    """`"LOW-HIGH"` (or `[LOW, HIGH]`) as a pair; raises ValueError with the reason."""
    if isinstance(value, (list, tuple)) and len(value) == 2:
        low, high = value
    elif isinstance(value, str):
        low, _, high = value.partition("-")
    else:
        raise ValueError('A port range "LOW-HIGH".')
    try:
        ports = int(low), int(high)
    except (TypeError, ValueError):
        raise ValueError('A port range "LOW-HIGH" of whole numbers.') from None
    if not 1024 <= ports[0] <= ports[1] <= 65535:
        raise ValueError("Ports must satisfy 1024 <= LOW <= HIGH <= 65535.")
    return ports
