"""`/api/schema/`: the management API's OpenAPI schema, public (third-party OpenAPI tools read it), built once
per process and rendered once per format: it changes only with a deploy.

NOTE: built per request (about a second of CPU), any anonymous client could keep the web processes busy, and
each `?version=` or `?lang=` made another build; neither is read here. Staff-only views are left out
(`controlplane.schema.leave_out_staff_only`).
"""

from __future__ import annotations

import threading

from django.http import HttpResponse
from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.utils import extend_schema
from drf_spectacular.views import SpectacularAPIView

_built_lock = threading.Lock()
_schema: dict | None = None
_rendered: dict[type, bytes] = {}


def public_schema() -> dict:
    """The schema as served, built on first use."""
    global _schema
    with _built_lock:
        if _schema is None:
            _schema = SchemaGenerator().get_schema(request=None, public=True)
        return _schema


def forget_schema() -> None:
    """Build the schema again on the next request (tests that change what it documents)."""
    global _schema
    with _built_lock:
        _schema = None
        _rendered.clear()


class CachedSchemaView(SpectacularAPIView):
    """The schema as YAML, or JSON (`?format=json`, or `Accept: application/json`), from this process's copy."""

    @extend_schema(exclude=True)
    def get(self, request, *args, **kwargs):
        renderer = request.accepted_renderer
        with _built_lock:
            content = _rendered.get(type(renderer))
        if content is None:
            content = renderer.render(public_schema(), renderer.media_type, {})
            with _built_lock:
                _rendered[type(renderer)] = content
        content_type = f"{renderer.media_type}; charset={renderer.charset}" if renderer.charset else renderer.media_type
        return HttpResponse(content, content_type=content_type,
                            headers={"Content-Disposition": f'inline; filename="{self._get_filename(request, None)}"'})
