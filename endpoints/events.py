"""The endpoint's event log: one line per decision, failure or state change, shown in the console and API.

Every service that changes an endpoint or its replicas writes here; it sits below them all
(`services`, `replicas`, `scheduler`), so none has to import another to log.
"""

from __future__ import annotations

from endpoints.models import Endpoint, EndpointEvent, Replica


def record_event(endpoint: Endpoint, kind: str, message: str, *, replica: Replica | None = None, **details) -> EndpointEvent:
    return EndpointEvent.objects.create(endpoint=endpoint, replica=replica, kind=kind, message=message[:300], details=details)
