import factory
from django.contrib.auth import get_user_model

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
