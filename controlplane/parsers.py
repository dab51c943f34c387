"""JSON from a client, nested too deeply for Python's `json`, refused as any JSON it cannot parse (a 400): in a body
(the management API's parser), in a field that holds JSON text (`loads`, `JSONField`). A body holding a lone surrogate
is refused too, naming where (`controlplane.lone_surrogates`). A form (urlencoded or multipart) in a charset other
than UTF-8 never reaches a parser (`controlplane.request_charset`)."""

import json

from rest_framework import parsers, serializers
from rest_framework.exceptions import ParseError, ValidationError
from rest_framework.settings import api_settings

from controlplane import lone_surrogates

MAX_SHOWN_PARAM = 200  # characters of where a lone surrogate is that a refusal names


class JSONParser(parsers.JSONParser):
    """NOTE: `[[[…]]]` a few thousand levels deep (10 KB) made `json` raise a `RecursionError`, which DRF's parser does
    not catch: every operation that reads a body (creating an endpoint, a key, an invitation; a PATCH) answered a 500.
    The agents' API and `/v1/batches` refuse such a body the same way."""

    def parse(self, stream, media_type=None, parser_context=None):
        try:
            data = super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError("JSON parse error - the body is nested too deeply.") from None
        # NOTE: refused here, once for every view: a 400 that echoes a lone surrogate (an unknown field's name, a
        # choice's value) made DRF's JSONRenderer raise (a 500), and one in a valid field reached PostgreSQL. Escaping
        # in the renderer instead would change every answer's text (`ensure_ascii`) and still store nothing.
        if (param := lone_surrogates.param_of_lone_surrogate(data)) is not None:
            raise ValidationError({param[:MAX_SHOWN_PARAM] or api_settings.NON_FIELD_ERRORS_KEY: [
                "It holds a lone surrogate (an escape from \\ud800 to \\udfff without its pair), which is not text."]})
        return data


def loads(text: str | bytes):
    """`json.loads`, with a text nested too deeply refused as any text it cannot parse: a `ValueError`.

    NOTE: the same 10 KB inside a string field (a form post, or a JSON body's string) raised a `RecursionError` past
    every `except ValueError` that judged the field: a 500."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None


class JSONField(serializers.JSONField):
    """DRF's `JSONField`, with JSON nested too deeply refused as invalid (a field error): a form post's value is JSON
    text it parses, and a deep structure from a JSON body is written out again to check it."""

    def to_internal_value(self, data):
        try:
            return super().to_internal_value(data)
        except RecursionError:
            self.fail("invalid")
