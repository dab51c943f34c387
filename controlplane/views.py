"""Console pages for accounts: home, sign-up, organisation switcher."""

from django.contrib import messages
from django.contrib.auth import login
from django.contrib.auth.decorators import login_required
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from controlplane.forms import SignUpForm
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
    return redirect(request.POST.get("next") or "console:dashboard")
