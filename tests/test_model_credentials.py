"""Model credentials through the API: write-only secrets, encrypted at rest, audited, per organisation."""

import pytest
from django.db import connection

from controlplane.accounts.models import AuditEvent, Role
from endpoints.credentials import stored_secrets
from endpoints.models import Adapter, Endpoint, ModelCredential
from tests.factories import AWS_SECRET, HF_SECRET, EndpointFactory, OrganizationFactory, make_credential

pytestmark = pytest.mark.django_db

S3_BODY = {"name": "prod-bucket", "kind": "s3", "access_key_id": "AKIAEXAMPLEKEY000001",
           "secret_access_key": AWS_SECRET, "session_token": "FQoGZXIvYXdzSESSIONtoken", "region": "eu-west-1"}


def assert_nowhere_in_database(*values):
    with connection.cursor() as cursor:
        for table in connection.introspection.table_names():
            for value in values:
                cursor.execute(f'SELECT count(*) FROM "{table}" WHERE CAST("{table}".* AS text) LIKE %s', [f"%{value}%"])
                assert cursor.fetchone()[0] == 0, (table, value)


def test_secrets_are_write_only_and_stored_only_encrypted(owner_client):
    created = owner_client.post("/api/v1/credentials/", S3_BODY, format="json")
    assert created.status_code == 201, created.json()
    body = created.json()
    assert body["access_key_id"] == "AKIAEXAMPLEKEY000001" and body["region"] == "eu-west-1"
    assert body["secrets_set"] == ["secret_access_key", "session_token"]
    assert body["external_id"].startswith("inferplane-")
    answers = [created, owner_client.get("/api/v1/credentials/"), owner_client.get(f"/api/v1/credentials/{body['id']}/")]
    for answer in answers:
        assert AWS_SECRET not in answer.content.decode() and "SESSIONtoken" not in answer.content.decode()
    assert_nowhere_in_database(AWS_SECRET, "FQoGZXIvYXdzSESSIONtoken")
    raw = ModelCredential.objects.values_list("encrypted_secrets", flat=True).get(pk=body["id"])
    assert AWS_SECRET not in raw and raw.startswith("gAAAA")  # a Fernet token


def test_the_answer_has_no_secret_field_at_all(owner_client):
    body = owner_client.post("/api/v1/credentials/", S3_BODY, format="json").json()
    assert not {"secret_access_key", "session_token", "hf_token", "encrypted_secrets"} & set(body)


def test_create_update_and_delete_are_audited_without_secret_values(owner_client):
    credential_id = owner_client.post("/api/v1/credentials/", S3_BODY, format="json").json()["id"]
    replaced = owner_client.patch(f"/api/v1/credentials/{credential_id}/",
                                  {"secret_access_key": "aNewSecretValue/For+Rotation00001"}, format="json")
    assert replaced.status_code == 200 and replaced.json()["secrets_set"] == ["secret_access_key"]
    assert owner_client.delete(f"/api/v1/credentials/{credential_id}/").status_code == 204
    actions = list(AuditEvent.objects.filter(target_type="ModelCredential").values_list("action", flat=True).order_by("id"))
    assert actions == ["credential.create", "credential.update", "credential.delete"]
    log = owner_client.get("/api/v1/audit-log/").content.decode()
    assert "credential.update" in log
    for secret in (AWS_SECRET, "aNewSecretValue", "SESSIONtoken"):
        assert secret not in log
    assert_nowhere_in_database(AWS_SECRET, "aNewSecretValue")


def test_replacing_secrets_replaces_them_all_and_keeps_them_when_none_given(owner_client):
    credential = make_credential(owner_client.organization, session_token="oldSessionToken")
    renamed = owner_client.patch(f"/api/v1/credentials/{credential.pk}/", {"region": "us-east-1"}, format="json")
    assert renamed.status_code == 200 and renamed.json()["secrets_set"] == ["secret_access_key", "session_token"]
    owner_client.patch(f"/api/v1/credentials/{credential.pk}/", {"secret_access_key": "brandNewSecret"}, format="json")
    assert stored_secrets(ModelCredential.objects.get(pk=credential.pk)) == {"secret_access_key": "brandNewSecret"}


def test_another_organisations_credential_is_a_404(owner_client):
    theirs = make_credential(OrganizationFactory(), name="theirs")
    assert owner_client.get(f"/api/v1/credentials/{theirs.pk}/").status_code == 404
    assert owner_client.patch(f"/api/v1/credentials/{theirs.pk}/", {"region": "x"}, format="json").status_code == 404
    assert owner_client.delete(f"/api/v1/credentials/{theirs.pk}/").status_code == 404
    assert owner_client.get("/api/v1/credentials/").json()["count"] == 0
    assert ModelCredential.objects.filter(pk=theirs.pk).exists()


def test_an_endpoint_cannot_name_another_organisations_credential(owner_client):
    theirs = make_credential(OrganizationFactory(), name="theirs")
    response = owner_client.post("/api/v1/endpoints/", {
        "name": "stolen", "model_source": "s3://their-bucket/llama", "gpu_type": "l4", "credential": str(theirs.pk),
    }, format="json")
    assert response.status_code == 400
    assert "does not exist" in response.json()["credential"][0]
    assert not Endpoint.objects.filter(name="stolen").exists()


@pytest.mark.parametrize("role", [Role.OWNER, Role.ADMIN])
def test_owners_and_admins_manage_credentials(org, member_client_factory, role):
    client = member_client_factory(org, role)
    assert client.post("/api/v1/credentials/", S3_BODY, format="json").status_code == 201


def test_members_see_credentials_but_cannot_change_them(org, member_client_factory):
    credential = make_credential(org)
    client = member_client_factory(org, Role.MEMBER)
    assert client.get("/api/v1/credentials/").json()["count"] == 1
    assert client.post("/api/v1/credentials/", S3_BODY, format="json").status_code == 403
    assert client.patch(f"/api/v1/credentials/{credential.pk}/", {"secret_access_key": "x" * 20}, format="json").status_code == 403
    assert client.delete(f"/api/v1/credentials/{credential.pk}/").status_code == 403


def test_members_may_use_a_credential_for_their_endpoints(org, member_client_factory):
    credential = make_credential(org)
    client = member_client_factory(org, Role.MEMBER)
    response = client.post("/api/v1/endpoints/", {
        "name": "private", "model_source": "s3://our-bucket/llama-8b", "gpu_type": "l4", "credential": str(credential.pk),
    }, format="json")
    assert response.status_code == 201, response.json()
    assert response.json()["credential"] == str(credential.pk)


def test_viewers_cannot_list_credentials(org, member_client_factory):
    make_credential(org)
    assert member_client_factory(org, Role.VIEWER).get("/api/v1/credentials/").status_code == 403


@pytest.mark.parametrize(("body", "field"), [
    ({"kind": "s3", "access_key_id": "AKIA1"}, "secret_access_key"),
    ({"kind": "s3"}, "access_key_id"),
    ({"kind": "hf"}, "hf_token"),
    ({"kind": "hf", "hf_token": HF_SECRET, "access_key_id": "AKIA1"}, "access_key_id"),
    ({"kind": "s3", "role_arn": "arn:aws:iam::123:role/x"}, "role_arn"),
    # Not a role in an account, though the pattern before took them (the account must be what AWS reads).
    ({"kind": "s3", "role_arn": "arn:aws-made-up:iam::123456789012:role/x"}, "role_arn"),
    ({"kind": "s3", "role_arn": "arn:aws:iam::" + "\u0661" * 12 + ":role/x"}, "role_arn"),  # Arabic-Indic digits
    ({"kind": "s3", "role_arn": "arn:aws:iam::123456789012:role//"}, "role_arn"),
    ({"kind": "s3", "role_arn": "arn:aws:iam::123456789012:role/r\u00e9ader"}, "role_arn"),
    ({"kind": "s3", "role_arn": "arn:aws:iam::123456789012:role/" + "r" * 65}, "role_arn"),
    ({"kind": "gcs", "hf_token": HF_SECRET}, "kind"),
    ({"kind": "hf", "hf_token": "has a space"}, "hf_token"),
    ({"kind": "s3", "role_arn": "arn:aws:iam::123456789012:role/reader", "extra": 1}, "extra"),
    ({"kind": "s3", "role_arn": "arn:aws:iam::123456789012:role/reader", "external_id": "mine"}, "external_id"),
])
def test_bad_credentials_are_400_with_field_errors(owner_client, body, field):
    response = owner_client.post("/api/v1/credentials/", {"name": "bad"} | body, format="json")
    assert response.status_code == 400
    assert field in response.json()
    assert not ModelCredential.objects.exists()


def test_a_role_needs_no_secret_and_gets_our_external_id(owner_client):
    response = owner_client.post("/api/v1/credentials/", {
        "name": "role", "kind": "s3", "role_arn": "arn:aws:iam::123456789012:role/inferplane-reader",
    }, format="json")
    assert response.status_code == 201, response.json()
    assert response.json()["secrets_set"] == [] and response.json()["external_id"].startswith("inferplane-")


PLATFORM_ACCOUNTS = frozenset({"111122223333", "444455556666"})


@pytest.mark.parametrize("role_arn", [
    "arn:aws:iam::444455556666:role/inferplane-node",
    "arn:aws:iam::111122223333:role/path/to/admin",
    "arn:aws-us-gov:iam::111122223333:role/reader",
])
def test_a_role_in_one_of_the_platforms_own_accounts_is_a_400_on_role_arn(owner_client, settings, role_arn):
    # The GPU nodes assume the role with their own credentials: one in the platform's account that trusts them
    # without checking the external id read, for the tenant, whatever the platform can.
    settings.PLATFORM_AWS_ACCOUNT_IDS = PLATFORM_ACCOUNTS
    response = owner_client.post("/api/v1/credentials/", {"name": "role", "kind": "s3", "role_arn": role_arn},
                                 format="json")
    assert response.status_code == 400
    assert response.json()["role_arn"] == [
        "This role is in one of the platform's own AWS accounts, so it is never assumed for you: "
        "name a role in your own account."
    ]
    assert not ModelCredential.objects.exists()


def test_a_credential_cannot_be_changed_to_a_role_in_the_platforms_account_and_one_elsewhere_still_works(
    owner_client, settings
):
    settings.PLATFORM_AWS_ACCOUNT_IDS = PLATFORM_ACCOUNTS
    created = owner_client.post("/api/v1/credentials/", {
        "name": "role", "kind": "s3", "role_arn": "arn:aws:iam::123456789012:role/inferplane-reader",
    }, format="json")
    assert created.status_code == 201, created.json()
    url = f"/api/v1/credentials/{created.json()['id']}/"
    changed = owner_client.patch(url, {"role_arn": "arn:aws:iam::111122223333:role/reader"}, format="json")
    assert changed.status_code == 400 and "platform's own AWS accounts" in changed.json()["role_arn"][0]
    assert ModelCredential.objects.get().role_arn == "arn:aws:iam::123456789012:role/inferplane-reader"
    # Stored before the platform's accounts were named: any change says why, on the field to change.
    settings.PLATFORM_AWS_ACCOUNT_IDS = frozenset({"123456789012"})
    renamed = owner_client.patch(url, {"name": "renamed"}, format="json")
    assert renamed.status_code == 400 and "platform's own AWS accounts" in renamed.json()["role_arn"][0]


@pytest.mark.parametrize("url", ["http://169.254.169.254", "https://169.254.169.254/latest", "https://10.0.0.5:9000",
                                 "https://localhost:9000", "https://minio.cluster.local", "https://[::1]/", "ftp://store.example.com"])
def test_an_endpoint_url_into_the_platforms_own_network_is_refused(owner_client, settings, url):
    settings.ALLOW_LOCAL_MODEL_PATHS = False
    response = owner_client.post("/api/v1/credentials/", S3_BODY | {"endpoint_url": url}, format="json")
    assert response.status_code == 400 and "endpoint_url" in response.json()


@pytest.mark.parametrize("url", ["https://[64:ff9b::a00:5]:9000", "https://[64:ff9b::a9fe:a9fe]/", "https://[2002:a9fe:a9fe::1]/",
                                 "https://[::169.254.169.254]/", "https://[::127.0.0.1]:9000",
                                 "https://[64:ff9b:1::a00:5]/", "https://[::ffff:0:a9fe:a9fe]/", "https://[fec0::1]/"])
def test_an_endpoint_url_spelling_an_internal_ipv4_address_in_ipv6_is_refused(owner_client, settings, url):
    """NAT64 (64:ff9b::/96), 6to4 (2002::/16) and IPv4-compatible (::/96) addresses carry an IPv4 address that a node
    behind a NAT64 gateway reaches; Python calls them global, so before they were saved and the nodes connected.
    So do NAT64's local-use prefix (64:ff9b:1::/48, an operator's own gateway), IPv4-translated addresses
    (::ffff:0:0/96, a SIIT translator's) and deprecated site-local ones (fec0::/10): this Python (3.11) calls them
    global too."""
    settings.ALLOW_LOCAL_MODEL_PATHS = False
    response = owner_client.post("/api/v1/credentials/", S3_BODY | {"endpoint_url": url}, format="json")
    assert response.status_code == 400
    assert response.json()["endpoint_url"] == ["This address is on the platform's own network."]


@pytest.mark.parametrize("development", [False, True])
@pytest.mark.parametrize("url", ["https://[::1", "https://store.example.com:99999", "https://store.example.com:port",
                                 "https://store example.com", "https://store.example.com%2f.internal",
                                 "https://store.example.com/\x1b[2J", "https://store.example.com/a\nb"])
def test_an_endpoint_url_that_is_not_a_host_and_port_is_refused_with_a_field_error(owner_client, settings, url, development):
    """Before, an unclosed IPv6 bracket was a 500; a port out of range or not a number, or a host name with a space
    or an escape, was saved, and every pull of its endpoints failed on the nodes with Python's words; a path with an
    escape sequence or a line break was saved and handed to the nodes' S3 client."""
    settings.ALLOW_LOCAL_MODEL_PATHS = development
    response = owner_client.post("/api/v1/credentials/", S3_BODY | {"endpoint_url": url}, format="json")
    assert response.status_code == 400
    assert response.json()["endpoint_url"] == ["Use https://host[:port] of an S3-compatible store."]


@pytest.mark.parametrize("url", ["https://2852039166/", "https://0xa9fea9fe/", "https://0251.0376.0251.0376/",
                                 "https://127.1:9000", "https://0x7f.1/", "https://10.1/"])
def test_an_endpoint_url_spelling_an_internal_address_in_decimal_octal_or_hex_is_refused(owner_client, settings, url):
    """The nodes' resolver reads these as 169.254.169.254, 127.0.0.1 and 10.0.0.1; Python's ipaddress does not, so
    before they were saved as host names (the agent refused them only when a pull began)."""
    settings.ALLOW_LOCAL_MODEL_PATHS = False
    response = owner_client.post("/api/v1/credentials/", S3_BODY | {"endpoint_url": url}, format="json")
    assert response.status_code == 400
    assert response.json()["endpoint_url"] == ["This address is on the platform's own network."]


def test_an_endpoint_url_at_a_public_address_behind_nat64_is_accepted(owner_client, settings):
    settings.ALLOW_LOCAL_MODEL_PATHS = False
    response = owner_client.post("/api/v1/credentials/", S3_BODY | {"endpoint_url": "https://[64:ff9b::808:808]/"}, format="json")
    assert response.status_code == 201, response.json()


def test_an_s3_compatible_store_on_the_internet_is_accepted(owner_client, settings):
    settings.ALLOW_LOCAL_MODEL_PATHS = False
    response = owner_client.post("/api/v1/credentials/", S3_BODY | {"endpoint_url": "https://abc.r2.cloudflarestorage.com"}, format="json")
    assert response.status_code == 201, response.json()


def test_names_are_unique_in_an_organisation_only(owner_client):
    make_credential(owner_client.organization, name="prod-bucket")
    make_credential(OrganizationFactory(), name="shared-name")
    assert owner_client.post("/api/v1/credentials/", S3_BODY, format="json").status_code == 400
    assert owner_client.post("/api/v1/credentials/", S3_BODY | {"name": "shared-name"}, format="json").status_code == 201


def test_the_kind_of_a_credential_cannot_change(owner_client):
    credential = make_credential(owner_client.organization)
    response = owner_client.patch(f"/api/v1/credentials/{credential.pk}/", {"kind": "hf", "hf_token": HF_SECRET}, format="json")
    assert response.status_code == 400 and "kind" in response.json()


def test_a_new_access_key_id_needs_its_secret(owner_client):
    credential = make_credential(owner_client.organization)
    response = owner_client.patch(f"/api/v1/credentials/{credential.pk}/", {"access_key_id": "AKIAOTHERKEY"}, format="json")
    assert response.status_code == 400 and "secret_access_key" in response.json()


@pytest.mark.parametrize(("source", "kind", "ok"), [
    ("s3://our-bucket/llama", "s3", True),
    ("hf:our-org/private-llama", "hf", True),
    ("s3://our-bucket/llama", "hf", False),
    ("hf:our-org/private-llama", "s3", False),
    ("/models/tiny", "s3", False),
])
def test_an_endpoints_credential_must_match_its_source(owner_client, source, kind, ok):
    credential = make_credential(owner_client.organization, kind=kind)
    response = owner_client.post("/api/v1/endpoints/", {
        "name": "ep", "model_source": source, "gpu_type": "l4", "credential": str(credential.pk),
    }, format="json")
    assert response.status_code == (201 if ok else 400), response.json()
    if not ok:
        assert "credential" in response.json()


def test_changing_the_source_to_another_kind_is_refused_while_a_credential_is_set(owner_client):
    credential = make_credential(owner_client.organization)
    endpoint = EndpointFactory(organization=owner_client.organization, model_source="s3://b/m", credential=credential)
    response = owner_client.patch(f"/api/v1/endpoints/{endpoint.pk}/", {"model_source": "hf:org/model"}, format="json")
    assert response.status_code == 400 and "credential" in response.json()
    detached = owner_client.patch(f"/api/v1/endpoints/{endpoint.pk}/", {"model_source": "hf:org/model", "credential": None}, format="json")
    assert detached.status_code == 200 and detached.json()["credential"] is None


def test_a_credential_in_use_cannot_be_deleted(owner_client):
    credential = make_credential(owner_client.organization)
    EndpointFactory(organization=owner_client.organization, name="uses-it", model_source="s3://b/m", credential=credential)
    response = owner_client.delete(f"/api/v1/credentials/{credential.pk}/")
    assert response.status_code == 400
    assert "uses-it" in response.json()["endpoints"][0]
    assert ModelCredential.objects.filter(pk=credential.pk).exists()


def test_a_deleted_endpoint_does_not_hold_its_credential(owner_client):
    credential = make_credential(owner_client.organization)
    endpoint = EndpointFactory(organization=owner_client.organization, model_source="s3://b/m", credential=credential)
    assert owner_client.delete(f"/api/v1/endpoints/{endpoint.pk}/").status_code == 204
    assert owner_client.delete(f"/api/v1/credentials/{credential.pk}/").status_code == 204
    assert Endpoint.objects.get(pk=endpoint.pk).credential is None


def test_a_credential_an_adapter_uses_cannot_be_deleted_and_the_answer_names_the_adapter(owner_client):
    """Before, the adapter's protected reference made the delete a 500."""
    credential = make_credential(owner_client.organization)
    endpoint = EndpointFactory(organization=owner_client.organization, name="base", max_loras=1)
    Adapter.objects.create(endpoint=endpoint, name="tone", source="s3://tuned/tone", credential=credential)
    response = owner_client.delete(f"/api/v1/credentials/{credential.pk}/")
    assert response.status_code == 400
    assert "LoRA adapters use this credential: base:tone" in response.json()["endpoints"][0]
    assert ModelCredential.objects.filter(pk=credential.pk).exists()


def test_adapters_of_a_deleted_endpoint_do_not_hold_their_credential(owner_client):
    """Before, a deleted endpoint's adapter kept the credential undeletable for good (a 500 each time)."""
    credential = make_credential(owner_client.organization)
    endpoint = EndpointFactory(organization=owner_client.organization, max_loras=1)
    adapter = Adapter.objects.create(endpoint=endpoint, name="tone", source="s3://tuned/tone", credential=credential)
    assert owner_client.delete(f"/api/v1/endpoints/{endpoint.pk}/").status_code == 204
    assert owner_client.delete(f"/api/v1/credentials/{credential.pk}/").status_code == 204
    assert Adapter.objects.get(pk=adapter.pk).credential is None


def test_the_credentials_api_is_in_the_openapi_schema(owner_client):
    schema = owner_client.get("/api/schema/", HTTP_ACCEPT="application/json").json()
    assert "/api/v1/credentials/" in schema["paths"]
    # NOTE: a request's component apart from its answer's: the secrets are in what a request sends, never in an answer
    sent = schema["components"]["schemas"]["CredentialRequest"]["properties"]
    answered = schema["components"]["schemas"]["Credential"]["properties"]
    assert all(sent[name].get("writeOnly") for name in ("secret_access_key", "session_token", "hf_token"))
    assert not {"secret_access_key", "session_token", "hf_token"} & set(answered)
    assert answered["external_id"].get("readOnly") and "external_id" not in sent
