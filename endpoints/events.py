"""The endpoint's event log: one line per decision, failure or state change, shown in the console and API.

Every service that changes an endpoint or its replicas writes here; it sits below them all
(`services`, `replicas`, `scheduler`), so none has to import another to log.
"""

from __future__ import annotations

import re

from endpoints.models import Endpoint, EndpointEvent, Replica


def record_event(endpoint: Endpoint, kind: str, message: str, *, replica: Replica | None = None, **details) -> EndpointEvent:
    return EndpointEvent.objects.create(endpoint=endpoint, replica=replica, kind=kind, message=message[:300], details=details)


def record_event_once(endpoint: Endpoint, kind: str, message: str, **details) -> EndpointEvent | None:
    """`record_event` unless the endpoint's last event of `kind` says the same (numbers aside): a
    decision taken again every tick is logged once per change, not once per tick."""
    last = EndpointEvent.objects.filter(endpoint=endpoint, kind=kind).order_by("-created_at").first()
    if last is not None and _without_numbers(last.message) == _without_numbers(message[:300]):
        return None
    return record_event(endpoint, kind, message, **details)


def _without_numbers(text: str) -> str:
    return re.sub(r"\d+", "#", text.lower())
