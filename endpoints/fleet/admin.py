"""The fleet in the Django admin: read-only; cordon, drain and uncordon go through `set_node_state`.

Registered by `endpoints.admin` (Django looks for admin modules in apps only, and the nodes' app,
`endpoints.nodes`, holds records and nothing that acts on them)."""

from django.contrib import admin, messages

from controlplane.accounts.admin import ReadOnlyAdmin
from controlplane.accounts.services import Actor
from endpoints.fleet.services import set_node_state
from endpoints.nodes.models import Node
from gpu_agent.protocol import NodeState


@admin.register(Node)
class NodeAdmin(ReadOnlyAdmin):
    list_display = ["name", "gpu_type", "num_gpus", "gpu_memory_mb", "state", "last_heartbeat_at", "agent_version"]
    list_filter = ["state", "gpu_type"]
    search_fields = ["name"]
    exclude = ["secret_lookup", "secret_digest"]
    actions = ["cordon", "drain", "uncordon"]

    def get_readonly_fields(self, request, obj=None):
        return [name for name in super().get_readonly_fields(request, obj) if name not in self.exclude]

    def _set_state(self, request, queryset, state: NodeState) -> None:
        for node in queryset:
            set_node_state(Actor.from_request(request), node, state)
        self.message_user(request, f"{queryset.count()} node(s) now {state.value.lower()}.", messages.SUCCESS)

    @admin.action(description="Cordon selected nodes (no new replicas)")
    def cordon(self, request, queryset):
        self._set_state(request, queryset, NodeState.CORDONED)

    @admin.action(description="Drain selected nodes (move replicas away)")
    def drain(self, request, queryset):
        self._set_state(request, queryset, NodeState.DRAINING)

    @admin.action(description="Uncordon selected nodes")
    def uncordon(self, request, queryset):
        self._set_state(request, queryset, NodeState.READY)

    def has_cordon_permission(self, request):
        return request.user.is_staff  # as the console's fleet pages

    has_drain_permission = has_uncordon_permission = has_cordon_permission
