"""The deploy wizard's form: it renders the spec; `EndpointSerializer` validates it (the rules live there)."""

import json

from django import forms
from django.conf import settings

from controlplane.accounts.forms import SerializerBackedForm
from controlplane.plain_numbers import plain_int
from endpoints.catalogue import AUTO_PARSER, GPU_TYPES, GPUS_PER_REPLICA, QUANTIZATIONS, TOOL_CALL_PARSERS
from endpoints.models import CredentialKind, Endpoint, ModelCredential
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
    credential = forms.ChoiceField(
        label="Credential", required=False, choices=[],
        help_text="Your organisation's S3 or Hugging Face credential for this source. None: the platform's "
                  "public catalogue, or an anonymous read.",
    )
    task = forms.ChoiceField(
        label="Task", required=False,
        choices=[("auto", "Automatic (from the model's config)"), ("generate", "Generate text (chat, completions, responses)"),
                 ("embed", "Embeddings (/v1/embeddings)")],
        help_text="An embedding endpoint serves /v1/embeddings, billed as input tokens at the input price.",
    )
    gpu_type = forms.ChoiceField(
        label="GPU type", required=False, choices=[(name, gpu.label) for name, gpu in GPU_TYPES.items()],
        widget=forms.RadioSelect,
    )
    quantization = forms.ChoiceField(
        label="Quantization", required=False, choices=[(name, name) for name in QUANTIZATIONS],
    )
    gpus_per_replica = forms.ChoiceField(
        label="GPUs per replica", required=False,
        choices=[("", "Automatic: the fewest that hold the model")] + [(str(n), str(n)) for n in GPUS_PER_REPLICA],
        help_text="Whole GPUs of one node; more than one runs the model tensor parallel.",
    )
    allow_gpu_sharing = forms.BooleanField(
        label="Share GPUs", required=False,
        help_text="One-GPU replicas may share a GPU with others, each held to its share of its memory.",
    )
    min_replicas = _number("Minimum replicas", "0 lets the endpoint scale to zero when idle.", min=0)
    max_replicas = _number("Maximum replicas", "Upper bound while scaling out.", min=1)
    idle_timeout_s = _number("Idle timeout (seconds)", "No requests for this long and it scales down.", min=LIMITS["idle_timeout_s"][0])
    idle_action = forms.ChoiceField(
        label="When idle", required=False,
        choices=[("stop", "Stop the replica"), ("sleep", "Sleep (GPU nodes: wakes in about a second, billed as zero)")],
        help_text="At the idle timeout a replica stops, or on a GPU node sleeps with its weights in host memory; "
                  "a long sleep stops it too. CPU nodes always stop.",
    )
    target_concurrency = _number("Target concurrency", "In-flight requests per replica before scaling out.", min=1)
    max_model_len = _number("Max model length (tokens)", "Prompt plus completion. Empty: the model's own context length.", min=LIMITS["max_model_len"][0])
    max_num_seqs = _number("Max sequences per batch", "Continuous-batching limit per replica.", min=1)
    max_num_batched_tokens = _number("Max batched tokens", "Optional; the engine picks when empty.")
    cold_start_timeout_s = _number("Cold-start timeout (seconds)", "How long a call waits for a replica to start.", min=LIMITS["cold_start_timeout_s"][0])
    prewarm_windows = forms.CharField(
        label="Pre-warm windows", required=False,
        help_text="One per line: a cron schedule (5 fields), a time zone, minutes open, replicas. "
                  "E.g. “0 9 * * 1-5 Europe/Paris 600 2”: two replicas from 09:00 Paris time, weekdays, for ten hours.",
        widget=forms.Textarea(attrs={"rows": 2, "spellcheck": "false", "placeholder": "0 9 * * 1-5 Europe/Paris 600 2"}),
    )
    keep_warm_after_cold_start_s = _number(
        "Keep warm after a cold start (seconds)", "After a replica starts, keep one this long even when idle. 0: off.", min=0,
    )
    enable_prefix_caching = forms.BooleanField(label="Prefix caching", required=False, help_text="Reuse the KV cache of shared prompt prefixes.")
    tool_call_parser = forms.ChoiceField(
        label="Tool-call parser", required=False,
        choices=[(AUTO_PARSER, "Automatic (from the model's family)"), ("", "None (tool calling off)")]
        + [(name, name) for name in TOOL_CALL_PARSERS],
        help_text="How the engine reads tool calls in the model's output, for `tools` in chat completions.",
    )

    speculative_method = forms.ChoiceField(
        label="Speculative decoding", required=False,
        choices=[("none", "Off"), ("ngram", "Prompt lookup (n-gram)"), ("draft", "Draft model")],
        help_text="Guess several tokens ahead and let the model check them in one step: same output, faster when "
                  "guesses land (prompt lookup for outputs that repeat the prompt, such as edits; a draft model "
                  "of the same tokenizer otherwise).",
    )
    num_speculative_tokens = _number("Tokens guessed per step", "1–16.", min=1, max=16)
    prompt_lookup_max = _number("Prompt lookup: longest match", "Tokens, 1–16.", min=1, max=16)
    prompt_lookup_min = _number("Prompt lookup: shortest match", "Tokens, at least 1.", min=1, max=16)
    draft_model_source = forms.CharField(
        label="Draft model source", required=False,
        help_text="A small model with the same tokenizer (hf:, s3:// or a local path), read with the credential above.",
        widget=forms.TextInput(attrs={"placeholder": "hf:meta-llama/Llama-3.2-1B-Instruct", "spellcheck": "false"}),
    )

    def __init__(self, *args, gpu_type: str | None = None, organization=None, **kwargs):
        super().__init__(*args, **kwargs)
        chosen = self.data.get("gpu_type") if self.is_bound else None
        self.set_gpu_type(chosen or gpu_type or self.initial.get("gpu_type"))
        # NOTE: only the organisation's own credentials are offered (the serializer checks it again).
        owned = ModelCredential.objects.filter(organization=organization) if organization is not None else []
        if not settings.SLEEP_MODE:  # the platform's sleep mode is off: the API refuses "sleep", the form omits it
            del self.fields["idle_action"]
        self.fields["credential"].choices = [("", "None")] + [
            (str(credential.pk), f"{credential.name} ({credential.kind})") for credential in owned
        ]

    def serializer_data(self, post):
        """The windows' lines become the list the API takes (a line that does not parse keeps its
        text as the schedule, so the API's message names what is missing)."""
        data = super().serializer_data(post)
        if "prewarm_windows" in data:
            data["prewarm_windows"] = json.dumps([_window_from_line(line) for line in
                                                  data["prewarm_windows"].splitlines() if line.strip()])
        return data

    def set_gpu_type(self, name: str | None) -> None:
        """Offer only the quantizations an engine on this GPU type supports."""
        gpu = GPU_TYPES.get(name or "")
        allowed = gpu.quantizations if gpu else tuple(QUANTIZATIONS)

        def label(q: str) -> str:  # what it means on this GPU's generation, then the value in general
            mode = gpu.quantization_mode(q) if gpu and q != "none" else ""
            return f"{q} — {mode} here. {QUANTIZATIONS[q]}" if mode else f"{q} — {QUANTIZATIONS[q]}"

        self.fields["quantization"].choices = [(q, label(q)) for q in allowed]

    @classmethod
    def initial_for(cls, endpoint=None) -> dict:
        if endpoint is not None:
            values = {name: getattr(endpoint, name) for name in cls.base_fields if name != "credential"}
            return values | {"credential": str(endpoint.credential_id or ""),
                             "prewarm_windows": "\n".join(window_line(w) for w in endpoint.prewarm_windows)}
        defaults = {name: Endpoint._meta.get_field(name).get_default() for name in cls.base_fields}
        return defaults | {"gpu_type": "l4", "name": "", "model_source": "", "credential": "", "tool_call_parser": AUTO_PARSER,
                           "gpus_per_replica": "", "prewarm_windows": ""}


def window_line(window: dict) -> str:
    """A pre-warm window as the form's line: schedule, time zone, minutes, replicas."""
    return f"{window['schedule']} {window['timezone']} {window['duration_minutes']} {window['min_replicas']}"


def _window_from_line(line: str) -> dict:
    tokens = line.split()
    if len(tokens) != 8:
        return {"schedule": line.strip()}
    *schedule, zone, minutes, replicas = tokens

    def number(text: str):
        value = plain_int(text)
        return text if value is None else value  # the API's own check says what is wrong with it

    return {"schedule": " ".join(schedule), "timezone": zone, "duration_minutes": number(minutes),
            "min_replicas": number(replicas)}


def _secret_input(label: str, help_text: str) -> forms.CharField:
    # NOTE: never rendered back (render_value=False): a secret typed once is not in any page after.
    return forms.CharField(label=label, required=False, help_text=help_text,
                           widget=forms.PasswordInput(render_value=False, attrs={"autocomplete": "new-password"}))


class CredentialForm(SerializerBackedForm):
    """Renders the credential form; `CredentialSerializer` validates it."""

    name = forms.CharField(label="Name", required=False, help_text="Lowercase letters, digits and hyphens, e.g. “prod-bucket”.")
    kind = forms.ChoiceField(label="Kind", required=False, choices=CredentialKind.choices)
    access_key_id = forms.CharField(label="Access key id", required=False, help_text="S3 only. Shown back.")
    secret_access_key = _secret_input("Secret access key", "S3 only. Stored encrypted, never shown again.")
    session_token = _secret_input("Session token", "S3 temporary keys only.")
    role_arn = forms.CharField(label="Role ARN", required=False,
                               help_text="S3 only, instead of keys: a role in your own AWS account, which we assume "
                                         "with the external id shown after saving.")
    region = forms.CharField(label="Region", required=False, widget=forms.TextInput(attrs={"placeholder": "us-east-1"}))
    endpoint_url = forms.CharField(label="Endpoint URL", required=False,
                                   help_text="An S3-compatible store's https address; empty for AWS S3.")
    hf_token = _secret_input("Hugging Face token", "Hugging Face only. Stored encrypted, never shown again.")

    SECRETS = ("secret_access_key", "session_token", "hf_token")

    def serializer_data(self, post):
        """Empty inputs mean "unchanged": a blank secret box never erases a stored secret."""
        data = super().serializer_data(post)
        for name in self.SECRETS:
            if name in data and not data.get(name):
                data.pop(name)
        return data
