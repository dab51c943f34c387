"""The node pool form of the fleet page (and the Django admin): it parses; `pool_services` judges.

Field types are checked here (a number, a JSON object); every rule of a pool, including the
provider's template fields, is `pool_services.pool_errors`, shown next to the field it names (a
template field's error on the template box, prefixed by the field).
"""

from __future__ import annotations

import json

from django import forms

from controlplane import parsers
from controlplane.accounts.stale_edits import RefusesStaleEdits
from endpoints.catalogue import GPU_TYPES
from endpoints.fleet import pool_services
from endpoints.nodes.models import NodePool, PoolProvider


class JsonObjectField(forms.CharField):
    widget = forms.Textarea(attrs={"rows": 6, "spellcheck": "false", "class": "mono"})

    def prepare_value(self, value):
        return value if isinstance(value, str) else json.dumps(value or {}, indent=2, sort_keys=True)

    def to_python(self, value):
        text = (value or "").strip() or "{}"
        try:
            parsed = parsers.loads(text)
        except ValueError as exc:
            raise forms.ValidationError(f"Not valid JSON: {exc}") from None
        if not isinstance(parsed, dict):
            raise forms.ValidationError("A JSON object ({…}) of the provider's template fields.")
        return parsed


class NodePoolForm(RefusesStaleEdits, forms.Form):
    name = forms.CharField(label="Name", max_length=63, help_text="Lowercase letters, digits and hyphens, e.g. “l4-spot”.")
    gpu_type = forms.ChoiceField(label="GPU type", choices=[(gpu.name, gpu.label) for gpu in GPU_TYPES.values()])
    provider = forms.ChoiceField(label="Provider", choices=PoolProvider.choices)
    template = JsonObjectField(label="Machine template (JSON)", required=False,
                               help_text="The provider's fields: local agent options, an EC2 launch template and "
                                         "subnets, a Kubernetes node selector and GPU resource.")
    gpus_per_node = forms.IntegerField(label="GPUs per machine", required=False, min_value=0,
                                       help_text="Empty: 1 (0 for CPU machines).")
    gpu_memory_mb = forms.IntegerField(label="Memory per GPU (MiB)", required=False, min_value=0,
                                       help_text="Empty: the GPU type's, from the catalogue.")
    min_nodes = forms.IntegerField(label="Min machines", min_value=0, initial=0)
    warm_nodes = forms.IntegerField(label="Warm empty machines", min_value=0, initial=0)
    max_nodes = forms.IntegerField(label="Max machines", min_value=0, initial=1)
    idle_timeout_s = forms.IntegerField(label="Idle timeout (s)", min_value=1, initial=600,
                                        help_text="An empty machine is released after this long.")
    join_deadline_s = forms.IntegerField(label="Join deadline (s)", min_value=1, initial=600,
                                         help_text="A machine not registered by then is replaced.")
    hourly_price = forms.DecimalField(label="Price per machine-hour (USD)", min_value=0, max_digits=10,
                                      decimal_places=4, initial=0)

    def __init__(self, *args, pool: NodePool | None = None, **kwargs):
        if pool is not None and "initial" not in kwargs:
            kwargs["initial"] = {name: getattr(pool, name) for name in pool_services.POOL_FIELDS}
        super().__init__(*args, **kwargs)
        self.pool = pool

    def pool_fields(self) -> dict:
        """The cleaned values for the services (call after `is_valid()`); empty optional numbers left out."""
        fields = {name: value for name, value in self.cleaned_data.items() if value is not None}
        if self.pool is not None:  # an edit sends only what changed
            fields = {name: value for name, value in fields.items() if value != getattr(self.pool, name)}
        return fields

    def show_errors(self, errors: dict[str, list[str]]) -> None:
        for name, messages in errors.items():
            field, _, template_field = name.partition(".")
            for message in messages:
                if template_field and field == "template":
                    self.add_error("template", f"{template_field}: {message}")
                else:
                    self.add_error(field if field in self.fields else None, message)

    def save(self, actor) -> NodePool | None:
        """Create or update through the services; None (with the errors on the form) when refused."""
        if not self.is_valid():
            return None
        try:
            if self.pool is None:
                return pool_services.create_node_pool(actor, **self.pool_fields())
            return pool_services.update_node_pool(actor, self.pool, **self.pool_fields())
        except pool_services.PoolInvalid as exc:
            self.show_errors(exc.errors)
            return None
