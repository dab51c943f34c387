"""A lone surrogate in JSON a client sends: where it is, as an error's `param` names it (`messages[0].content`).

JSON may escape one (`"\\ud800"`) and the json module decodes it into a `str`, but it is not text: it cannot be written
as UTF-8, so PostgreSQL refuses it, vLLM fails on it, and a renderer that echoes it (DRF's, in a 400 naming a bad
value or field) raises. The gateway (`endpoints.gateway.request`) and the management API's parser
(`controlplane.parsers`) refuse a body holding one with a 400 naming where, by this one rule.
"""

from __future__ import annotations

import re

import msgspec

_encoder = msgspec.json.Encoder()
_SURROGATE = re.compile("[\ud800-\udfff]")
# An object key a `param` names (`metadata.job`); past another (free text), the param names the object holding it.
_PARAM_KEY = re.compile(r"[A-Za-z0-9_\-]{1,64}")


def param_of_lone_surrogate(payload) -> str | None:
    """Where `payload` (JSON as the json module decodes it, its depth already bounded) holds a lone surrogate, as
    `lone_surrogate_at` names it, or None.

    NOTE: msgspec's encoder (C) first: it refuses a lone surrogate, and only one, so the walk (Python, a step an
    element) runs only for a body that really holds one. An escaped backslash before `ud800` (no surrogate) in 720 KB
    of `[]`, `[]`, … had the walk add 1.3 s of the event loop to the json module's 0.57 s."""
    try:
        _encoder.encode(payload)
    except UnicodeEncodeError:
        return lone_surrogate_at(payload)
    return None


def lone_surrogate_at(value) -> str | None:
    """Where in `value` (decoded by the json module, which joins a valid pair into one character: any surrogate left in
    a string is a lone one) the first string or object key holding a lone surrogate is, as a `param`
    (`messages[0].content`, `metadata.job`; "" for a key of the body itself), or None.

    NOTE: a lone surrogate is not text: vLLM generated a whole Responses answer for a body with one in `metadata` or
    `user`, then failed to write the answer that echoes them (a 400: billed nothing), and answered 500 for one in
    `stop` (the gateway took its replica for failed); PostgreSQL refuses one in a usage row or an error."""
    # NOTE: each item stacked with its place, a link to its parent's (`_param_of`), the param's text made only for the
    # one found: nested 64-character keys 800 deep over 30,000 items, each item's param built as it was stacked, took
    # 1.5 GB and 1.7 s of the event loop for a 115 KB body.
    stack: list[tuple[object, tuple | None, bool]] = [(value, None, True)]  # a value, its place, whether named
    while stack:
        item, place, named = stack.pop()
        if isinstance(item, str):
            if not item.isascii() and _SURROGATE.search(item) is not None:
                return _param_of(place)
        elif isinstance(item, dict):
            children = []
            for key, child in item.items():
                if not key.isascii() and _SURROGATE.search(key) is not None:
                    return _param_of(place)
                nameable = named and _PARAM_KEY.fullmatch(key) is not None
                children.append((child, (place, key) if nameable else place, nameable))
            stack.extend(reversed(children))  # NOTE: in the body's order: the first one is named
        elif isinstance(item, list):
            stack.extend((item[index], (place, index) if named else place, named)
                         for index in range(len(item) - 1, -1, -1))
    return None


def _param_of(place: tuple | None) -> str:
    """`place` (an item's parent's place, None for the body, and its key or index there) as a `param`
    (`messages[0].content`; "" for the body itself)."""
    steps: list[str | int] = []
    while place is not None:
        place, step = place
        steps.append(step)
    param = ""
    for step in reversed(steps):
        param = f"{param}[{step}]" if isinstance(step, int) else f"{param}.{step}" if param else step
    return param
