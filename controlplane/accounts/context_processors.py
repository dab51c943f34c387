"""What every console template knows of its request: the organisation it acts in, and the others
the user may switch to, and whether staff pages are open to this session."""

from controlplane.accounts.second_factor import has_staff_powers
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
        "staff_powers": has_staff_powers(user),
    }
