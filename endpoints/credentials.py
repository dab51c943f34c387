"""Model credentials and the public catalogue: who may read a model source, and with what.

An organisation stores its own S3 keys or role and Hugging Face tokens (`ModelCredential`); the
secrets are encrypted at rest (`controlplane.secrets`) and leave the control plane only inside the
desired spec of a replica that needs them, answered to the node that runs it. The fleet's own
credentials read only what staff put on the public catalogue (`AllowedSource`).

`source_access()` is the one place that decides, for an endpoint, which credentials its replicas
get, whether the agent may use the fleet's own, and who may share the cached weights.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.http import Http404
from django.utils import timezone
from rest_framework.exceptions import ValidationError

from controlplane import secrets
from controlplane.accounts.models import Organization, lock_organizations
from controlplane.accounts.services import ORGANIZATION_CLOSED, Actor, record_audit
from controlplane.integrity import unique_or_field_error
from endpoints.models import (
    SECRET_FIELDS,
    Adapter,
    CredentialKind,
    Endpoint,
    ModelCredential,
    source_kind,
    weights_scope_for,
)
from gpu_agent.protocol import SourceCredentials, role_account

logger = logging.getLogger(__name__)

# Fields a customer sets and sees again, per kind.
PUBLIC_FIELDS = {
    CredentialKind.S3: ("access_key_id", "role_arn", "region", "endpoint_url"),
    CredentialKind.HF: (),
}
SECRETS_OF_KIND = {
    CredentialKind.S3: ("secret_access_key", "session_token"),
    CredentialKind.HF: ("hf_token",),
}

# last_used_at is written at most this often per credential (heartbeats build specs every few seconds).
LAST_USED_RESOLUTION = timedelta(seconds=60)


class CredentialInUse(ValueError):
    """A credential that live endpoints or their adapters still name cannot be deleted."""


class RoleNotAllowed(ValueError):
    """A role ARN the platform will not assume for a tenant; the message is for the tenant."""


ROLE_ARN_FORMAT = "Use arn:aws:iam::<12-digit account>:role/<name>."
PLATFORM_ROLE = ("This role is in one of the platform's own AWS accounts, so it is never assumed for you: "
                 "name a role in your own account.")


def check_role_arn(role_arn: str) -> None:
    """Refuse a role ARN that is not a role in an account, or whose account is one the platform runs in.

    NOTE: the GPU nodes assume a tenant's role with their own credentials. A role in the platform's own
    account (`INFERPLANE_PLATFORM_AWS_ACCOUNT_IDS`) that trusts the nodes, or the account, without checking
    the external id would let the tenant read what the platform can: IAM policy is not in this repository,
    so such a role is never assumed, whatever its trust policy says. Checked when a credential is saved and
    each time a replica's spec is built, for rows stored before the check or the setting.
    """
    account = role_account(role_arn)
    if account is None:
        raise RoleNotAllowed(ROLE_ARN_FORMAT)
    if account in settings.PLATFORM_AWS_ACCOUNT_IDS:
        raise RoleNotAllowed(PLATFORM_ROLE)


def build_source_credentials(kind: str, values: dict) -> SourceCredentials:
    """The protocol's credentials from non-secret and secret values; raises ValueError if incomplete,
    `RoleNotAllowed` for a role the platform will not assume (`check_role_arn`).

    NOTE: the completeness rules (keys or a role for S3, a token for Hugging Face) are the
    protocol's own, so what the API accepts is exactly what an agent can use.
    """
    wanted = PUBLIC_FIELDS[kind] + SECRETS_OF_KIND[kind] + ("external_id",)
    credentials = SourceCredentials(kind=kind, **{name: values.get(name) or "" for name in wanted})
    if credentials.role_arn:
        check_role_arn(credentials.role_arn)
    return credentials


# --- writes -------------------------------------------------------------------------------------


def _new_external_id() -> str:
    return f"inferplane-{uuid.uuid4().hex}"


def _store_secrets(credential: ModelCredential, plain: dict) -> None:
    kept = {name: value for name, value in plain.items() if name in SECRET_FIELDS and value}
    credential.encrypted_secrets = secrets.encrypt(json.dumps(kept))
    credential.secret_fields = sorted(kept)


CREDENTIAL_NAME_TAKEN = "A credential with this name already exists in your organisation."
_NAME_CONSTRAINT = {"model_credential_name_unique_in_org": ("name", CREDENTIAL_NAME_TAKEN)}


@transaction.atomic
def create_credential(actor: Actor, organization, *, name: str, kind: str, **values) -> ModelCredential:
    """A new credential. The caller validated `values` (`CredentialSerializer`); secrets are encrypted here.
    A 400 (`non_field_errors`) where its organisation is closed."""
    # NOTE: under the organisation's row lock, which its close takes (`endpoints.closing`): a create that passed its
    # permission check before the close committed, and wrote after it, kept its encrypted secrets in the closed
    # organisation for good (nothing there changes any more, so nothing deleted them).
    lock_organizations([organization.pk])
    if Organization.objects.filter(pk=organization.pk, closed_at__isnull=False).exists():
        raise ValidationError({"non_field_errors": [ORGANIZATION_CLOSED]})
    credential = ModelCredential(
        organization=organization, name=name, kind=kind, external_id=_new_external_id(),
        created_by=actor.user,
        **{field: values.get(field, "") for field in PUBLIC_FIELDS[kind]},
    )
    build_source_credentials(kind, values | {"external_id": credential.external_id})
    _store_secrets(credential, values)
    with unique_or_field_error(_NAME_CONSTRAINT):  # NOTE: the name may have been taken since the serializer's check
        credential.save()
    # NOTE: names of the secret fields only, never their values.
    record_audit(actor, organization, "credential.create", credential, kind=kind, secret_fields=credential.secret_fields)
    return credential


@transaction.atomic
def update_credential(actor: Actor, credential: ModelCredential, **changes) -> ModelCredential:
    """Change non-secret fields; any secret field given replaces every stored secret of the credential."""
    credential = ModelCredential.objects.select_for_update().get(pk=credential.pk)
    changed = []
    for field in ("name",) + PUBLIC_FIELDS[credential.kind]:
        if field in changes and getattr(credential, field) != changes[field]:
            setattr(credential, field, changes[field])
            changed.append(field)
    new_secrets = {name: changes.get(name, "") for name in SECRETS_OF_KIND[credential.kind]}
    replaces_secrets = any(name in changes for name in SECRETS_OF_KIND[credential.kind])
    if replaces_secrets:
        _store_secrets(credential, new_secrets)
        changed.append("secrets")
    if not changed:
        return credential
    with unique_or_field_error(_NAME_CONSTRAINT):  # NOTE: the name may have been taken since the serializer's check
        credential.save()
    record_audit(actor, credential.organization, "credential.update", credential,
                 changed=changed, secret_fields=credential.secret_fields)
    return credential


CREDENTIAL_DELETED = "This credential was deleted meanwhile; choose another."


def hold_credential(credential: ModelCredential | None) -> None:
    """Keeps `credential` from being deleted until the caller's transaction ends (its row locked, as `delete_credential`
    locks it); a 400 on `credential` when it is gone already.

    NOTE: Django's foreign keys are checked at commit. A credential deleted between a serializer's check and an
    endpoint's or adapter's write (the DELETE saw nothing using it yet) failed that commit: an IntegrityError, a 500.
    """
    if credential is None:
        return
    if ModelCredential.objects.select_for_update(no_key=True).filter(pk=credential.pk).values_list("pk").first() is None:
        raise ValidationError({"credential": [CREDENTIAL_DELETED]})


@transaction.atomic
def delete_credential(actor: Actor, credential: ModelCredential) -> None:
    """Delete a credential that no live endpoint nor its adapters name (deleted endpoints and their
    adapters just lose the reference). Http404 where it was deleted since the caller read it.

    NOTE: two deletes at once (two admins, or an admin's and the organisation's close: `closing`) both found it; the
    second read it again here with `.get`: DoesNotExist, a 500 (the whole close rolled back)."""
    credential = ModelCredential.objects.select_for_update().filter(pk=credential.pk).first()
    if credential is None:
        raise Http404("No such credential.")
    users = list(Endpoint.objects.live().filter(credential=credential).values_list("name", flat=True))
    adapters = [f"{endpoint}:{name}" for endpoint, name in Adapter.objects.filter(
        credential=credential, endpoint__deleted_at__isnull=True).values_list("endpoint__name", "name")]
    problems = []
    if users:
        problems.append(f"Endpoints use this credential: {', '.join(sorted(users))}. Point them at another credential first.")
    if adapters:
        problems.append(f"LoRA adapters use this credential: {', '.join(sorted(adapters))}. Delete them first.")
    if problems:
        raise CredentialInUse(" ".join(problems))
    record_audit(actor, credential.organization, "credential.delete", credential, kind=credential.kind)
    credential.delete()


# --- reads for the agent channel ------------------------------------------------------------


def stored_secrets(credential: ModelCredential) -> dict:
    """The decrypted secrets. NOTE: the result goes into a replica's spec and nowhere else."""
    return json.loads(secrets.decrypt(credential.encrypted_secrets))


def source_credentials(credential: ModelCredential) -> SourceCredentials:
    values = {field: getattr(credential, field) for field in PUBLIC_FIELDS[credential.kind]}
    return build_source_credentials(
        credential.kind, values | stored_secrets(credential) | {"external_id": credential.external_id}
    )


def _touch(credential: ModelCredential) -> None:
    now = timezone.now()
    ModelCredential.objects.filter(pk=credential.pk).exclude(last_used_at__gt=now - LAST_USED_RESOLUTION).update(
        last_used_at=now
    )


@dataclass(slots=True, frozen=True)
class SourceAccess:
    credentials: SourceCredentials | None
    use_fleet_credentials: bool
    weights_scope: str

    def __repr__(self) -> str:  # NOTE: never the secrets, whatever SourceCredentials' repr becomes
        return f"SourceAccess(credentials={'set' if self.credentials else None}, fleet={self.use_fleet_credentials}, scope={self.weights_scope!r})"


def source_access(endpoint: Endpoint) -> SourceAccess:
    """How an endpoint's replicas read its model source.

    - With a credential: that credential, never the fleet's; weights cached for the organisation only.
    - Without, a source on the public catalogue: the fleet's own credentials; one cached copy for all.
    - Without, anything else (a public repo we cannot prove public, a local path): an anonymous
      read, cached for the organisation only, since another tenant must not get it from our cache.

    Raises `RoleNotAllowed` for a credential whose role the platform will not assume (stored before
    `check_role_arn` refused it): its replicas then fail with the reason, and the role never reaches a node.
    """
    scope = weights_scope_for(endpoint.organization_id, endpoint.credential_id, endpoint.model_source)
    if endpoint.credential_id is not None:
        credential = endpoint.credential
        if credential.kind != source_kind(endpoint.model_source):
            return SourceAccess(None, False, scope)
        try:
            credentials = source_credentials(credential)
        except RoleNotAllowed:
            raise  # the replica fails with the reason on its endpoint (`desired_replicas`); the role is never sent
        except (secrets.SecretUnreadable, ValueError):
            # The download then fails as unauthorised; the operator fixes the keys (see rotate_encryption_keys).
            logger.error("credential %s of endpoint %s cannot be read with the configured keys", credential.pk, endpoint.pk)
            return SourceAccess(None, False, scope)
        _touch(credential)
        return SourceAccess(credentials, False, scope)
    return SourceAccess(None, scope == "", scope)
