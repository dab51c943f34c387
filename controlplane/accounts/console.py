"""Access rules every console page shares: who may read, who may write, and in which organisation.

A console view is decorated with `member_required(write=<role>)`: any member of the
session's organisation may read (GET/HEAD); a POST needs `write` or higher. The view
then finds its objects from `request.organization`, so another tenant's object is a 404.
Every console form that changes state carries the organisation its page was shown for
(`templates/controlplane/_page_organization.html`, next to `{% csrf_token %}`); a POST naming another than the
session's current one changes nothing (`page_organization_refusal`).
Fleet pages are for staff only, in a session that passed the second factor, and are a 404 to everyone
else (a staff account signed in with its password alone included).
"""

from __future__ import annotations

from functools import wraps

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404
from django.shortcuts import redirect, render
from django.utils.http import url_has_allowed_host_and_scheme

from controlplane.accounts.models import Role
from controlplane.accounts.second_factor import has_staff_powers
from controlplane.accounts.services import ORGANIZATION_CLOSED
from controlplane.accounts.tenancy import memberships_of, no_longer_member
from controlplane.plain_numbers import INT64_MAX, plain_int
from controlplane.text import shown_name

READ_METHODS = ("GET", "HEAD")
# The form field naming the organisation a console page was shown for (`_page_organization.html` writes it).
PAGE_ORGANIZATION_FIELD = "page_organization"


def page_organization_refusal(request, *, in_query: bool = False):
    """The page the form came from again, with why, when the form was shown for another organisation than the one
    the session now acts in (switched in another tab); None when it was shown for this one or names none (a
    client that is no browser, a page cached from before forms carried it: acts as before). `in_query`: read in the
    query string (a form that posts a file names it in its action too, checked before its body is read), never in
    the form's body.

    NOTE: the switcher writes the session's organisation, and every console form acted in it: a form left open on
    organisation A's page, posted after a switch to B in another tab, changed B without a word (a $0 spend cap, a key,
    an invitation, an endpoint)."""
    shown_for = (request.GET if in_query else request.POST).get(PAGE_ORGANIZATION_FIELD)
    if shown_for is None or shown_for == str(request.organization.pk):
        return None
    shown_for_id = plain_int(shown_for, maximum=INT64_MAX)
    page = (memberships_of(request.user).filter(organization_id=shown_for_id).first()
            if shown_for_id is not None else None)
    # NOTE: the name of an organisation the user is in, never of one a forged field names
    page_name = shown_name(page.organization.name) if page is not None else "another organisation"
    messages.error(request, f"This page was for {page_name}; you have since switched to {shown_name(request.organization.name)}. "
                            "Nothing was changed.")
    back = request.headers.get("Referer", "")
    if url_has_allowed_host_and_scheme(back, allowed_hosts={request.get_host()}, require_https=request.is_secure()):
        return redirect(back)
    return redirect("console:dashboard")


def member_required(write: str = Role.MEMBER, *, view_reads_form: bool = False, open_when_closed: bool = False):
    """`view_reads_form`: the view streams its body (a file upload) and calls `page_organization_refusal` itself,
    where it reads the form's fields; reading them here would parse the whole body before the view runs.
    `open_when_closed`: a POST a closed organisation may still make (to Stripe's portal, to pay its last invoices);
    every other is refused there."""
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
            if (request.method not in READ_METHODS and membership.organization.closed_at is not None
                    and not open_when_closed):
                raise PermissionDenied(ORGANIZATION_CLOSED)
            request.organization = membership.organization
            if request.method not in READ_METHODS and not view_reads_form:
                if (refusal := page_organization_refusal(request)) is not None:
                    return refusal
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

