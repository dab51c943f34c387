"""Closing an organisation and deleting one's account: `/api/v1/organization/close/`, `/api/v1/account/delete/` and
their console pages. Thin: `endpoints.closing` decides and writes."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth import logout
from django.contrib.auth.decorators import login_required
from django.shortcuts import redirect, render
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import serializers, status
from rest_framework.exceptions import PermissionDenied, Throttled, ValidationError
from rest_framework.permissions import IsAuthenticated
from rest_framework.response import Response
from rest_framework.views import APIView

from billing import credits
from controlplane.accounts.console import member_required
from controlplane.accounts.models import Role
from controlplane.accounts.serializers import OrganizationSerializer
from controlplane.accounts.services import Actor, NotPermitted
from controlplane.accounts.tenancy import request_membership
from endpoints import closing


class CloseOrganizationInput(serializers.Serializer):
    confirm_name = serializers.CharField(trim_whitespace=False, help_text="The organisation's name, exactly.")
    forfeit_promotional_credit = serializers.BooleanField(
        default=False, help_text="Required (true) while promotional credit remains: it ends with the organisation.")


class CloseOrganizationView(APIView):
    """Closes the caller's organisation for good (owners only, signed in): its keys are revoked, its endpoints,
    adapters, credentials and files deleted, its open batches cancelled and its pending invitations withdrawn; its
    usage, invoices, credit ledger and audit log stay, readable, and its last usage is billed on a final invoice, then
    its subscription ends. Refused while purchased credit remains; promotional credit left must be forfeited
    explicitly (`forfeit_promotional_credit`)."""

    required_role = Role.OWNER

    @extend_schema(request=CloseOrganizationInput, responses={
        200: OrganizationSerializer,
        400: OpenApiResponse(description="`confirm_name` is not the organisation's name; purchased credit remains "
                                         "(`non_field_errors`: support refunds it first); promotional credit remains "
                                         "and `forfeit_promotional_credit` is not true (the amount is stated)."),
        403: OpenApiResponse(description="Not an owner, called with an API key, or the organisation is closed already."),
        409: OpenApiResponse(description="Another request closed it first."),
    })
    def post(self, request):
        data = CloseOrganizationInput(data=request.data)
        data.is_valid(raise_exception=True)
        membership = request_membership(request)
        try:
            organization = closing.close_organization(
                Actor.from_request(request), membership.organization, confirm_name=data.validated_data["confirm_name"],
                forfeit_promotional_credit=data.validated_data["forfeit_promotional_credit"])
        except NotPermitted as exc:
            raise PermissionDenied(str(exc)) from None
        except closing.Refused as exc:
            raise ValidationError({exc.field: [str(exc)]}) from None
        except closing.AlreadyClosed as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_409_CONFLICT)
        return Response(OrganizationSerializer(organization).data | {"role": membership.role})


class DeleteAccountInput(serializers.Serializer):
    password = serializers.CharField(trim_whitespace=False, style={"input_type": "password"})


class DeleteAccountView(APIView):
    """Deletes the signed-in user's own account: every membership ends (their keys revoked), every session ends, the
    account is deactivated and its address and name scrubbed. Refused while they are the only owner of an open
    organisation with other members or live resources."""

    permission_classes = [IsAuthenticated]

    @extend_schema(request=DeleteAccountInput, responses={
        204: None,
        400: OpenApiResponse(description="A wrong password, or an organisation that depends on the account."),
        403: OpenApiResponse(description="Called with an API key, or a staff account."),
        429: OpenApiResponse(description="Too many wrong passwords lately (shared with the password change's): wait "
                                         "`Retry-After` seconds."),
    })
    def post(self, request):
        data = DeleteAccountInput(data=request.data)
        data.is_valid(raise_exception=True)
        try:
            closing.delete_account(Actor.from_request(request), request.user,
                                   password=data.validated_data["password"])
        except NotPermitted as exc:
            raise PermissionDenied(str(exc)) from None
        except closing.Refused as exc:
            raise ValidationError({exc.field: [str(exc)]}) from None
        except closing.TooManyAttempts as exc:
            raise Throttled(wait=exc.retry_after_s, detail=str(exc)) from None
        logout(request._request)
        return Response(status=status.HTTP_204_NO_CONTENT)


@member_required(write=Role.OWNER)
def organization_close(request):
    organization = request.organization
    context = {"organization": organization, "is_owner": request.membership.role == Role.OWNER,
               "credit": credits.remaining_credit(organization.pk)}
    if request.method == "POST":
        try:
            closing.close_organization(Actor.from_request(request), organization,
                                       confirm_name=request.POST.get("confirm_name", ""),
                                       forfeit_promotional_credit=request.POST.get("forfeit_promotional_credit") == "on")
        except closing.Refused as exc:
            return render(request, "controlplane/organization_close.html", context | {"error": str(exc)}, status=400)
        except (NotPermitted, closing.AlreadyClosed) as exc:
            return render(request, "controlplane/organization_close.html", context | {"error": str(exc)}, status=409)
        messages.success(request, f"{organization.name} is closed. Its invoices, usage and audit log stay readable.")
        return redirect("console:dashboard")
    return render(request, "controlplane/organization_close.html", context)


@login_required
def account_delete(request):
    if request.method == "POST":
        try:
            closing.delete_account(Actor.from_request(request), request.user, password=request.POST.get("password", ""))
        except (closing.Refused, NotPermitted) as exc:
            return render(request, "controlplane/account_delete.html", {"error": str(exc)}, status=400)
        except closing.TooManyAttempts as exc:
            response = render(request, "controlplane/account_delete.html", {"error": str(exc)}, status=429)
            response["Retry-After"] = str(exc.retry_after_s)
            return response
        logout(request)
        messages.success(request, "Your account is deleted.")
        return redirect("login")
    return render(request, "controlplane/account_delete.html")
