"""Management API for accounts: the current organisation, members, invitations, API keys, audit log."""

from django.http import JsonResponse
from django.views import defaults
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_view,
    inline_serializer,
)
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action, api_view, permission_classes
from rest_framework.exceptions import NotFound, PermissionDenied, Throttled, ValidationError
from rest_framework.generics import get_object_or_404
from rest_framework.permissions import IsAuthenticated
from rest_framework.response import Response

from controlplane.accounts import invitations, keys, members, organizations, services
from controlplane.accounts.models import ApiKey, AuditEvent, Invitation, Membership, Role
from controlplane.accounts.serializers import (
    ApiKeySerializer,
    AuditEventSerializer,
    InvitationSerializer,
    MembershipSerializer,
    NewOrganizationSerializer,
    OrganizationSerializer,
    StrictSerializer,
)
from controlplane.accounts.tenancy import request_membership


def not_found(request, exception=None):
    """The project's 404 (`handler404`): the console's page, or under `/api/` the API's JSON error,
    also for paths that match no route (an id with a `.` or a `/` in it)."""
    if request.path.startswith("/api/"):
        return JsonResponse({"detail": "Not found."}, status=404)
    return defaults.page_not_found(request, exception)


class OrganizationScopedMixin:
    """Every queryset starts from the caller's organisation: another tenant's object is a 404."""

    @property
    def organization(self):
        if getattr(self, "swagger_fake_view", False):  # schema generation: no caller, no rows
            return None
        membership = request_membership(self.request)
        if membership is None:  # permissions already refused; this guards direct use
            raise NotFound()
        return membership.organization

    @property
    def actor(self) -> services.Actor:
        return services.Actor.from_request(self.request)

    def get_serializer_context(self):
        return super().get_serializer_context() | {"organization": self.organization}


@extend_schema(responses=OrganizationSerializer)
@api_view(["GET"])
def current_organization(request):
    membership = request_membership(request)
    data = OrganizationSerializer(membership.organization).data | {"role": membership.role}
    return Response(data)


ORGANIZATION_REFUSED = inline_serializer("OrganizationCreationRefused", {
    "detail": serializers.CharField(help_text="Why, for a person."),
    "code": serializers.CharField(required=False, help_text=(
        "Why, for a program: `session_required` (called with an API key, which acts in its own organisation only), "
        "`account_inactive` (a deactivated or deleted account), `email_unverified`.")),
})


@extend_schema(request=NewOrganizationSerializer, responses={
    201: OrganizationSerializer,
    400: OpenApiResponse(description="A bad `name`; or (`non_field_errors`) the caller already owns or created the "
                                     "most organisations one person may (`INFERPLANE_MAX_OWNED_ORGANIZATIONS`)."),
    403: OpenApiResponse(response=ORGANIZATION_REFUSED, description="Signed-in sessions only, of an active account "
                                                                    "with a verified address (`code` says which)."),
    429: OpenApiResponse(description="Too many organisations created lately by this account or from this address: "
                                     "wait `Retry-After` seconds."),
})
@api_view(["POST"])
@permission_classes([IsAuthenticated])
def create_organization(request):
    """A new organisation owned by the signed-in caller, with a sign-up's set-up (default quotas and billing). The
    session goes on acting in the organisation it chose: the console's switcher moves it."""
    data = NewOrganizationSerializer(data=request.data)
    data.is_valid(raise_exception=True)
    try:
        organization = organizations.create_own_organization(services.Actor.from_request(request),
                                                             name=data.validated_data["name"])
    except organizations.CreationRefused as exc:
        return Response({"detail": str(exc), "code": exc.code}, status=status.HTTP_403_FORBIDDEN)
    except organizations.TooManyOrganizations as exc:
        raise ValidationError({exc.field: [str(exc)]}) from None
    except organizations.TooManyAttempts as exc:
        raise Throttled(wait=exc.retry_after_s, detail=str(exc)) from None
    return Response(OrganizationSerializer(organization).data, status=status.HTTP_201_CREATED)


# NOTE: was a 400 naming the field at fault, where every other refusal of a role (revoking a key, members,
# invitations) is a 403.
KEY_BEYOND_THE_CALLER = OpenApiResponse(description=(
    "The caller may not create this key: its role (a viewer none; a member none with the 'manage' scope, a priority "
    "range or limits above the platform's), or the API key it calls with (none beyond its own scopes, limits, "
    "priority range or expiry; none that infers from a key with a spend cap or limits of its own)."))


class ApiKeyViewSet(OrganizationScopedMixin, mixins.ListModelMixin, mixins.CreateModelMixin,
                    mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    serializer_class = ApiKeySerializer

    def get_queryset(self):
        return ApiKey.objects.for_org(self.organization)

    @extend_schema(
        responses={
            201: inline_serializer("CreatedApiKey", {"api_key": ApiKeySerializer(), "secret": serializers.CharField()}),
            400: OpenApiResponse(description="A field's error, or the organisation already holds its most live keys."),
            403: KEY_BEYOND_THE_CALLER,
        }
    )
    def create(self, request, *args, **kwargs):
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        try:
            created = keys.create_api_key(self.actor, self.organization, **serializer.validated_data)
        except members.NotPermitted as exc:  # the caller's role's, or its key's bounds: a 403, as revoking's
            raise PermissionDenied(str(exc)) from None
        except keys.TooManyKeys as exc:
            raise ValidationError({exc.field: [str(exc)]}) from None
        # NOTE: the only response that ever contains the secret.
        return Response(
            {"api_key": ApiKeySerializer(created.api_key).data, "secret": created.plain},
            status=status.HTTP_201_CREATED,
        )

    @extend_schema(request=None, responses={200: ApiKeySerializer, 403: None})
    @action(detail=True, methods=["post"])
    def revoke(self, request, pk=None):
        """Members revoke their own keys, admins any key but an owner's, owners every key."""
        try:
            api_key = keys.revoke_api_key(self.actor, self.get_object())
        except members.NotPermitted as exc:
            raise PermissionDenied(str(exc)) from None
        return Response(ApiKeySerializer(api_key).data)


class MemberRoleSerializer(StrictSerializer):
    """A member's new role: the PATCH body, `role` and nothing else."""

    role = serializers.ChoiceField(choices=Role.choices)


# NOTE: members, roles and invitations change only in a signed-in session (`members.ensure_in_a_session`).
SESSION_ONLY = OpenApiResponse(description="The caller's role does not allow this, or it called with an API key: "
                                           "members, roles and invitations change only when signed in (the console).")


@extend_schema_view(destroy=extend_schema(responses={
    204: None, 400: OpenApiResponse(description="The organisation's last owner cannot leave."),
    403: SESSION_ONLY,
}))
class MembershipViewSet(OrganizationScopedMixin, mixins.ListModelMixin, mixins.DestroyModelMixin, viewsets.GenericViewSet):
    """Members and their roles. Nobody is added here: people join by accepting an invitation. Roles are changed and
    members removed only when signed in, never with an API key (403); a removed member's keys are revoked."""

    serializer_class = MembershipSerializer
    required_role = Role.ADMIN
    patch_sets_every_field = True  # `role`, the one thing a PATCH changes (`controlplane.schema`)

    def get_queryset(self):
        return Membership.objects.filter(organization=self.organization).select_related("user")

    @extend_schema(request=MemberRoleSerializer, responses={200: MembershipSerializer, 403: SESSION_ONLY})
    def partial_update(self, request, pk=None):
        data = MemberRoleSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        membership = get_object_or_404(self.get_queryset(), pk=pk)
        try:
            membership = members.change_member_role(self.actor, membership, role=data.validated_data["role"])
        except members.NotPermitted as exc:  # an API key's (`SessionRequired`), or the caller's role's
            raise PermissionDenied(str(exc)) from None
        except members.LastOwnerError as exc:
            raise ValidationError({"role": [str(exc)]}) from None
        return Response(MembershipSerializer(membership).data)

    def perform_destroy(self, membership):
        try:
            members.remove_member(self.actor, membership)
        except members.NotPermitted as exc:
            raise PermissionDenied(str(exc)) from None
        except members.LastOwnerError as exc:
            raise ValidationError({"role": [str(exc)]}) from None


class InvitationViewSet(OrganizationScopedMixin, mixins.ListModelMixin, mixins.CreateModelMixin,
                        mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Invitations to the organisation: admins create (the link is emailed to the invitee), list and revoke them.

    Created only when signed in, never with an API key (403). The invitee accepts in the console, signed in as a
    verified user with the invited email.
    """

    serializer_class = InvitationSerializer
    required_role = Role.ADMIN
    required_read_role = Role.ADMIN

    def get_queryset(self):
        queryset = Invitation.objects.for_org(self.organization).select_related("invited_by", "organization")
        return queryset.pending() if self.action == "list" and self.request.query_params.get("status") != "all" else queryset

    @extend_schema(parameters=[OpenApiParameter("status", str, enum=["pending", "all"],
                                                description="pending (the default) or all, accepted and revoked included")])
    def list(self, request, *args, **kwargs):
        return super().list(request, *args, **kwargs)

    @extend_schema(responses={201: InvitationSerializer, 403: SESSION_ONLY, 429: OpenApiResponse(
        description="Too many invitations from this organisation, or to this address: wait `Retry-After` seconds."),
        503: OpenApiResponse(description="The invitation could not be emailed now (too many mails wait to be sent): "
                                         "nothing was sent or left pending; send it again after `Retry-After` seconds.")})
    def create(self, request, *args, **kwargs):
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        try:
            invitation = invitations.invite_member(self.actor, self.organization, **serializer.validated_data)
        except invitations.TooManyInvitations as exc:
            raise Throttled(wait=exc.retry_after_s, detail=str(exc)) from None
        except members.NotPermitted as exc:  # an API key's (`SessionRequired`), or the caller's role's
            raise PermissionDenied(str(exc)) from None
        except invitations.AlreadyInvited as exc:
            raise ValidationError({exc.field: [str(exc)]}) from None
        except invitations.InvitationNotMailed as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_503_SERVICE_UNAVAILABLE,
                            headers={"Retry-After": str(exc.retry_after_s)})
        return Response(InvitationSerializer(invitation).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses=InvitationSerializer)
    @action(detail=True, methods=["post"])
    def revoke(self, request, pk=None):
        try:
            invitation = invitations.revoke_invitation(self.actor, self.get_object())
        except members.NotPermitted as exc:
            raise PermissionDenied(str(exc)) from None
        return Response(InvitationSerializer(invitation).data)


class AuditEventViewSet(OrganizationScopedMixin, viewsets.ReadOnlyModelViewSet):
    serializer_class = AuditEventSerializer
    required_read_role = Role.ADMIN

    def get_queryset(self):
        return AuditEvent.objects.filter(organization=self.organization).select_related("actor", "api_key")
