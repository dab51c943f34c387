"""The Django admin's site: staff only in a session that passed the second factor."""

from __future__ import annotations

from urllib.parse import urlencode

from django.contrib import admin
from django.contrib.auth import REDIRECT_FIELD_NAME
from django.shortcuts import redirect
from django.urls import reverse

from controlplane.accounts.second_factor import has_staff_powers, needs_second_factor


class StaffAdminSite(admin.AdminSite):
    def has_permission(self, request) -> bool:
        # NOTE: Django's asks `is_staff` alone: a password would open every tenant's prices, plans and keys.
        return request.user.is_active and has_staff_powers(request.user)

    def login(self, request, extra_context=None):
        """The password here as on the console; a staff account then enters its code on the console's page."""
        if needs_second_factor(request.user):
            next_url = request.GET.get(REDIRECT_FIELD_NAME) or reverse("admin:index", current_app=self.name)
            return redirect(f"{reverse('second-factor')}?{urlencode({REDIRECT_FIELD_NAME: next_url})}")
        return super().login(request, extra_context)
