"""Which organisation a request acts in, and with which role.

A session user acts in the organisation chosen in the console (kept in the
session, defaulting to their first); an API key acts in its own organisation
with its creator's current role there.
"""

from __future__ import annotations

from controlplane.accounts.models import ApiKey, Membership

SESSION_KEY = "organization_id"


def memberships_of(user):
    return Membership.objects.filter(user=user).select_related("organization").order_by("created_at")


def session_membership(request) -> Membership | None:
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return None
    chosen = request.session.get(SESSION_KEY)
    memberships = memberships_of(user)
    membership = memberships.filter(organization_id=chosen).first() if chosen else None
    return membership or memberships.first()


def request_membership(request) -> Membership | None:
    """The caller's membership in the organisation the request acts in (cached on the request)."""
    if hasattr(request, "_inferplane_membership"):
        return request._inferplane_membership
    api_key = getattr(request, "auth", None)
    if isinstance(api_key, ApiKey):
        membership = Membership.objects.filter(organization=api_key.organization, user=api_key.created_by_id).select_related("organization").first()
    else:
        membership = session_membership(request)
    request._inferplane_membership = membership
    return membership
