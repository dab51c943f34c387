"""Management API for accounts: the current organisation, members, API keys, audit log."""

from django.contrib.auth import get_user_model
from django.http import JsonResponse
from django.views import defaults
from drf_spectacular.utils import OpenApiResponse, extend_schema, extend_schema_view, inline_serializer
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action, api_view
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.generics import get_object_or_404
from rest_framework.response import Response

from controlplane import services
from controlplane.models import ApiKey, AuditEvent, Membership, Role
from controlplane.serializers import (
    ApiKeySerializer,
    AuditEventSerializer,
    MembershipSerializer,
    OrganizationSerializer,
)
from controlplane.tenancy import request_membership


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


class ApiKeyViewSet(OrganizationScopedMixin, mixins.ListModelMixin, mixins.CreateModelMixin,
                    mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    serializer_class = ApiKeySerializer

    def get_queryset(self):
        return ApiKey.objects.for_org(self.organization)

    @extend_schema(
        responses=inline_serializer("CreatedApiKey", {"api_key": ApiKeySerializer(), "secret": serializers.CharField()})
    )
    def create(self, request, *args, **kwargs):
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        try:
            created = services.create_api_key(self.actor, self.organization, **serializer.validated_data)
        except services.NotPermitted as exc:
            raise ValidationError({exc.field: [str(exc)]}) from None
        # NOTE: the only response that ever contains the secret.
        return Response(
            {"api_key": ApiKeySerializer(created.api_key).data, "secret": created.plain},
            status=status.HTTP_201_CREATED,
        )

    @extend_schema(request=None, responses=ApiKeySerializer)
    @action(detail=True, methods=["post"])
    def revoke(self, request, pk=None):
        api_key = services.revoke_api_key(self.actor, self.get_object())
        return Response(ApiKeySerializer(api_key).data)


class MemberInputSerializer(serializers.Serializer):
    email = serializers.EmailField()
    role = serializers.ChoiceField(choices=Role.choices)


@extend_schema_view(destroy=extend_schema(responses={
    204: None, 400: OpenApiResponse(description="The organisation's last owner cannot leave, or the caller may not remove an owner."),
}))
class MembershipViewSet(OrganizationScopedMixin, mixins.ListModelMixin, mixins.DestroyModelMixin, viewsets.GenericViewSet):
    serializer_class = MembershipSerializer
    required_role = Role.ADMIN

    def get_queryset(self):
        return Membership.objects.filter(organization=self.organization).select_related("user")

    @extend_schema(request=MemberInputSerializer, responses=MembershipSerializer)
    def create(self, request):
        data = MemberInputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        user = get_user_model().objects.filter(email__iexact=data.validated_data["email"]).first()
        if user is None:
            raise ValidationError({"email": ["No user has signed up with this email yet."]})
        try:
            membership = services.add_member(self.actor, self.organization, user=user, role=data.validated_data["role"])
        except services.NotPermitted as exc:
            raise ValidationError({exc.field: [str(exc)]}) from None
        return Response(MembershipSerializer(membership).data, status=status.HTTP_201_CREATED)

    def partial_update(self, request, pk=None):
        data = MemberInputSerializer(data=request.data, partial=True)
        data.is_valid(raise_exception=True)
        if set(request.data) - {"role"} or "role" not in data.validated_data:
            raise ValidationError({"role": ["Send exactly {'role': …}."]})
        membership = get_object_or_404(self.get_queryset(), pk=pk)
        try:
            membership = services.change_member_role(self.actor, membership, role=data.validated_data["role"])
        except (services.LastOwnerError, services.NotPermitted) as exc:
            raise ValidationError({"role": [str(exc)]}) from None
        return Response(MembershipSerializer(membership).data)

    def perform_destroy(self, membership):
        try:
            services.remove_member(self.actor, membership)
        except (services.LastOwnerError, services.NotPermitted) as exc:
            raise ValidationError({"role": [str(exc)]}) from None


class AuditEventViewSet(OrganizationScopedMixin, viewsets.ReadOnlyModelViewSet):
    serializer_class = AuditEventSerializer
    required_read_role = Role.ADMIN

    def get_queryset(self):
        return AuditEvent.objects.filter(organization=self.organization).select_related("actor", "api_key")
