"""Shapes of the endpoints API. Validation of an endpoint spec lives here, once, for API and console."""

import functools
import ipaddress
import re
import socket
from urllib.parse import urlsplit

from django.conf import settings
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from controlplane import parsers
from controlplane.accounts.models import Role
from controlplane.accounts.serializers import AddressField, StrictModelSerializer, StrictSerializer
from controlplane.accounts.tenancy import request_membership
from controlplane.text import is_plain
from endpoints import prewarm, quotas, speculative
from endpoints.adapters import (
    ADAPTER_NAME_TAKEN,
    ADAPTER_NAMED_AS_ENDPOINT,
    ENDPOINT_NAMED_AS_ADAPTER,
    MAX_ADAPTERS,
    TOO_MANY_ADAPTERS,
)
from endpoints.catalogue import (
    AUTO_PARSER,
    GPU_TYPES,
    GPUS_PER_REPLICA,
    QUANTIZATIONS,
    TOOL_CALL_PARSERS,
    default_tool_call_parser,
)
from endpoints.credentials import (
    CREDENTIAL_NAME_TAKEN,
    PUBLIC_FIELDS,
    SECRETS_OF_KIND,
    RoleNotAllowed,
    build_source_credentials,
    check_role_arn,
)
from endpoints.models import (
    Adapter,
    CredentialKind,
    Endpoint,
    EndpointEvent,
    IdleAction,
    ModelCredential,
    ModelFacts,
    Replica,
    source_kind,
    weights_scope_for,
)
from endpoints.placement import memory_needed_mb, smallest_gpu_count
from endpoints.services import ENDPOINT_NAME_TAKEN
from gpu_agent.protocol import (
    ModelTask,
    SpeculativeMethod,
    checkpoint_quantization_problem,
    is_public_address,
)

HF_SOURCE = re.compile(r"^hf:[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}(@[A-Za-z0-9._/-]{1,100})?$")
S3_SOURCE = re.compile(r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^\s]*)?$")
NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")

LIMITS = {
    "min_replicas": (0, 100),
    "max_replicas": (1, 100),
    "idle_timeout_s": (30, 86_400),
    "target_concurrency": (1, 1024),
    "max_model_len": (16, 1_048_576),
    "max_num_seqs": (1, 4096),
    "max_num_batched_tokens": (16, 1_048_576),
    "cold_start_timeout_s": (10, 3600),
    "keep_warm_after_cold_start_s": (0, 86_400),
    "max_loras": (0, 64),
}

# The ranks vLLM accepts as --max-lora-rank.
LORA_RANKS = (8, 16, 32, 64, 128, 256)


def validate_model_source(value: str) -> str:
    value = value.strip()
    # NOTE: an s3:// key or a local path took any character but whitespace: an escape sequence in one reached the
    # agent's log ("fetching …") and ran in the terminal of the operator reading it.
    if not is_plain(value):
        raise serializers.ValidationError("No control characters.")
    if value.startswith("hf:"):
        if not HF_SOURCE.match(value):
            raise serializers.ValidationError("Use hf:org/name or hf:org/name@revision.")
    elif value.startswith("s3://"):
        if not S3_SOURCE.match(value):
            raise serializers.ValidationError("Use s3://bucket/prefix with a valid bucket name.")
    elif value.startswith("/"):
        if not settings.ALLOW_LOCAL_MODEL_PATHS:
            raise serializers.ValidationError("Local model paths are disabled on this platform; use hf: or s3://.")
        if ".." in value.split("/"):
            raise serializers.ValidationError("A local path may not contain '..'.")
    else:
        raise serializers.ValidationError("Must start with hf:, s3:// or / (a local path).")
    return value


def validate_unique_name(value: str, siblings, instance, taken: str) -> str:
    """A slug-like name, unique among `siblings` (the organisation's objects of that kind); `taken` says it is not."""
    if not NAME.match(value):
        raise serializers.ValidationError(
            "Use 1-63 lowercase letters, digits and hyphens, starting and ending with a letter or digit."
        )
    clash = siblings.filter(name=value)
    if instance is not None:
        clash = clash.exclude(pk=instance.pk)
    if clash.exists():
        raise serializers.ValidationError(taken)
    return value


# The fields a replica's GPU needs depend on: an update that touches none of them is not checked again.
GPU_SPEC_FIELDS = frozenset(
    {"model_source", "gpu_type", "quantization", "max_model_len", "max_num_seqs", "gpus_per_replica", "allow_gpu_sharing"}
)


def gpu_count_errors(spec: Endpoint, *, automatic: bool) -> dict:
    """Field errors for `gpus_per_replica` and `allow_gpu_sharing` of an (unsaved) endpoint spec.

    The count must hold the model's estimated size with its context (`placement.memory_needed_mb`,
    the estimate placement reserves): the message names the smallest count that does. With
    `automatic`, `spec.gpus_per_replica` is set to that smallest count instead.
    """
    needed_mb = memory_needed_mb(spec)
    smallest = smallest_gpu_count(spec, needed_mb)
    gpu = GPU_TYPES[spec.gpu_type].label
    if smallest is None:
        most = 1 if spec.gpu_type == "cpu" else GPUS_PER_REPLICA[-1]
        return {"gpus_per_replica": [
            f"This model needs about {needed_mb} MB with its context; it does not fit on {most} × {gpu}. "
            "Choose a larger GPU type, a quantization or a shorter max_model_len."
        ]}
    if automatic:
        spec.gpus_per_replica = smallest
    count = int(spec.gpus_per_replica)
    if spec.gpu_type == "cpu" and count != 1:
        return {"gpus_per_replica": ["A CPU replica runs as one engine: use 1."]}
    if count < smallest:
        return {"gpus_per_replica": [
            f"This model needs about {needed_mb} MB with its context: at least {smallest} × {gpu} per replica."
        ]}
    if spec.allow_gpu_sharing and count != 1:
        return {"allow_gpu_sharing": ["Only one-GPU replicas can share a GPU; set gpus_per_replica to 1 or turn sharing off."]}
    return {}


class ReplicaSerializer(serializers.ModelSerializer):
    """A replica as its endpoint's detail shows it: its node (name and id) to owners and admins only, and never the
    engine's address (a node's host and port): nothing but the gateway calls an engine."""

    node = serializers.CharField(source="node.name", default=None, allow_null=True, read_only=True,
                                 help_text="The node it runs on: owners and admins only (null for other roles).")
    node_id = serializers.UUIDField(allow_null=True, read_only=True,
                                    help_text="The node's id: owners and admins only (null for other roles).")

    class Meta:
        model = Replica
        fields = [
            "id", "state", "node", "node_id", "gpu_indices", "gpu_memory_fraction", "failure_reason", "num_restarts",
            "num_running", "num_waiting", "kv_cache_usage", "tokens_per_s",
            "num_prefix_cache_queries", "num_prefix_cache_hits", "progress", "progress_percent",
            "engine_weights_mb", "engine_kv_cache_mb",
            "created_at", "state_changed_at", "ready_at", "stopped_at",
        ]
        read_only_fields = fields

    def to_representation(self, replica):
        data = super().to_representation(replica)
        if not self._shows_nodes:
            data["node"] = data["node_id"] = None
        return data

    @functools.cached_property
    def _shows_nodes(self) -> bool:
        request = self.context.get("request")
        membership = request_membership(request) if request is not None else None
        return membership is not None and membership.role in (Role.OWNER, Role.ADMIN)


class EndpointEventSerializer(serializers.ModelSerializer):
    replica_id = serializers.UUIDField(allow_null=True, read_only=True)

    class Meta:
        model = EndpointEvent
        fields = ["id", "created_at", "kind", "message", "replica_id", "details"]
        read_only_fields = fields


class PrewarmWindowSerializer(StrictSerializer):
    """One pre-warm window (documentation of the shape; `PrewarmWindowsField` validates). Strict, as
    `prewarm.validate_windows` refuses a key it does not know: the schema says `additionalProperties: false`."""

    schedule = serializers.CharField(help_text="When the window opens: a five-field cron expression, e.g. \"0 9 * * 1-5\".")
    timezone = serializers.CharField(help_text="The IANA time zone the schedule is read in, e.g. \"Europe/Paris\".")
    duration_minutes = serializers.IntegerField(min_value=1, max_value=prewarm.MAX_DURATION_MINUTES,
                                                help_text="How long the window stays open.")
    min_replicas = serializers.IntegerField(min_value=1, help_text="The floor of replicas while it is open.")


@extend_schema_field(PrewarmWindowSerializer(many=True))
class PrewarmWindowsField(serializers.Field):
    """A list of pre-warm windows (`endpoints.prewarm`): each problem names its window and field."""

    default_error_messages = {"invalid": "Must be a JSON list of windows."}

    def to_internal_value(self, data):
        if isinstance(data, str):  # a form post: the console sends the list as JSON
            try:
                data = parsers.loads(data or "[]")
            except ValueError:
                self.fail("invalid")
        problems = prewarm.validate_windows(data)
        if problems:
            raise serializers.ValidationError(problems)
        return [{name: window[name] for name in sorted(prewarm.WINDOW_FIELDS)} for window in data]

    def to_representation(self, value):
        return list(value or [])


class EndpointSerializer(StrictModelSerializer):
    state = serializers.CharField(read_only=True)
    prewarm_windows = PrewarmWindowsField(
        required=False,
        help_text="Times the endpoint keeps a higher floor of replicas, e.g. office hours in its users' time zone "
                  "(at most 10). Each window's min_replicas must be at most max_replicas; the largest counts toward "
                  "the plan's max_min_replicas as min_replicas does.",
    )
    name = serializers.CharField(max_length=63, help_text="Lowercase letters, digits and hyphens; the `model` in /v1 calls.")
    model_source = serializers.CharField(max_length=500, validators=[validate_model_source])
    credential = serializers.PrimaryKeyRelatedField(
        queryset=ModelCredential.objects.none(), allow_null=True, required=False,
        help_text="Id of your organisation's credential for the model source (its kind matches the source). "
                  "Without one the source is read anonymously, or with the platform's own access if it is "
                  "in the public catalogue.",
    )
    gpu_type = serializers.ChoiceField(choices=sorted(GPU_TYPES))
    quantization = serializers.ChoiceField(choices=list(QUANTIZATIONS), default="none")
    gpus_per_replica = serializers.ChoiceField(
        choices=list(GPUS_PER_REPLICA), required=False, allow_blank=True,
        help_text="Whole GPUs of one node per replica; more than one runs the model tensor parallel over them. "
                  "Omitted on create, or \"\": the smallest count that holds the model's estimated size with its "
                  "context. A count too small for it is refused, naming the smallest that fits.",
    )
    allow_gpu_sharing = serializers.BooleanField(
        default=False,
        help_text="A one-GPU replica may share its GPU with other sharing replicas, each held to its share of the "
                  "GPU's memory. Off: each replica has its GPUs to itself.",
    )
    max_model_len = serializers.IntegerField(
        allow_null=True, default=None, min_value=LIMITS["max_model_len"][0], max_value=LIMITS["max_model_len"][1],
        help_text="Longest prompt plus completion, in tokens. Null (the default): the model's own context length. "
                  "A value above the model's is refused once the platform has read the model's config.",
    )
    context_length = serializers.IntegerField(
        read_only=True, help_text="The context the endpoint serves: max_model_len, else the model's own (4096 until known).",
    )
    tool_call_parser = serializers.ChoiceField(
        choices=[AUTO_PARSER, "", *TOOL_CALL_PARSERS], required=False, allow_blank=True,
        help_text="vLLM's tool-call parser for `tools` in chat completions. Omitted on create, or \"auto\": the "
                  "parser of the model's family (llama3_json for Llama 3, hermes for Qwen, mistral, ...), none "
                  "if the family is unknown. \"\" turns tool calling off.",
    )

    task = serializers.ChoiceField(
        choices=[task.value for task in ModelTask], default=ModelTask.AUTO.value,
        help_text="What the endpoint serves: \"generate\" (/v1/chat/completions, /v1/completions and "
                  "/v1/responses), \"embed\" (/v1/embeddings, billed as input tokens at the input price) or \"auto\" "
                  "(the default): from the model's config (an encoder such as BertModel, a bare *Model body or a "
                  "sentence-transformers layout embeds). Batches take the same paths as their `endpoint`.",
    )
    speculative_method = serializers.ChoiceField(
        choices=[method.value for method in SpeculativeMethod], default=SpeculativeMethod.NONE.value,
        help_text="Speculative decoding: guess tokens ahead and let the model check them in one pass (same output, "
                  "fewer steps). \"ngram\": look the last tokens up in the prompt (outputs that repeat their input, "
                  "such as edits); \"draft\": a small model with the same tokenizer (`draft_model_source`); \"none\".",
    )
    num_speculative_tokens = serializers.IntegerField(
        default=4, help_text="Tokens guessed per step (1-16), with ngram or draft.",
    )
    prompt_lookup_max = serializers.IntegerField(default=4, help_text="ngram: longest run of tokens looked up (1-16).")
    prompt_lookup_min = serializers.IntegerField(default=2, help_text="ngram: shortest run looked up (1-prompt_lookup_max).")
    draft_model_source = serializers.CharField(
        max_length=500, required=False, allow_blank=True, validators=[validate_model_source],
        help_text="draft: the draft model (hf:, s3:// or a local path), read with the endpoint's credential. It must "
                  "share the endpoint model's tokenizer; a replica whose draft has another vocabulary fails before "
                  "its engine starts, saying so.",
    )
    max_lora_rank = serializers.ChoiceField(
        choices=list(LORA_RANKS), default=16,
        help_text="The largest LoRA rank an adapter of this endpoint may have (max_loras > 0 turns adapters on).",
    )
    idle_action = serializers.ChoiceField(
        choices=[action.value for action in IdleAction], default=IdleAction.STOP.value,
        help_text="What an idle replica does at idle_timeout_s: \"stop\" (the default) or \"sleep\" (only where the "
                  "platform allows it: on a GPU node the engine sleeps, its weights in host memory, billed as zero, and "
                  "the next call wakes it in about a second; it stops after a longer sleep. A CPU node's replica stops).",
    )
    serving_task = serializers.CharField(
        read_only=True, help_text="What it serves now: \"generate\" or \"embed\"; \"\" while an auto endpoint's model is unread.",
    )

    class Meta:
        model = Endpoint
        fields = [
            "id", "name", "model_source", "credential", "task", "serving_task",
            "gpu_type", "quantization", "gpus_per_replica", "allow_gpu_sharing",
            "min_replicas", "max_replicas", "idle_timeout_s", "idle_action", "target_concurrency",
            "max_model_len", "max_num_seqs", "max_num_batched_tokens", "cold_start_timeout_s",
            "prewarm_windows", "keep_warm_after_cold_start_s",
            "enable_prefix_caching", "tool_call_parser", *speculative.SPECULATIVE_FIELDS, "max_loras", "max_lora_rank",
            "price_input_per_million", "price_cached_input_per_million", "price_output_per_million",
            "batch_price_fraction", "context_length", "state", "status_message", "failed_at", "paused_at", "created_at", "updated_at",
        ]
        read_only_fields = [
            "id", "state", "status_message", "failed_at", "paused_at", "created_at", "updated_at",
            "price_input_per_million", "price_cached_input_per_million", "price_output_per_million",
            "batch_price_fraction",
        ]
        extra_kwargs = {
            name: {"min_value": low, "max_value": high} for name, (low, high) in LIMITS.items()
        }

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        organization = self.context.get("organization")
        if organization is not None:
            # NOTE: another organisation's credential is "does not exist", as if it did not.
            self.fields["credential"].queryset = ModelCredential.objects.filter(organization=organization)

    def validate_name(self, value: str) -> str:
        value = validate_unique_name(value, Endpoint.objects.for_org(self.context["organization"]), self.instance,
                                     ENDPOINT_NAME_TAKEN)
        if self.instance is not None and self.instance.adapters.filter(name=value).exists():
            raise serializers.ValidationError(ENDPOINT_NAMED_AS_ADAPTER)
        return value

    def validate(self, attrs):
        def current(name):
            if name in attrs:
                return attrs[name]
            if self.instance is not None:
                return getattr(self.instance, name)
            return Endpoint._meta.get_field(name).get_default()

        errors = {}
        gpu = current("gpu_type")
        quantization = current("quantization")
        # NOTE: judged when the request sets the pair, not on every PATCH: an endpoint saved before a GPU type
        # stopped offering its quantization (int8 on cpu) can still be scaled to zero, paused or renamed.
        changes_gpu = self.instance is None or any(
            name in attrs and attrs[name] != getattr(self.instance, name) for name in ("gpu_type", "quantization"))
        if changes_gpu and gpu in GPU_TYPES and quantization not in GPU_TYPES[gpu].quantizations:
            allowed = ", ".join(GPU_TYPES[gpu].quantizations)
            errors["quantization"] = [f"{quantization!r} is not available on {gpu}; choose one of: {allowed}."]
        min_replicas, max_replicas = current("min_replicas"), current("max_replicas")
        if max_replicas < max(1, min_replicas):
            errors["max_replicas"] = [f"Must be at least max(1, min_replicas) = {max(1, min_replicas)}."]
        too_many = [number for number, window in enumerate(current("prewarm_windows") or [], start=1)
                    if window["min_replicas"] > max_replicas]
        if too_many and "max_replicas" not in errors:
            errors["prewarm_windows"] = [f"Window {number}: min_replicas is above max_replicas ({max_replicas})."
                                         for number in too_many]
        if attrs.get("idle_action") == IdleAction.SLEEP and not settings.SLEEP_MODE:
            errors["idle_action"] = ["Sleep mode is off on this platform (INFERPLANE_SLEEP_MODE); use \"stop\"."]
        batched = current("max_num_batched_tokens")
        if batched is not None and batched < current("max_num_seqs"):
            errors["max_num_batched_tokens"] = ["Must be at least max_num_seqs."]
        requested, source = current("max_model_len"), current("model_source")
        changes_quantization = self.instance is None or bool({"quantization", "model_source"} & attrs.keys())
        scope = None
        if source and (requested is not None or changes_quantization):
            credential = current("credential")
            scope = weights_scope_for(self.context["organization"].pk, credential.pk if credential is not None else None,
                                      source)
        model_context = ModelFacts.context_length_of(source, scope) if requested is not None and source else None
        if model_context is not None and requested > model_context:
            errors["max_model_len"] = [
                f"This model's context is {model_context} tokens (from its config.json); choose at most "
                f"{model_context}, or leave it empty for the model's own."
            ]
        if "quantization" not in errors and source and changes_quantization:
            # NOTE: once an agent has read the checkpoint's config.json: the engine would refuse it only
            # after a download and a minute of loading (the agent refuses it too, `spec_problem`).
            problem = checkpoint_quantization_problem(quantization, ModelFacts.quantization_of(source, scope))
            if problem:
                errors["quantization"] = [problem[0].upper() + problem[1:] + "."]
        # Omitted on create, or "": the smallest count that holds the model (what the wizard suggests).
        automatic = attrs.get("gpus_per_replica") == "" or (self.instance is None and "gpus_per_replica" not in attrs)
        if (automatic or GPU_SPEC_FIELDS & set(attrs)) and gpu in GPU_TYPES and not errors.keys() & {"quantization", "max_model_len"}:
            spec = Endpoint(
                model_source=source or "", gpu_type=gpu, quantization=quantization, max_model_len=requested,
                max_num_seqs=current("max_num_seqs"), gpus_per_replica=1 if automatic else current("gpus_per_replica"),
                allow_gpu_sharing=current("allow_gpu_sharing"),
            )
            errors |= gpu_count_errors(spec, automatic=automatic)
            attrs["gpus_per_replica"] = spec.gpus_per_replica
        credential, needed = current("credential"), source_kind(current("model_source") or "")
        if credential is not None and credential.kind != needed:
            errors["credential"] = [
                "A local path takes no credential." if needed is None
                else f"This source needs a {CredentialKind(needed).label} credential; {credential.name} is {credential.kind}."
            ]
        errors |= speculative.spec_errors(
            {name: current(name) for name in speculative.SPECULATIVE_FIELDS},
            model_source=current("model_source") or "", credential=credential,
        )
        if not errors:
            errors = quotas.spec_errors(self.context["organization"], attrs, self.instance)
        if errors:
            raise serializers.ValidationError(errors)
        if attrs.get("tool_call_parser") == AUTO_PARSER or (self.instance is None and "tool_call_parser" not in attrs):
            attrs["tool_call_parser"] = default_tool_call_parser(current("model_source") or "")
        return attrs


class EndpointDetailSerializer(EndpointSerializer):
    replicas = serializers.SerializerMethodField()

    class Meta(EndpointSerializer.Meta):
        fields = EndpointSerializer.Meta.fields + ["replicas"]

    @extend_schema_field(ReplicaSerializer(many=True))
    def get_replicas(self, endpoint):
        # Every replica still alive, and the last few that ended, oldest first (so a failure stays visible).
        alive, ended = endpoint.shown_replicas()
        return ReplicaSerializer(alive + ended[::-1], many=True, context=self.context).data


# --- model credentials ------------------------------------------------------------------------

REGION = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}$")
ACCESS_KEY_ID = re.compile(r"^[\x21-\x7e]{1,128}$")  # printable ASCII: S3-compatible stores use their own formats
SECRET_VALUE = re.compile(r"^[\x21-\x7e]+$")
BLOCKED_HOSTS = {"localhost", "metadata.google.internal", "metadata"}
STORE_HOST = re.compile(r"^[a-z0-9_]([a-z0-9_.-]{0,251}[a-z0-9])?$")  # a DNS name (underscores: development hosts)


def _is_ip_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _inet_aton_address(host: str) -> ipaddress.IPv4Address | None:
    """The IPv4 address a C resolver reads in a numeric host (decimal, octal, hex, fewer than four parts), else None."""
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except (OSError, ValueError):
        return None


def validate_endpoint_url(value: str) -> str:
    """An S3-compatible store's address. GPU nodes connect to it, so it may not point into their
    own network (loopback, private, link-local such as the cloud metadata service) unless the
    platform runs in development mode (`INFERPLANE_ALLOW_LOCAL_MODEL_PATHS`)."""
    development = settings.ALLOW_LOCAL_MODEL_PATHS
    if not is_plain(value):  # NOTE: its path went to the nodes' S3 client and logs with an escape sequence in it
        raise serializers.ValidationError("Use https://host[:port] of an S3-compatible store.")
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises for a port out of range or not a number
    except ValueError:  # NOTE: an unclosed "[" was a 500; a bad port was saved and failed every pull on the nodes
        raise serializers.ValidationError("Use https://host[:port] of an S3-compatible store.") from None
    if (parts.scheme not in (("https", "http") if development else ("https",)) or not parts.hostname
            or not (STORE_HOST.match(parts.hostname) or _is_ip_address(parts.hostname))):
        raise serializers.ValidationError("Use https://host[:port] of an S3-compatible store.")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise serializers.ValidationError("Give the store's address only: no user, query or fragment.")
    if development:
        return value
    host = parts.hostname.lower().rstrip(".")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        numeric = _inet_aton_address(host)  # 2852039166, 0xa9fea9fe, 127.1: what a node's resolver makes of them
        if numeric is not None and not is_public_address(numeric):
            raise serializers.ValidationError("This address is on the platform's own network.") from None
        if host in BLOCKED_HOSTS or host.endswith((".localhost", ".internal", ".local")):
            raise serializers.ValidationError("This address is on the platform's own network.") from None
        return value
    if not is_public_address(address):
        raise serializers.ValidationError("This address is on the platform's own network.")
    return value


def validate_role_arn(value: str) -> str:
    """A role in an account, not one of the platform's own (`endpoints.credentials.check_role_arn`)."""
    try:
        check_role_arn(value)
    except RoleNotAllowed as exc:
        raise serializers.ValidationError(str(exc)) from None
    return value


def _secret(label: str, max_length: int) -> serializers.CharField:
    return serializers.CharField(
        write_only=True, required=False, max_length=max_length, style={"input_type": "password"},
        help_text=f"{label}. Write-only: stored encrypted and never returned.",
    )


class CredentialSerializer(StrictModelSerializer):
    """A model credential. Secret fields are write-only; `secrets_set` names those that hold a value."""

    name = serializers.CharField(max_length=63, help_text="Lowercase letters, digits and hyphens; unique in your organisation.")
    kind = serializers.ChoiceField(choices=CredentialKind.choices, help_text="s3 or hf; fixed once created.")
    access_key_id = serializers.RegexField(ACCESS_KEY_ID, required=False, allow_blank=True,
                                           help_text="S3 access key id (shown back).")
    role_arn = serializers.CharField(required=False, allow_blank=True, max_length=2048, validators=[validate_role_arn],
                                     help_text="An IAM role in your own AWS account, which the platform assumes with "
                                               "`external_id`; a role in the platform's own accounts is refused.")
    region = serializers.RegexField(REGION, required=False, allow_blank=True,
                                    error_messages={"invalid": "Use a region name such as eu-west-1."})
    endpoint_url = serializers.CharField(required=False, allow_blank=True, max_length=500, validators=[validate_endpoint_url],
                                         help_text="An S3-compatible store's https address; empty for AWS S3.")
    secret_access_key = _secret("S3 secret access key", 512)
    session_token = _secret("S3 session token (temporary keys)", 4096)
    hf_token = _secret("Hugging Face access token", 512)
    secrets_set = serializers.ListField(source="secret_fields", child=serializers.CharField(), read_only=True)
    created_by = AddressField(source="created_by.email", default=None, allow_null=True, read_only=True,
                              help_text="Who created it; null once staff deleted that user.")

    class Meta:
        model = ModelCredential
        fields = [
            "id", "name", "kind", "access_key_id", "role_arn", "external_id", "region", "endpoint_url",
            "secret_access_key", "session_token", "hf_token", "secrets_set",
            "created_by", "created_at", "updated_at", "last_used_at",
        ]
        read_only_fields = ["id", "external_id", "secrets_set", "created_by", "created_at", "updated_at", "last_used_at"]

    def validate_name(self, value: str) -> str:
        return validate_unique_name(
            value, ModelCredential.objects.filter(organization=self.context["organization"]), self.instance, CREDENTIAL_NAME_TAKEN
        )

    def validate(self, attrs):
        kind = attrs.get("kind", getattr(self.instance, "kind", None))
        errors = {}
        if self.instance is not None and attrs.get("kind", kind) != self.instance.kind:
            raise serializers.ValidationError({"kind": ["The kind of a credential cannot change; create a new one."]})
        allowed = set(PUBLIC_FIELDS[kind]) | set(SECRETS_OF_KIND[kind])
        for name in ("access_key_id", "role_arn", "region", "endpoint_url", "secret_access_key", "session_token", "hf_token"):
            if attrs.get(name) and name not in allowed:
                errors[name] = [f"Not used by {kind} credentials."]
        for name in SECRETS_OF_KIND[kind]:
            if name in attrs and attrs[name] and not SECRET_VALUE.match(attrs[name]):
                errors[name] = ["No spaces or control characters."]
        if errors:
            raise serializers.ValidationError(errors)

        # The credential as it will be: stored secrets are kept unless any secret field is given.
        values = {name: attrs.get(name, getattr(self.instance, name, "")) for name in PUBLIC_FIELDS[kind]}
        if any(name in attrs for name in SECRETS_OF_KIND[kind]):
            values |= {name: attrs.get(name, "") for name in SECRETS_OF_KIND[kind]}
        elif self.instance is not None:
            values |= {name: "set" for name in self.instance.secret_fields}
        if (self.instance is not None and "access_key_id" in attrs and attrs["access_key_id"]
                and attrs["access_key_id"] != self.instance.access_key_id and not attrs.get("secret_access_key")):
            errors["secret_access_key"] = ["A new access key id needs its secret access key."]
        if kind == CredentialKind.S3 and not values.get("role_arn") and not (values.get("access_key_id") and values.get("secret_access_key")):
            errors["secret_access_key" if values.get("access_key_id") else "access_key_id"] = [
                "Give an access key id and its secret access key, or a role ARN."
            ]
        if kind == CredentialKind.HF and not values.get("hf_token"):
            errors["hf_token"] = ["A Hugging Face credential needs a token."]
        if errors:
            raise serializers.ValidationError(errors)
        try:
            build_source_credentials(kind, values)
        except RoleNotAllowed as exc:  # a stored role, refused since it was saved: the change would keep it
            raise serializers.ValidationError({"role_arn": [str(exc)]}) from None
        except ValueError as exc:
            raise serializers.ValidationError(str(exc)) from None
        return attrs

class QuotaRowSerializer(serializers.Serializer):
    quota = serializers.CharField(help_text="The plan's field, e.g. `max_replicas` or `max_gpus_by_type.h100`; "
                                            "`replica_starts_per_hour`: replicas started in the last hour.")
    label = serializers.CharField()
    limit = serializers.IntegerField()
    used = serializers.IntegerField()
    unit = serializers.CharField(help_text='"bytes" for storage; empty for a count.')


class QuotaUseSerializer(serializers.Serializer):
    plan = serializers.CharField(allow_null=True, help_text="null: the platform's default quotas.")
    quotas = QuotaRowSerializer(source="rows", many=True)


class AdapterSerializer(StrictModelSerializer):
    """A LoRA adapter on an endpoint. Validated here against the endpoint (adapters on, rank limit,
    credential kind); what needs the adapter's files (its rank and target modules against the base
    model) is checked by the engine on first load, and a refusal shows as `state` FAILED with the
    engine's reason in `status_message`."""

    name = serializers.CharField(max_length=63, help_text="Calls name the adapter `<endpoint>:<name>` as `model`.")
    source = serializers.CharField(max_length=500, validators=[validate_model_source],
                                   help_text="hf:org/name[@revision], s3://bucket/prefix or an allowed local path.")
    credential = serializers.PrimaryKeyRelatedField(queryset=ModelCredential.objects.none(), allow_null=True, required=False)
    rank = serializers.IntegerField(min_value=1, max_value=LORA_RANKS[-1], allow_null=True, required=False,
                                    help_text="The adapter's rank (adapter_config.json `r`), checked against the endpoint's max_lora_rank.")
    model = serializers.SerializerMethodField()

    class Meta:
        model = Adapter
        fields = ["id", "name", "model", "source", "credential", "rank", "price_input_per_million",
                  "price_output_per_million", "state", "status_message", "last_requested_at", "created_at"]
        # NOTE: prices are the platform's to set, as an endpoint's: staff price an adapter in the admin (null:
        # the endpoint's prices). A tenant that priced its own adapter at zero got free inference.
        read_only_fields = ["id", "model", "price_input_per_million", "price_output_per_million", "state",
                            "status_message", "last_requested_at", "created_at"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        organization = self.context.get("organization")
        if organization is not None:
            self.fields["credential"].queryset = ModelCredential.objects.filter(organization=organization)

    def get_model(self, adapter) -> str:
        return f"{adapter.endpoint.name}:{adapter.name}"

    def validate_name(self, value: str) -> str:
        if not NAME.match(value):
            raise serializers.ValidationError(
                "Use 1-63 lowercase letters, digits and hyphens, starting and ending with a letter or digit."
            )
        if value == self.context["endpoint"].name:
            raise serializers.ValidationError(ADAPTER_NAMED_AS_ENDPOINT)
        if self.context["endpoint"].adapters.filter(name=value).exists():
            raise serializers.ValidationError(ADAPTER_NAME_TAKEN)
        return value

    def validate(self, attrs):
        endpoint = self.context["endpoint"]
        errors = {}
        if endpoint.max_loras < 1:
            errors["endpoint"] = ["This endpoint serves no adapters: set its max_loras (and max_lora_rank) first."]
        elif endpoint.serving_task == ModelTask.EMBED:
            errors["endpoint"] = ["An embedding endpoint serves no LoRA adapters."]
        elif endpoint.adapters.count() >= MAX_ADAPTERS:
            errors["endpoint"] = [TOO_MANY_ADAPTERS]
        rank = attrs.get("rank")
        if rank is not None and rank > endpoint.max_lora_rank:
            errors["rank"] = [f"This endpoint accepts adapters up to rank {endpoint.max_lora_rank} (its max_lora_rank)."]
        credential, needed = attrs.get("credential"), source_kind(attrs.get("source", ""))
        if credential is not None and credential.kind != needed:
            errors["credential"] = [
                "A local path takes no credential." if needed is None
                else f"This source needs a {CredentialKind(needed).label} credential; {credential.name} is {credential.kind}."
            ]
        if errors:
            raise serializers.ValidationError(errors)
        return attrs
