import json

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError
from django.core.validators import validate_email, validate_slug
from django.db import transaction

from controlplane.accounts.backends import ACCOUNT_EMAIL_MAX_LENGTH, normalize_email
from controlplane.accounts.keys import TooManyKeys
from controlplane.accounts.models import Organization
from controlplane.accounts.signup import bootstrap_organization
from controlplane.text import as_name, name_problem


class Command(BaseCommand):
    help = "Create an organisation, its owner (if new) and a manage+inference API key."

    def add_arguments(self, parser):
        parser.add_argument("slug")
        parser.add_argument("--owner", required=True, help="owner's email; the user is created if new")
        parser.add_argument("--name", help="display name (default: the slug)")
        parser.add_argument("--password", help="set the owner's password (default: unchanged, or unusable if new)")
        parser.add_argument("--json", dest="as_json", action="store_true", help='print {"org": …, "owner": …, "api_key": …}')

    def handle(self, *args, slug, owner, name, password, as_json: bool, **options):
        try:
            validate_slug(slug)
            validate_email(owner)
            owner = normalize_email(owner, max_length=ACCOUNT_EMAIL_MAX_LENGTH)  # also its username
        except ValidationError as exc:
            raise CommandError("; ".join(exc.messages)) from None
        if name is not None:
            # NOTE: the rule sign-up's form applies (`SignUpForm.clean_organization_name`): stored NFC, no hidden or
            # reordering character, within its column (past it, a database error)
            name = as_name(name)
            if (problem := name_problem(name)) is not None:
                raise CommandError(f"--name: {problem}")
            if len(name) > (max_length := Organization._meta.get_field("name").max_length):
                raise CommandError(f"--name: at most {max_length} characters (it has {len(name)}).")
        try:
            # NOTE: one transaction: the owner (created, or given the password) and its membership were committed
            # before the key was refused, so the command said it failed and yet left a new owner who could log in.
            with transaction.atomic():
                organization, user, created_key = bootstrap_organization(slug=slug, owner_email=owner, name=name,
                                                                         password=password)
        except TooManyKeys as exc:  # an existing organisation at its live-key limit: a message, not a traceback
            raise CommandError(str(exc)) from None
        except ValidationError as exc:  # an address several accounts have: which is the owner is the operator's call
            raise CommandError("--owner: " + "; ".join(exc.messages)) from None
        if as_json:
            self.stdout.write(json.dumps({"org": organization.slug, "owner": user.email, "api_key": created_key.plain}))
        else:
            self.stdout.write(f"Organisation {organization.slug} owned by {user.email}")
            self.stdout.write(f"API key (shown once): {created_key.plain}")

