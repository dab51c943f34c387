"""A body past a limit, sent to `/v1` by a page of another origin: the ingress sets no body limit on `/v1`
(`inferplane-gateway`, `inferplane-files`: tests/infra/test_network_isolation.py), so the refusal is the gateway's, a
413 in OpenAI's shape that the page may read (`Access-Control-Allow-Origin`), never nginx's HTML page without it,
which the browser hid behind a network error (an upload's refusals: tests/gateway/test_cors.py)."""

from __future__ import annotations

import httpx
import pytest

from endpoints.gateway.request import MAX_BODY_BYTES

pytestmark = pytest.mark.django_db(transaction=True)

ORIGIN = "https://app.example"


def _assert_a_413_the_page_reads(answer: httpx.Response) -> None:
    assert answer.status_code == 413, answer.text
    assert answer.headers["access-control-allow-origin"] == "*"
    assert "x-request-id" in answer.headers["access-control-expose-headers"]
    assert answer.json()["error"]["message"] and answer.json()["error"]["type"] == "invalid_request_error"


def test_a_call_past_the_gateways_body_limit_is_a_413_a_page_reads(gateway, tenant):
    body = b'{"model": "m", "messages": [], "pad": "' + b"x" * (MAX_BODY_BYTES + 1) + b'"}'
    answer = httpx.post(f"{gateway}/v1/chat/completions", content=body, timeout=60, headers={
        "origin": ORIGIN, "authorization": f"Bearer {tenant.key}", "content-type": "application/json"})
    _assert_a_413_the_page_reads(answer)

