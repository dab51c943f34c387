"""Shapes of the endpoints API. Validation of an endpoint spec lives here, once, for API and console."""

import re

from django.conf import settings
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from controlplane.serializers import StrictModelSerializer
from endpoints import quotas
from endpoints.catalogue import GPU_TYPES, QUANTIZATIONS
from endpoints.models import FINAL_REPLICA_STATES, Endpoint, EndpointEvent, Replica

RECENT_ENDED_REPLICAS = 5

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
}


def validate_model_source(value: str) -> str:
    value = value.strip()
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


class ReplicaSerializer(serializers.ModelSerializer):
    node = serializers.CharField(source="node.name", default=None, read_only=True)
    node_id = serializers.UUIDField(read_only=True)

    class Meta:
        model = Replica
        fields = [
            "id", "state", "node", "node_id", "address", "failure_reason", "num_restarts",
            "num_running", "num_waiting", "kv_cache_usage", "tokens_per_s", "progress", "progress_percent",
            "created_at", "state_changed_at", "ready_at", "stopped_at",
        ]
        read_only_fields = fields


class EndpointEventSerializer(serializers.ModelSerializer):
    replica_id = serializers.UUIDField(read_only=True)

    class Meta:
        model = EndpointEvent
        fields = ["id", "created_at", "kind", "message", "replica_id", "details"]
        read_only_fields = fields


class EndpointSerializer(StrictModelSerializer):
    state = serializers.CharField(read_only=True)
    name = serializers.CharField(max_length=63, help_text="Lowercase letters, digits and hyphens; the `model` in /v1 calls.")
    model_source = serializers.CharField(max_length=500, validators=[validate_model_source])
    gpu_type = serializers.ChoiceField(choices=sorted(GPU_TYPES))
    quantization = serializers.ChoiceField(choices=list(QUANTIZATIONS), default="none")

    class Meta:
        model = Endpoint
        fields = [
            "id", "name", "model_source", "gpu_type", "quantization",
            "min_replicas", "max_replicas", "idle_timeout_s", "target_concurrency",
            "max_model_len", "max_num_seqs", "max_num_batched_tokens", "cold_start_timeout_s",
            "enable_prefix_caching",
            "price_input_per_million", "price_cached_input_per_million", "price_output_per_million",
            "state", "status_message", "paused_at", "created_at", "updated_at",
        ]
        read_only_fields = [
            "id", "state", "status_message", "paused_at", "created_at", "updated_at",
            "price_input_per_million", "price_cached_input_per_million", "price_output_per_million",
        ]
        extra_kwargs = {
            name: {"min_value": low, "max_value": high} for name, (low, high) in LIMITS.items()
        }

    def validate_name(self, value: str) -> str:
        if not NAME.match(value):
            raise serializers.ValidationError(
                "Use 1-63 lowercase letters, digits and hyphens, starting and ending with a letter or digit."
            )
        organization = self.context["organization"]
        clash = Endpoint.objects.for_org(organization).filter(name=value)
        if self.instance is not None:
            clash = clash.exclude(pk=self.instance.pk)
        if clash.exists():
            raise serializers.ValidationError("An endpoint with this name already exists in your organisation.")
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
        if gpu in GPU_TYPES and quantization not in GPU_TYPES[gpu].quantizations:
            allowed = ", ".join(GPU_TYPES[gpu].quantizations)
            errors["quantization"] = [f"{quantization!r} is not available on {gpu}; choose one of: {allowed}."]
        min_replicas, max_replicas = current("min_replicas"), current("max_replicas")
        if max_replicas < max(1, min_replicas):
            errors["max_replicas"] = [f"Must be at least max(1, min_replicas) = {max(1, min_replicas)}."]
        batched = current("max_num_batched_tokens")
        if batched is not None and batched < current("max_num_seqs"):
            errors["max_num_batched_tokens"] = ["Must be at least max_num_seqs."]
        if not errors:
            errors = quotas.spec_errors(self.context["organization"], attrs, self.instance)
        if errors:
            raise serializers.ValidationError(errors)
        return attrs


class EndpointDetailSerializer(EndpointSerializer):
    replicas = serializers.SerializerMethodField()

    class Meta(EndpointSerializer.Meta):
        fields = EndpointSerializer.Meta.fields + ["replicas"]

    @extend_schema_field(ReplicaSerializer(many=True))
    def get_replicas(self, endpoint):
        # Every replica still alive, and the last few that ended (so a failure stays visible).
        replicas = list(endpoint.replicas.all())
        alive = [r for r in replicas if r.state not in FINAL_REPLICA_STATES]
        ended = sorted((r for r in replicas if r.state in FINAL_REPLICA_STATES), key=lambda r: r.state_changed_at)
        return ReplicaSerializer(alive + ended[-RECENT_ENDED_REPLICAS:], many=True).data


class QuotaRowSerializer(serializers.Serializer):
    quota = serializers.CharField(help_text="The plan's field, e.g. `max_replicas` or `max_gpus_by_type.h100`.")
    label = serializers.CharField()
    limit = serializers.IntegerField()
    used = serializers.IntegerField()


class QuotaUseSerializer(serializers.Serializer):
    plan = serializers.CharField(allow_null=True, help_text="null: the platform's default quotas.")
    quotas = QuotaRowSerializer(source="rows", many=True)
