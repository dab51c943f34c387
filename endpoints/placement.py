"""Placement: which node runs a new replica (the policy; `replicas.place_replica` creates it).

Best fit by free GPU memory on READY nodes of the endpoint's GPU type whose
engine supports the endpoint's quantization and whose registered host the gateway may reach (`Node.host_problem`), preferring nodes that already hold
the weights (a copy they were given: `nodes_holding_weights`) and spreading one endpoint's replicas over nodes. A node
where the endpoint's replicas failed since one of them was last READY ranks below the others (`failures_here`): its
retry goes elsewhere first. Never over-commits: a node's reservations never exceed its GPU memory.

GPUs are units on nodes that reported them (`Node.gpus`): a replica gets
`gpus_per_replica` whole GPUs of one node that nobody else holds (tensor parallel
when more than one), best fit per GPU; only replicas of endpoints that allow
sharing go several to one GPU, each with its fraction of the GPU's memory
(`assign_gpus`). Nodes without a GPU list (CPU nodes, older agents) are one pool.

A SLEEPING replica (vLLM sleep mode) holds no GPU memory here: its weights are in its node's host
memory and its KV cache is freed, so its GPUs are placeable while it sleeps; it wakes only if its own
GPUs still have room (`room_to_wake`), else it is stopped and a replica placed afresh. The host memory sleepers hold
is counted instead: a replica sleeps only while its node's sleepers fit in a share of the node's memory
(`room_to_sleep`), else it stops.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from django.db.models import Count, Max

from endpoints.catalogue import GPU_TYPES, GPUS_PER_REPLICA
from endpoints.models import (
    AllowedSource,
    Endpoint,
    ModelFacts,
    Replica,
    is_catalogue_source,
    organization_scope,
    weights_scope_for,
)
from endpoints.nodes.models import Node
from gpu_agent.protocol import CPU_WEIGHT_FACTOR, QUANTIZATION_FACTS, ReplicaState

# Without a size from an agent's weights cache or the model's name, assume a small model; the
# agent reports the real size after its first download and later placements use it.
DEFAULT_WEIGHTS_MB = 1024
BYTES_PER_PARAMETER = 2  # bf16 checkpoints
# KV cache per token scales with the model: about 128 KiB for an 8B Llama with GQA (16 GB of weights).
KV_BYTES_PER_TOKEN_PER_WEIGHT_BYTE = 8e-6
# CPU engines get a KV cache of at most the agent's --cpu-kv-cache-gib (1 GiB; less when their sequences
# fill less, `gpu_agent.runtime.engine.cpu_kv_cache_bytes`) plus Python and runtime: reserved whole.
CPU_KV_CACHE_MB = 1024
CPU_ENGINE_OVERHEAD_MB = 768
# NOTE: at most six digits before the point: a name like "x-<300 nines>B" is no model size (and would
# overflow a float).
PARAMETERS_IN_NAME = re.compile(r"(?<![0-9.])(\d{1,6}(?:\.\d{1,6})?)[bB](?![a-zA-Z])")


def reported_weights_size_mb(endpoint: Endpoint) -> int | None:
    """The size of this model source's checkpoint as stored, as a node running it reported (`ModelFacts`, in
    the endpoint's weights scope); None if none has.

    NOTE: never from what a node merely lists in its cache: a node with no replica of a source reporting
    it at a petabyte made it unplaceable for every endpoint on it."""
    size = (ModelFacts.of(endpoint.model_source, endpoint.weights_scope).exclude(weights_bytes=None)
            .values_list("weights_bytes", flat=True).first())
    return max(1, size // (1024 * 1024)) if size else None


def reported_weights_sizes_mb(endpoints: list[Endpoint]) -> dict[object, int | None]:
    """`reported_weights_size_mb` of each of `endpoints`, by its primary key: two queries however many endpoints and
    model sources (the catalogue's patterns, which each one's scope depends on: `weights_scope_for`; the sizes)."""
    # NOTE: the catalogue's patterns read once: read for each source, a node whose sleepers ran many tenants' own
    # models took a query a model under its row lock (a review's finding)
    patterns = list(AllowedSource.objects.values_list("pattern", flat=True)) if endpoints else []
    catalogue = {source: is_catalogue_source(source, patterns)
                 for source in {endpoint.model_source for endpoint in endpoints}}
    keys = {endpoint.pk: (endpoint.model_source, "" if endpoint.credential_id is None and catalogue[endpoint.model_source]
                          else organization_scope(endpoint.organization_id)) for endpoint in endpoints}
    found: dict[tuple[str, str], int] = {}
    if keys:
        rows = (ModelFacts.objects.filter(source__in={source for source, _ in keys.values()},
                                          scope__in={scope for _, scope in keys.values()} | {""})
                .exclude(weights_bytes=None).values_list("source", "scope", "weights_bytes"))
        for source, scope, size in rows:
            found[(source, scope)] = size
    # As `ModelFacts.of`: the copy's own facts first, else the shared ones.
    sizes = {pk: found.get(key, found.get((key[0], ""))) for pk, key in keys.items()}
    return {pk: max(1, size // (1024 * 1024)) if size else None for pk, size in sizes.items()}


def weights_size_mb(endpoint: Endpoint) -> int:
    """The largest size any agent reported for this model source; else what its name says (…-8B…); else a guess."""
    reported = reported_weights_size_mb(endpoint)
    return guessed_weights_size_mb(endpoint) if reported is None else reported


def guessed_weights_size_mb(endpoint: Endpoint) -> int:
    """A 16-bit checkpoint's size from the model's name (…-8B…); else a small model's."""
    match = PARAMETERS_IN_NAME.search(endpoint.model_source.rsplit("/", 1)[-1])
    if match:
        return int(float(match.group(1)) * 1e9 * BYTES_PER_PARAMETER / (1024 * 1024))
    return DEFAULT_WEIGHTS_MB


def weight_factor(quantization: str, gpu_type: str, *, checkpoint_is_quantized: bool = False) -> float:
    """Engine weight memory over a 16-bit checkpoint's size (`protocol.QUANTIZATION_FACTS`).

    A pre-quantized method (awq, gptq) applied to a checkpoint's reported size is 1.0: the files
    are already 4-bit; its factor applies only to a 16-bit size guessed from the model's name.
    """
    facts = QUANTIZATION_FACTS.get(quantization)
    if facts is None:
        return 1.0
    if facts.checkpoint_methods and checkpoint_is_quantized:
        return 1.0
    if gpu_type == "cpu":
        return CPU_WEIGHT_FACTOR.get(quantization, facts.weight_factor)
    return facts.weight_factor


def _engine_weights_mb(endpoint: Endpoint, weights_mb: int | None = None) -> tuple[float, float]:
    """(What the engine's weights take, the model's 16-bit size): from the checkpoint's size as stored
    (`weights_mb`, else what agents reported), else the size its name suggests."""
    reported = reported_weights_size_mb(endpoint) if weights_mb is None else weights_mb
    size_mb = guessed_weights_size_mb(endpoint) if reported is None else reported
    weights = size_mb * weight_factor(endpoint.quantization, endpoint.gpu_type, checkpoint_is_quantized=reported is not None)
    facts = QUANTIZATION_FACTS.get(endpoint.quantization)
    if reported is not None and facts is not None and facts.checkpoint_methods:
        return weights, size_mb / facts.weight_factor  # 4-bit files of a model whose KV cache is 16-bit's
    return weights, size_mb


def estimated_weights_mb(endpoint: Endpoint) -> int:
    """What placement expects the engine's weights to take (checked against the engine's own report)."""
    return math.ceil(_engine_weights_mb(endpoint)[0])


def memory_needed_mb(endpoint: Endpoint, weights_mb: int | None = None) -> int:
    """Memory one replica reserves on its node: weights (after quantization) plus its KV cache.

    `weights_mb`, when given, is the checkpoint's size as stored (what an agent reports).
    """
    weights, weights_mb = _engine_weights_mb(endpoint, weights_mb)
    if endpoint.gpu_type == "cpu":
        return math.ceil(weights + CPU_KV_CACHE_MB + CPU_ENGINE_OVERHEAD_MB)
    kv_per_token = weights_mb * 1024 * 1024 * KV_BYTES_PER_TOKEN_PER_WEIGHT_BYTE
    kv_cache = endpoint.context_length * min(endpoint.max_num_seqs, 32) * kv_per_token / (1024 * 1024)
    return math.ceil((weights + kv_cache) * 1.1)  # 10% for activations and the CUDA context


# What one engine may take of a GPU it has to itself (vLLM's default `--gpu-memory-utilization`);
# replicas sharing a GPU together take no more, so the driver's own reservation stays free.
WHOLE_GPU_MEMORY_FRACTION = 0.9


def smallest_gpu_count(endpoint: Endpoint, needed_mb: int | None = None) -> int | None:
    """The fewest GPUs per replica (of `GPUS_PER_REPLICA`) whose memory holds the replica's estimate; None if none do.

    CPU endpoints run on one engine per replica: 1 if it fits, else None.
    """
    needed_mb = memory_needed_mb(endpoint) if needed_mb is None else needed_mb
    gpu_memory_mb = GPU_TYPES[endpoint.gpu_type].memory_mb
    counts = (1,) if endpoint.gpu_type == "cpu" else GPUS_PER_REPLICA
    return next((count for count in counts if math.ceil(needed_mb / count) <= gpu_memory_mb), None)


@dataclass(slots=True, frozen=True)
class GpuHold:
    """What one active replica holds on its node: GPU indices (empty: the pooled memory) and memory."""

    gpu_indices: tuple[int, ...]
    reserved_mb: int
    shared: bool  # placed with a memory fraction, beside other sharing replicas


@dataclass(slots=True, frozen=True)
class GpuAssignment:
    gpu_indices: tuple[int, ...]
    memory_fraction: float | None  # of each GPU's memory when sharing; None: whole GPUs
    free_after_mb: int  # what the node's placeable GPUs have left after it (best fit packs)


@dataclass(slots=True, frozen=True)
class PlacementDecision:
    node: Node | None
    reason: str  # why this node, or why none: the tenant reads it (events, `status_message`)
    gpu_indices: tuple[int, ...] = ()
    gpu_memory_fraction: float | None = None
    # NOTE: what the fleet has free (the most on one node or GPU) is staff's only (`place_replica` logs it): a tenant's
    # `reason` carries no figure of other tenants' or the fleet's memory, only what its own replica needs. Before, it
    # read "the most free on a l4 node is 1024 MB": any tenant could watch the fleet's capacity through its events.
    fleet_detail: str = ""


def nodes_holding_weights(endpoint: Endpoint, candidates: list[Node]) -> set:
    """The ids of `candidates` whose claim to hold a complete copy of the endpoint's weights counts.

    NOTE: a node's claim (its heartbeat's weights cache) counts only for a copy the control plane gave it: the
    endpoint's source, read in the endpoint's weights scope, of which the node was placed a replica (any state:
    the cache outlives it). Before, any claim counted: a node holding one secret claimed every source complete and
    was preferred for the first replica of every endpoint, another tenant's private model included (its spec's
    credentials, its prompts).
    """
    source, scope = endpoint.model_source, endpoint.weights_scope
    claiming = [node.pk for node in candidates if any(
        w.get("source") == source and w.get("complete") and w.get("scope") in (None, scope)
        for w in (node.last_status or {}).get("weights", []))]
    if not claiming:
        return set()
    given = (Replica.objects.filter(node__in=claiming, endpoint__model_source=source).order_by()
             .values_list("node", "endpoint__organization", "endpoint__credential").distinct())
    return {node_id for node_id, organization_id, credential_id in given
            if weights_scope_for(organization_id, credential_id, source) == scope}


def failures_here(endpoint: Endpoint, candidates: list[Node]) -> dict:
    """Node id -> how many of the endpoint's replicas FAILED on it since one of its replicas was last READY
    (`Replica.ready_at`, a wake's included; every failure when none ever was), for `candidates` with any.

    NOTE: placement ranks these nodes below the others, ahead of the weights they hold: a FAILED replica is not live,
    so the node where it just failed (an ECC or driver error, a start that timed out) counted no replica of the
    endpoint, still held its weights and stood empty, and won every retry until the endpoint was FAILED for good,
    while a healthy node stood by (a review's finding). Still placed on when no other node fits.
    """
    replicas = Replica.objects.filter(endpoint=endpoint)
    last_ready_at = replicas.aggregate(last=Max("ready_at"))["last"]
    failed = replicas.filter(state=ReplicaState.FAILED, node__in=candidates)
    if last_ready_at is not None:
        failed = failed.filter(stopped_at__gt=last_ready_at)
    return dict(failed.order_by().values_list("node").annotate(num=Count("pk")))


@dataclass(slots=True)
class _GpuRoom:
    index: int
    memory_mb: int
    used_mb: int = 0
    exclusive: bool = False  # a replica has it to itself
    num_holders: int = 0

    @property
    def free_mb(self) -> int:
        return 0 if self.exclusive else self.memory_mb - self.used_mb


def _gpu_rooms(node: Node, holds: list[GpuHold]) -> dict[int, _GpuRoom]:
    """The node's placeable GPUs with what its replicas hold of each (MIG-partitioned GPUs are not placeable)."""
    rooms = {gpu["index"]: _GpuRoom(gpu["index"], gpu["memory_mb"]) for gpu in node.gpus if not gpu.get("mig_slices")}
    for hold in holds:
        # NOTE: a replica placed before its node reported GPUs runs without CUDA_VISIBLE_DEVICES,
        # that is on GPU 0: count it there, whole.
        indices = hold.gpu_indices or (0,)
        for index in indices:
            if index in rooms:
                room = rooms[index]
                room.used_mb += math.ceil(hold.reserved_mb / len(indices))
                room.exclusive = room.exclusive or not hold.shared or not hold.gpu_indices
                room.num_holders += 1
    return rooms


def assign_gpus(node: Node, holds: list[GpuHold], *, num_gpus: int, needed_mb: int, share: bool) -> GpuAssignment | None:
    """The GPUs of `node` a new replica gets, best fit; None when they are not free.

    Without sharing a replica takes `num_gpus` GPUs nobody else holds, each with room for its share
    of `needed_mb` (tensor parallel splits weights and KV cache evenly). A sharing one-GPU replica
    goes beside other sharing replicas on the fullest GPU with room, and gets the fraction of its
    memory it reserved; the fractions on one GPU sum to at most `WHOLE_GPU_MEMORY_FRACTION`.
    """
    rooms = _gpu_rooms(node, holds)
    if share and num_gpus == 1:
        fitting = [room for room in rooms.values()
                   if not room.exclusive and room.used_mb + needed_mb <= room.memory_mb * WHOLE_GPU_MEMORY_FRACTION]
        if not fitting:
            return None
        room = min(fitting, key=lambda room: (room.memory_mb * WHOLE_GPU_MEMORY_FRACTION - room.used_mb - needed_mb, room.index))
        # NOTE: rounded down, so the fractions on one GPU never sum past what placement reserved.
        fraction = max(0.001, math.floor(needed_mb / room.memory_mb * 1000) / 1000)
        left = sum(other.free_mb for other in rooms.values()) - needed_mb
        return GpuAssignment((room.index,), fraction, left)
    per_gpu_mb = math.ceil(needed_mb / num_gpus)
    idle = [room for room in rooms.values() if room.num_holders == 0 and room.memory_mb >= per_gpu_mb]
    if len(idle) < num_gpus:
        return None
    chosen = sorted(idle, key=lambda room: (room.memory_mb, room.index))[:num_gpus]
    left = sum(room.free_mb for room in rooms.values()) - sum(room.memory_mb for room in chosen)
    return GpuAssignment(tuple(sorted(room.index for room in chosen)), None, left)


def _no_gpus_decision(endpoint: Endpoint, needed_mb: int, nodes: list[Node], holds: dict) -> PlacementDecision:
    num_gpus = endpoint.gpus_per_replica
    if endpoint.allow_gpu_sharing and num_gpus == 1:
        most = max((room.memory_mb * WHOLE_GPU_MEMORY_FRACTION - room.used_mb
                    for node in nodes for room in _gpu_rooms(node, holds.get(node.pk, [])).values() if not room.exclusive),
                   default=0)
        return PlacementDecision(
            None, f"no {endpoint.gpu_type} GPU has {needed_mb} MB free to share now",
            fleet_detail=f"needs {needed_mb} MB of a shared GPU, the most free on one {endpoint.gpu_type} GPU is "
                         f"{max(0, int(most))} MB")
    per_gpu_mb = math.ceil(needed_mb / num_gpus)
    most = max((sum(room.num_holders == 0 and room.memory_mb >= per_gpu_mb for room in _gpu_rooms(node, holds.get(node.pk, [])).values())
                for node in nodes), default=0)
    gpus = "a free GPU" if num_gpus == 1 else f"{num_gpus} free GPUs"
    return PlacementDecision(
        None, f"no {endpoint.gpu_type} node has {gpus} with {per_gpu_mb} MB each now",
        fleet_detail=f"needs {gpus}{'' if num_gpus == 1 else ' on one node'} with {per_gpu_mb} MB each, the most on one "
                     f"{endpoint.gpu_type} node is {most} free GPU{'' if most == 1 else 's'}")


def bills_by_catalogue_context(endpoint: Endpoint) -> bool:
    """Whether its calls are billed by a catalogue copy's context as the control plane keeps it (the first node's
    description: `ModelFacts.learn`), which its replicas' specs carry (`ReplicaSpec.billed_context_tokens`).

    NOTE: an agent older than that field launched with its own reading of the copy, which may be larger: such an
    endpoint's replicas go to nodes whose agents say they launch within it (`Node.launches_within_billed_context`).
    Its own `max_model_len`, or a tenant's own copy's (the largest its running nodes read: `merged_claims`), is any
    agent's to launch with; so is a context not known yet, which the spec does not carry."""
    return endpoint.max_model_len is None and endpoint.weights_scope == "" and endpoint.known_context_length() is not None


def choose_node(endpoint: Endpoint, needed_mb: int, candidates: list[Node], used_mb: dict, replicas_here: dict,
                holds: dict | None = None, holding_weights: set | None = None,
                failed_here: dict | None = None) -> PlacementDecision:
    """The node (and on nodes that reported their GPUs, the GPUs) for a new replica of `endpoint`.

    `used_mb` and `holds` are what active replicas hold per node (`GpuHold`s). Nodes without a GPU
    list (CPU nodes, older agents) are one pool of `num_gpus` × `gpu_memory_mb`. `holding_weights`:
    the ids of nodes that hold its weights (`nodes_holding_weights`), preferred. `failed_here`: node id -> the
    endpoint's replicas that failed there of late (`failures_here`), fewer preferred, before the weights.
    """
    holds = holds or {}
    holding_weights = holding_weights or set()
    failed_here = failed_here or {}
    if not candidates:
        return PlacementDecision(None, f"no READY node of GPU type {endpoint.gpu_type}")
    # NOTE: a node whose registered host the gateway refuses (`Node.host_problem`) would fail every replica it
    # got (its engine's address is refused) and win the next placement again: it takes none.
    reachable = [n for n in candidates if not n.host_problem()]
    if not reachable:
        return PlacementDecision(None, f"no READY node of GPU type {endpoint.gpu_type} the gateway may reach")
    supported = [n for n in reachable if endpoint.quantization in n.quantizations]
    if not supported:
        return PlacementDecision(None, f"no {endpoint.gpu_type} node supports quantization {endpoint.quantization}")
    if bills_by_catalogue_context(endpoint):
        within = [n for n in supported if n.launches_within_billed_context()]
        if not within:
            return PlacementDecision(None, f"no {endpoint.gpu_type} node runs an agent that launches engines within "
                                           "the context its calls are billed by (their agents are older)")
        supported = within
    num_gpus = endpoint.gpus_per_replica
    options = []  # (node, assignment or None for a pooled node, free memory after)
    for node in supported:
        if node.gpus:
            assignment = assign_gpus(node, holds.get(node.pk, []), num_gpus=num_gpus, needed_mb=needed_mb,
                                     share=endpoint.allow_gpu_sharing)
            if assignment is not None:
                options.append((node, assignment, assignment.free_after_mb))
        elif max(node.num_gpus, 1) >= num_gpus:
            free_after = node.total_gpu_memory_mb - used_mb.get(node.pk, 0) - needed_mb
            if free_after >= 0:
                options.append((node, None, free_after))
    if not options:
        per_gpu_nodes = [n for n in supported if n.gpus]
        if per_gpu_nodes:
            return _no_gpus_decision(endpoint, needed_mb, per_gpu_nodes, holds)
        pooled = [n for n in supported if max(n.num_gpus, 1) >= num_gpus]
        if not pooled:
            return PlacementDecision(None, f"needs {num_gpus} GPUs on one node, no {endpoint.gpu_type} node has that many")
        # NOTE: clamped, as the sharing figure is: an overcommitted node (its reservations past its memory, after a
        # heartbeat lowered it) has none free, not a negative amount.
        largest = max(0, *(n.total_gpu_memory_mb - used_mb.get(n.pk, 0) for n in pooled))
        return PlacementDecision(None, f"no {endpoint.gpu_type} node has {needed_mb} MB of GPU memory free now",
                                 fleet_detail=f"needs {needed_mb} MB of GPU memory, the most free on a "
                                              f"{endpoint.gpu_type} node is {largest} MB")

    def preference(option):
        node, _, free_after = option
        return (replicas_here.get(node.pk, 0), failed_here.get(node.pk, 0), node.pk not in holding_weights, free_after,
                node.name)

    node, assignment, _ = min(options, key=preference)
    if assignment is None:
        return PlacementDecision(node, "best fit")
    gpus = ",".join(map(str, assignment.gpu_indices))
    shared = f", sharing at {assignment.memory_fraction:.3f}" if assignment.memory_fraction is not None else ""
    return PlacementDecision(node, f"best fit, GPU {gpus}{shared}", assignment.gpu_indices, assignment.memory_fraction)


# The share of a node's memory (`Node.memory_mb`: the host's, or its agent container's limit where that is less) its
# sleeping replicas may hold together (vLLM's level-1 sleep copies an engine's weights to host memory). The rest is
# what nothing counts: each engine's own process (Python, torch, CUDA's libraries: several GB each, asleep or not), the
# agent, the engines' shared memory (/dev/shm) and the page cache weights load through. Past the container's limit the
# kubelet kills the agent's container whole, every tenant's engine of the node with it; past the host's, the kernel's
# OOM killer takes an engine.
SLEEPERS_HOST_MEMORY_FRACTION = 0.5


_UNREAD = object()


def host_memory_asleep_mb(replica: Replica, reported_mb: int | None | object = _UNREAD) -> int:
    """The host memory `replica` holds asleep: its engine's weights (the largest of the figures below).

    - its engine's own report (`engine_weights_mb`, one worker's share: times its GPUs). It is read from the engine's
      log, which prints text a tenant's files hold, so it may raise the figure, never lower it;
    - the control plane's estimate of the weights from the checkpoint's size a node measured (`estimated_weights_mb`);
    - with no size measured, its whole reservation (`reserved_memory_mb`: weights and KV cache): a guess from the
      model's name (or a small model's) is no bound.

    `reported_mb`: `reported_weights_size_mb` of its endpoint, where the caller read it (`reported_weights_sizes_mb`).
    """
    engine_mb = (replica.engine_weights_mb or 0) * max(1, len(replica.gpu_indices))
    endpoint = replica.endpoint
    reported = reported_weights_size_mb(endpoint) if reported_mb is _UNREAD else reported_mb
    control_plane_mb = (math.ceil(_engine_weights_mb(endpoint, reported)[0]) if reported is not None
                        else replica.reserved_memory_mb)
    return max(engine_mb, control_plane_mb, 1)


def node_memory_mb(node: Node) -> int:
    """The node's memory: the least of what its agent registered and what its last heartbeat says (0: unknown).

    NOTE: an agent older than its cgroup's limit registered the host's memory; upgraded, its heartbeats say the limit,
    and a node keeps its registration."""
    beat = (node.last_status or {}).get("memory_mb")
    figures = [figure for figure in (node.memory_mb, beat) if isinstance(figure, int) and figure > 0]
    return min(figures, default=0)


def room_to_sleep(node: Node, asleep_mb: int, sleeper_mb: int) -> str:
    """Why a replica of `sleeper_mb` cannot sleep on `node`, whose sleepers hold `asleep_mb` of its host memory; "" when
    it can. Said to its tenant: no figure of what other tenants' sleepers hold (`replicas.sleep_replica` logs it)."""
    memory_mb = node_memory_mb(node)
    if not memory_mb:
        return "its node did not report its memory"
    if asleep_mb + sleeper_mb > memory_mb * SLEEPERS_HOST_MEMORY_FRACTION:
        return "its node's host memory for sleeping replicas is full"
    return ""


def room_to_wake(node: Node, holds: list[GpuHold], used_mb: int, sleeper: GpuHold) -> str:
    """Why a sleeping replica cannot wake on its own GPUs of `node`; "" when they have room for it again. Said to its
    tenant: no figure of what the node has free (`wake_replica` logs it for staff).

    A sleeping replica holds none of its GPUs' memory (its weights are in host memory), so placement may
    have given that memory to another replica meanwhile; the engine wakes on the GPUs it was started on
    (CUDA_VISIBLE_DEVICES), so only those count. `holds` and `used_mb` are what the node's active
    replicas hold now.
    """
    if not node.gpus:
        free = node.total_gpu_memory_mb - used_mb
        return "" if free >= sleeper.reserved_mb else f"its node no longer has the {sleeper.reserved_mb} MB it needs free"
    rooms = _gpu_rooms(node, holds)
    indices = sleeper.gpu_indices or (0,)
    per_gpu_mb = math.ceil(sleeper.reserved_mb / len(indices))
    for index in indices:
        room = rooms.get(index)
        if room is None:
            return f"its GPU {index} is no longer placeable"
        if sleeper.shared and sleeper.gpu_indices:
            if room.exclusive or room.used_mb + per_gpu_mb > room.memory_mb * WHOLE_GPU_MEMORY_FRACTION:
                return f"its GPU {index} was given to other replicas while it slept"
        elif room.num_holders:
            return f"its GPU {index} was given to another replica while it slept"
    return ""
