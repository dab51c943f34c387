"""Access rules for the management API."""

from rest_framework import permissions

from controlplane.accounts.models import ApiKey, Role, Scope
from controlplane.accounts.services import ORGANIZATION_CLOSED
from controlplane.accounts.tenancy import NO_LONGER_MEMBER, no_longer_member, request_membership


class IsOrganizationMember(permissions.BasePermission):
    """Any member may read; members and above may write; a view may ask for more with `required_role`.

    API keys need the `manage` scope here (an `inference` key only calls /v1).
    """

    message = "You do not have permission to perform this action."

    def has_permission(self, request, view) -> bool:
        if not request.user or not request.user.is_authenticated:
            return False
        if isinstance(request.auth, ApiKey) and not request.auth.has_scope(Scope.MANAGE):
            self.message = "This API key lacks the 'manage' scope."
            return False
        membership = request_membership(request)
        if membership is None:
            if no_longer_member(request):
                self.message = NO_LONGER_MEMBER
            return False
        if request.method in permissions.SAFE_METHODS:
            needed = getattr(view, "required_read_role", Role.VIEWER)
        else:
            needed = getattr(view, "required_role", Role.MEMBER)
            # NOTE: a closed organisation's members still read its invoices, usage and audit log; nothing changes, but
            # for a view that says it may (`open_when_closed`: the Stripe portal, where its last invoices are paid)
            if membership.organization.closed_at is not None and not getattr(view, "open_when_closed", False):
                self.message = ORGANIZATION_CLOSED
                return False
        if not membership.can(needed):
            self.message = f"This action needs the {needed} role or higher."
            return False
        return True
