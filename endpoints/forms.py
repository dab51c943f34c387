"""The deploy wizard's form: it renders the spec; `EndpointSerializer` validates it (the rules live there)."""

from django import forms

from controlplane.forms import SerializerBackedForm
from endpoints.catalogue import GPU_TYPES, QUANTIZATIONS
from endpoints.serializers import LIMITS


def _number(label: str, help_text: str = "", **attrs) -> forms.CharField:
    # NOTE: a CharField, so that a bad value reaches the serializer and its message is the one shown.
    return forms.CharField(label=label, required=False, help_text=help_text, widget=forms.NumberInput(attrs=attrs))


class EndpointForm(SerializerBackedForm):
    name = forms.CharField(
        label="Endpoint name", required=False,
        help_text="Clients pass it as the model name. Lowercase letters, digits and hyphens.",
        widget=forms.TextInput(attrs={"placeholder": "support-chat", "autocomplete": "off", "spellcheck": "false"}),
    )
    model_source = forms.CharField(
        label="Model source", required=False,
        help_text="hf:org/name[@revision] from Hugging Face, s3://bucket/prefix, or a local path on the GPU nodes.",
        widget=forms.TextInput(attrs={"placeholder": "hf:meta-llama/Llama-3.1-8B-Instruct", "spellcheck": "false"}),
    )
    gpu_type = forms.ChoiceField(
        label="GPU type", required=False, choices=[(name, gpu.label) for name, gpu in GPU_TYPES.items()],
        widget=forms.RadioSelect,
    )
    quantization = forms.ChoiceField(
        label="Quantization", required=False, choices=[(name, name) for name in QUANTIZATIONS],
    )
    min_replicas = _number("Minimum replicas", "0 lets the endpoint scale to zero when idle.", min=0)
    max_replicas = _number("Maximum replicas", "Upper bound while scaling out.", min=1)
    idle_timeout_s = _number("Idle timeout (seconds)", "No requests for this long and it scales down.", min=LIMITS["idle_timeout_s"][0])
    target_concurrency = _number("Target concurrency", "In-flight requests per replica before scaling out.", min=1)
    max_model_len = _number("Max model length (tokens)", "Prompt plus completion.", min=LIMITS["max_model_len"][0])
    max_num_seqs = _number("Max sequences per batch", "Continuous-batching limit per replica.", min=1)
    max_num_batched_tokens = _number("Max batched tokens", "Optional; the engine picks when empty.")
    cold_start_timeout_s = _number("Cold-start timeout (seconds)", "How long a call waits for a replica to start.", min=LIMITS["cold_start_timeout_s"][0])
    enable_prefix_caching = forms.BooleanField(label="Prefix caching", required=False, help_text="Reuse the KV cache of shared prompt prefixes.")

    SECTIONS = (
        ("Model", ("name", "model_source")),
        ("Hardware", ("gpu_type", "quantization")),
        ("Scaling", ("min_replicas", "max_replicas", "idle_timeout_s", "target_concurrency")),
        ("Limits", ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "cold_start_timeout_s", "enable_prefix_caching")),
    )

    def __init__(self, *args, gpu_type: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        chosen = self.data.get("gpu_type") if self.is_bound else None
        self.set_gpu_type(chosen or gpu_type or self.initial.get("gpu_type"))

    def set_gpu_type(self, name: str | None) -> None:
        """Offer only the quantizations an engine on this GPU type supports."""
        gpu = GPU_TYPES.get(name or "")
        allowed = gpu.quantizations if gpu else tuple(QUANTIZATIONS)
        self.fields["quantization"].choices = [(q, f"{q} — {QUANTIZATIONS[q]}") for q in allowed]

    def sections(self):
        return [(title, [self[name] for name in names]) for title, names in self.SECTIONS]

    @classmethod
    def initial_for(cls, endpoint=None) -> dict:
        from endpoints.models import Endpoint

        if endpoint is not None:
            return {name: getattr(endpoint, name) for name in cls.base_fields}
        defaults = {name: Endpoint._meta.get_field(name).get_default() for name in cls.base_fields}
        return defaults | {"gpu_type": "l4", "name": "", "model_source": ""}
