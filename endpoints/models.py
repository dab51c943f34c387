"""Endpoints (what a team deployed), their replicas (what runs) and their event log."""

from __future__ import annotations

import json
import secrets
import uuid
from collections.abc import Iterable
from decimal import Decimal

from django.conf import settings
from django.contrib.postgres.fields import ArrayField
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import IntegrityError, models, transaction
from django.utils import timezone

from controlplane import secrets as secrets_at_rest
from controlplane.clock import database_now
from endpoints.catalogue import GPU_TYPES, GPUS_PER_REPLICA, QUANTIZATIONS
from gpu_agent.protocol import (
    FINAL_REPLICA_STATES,
    MAX_DIFFERING_TOKENIZERS,
    UNKNOWN_CONTEXT_TOKENS,
    CheckpointQuantization,
    ModelTask,
    ReplicaState,
    SpeculativeMethod,
    TokenizerNormalizer,
    task_of_architecture,
)

# Replicas that ended shown with an endpoint (`Endpoint.shown_replicas`): the latest few, so a failure stays visible.
RECENT_ENDED_REPLICAS = 5


def _alive(replicas: models.QuerySet) -> models.QuerySet:
    return replicas.exclude(state__in=FINAL_REPLICA_STATES).select_related("node")


def _recently_ended(replicas: models.QuerySet) -> models.QuerySet:
    return replicas.filter(state__in=FINAL_REPLICA_STATES).select_related("node").order_by("-state_changed_at")[
        :RECENT_ENDED_REPLICAS]


def shown_replicas_prefetch() -> tuple[models.Prefetch, models.Prefetch]:
    """What a list or page of endpoints prefetches for `Endpoint.shown_replicas`: the alive replicas, and the latest
    ended ones per endpoint (a window over each endpoint's), with their nodes."""
    return (models.Prefetch("replicas", to_attr="alive_replicas", queryset=_alive(Replica.objects.all())),
            models.Prefetch("replicas", to_attr="recently_ended_replicas", queryset=_recently_ended(Replica.objects.all())))


class EndpointState(models.TextChoices):
    PAUSED = "PAUSED", "Paused"
    SCALED_TO_ZERO = "SCALED_TO_ZERO", "Scaled to zero"
    STARTING = "STARTING", "Starting"
    # Wants replicas, but no node has room for one (status_message says what it needs).
    WAITING_FOR_CAPACITY = "WAITING_FOR_CAPACITY", "Waiting for capacity"
    READY = "READY", "Ready"
    # Its replicas sleep (vLLM sleep mode, `idle_action` "sleep"): the next call wakes one in about a second.
    SLEEPING = "SLEEPING", "Sleeping"
    FAILED = "FAILED", "Failed"


class IdleAction(models.TextChoices):
    """What an idle replica of a serverless endpoint does at its idle timeout."""

    STOP = "stop", "Stop"
    # GPU nodes only, where `INFERPLANE_SLEEP_MODE` is on: vLLM sleep mode, weights offloaded to host memory,
    # billed as zero; stopped for real after `INFERPLANE_SLEEP_STOP_AFTER_S` asleep. A CPU node's replica stops.
    SLEEP = "sleep", "Sleep"


class EndpointQuerySet(models.QuerySet):
    def for_org(self, organization):
        return self.filter(organization=organization, deleted_at__isnull=True)

    def live(self):
        return self.filter(deleted_at__isnull=True)


class CredentialKind(models.TextChoices):
    S3 = "s3", "S3 (access key or role)"
    HF = "hf", "Hugging Face token"


# The secret part of a credential: stored only inside `encrypted_secrets`, never returned.
SECRET_FIELDS = ("secret_access_key", "session_token", "hf_token")


class ModelCredential(models.Model):
    """An organisation's own credentials for its model sources (a bucket, a gated or private repo).

    Non-secret fields are shown back; the secrets are one Fernet-encrypted JSON object
    (`controlplane.secrets`), write-only through the API and console. `external_id` is ours, not
    the customer's: it goes into their role's trust policy, so another organisation naming the
    same role cannot assume it (AWS's confused-deputy guard).
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    organization = models.ForeignKey("controlplane.Organization", on_delete=models.CASCADE, related_name="model_credentials")
    name = models.SlugField(max_length=63)
    kind = models.CharField(max_length=8, choices=CredentialKind.choices)
    access_key_id = models.CharField(max_length=128, blank=True)
    role_arn = models.CharField(max_length=2048, blank=True)
    external_id = models.CharField(max_length=64, unique=True, editable=False)
    region = models.CharField(max_length=64, blank=True)
    endpoint_url = models.CharField(max_length=500, blank=True)
    encrypted_secrets = models.TextField(editable=False)
    # Which secret fields hold a value (names only), so a page can say "set" without decrypting.
    secret_fields = models.JSONField(default=list, editable=False)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(auto_now=True)
    last_used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.UniqueConstraint(fields=["organization", "name"], name="model_credential_name_unique_in_org"),
        ]

    def __str__(self) -> str:
        return self.name


class AllowedSource(models.Model):
    """The public model catalogue: sources the fleet's own credentials may read, for every tenant.

    `pattern` is a model source (`hf:org/name` also admits `@main`, its default branch; another revision
    only when a pattern names it exactly, `is_catalogue_source`) or, ending in
    `/`, a prefix (`s3://inferplane-public-models/`, `hf:meta-llama/`). Staff manage it in the
    Django admin. A cached copy of a catalogue model is shared by every organisation.
    """

    pattern = models.CharField(max_length=500, unique=True)
    description = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["pattern"]

    def __str__(self) -> str:
        return self.pattern

    def clean(self) -> None:
        if not self.pattern.startswith(("hf:", "s3://")) or any(c.isspace() for c in self.pattern) or ".." in self.pattern:
            raise ValidationError({"pattern": "Use hf:org/name, s3://bucket/prefix, or a prefix of either ending in /."})


def source_kind(model_source: str) -> str | None:
    """The credential kind a model source needs: "s3", "hf", or None (a local path)."""
    if model_source.startswith("s3://"):
        return CredentialKind.S3
    if model_source.startswith("hf:"):
        return CredentialKind.HF
    return None


def same_source(model_source: str) -> str:
    """One spelling for each object a model source names, as the agent fetches it (`weights_sources.ModelSource.parse`):
    an S3 prefix without slashes at its ends (the same objects are listed), a Hub repo id in lower case (the Hub
    resolves it so) without its default revision `@main`, a local path without a trailing slash.

    NOTE: for comparing only (staff's prices by source, `adapters.staff_prices`); a source is stored as given. Before,
    `s3://bucket/french/` under a new name started at the endpoint's prices, not at those staff set for `.../french`."""
    source = model_source.strip()
    if source.startswith("s3://"):
        return "s3://" + source[len("s3://"):].strip("/")
    if source.startswith("hf:"):
        repo_id, _, revision = source[len("hf:"):].partition("@")
        return f"hf:{repo_id.lower()}" + (f"@{revision}" if revision not in ("", "main") else "")
    return source.rstrip("/") or source


def organization_scope(organization_id) -> str:
    """The weights scope of an organisation's private sources: its cached copies are its own."""
    return f"{_ORGANIZATION_SCOPE_PREFIX}{organization_id}"


def organization_of_scope(scope: str) -> int | None:
    """The organisation whose scope `scope` is (`organization_scope`); None for the shared one ("") or another."""
    if not scope.startswith(_ORGANIZATION_SCOPE_PREFIX):
        return None
    number = scope.removeprefix(_ORGANIZATION_SCOPE_PREFIX)
    return int(number) if number.isdigit() else None


_ORGANIZATION_SCOPE_PREFIX = "org-"


def _plain_path(model_source: str) -> bool:
    """No segment that a store, a client library or the agent could read as a step elsewhere."""
    rest = model_source.split("://", 1)[1] if "://" in model_source else model_source.split(":", 1)[1]
    segments = rest.split("/")
    return not any(c.isspace() or c in "\\%" for c in rest) and "" not in segments[:-1] and not {".", ".."} & set(segments)


# Hub revisions a catalogue repo (`hf:org/name` or a `hf:org/` prefix) never stands for unless staff pin them
# exactly: refs the Hub keeps for others than the repo's owners (`refs/pr/N`: anyone's pull request).
UNREVIEWED_REVISIONS = "refs/"


def is_catalogue_source(model_source: str, patterns: list[str] | None = None) -> bool:
    """Whether staff put this source on the public catalogue (an exact source or a `…/` prefix). `patterns`: the
    catalogue's (`AllowedSource.pattern`), where the caller read them once for many sources; read here if None.

    NOTE: a Hub repo on the catalogue stands for its branches, tags and commits (its owners'), not for a
    ref under `refs/` (a pull request's `refs/pr/N` holds what anyone pushed and nobody reviewed): that is
    catalogue only when staff pinned it exactly, else it is read as a tenant's own. Endpoints pinned to a
    commit or tag of a catalogue repo (gated ones read with the fleet's token) keep working.
    """
    if source_kind(model_source) is None or not _plain_path(model_source):
        return False
    name, revision = model_source, ""
    if source_kind(model_source) == CredentialKind.HF:
        name, _, revision = model_source.partition("@")
    for pattern in AllowedSource.objects.values_list("pattern", flat=True) if patterns is None else patterns:
        if model_source == pattern:
            return True
        if revision.startswith(UNREVIEWED_REVISIONS):
            continue
        if pattern.endswith("/"):
            if name.startswith(pattern):
                return True
        elif pattern.startswith("hf:") and "@" not in pattern and name == pattern:
            return True
    return False


def weights_scope_for(organization_id, credential_id, model_source: str) -> str:
    """Who shares what is read from a model source: "" for a catalogue source read without an
    organisation's credential (one cached copy, one set of `ModelFacts`, for every tenant), else the
    organisation's scope. The agents cache weights by it (`credentials.source_access`) and the control
    plane keeps what they read from those weights by it: a tenant's own copy of a source, its store or
    its credential, never stands for anyone else's copy of the same name."""
    if credential_id is None and is_catalogue_source(model_source):
        return ""
    return organization_scope(organization_id)


# The fields an engine is started with (its command line, its weights, the name it answers to; see
# `endpoints.fleet.services.replica_spec`). A replica started before one of them changed serves the old
# configuration for as long as it runs, while calls are checked, reserved and billed by the new one (a shorter
# `max_model_len` reserved a 30k-token prompt as 16 tokens; another `gpu_type` billed an H200 at an L4's prices):
# a change to any of them replaces the endpoint's replicas (`endpoints.services.update_endpoint`). Another credential
# is another copy of the weights (its scope: `weights_scope_for`) with facts of its own; a credential's secrets
# changed in place, adapters, prices and scaling are read live and replace nothing.
ENGINE_FIELDS = frozenset({
    "name", "model_source", "credential", "gpu_type", "quantization", "gpus_per_replica", "allow_gpu_sharing", "idle_action",
    "max_model_len", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching", "speculative_method",
    "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "draft_model_source", "max_loras",
    "max_lora_rank", "tool_call_parser", "task",
})


# An annotation a query that loads endpoints may add (`DatabaseClock()`): PostgreSQL's clock as it read them, which
# `Endpoint.backoff_left_s` judges by instead of asking again.
DATABASE_NOW_AT_LOAD = "database_now_at_load"


class Endpoint(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    organization = models.ForeignKey("controlplane.Organization", on_delete=models.PROTECT, related_name="endpoints")
    name = models.SlugField(max_length=63)  # the `model` in /v1 calls
    model_source = models.CharField(max_length=500)
    # The organisation's credential for `model_source`; none: the public catalogue or an anonymous read.
    credential = models.ForeignKey(
        ModelCredential, on_delete=models.SET_NULL, null=True, blank=True, related_name="endpoints"
    )
    gpu_type = models.CharField(max_length=32, choices=[(name, gpu.label) for name, gpu in GPU_TYPES.items()])
    quantization = models.CharField(max_length=32, choices=[(name, name) for name in QUANTIZATIONS], default="none")
    # Whole GPUs of one node per replica; more than one runs the model tensor parallel over them.
    gpus_per_replica = models.PositiveSmallIntegerField(choices=[(n, str(n)) for n in GPUS_PER_REPLICA], default=1, db_default=1)
    # A one-GPU replica may share its GPU with other sharing replicas, each engine held to its share
    # of the GPU's memory; without it a replica has its GPUs to itself.
    allow_gpu_sharing = models.BooleanField(default=False, db_default=False)
    min_replicas = models.PositiveIntegerField(default=0)
    max_replicas = models.PositiveIntegerField(default=1)
    idle_timeout_s = models.PositiveIntegerField(default=300)
    idle_action = models.CharField(max_length=8, choices=IdleAction.choices, default=IdleAction.STOP, db_default=IdleAction.STOP)
    target_concurrency = models.PositiveIntegerField(default=8)
    # None: the model's own context length (`ModelFacts`, or vLLM's reading of its config).
    max_model_len = models.PositiveIntegerField(null=True, blank=True, default=None)
    max_num_seqs = models.PositiveIntegerField(default=64)
    max_num_batched_tokens = models.PositiveIntegerField(null=True, blank=True)
    cold_start_timeout_s = models.PositiveIntegerField(default=300)
    # Times the floor is higher (`endpoints.prewarm`): [{"schedule", "timezone", "duration_minutes", "min_replicas"}].
    prewarm_windows = models.JSONField(default=list, db_default=[], blank=True)
    # After a cold start, keep one replica at least this long even when idle (0: only idle_timeout_s counts).
    keep_warm_after_cold_start_s = models.PositiveIntegerField(default=0, db_default=0)
    last_cold_start_at = models.DateTimeField(null=True, blank=True, editable=False)
    enable_prefix_caching = models.BooleanField(default=True)
    # Speculative decoding (`endpoints.speculative`): "none", "ngram" (prompt lookup) or "draft" (a small
    # model with the same tokenizer, read from `draft_model_source` with the endpoint's own credential).
    speculative_method = models.CharField(max_length=16, choices=[(m.value, m.value) for m in SpeculativeMethod], default="none", db_default="none")
    num_speculative_tokens = models.PositiveSmallIntegerField(default=4, db_default=4)
    prompt_lookup_max = models.PositiveSmallIntegerField(default=4, db_default=4)
    prompt_lookup_min = models.PositiveSmallIntegerField(default=2, db_default=2)
    draft_model_source = models.CharField(max_length=500, blank=True, default="", db_default="")

    # LoRA adapters (`Adapter`): 0 serves none (the engine starts without LoRA); else how many one
    # replica holds loaded at once and the largest rank it accepts.
    max_loras = models.PositiveSmallIntegerField(default=0, db_default=0)
    max_lora_rank = models.PositiveSmallIntegerField(default=16, db_default=16)
    # vLLM's tool-call parser (`endpoints.catalogue.TOOL_CALL_PARSERS`); "" turns tool calling off.
    tool_call_parser = models.CharField(max_length=32, blank=True, default="", db_default="")
    # What it serves (`protocol.ModelTask`): "auto" reads it from the model's config (`serving_task`).
    task = models.CharField(max_length=16, choices=[(t.value, t.value) for t in ModelTask], default=ModelTask.AUTO.value, db_default=ModelTask.AUTO.value)
    # Counts the changes to its `ENGINE_FIELDS`; a replica records the one it was placed under, and the gateway sends a
    # call only to a replica of the configuration it checked and reserved the call by.
    engine_generation = models.PositiveIntegerField(default=0, db_default=0, editable=False)
    price_input_per_million = models.DecimalField(max_digits=12, decimal_places=6)
    price_cached_input_per_million = models.DecimalField(max_digits=12, decimal_places=6)
    price_output_per_million = models.DecimalField(max_digits=12, decimal_places=6)
    # Batch lines (`endpoints.batches`) pay this fraction of the prices above (staff set it; default half).
    batch_price_fraction = models.DecimalField(max_digits=4, decimal_places=3, default=Decimal("0.5"), db_default=Decimal("0.5"),
                                               validators=[MinValueValidator(Decimal(0)), MaxValueValidator(Decimal(1))])
    # Why the endpoint cannot get what it wants right now ("waiting for capacity: …"); empty when fine.
    status_message = models.CharField(max_length=300, blank=True)
    # Set by the scheduler while no node has room for a replica it wants (the message says why).
    waiting_for_capacity = models.BooleanField(default=False, db_default=False)
    # Replicas it wants that no node had room for at its last reconcile (not quota refusals): the
    # demand node pools launch machines for (`endpoints.fleet.pools`). 0 once placed or unwanted.
    unplaced_replicas = models.PositiveIntegerField(default=0, db_default=0)
    # Replica failures in a row with the same reason; they back off, then stop the endpoint (FAILED).
    num_identical_failures = models.PositiveIntegerField(default=0, db_default=0)
    # Replica failures in a row, whatever their reasons, with none of its replicas READY (since one last was): the
    # backoff grows with these, and too many stop the endpoint too (reasons that vary or alternate never reach the
    # identical rule).
    num_failures_since_ready = models.PositiveIntegerField(default=0, db_default=0)
    # Replica failures in a row while another replica of it was READY (a scale-up's): the backoff of its scale-ups
    # grows with these; they never stop it by their number (`scale_up_backing_off`).
    num_scale_up_failures = models.PositiveIntegerField(default=0, db_default=0)
    last_failure_reason = models.CharField(max_length=300, blank=True, default="", db_default="")
    next_attempt_at = models.DateTimeField(null=True, blank=True)  # no new replica before this (backoff)
    failed_at = models.DateTimeField(null=True, blank=True)  # gave up: no replicas until a spec change or resume
    paused_at = models.DateTimeField(null=True, blank=True)
    deleted_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(auto_now=True)

    objects = EndpointQuerySet.as_manager()

    class Meta:
        ordering = ["name"]
        constraints = [
            models.UniqueConstraint(
                fields=["organization", "name"],
                condition=models.Q(deleted_at__isnull=True),
                name="endpoint_name_unique_in_org",
            ),
        ]

    def __str__(self) -> str:
        return self.name

    def shown_replicas(self) -> tuple[list[Replica], list[Replica]]:
        """Its replicas still alive, and the latest `RECENT_ENDED_REPLICAS` that ended, newest first (so a failure
        stays visible); read without a query where `shown_replicas_prefetch()` was prefetched (lists, pages).

        NOTE: not every replica it ever had: rows are kept, and an endpoint scaling up and down for months had tens of
        thousands, all read (with their nodes) by every list, detail and console poll of every 3 s."""
        alive = getattr(self, "alive_replicas", None)
        ended = getattr(self, "recently_ended_replicas", None)
        return (alive if alive is not None else list(_alive(self.replicas.all())),
                ended if ended is not None else list(_recently_ended(self.replicas.all())))

    @property
    def state(self) -> str:
        """The state a user sees, derived from the replicas (prefetch `shown_replicas_prefetch()` in lists)."""
        if self.paused_at is not None:
            return EndpointState.PAUSED
        alive, ended = self.shown_replicas()
        states = {replica.state for replica in (*alive, *ended)}
        if ReplicaState.READY in states:
            return EndpointState.READY
        if self.failed_at is not None:
            return EndpointState.FAILED
        if self.waiting_for_capacity:
            return EndpointState.WAITING_FOR_CAPACITY
        if states & {ReplicaState.PENDING, ReplicaState.STARTING} or self.unplaced_replicas:
            # NOTE: unplaced but not waiting for capacity: a node pool is provisioning a node for it.
            return EndpointState.STARTING
        if ReplicaState.SLEEPING in states:
            return EndpointState.SLEEPING
        if self.min_replicas > 0 and ReplicaState.FAILED in states:
            return EndpointState.FAILED
        return EndpointState.SCALED_TO_ZERO


    @property
    def backing_off(self) -> bool:
        """It places no replica before `next_attempt_at`, after failures (a Retry clears it)."""
        return self.backoff_left_s() > 0

    def backoff_left_s(self) -> float:
        """Seconds before it may place a replica again after failures (0: not backing off), by PostgreSQL's clock, the
        one `next_attempt_at` is stamped by (`replicas.record_replica_failure`); a query only while one is set.

        NOTE: stamped by the clock of the process that heard the failure and judged by the reconcile's (and the
        gateway's) own, a web pod 10 minutes ahead made a 1 s backoff 10 minutes long: no replica placed, calls 503."""
        if self.failed_at is not None or self.next_attempt_at is None:
            return 0.0
        # NOTE: PostgreSQL's clock as the row was read where its query read it too (`DATABASE_NOW_AT_LOAD`, the
        # gateway's load every 2 s: a query of its own there, for as long as a failed scale-up's stamp stood)
        now = getattr(self, DATABASE_NOW_AT_LOAD, None) or database_now()
        return max(0.0, (self.next_attempt_at - now).total_seconds())

    @property
    def scale_up_backing_off(self) -> bool:
        """Its backoff (`next_attempt_at`) follows failures of replicas added while another served, none since with
        nothing READY: the model works, so it holds replicas beyond the first, never a start from none."""
        return self.num_scale_up_failures > 0 and self.num_failures_since_ready == 0

    @property
    def weights_scope(self) -> str:
        return weights_scope_for(self.organization_id, self.credential_id, self.model_source)

    @property
    def serving_task(self) -> str:
        """"generate" or "embed": the endpoint's `task`, or for "auto" what its model's architecture
        says once an agent has read it; "" while that is unknown (the engine decides)."""
        if self.task != ModelTask.AUTO:
            return self.task
        architecture = (ModelFacts.of(self.model_source, self.weights_scope).exclude(architecture="")
                        .values_list("architecture", flat=True).first())
        return task_of_architecture(architecture).value if architecture else ""

    @property
    def chat_template_tokens(self) -> tuple[int, int]:
        """What its model's chat template adds to a conversation (`ModelFacts.chat_template_tokens_of`)."""
        return ModelFacts.chat_template_tokens_of(self.model_source, self.weights_scope)

    @property
    def chat_template_measures(self) -> tuple[tuple[int, int], tuple[int, int] | None]:
        """That, and what it adds with a flag set (`ModelFacts.chat_template_measures_of`)."""
        return ModelFacts.chat_template_measures_of(self.model_source, self.weights_scope)

    @property
    def tokenizer_normalizer(self) -> dict | None:
        """What its model's tokenizer's normalizer does (`ModelFacts.tokenizer_normalizer_of`); None until known."""
        return ModelFacts.tokenizer_normalizer_of(self.model_source, self.weights_scope)

    @property
    def prompt_factor(self) -> Decimal | None:
        """What its calls' prompt bounds are multiplied by, learned from prompts that ran past them on the model it
        serves now (`PromptFactor`); None when none did."""
        return PromptFactor.of(self)

    @property
    def context_length(self) -> int:
        """The context the engine serves: the endpoint's own limit, else the model's, else a cautious guess."""
        return self.known_context_length() or UNKNOWN_CONTEXT_LENGTH

    def known_context_length(self, model_contexts: dict[tuple[str, str], int] | None = None) -> int | None:
        """`context_length` once it is known: the endpoint's own limit, else its model's as an agent described it;
        None before any did. `model_contexts`: `ModelFacts.context_lengths_of` read already for its copy."""
        if self.max_model_len is not None:
            return self.max_model_len
        copy = (self.model_source, self.weights_scope)
        if model_contexts is None:
            model_contexts = ModelFacts.context_lengths_of([copy])
        return model_contexts.get(copy)


# Until an agent has read a model's config, estimates (placement, the gateway's checks) assume this; so does an engine
# whose agent cannot read it either.
UNKNOWN_CONTEXT_LENGTH = UNKNOWN_CONTEXT_TOKENS


# NOTE: what a node reports of a model is what its machine says, and a machine holding one node's secret is trusted
# with nothing beyond its own replicas: a report outside what a model can be (and vLLM can serve) is refused whole.
# Before, a node set a shared model's context to 1 token or its size to 4 EiB, and every tenant's endpoint of it
# failed its calls or could not be placed.
MIN_PLAUSIBLE_CONTEXT_TOKENS = 256  # BERT-style encoders have 512; no servable model has less than this
MAX_PLAUSIBLE_CONTEXT_TOKENS = 2**24  # the longest contexts vLLM serves are ~10M tokens
MAX_PLAUSIBLE_NUM_PARAMS = 2**44  # ~17.6T parameters
MAX_PLAUSIBLE_TEMPLATE_TOKENS_PER_CONVERSATION = 8192  # long default system prompts are a few hundred
MAX_PLAUSIBLE_TEMPLATE_TOKENS_PER_MESSAGE = 1024
# Nodes whose disputed reports of one shared copy are kept (`ModelFacts.disputed`); the oldest go first.
MAX_DISPUTING_NODES = 16
# The facts a tenant's copy is reserved by (its context caps a prompt, its tokenizer and template bound one), merged
# over the nodes running it now (`ModelFacts.learn`): the largest, and a tokenizer two nodes describe differently is
# unknown (the gateway reserves the context).
RESERVATION_FACTS = ("max_model_len", "tokenizer_normalizer", "template_tokens_per_conversation",
                     "template_tokens_per_message", "template_tokens_flagged_per_conversation",
                     "template_tokens_flagged_per_message")
# Of those, what a replica's engine counted (its chat template): a replica's own claim, never a node's (`learn`).
TEMPLATE_COUNT_FACTS = tuple(name for name in RESERVATION_FACTS if name.startswith("template_tokens_"))
DIFFERING_TOKENIZERS = TokenizerNormalizer(unknown="its replicas read tokenizers that differ (two revisions)").to_dict()


def implausible_model_facts(values: dict) -> str:
    """Why `values` (`ModelFacts` fields) are not what a model can be; "" when they are plausible (a size past what
    its node could hold is `ModelFacts.learn`'s to leave out)."""
    context = values.get("max_model_len")
    if context is not None and not MIN_PLAUSIBLE_CONTEXT_TOKENS <= context <= MAX_PLAUSIBLE_CONTEXT_TOKENS:
        return f"a context of {context} tokens is outside {MIN_PLAUSIBLE_CONTEXT_TOKENS}..{MAX_PLAUSIBLE_CONTEXT_TOKENS}"
    if (values.get("num_params") or 0) > MAX_PLAUSIBLE_NUM_PARAMS:
        return f"{values['num_params']} parameters is past {MAX_PLAUSIBLE_NUM_PARAMS}"
    for name, most in (("template_tokens_per_conversation", MAX_PLAUSIBLE_TEMPLATE_TOKENS_PER_CONVERSATION),
                       ("template_tokens_per_message", MAX_PLAUSIBLE_TEMPLATE_TOKENS_PER_MESSAGE),
                       ("template_tokens_flagged_per_conversation", MAX_PLAUSIBLE_TEMPLATE_TOKENS_PER_CONVERSATION),
                       ("template_tokens_flagged_per_message", MAX_PLAUSIBLE_TEMPLATE_TOKENS_PER_MESSAGE)):
        if (values.get(name) or 0) > most:
            return f"{values[name]} chat template tokens is past {most}"
    return ""


def replica_key(replica_id) -> str:
    """A replica's claim's key in `ModelFacts.disputed`, apart from its node's (the node's id as text)."""
    return f"{_REPLICA_KEY_PREFIX}{replica_id}"


_REPLICA_KEY_PREFIX = "replica:"


def merged_claims(claims: dict[str, dict]) -> dict:
    """`RESERVATION_FACTS` as the nodes' `claims` ({node: {field: value}}) bound a reservation together: each count
    the largest any node reported, the tokenizer the one they all describe, else `differing_tokenizers` of theirs."""
    merged = {}
    for name in RESERVATION_FACTS:
        reported = [node_claims[name] for node_claims in claims.values() if node_claims.get(name) is not None]
        if not reported:
            continue
        if name == "tokenizer_normalizer":
            merged[name] = reported[0] if all(value == reported[0] for value in reported) else (
                differing_tokenizers(reported))
        else:
            merged[name] = max(reported)
    return merged


def differing_tokenizers(descriptions: list[dict]) -> dict:
    """Tokenizers that replicas of one copy read differently (two revisions, or two agent versions' describers during a
    rollout), as the gateway bounds a prompt by them: `DIFFERING_TOKENIZERS` (read as unknown by a gateway that knows
    no better), with each description (`alternatives`, in a fixed order) when all are known and at most
    `MAX_DIFFERING_TOKENIZERS`: each prompt is then reserved its largest bound among them, not the context.

    NOTE: every replica's engine reads one of these descriptions' tokenizers, so the largest bound is its bound too.
    Before, any difference reserved the whole context: a 1,000-space chat to a copy on two agent versions' nodes was
    reserved 32,768 prompt tokens (1,084 on either alone) until the last node was upgraded."""
    each = {}
    for description in descriptions:
        if not isinstance(description, dict):
            return DIFFERING_TOKENIZERS
        for one in description.get("alternatives") or [description]:
            if not isinstance(one, dict) or one.get("unknown"):
                return DIFFERING_TOKENIZERS
            each[json.dumps(one, sort_keys=True)] = one
    if len(each) > MAX_DIFFERING_TOKENIZERS:
        return DIFFERING_TOKENIZERS
    if len(each) == 1:
        return next(iter(each.values()))
    return DIFFERING_TOKENIZERS | {"alternatives": [each[key] for key in sorted(each)]}


class ModelFacts(models.Model):
    """What agents read from a model source's own files (its config.json and safetensors headers).

    NOTE: an agent's report is taken only for sources it runs replicas of now (`endpoints.fleet.services`),
    and kept in the scope those replicas read the source in (`weights_scope_for`): what one tenant's
    store served under a catalogue model's name is that tenant's fact, never every tenant's. How a report
    becomes a fact, and why one node cannot change a shared one: `learn`.
    """

    source = models.CharField(max_length=500)
    scope = models.CharField(max_length=40, blank=True, default="", db_default="")  # `weights_scope_for`: "" shared by every tenant
    max_model_len = models.PositiveIntegerField(null=True, blank=True)
    architecture = models.CharField(max_length=200, blank=True)
    num_params = models.BigIntegerField(null=True, blank=True)
    weights_bytes = models.BigIntegerField(null=True, blank=True)  # the checkpoint's files as stored
    # The checkpoint's `quantization_config` as `protocol.CheckpointQuantization.to_dict()`:
    # null = not read (an older agent), {"quant_method": ""} = it declares none.
    checkpoint_quantization = models.JSONField(null=True, blank=True)
    # What its chat template adds to a conversation, in tokens, as a READY engine counted it
    # (`protocol.ChatTemplateTokens`); null until one has. The gateway's estimate allows at least this.
    template_tokens_per_conversation = models.PositiveIntegerField(null=True, blank=True)
    template_tokens_per_message = models.PositiveIntegerField(null=True, blank=True)
    # The same with any flag or reasoning effort a request may set (`protocol.TEMPLATE_FLAGS`); null until measured,
    # and a request that sets one reserves the whole context.
    template_tokens_flagged_per_conversation = models.PositiveIntegerField(null=True, blank=True)
    template_tokens_flagged_per_message = models.PositiveIntegerField(null=True, blank=True)
    # What its tokenizer's normalizer does to a text's length (`protocol.TokenizerNormalizer.to_dict()`): null = not
    # read (an older agent), and the gateway's estimate bounds prompts as before (`endpoints.gateway.normalizers`).
    tokenizer_normalizer = models.JSONField(null=True, blank=True)
    # Of a shared copy (scope ""): what nodes reported that differs from the facts kept, by node id, {node: {field:
    # value}}; a value two nodes report replaces the kept one (`learn`). Of a tenant's copy: what each node running it
    # reported of `RESERVATION_FACTS`, which are kept merged.
    disputed = models.JSONField(default=dict, db_default={}, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name_plural = "model facts"
        constraints = [models.UniqueConstraint(fields=["source", "scope"], name="model_facts_source_scope_unique")]

    def __str__(self) -> str:
        return self.source

    @classmethod
    def of(cls, source: str, scope: str) -> models.QuerySet:
        """What is known of `source` read in `scope`: its own facts first, else the shared ones (a catalogue
        copy's, which no tenant writes), never another organisation's. Readers skip a row that lacks the
        fact they want (a copy still downloading has its size, not yet its config)."""
        return cls.objects.filter(source=source, scope__in={scope, ""}).order_by("-scope")

    @classmethod
    def learn(cls, source: str, scope: str, node_id, values: dict, *, max_weights_bytes: int | None = None,
              replica_id=None) -> str:
        """Keep what a node running a replica of this copy (`source` read in `scope`) read of it; returns why some or
        all of it was not kept ("" when all was).

        NOTE: a report outside what a model can be is refused whole (`implausible_model_facts`). A fact not known
        yet is learned from the first node that reports it. In a tenant's own scope the latest report stands (but for
        `RESERVATION_FACTS`, below): only nodes running that tenant's replicas report there. A shared copy's facts (scope "", every tenant's
        catalogue endpoints read them) are never changed by one node: a value that differs from the one kept is held
        as that node's dispute, and replaces it only once a second node reports the same value (a catalogue model
        updated upstream, read afresh). Before, the last node to report set them: one node made every tenant's
        endpoints of a model unplaceable (its size), refused their calls (its context) or over-reserved them (its
        chat template).

        NOTE: a tenant's copy is named by its source, not its content: replicas started before and after its branch
        moved (or its store's files were replaced) run two revisions, and each node's report replaced the other's, so
        the prompt bound flipped with every heartbeat, to the cheaper one's context and tokenizer while the costlier
        served. So each node's report of `RESERVATION_FACTS` is kept (in `disputed`), and the facts are those merged
        over the nodes running a replica of this copy now (`merged_claims`). What a replica's engine counted (its chat
        template, `replica_id`) is its own claim there: two replicas on one node may run two revisions (900 and 40
        tokens a conversation were kept as 40 while both served), and it stands while that replica is live.
        """
        # NOTE: a size past what the node could hold leaves the size out, not the report: an agent's size is every file
        # of the repository, and some hold the weights twice (`original/consolidated.00.pth` beside the safetensors),
        # so a genuine 8B model on one L4 was past it, and its context, architecture and task were never learned.
        left_out = ""
        size = values.get("weights_bytes")
        if size is not None and max_weights_bytes is not None and size > max_weights_bytes:
            values = {name: value for name, value in values.items() if name != "weights_bytes"}
            left_out = f"its size left out: {size} bytes is past the {max_weights_bytes} its node could hold"
        problem = implausible_model_facts(values)
        if problem:
            return problem
        if not values:
            return left_out
        node_key = replica_key(replica_id) if scope and replica_id is not None else str(node_id)
        claimed = {name: value for name, value in values.items() if name in RESERVATION_FACTS}
        with transaction.atomic():
            defaults = values | ({"disputed": {node_key: claimed}} if scope and claimed else {})
            facts, created = cls.objects.get_or_create(source=source, scope=scope, defaults=defaults)
            if created:
                return left_out
            facts = cls.objects.select_for_update().get(pk=facts.pk)
            if scope:
                claims = {node: claims for node, claims in facts.disputed.items() if node != node_key}
                if claims:  # NOTE: of the nodes running it now: once the other revision's replicas are gone, it goes
                    running = cls.running_claimants(source, scope)
                    claims = {node: claims for node, claims in claims.items() if node in running}
                if claimed or node_key in facts.disputed:
                    claims[node_key] = facts.disputed.get(node_key, {}) | claimed
                # NOTE: a template count is its replica's claim: one a node's claim still holds (kept before claims
                # were a replica's) stood while that node ran any replica of the copy (900 reserved for a 40 template).
                claims = {key: claim if key.startswith(_REPLICA_KEY_PREFIX) else
                          {name: value for name, value in claim.items() if name not in TEMPLATE_COUNT_FACTS}
                          for key, claim in claims.items()}
                claims = {key: claim for key, claim in claims.items() if claim}
                merged = values | merged_claims(claims)
                kept = {name: value for name, value in merged.items() if getattr(facts, name) != value}
                if kept or claims != facts.disputed:
                    cls.objects.filter(pk=facts.pk).update(**kept, disputed=claims, updated_at=timezone.now())
                return left_out
            changed = {name: value for name, value in values.items() if getattr(facts, name) != value}
            kept = {name: value for name, value in changed.items() if getattr(facts, name) in (None, "")}
            others = [claims for node, claims in facts.disputed.items() if node != node_key]
            kept |= {name: value for name, value in changed.items()
                     if name not in kept and any(claims.get(name) == value for claims in others)}
            disputed = {name: value for name, value in changed.items() if name not in kept}
            disputes = {node: claims for node, claims in facts.disputed.items() if node != node_key}
            if disputed:
                disputes[node_key] = disputed
            disputes = dict(list(disputes.items())[-MAX_DISPUTING_NODES:])
            if kept or disputes != facts.disputed:
                cls.objects.filter(pk=facts.pk).update(**kept, disputed=disputes, updated_at=timezone.now())
        disputed_note = f"disputed, kept until another node reports the same: {sorted(disputed)}" if disputed else ""
        return "; ".join(note for note in (left_out, disputed_note) if note)

    @staticmethod
    def running_claimants(source: str, scope: str) -> set[str]:
        """The keys of the claims that stand (`learn`): the nodes (ids as text) running a live replica of `source` read
        in `scope`, and those replicas (`replica_key`)."""
        # NOTE: a tenant's scope is one organisation's: its replicas alone are read, not every tenant's of a catalogue
        # name (sorted out here by their scope, a row each, unordered).
        rows = Replica.objects.filter(state__in=LIVE_REPLICA_STATES, endpoint__model_source=source).order_by()
        organization_id = organization_of_scope(scope)
        if organization_id is not None:
            rows = rows.filter(endpoint__organization_id=organization_id)
        rows = rows.values_list("pk", "node_id", "endpoint__organization_id", "endpoint__credential_id")
        running = [(replica, node) for replica, node, organization, credential in rows
                   if weights_scope_for(organization, credential, source) == scope]
        return {str(node) for _, node in running} | {replica_key(replica) for replica, _ in running}

    @classmethod
    def context_length_of(cls, source: str, scope: str) -> int | None:
        return cls.context_lengths_of([(source, scope)]).get((source, scope))

    @classmethod
    def context_lengths_of(cls, copies: Iterable[tuple[str, str]]) -> dict[tuple[str, str], int]:
        """The context of each copy (source, scope) as `of` finds it, in one query; a copy no agent described is
        left out."""
        copies = set(copies)
        if not copies:
            return {}
        kept = {(source, scope): context for source, scope, context in cls.objects.filter(
            source__in={source for source, _ in copies}, scope__in={scope for _, scope in copies} | {""},
        ).exclude(max_model_len=None).values_list("source", "scope", "max_model_len")}
        found = {(source, scope): kept.get((source, scope)) or kept.get((source, "")) for source, scope in copies}
        return {copy: context for copy, context in found.items() if context is not None}

    @classmethod
    def chat_template_tokens_of(cls, source: str, scope: str) -> tuple[int, int]:
        """(per conversation, per message) its chat template adds, as measured; (0, 0) until measured."""
        return cls.chat_template_measures_of(source, scope)[0]

    @classmethod
    def chat_template_measures_of(cls, source: str, scope: str) -> tuple[tuple[int, int], tuple[int, int] | None]:
        """`chat_template_tokens_of`, and the same with any flag a request may set (`protocol.TEMPLATE_FLAGS`), None
        until measured: one query."""
        measured = cls.of(source, scope).exclude(template_tokens_per_conversation=None).values_list(
            "template_tokens_per_conversation", "template_tokens_per_message",
            "template_tokens_flagged_per_conversation", "template_tokens_flagged_per_message").first()
        if not measured:
            return (0, 0), None
        flagged = None if measured[2] is None else (measured[2], measured[3] or 0)
        return (measured[0], measured[1] or 0), flagged

    @classmethod
    def tokenizer_normalizer_of(cls, source: str, scope: str) -> dict | None:
        """What its tokenizer's normalizer does (`protocol.TokenizerNormalizer.to_dict()`); None until an agent said."""
        return cls.of(source, scope).exclude(tokenizer_normalizer__isnull=True).values_list(
            "tokenizer_normalizer", flat=True).first()

    @classmethod
    def quantization_of(cls, source: str, scope: str) -> CheckpointQuantization | None:
        """What the source's config.json declares; None when no agent has read it yet."""
        stored = cls.of(source, scope).exclude(checkpoint_quantization__isnull=True).values_list(
            "checkpoint_quantization", flat=True).first()
        return CheckpointQuantization.from_dict(stored) if isinstance(stored, dict) else None


# The most a learned prompt factor can be: any factor past the context over the smallest bound (8 tokens) already
# reserves the whole context; this keeps the column's digits bounded.
MAX_PROMPT_FACTOR = Decimal(2**20)
# A factor is kept rounded up to this fraction: fewer, larger steps (a stream of requests each a little past the
# last factor writes a row each at most once per eighth).
PROMPT_FACTOR_STEP = 8


def prompt_factor_for(num_prompt_tokens: int, prompt_bounds: tuple[int, ...], max_model_len: int) -> Decimal:
    """The factor a request teaches: the least (rounded up to 1/`PROMPT_FACTOR_STEP`, at most `MAX_PROMPT_FACTOR`)
    that makes its prompts' bounds (before any factor), each multiplied and capped at the context as
    `WorstCase.scaled` does, add up to its engine's prompt tokens.

    NOTE: not the ratio of the totals: a bound already at the context grows no further, so a list with one such prompt
    (a completions list, embeddings inputs, a batch line) learned a ratio its scaled bounds never reached, and lost the
    rest of every call for ever (the review's "Hello" beside a padded prompt: 1.75, ~42 % of each call unbilled). The
    tokens past the capped bounds are what the others must cover: with the largest bounds capped one by one until the
    next largest stays under the context at the factor that covers the rest."""
    limit = max(1, max_model_len)
    bounds = sorted(prompt_bounds, reverse=True)
    num_capped, rest = 0, sum(bounds)
    for bound in bounds:
        # NOTE: integers only: at the factor (num_prompt_tokens - capped) / rest, this bound stays under the context.
        if rest <= 0 or bound * (num_prompt_tokens - num_capped * limit) < limit * rest:
            break
        num_capped, rest = num_capped + 1, rest - bound
    if rest <= 0:
        return MAX_PROMPT_FACTOR  # every bound reaches the context and the tokens are still more: the most there is
    # NOTE: past the bounds, so more than 1 (a factor of 1 or less would lower a reservation, never raise it).
    steps = max(PROMPT_FACTOR_STEP + 1, -(-(num_prompt_tokens - num_capped * limit) * PROMPT_FACTOR_STEP // rest))
    return min(MAX_PROMPT_FACTOR, Decimal(steps) / PROMPT_FACTOR_STEP)


class PromptFactor(models.Model):
    """What an endpoint's prompt bounds are multiplied by (`endpoints.gateway.estimate.WorstCase.scaled`): the highest
    ratio an engine's prompt tokens reached against a request's bound, learned from the loss (the gateway bills at
    most what it reserved, so a prompt past its bound was free past it).

    NOTE: per endpoint and per copy of the model it served (`model_source`, which names a revision, and the
    `weights_scope` read): another model, revision or copy starts fresh, and no tenant's requests raise another's
    reservations (the shared catalogue copy's `ModelFacts` are every tenant's). Only ever raised (`raise_to`: a
    conditional update, so of two writers the larger wins), and cleared only by staff (`services.reset_prompt_factor`).
    In PostgreSQL: Redis losing its memory loses no factor.
    """

    endpoint = models.ForeignKey(Endpoint, on_delete=models.CASCADE, related_name="prompt_factors")
    model_source = models.CharField(max_length=500)
    weights_scope = models.CharField(max_length=40, blank=True, default="")
    factor = models.DecimalField(max_digits=10, decimal_places=3)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["endpoint", "model_source", "weights_scope"],
                                               name="prompt_factor_endpoint_copy_unique")]

    def __str__(self) -> str:
        return f"{self.factor}× {self.model_source}"

    @classmethod
    def of(cls, endpoint: Endpoint) -> Decimal | None:
        return cls.objects.filter(endpoint=endpoint, model_source=endpoint.model_source,
                                  weights_scope=endpoint.weights_scope).values_list("factor", flat=True).first()

    @classmethod
    def raise_to(cls, endpoint_id, model_source: str, weights_scope: str, factor: Decimal) -> bool:
        """Keep `factor` for the endpoint's copy of its model unless a larger one is kept already; True when it was
        kept. Not for a deleted endpoint (its calls in flight may still finish).

        NOTE: a conditional update (`factor < new`), never a read then a write: PostgreSQL re-checks the condition
        on the row another writer just committed, so of two writers racing the larger factor stands."""
        factor = min(MAX_PROMPT_FACTOR, factor)
        if factor <= 1:
            return False
        copy = cls.objects.filter(endpoint_id=endpoint_id, model_source=model_source, weights_scope=weights_scope)
        if copy.filter(factor__lt=factor).update(factor=factor, updated_at=timezone.now()):
            return True
        if not copy.exists():
            if not Endpoint.objects.live().filter(pk=endpoint_id).exists():
                return False
            try:
                with transaction.atomic():
                    cls.objects.create(endpoint_id=endpoint_id, model_source=model_source, weights_scope=weights_scope,
                                       factor=factor)
                return True
            except IntegrityError:  # another writer created it first (or the endpoint's row is gone)
                pass
        # NOTE: a row another writer created since the update above (a smaller factor's, maybe): raised if smaller.
        # Returning at `exists()` let the smaller stand (`test_of_two_writers_racing_the_larger_factor_stands`).
        return bool(copy.filter(factor__lt=factor).update(factor=factor, updated_at=timezone.now()))


# Replicas that hold their node's memory (placement counts them) and those that serve or will serve.
ACTIVE_REPLICA_STATES = (ReplicaState.PENDING, ReplicaState.STARTING, ReplicaState.READY, ReplicaState.DRAINING)
SERVING_REPLICA_STATES = (ReplicaState.PENDING, ReplicaState.STARTING, ReplicaState.READY)
# Replicas whose engine process lives on a node: the active ones and the SLEEPING ones, which hold no
# GPU memory (placement does not count them) nor quota, and are billed as zero (`ReplicaSleep`).
LIVE_REPLICA_STATES = (*ACTIVE_REPLICA_STATES, ReplicaState.SLEEPING)


class ReplicaQuerySet(models.QuerySet):
    def active(self):
        return self.filter(state__in=ACTIVE_REPLICA_STATES)


def new_engine_key() -> str:
    """A replica's engine key, encrypted at rest (`controlplane.secrets`)."""
    return secrets_at_rest.encrypt(secrets.token_urlsafe(32))


class Replica(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    endpoint = models.ForeignKey(Endpoint, on_delete=models.CASCADE, related_name="replicas")
    node = models.ForeignKey("gpu_agent.Node", on_delete=models.SET_NULL, null=True, blank=True, related_name="replicas")
    state = models.CharField(max_length=16, choices=[(s.value, s.value.title()) for s in ReplicaState], default=ReplicaState.PENDING)
    address = models.CharField(max_length=200, blank=True)  # http://host:port, once READY
    failure_reason = models.TextField(blank=True)
    # GPU memory this replica holds on its node, for placement (weights plus KV cache).
    reserved_memory_mb = models.PositiveIntegerField(default=0)
    # The node's GPUs placement gave it (CUDA_VISIBLE_DEVICES); empty on nodes without a GPU list.
    gpu_indices = ArrayField(models.PositiveSmallIntegerField(), default=list, db_default=[], blank=True)
    # Its share of its GPU's memory when it shares the GPU with other replicas; None: whole GPUs.
    gpu_memory_fraction = models.FloatField(null=True, blank=True)
    num_restarts = models.PositiveIntegerField(default=0)
    # Latest figures from the agent's heartbeat.
    num_running = models.PositiveIntegerField(default=0)
    num_waiting = models.PositiveIntegerField(default=0)
    kv_cache_usage = models.FloatField(default=0.0)
    tokens_per_s = models.FloatField(default=0.0)
    # Prompt tokens its engine looked up in its prefix cache, and found there, since the engine started.
    num_prefix_cache_queries = models.PositiveBigIntegerField(default=0, db_default=0)
    num_prefix_cache_hits = models.PositiveBigIntegerField(default=0, db_default=0)
    progress = models.CharField(max_length=100, blank=True)
    progress_percent = models.FloatField(null=True, blank=True)
    # What the engine said it allocated once started (its log; `protocol.EngineMemory`), in MB.
    engine_weights_mb = models.PositiveIntegerField(null=True, blank=True)
    engine_kv_cache_mb = models.PositiveIntegerField(null=True, blank=True)
    # The agent's measure of its cold start (`gpu_agent.protocol.ReplicaStatus`): see `endpoints.gateway.anatomy`.
    download_s = models.FloatField(null=True, blank=True)
    engine_start_s = models.FloatField(null=True, blank=True)
    # When the control plane last asked its sleeping engine to wake (`replicas.wake_replica`); the next READY
    # is a wake, not a cold start (`endpoints.gateway.anatomy`).
    woken_at = models.DateTimeField(null=True, blank=True)

    # Its endpoint's `engine_generation` when it was placed: the configuration its engine starts with.
    engine_generation = models.PositiveIntegerField(default=0, db_default=0, editable=False)
    # LoRA adapters its engine holds now (as its agent reported), most recently used first.
    adapters = ArrayField(models.CharField(max_length=63), default=list, db_default=[], blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    state_changed_at = models.DateTimeField(default=timezone.now)
    ready_at = models.DateTimeField(null=True, blank=True)
    stopped_at = models.DateTimeField(null=True, blank=True)
    # When the platform took it off its node for a reason of its own while it served or slept (its node drained, lost,
    # retired or unfit; a sleeper whose node could not wake it): the replica that replaces it is no start of its
    # organisation's (`quota_room.replica_starts`). None: it ended, if it did, by its tenant's doing or its own.
    moved_at = models.DateTimeField(null=True, blank=True)
    # NOTE: the engine's key (random per replica, Fernet-encrypted): the agent hands it to the engine,
    # the gateway sends it; nothing else can call the engine.
    encrypted_engine_key = models.TextField(default=new_engine_key, editable=False)

    objects = ReplicaQuerySet.as_manager()

    class Meta:
        ordering = ["created_at"]
        indexes = [models.Index(fields=["endpoint", "state"]), models.Index(fields=["node", "state"]),
                   # an organisation's starts in the last hour (`quota_room.replica_starts`): rows stay when they stop
                   models.Index(fields=["endpoint", "created_at"], name="replica_endpoint_created"),
                   # and the moves of the last hour beside them: few rows, so only those
                   models.Index(fields=["endpoint", "moved_at"], name="replica_endpoint_moved",
                                condition=models.Q(moved_at__isnull=False))]

    @property
    def prefix_cache_hit_percent(self) -> float:
        """Share of the prompt tokens its engine looked up that its prefix cache held, 0..100."""
        return 100 * self.num_prefix_cache_hits / self.num_prefix_cache_queries if self.num_prefix_cache_queries else 0.0

    def __str__(self) -> str:
        return f"{self.endpoint.name}/{str(self.id)[:8]}"

    @property
    def engine_api_key(self) -> str:
        return secrets_at_rest.decrypt(self.encrypted_engine_key)


class ReplicaSleep(models.Model):
    """One time a replica slept (SLEEPING): its GPU-seconds stop from `started_at` to `ended_at`
    (`billing.cost_truth`). Written only by `endpoints.replicas`."""

    replica = models.ForeignKey(Replica, on_delete=models.CASCADE, related_name="sleeps")
    started_at = models.DateTimeField(default=timezone.now)
    ended_at = models.DateTimeField(null=True, blank=True)  # null: asleep now

    class Meta:
        ordering = ["started_at"]
        indexes = [models.Index(fields=["replica", "started_at"])]


class EventKind(models.TextChoices):
    CONFIG = "config", "Configuration"
    SCALE = "scale", "Scaling decision"
    REPLICA = "replica", "Replica state"
    COLD_START = "cold_start", "Cold start"
    FAILURE = "failure", "Failure"
    CAPACITY = "capacity", "Capacity"
    BATCH = "batch", "Batch work"


class EndpointEvent(models.Model):
    """The endpoint's log a user reads: scaling decisions, replica states, cold starts, failures."""

    endpoint = models.ForeignKey(Endpoint, on_delete=models.CASCADE, related_name="events")
    replica = models.ForeignKey(Replica, on_delete=models.SET_NULL, null=True, blank=True, related_name="events")
    kind = models.CharField(max_length=16, choices=EventKind.choices)
    message = models.CharField(max_length=300)
    details = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return self.message


class AdapterState(models.TextChoices):
    PENDING = "PENDING", "Pending"  # not yet loaded by any replica (loads on first use)
    READY = "READY", "Ready"  # a replica loaded it once: the files and the base model agree
    FAILED = "FAILED", "Failed"  # an engine refused it, or a load failed (`failure_retried`); `status_message` says why


class Adapter(models.Model):
    """A LoRA adapter served by its endpoint's replicas. Calls name it `"<endpoint>:<adapter>"`."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    endpoint = models.ForeignKey(Endpoint, on_delete=models.CASCADE, related_name="adapters")
    name = models.SlugField(max_length=63)
    source = models.CharField(max_length=500)  # like a model source: hf:, s3:// or an allowed local path
    # NOTE: SET_NULL as an endpoint's: `delete_credential` refuses while a live endpoint's adapter names it.
    credential = models.ForeignKey(ModelCredential, on_delete=models.SET_NULL, null=True, blank=True, related_name="adapters")
    rank = models.PositiveSmallIntegerField(null=True, blank=True)  # declared (adapter_config.json "r"), if known
    base_model = models.CharField(max_length=500, blank=True)  # adapter_config.json "base_model_name_or_path"
    # Own prices per million tokens; None: the endpoint's.
    price_input_per_million = models.DecimalField(max_digits=12, decimal_places=6, null=True, blank=True)
    price_output_per_million = models.DecimalField(max_digits=12, decimal_places=6, null=True, blank=True)
    state = models.CharField(max_length=16, choices=AdapterState.choices, default=AdapterState.PENDING)
    status_message = models.CharField(max_length=300, blank=True)
    # FAILED for a passing reason its agent tries again (`ReplicaStatus.adapter_failures_retried`: the store
    # unreachable, a disk full): calls are held for it as for a load. False: the failure stands (400 `adapter_failed`).
    failure_retried = models.BooleanField(default=False, db_default=False)
    last_requested_at = models.DateTimeField(null=True, blank=True)  # the last call that named it
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]
        constraints = [models.UniqueConstraint(fields=["endpoint", "name"], name="adapter_name_unique_in_endpoint")]

    def __str__(self) -> str:
        return f"{self.endpoint.name}:{self.name}"


class AdapterPrice(models.Model):
    """The prices staff set on an endpoint's adapter name (`services.set_prices`), kept when the adapter is deleted: an
    adapter created again under that name (or with the same source) starts at them (`adapters.create_adapter`).

    NOTE: the prices lived on the adapter's row alone, and a tenant deleting and creating it again (same name, same
    source: all the API allows) was billed at the endpoint's prices, 40 times less for one staff had priced."""

    endpoint = models.ForeignKey(Endpoint, on_delete=models.CASCADE, related_name="adapter_prices")
    name = models.SlugField(max_length=63)
    source = models.CharField(max_length=500, blank=True)  # the priced adapter's, when its prices were last set
    price_input_per_million = models.DecimalField(max_digits=12, decimal_places=6, null=True, blank=True)
    price_output_per_million = models.DecimalField(max_digits=12, decimal_places=6, null=True, blank=True)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["endpoint", "name"], name="adapter_price_unique_in_endpoint")]

    def __str__(self) -> str:
        return f"{self.endpoint_id}:{self.name}"
