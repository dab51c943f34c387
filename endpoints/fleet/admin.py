"""The fleet in the Django admin: read-only; cordon, drain and uncordon go through `set_node_state`, retire
through `retire_node` (as pools retire their machines);
node pools are created, changed and deleted through `pool_services` (the API's and console's rules),
their launches only shown (`endpoints.fleet.launches` owns them).

Registered by `endpoints.admin` (Django looks for admin modules in apps only, and the nodes' app,
`endpoints.nodes`, holds records and nothing that acts on them)."""

from django import forms
from django.contrib import admin, messages
from django.urls import reverse
from django.utils.html import format_html

from controlplane.accounts.admin import ReadOnlyAdmin
from controlplane.accounts.second_factor import has_staff_powers
from controlplane.accounts.services import Actor
from controlplane.accounts.stale_edits import LocksEditedRow, RefusesStaleEdits
from endpoints.fleet import pool_services
from endpoints.fleet.services import NodeStateRefused, retire_node, set_node_state
from endpoints.nodes.models import LIVE_LAUNCH_STATES, Node, NodeLaunch, NodePool
from gpu_agent.protocol import NodeState


@admin.register(Node)
class NodeAdmin(ReadOnlyAdmin):
    list_display = [
        "name", "gpu_type", "num_gpus", "gpu_memory_mb", "state", "last_heartbeat_at", "agent_version", "engine_sandbox"
    ]
    list_filter = ["state", "gpu_type"]
    search_fields = ["name"]
    exclude = ["secret_lookup", "secret_digest"]
    actions = ["cordon", "drain", "uncordon", "retire"]

    def get_readonly_fields(self, request, obj=None):
        return [name for name in super().get_readonly_fields(request, obj) if name not in self.exclude]

    def _set_state(self, request, queryset, state: NodeState) -> None:
        refused = []
        for node in queryset:
            try:
                set_node_state(Actor.from_request(request), node, state)
            except NodeStateRefused as refusal:
                refused.append(str(refusal))
        self.message_user(request, f"{queryset.count() - len(refused)} node(s) now {state.value.lower()} "
                                   "(an offline one once its agent beats again).", messages.SUCCESS)
        for refusal in refused:
            self.message_user(request, f"Nothing changed: {refusal}.", messages.WARNING)

    @admin.action(description="Cordon selected nodes (no new replicas)", permissions=["cordon"])
    def cordon(self, request, queryset):
        self._set_state(request, queryset, NodeState.CORDONED)

    @admin.action(description="Drain selected nodes (move replicas away)", permissions=["drain"])
    def drain(self, request, queryset):
        self._set_state(request, queryset, NodeState.DRAINING)

    @admin.action(description="Uncordon selected nodes", permissions=["uncordon"])
    def uncordon(self, request, queryset):
        self._set_state(request, queryset, NodeState.READY)

    @admin.action(description="Retire selected nodes (void their secrets, revoke join tokens no other node uses)",
                  permissions=["retire"])
    def retire(self, request, queryset):
        # NOTE: for a node that joined by hand, as pools retire theirs: a stolen or misbehaving machine is cut
        # off, its replicas failed and replaced elsewhere, and its agent told so stops for good (`protocol.NODE_RETIRED`).
        # The machine still holds its join token (an older agent, or the machine set up afresh, registers again with
        # it) unless that is revoked too (`retire_node`); a token other nodes share must be rotated, and staff are told.
        retirements = [retire_node(Actor.from_request(request), node, reason=f"retired by {request.user}")
                       for node in queryset]
        self.message_user(request, f"{sum(r.retired for r in retirements)} node(s) retired.", messages.SUCCESS)
        for retirement in retirements:
            if retirement.revoked_join_token is not None:
                self.message_user(request, f"Join token “{retirement.revoked_join_token.name}”, which no other node "
                                           "joined with, was revoked.", messages.SUCCESS)
        revoked = {r.revoked_join_token.pk for r in retirements if r.revoked_join_token is not None}
        open_tokens = {r.open_join_token.pk: r for r in retirements
                       if r.open_join_token is not None and r.open_join_token.pk not in revoked}
        for retirement in open_tokens.values():
            self.message_user(request, format_html(
                "Join token “{}” still admits machines: {} other node(s) joined with it. Until it is rotated "
                "(<a href=\"{}\">fleet page</a>, Join tokens, Rotate), a retired node's machine can register "
                "with it again as a new node.",
                retirement.open_join_token.name, retirement.num_other_nodes,
                reverse("console:fleet") + "#tokens-title"), messages.WARNING)

    def has_cordon_permission(self, request):
        return has_staff_powers(request.user)  # as the console's fleet pages

    has_drain_permission = has_uncordon_permission = has_retire_permission = has_cordon_permission


class NodePoolAdminForm(RefusesStaleEdits, forms.ModelForm):
    """The admin's form for a pool; its rules are `pool_services.node_pool_errors`."""

    class Meta:
        model = NodePool
        fields = list(pool_services.POOL_FIELDS)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for name in ("gpus_per_node", "gpu_memory_mb"):  # empty: from the GPU type
            self.fields[name].required = False

    def _post_clean(self):
        # NOTE: no model validation or assignment to the instance: the services validate and save.
        pass

    def pool_fields(self) -> dict:
        pool = self.instance if self.instance.pk else None
        fields = {name: value for name, value in self.cleaned_data.items() if value is not None}
        if pool is not None:
            fields = {name: value for name, value in fields.items() if value != getattr(pool, name)}
        return fields

    def clean(self):
        cleaned = super().clean()
        if not self.errors:
            errors = pool_services.node_pool_errors(self.pool_fields(), self.instance if self.instance.pk else None)
            for name, problems in errors.items():
                field, _, template_field = name.partition(".")
                for problem in problems:
                    self.add_error(field if field in self.fields else None,
                                   f"{template_field}: {problem}" if template_field else problem)
        return cleaned


@admin.register(NodePool)
class NodePoolAdmin(LocksEditedRow, admin.ModelAdmin):
    form = NodePoolAdminForm
    list_display = ["name", "gpu_type", "provider", "min_nodes", "warm_nodes", "max_nodes", "idle_timeout_s", "hourly_price"]
    list_filter = ["provider", "gpu_type"]
    search_fields = ["name"]

    def save_model(self, request, obj, form, change):
        actor = Actor.from_request(request)
        if change:
            pool_services.update_node_pool(actor, NodePool.objects.get(pk=obj.pk), **form.pool_fields())
        else:
            created = pool_services.create_node_pool(actor, **form.pool_fields())
            obj.pk, obj.name, obj._state.adding = created.pk, created.name, False
        obj.refresh_from_db()

    def has_delete_permission(self, request, obj=None):
        if obj is not None and NodeLaunch.objects.filter(pool=obj, state__in=LIVE_LAUNCH_STATES).exists():
            return False  # its machines are paid for: released first (pool_services.delete_node_pool)
        return super().has_delete_permission(request, obj)

    def delete_model(self, request, obj):
        pool_services.delete_node_pool(Actor.from_request(request), obj)

    def delete_queryset(self, request, queryset):
        for pool in queryset:
            try:
                pool_services.delete_node_pool(Actor.from_request(request), pool)
            except pool_services.PoolInUse as exc:
                self.message_user(request, str(exc), messages.ERROR)


@admin.register(NodeLaunch)
class NodeLaunchAdmin(ReadOnlyAdmin):
    list_display = ["pool", "state", "provider_id", "node", "requested_at", "joined_at", "terminated_at", "reason"]
    list_filter = ["state", "pool"]
    search_fields = ["provider_id", "pool__name"]
