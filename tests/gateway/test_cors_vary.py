"""`/v1` answers and shared caches: an answer's CORS headers depend on the call's `Origin` (none without one), so every
`/v1` answer (a preflight's, a success's, a stream's, every error's, Django's Files and Batch APIs', and one to a call
without `Origin`) says `Vary: Origin`, merged into the `Vary` it already has. Before, none did: a cache or CDN could
hand an answer stored for one caller to a caller that sent another `Origin`, or none."""

from __future__ import annotations

import httpx
import pytest

from endpoints.gateway import cors
from tests.gateway.conftest import serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)

ORIGIN = "https://app.example"
MESSAGES = [{"role": "user", "content": "Hello"}]


def _varies_on(answer: httpx.Response) -> list[str]:
    (vary,) = answer.headers.get_list("vary")  # one field line: a cache reading only the first misses none of it
    return [token.strip().lower() for token in vary.split(",")]


def test_every_v1_answer_with_or_without_origin_varies_on_origin(gateway, tenant, start_mock_upstream):
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    chat = {"model": endpoint.name, "messages": MESSAGES, "max_tokens": 2}
    for origin in ({"origin": ORIGIN}, {}):
        with httpx.Client(base_url=gateway, headers={"authorization": f"Bearer {tenant.key}"} | origin,
                          timeout=60) as http:
            answers = [http.get("/v1/models"), http.post("/v1/chat/completions", json=chat),
                       http.get("/v1/models", headers={"authorization": "Bearer ip_wrong"}),
                       http.get("/v1/models/nothing-here"), http.get("/v1/chat/completions"),
                       http.post("/v1/embeddings", content=b"{not json"), http.get("/v1/nothing/here"),
                       http.get("/v1/files"), http.get("/v1/batches"), http.get("/v1/files/file-missing"),
                       http.get("/v1/files", headers={"authorization": "Bearer ip_wrong"})]
            with http.stream("POST", "/v1/chat/completions", json=chat | {"stream": True}) as streamed:
                streamed.read()
                answers.append(streamed)
            for answer in answers:
                assert "origin" in _varies_on(answer), (origin, answer.request.url, answer.status_code, answer.headers)
                assert ("access-control-allow-origin" in answer.headers) == bool(origin)


def test_a_preflight_varies_on_origin_and_what_it_asks_for(gateway):
    for path in ("/v1/chat/completions", "/v1/files", "/v1/batches/batch_x/cancel"):
        answer = httpx.options(f"{gateway}{path}", timeout=30, headers={
            "origin": ORIGIN, "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type"})
        assert answer.status_code == 204
        assert set(_varies_on(answer)) == {"origin", "access-control-request-method", "access-control-request-headers"}


def test_origin_joins_the_vary_an_answer_already_has_and_is_named_once():
    assert cors.answer_headers([(b"content-type", b"application/json"), (b"vary", b"Accept, Cookie")],
                               from_a_page=False) == [(b"content-type", b"application/json"),
                                                      (b"vary", b"Accept, Cookie, Origin")]
    assert cors.answer_headers([(b"Vary", b"Cookie"), (b"vary", b"origin")], from_a_page=False) == [
        (b"Vary", b"Cookie"), (b"vary", b"origin")]
    assert cors.answer_headers([(b"vary", b"*")], from_a_page=False) == [(b"vary", b"*")]
    assert cors.answer_headers([], from_a_page=False) == [(b"vary", b"Origin")]
    assert cors.answer_headers([], from_a_page=True) == [(b"vary", b"Origin"), *cors.ANSWER_HEADERS]
