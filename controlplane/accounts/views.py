"""Console pages for accounts: home, sign-up, email verification, invitations, organisation switcher,
members and API keys."""

from urllib.parse import urlencode, urlsplit

from django.conf import settings
from django.contrib import messages
from django.contrib.auth import REDIRECT_FIELD_NAME, logout
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpResponseRedirect
from django.shortcuts import get_object_or_404, redirect, render, resolve_url
from django.urls import reverse
from django.utils.html import format_html
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_POST

from controlplane.accounts import (
    enrolment_codes,
    invitations,
    keys,
    organizations,
    recovery_codes,
    second_factor,
    services,
    staff_sessions,
)
from controlplane.accounts.console import member_required
from controlplane.accounts.forms import ApiKeyForm, MemberInviteForm, NewOrganizationForm, SignUpForm
from controlplane.accounts.members import LastOwnerError, NotPermitted, change_member_role, remove_member
from controlplane.accounts.models import ApiKey, Invitation, Membership, Role, Scope, email_is_verified
from controlplane.accounts.serializers import ApiKeySerializer, NewOrganizationSerializer
from controlplane.accounts.services import client_ip
from controlplane.accounts.signup import (
    InvalidLink,
    LinkMailed,
    secure_after_password_reset,
    send_verification_email,
    sign_up_user,
    verification_link_user,
)
from controlplane.accounts.signup import verify_email as verify_email_token
from controlplane.accounts.tenancy import SESSION_KEY, memberships_of
from controlplane.clock import DatabaseClock
from controlplane.plain_numbers import INT64_MAX, plain_int
from controlplane.text import shown_name


def home(request):
    if request.user.is_authenticated:
        return redirect("console:dashboard")
    return render(request, "controlplane/home.html")


def signup(request):
    if request.user.is_authenticated:
        return redirect("console:dashboard")
    form = SignUpForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        # NOTE: the same answer whether the address had an account (then mailed so) or not: no enumeration.
        sign_up_user(
            email=form.cleaned_data["email"],
            password=form.cleaned_data["password"],
            organization_name=form.cleaned_data["organization_name"],
            source_ip=client_ip(request),
        )
        return redirect("signup-done")
    return render(request, "controlplane/signup.html", {"form": form})


def signup_done(request):
    return render(request, "controlplane/signup_done.html")


# --- email verification ----------------------------------------------------------------


class LoginView(auth_views.LoginView):
    """Django's, for a user already signed in too: a `next` naming this page leads to the default page.

    NOTE: `/login/?next=/login/` opened signed in was a 500 (Django refuses the redirect loop with a ValueError):
    a link anyone could send."""

    redirect_authenticated_user = True

    def get_redirect_url(self):
        url = super().get_redirect_url()
        return "" if url and urlsplit(url).path == self.request.path else url

    def get_success_url(self):
        """A staff account goes on to its code (or to enrol a device) before anything else."""
        url = super().get_success_url()
        if second_factor.needs_second_factor(self.request.user):
            return f"{reverse('second-factor')}?{urlencode({REDIRECT_FIELD_NAME: url})}"
        return url


# --- staff's second factor (controlplane.accounts.second_factor) ----------------------------


def _safe_next(request) -> str:
    """The `next` asked for when it stays on this site, else the default page.

    NOTE: an address, redirected to as it is (`HttpResponseRedirect`, as Django's `LoginView` does), never through
    `redirect()`: that takes a text without "/" or "." for a URL's name, and `?next=0` was a NoReverseMatch, a 500,
    after staff's code was taken."""
    url = request.POST.get(REDIRECT_FIELD_NAME) or request.GET.get(REDIRECT_FIELD_NAME) or ""
    if url and url_has_allowed_host_and_scheme(url, allowed_hosts={request.get_host()},
                                               require_https=request.is_secure()):
        return url
    return resolve_url(settings.LOGIN_REDIRECT_URL)


def _code_refused(request, check, template: str, context: dict):
    if check.outcome is second_factor.Outcome.THROTTLED:
        error = f"Too many wrong codes: wait {check.retry_after_s} s before the next try."
    else:
        error = "That code is wrong or was already used: enter the next one your app shows."
    response = render(request, template, context | {"error": error}, status=429 if check.retry_after_s else 400)
    if check.retry_after_s:
        response["Retry-After"] = str(check.retry_after_s)
    return response


def _sign_in_again(request, next_url: str):
    """A session whose sign-in is older than a staff session lasts (one signed in before the account was made staff)
    passes no second factor: its owner signs in again (`staff_sessions.may_become_staff`)."""
    logout(request)
    messages.info(request, f"Sign in again: a staff session lasts {settings.STAFF_SESSION_HOURS:g} hours from its "
                           "sign-in, and this session's sign-in is older.")
    return redirect(_with_next("login", next_url))


@login_required
def second_factor_verify(request):
    """After the password, a staff account enters a code from its device, or a recovery code; the session is then
    staff."""
    next_url = _safe_next(request)
    if not second_factor.needs_second_factor(request.user):
        return HttpResponseRedirect(next_url)
    if not staff_sessions.may_become_staff(request.session):
        return _sign_in_again(request, next_url)
    if second_factor.confirmed_device(request.user) is None:
        return redirect(_with_next("second-factor-enrol", next_url))
    context = {"next": next_url}
    if request.method == "POST":
        check = second_factor.verify_staff_code(request, request.POST.get("code", ""))
        if check.ok:
            if check.num_recovery_codes_left is not None:
                messages.warning(request, format_html(
                    "You signed in with a recovery code, which no longer works; {} left. "
                    '<a href="{}">Make new ones</a> before they run out.',
                    check.num_recovery_codes_left, reverse("second-factor-recovery")))
            return HttpResponseRedirect(next_url)
        return _code_refused(request, check, "registration/second_factor.html", context)
    return render(request, "registration/second_factor.html", context)


def _with_next(url_name: str, next_url: str) -> str:
    return f"{reverse(url_name)}?{urlencode({REDIRECT_FIELD_NAME: next_url})}"


@login_required
def second_factor_enrol(request):
    """A staff account without a device: first an enrolment code from outside the password and the mailbox (from an
    operator or a verified staff member, never mailed), then the secret for an authenticator app, confirmed by a
    code from it; then its recovery codes."""
    next_url = _safe_next(request)
    if not second_factor.needs_second_factor(request.user):
        return HttpResponseRedirect(next_url)
    if not staff_sessions.may_become_staff(request.session):
        return _sign_in_again(request, next_url)
    if second_factor.confirmed_device(request.user) is not None:
        return redirect(_with_next("second-factor", next_url))
    device = second_factor.enrolling_device(request)
    if device is None:
        return _enrolment_code_step(request, next_url)
    context = {"next": next_url, "secret": second_factor.base32_secret(device), "otpauth_url": device.config_url}
    if request.method == "POST":
        check = second_factor.confirm_enrolment(request, request.POST.get("code", ""))
        if check.ok:
            messages.success(request, "Your authenticator is set up: each sign-in now asks for a code from it.")
            # NOTE: the codes are in this answer only; nothing keeps them in plain (recovery_codes).
            return render(request, "registration/recovery_codes.html",
                          {"codes": check.recovery_codes, "next": next_url})
        return _code_refused(request, check, "registration/second_factor_enrol.html", context)
    return render(request, "registration/second_factor_enrol.html", context)


def _enrolment_code_step(request, next_url: str):
    context = {"next": next_url, "ttl_min": int(enrolment_codes.ENROLMENT_CODE_TTL.total_seconds() // 60)}
    if request.method == "POST":
        check = second_factor.take_enrolment_code(request, request.POST.get("enrolment_code", ""))
        if check.ok:
            return redirect(_with_next("second-factor-enrol", next_url))
        error = "That enrolment code is wrong, expired or already used: ask for a new one."
        return render(request, "registration/second_factor_enrolment_code.html", context | {"error": error}, status=400)
    return render(request, "registration/second_factor_enrolment_code.html", context)


@login_required
def second_factor_recovery(request):
    """A staff member's recovery codes: how many are left, and new ones (the old ones then void), shown once."""
    if not second_factor.has_staff_powers(request.user):
        if second_factor.needs_second_factor(request.user):
            return redirect(_with_next("second-factor", request.path))
        raise Http404
    if request.method == "POST":
        codes = second_factor.replace_recovery_codes(request)
        return render(request, "registration/recovery_codes.html", {"codes": codes, "next": _safe_next(request)})
    return render(request, "registration/recovery_codes.html",
                  {"num_left": recovery_codes.num_recovery_codes_left(request.user), "next": _safe_next(request)})


@login_required
def verify_email(request):
    """What an unverified account sees instead of the console: where the link went, and a resend button."""
    if email_is_verified(request.user):
        return redirect("console:dashboard")
    return render(request, "registration/verify_email.html")


@login_required
@require_POST
def verify_email_resend(request):
    # NOTE: throttled per user and address (controlplane.accounts.throttle), so this cannot mail-bomb anyone.
    if not email_is_verified(request.user):
        mailed = send_verification_email(request.user)
        if mailed is LinkMailed.SENT:
            messages.success(request, f"We sent a new link to {request.user.email}.")
        elif mailed is LinkMailed.DROPPED:
            messages.error(request, f"We could not send a link to {request.user.email} just now: try again in a few "
                                    "minutes.")
        else:
            messages.error(request, f"{request.user.email} got as many links as we send an address in a day: use the "
                                    "last one, or try again tomorrow.")
    return redirect("verify-email")


def verify_email_confirm(request, token):
    """The emailed link: it verifies the address only in the account's own session (`signup.verify_email`)."""
    try:
        if not request.user.is_authenticated:
            user = verification_link_user(token)
            messages.info(request, format_html(
                "Log in as {} to verify your email. Did you not sign up, or forget the password? "
                '<a href="{}">Reset the password</a>: it signs out every session of this account.',
                user.email, reverse("password_reset")))
            return redirect(f"{reverse('login')}?{urlencode({REDIRECT_FIELD_NAME: request.path})}")
        user = verify_email_token(token, signed_in_as=request.user)
    except InvalidLink as exc:
        return render(request, "registration/verify_email_failed.html", {"reason": str(exc)}, status=400)
    messages.success(request, f"Thank you: {user.email} is verified.")
    return redirect("console:dashboard")


class PasswordResetConfirmView(auth_views.PasswordResetConfirmView):
    """Django's, and then what a forgotten password's reset secures (`signup.secure_after_password_reset`)."""

    def form_valid(self, form):
        response = super().form_valid(form)
        secured = secure_after_password_reset(form.user, source_ip=client_ip(self.request))
        revoked = [f"{secured.num_keys_revoked} API key(s) of this account"] if secured.num_keys_revoked else []
        if secured.num_invitations_revoked:
            revoked.append(f"{secured.num_invitations_revoked} pending invitation(s) it sent")
        if revoked:
            messages.warning(self.request, f"{' and '.join(revoked)} were revoked: the address had not been "
                                           "confirmed by you, and someone else may have made them. Make new ones.")
        if secured.num_members_removed:
            messages.warning(self.request, f"{secured.num_members_removed} member(s) who joined through invitations "
                                           "this account sent were removed: the address had not been confirmed by "
                                           "you, and someone else may have invited them. The audit log names them; "
                                           "invite again those you know.")
        return response


# --- invitations -------------------------------------------------------------------------


@login_required
def invitation(request, token):
    """The invitee's page: what they are invited to, and the button that accepts it."""
    found = invitations.find_invitation(token)
    if found is None:
        return render(request, "controlplane/invitation.html", {"refusal": "This invitation link is not valid."}, status=404)
    if request.method == "POST":
        try:
            membership = invitations.accept_invitation(services.Actor.from_request(request), found)
        except invitations.InvitationRefused as exc:
            refusal = str(exc)
        else:
            request.session[SESSION_KEY] = membership.organization_id
            messages.success(request, f"You joined {shown_name(membership.organization.name)} as {membership.get_role_display().lower()}.")
            return redirect("console:dashboard")
    else:
        refusal = invitations.invitation_refusal(found, request.user)
    is_addressee = found.email.lower() == request.user.email.lower()
    return render(request, "controlplane/invitation.html", {"invitation": found, "refusal": refusal, "is_addressee": is_addressee},
                  status=400 if refusal and request.method == "POST" else 200)


@login_required
@require_POST
def switch_organization(request):
    chosen = request.POST.get("organization", "")
    organization_id = plain_int(chosen, maximum=INT64_MAX)
    membership = memberships_of(request.user).filter(organization_id=organization_id).first() \
        if organization_id is not None else None
    if membership is not None:
        request.session[SESSION_KEY] = membership.organization_id
    return redirect("console:dashboard")


def _new_organization_page(request, form, status=200, retry_after_s: int | None = None):
    response = render(request, "controlplane/organization_new.html", {
        "form": form, "max_owned": settings.MAX_OWNED_ORGANIZATIONS}, status=status)
    if retry_after_s is not None:
        response["Retry-After"] = str(retry_after_s)
    return response


@login_required
def new_organization(request):
    """A new organisation owned by the signed-in person (`organizations.create_own_organization`, the bounds and the
    audit there); the session then acts in it, as the switcher would have it."""
    if request.method != "POST":
        return _new_organization_page(request, NewOrganizationForm())
    form = NewOrganizationForm(request.POST)
    if (data := form.validated(NewOrganizationSerializer)) is None:
        return _new_organization_page(request, form, status=400)
    try:
        organization = organizations.create_own_organization(services.Actor.from_request(request), name=data["name"])
    except organizations.TooManyAttempts as exc:
        form.show_errors({"non_field_errors": [str(exc)]})
        return _new_organization_page(request, form, status=429, retry_after_s=exc.retry_after_s)
    except organizations.CreationRefused as exc:
        form.show_errors({exc.field: [str(exc)]})
        return _new_organization_page(request, form, status=403)
    except organizations.TooManyOrganizations as exc:
        form.show_errors({exc.field: [str(exc)]})
        return _new_organization_page(request, form, status=400)
    request.session[SESSION_KEY] = organization.pk
    messages.success(request, f"{shown_name(organization.name)} is created, with you as its owner: you are now working "
                              "in it. Invite your team from Members.")
    return redirect("console:dashboard")


# --- members ---------------------------------------------------------------------


def _members_page(request, invite_form, status=200):
    memberships = Membership.objects.filter(organization=request.organization).select_related("user")
    can_manage = request.membership.can(Role.ADMIN)
    # NOTE: pending invitations (invitees' and inviters' emails) are an admin's, as the API's InvitationViewSet has them.
    invitations = (Invitation.objects.for_org(request.organization).pending().select_related("invited_by")
                   if can_manage else Invitation.objects.none())
    return render(request, "controlplane/members.html", {
        "memberships": memberships,
        "invitations": invitations,
        "invite_form": invite_form,
        "roles": Role.choices,
        "can_manage": can_manage,
    }, status=status)


@member_required(write=Role.ADMIN)
def members(request):
    form = MemberInviteForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        email, role = form.cleaned_data["email"], form.cleaned_data["role"]
        try:
            invitations.invite_member(services.Actor.from_request(request), request.organization, email=email, role=role)
        except (NotPermitted, invitations.AlreadyInvited) as exc:
            form.add_error(exc.field, str(exc))
        except invitations.InvitationNotMailed as exc:
            form.add_error("email", str(exc))
            return _members_page(request, form, status=503)
        else:
            messages.success(request, f"We emailed an invitation to {email.lower()}; it is valid for "
                                      f"{invitations.INVITATION_TTL.days} days.")
            return redirect("console:members")
    if request.method == "POST":
        return _members_page(request, form, status=400)
    return _members_page(request, MemberInviteForm())


@member_required(write=Role.ADMIN)
@require_POST
def invitation_revoke(request, pk):
    invitation = get_object_or_404(Invitation.objects.for_org(request.organization).select_related("organization"), pk=pk)
    try:
        invitations.revoke_invitation(services.Actor.from_request(request), invitation)
        messages.success(request, f"The invitation to {invitation.email} was revoked; its link no longer works.")
    except NotPermitted as exc:
        messages.error(request, str(exc))
    return redirect("console:members")


@member_required(write=Role.ADMIN)
@require_POST
def member_role(request, pk):
    membership = get_object_or_404(Membership.objects.filter(organization=request.organization).select_related("user"), pk=pk)
    role = request.POST.get("role", "")
    if role not in Role.values:
        messages.error(request, "Choose one of the listed roles.")
    else:
        try:
            change_member_role(services.Actor.from_request(request), membership, role=role)
            messages.success(request, f"{membership.user.email} is now {Role(role).label.lower()}.")
        except (LastOwnerError, NotPermitted) as exc:
            messages.error(request, str(exc))
    return redirect("console:members")


@member_required(write=Role.ADMIN)
@require_POST
def member_remove(request, pk):
    membership = get_object_or_404(Membership.objects.filter(organization=request.organization).select_related("user"), pk=pk)
    try:
        remove_member(services.Actor.from_request(request), membership)
        messages.success(request, f"{shown_name(membership.user.email)} was removed from {shown_name(request.organization.name)}.")
    except (LastOwnerError, NotPermitted) as exc:
        messages.error(request, str(exc))
    return redirect("console:members")


# --- API keys ---------------------------------------------------------------------


def _keys_page(request, form, status=200):
    # NOTE: live or expired by PostgreSQL's clock, read in the list's own query, as `keys.find_api_key` judges it
    # (a template cannot hand `ApiKey.is_usable` its `now`: asked there, every key with an expiry read as expired)
    api_keys = list(ApiKey.objects.for_org(request.organization).select_related("created_by", "minted_by")
                    .annotate(listed_at=DatabaseClock()))
    roles = keys.member_roles(request.organization)
    actor = services.Actor.from_request(request)
    for api_key in api_keys:
        api_key.usable = api_key.is_usable(api_key.listed_at)
        api_key.can_revoke = keys.may_revoke_api_key(
            actor, api_key, actor_role=request.membership.role, creator_role=roles.get(api_key.created_by_id))
    return render(request, "controlplane/keys.html", {
        "api_keys": api_keys,
        "form": form,
        "can_write": request.membership.can(Role.MEMBER),
    }, status=status)


@member_required(write=Role.MEMBER)
def api_keys(request):
    if request.method != "POST":
        return _keys_page(request, ApiKeyForm(initial={"scopes": [Scope.INFERENCE]}))
    form = ApiKeyForm(request.POST)
    if (data := form.validated(ApiKeySerializer)) is None:
        return _keys_page(request, form, status=400)
    try:
        created = keys.create_api_key(services.Actor.from_request(request), request.organization, **data)
    except (NotPermitted, keys.TooManyKeys) as exc:
        form.show_errors({exc.field: [str(exc)]})
        return _keys_page(request, form, status=400)
    # NOTE: the secret is rendered in this response only; it is never stored or shown again.
    return render(request, "controlplane/key_created.html", {"api_key": created.api_key, "secret": created.plain}, status=201)


@member_required(write=Role.MEMBER)
@require_POST
def api_key_revoke(request, pk):
    api_key = get_object_or_404(ApiKey.objects.for_org(request.organization).select_related("organization"), pk=pk)
    try:
        keys.revoke_api_key(services.Actor.from_request(request), api_key)
    except NotPermitted as exc:
        messages.error(request, str(exc))
        return redirect("console:keys")
    messages.success(request, f"Key “{shown_name(api_key.name)}” ({api_key.display_prefix}…) was revoked, with the keys it "
                              "created; calls with them now fail.")
    return redirect("console:keys")
