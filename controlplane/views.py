"""Console pages for accounts: home, sign-up, organisation switcher, members and API keys."""

from django.contrib import messages
from django.contrib.auth import get_user_model, login
from django.contrib.auth.decorators import login_required
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from controlplane import services
from controlplane.console import member_required
from controlplane.forms import ApiKeyForm, MemberInviteForm, SignUpForm
from controlplane.models import ApiKey, Membership, Role, Scope
from controlplane.serializers import ApiKeySerializer
from controlplane.services import client_ip, sign_up_user
from controlplane.tenancy import SESSION_KEY, memberships_of


def home(request):
    if request.user.is_authenticated:
        return redirect("console:dashboard")
    return render(request, "controlplane/home.html")


def signup(request):
    if request.user.is_authenticated:
        return redirect("console:dashboard")
    form = SignUpForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        user, organization = sign_up_user(
            email=form.cleaned_data["email"],
            password=form.cleaned_data["password"],
            organization_name=form.cleaned_data["organization_name"],
            source_ip=client_ip(request),
        )
        login(request, user, backend="django.contrib.auth.backends.ModelBackend")
        request.session[SESSION_KEY] = organization.pk
        messages.success(request, f"Welcome to Inferplane. {organization.name} is ready for its first endpoint.")
        return redirect("console:dashboard")
    return render(request, "controlplane/signup.html", {"form": form})


@login_required
@require_POST
def switch_organization(request):
    membership = memberships_of(request.user).filter(organization_id=request.POST.get("organization")).first()
    if membership is not None:
        request.session[SESSION_KEY] = membership.organization_id
    return redirect("console:dashboard")


# --- members ---------------------------------------------------------------------


def _members_page(request, invite_form, status=200):
    memberships = Membership.objects.filter(organization=request.organization).select_related("user")
    return render(request, "controlplane/members.html", {
        "memberships": memberships,
        "invite_form": invite_form,
        "roles": Role.choices,
        "can_manage": request.membership.can(Role.ADMIN),
    }, status=status)


@member_required(write=Role.ADMIN)
def members(request):
    form = MemberInviteForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        user = get_user_model().objects.filter(email__iexact=form.cleaned_data["email"]).first()
        role = form.cleaned_data["role"]
        if user is None:
            form.add_error("email", "No user has signed up with this email yet. Ask them to sign up first.")
        elif Membership.objects.filter(organization=request.organization, user=user).exists():
            form.add_error("email", "This user is already a member; change their role in the table.")
        else:
            try:
                services.add_member(services.Actor.from_request(request), request.organization, user=user, role=role)
            except services.NotPermitted as exc:
                form.add_error(exc.field, str(exc))
            else:
                messages.success(request, f"{user.email} joined {request.organization.name} as {Role(role).label.lower()}.")
                return redirect("console:members")
        return _members_page(request, form, status=400)
    return _members_page(request, MemberInviteForm())


@member_required(write=Role.ADMIN)
@require_POST
def member_role(request, pk):
    membership = get_object_or_404(Membership.objects.filter(organization=request.organization).select_related("user"), pk=pk)
    role = request.POST.get("role", "")
    if role not in Role.values:
        messages.error(request, "Choose one of the listed roles.")
    else:
        try:
            services.change_member_role(services.Actor.from_request(request), membership, role=role)
            messages.success(request, f"{membership.user.email} is now {Role(role).label.lower()}.")
        except (services.LastOwnerError, services.NotPermitted) as exc:
            messages.error(request, str(exc))
    return redirect("console:members")


@member_required(write=Role.ADMIN)
@require_POST
def member_remove(request, pk):
    membership = get_object_or_404(Membership.objects.filter(organization=request.organization).select_related("user"), pk=pk)
    try:
        services.remove_member(services.Actor.from_request(request), membership)
        messages.success(request, f"{membership.user.email} was removed from {request.organization.name}.")
    except (services.LastOwnerError, services.NotPermitted) as exc:
        messages.error(request, str(exc))
    return redirect("console:members")


# --- API keys ---------------------------------------------------------------------


def _keys_page(request, form, status=200):
    return render(request, "controlplane/keys.html", {
        "api_keys": ApiKey.objects.for_org(request.organization).select_related("created_by"),
        "form": form,
        "can_write": request.membership.can(Role.MEMBER),
    }, status=status)


@member_required(write=Role.MEMBER)
def api_keys(request):
    if request.method != "POST":
        return _keys_page(request, ApiKeyForm(initial={"scopes": [Scope.INFERENCE]}))
    form = ApiKeyForm(request.POST)
    serializer = ApiKeySerializer(data=form.serializer_data(request.POST))
    if not serializer.is_valid():
        form.show_errors(serializer.errors)
        return _keys_page(request, form, status=400)
    try:
        created = services.create_api_key(services.Actor.from_request(request), request.organization, **serializer.validated_data)
    except services.NotPermitted as exc:
        form.show_errors({exc.field: [str(exc)]})
        return _keys_page(request, form, status=400)
    # NOTE: the secret is rendered in this response only; it is never stored or shown again.
    return render(request, "controlplane/key_created.html", {"api_key": created.api_key, "secret": created.plain}, status=201)


@member_required(write=Role.MEMBER)
@require_POST
def api_key_revoke(request, pk):
    api_key = get_object_or_404(ApiKey.objects.for_org(request.organization), pk=pk)
    services.revoke_api_key(services.Actor.from_request(request), api_key)
    messages.success(request, f"Key “{api_key.name}” ({api_key.display_prefix}…) was revoked; calls with it now fail.")
    return redirect("console:keys")
