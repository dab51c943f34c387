"""Staff tools for endpoints: prices per endpoint are edited here (defaults come from the GPU catalogue),
and the public model catalogue (sources the fleet's own credentials may read) is managed here."""

from django.contrib import admin

from controlplane.accounts.admin import ReadOnlyAdmin
from controlplane.accounts.services import Actor, record_audit
from controlplane.accounts.stale_edits import LocksEditedRow, StaleEditsRefusedForm
from endpoints import services
from endpoints.adapters import ADAPTER_PRICE_FIELDS
from endpoints.fleet import admin as fleet_admin  # noqa: F401 - registers the nodes' admin
from endpoints.models import Adapter, AllowedSource, Endpoint, EndpointEvent, ModelCredential, Replica


@admin.register(AllowedSource)
class AllowedSourceAdmin(LocksEditedRow, admin.ModelAdmin):
    """The public catalogue. NOTE: a source added here is read with the fleet's own credentials for
    every organisation, and its cached copy is shared: add only models that are public."""

    form = StaleEditsRefusedForm
    list_display = ["pattern", "description", "created_at"]
    search_fields = ["pattern", "description"]
    fields = ["pattern", "description"]

    def save_model(self, request, obj, form, change):
        super().save_model(request, obj, form, change)
        # NOTE: with what a change changed: a pattern widened ("hf:public/*" to "hf:*") lets every organisation read
        # any model with the fleet's credentials, and its event named only the new pattern.
        changes = {name: {"from": form.initial.get(name), "to": form.cleaned_data[name]} for name in form.changed_data}
        record_audit(Actor.from_request(request), None, "catalogue.update" if change else "catalogue.add", obj,
                     **({"changes": changes} if change else {}))

    def delete_model(self, request, obj):
        record_audit(Actor.from_request(request), None, "catalogue.remove", obj)
        super().delete_model(request, obj)

    def delete_queryset(self, request, queryset):
        for obj in queryset:
            self.delete_model(request, obj)


@admin.register(ModelCredential)
class ModelCredentialAdmin(ReadOnlyAdmin):
    """Read-only for staff: which organisation holds which credential, never its secrets."""

    list_display = ["name", "organization", "kind", "created_at", "last_used_at"]
    list_filter = ["kind"]
    search_fields = ["name", "organization__slug"]
    list_select_related = ["organization"]
    fields = ["name", "organization", "kind", "access_key_id", "role_arn", "external_id", "region", "endpoint_url",
              "secret_fields", "created_by", "created_at", "updated_at", "last_used_at"]


@admin.register(Endpoint)
class EndpointAdmin(LocksEditedRow, admin.ModelAdmin):
    form = StaleEditsRefusedForm
    list_display = ["name", "organization", "task", "gpu_type", "quantization", "min_replicas", "max_replicas",
                    "price_input_per_million", "price_cached_input_per_million", "price_output_per_million",
                    "paused_at", "deleted_at"]
    list_filter = ["task", "gpu_type", "quantization"]
    search_fields = ["name", "organization__slug", "model_source"]
    list_select_related = ["organization"]
    # NOTE: staff edit prices only; the spec goes through the API's validation (serializers) instead.
    fields = ["name", "organization", "model_source", "task", "gpu_type", "quantization", "gpus_per_replica", "allow_gpu_sharing",
              "price_input_per_million", "price_cached_input_per_million", "price_output_per_million",
              "batch_price_fraction", "prompt_factor"]
    readonly_fields = ["name", "organization", "model_source", "task", "gpu_type", "quantization", "gpus_per_replica",
                       "allow_gpu_sharing", "prompt_factor"]
    actions = ["reset_prompt_factor"]

    @admin.display(description="prompt factor (learned)")
    def prompt_factor(self, obj):
        """What its prompt bounds are multiplied by since a prompt ran past them (`PromptFactor`); "-": none."""
        factor = obj.prompt_factor
        return "-" if factor is None else f"{factor.normalize()}×"

    @admin.action(description="Reset the learned prompt factor (reserve prompts as estimated again)")
    def reset_prompt_factor(self, request, queryset):
        actor = Actor.from_request(request)
        cleared = sum(services.reset_prompt_factor(actor, endpoint) for endpoint in queryset)
        self.message_user(request, f"{cleared} prompt factor(s) cleared.")

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    def save_model(self, request, obj, form, change):
        services.set_prices(Actor.from_request(request), obj,
                            **{name: form.cleaned_data[name] for name in services.ENDPOINT_PRICE_FIELDS})


@admin.register(Adapter)
class AdapterAdmin(LocksEditedRow, admin.ModelAdmin):
    form = StaleEditsRefusedForm
    list_display = ["name", "endpoint", "state", "price_input_per_million", "price_output_per_million", "created_at"]
    list_filter = ["state"]
    search_fields = ["name", "endpoint__name", "endpoint__organization__slug"]
    list_select_related = ["endpoint"]
    # NOTE: staff price adapters (empty: the endpoint's prices); tenants create and delete them through the API.
    fields = ["name", "endpoint", "source", "rank", "state", "price_input_per_million", "price_output_per_million"]
    readonly_fields = ["name", "endpoint", "source", "rank", "state"]

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    def save_model(self, request, obj, form, change):
        services.set_prices(Actor.from_request(request), obj,
                            **{name: form.cleaned_data[name] for name in ADAPTER_PRICE_FIELDS})


@admin.register(Replica)
class ReplicaAdmin(admin.ModelAdmin):
    list_display = ["id", "endpoint", "node", "state", "state_changed_at", "failure_reason"]
    list_filter = ["state"]
    list_select_related = ["endpoint", "node"]
    # The engine key stays out of every page, even encrypted.
    exclude = ["encrypted_engine_key"]
    readonly_fields = [field.name for field in Replica._meta.fields if field.name != "encrypted_engine_key"]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        # NOTE: every field is read-only, yet saving its page wrote the whole row back as the save had read it: a state
        # its agent reported in between (FAILED, STOPPED) was undone, past `endpoints.replicas`, which owns every change.
        return False

    def has_delete_permission(self, request, obj=None):
        return False  # NOTE: its rows are the record of the GPU-seconds counted (`billing.cost_truth`)


@admin.register(EndpointEvent)
class EndpointEventAdmin(ReadOnlyAdmin):
    """The customer's endpoint log: staff read it, never write in it or take from it."""

    list_display = ["created_at", "endpoint", "kind", "message"]
    list_filter = ["kind"]
