"""The Django admin for accounts: users that staff create there count as verified."""

from django.contrib import admin
from django.contrib.auth import admin as auth_admin
from django.contrib.auth import get_user_model

from controlplane.services import mark_email_verified

User = get_user_model()


class UserAdmin(auth_admin.UserAdmin):
    def save_model(self, request, obj, form, change):
        super().save_model(request, obj, form, change)
        # NOTE: staff vouch for the address they type; only self-service sign-ups must prove theirs.
        if obj.email and (not change or "email" in form.changed_data):
            mark_email_verified(obj)


admin.site.unregister(User)
admin.site.register(User, UserAdmin)
