"""Console forms. Where an API serializer holds the rules, the form only renders and shows its errors."""

import logging
from datetime import timedelta

from django import forms
from django.conf import settings
from django.contrib.auth import forms as auth_forms
from django.contrib.auth import get_user_model, password_validation
from django.core.mail import EmailMultiAlternatives
from django.forms.utils import ErrorDict
from django.http import QueryDict
from django.template import loader
from django.utils import timezone

from controlplane.accounts.backends import ACCOUNT_EMAIL_MAX_LENGTH, EMAIL_MAX_LENGTH, normalize_email
from controlplane.accounts.mail_sender import send_later
from controlplane.accounts.models import Role, Scope
from controlplane.accounts.signup import send_no_account_email
from controlplane.text import as_name, name_problem

logger = logging.getLogger(__name__)


class PasswordResetForm(auth_forms.PasswordResetForm):
    """Django's, which mails an address with an account (able to log in) its link, bounded only by the form's limits
    per typed address (`throttle.PASSWORD_RESET`), and one without that no account has it (`signup.send_no_account_email`,
    a daily budget of its own per mailbox, past which it is mailed nothing): the answer alike whichever it is.

    Either mail is sent off the request (`mail_sender.send_later`), so the answer's time does not tell either: the
    request only looks the address up, renders the mail and hands it over, whichever it mails or whether it mails
    at all, and waits for no relay. A mail that fails is logged (`mail_sender`).

    NOTE: before, the mails went out within the request: a reset that mailed took the relay's round trips, one past
    the no-account budget none; the request then waited to take as long as a recent reset that mailed (a history of
    32 per process), and a process that had mailed none yet (just deployed) answered every reset after `EMAIL_TIMEOUT`
    (10 s): a poor answer to users, and the first reset of each process told who had an account until that wait was
    added. A Celery task was dropped earlier (see `mail_sender`)."""

    def send_mail(self, subject_template_name, email_template_name, context, from_email, to_email,
                  html_email_template_name=None):
        """Django's, the link handed to the sender threads rather than sent here (a failure there is logged, as
        Django's own logs it)."""
        subject = "".join(loader.render_to_string(subject_template_name, context).splitlines())
        message = EmailMultiAlternatives(subject, loader.render_to_string(email_template_name, context), from_email,
                                         [to_email])
        if html_email_template_name is not None:
            message.attach_alternative(loader.render_to_string(html_email_template_name, context), "text/html")
        send_later(message, what=f"a password reset email to user {context['user'].pk}")

    def get_users(self, email):
        """Django's, looked up once per form and address.

        NOTE: `save` chose the mail by them and Django's `save` looked them up again for the link: a reset with an
        account made one more query (a database round trip) than one without, and its answer's time told it."""
        looked_up = getattr(self, "_users_of", None)
        if looked_up is None or looked_up[0] != email:
            looked_up = self._users_of = (email, list(super().get_users(email)))
        return iter(looked_up[1])

    def save(self, domain_override=None, use_https=False, request=None, **kwargs):
        email = self.cleaned_data["email"]
        if next(self.get_users(email), None) is None:
            send_no_account_email(email)
            return
        super().save(domain_override=domain_override, use_https=use_https, request=request, **kwargs)


class SignUpForm(forms.Form):
    # NOTE: an account's email is also its username (150 characters); a longer one was a 500 at the insert.
    email = forms.EmailField(label="Work email", max_length=ACCOUNT_EMAIL_MAX_LENGTH, widget=forms.EmailInput(attrs={"autocomplete": "email"}))
    password = forms.CharField(
        label="Password", widget=forms.PasswordInput(attrs={"autocomplete": "new-password"}),
        help_text="At least 10 characters, not entirely numeric.",
    )
    organization_name = forms.CharField(label="Organisation name", max_length=128)

    def clean_organization_name(self):
        name = as_name(self.cleaned_data["organization_name"])
        if (problem := name_problem(name)) is not None:
            raise forms.ValidationError(problem)
        if len(name) > self.fields["organization_name"].max_length:  # NOTE: NFC may lengthen a name
            raise forms.ValidationError(f"Ensure this name has at most {self.fields['organization_name'].max_length} "
                                        f"characters (it has {len(name)}).")
        return name

    def clean_email(self):
        # NOTE: an address in use is no error here: the answer would tell a stranger who has an account
        # (`signup.sign_up_user` mails the address instead).
        return normalize_email(self.cleaned_data["email"], max_length=ACCOUNT_EMAIL_MAX_LENGTH)

    def clean(self):
        cleaned = super().clean()
        if cleaned.get("password"):
            email = cleaned.get("email", "")
            user = get_user_model()(username=email, email=email)
            try:
                password_validation.validate_password(cleaned["password"], user)
            except forms.ValidationError as exc:
                self.add_error("password", exc)
        return cleaned


class SerializerBackedForm(forms.Form):
    """A form that renders fields (labels, widgets, help) while a DRF serializer validates them.

    The rules live once, in the serializer the API uses; the console shows that
    serializer's errors inline, next to the field they name.
    """

    def serializer_data(self, post) -> QueryDict:
        """The posted values of this form's fields only (the CSRF token is no spec field)."""
        data = QueryDict(mutable=True)
        for name in self.fields:
            if name in post:
                data.setlist(name, post.getlist(name))
        return data

    def validated(self, serializer_class, **kwargs) -> dict | None:
        """What `serializer_class` makes of the posted fields (`serializer_data`), or None, its errors shown here."""
        serializer = serializer_class(data=self.serializer_data(self.data), **kwargs)
        if serializer.is_valid():
            return serializer.validated_data
        self.show_errors(serializer.errors)
        return None

    # Serializer field names shown on a differently named form field.
    error_fields: dict[str, str] = {}

    def show_errors(self, errors: dict) -> None:
        # NOTE: the form's own field validation never runs: the serializer's messages are the only ones.
        self._errors, self.cleaned_data = ErrorDict(renderer=self.renderer), {}
        for name, messages in errors.items():
            name = self.error_fields.get(name, name)
            for message in messages if isinstance(messages, list) else [messages]:
                self.add_error(name if name in self.fields else None, str(message))


class NewOrganizationForm(SerializerBackedForm):
    """Renders the new-organisation form; `NewOrganizationSerializer` validates it."""

    name = forms.CharField(label="Organisation name", required=False,
                           widget=forms.TextInput(attrs={"autocomplete": "organization"}),
                           help_text="A separate bill, its own members, keys and endpoints: a team, or staging.")


class MemberInviteForm(forms.Form):
    email = forms.EmailField(label="Email", max_length=EMAIL_MAX_LENGTH,
                             widget=forms.EmailInput(attrs={"autocomplete": "off"}))
    role = forms.ChoiceField(label="Role", choices=Role.choices, initial=Role.MEMBER)

    def clean_email(self):
        return normalize_email(self.cleaned_data["email"])


EXPIRY_CHOICES = [("", "Never"), ("7", "In 7 days"), ("30", "In 30 days"), ("90", "In 90 days"), ("365", "In a year")]


class ApiKeyForm(SerializerBackedForm):
    """Renders the new-key form; `ApiKeySerializer` validates it."""

    error_fields = {"expires_at": "expires_in_days"}

    name = forms.CharField(label="Name", required=False, help_text="What uses this key, e.g. “staging chatbot”.")
    scopes = forms.MultipleChoiceField(
        label="Scopes", choices=Scope.choices, required=False, initial=[Scope.INFERENCE],
        widget=forms.CheckboxSelectMultiple,
        help_text="Inference calls /v1 (chat, completions). Manage calls /api/v1 (admins only).",
    )
    expires_in_days = forms.ChoiceField(label="Expires", choices=EXPIRY_CHOICES, required=False)
    requests_per_minute = forms.CharField(
        label="Requests per minute", required=False, widget=forms.NumberInput(attrs={"placeholder": "platform default"})
    )
    tokens_per_minute = forms.CharField(
        label="Tokens per minute", required=False, widget=forms.NumberInput(attrs={"placeholder": "platform default"})
    )
    max_priority_boost = forms.CharField(
        label="Priority range", required=False, widget=forms.NumberInput(attrs={"placeholder": "none", "min": 0}),
        help_text="N lets calls pass `priority` from -N (sooner) to N (later). Empty: calls may not set a priority.",
    )

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for name, default in (("requests_per_minute", settings.DEFAULT_KEY_REQUESTS_PER_MINUTE),
                              ("tokens_per_minute", settings.DEFAULT_KEY_TOKENS_PER_MINUTE)):
            shown = f"{default}/min" if default else "no limit"
            self.fields[name].widget.attrs["placeholder"] = f"default {shown}"
            self.fields[name].help_text = f"Empty: the platform default, {shown}."

    def serializer_data(self, post) -> QueryDict:
        data = super().serializer_data(post)
        days = data.pop("expires_in_days", [""])[0]
        if days in {str(value) for value, _ in EXPIRY_CHOICES if value}:  # the form's choices, nothing else
            data["expires_at"] = (timezone.now() + timedelta(days=int(days))).isoformat()
        return data
