"""Console forms. Where an API serializer holds the rules, the form only renders and shows its errors."""

import logging
import random
import time
from collections import deque
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
from controlplane.accounts.models import Role, Scope
from controlplane.accounts.signup import send_no_account_email
from controlplane.text import as_name, name_problem

logger = logging.getLogger(__name__)


class PasswordResetForm(auth_forms.PasswordResetForm):
    """Django's, which mails an address with an account (able to log in) its link, bounded only by the form's limits
    per typed address (`throttle.PASSWORD_RESET`), and one without that no account has it (`signup.send_no_account_email`,
    a daily budget of its own per mailbox): the answer, and its time (one mail sent either way), alike whichever it is.
    Past that budget an address without an account is mailed nothing, and answered after as long as a reset that
    mailed takes (`_as_long_as_a_reset_that_mailed`); so is a reset whose mail failed, a link (`send_mail`) or not.
    A process that has mailed none yet answers every reset after `EMAIL_TIMEOUT`, mailing or not (`save`).

    NOTE: the reset's mails were once sent off the request by a Celery task (the answer at once); a review found that
    a flood of resets with the relay slow then held the default queue's slots the autoscaler and cold-start wakes
    need, and that a worker of the release before dropped the unknown task's message during a rollout. In the request,
    bounded by `EMAIL_TIMEOUT`, a slow relay holds only the asker's own request."""

    _num_links_mailed = 0  # by this form's save (`send_mail`)

    def save(self, domain_override=None, use_https=False, request=None, **kwargs):
        started = time.monotonic()
        # NOTE: a process that has mailed no reset yet has no time to answer as long as: every reset it answers until
        # then, mailing or not, is answered after `EMAIL_TIMEOUT`, the longest a reset that mails nothing waits.
        # Before, one that mailed nothing was answered after a fixed 0.2 s and one that mailed after the relay's send
        # (0.5 s in the test): the first reset of each fresh process (after a deploy) told who has an account.
        unmeasured = not _reset_times
        try:
            self._save(started, domain_override=domain_override, use_https=use_https, request=request, **kwargs)
        finally:
            if unmeasured:
                _sleep_until(started + settings.EMAIL_TIMEOUT)

    def _save(self, started: float, **kwargs) -> None:
        email = self.cleaned_data["email"]
        if next(iter(self.get_users(email)), None) is None:
            if send_no_account_email(email):
                _reset_times.append(time.monotonic() - started)
            else:
                _as_long_as_a_reset_that_mailed(started)
            return
        self._num_links_mailed = 0
        super().save(**kwargs)
        if self._num_links_mailed:
            _reset_times.append(time.monotonic() - started)
        else:
            _as_long_as_a_reset_that_mailed(started)

    def send_mail(self, subject_template_name, email_template_name, context, from_email, to_email,
                  html_email_template_name=None):
        """Django's (a link it could not send is logged, and the reset goes on), counting the links sent.

        NOTE: a link that failed is no time of a reset that mailed (`_reset_times`), as a "no account" mail that failed
        is not: counted (Django's own says nothing of a failure), a stranger resetting their own accounts at a host the
        relay refuses at once filled the process's history with near-zero times, and a reset past the no-account
        budget was answered at once again (a review's finding)."""
        subject = "".join(loader.render_to_string(subject_template_name, context).splitlines())
        message = EmailMultiAlternatives(subject, loader.render_to_string(email_template_name, context), from_email,
                                         [to_email])
        if html_email_template_name is not None:
            message.attach_alternative(loader.render_to_string(html_email_template_name, context), "text/html")
        try:
            message.send()
        except Exception:
            logger.exception("Failed to send password reset email to %s", context["user"].pk)
            return
        self._num_links_mailed += 1


# How long this process's recent resets that mailed took (`PasswordResetForm.save`), a link or "no account" alike.
_reset_times: deque[float] = deque(maxlen=32)


def _as_long_as_a_reset_that_mailed(started: float) -> None:
    """Wait until a reset that mailed nothing (an address past its no-account budget, or its mail failed) has taken
    as long as one of this process's recent resets that mailed, drawn at random (so their times are alike in spread as
    in median), at most `EMAIL_TIMEOUT`: a reset's time does not tell whether an account has the address.

    NOTE: before, past the budget such an address was answered at once, one with an account after the relay's round
    trips: an attacker's medians over a few resets told them apart (a review's test: 50 ms apart). The wait holds
    the request's thread as long as a mail would have: no more than a reset anyone may ask for costs."""
    # NOTE: none yet: the reset waits for `EMAIL_TIMEOUT`, as every reset of this process does (`save`)
    wanted = random.choice(_reset_times) if _reset_times else settings.EMAIL_TIMEOUT  # noqa: S311 (not a secret)
    _sleep_until(started + min(wanted, settings.EMAIL_TIMEOUT))


def _sleep_until(moment: float) -> None:
    """Sleep until `moment` (`time.monotonic`), if it has not come yet."""
    time.sleep(max(0.0, moment - time.monotonic()))


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

    # Serializer field names shown on a differently named form field.
    error_fields: dict[str, str] = {}

    def show_errors(self, errors: dict) -> None:
        # NOTE: the form's own field validation never runs: the serializer's messages are the only ones.
        self._errors, self.cleaned_data = ErrorDict(renderer=self.renderer), {}
        for name, messages in errors.items():
            name = self.error_fields.get(name, name)
            for message in messages if isinstance(messages, list) else [messages]:
                self.add_error(name if name in self.fields else None, str(message))


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
