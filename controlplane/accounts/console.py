"""Access rules every console page shares: who may read, who may write, and in which organisation.

A console view is decorated with `member_required(write=<role>)`: any member of the
session's organisation may read (GET/HEAD); a POST needs `write` or higher. The view
then finds its objects from `request.organization`, so another tenant's object is a 404.
Fleet pages are for staff only, in a session that passed the second factor, and are a 404 to everyone
else (a staff account signed in with its password alone included).
"""

from __future__ import annotations

from functools import wraps

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404
from django.shortcuts import render

from controlplane.accounts.models import Role
from controlplane.accounts.second_factor import has_staff_powers
from controlplane.accounts.tenancy import no_longer_member

READ_METHODS = ("GET", "HEAD")


def member_required(write: str = Role.MEMBER):
    def decorator(view):
        @login_required
        @wraps(view)
        def wrapper(request, *args, **kwargs):
            membership = request.membership
            if not membership:
                # NOTE: a session whose chosen organisation is no longer the user's gets the chooser, never a page of
                # another organisation (`tenancy.chosen_membership`).
                return render(request, "controlplane/no_organization.html",
                              {"no_longer_member": no_longer_member(request)}, status=403)
            if request.method not in READ_METHODS and not membership.can(write):
                raise PermissionDenied(f"This needs the {Role(write).label.lower()} role or higher.")
            request.organization = membership.organization
            return view(request, *args, **kwargs)

        return wrapper

    return decorator


def staff_required(view):
    @login_required
    @wraps(view)
    def wrapper(request, *args, **kwargs):
        if not has_staff_powers(request.user):
            raise Http404("No such page.")
        return view(request, *args, **kwargs)

    return wrapper

