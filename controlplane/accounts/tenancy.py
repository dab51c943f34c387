"""Which organisation a request acts in, and with which role.

A session user acts in the organisation chosen in the console (kept in the session; a sign-in, or the first console
or API request of a session that has none, chooses their first); an API key acts in its own organisation with its
creator's current role there.

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


NOT_CHOSEN = ("This session has not chosen an organisation yet. Open the console (it chooses your first) and "
              "call again.")


class NotChosen(Exception):
    """The session never chose an organisation and the user has some: sign-ins and the console pin one
    (`pin_first_membership`); the gateway, which writes no session, acts in none rather than guess."""

    def __init__(self):
        super().__init__(NOT_CHOSEN)


def chosen_membership(user, session) -> Membership | None:
    """The user's membership in the organisation chosen in `session` (any mapping: the console's, or the one the
    gateway loads); None when they have none. `NoLongerMember` when the chosen organisation is no longer theirs,
    `NotChosen` when the session never chose: never another in its place. The one rule, for both paths.

    NOTE: a session that never chose once followed the user's first membership wherever it went: removed from it,
    they acted in the next one without a word. Sign-ins and the console pin the first (`pin_first_membership`)."""
    memberships = memberships_of(user)
    chosen = session.get(SESSION_KEY)
    if chosen is None:
        if memberships.exists():
            raise NotChosen()
        return None
    membership = memberships.filter(organization_id=chosen).first()
    if membership is None:
        raise NoLongerMember()
    return membership


def pin_first_membership(user, session) -> None:
    """Writes the user's first organisation into a session that never chose one (`session` is saved with the
    response), as the console then shows it; a session in no organisation stays unchosen until it has one."""
    if SESSION_KEY in session:
        return
    first = memberships_of(user).first()
    if first is not None:
        session[SESSION_KEY] = first.organization_id


def choose_first_at_login(sender, request, user, **kwargs) -> None:
    """A new sign-in chooses the user's first organisation (`user_logged_in`)."""
    if request is not None and hasattr(request, "session"):
        pin_first_membership(user, request.session)


def session_membership(request) -> Membership | None:
    """The console's membership: None when signed out, in no organisation, or no longer in the chosen one
    (`no_longer_member` tells which)."""
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return None
    # NOTE: a session signed in before sign-ins chose (or while the user was in no organisation) is pinned by its
    # first console or API request, so a later removal from that organisation moves it nowhere.
    pin_first_membership(user, request.session)
    try:
        return chosen_membership(user, request.session)
    except (NoLongerMember, NotChosen):
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
    except NotChosen:
        pass
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
