"""What every console template knows of its request: the organisation it acts in, and the others
the user may switch to."""

from controlplane.accounts.tenancy import memberships_of


def organization(request):
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {}
    membership = getattr(request, "membership", None)
    return {
        "current_membership": membership if membership else None,
        "current_organization": membership.organization if membership else None,
        "all_memberships": memberships_of(user),
    }
