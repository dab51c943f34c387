from django import forms
from django.contrib.auth import get_user_model, password_validation


class SignUpForm(forms.Form):
    email = forms.EmailField(label="Work email", widget=forms.EmailInput(attrs={"autocomplete": "email"}))
    password = forms.CharField(
        label="Password", widget=forms.PasswordInput(attrs={"autocomplete": "new-password"}),
        help_text="At least 10 characters, not entirely numeric.",
    )
    organization_name = forms.CharField(label="Organisation name", max_length=128)

    def clean_email(self):
        email = self.cleaned_data["email"].lower()
        if get_user_model().objects.filter(username=email).exists():
            raise forms.ValidationError("An account with this email exists; log in instead.")
        return email

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
