"""The management API's schema with its staff-only views, which the served one leaves out
(`controlplane.schema.leave_out_staff_only`): what the pools' API documents for staff."""

from __future__ import annotations

import json

from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.settings import patched_settings


def staff_schema() -> dict:
    with patched_settings({"PREPROCESSING_HOOKS": []}):
        schema = SchemaGenerator().get_schema(request=None, public=True)
    return json.loads(json.dumps(schema, default=str))  # plain JSON types, as a client reads it
