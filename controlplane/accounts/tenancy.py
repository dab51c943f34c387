"""Which organisation a request acts in, and with which role.

A session user acts in the organisation chosen in the console (kept in the
session, defaulting to their first while they never chose); an API key acts in its own organisation
with its creator's current role there.

NOTE: a session whose chosen organisation is no longer the user's (they were removed, or it was deleted) acts in
none until they choose again (`NoLongerMember`): the console shows the chooser, `/api/` and the playground answer 403.
It fell back to their first other membership: the next console action (an endpoint, a key, a batch, a billed
playground call) happened in another organisation without a word.
"""

from __future__ import annotations

from controlplane.accounts.models import ApiKey, Membership

SESSION_KEY = "organization_id"


def memberships_of(user):
    return Membership.objects.filter(user=user).select_related("organization").order_by("created_at")


NO_LONGER_MEMBER = ("You are no longer a member of the organisation chosen in this session (you were removed, or it "
                    "was deleted). Choose one of your organisations in the console to go on.")


class NoLongerMember(Exception):
    """The organisation chosen in the session is no longer the user's: the session acts in none until they choose."""

    def __init__(self):
        super().__init__(NO_LONGER_MEMBER)


def chosen_membership(user, session) -> Membership | None:
    """The user's membership in the organisation chosen in `session` (any mapping: the console's, or the one the
    gateway loads): their first membership while they never chose, None when they have none; `NoLongerMember` when
    the chosen organisation is no longer theirs, never another in its place. The one rule, for both paths."""
    memberships = memberships_of(user)
    chosen = session.get(SESSION_KEY)
    if chosen is None:
        return memberships.first()
    membership = memberships.filter(organization_id=chosen).first()
    if membership is None:
        raise NoLongerMember()
    return membership


def choose_first_at_login(sender, request, user, **kwargs) -> None:
    """A new sign-in chooses the user's first organisation, as the console then shows it (`user_logged_in`).

    NOTE: a session that never chose followed the user's first membership wherever it went: removed from it, they
    acted in the next one without a word, as a removed member's chosen organisation did (`chosen_membership`)."""
    if request is None or not hasattr(request, "session") or SESSION_KEY in request.session:
        return
    first = memberships_of(user).first()
    if first is not None:
        request.session[SESSION_KEY] = first.organization_id


def session_membership(request) -> Membership | None:
    """The console's membership: None when signed out, in no organisation, or no longer in the chosen one
    (`no_longer_member` tells which)."""
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return None
    try:
        return chosen_membership(user, request.session)
    except NoLongerMember:
        return None


def no_longer_member(request) -> bool:
    """Why a signed-in session has no membership: it chose an organisation that is no longer the user's."""
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return False
    try:
        chosen_membership(user, request.session)
    except NoLongerMember:
        return True
    return False


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
