import time
from io import StringIO

import factory
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.test import Client
from django_otp.oath import TOTP
from django_otp.plugins.otp_totp.models import TOTPDevice
from rest_framework.test import APIClient

from controlplane.accounts.models import EmailVerification, Membership, Organization, Role
from controlplane.accounts.services import SYSTEM
from endpoints.catalogue import GPU_TYPES
from endpoints.credentials import create_credential
from endpoints.models import Endpoint


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = get_user_model()
        django_get_or_create = ("username",)

    username = factory.Sequence(lambda n: f"user{n}@example.test")
    email = factory.SelfAttribute("username")
    password = factory.PostGenerationMethodCall("set_password", "correct horse battery")

    @factory.post_generation
    def verified(user, create, extracted, **kwargs):
        """Users have verified their email unless made with `verified=False` (a fresh sign-up)."""
        if create and extracted is not False and user.email:
            EmailVerification.objects.update_or_create(user=user, defaults={"email": user.email.lower()})


class OrganizationFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Organization

    name = factory.Sequence(lambda n: f"Org {n}")
    slug = factory.Sequence(lambda n: f"org-{n}")


class MembershipFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Membership

    organization = factory.SubFactory(OrganizationFactory)
    user = factory.SubFactory(UserFactory)
    role = Role.MEMBER


class EndpointFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Endpoint

    organization = factory.SubFactory(OrganizationFactory)
    name = factory.Sequence(lambda n: f"model-{n}")
    model_source = "hf:meta-llama/Llama-3.1-8B-Instruct"
    gpu_type = "l4"
    price_input_per_million = factory.LazyAttribute(lambda o: GPU_TYPES[o.gpu_type].price_input_per_million)
    price_cached_input_per_million = factory.LazyAttribute(lambda o: GPU_TYPES[o.gpu_type].price_cached_input_per_million)
    price_output_per_million = factory.LazyAttribute(lambda o: GPU_TYPES[o.gpu_type].price_output_per_million)


AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYzSECRETKEY"
HF_SECRET = "hf_PRIVATEtokenDoNotLeak0123456789"


def make_credential(organization, *, name="bucket", kind="s3", **values):
    """A model credential stored through the service, so its secrets are encrypted as in production."""
    if kind == "s3":
        values = {"access_key_id": "AKIAEXAMPLEKEY000001", "secret_access_key": AWS_SECRET, "region": "eu-west-1"} | values
    else:
        values = {"hf_token": HF_SECRET} | values
    return create_credential(SYSTEM, organization, name=name, kind=kind, **values)


def totp_code(device, *, steps_ahead: int = 0) -> str:
    """The code `device`'s authenticator app shows now (or `steps_ahead` 30-second steps later)."""
    totp = TOTP(device.bin_key, device.step, device.t0, device.digits, device.drift)
    totp.time = time.time() + steps_ahead * device.step
    return f"{totp.token():0{device.digits}d}"


def sign_in_staff(client, user):
    """Signs `user` in on `client` as staff sign in: a session (as after the password), then a code from a
    real, confirmed TOTP device through the code page. Returns the device.

    NOTE: the code page is the one way a session gets staff powers (no setting turns the check off), so a
    test that signs staff in any other way tests a session with no staff powers. A device that already took
    this step's code (signed in twice within 30 s) is given the next step's: the tolerance of one step takes it.
    """
    device = TOTPDevice.objects.filter(user=user, confirmed=True).first()
    if device is None:
        device = TOTPDevice.objects.create(user=user, name="test phone", confirmed=True)
    client.force_login(user)
    now_t = int((time.time() - device.t0) // device.step)
    response = client.post("/login/code/", {"code": totp_code(device, steps_ahead=max(0, device.last_t + 1 - now_t))})
    assert response.status_code == 302 and not response["Location"].startswith("/login/"), response
    return device


def staff_member(username: str = "ops@example.test"):
    """A staff account (a superuser) that owns an organisation and has no second-factor device yet."""
    user = UserFactory(username=username, is_staff=True, is_superuser=True)
    MembershipFactory(organization=OrganizationFactory(), user=user, role=Role.OWNER)
    return user


def signed_in_with_the_password(user) -> Client:
    """A browser past the log-in form with `user`'s password (UserFactory's), before any second factor."""
    client = Client()
    response = client.post("/login/", {"username": user.email, "password": "correct horse battery"})
    assert response.status_code == 302, response
    return client


def signed_in_api_client(user) -> APIClient:
    """An API client with `user`'s signed-in session, as the console's own calls, not an API key: members, roles and
    invitations change only so (`members.ensure_in_a_session`). Its `user` and `organization` are `user`'s first."""
    client = APIClient()
    client.force_login(user)
    client.user = user
    client.organization = Organization.objects.filter(memberships__user=user).order_by("memberships__pk").first()
    return client


def enrolment_code_for(user) -> str:
    """An enrolment code for `user`, as an operator's `reset_staff_second_factor` prints it (the account's
    devices go with it)."""
    printed = StringIO()
    call_command("reset_staff_second_factor", user.username, stdout=printed)
    return printed.getvalue().split()[-1]
