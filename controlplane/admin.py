"""The Django admin for accounts: users staff create there count as verified; plans (quotas) and which
plan each organisation is on, saved through the services that audit (`save_plan`, `set_organization_plan`).
"""

from django.contrib import admin
from django.contrib.auth import admin as auth_admin
from django.contrib.auth import get_user_model

from controlplane.models import Organization, Plan
from controlplane.services import Actor, mark_email_verified, save_plan, set_organization_plan

User = get_user_model()


class UserAdmin(auth_admin.UserAdmin):
    def save_model(self, request, obj, form, change):
        super().save_model(request, obj, form, change)
        # NOTE: staff vouch for the address they type; only self-service sign-ups must prove theirs.
        if obj.email and (not change or "email" in form.changed_data):
            mark_email_verified(obj)


admin.site.unregister(User)
admin.site.register(User, UserAdmin)



@admin.register(Plan)
class PlanAdmin(admin.ModelAdmin):
    list_display = ["name", "max_endpoints", "max_replicas", "max_min_replicas", "max_held_requests", "max_gpus_by_type"]
    fields = ["name", "max_endpoints", "max_replicas", "max_min_replicas", "max_held_requests", "max_gpus_by_type"]

    def save_model(self, request, obj, form, change):
        save_plan(Actor.from_request(request), obj)

    def has_delete_permission(self, request, obj=None):
        return False  # an organisation on it would be left without; move them first (PROTECT)


@admin.register(Organization)
class OrganizationAdmin(admin.ModelAdmin):
    list_display = ["slug", "name", "plan", "created_at"]
    list_filter = ["plan"]
    search_fields = ["slug", "name"]
    list_select_related = ["plan"]
    # NOTE: staff change the plan only; everything else belongs to the organisation's owners.
    fields = ["name", "slug", "plan"]
    readonly_fields = ["name", "slug"]

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    def save_model(self, request, obj, form, change):
        if "plan" in form.changed_data:
            set_organization_plan(Actor.from_request(request), obj, obj.plan)
