"""Browser clients of `/v1` (CORS): a page of any origin calls with an API key, its preflight answered without a key,
Redis or the database, and reads every answer; a page of another origin never rides the console's session cookie.
`/api/v1` and the console answer no CORS."""

from __future__ import annotations

import http.server
import threading
import time

import httpx
import pytest
from django.conf import settings
from django.middleware.csrf import _get_new_csrf_string
from django.test import Client

from billing.models import UsageRecord
from controlplane.accounts.models import ApiKey, Role
from controlplane.accounts.tenancy import SESSION_KEY
from endpoints.gateway import cors
from tests.conftest import wait_until
from tests.console.conftest import BROWSER_TIMEOUT_MS, browser  # noqa: F401 - the module's chromium
from tests.factories import EndpointFactory, MembershipFactory, UserFactory
from tests.gateway.conftest import serve_endpoint
from tests.outages import database_refusing_connections, redis_frozen

pytestmark = pytest.mark.django_db(transaction=True)

ORIGIN = "https://app.example"
HOSTILE_ORIGIN = "https://evil.example"
MESSAGES = [{"role": "user", "content": "Hello"}]
# What openai-node sends from a browser, and two it must not have: the session path's header and one made up.
REQUESTED_HEADERS = ("Authorization, Content-Type, X-Stainless-OS, x-stainless-retry-count, OpenAI-Organization, "
                     "idempotency-key, x-inferplane-progress, x-csrftoken, x-inferplane-organization, x-made-up")
ALLOWED_HEADERS = ("authorization, content-type, x-stainless-os, x-stainless-retry-count, openai-organization, "
                   "idempotency-key, x-inferplane-progress")
# Every `/v1` route, a method it does not take, and the methods it does (its 405's `Allow`).
ROUTES = (("/v1/chat/completions", "GET"), ("/v1/completions", "GET"), ("/v1/embeddings", "GET"),
          ("/v1/responses", "GET"), ("/v1/models", "POST"), ("/v1/models/some-model", "DELETE"),
          ("/v1/files", "PUT"), ("/v1/files/file-x", "PUT"), ("/v1/files/file-x/content", "POST"),
          ("/v1/batches", "PATCH"), ("/v1/batches/batch_x", "DELETE"), ("/v1/batches/batch_x/cancel", "GET"))


def _preflight(gateway: str, path: str, method: str = "POST", **headers: str) -> httpx.Response:
    return httpx.options(f"{gateway}{path}", timeout=30, headers={
        "origin": ORIGIN, "access-control-request-method": method,
        "access-control-request-headers": REQUESTED_HEADERS} | headers)


def _assert_readable_by_any_page(answer: httpx.Response) -> None:
    assert answer.headers.get("access-control-allow-origin") == "*", (answer.status_code, answer.headers)
    exposed = {name.strip() for name in answer.headers["access-control-expose-headers"].split(",")}
    assert {"x-request-id", "retry-after", "x-ratelimit-remaining-requests", "x-ratelimit-limit-tokens",
            "x-ratelimit-reset-requests", "x-should-retry"} <= exposed
    assert "access-control-allow-credentials" not in answer.headers


def test_a_preflight_on_every_v1_path_is_a_204_naming_its_methods_and_the_allowed_headers_never_credentials(
        gateway, tenant):
    # Before: a 405 (no route takes OPTIONS), so every browser client's call failed before it was sent.
    for path, refused_method in ROUTES:
        allow = httpx.request(refused_method, f"{gateway}{path}", timeout=30,
                              headers={"authorization": f"Bearer {tenant.key}"}).headers["allow"]
        answer = _preflight(gateway, path)
        assert answer.status_code == 204, (path, answer.status_code, answer.text)
        assert answer.content == b"" and "content-length" not in answer.headers
        assert answer.headers["access-control-allow-origin"] == "*"
        assert answer.headers["access-control-allow-methods"] == allow, path
        assert answer.headers["access-control-allow-headers"] == ALLOWED_HEADERS
        assert answer.headers["access-control-max-age"] == str(cors.MAX_AGE_S)
        assert "access-control-allow-credentials" not in answer.headers
    # A path nothing serves is told every method: the page then reads its 404 rather than a failed preflight.
    unknown = _preflight(gateway, "/v1/nothing/here", "GET")
    assert unknown.status_code == 204 and "GET" in unknown.headers["access-control-allow-methods"]
    read = httpx.get(f"{gateway}/v1/nothing/here", headers={"origin": ORIGIN, "authorization": f"Bearer {tenant.key}"})
    assert read.status_code == 404 and read.json()["error"]["code"] == "unknown_url"
    _assert_readable_by_any_page(read)


def test_a_preflight_costs_no_key_lookup_no_redis_and_no_database(gateway, tenant):
    assert _preflight(gateway, "/v1/models", "GET").status_code == 204  # the server's first request served
    with redis_frozen(), database_refusing_connections():
        for path in ("/v1/chat/completions", "/v1/models", "/v1/files", "/v1/batches/batch_x/cancel"):
            answer = _preflight(gateway, path, authorization=f"Bearer {tenant.key}")
            assert answer.status_code == 204, (path, answer.text)


def test_a_plain_options_is_still_a_405_and_a_call_without_origin_gets_no_cors_headers(gateway, tenant):
    plain = httpx.options(f"{gateway}/v1/embeddings", headers={"authorization": f"Bearer {tenant.key}"})
    assert plain.status_code == 405 and plain.headers["allow"] == "POST"
    assert "access-control-allow-origin" not in plain.headers
    for answer in (httpx.get(f"{gateway}/v1/models", headers={"authorization": f"Bearer {tenant.key}"}),
                   httpx.get(f"{gateway}/v1/models", headers={"authorization": "Bearer ip_wrong"}),
                   httpx.get(f"{gateway}/v1/files", headers={"authorization": f"Bearer {tenant.key}"})):
        assert answer.status_code in (200, 401)
        assert not any(name.startswith("access-control-") for name in answer.headers), answer.headers


def test_every_answer_to_a_browser_call_is_readable_by_its_page(gateway, tenant, start_mock_upstream):
    # Before: none carried `Access-Control-Allow-Origin`, so a page could read no answer, not even an error's reason.
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    ApiKey.objects.filter(pk=tenant.api_key.pk).update(requests_per_minute=2)
    browser_headers = {"origin": ORIGIN, "authorization": f"Bearer {tenant.key}"}
    chat = {"model": endpoint.name, "messages": MESSAGES, "max_tokens": 2}

    with httpx.Client(base_url=gateway, headers=browser_headers, timeout=60) as http:
        models = http.get("/v1/models")
        assert models.status_code == 200 and models.headers["x-request-id"].startswith("req_")
        _assert_readable_by_any_page(models)
        with http.stream("POST", "/v1/chat/completions", json=chat | {"stream": True}) as streamed:
            assert streamed.status_code == 200
            _assert_readable_by_any_page(streamed)
            assert b"data: [DONE]" in streamed.read()
        # Every refusal's shape: no key, a bad one, a bad body, an unknown URL, a method the path does not take.
        for answer, status in ((http.get("/v1/models", headers={"authorization": ""}), 401),
                               (http.get("/v1/models", headers={"authorization": "Bearer ip_wrong"}), 401),
                               (http.post("/v1/embeddings", content=b"{not json"), 400),
                               (http.get("/v1/models/nothing-here"), 404),
                               (http.get("/v1/chat/completions"), 405)):
            assert answer.status_code == status, answer.text
            assert answer.json()["error"]["message"]
            _assert_readable_by_any_page(answer)
        # Django's `/v1/files` and `/v1/batches`, and the gateway's refusal of them.
        for answer, status in ((http.get("/v1/files"), 200), (http.get("/v1/batches"), 200),
                               (http.get("/v1/files/file-missing"), 404),
                               (http.get("/v1/files", headers={"authorization": "Bearer ip_wrong"}), 401)):
            assert answer.status_code == status, answer.text
            assert answer.headers["x-request-id"].startswith("req_")
            _assert_readable_by_any_page(answer)
        limited = http.post("/v1/chat/completions", json=chat)
        if limited.status_code == 200:  # the stream's call and this one make the key's two a minute
            limited = http.post("/v1/chat/completions", json=chat)
        assert limited.status_code == 429 and limited.headers["retry-after"], limited.text
        assert limited.headers["x-ratelimit-remaining-requests"] == "0"
        _assert_readable_by_any_page(limited)


def test_a_cold_starts_503_is_readable_by_the_page(gateway, tenant):
    endpoint = EndpointFactory(organization=tenant.org, max_model_len=2048, cold_start_timeout_s=1)  # never served
    answer = httpx.post(f"{gateway}/v1/chat/completions", timeout=60,
                        headers={"origin": ORIGIN, "authorization": f"Bearer {tenant.key}"},
                        json={"model": endpoint.name, "messages": MESSAGES, "max_tokens": 2})
    assert answer.status_code == 503 and answer.headers["retry-after"], answer.text
    _assert_readable_by_any_page(answer)


def test_the_management_api_and_the_console_answer_no_cors(gateway, tenant):
    for answer in (httpx.options(f"{gateway}/api/v1/endpoints/", headers={
                       "origin": ORIGIN, "access-control-request-method": "GET",
                       "access-control-request-headers": "authorization"}),
                   httpx.get(f"{gateway}/api/v1/endpoints/", headers={
                       "origin": ORIGIN, "authorization": f"Bearer {tenant.key}"}),
                   httpx.get(f"{gateway}/login/", headers={"origin": ORIGIN})):
        assert answer.status_code < 500
        assert not any(name.startswith("access-control-") for name in answer.headers), (answer.url, answer.headers)


# --- the console's session ------------------------------------------------------------------------------------------


@pytest.fixture
def signed_in(tenant) -> Client:
    """A member of the tenant's organisation, signed in to the console with it chosen."""
    user = UserFactory()
    MembershipFactory(organization=tenant.org, user=user, role=Role.MEMBER)
    client = Client()
    client.force_login(user)
    session = client.session
    session[SESSION_KEY] = tenant.org.pk
    session.save()
    return client


def _with_session(client: Client, **headers: str) -> dict[str, str]:
    """The session cookie and a matching CSRF pair: what a page that got the CSRF cookie planted could send."""
    csrf = _get_new_csrf_string()
    session = client.cookies[settings.SESSION_COOKIE_NAME].value
    return {"cookie": f"{settings.SESSION_COOKIE_NAME}={session}; {settings.CSRF_COOKIE_NAME}={csrf}",
            "x-csrftoken": csrf} | headers


def test_a_page_of_another_origin_never_spends_or_reads_as_the_signed_in_user(
        gateway, tenant, signed_in, start_mock_upstream):
    # Before: the CSRF pair alone was checked, so a hostile page that could plant the CSRF cookie (a sibling
    # subdomain's) ran calls billed to the signed-in user's organisation and read their answers.
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    hostile = _with_session(signed_in, origin=HOSTILE_ORIGIN)
    spent = httpx.post(f"{gateway}/v1/chat/completions", headers=hostile, timeout=30,
                       json={"model": endpoint.name, "messages": MESSAGES, "max_tokens": 2})
    assert spent.status_code == 403, spent.text
    assert spent.json()["error"]["code"] == "cross_origin_session"
    assert "access-control-allow-credentials" not in spent.headers
    for path in ("/v1/models", "/v1/files"):
        read = httpx.get(f"{gateway}{path}", headers=hostile, timeout=30)
        assert read.status_code == 403 and read.json()["error"]["code"] == "cross_origin_session", (path, read.text)
    # The playground, from the console's own origin, is served as before.
    own = httpx.post(f"{gateway}/v1/chat/completions", headers=_with_session(signed_in, origin=gateway), timeout=30,
                     json={"model": endpoint.name, "messages": MESSAGES, "max_tokens": 2})
    assert own.status_code == 200, own.text
    wait_until(lambda: UsageRecord.objects.exists(), 15, message="the playground's usage row")
    time.sleep(1)
    assert UsageRecord.objects.count() == 1  # the playground's call alone


def test_a_preflight_never_lets_a_browser_send_the_session_cookie_or_its_csrf_header(gateway):
    answer = _preflight(gateway, "/v1/chat/completions", **{"access-control-request-headers": "x-csrftoken"})
    assert answer.status_code == 204
    assert "access-control-allow-headers" not in answer.headers
    assert "access-control-allow-credentials" not in answer.headers


# --- a real browser -------------------------------------------------------------------------------------------------


class _Page(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        body = b"<!doctype html><title>a chat UI of another origin</title>"
        self.send_response(200)
        self.send_header("content-type", "text/html")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def other_origin():
    """A page served from `http://localhost:<port>`: another origin, and another site, than the gateway's
    `127.0.0.1`."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://localhost:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


FETCH = """async ([url, init]) => {
    try {
        const answer = await fetch(url, init);
        return {status: answer.status, requestId: answer.headers.get("x-request-id"),
                remaining: answer.headers.get("x-ratelimit-limit-requests"), body: await answer.text()};
    } catch (error) {
        return {failed: String(error)};
    }
}"""


def test_a_page_of_another_origin_calls_v1_with_a_key_and_never_with_the_session(
        browser, gateway, tenant, signed_in, other_origin, start_mock_upstream):  # noqa: F811 - the fixture
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    context = browser.new_context()
    context.set_default_timeout(BROWSER_TIMEOUT_MS)
    session = signed_in.cookies[settings.SESSION_COOKIE_NAME].value
    csrf = _get_new_csrf_string()
    context.add_cookies([{"name": settings.SESSION_COOKIE_NAME, "value": session, "url": gateway},
                         {"name": settings.CSRF_COOKIE_NAME, "value": csrf, "url": gateway}])
    try:
        page = context.new_page()
        page.goto(other_origin)
        # Before: "TypeError: Failed to fetch" (the preflight's 405) for each.
        key = {"Authorization": f"Bearer {tenant.key}", "x-stainless-os": "Linux", "x-stainless-retry-count": "0"}
        models = page.evaluate(FETCH, [f"{gateway}/v1/models", {"headers": key}])
        assert models.get("status") == 200, models
        assert endpoint.name in models["body"] and models["requestId"].startswith("req_")
        assert models["remaining"] is not None  # an exposed header: hidden from the page without it
        streamed = page.evaluate(FETCH, [f"{gateway}/v1/chat/completions", {
            "method": "POST", "headers": key | {"Content-Type": "application/json"},
            "body": f'{{"model": "{endpoint.name}", "messages": [{{"role": "user", "content": "Hi"}}], '
                    '"max_tokens": 2, "stream": true}'}])
        assert streamed.get("status") == 200 and "data: [DONE]" in streamed["body"], streamed
        refused = page.evaluate(FETCH, [f"{gateway}/v1/models", {"headers": {"Authorization": "Bearer ip_wrong"}}])
        assert refused.get("status") == 401 and "invalid_api_key" in refused["body"], refused
        # The session: the browser refuses the credentialed call at its preflight (no Allow-Credentials), and a
        # call without its CSRF header is a 401 whose answer the page may not read.
        for init in ({"method": "POST", "credentials": "include",
                      "headers": {"X-CSRFToken": csrf, "Content-Type": "application/json"},
                      "body": f'{{"model": "{endpoint.name}", "messages": [], "max_tokens": 2}}'},
                     {"credentials": "include"}):
            riding = page.evaluate(FETCH, [f"{gateway}/v1/models", init])
            assert "failed" in riding, riding
    finally:
        context.close()
    wait_until(lambda: UsageRecord.objects.exists(), 15, message="the streamed call's usage row")
    assert UsageRecord.objects.count() == 1  # the key's streamed call alone
