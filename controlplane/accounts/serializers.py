"""Shapes of the accounts API, and the strictness every API serializer shares."""

from django.utils import timezone
from rest_framework import serializers

from controlplane.accounts.backends import normalize_email
from controlplane.accounts.models import (
    MAX_PRIORITY_BOOST,
    ApiKey,
    AuditEvent,
    Invitation,
    Membership,
    Organization,
    Scope,
)
from controlplane.text import as_name, name_problem, shown_name


class StrictSerializer(serializers.Serializer):
    """Rejects unknown and read-only fields, so a typo is a 400, not a silently ignored setting (and the schema says
    so: `additionalProperties: false`, `controlplane.schema`)."""

    refuses_unknown_fields = True

    def to_internal_value(self, data):
        if isinstance(data, dict):
            errors = {}
            for name in data:
                if name not in self.fields:
                    errors[name] = ["Unknown field."]
                elif self.fields[name].read_only:
                    errors[name] = ["This field is read-only."]
            if errors:
                raise serializers.ValidationError(errors)
        return super().to_internal_value(data)


class StrictModelSerializer(StrictSerializer, serializers.ModelSerializer):
    """Rejects unknown and read-only fields, so a typo is a 400, not a silently ignored setting."""


class NameField(serializers.CharField):
    """A name one person sets and others read (a key's, an organisation's): NFC (`text.as_name`), its length counted
    so; refused with a field error where it holds a control, format, private-use or unassigned character
    (`text.name_problem`); one stored before that rule is shown with those characters escaped (`text.shown_name`)."""

    def to_internal_value(self, data):
        value = as_name(super().to_internal_value(data))
        if (problem := name_problem(value)) is not None:
            raise serializers.ValidationError(problem, code="invalid")
        return value  # NOTE: `max_length` is checked after, on the name as it is stored

    def to_representation(self, value):
        return shown_name(super().to_representation(value))


class AddressField(serializers.EmailField):
    """A person's address others read (a member's, an inviter's, an actor's): one stored before `normalize_email`
    refused format characters is shown with them escaped (`text.shown_name`), as the members page shows it."""

    def to_representation(self, value):
        return shown_name(super().to_representation(value))


class OrganizationSerializer(serializers.ModelSerializer):
    name = NameField(read_only=True)

    class Meta:
        model = Organization
        fields = ["id", "name", "slug", "created_at", "closed_at"]
        read_only_fields = fields


class NewOrganizationSerializer(StrictSerializer):
    """A new organisation (`POST /api/v1/organizations/`): its name alone; its slug is made from it, free of every
    other organisation's."""

    name = NameField(max_length=Organization._meta.get_field("name").max_length,
                     help_text="Shown to its members and in every mail about it. Letters, digits, spaces and "
                               "punctuation: no control or format character (such as a direction override).")


class MembershipSerializer(serializers.ModelSerializer):
    email = AddressField(source="user.email", read_only=True)

    class Meta:
        model = Membership
        fields = ["id", "email", "role", "created_at"]
        read_only_fields = ["id", "email", "created_at"]


class InvitationSerializer(StrictModelSerializer):
    """An invitation as admins see it; the signed link goes only to the invitee's mailbox."""

    invited_by = AddressField(
        source="invited_by.email", default=None, allow_null=True, read_only=True,
        help_text="Who sent it; null for the platform's own invitations, or once staff deleted the sender.")
    status = serializers.ChoiceField(choices=["pending", "accepted", "revoked", "expired"], read_only=True)

    class Meta:
        model = Invitation
        fields = ["id", "email", "role", "status", "invited_by", "created_at", "expires_at", "accepted_at", "revoked_at"]
        read_only_fields = ["id", "status", "invited_by", "created_at", "expires_at", "accepted_at", "revoked_at"]
        extra_kwargs = {"role": {"required": True}}  # an invitation always says which role it offers

    def validate_email(self, value: str) -> str:
        return normalize_email(value)


class ApiKeySerializer(StrictModelSerializer):
    name = NameField(max_length=ApiKey._meta.get_field("name").max_length,
                     help_text="What uses the key; shown to the organisation's admins. Letters, digits, spaces and "
                               "punctuation: no control or format character (such as a direction override).")
    prefix = serializers.CharField(source="display_prefix", read_only=True)
    effective_requests_per_minute = serializers.IntegerField(
        read_only=True, help_text="What the gateway enforces: `requests_per_minute`, or the platform default when null (0: none).")
    effective_tokens_per_minute = serializers.IntegerField(
        read_only=True, help_text="What the gateway enforces: `tokens_per_minute`, or the platform default when null (0: none).")
    scopes = serializers.ListField(
        child=serializers.ChoiceField(choices=Scope.choices), allow_empty=False, default=[Scope.INFERENCE]
    )
    minted_by = serializers.PrimaryKeyRelatedField(
        read_only=True, allow_null=True,
        help_text="The id of the key that created this one (with `manage`); null for a key created when signed in. "
                  "Revoking a key revokes the keys it created, and theirs.")

    class Meta:
        model = ApiKey
        fields = [
            "id", "name", "prefix", "scopes", "requests_per_minute", "tokens_per_minute", "max_priority_boost",
            "effective_requests_per_minute", "effective_tokens_per_minute",
            "expires_at", "revoked_at", "last_used_at", "created_at", "minted_by",
        ]
        read_only_fields = ["id", "prefix", "effective_requests_per_minute", "effective_tokens_per_minute",
                            "revoked_at", "last_used_at", "created_at", "minted_by"]
        extra_kwargs = {
            "requests_per_minute": {"min_value": 1, "max_value": 1_000_000},
            "tokens_per_minute": {"min_value": 1, "max_value": 1_000_000_000},
            "max_priority_boost": {
                "min_value": 0, "max_value": MAX_PRIORITY_BOOST,
                "help_text": "Calls with this key may pass `priority` (an integer, lower runs sooner, default 0) from "
                             f"-N to N. Null (the default): passing `priority` is refused. At most {MAX_PRIORITY_BOOST}, "
                             "so interactive calls always run before batch work.",
            },
        }

    def validate_expires_at(self, value):
        if value is not None and value <= timezone.now():
            raise serializers.ValidationError("Must be in the future.")
        return value


STAFF_ACTOR = "Inferplane staff"


class AuditEventSerializer(serializers.ModelSerializer):
    actor = AddressField(source="actor.email", default=None, allow_null=True, read_only=True,
                         help_text=f'Who acted: a member\'s address, or "{STAFF_ACTOR}" for the platform\'s staff.')
    api_key = serializers.CharField(source="api_key.display_prefix", default=None, allow_null=True, read_only=True)
    target_repr = NameField(read_only=True, help_text="What was acted on, as it was named then (a key's name and prefix, "
                                                      "an address …).")

    class Meta:
        model = AuditEvent
        fields = ["id", "created_at", "actor", "api_key", "action", "target_type", "target_id", "target_repr", "details", "source_ip"]
        read_only_fields = fields

    def to_representation(self, instance):
        # NOTE: the details quote addresses and names as they were (`invitation.accept`'s `email`,
        # `organization.create`'s `owner`): escaped as `actor` and `target_repr` are (`text.shown_name`)
        data = super().to_representation(instance)
        data["details"] = _shown_strings(data["details"])
        if instance.by_staff:
            # NOTE: staff's address and network are not the tenant's to read (`AuditEvent.by_staff`): a hostile
            # tenant learnt whom to phish, and from where staff connect. Staff read them in the admin.
            data.update(actor=STAFF_ACTOR, api_key=None, source_ip=None)
            data["details"].pop("operator", None)
        return data


def _shown_strings(value):
    """`value` (JSON) with each string in it, at any depth, through `text.shown_name`."""
    if isinstance(value, str):
        return shown_name(value)
    if isinstance(value, list):
        return [_shown_strings(item) for item in value]
    if isinstance(value, dict):
        return {key: _shown_strings(item) for key, item in value.items()}
    return value
