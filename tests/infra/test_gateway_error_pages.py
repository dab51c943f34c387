"""nginx's own 502, 503 and 504 on `/v1` (no gateway pod answers: a rollout, a crash, none ready) reach a browser client
as the gateway's own errors do: in OpenAI's shape, with the CORS headers the gateway sends (`endpoints.gateway.cors`),
in every overlay as `kubectl kustomize` renders it.

Before: nginx answered its HTML page without `Access-Control-Allow-Origin`, and a page calling from another origin saw
an opaque network error instead of a status its client retries on."""

from __future__ import annotations

import json
import re

import pytest

from endpoints.gateway import cors, errors
from tests.infra.conftest import INFRA_DIR, render

OVERLAYS = sorted(path.name for path in (INFRA_DIR / "k8s" / "overlays").iterdir() if path.is_dir())
NGINX_ERRORS = (502, 503, 504)
SERVER_SNIPPET = "nginx.ingress.kubernetes.io/server-snippet"
CONFIGURATION_SNIPPET = "nginx.ingress.kubernetes.io/configuration-snippet"
_TOKEN = re.compile(r"""'((?:[^'\\]|\\.)*)'|"((?:[^"\\]|\\.)*)"|([{};])|([^\s{};'"]+)""")


@pytest.fixture(scope="module", params=OVERLAYS)
def ingresses(request) -> list[dict]:
    return render(request.param).all("Ingress")


def _directives(snippet: str) -> list:
    """nginx configuration as [name, *arguments] lists, a block as its directive's last item (a list of those)."""
    stack: list[list] = [[]]
    words: list[str] = []
    for quoted_single, quoted_double, punctuation, bare in _TOKEN.findall(snippet):
        if punctuation == ";":
            stack[-1].append(words)
            words = []
        elif punctuation == "{":
            block: list = []
            stack[-1].append([*words, block])
            stack.append(block)
            words = []
        elif punctuation == "}":
            assert not words, f"a directive without its ';' in {snippet!r}"
            stack.pop()
        else:
            words.append(quoted_single or quoted_double or bare)
    assert len(stack) == 1 and not words, f"unbalanced nginx configuration: {snippet!r}"
    return stack[0]


def _v1_ingresses(ingresses: list[dict]) -> list[dict]:
    return [ingress for ingress in ingresses
            if any(path["path"].startswith("/v1") for rule in ingress["spec"]["rules"] for path in rule["http"]["paths"])]


def _error_locations(ingresses: list[dict]) -> dict[str, list]:
    """The host's named locations (its one server snippet): name -> directives."""
    snippets = [ingress["metadata"]["annotations"][SERVER_SNIPPET] for ingress in ingresses
                if SERVER_SNIPPET in ingress["metadata"].get("annotations", {})]
    assert len(snippets) == 1, "ingress-nginx takes one server snippet per host"
    return {directive[1]: directive[2] for directive in _directives(snippets[0]) if directive[0] == "location"}


def test_every_ingress_of_a_v1_path_sends_nginx_s_own_5xx_to_the_gateway_s_error_pages(ingresses):
    v1 = _v1_ingresses(ingresses)
    assert {ingress["metadata"]["name"] for ingress in v1} == {"inferplane-gateway", "inferplane-files"}
    locations = _error_locations(ingresses)
    for ingress in v1:
        annotations = ingress["metadata"]["annotations"]
        error_pages = [d for d in _directives(annotations.get(CONFIGURATION_SNIPPET, "")) if d[0] == "error_page"]
        assert sorted(error_pages) == [["error_page", str(code), f"@inferplane_v1_{code}"] for code in NGINX_ERRORS]
        assert all(page[2] in locations for page in error_pages)
        # only nginx's own: the gateway's 5xx (its message, `x-request-id`, `retry-after`) pass as they are
        assert "custom-http-errors" not in " ".join(annotations)
        assert "proxy_intercept_errors" not in annotations.get(CONFIGURATION_SNIPPET, "")


def test_nginx_s_own_v1_5xx_carry_the_gateway_s_cors_headers_and_its_service_unavailable_error(ingresses):
    locations = _error_locations(ingresses)
    unavailable = errors.service_unavailable()
    expected_headers = {name.decode(): value.decode() for name, value in cors.ANSWER_HEADERS} | {
        "vary": "Origin", **unavailable.headers}
    for code in NGINX_ERRORS:
        directives = locations[f"@inferplane_v1_{code}"]
        headers = {d[1].lower(): d[2] for d in directives if d[0] == "add_header"}
        assert headers == expected_headers
        # `always`: nginx adds a header to a 4xx or 5xx only so
        assert all(d[3:] == ["always"] for d in directives if d[0] == "add_header")
        assert ["default_type", "application/json"] in directives
        [answer] = [d for d in directives if d[0] == "return"]
        assert answer[1] == str(code)
        assert json.loads(answer[2]) == json.loads(unavailable.body())
