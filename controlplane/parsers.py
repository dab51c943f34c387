"""The management API's JSON parser: DRF's, with a body nested too deeply for Python's `json` refused as any body
it cannot parse (a 400)."""

from rest_framework import parsers
from rest_framework.exceptions import ParseError


class JSONParser(parsers.JSONParser):
    """NOTE: `[[[…]]]` a few thousand levels deep (10 KB) made `json` raise a `RecursionError`, which DRF's parser does
    not catch: every operation that reads a body (creating an endpoint, a key, an invitation; a PATCH) answered a 500.
    The agents' API and `/v1/batches` refuse such a body the same way."""

    def parse(self, stream, media_type=None, parser_context=None):
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError("JSON parse error - the body is nested too deeply.") from None
