"""Staff tools for endpoints: prices per endpoint are edited here (defaults come from the GPU catalogue)."""

from django.contrib import admin

from endpoints.models import Endpoint, EndpointEvent, Replica


@admin.register(Endpoint)
class EndpointAdmin(admin.ModelAdmin):
    list_display = ["name", "organization", "gpu_type", "quantization", "min_replicas", "max_replicas",
                    "price_input_per_million", "price_cached_input_per_million", "price_output_per_million",
                    "paused_at", "deleted_at"]
    list_filter = ["gpu_type", "quantization"]
    search_fields = ["name", "organization__slug", "model_source"]
    list_select_related = ["organization"]
    # NOTE: staff edit prices only; the spec goes through the API's validation (serializers) instead.
    fields = ["name", "organization", "model_source", "gpu_type", "quantization",
              "price_input_per_million", "price_cached_input_per_million", "price_output_per_million"]
    readonly_fields = ["name", "organization", "model_source", "gpu_type", "quantization"]

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(Replica)
class ReplicaAdmin(admin.ModelAdmin):
    list_display = ["id", "endpoint", "node", "state", "state_changed_at", "failure_reason"]
    list_filter = ["state"]
    list_select_related = ["endpoint", "node"]
    readonly_fields = [field.name for field in Replica._meta.fields]

    def has_add_permission(self, request):
        return False


@admin.register(EndpointEvent)
class EndpointEventAdmin(admin.ModelAdmin):
    list_display = ["created_at", "endpoint", "kind", "message"]
    list_filter = ["kind"]
    readonly_fields = [field.name for field in EndpointEvent._meta.fields]
