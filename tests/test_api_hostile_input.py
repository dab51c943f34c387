"""Hostile input to the management API is a 4xx, never a 500; the schema documents the errors.

Each case here was a 500 found by the schema fuzzer (tests/test_api_fuzz.py).
"""

from urllib.parse import urlencode

import pytest
from rest_framework.request import Request
from rest_framework.settings import api_settings
from rest_framework.test import APIRequestFactory

from controlplane.accounts.models import Role
from endpoints.events import record_event
from endpoints.models import Endpoint, EventKind
from tests.factories import EndpointFactory, MembershipFactory

pytestmark = pytest.mark.django_db

LIST_PATHS = ["/api/v1/endpoints/", "/api/v1/keys/", "/api/v1/members/", "/api/v1/audit-log/"]
PAST_BIGINT = "9223372036854775809"


@pytest.mark.parametrize("path", LIST_PATHS)
def test_a_limit_past_bigint_on_any_list_is_clamped_to_the_largest_page(owner_client, path):
    EndpointFactory(organization=owner_client.organization)  # a list with rows: an empty one never queries a page

    response = owner_client.get(path, {"limit": PAST_BIGINT})

    assert response.status_code == 200
    assert response.json()["count"] >= 1


def test_an_endpoints_event_list_clamps_a_huge_limit_and_a_huge_offset_is_an_empty_page(owner_client):
    endpoint = EndpointFactory(organization=owner_client.organization)
    record_event(endpoint, EventKind.CONFIG, "Created.")

    huge_limit = owner_client.get(f"/api/v1/endpoints/{endpoint.pk}/events/", {"limit": PAST_BIGINT})
    huge_offset = owner_client.get("/api/v1/keys/", {"offset": PAST_BIGINT, "limit": PAST_BIGINT})
    too_many_digits = owner_client.get("/api/v1/keys/", {"limit": "9" * 5000})

    assert huge_limit.status_code == 200 and len(huge_limit.json()["results"]) == 1
    assert huge_offset.status_code == 200 and huge_offset.json()["results"] == []
    assert too_many_digits.status_code == 200 and len(too_many_digits.json()["results"]) == 1


def test_a_list_page_is_at_most_a_thousand_rows(owner_client):
    paginator = api_settings.DEFAULT_PAGINATION_CLASS()
    request = Request(APIRequestFactory().get("/api/v1/keys/", {"limit": PAST_BIGINT}))

    assert paginator.get_limit(request) == 1000


def test_options_on_the_billing_portal_describes_it_rather_than_failing(owner_client):
    response = owner_client.options("/api/v1/billing/portal/")

    assert response.status_code == 200
    assert response.json()["name"] == "Portal Link"


def test_options_on_every_documented_route_is_never_a_server_error(owner_client):
    paths = owner_client.get("/api/schema/", {"format": "json"}).json()["paths"]
    endpoint = EndpointFactory(organization=owner_client.organization)

    for path in paths:
        concrete = path.replace("{id}", str(endpoint.pk)).replace("{endpoint_pk}", str(endpoint.pk)).replace("{key_id}", "1")
        assert owner_client.options(concrete).status_code in (200, 404), concrete


@pytest.mark.parametrize("member_id", ["null,null", "1.5", "-1", "99999999999999999999999"])
def test_patching_or_removing_a_member_by_a_malformed_id_is_a_404(owner_client, member_id):
    MembershipFactory(organization=owner_client.organization, role=Role.MEMBER)

    patched = owner_client.patch(f"/api/v1/members/{member_id}/", {"role": "viewer"}, format="json")
    removed = owner_client.delete(f"/api/v1/members/{member_id}/")

    assert (patched.status_code, removed.status_code) == (404, 404)
    assert "detail" in patched.json()


def test_an_api_path_that_matches_no_route_answers_the_apis_json_404(owner_client, settings):
    settings.DEBUG = False

    response = owner_client.get("/api/v1/no-such-thing/")

    assert response.status_code == 404
    assert response["Content-Type"] == "application/json" and response.json() == {"detail": "Not found."}


def test_a_console_path_that_matches_nothing_still_shows_the_console_page(client, settings):
    settings.DEBUG = False

    response = client.get("/no-such-page/")

    assert response.status_code == 404 and response["Content-Type"].startswith("text/html")


def test_a_stripe_outage_makes_the_portal_link_a_503_with_a_message(owner_client, settings):
    from tests.conftest import free_port

    settings.STRIPE_SECRET_KEY = "sk_test_inferplane"
    settings.STRIPE_API_BASE = f"http://127.0.0.1:{free_port()}"  # nothing listens: Stripe is unreachable
    settings.STRIPE_TIMEOUT_S = 0.5
    settings.STRIPE_RETRY_BASE_DELAY_S = 0.01

    response = owner_client.post("/api/v1/billing/portal/")

    assert response.status_code == 503
    assert "Stripe could not be reached" in response.json()["detail"]


def test_the_schema_documents_each_operations_error_answers_with_their_bodies(owner_client):
    schema = owner_client.get("/api/schema/", {"format": "json"}).json()
    paths = schema["paths"]

    def codes(path, method):
        return set(paths[path][method]["responses"])

    # 503: every key lookup busy (`authentication.KeyLookupsBusy`)
    assert codes("/api/v1/endpoints/", "post") == {"201", "400", "401", "403", "415", "503"}
    assert codes("/api/v1/endpoints/{id}/", "get") == {"200", "401", "403", "404", "503"}
    assert codes("/api/v1/endpoints/", "get") == {"200", "401", "403", "503"}  # a bad limit is clamped, not a 400
    assert codes("/api/v1/usage/", "get") == {"200", "400", "401", "403", "503"}
    assert codes("/api/v1/members/{id}/", "delete") == {"204", "400", "401", "403", "404", "503"}
    assert codes("/api/v1/billing/portal/", "post") == {"200", "401", "403", "503"}
    not_found = paths["/api/v1/keys/{id}/"]["get"]["responses"]["404"]["content"]["application/json"]["schema"]
    invalid = paths["/api/v1/keys/"]["post"]["responses"]["400"]["content"]["application/json"]["schema"]
    assert not_found == {"$ref": "#/components/schemas/Error"}
    assert invalid == {"$ref": "#/components/schemas/ValidationError"}
    assert schema["components"]["schemas"]["Error"]["required"] == ["detail"]


def test_a_method_a_documented_route_does_not_take_is_a_json_405(owner_client):
    paths = owner_client.get("/api/schema/", {"format": "json"}).json()["paths"]
    endpoint = EndpointFactory(organization=owner_client.organization)
    answers = {}

    for path, operations in paths.items():
        concrete = path.replace("{id}", str(endpoint.pk)).replace("{endpoint_pk}", str(endpoint.pk)).replace("{key_id}", "1")
        for method in {"get", "post", "put", "patch", "delete"} - set(operations):
            response = getattr(owner_client, method)(concrete)
            answers[f"{method.upper()} {path}"] = (response.status_code, response["Content-Type"])

    assert answers and set(answers.values()) == {(405, "application/json")}


def test_hostile_console_and_api_input_is_a_clear_answer_never_a_500(org, owner_client):
    """Each of these was a 500 (an uncaught ValueError, OverflowError or PostgreSQL DataError)."""
    from django.test import Client

    from controlplane.accounts.tenancy import SESSION_KEY

    console = Client(raise_request_exception=False)
    console.force_login(owner_client.user)
    session = console.session
    session[SESSION_KEY] = org.pk
    session.save()
    nines = "9" * 310
    answers = {
        "switch to abc": console.post("/org/switch/", {"organization": "abc"}).status_code,
        "switch to nothing": console.post("/org/switch/", {}).status_code,
        "switch to ²": console.post("/org/switch/", {"organization": "²"}).status_code,
        "key expiring in 10^8 days": console.post("/console/keys/", {"name": "k", "scopes": ["inference"],
                                                                    "expires_in_days": "99999999"}).status_code,
        "key expiring in ² days": console.post("/console/keys/", {"name": "k2", "scopes": ["inference"],
                                                                 "expires_in_days": "²"}).status_code,
        "GPUs for a 10^310 B model": console.get("/console/endpoints/gpus/",
                                                 {"gpu_type": "l4", "model_source": f"hf:x/m-{nines}B"}).status_code,
        "endpoint of a 10^310 B model": owner_client.post("/api/v1/endpoints/", {
            "name": "huge", "model_source": f"s3://bucket/m-{nines}B", "gpu_type": "l4"}, format="json").status_code,
        "a batch named with NUL": console.get("/console/batches/batch_%00/").status_code,
        "a file named with NUL": console.get("/console/files/file-%00/download/").status_code,
        "an API file named with NUL": owner_client.get("/v1/files/file-%00").status_code,
        "an API batch named with NUL": owner_client.get("/v1/batches/batch_%00").status_code,
    }
    assert {what: status for what, status in answers.items() if status >= 500} == {}
    assert answers["a batch named with NUL"] == answers["a file named with NUL"] == 404


def test_an_organisation_name_with_a_line_break_is_refused_at_sign_up(client):
    response = client.post("/signup/", {"email": "new@example.test", "password": "a long passphrase 1",
                                        "organization_name": "Acme\nBcc: victim@example.test"})
    assert response.status_code == 200 and "letters, digits, spaces and punctuation" in response.content.decode()


def test_a_format_suffix_on_an_api_path_is_the_apis_json_404_never_a_500(owner_client, settings):
    """`/api/v1/endpoints/{id}/pause.json/` and the like were DRF's format-suffix routes, which no schema documents:
    every custom action (and a member's PATCH) answered them with a 500, its method taking no `format` argument."""
    settings.DEBUG = False
    owner_client.raise_request_exception = False
    endpoint = EndpointFactory(organization=owner_client.organization)
    member = MembershipFactory(organization=owner_client.organization, role=Role.MEMBER)
    key_id = owner_client.get("/api/v1/keys/").json()["results"][0]["id"]
    calls = [("post", f"/api/v1/endpoints/{endpoint.pk}/pause.json/"), ("get", f"/api/v1/endpoints/{endpoint.pk}/events.json/"),
             ("get", f"/api/v1/endpoints/{endpoint.pk}/stats.json"), ("post", f"/api/v1/keys/{key_id}/revoke.json/"),
             ("patch", f"/api/v1/members/{member.pk}.json/"), ("get", "/api/v1/endpoints.json")]

    answers = {path: getattr(owner_client, method)(path, {"role": "viewer"}, format="json") for method, path in calls}

    assert {path: response.status_code for path, response in answers.items()} == {path: 404 for _, path in calls}
    assert all(response.json() == {"detail": "Not found."} for response in answers.values())
    assert owner_client.get(f"/api/v1/endpoints/{endpoint.pk}/", {"format": "json"}).status_code == 200


def test_a_body_nested_too_deeply_is_a_400_on_every_operation_that_reads_one(owner_client, settings):
    """`[[[…]]]` 5,000 levels deep (10 KB) raised a RecursionError in the JSON parser: a 500 on every body."""
    settings.DEBUG = False
    owner_client.raise_request_exception = False
    endpoint = EndpointFactory(organization=owner_client.organization)
    member = MembershipFactory(organization=owner_client.organization, role=Role.MEMBER)
    key_id = owner_client.get("/api/v1/keys/").json()["results"][0]["id"]
    nested = b"[" * 5000 + b"]" * 5000
    calls = [("post", "/api/v1/endpoints/"), ("patch", f"/api/v1/endpoints/{endpoint.pk}/"), ("post", "/api/v1/keys/"),
             ("post", "/api/v1/credentials/"), ("post", f"/api/v1/endpoints/{endpoint.pk}/adapters/"),
             ("post", "/api/v1/invitations/"), ("patch", f"/api/v1/members/{member.pk}/"), ("patch", "/api/v1/billing/"),
             ("patch", f"/api/v1/billing/keys/{key_id}/")]

    answers = {path: getattr(owner_client, method)(path, nested, content_type="application/json") for method, path in calls}

    assert {path: response.status_code for path, response in answers.items()} == {path: 400 for _, path in calls}
    assert all("nested too deeply" in response.json()["detail"] for response in answers.values())


def test_json_text_nested_too_deeply_inside_a_field_is_a_400_on_that_field(owner_client, settings):
    """The pre-warm windows as JSON text (the console's form post, or a string in a JSON body) `[[[…]]]` 5,000 levels
    deep raised a RecursionError past the field's `except ValueError`: a 500 from every parser."""
    settings.DEBUG = False
    owner_client.raise_request_exception = False
    endpoint = EndpointFactory(organization=owner_client.organization)
    nested = "[" * 5000 + "]" * 5000
    new = {"name": "deep", "model_source": "hf:org/m-1B", "gpu_type": "l4", "prewarm_windows": nested}
    patch = f"/api/v1/endpoints/{endpoint.pk}/"

    answers = {
        "a string in a JSON PATCH": owner_client.patch(patch, {"prewarm_windows": nested}, format="json"),
        "a string in a JSON POST": owner_client.post("/api/v1/endpoints/", new, format="json"),
        "an urlencoded PATCH": owner_client.patch(patch, urlencode({"prewarm_windows": nested}),
                                                  content_type="application/x-www-form-urlencoded"),
        "a multipart POST": owner_client.post("/api/v1/endpoints/", new),
    }

    assert {what: response.status_code for what, response in answers.items()} == {what: 400 for what in answers}
    assert all(response.json() == {"prewarm_windows": ["Must be a JSON list of windows."]} for response in answers.values())
    endpoint.refresh_from_db()
    assert endpoint.prewarm_windows == [] and not Endpoint.objects.filter(name="deep").exists()


def test_a_form_in_a_charset_that_cannot_decode_it_is_a_400(owner_client, settings):
    """`charset=punycode` names a codec Python has, which raises on the body whatever error handler is asked for;
    DRF's form parser let the UnicodeError out: a 500 on every operation that reads a body."""
    settings.DEBUG = False
    owner_client.raise_request_exception = False
    endpoint = EndpointFactory(organization=owner_client.organization)
    calls = [("POST", "/api/v1/keys/"), ("PATCH", f"/api/v1/endpoints/{endpoint.pk}/"), ("PATCH", "/api/v1/billing/")]

    answers = [owner_client.generic(method, path, b"name=k", content_type="application/x-www-form-urlencoded; charset=punycode")
               for method, path in calls]

    assert [response.status_code for response in answers] == [400] * len(calls)
    assert all("charset" in response.json()["detail"] for response in answers)


@pytest.mark.parametrize("path, body, field", [
    ("/api/v1/keys/", '{"name": "k", "\\ud800": 1}', api_settings.NON_FIELD_ERRORS_KEY),  # an unknown field echoed
    ("/api/v1/keys/", '{"name": "k", "scopes": ["\\ud800"]}', "scopes[0]"),  # a choice echoed
    ("/api/v1/credentials/", '{"name": "c", "kind": "\\ud800"}', "kind"),
    ("/api/v1/keys/", '{"name": "k\\ud800"}', "name"),  # a valid field: PostgreSQL would refuse it
], ids=["unknown_field_key", "choice_value", "credential_kind", "name"])
def test_a_lone_surrogate_in_a_body_is_a_400_naming_where_it_is(owner_client, settings, path, body, field):
    """A 400 echoing a lone surrogate (JSON may escape one, `"\\ud800"`) made DRF's JSONRenderer raise a
    UnicodeEncodeError: a 500. The parser refuses such a body first, as the gateway does, naming where."""
    settings.DEBUG = False
    owner_client.raise_request_exception = False

    response = owner_client.post(path, data=body, content_type="application/json")

    assert response.status_code == 400, response.status_code
    assert list(response.json()) == [field]
    assert "lone surrogate" in response.json()[field][0]


def test_a_multipart_body_in_a_charset_that_cannot_decode_it_is_a_400(owner_client, settings):
    """Django's multipart parser decodes each field with `errors="replace"`, which the punycode codec does not heed:
    its `DjangoUnicodeDecodeError` was a 500."""
    settings.DEBUG = False
    owner_client.raise_request_exception = False
    body = (b'--XyZ\r\nContent-Disposition: form-data; name="name"\r\n\r\n\xff\xfe\r\n--XyZ--\r\n')

    response = owner_client.generic("POST", "/api/v1/keys/", body,
                                    content_type="multipart/form-data; boundary=XyZ; charset=punycode")

    assert response.status_code == 400
    assert "charset" in response.json()["detail"]
