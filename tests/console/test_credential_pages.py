"""The Credentials page and the wizard's credential select: secrets go in, never come out."""

import pytest
from django.urls import reverse

from controlplane.accounts.models import AuditEvent, Role
from endpoints.credentials import stored_secrets
from endpoints.models import Endpoint, ModelCredential
from tests.console.test_endpoint_pages import VALID_SPEC
from tests.factories import AWS_SECRET, HF_SECRET, EndpointFactory, OrganizationFactory, make_credential

pytestmark = pytest.mark.django_db

NEW_S3 = {"name": "prod-bucket", "kind": "s3", "access_key_id": "AKIAEXAMPLEKEY000001", "secret_access_key": AWS_SECRET,
          "session_token": "", "role_arn": "", "region": "eu-west-1", "endpoint_url": "", "hf_token": ""}


def test_an_admin_adds_a_credential_and_never_sees_its_secret_again(owner):
    response = owner.post(reverse("console:credentials"), NEW_S3, follow=True)
    assert response.status_code == 200
    credential = ModelCredential.objects.get(organization=owner.organization)
    assert stored_secrets(credential) == {"secret_access_key": AWS_SECRET}
    for url in (reverse("console:credentials"), reverse("console:credential-edit", args=[credential.pk])):
        page = owner.get(url).content.decode()
        assert AWS_SECRET not in page
        assert "AKIAEXAMPLEKEY000001" in page and "secret_access_key set" in page
    assert credential.external_id in owner.get(reverse("console:credential-edit", args=[credential.pk])).content.decode()
    assert AWS_SECRET not in response.content.decode()


def test_form_errors_are_inline_and_the_typed_secret_is_not_echoed(owner):
    response = owner.post(reverse("console:credentials"), NEW_S3 | {"name": "Bad Name", "role_arn": "arn:nope"})
    page = response.content.decode()
    assert response.status_code == 400
    assert "lowercase letters" in page and "Use arn:aws:iam::" in page
    assert AWS_SECRET not in page
    assert not ModelCredential.objects.exists()


def test_a_role_in_the_platforms_own_account_is_refused_on_the_form_with_the_reason(owner, settings):
    settings.PLATFORM_AWS_ACCOUNT_IDS = frozenset({"111122223333"})
    role = NEW_S3 | {"name": "role", "access_key_id": "", "secret_access_key": "",
                     "role_arn": "arn:aws:iam::111122223333:role/inferplane-node"}
    response = owner.post(reverse("console:credentials"), role)
    assert response.status_code == 400
    assert "This role is in one of the platform&#x27;s own AWS accounts" in response.content.decode()
    assert "platform's own AWS accounts" in response.context["form"].errors["role_arn"][0]  # next to its field
    assert not ModelCredential.objects.exists()
    elsewhere = owner.post(reverse("console:credentials"), role | {"role_arn": "arn:aws:iam::123456789012:role/reader"})
    assert elsewhere.status_code == 302
    assert ModelCredential.objects.get().role_arn == "arn:aws:iam::123456789012:role/reader"


def test_a_blank_secret_box_keeps_the_stored_secret_and_a_typed_one_replaces_it(owner):
    credential = make_credential(owner.organization)
    url = reverse("console:credential-edit", args=[credential.pk])
    kept = owner.post(url, {"name": "bucket", "access_key_id": credential.access_key_id, "role_arn": "",
                            "region": "us-east-1", "endpoint_url": "", "secret_access_key": "", "session_token": ""})
    assert kept.status_code == 302
    credential.refresh_from_db()
    assert credential.region == "us-east-1" and stored_secrets(credential) == {"secret_access_key": AWS_SECRET}
    owner.post(url, {"name": "bucket", "access_key_id": credential.access_key_id, "role_arn": "", "region": "us-east-1",
                     "endpoint_url": "", "secret_access_key": "replacedSecret0001", "session_token": ""})
    credential.refresh_from_db()
    assert stored_secrets(credential) == {"secret_access_key": "replacedSecret0001"}
    assert "replacedSecret0001" not in str(list(AuditEvent.objects.values()))


def test_a_credential_in_use_is_not_deleted_and_the_page_says_by_what(owner):
    credential = make_credential(owner.organization)
    EndpointFactory(organization=owner.organization, name="uses-it", model_source="s3://b/m", credential=credential)
    response = owner.post(reverse("console:credential-delete", args=[credential.pk]), follow=True)
    assert "uses-it" in response.content.decode()
    assert ModelCredential.objects.filter(pk=credential.pk).exists()


def test_an_unused_credential_is_deleted(owner):
    credential = make_credential(owner.organization)
    owner.post(reverse("console:credential-delete", args=[credential.pk]))
    assert not ModelCredential.objects.exists()


def test_members_see_the_list_but_cannot_add_edit_or_delete(org, console_client_factory):
    credential = make_credential(org)
    member = console_client_factory(org, Role.MEMBER)
    page = member.get(reverse("console:credentials"))
    assert page.status_code == 200 and "bucket" in page.content.decode() and "Add a credential" not in page.content.decode()
    assert member.post(reverse("console:credentials"), NEW_S3).status_code == 403
    assert member.get(reverse("console:credential-edit", args=[credential.pk])).status_code == 403
    assert member.post(reverse("console:credential-delete", args=[credential.pk])).status_code == 403
    assert console_client_factory(org, Role.VIEWER).get(reverse("console:credentials")).status_code == 403


def test_another_organisations_credential_pages_are_404(owner):
    theirs = make_credential(OrganizationFactory(), name="theirs")
    assert owner.get(reverse("console:credential-edit", args=[theirs.pk])).status_code == 404
    assert owner.post(reverse("console:credential-delete", args=[theirs.pk])).status_code == 404
    assert "theirs" not in owner.get(reverse("console:credentials")).content.decode()


def test_the_wizard_offers_only_the_organisations_credentials(owner):
    ours = make_credential(owner.organization, name="our-hub", kind="hf")
    theirs = make_credential(OrganizationFactory(), name="their-hub", kind="hf")
    page = owner.get(reverse("console:endpoint-new")).content.decode()
    assert "our-hub" in page and "their-hub" not in page
    assert HF_SECRET not in page
    stolen = owner.post(reverse("console:endpoint-new"), VALID_SPEC | {"credential": str(theirs.pk)})
    assert stolen.status_code == 400 and not Endpoint.objects.exists()
    deployed = owner.post(reverse("console:endpoint-new"), VALID_SPEC | {"credential": str(ours.pk)})
    assert deployed.status_code == 302
    endpoint = Endpoint.objects.get()
    assert endpoint.credential == ours
    edit = owner.get(reverse("console:endpoint-edit", args=[endpoint.pk])).content.decode()
    assert f'value="{ours.pk}" selected' in edit


def test_the_navigation_links_to_credentials(owner):
    assert reverse("console:credentials") in owner.get(reverse("console:dashboard")).content.decode()
