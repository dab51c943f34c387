"""The OpenAPI schema's error answers: every operation documents the 4xx it can return.

drf-spectacular documents the success of each operation from its serializers; the errors come
from DRF's machinery around the view (parsing, authentication, permissions, lookups, throttles),
so they are added here once, from what the view is made of, rather than by hand on every view:

- 400 `ValidationError` where the operation reads a body or a query string (besides pagination);
- 401 `Error` where it accepts credentials (a missing, malformed, revoked or expired key), and there 503 `Error`
  with `Retry-After` too (every key-lookup slot taken by a flood of new keys: `authentication.KeyLookupsBusy`);
- 403 `Error` where a permission may refuse (a role or a key's scope too small);
- 404 `Error` where a path parameter names an object (absent, or another organisation's), and on
  every operation of a staff-only view (`staff_only = True`: anyone else gets a 404);
- 415 `Error` where it reads a body (a content type no parser reads);
- 429 `Error` with `Retry-After` where a throttle applies.

What a body may hold is documented as the view reads it, where drf-spectacular's defaults would say more:

- a serializer that refuses fields it does not know (`refuses_unknown_fields`: `StrictModelSerializer`) is an object
  with `additionalProperties: false`; before, the schema allowed any extra field, and the 400 a client generated from
  it got for one was a surprise;
- a view whose PATCH needs its body's fields (`patch_sets_every_field = True`: the one setting it changes) documents
  them required; drf-spectacular documents every PATCH body with each field optional, and `{}` was a 400.

A view that answers anything else (a 400 from a DELETE, a 503) says so with
`extend_schema(responses={503: OpenApiResponse(description="…")})`; a documented 4xx or 5xx without
a body gets the error body here.

The served schema (`/api/schema/`, public: third-party OpenAPI tools read it) leaves out staff-only views
(`leave_out_staff_only`), which answer anyone else a 404 as if the route did not exist, and is built once
per process and per format (`controlplane.schema_view`): it changes only with a deploy.
"""

from __future__ import annotations

from drf_spectacular import openapi
from drf_spectacular.plumbing import ResolvedComponent
from drf_spectacular.utils import inline_serializer
from rest_framework import serializers
from rest_framework.permissions import AllowAny

# The body of every DRF error but a validation error.
ERROR = inline_serializer("Error", {"detail": serializers.CharField(help_text="What went wrong, for a person.")})

VALIDATION_ERROR_SCHEMA = {
    "type": "object",
    "description": (
        "Each invalid field, by name, with its messages (a list of strings, or an object of the same shape "
        "for a nested field); `non_field_errors` for the whole body; `detail` alone when the body could not "
        "be parsed."
    ),
    "additionalProperties": {
        "oneOf": [
            {"type": "array", "items": {}},
            {"type": "object", "additionalProperties": {}},
            {"type": "string"},
        ],
    },
}
# Out of range or malformed, these are clamped or ignored (controlplane.pagination), never a 400.
PAGINATION_PARAMETERS = {"limit", "offset"}
RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before trying again.", "schema": {"type": "integer"}}}


class AutoSchema(openapi.AutoSchema):
    def get_operation(self, path, path_regex, path_prefix, method, registry):
        operation = super().get_operation(path, path_regex, path_prefix, method, registry)
        if operation is None:
            return None
        responses = operation["responses"]
        for status, description, headers in self._error_responses(operation):
            if status in responses and headers:  # the view's own answer (the portal's 503), and this one too
                responses[status]["description"] = f"{responses[status]['description']} Or: {description}"
                responses[status]["headers"] = responses[status].get("headers", {}) | headers
            else:
                responses.setdefault(status, {"description": description} | ({"headers": headers} if headers else {}))
        for status, response in responses.items():
            if status.startswith(("4", "5")) and "content" not in response:
                response["content"] = {"application/json": {"schema": self._error_schema(status)}}
        operation["responses"] = dict(sorted(responses.items()))
        return operation

    def _map_basic_serializer(self, serializer, direction):
        schema = super()._map_basic_serializer(serializer, direction)
        # NOTE: the request's side only (`COMPONENT_SPLIT_REQUEST`): on an answer's component it told strict generated
        # clients (pydantic's `extra="forbid"`) that no release would ever add a field, and the first one added (during
        # a rollout, pods of two releases answering) failed their parse
        if direction == "request" and getattr(serializer, "refuses_unknown_fields", False):
            schema["additionalProperties"] = False
        return schema

    def _get_request_for_media_type(self, serializer, direction="request"):
        if self.method == "PATCH" and getattr(self.view, "patch_sets_every_field", False):
            # NOTE: drf-spectacular makes a PATCH body partial by the method alone: documented as a PUT's, it is whole.
            self.method = "PUT"
            try:
                return super()._get_request_for_media_type(serializer, direction)
            finally:
                self.method = "PATCH"
        return super()._get_request_for_media_type(serializer, direction)

    def _error_responses(self, operation: dict):
        parameters = operation.get("parameters", [])
        reads_body = "requestBody" in operation
        if reads_body or any(p.get("in") == "query" and p["name"] not in PAGINATION_PARAMETERS for p in parameters):
            yield "400", "The request is invalid: see each field's messages.", None
        accepts_credentials = any(requirement for requirement in operation.get("security", []))
        if accepts_credentials:
            yield "401", "No credentials, or an invalid, expired or revoked API key.", None
        if not all(isinstance(permission, AllowAny) for permission in self.view.get_permissions()):
            yield "403", "The caller's role, or its API key's scopes, do not allow this.", None
        if getattr(self.view, "staff_only", False):
            yield "404", "No such object, or the caller is not staff.", None
        elif any(p.get("in") == "path" for p in parameters):
            yield "404", "No such object in the caller's organisation.", None
        if reads_body:
            yield "415", "The body's content type is not one this operation reads.", None
        if self.view.get_throttles():
            yield "429", "Too many requests: wait `Retry-After` seconds.", RETRY_AFTER
        if accepts_credentials:
            # NOTE: any operation that takes a key answers this while a flood of made-up keys holds every lookup.
            yield "503", "Too many API keys are being checked at once: wait `Retry-After` seconds.", RETRY_AFTER

    def _error_schema(self, status: str) -> dict:
        if status != "400":
            return self.resolve_serializer(ERROR, "response").ref
        component = ResolvedComponent(name="ValidationError", type=ResolvedComponent.SCHEMA, object="ValidationError",
                                      schema=VALIDATION_ERROR_SCHEMA)
        self.registry.register_on_missing(component)
        return component.ref


def leave_out_staff_only(endpoints, **kwargs):
    """drf-spectacular's preprocessing hook: no operation of a staff-only view (`staff_only = True`) in the schema.

    NOTE: such a view answers anyone but staff a 404, as if the route did not exist; a public schema listing it
    said it did, and what it takes.
    """
    return [endpoint for endpoint in endpoints if not getattr(getattr(endpoint[3], "cls", None), "staff_only", False)]
