"""Rotating the encryption key: every stored secret is re-encrypted with the newest key, then the
old key can go and every secret still decrypts."""

import pytest
from cryptography.fernet import Fernet
from django.apps import apps
from django.core.management import call_command
from django.core.management.base import CommandError

from controlplane import secrets
from endpoints.credentials import stored_secrets
from endpoints.models import ModelCredential
from tests.factories import AWS_SECRET, HF_SECRET, OrganizationFactory, make_credential

pytestmark = pytest.mark.django_db


@pytest.fixture
def keys(settings):
    """Sets the configured keys (newest first) and makes `controlplane.secrets` use them."""

    def use(*new_keys):
        settings.ENCRYPTION_KEYS = list(new_keys)
        secrets.reset_keys()

    yield use
    secrets.reset_keys()


def test_every_encrypted_column_is_declared_and_exists():
    for label, field in secrets.ENCRYPTED_FIELDS:
        assert apps.get_model(label)._meta.get_field(field)


def test_rotation_re_encrypts_with_the_new_key_so_the_old_one_can_go(keys):
    key_a, key_b = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    keys(key_a)
    organization = OrganizationFactory()
    s3 = make_credential(organization, name="bucket")
    hf = make_credential(organization, name="hub", kind="hf")
    before = dict(ModelCredential.objects.values_list("pk", "encrypted_secrets"))

    keys(key_b, key_a)
    call_command("rotate_encryption_keys")
    after = dict(ModelCredential.objects.values_list("pk", "encrypted_secrets"))
    assert all(after[pk] != before[pk] for pk in before)

    keys(key_b)  # the old key is dropped
    assert stored_secrets(ModelCredential.objects.get(pk=s3.pk)) == {"secret_access_key": AWS_SECRET}
    assert stored_secrets(ModelCredential.objects.get(pk=hf.pk)) == {"hf_token": HF_SECRET}


def test_without_rotation_dropping_the_old_key_makes_secrets_unreadable(keys):
    key_a, key_b = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    keys(key_a)
    credential = make_credential(OrganizationFactory())
    keys(key_b)
    with pytest.raises(secrets.SecretUnreadable):
        stored_secrets(ModelCredential.objects.get(pk=credential.pk))


def test_rotation_fails_loudly_on_a_secret_no_configured_key_reads(keys, capsys):
    key_a, key_b = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    keys(key_a)
    lost = make_credential(OrganizationFactory(), name="lost")
    keys(key_b)
    kept = make_credential(OrganizationFactory(), name="kept")
    with pytest.raises(CommandError, match="1 secret"):
        call_command("rotate_encryption_keys")
    assert str(lost.pk) in capsys.readouterr().err
    assert stored_secrets(ModelCredential.objects.get(pk=kept.pk)) == {"secret_access_key": AWS_SECRET}
