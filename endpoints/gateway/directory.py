"""What the gateway needs to know about endpoints and replicas, cached briefly per process.

Lookups never queue behind the database on the hot path (see `endpoints.gateway.memo`); only an
endpoint never loaded, or an empty READY list, waits for the database.

NOTE: a cached READY list may name a replica that began draining moments ago. That is safe: a
draining replica still finishes every request it gets; only the agent's stop waits for them. One
that is gone fails before the first byte, and the gateway retries elsewhere.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from dataclasses import dataclass
from decimal import Decimal

from django.conf import settings

from controlplane.clock import DatabaseClock, database_time_ago
from controlplane.credential_lookups import WAIT_S, ExpiringSet, LookupsBusy
from controlplane.worker_threads import in_worker_thread
from endpoints.gateway import errors
from endpoints.gateway.memo import Memo
from endpoints.gateway.normalizers import PromptNormalizer, prompt_normalizer
from endpoints.models import DATABASE_NOW_AT_LOAD, Adapter, Endpoint, Replica
from endpoints.quota_room import refused_for_starts
from gpu_agent.protocol import NodeState, ReplicaState

logger = logging.getLogger(__name__)

ENDPOINT_CACHE_S = 2.0
REPLICA_CACHE_S = 0.5
KNOWN_ENDPOINTS_MAX = 100_000
# Unknown (organisation, name) pairs remembered per process: each at most ~1 KB (a name is at most
# `request.MAX_MODEL_NAME` characters), so a few MB at most.
UNKNOWN_ENDPOINTS_MAX = 4096
# Endpoints looked up in PostgreSQL at once per gateway process (as API keys are: `auth.MAX_KEY_LOOKUPS`), and how
# long a name never seen waits for one of them before its call gets a 503 with Retry-After (as a key's lookup).
MAX_ENDPOINT_LOOKUPS = 4
ENDPOINT_LOOKUP_WAIT_S = WAIT_S


@dataclass(slots=True, frozen=True)
class EndpointInfo:
    id: str
    name: str
    organization_id: int
    paused: bool
    max_model_len: int
    cold_start_timeout_s: int
    price_input_per_million: Decimal
    price_cached_input_per_million: Decimal
    price_output_per_million: Decimal
    created_at: float
    max_held_requests: int  # the organisation's quota of requests held for cold starts at once
    # Why calls cannot be served now: "FAILED" or "WAITING_FOR_CAPACITY" (see `endpoints.gateway.standing`);
    # "" when the endpoint serves or may start. `status_message` says why, in the user's words.
    state: str = ""
    status_message: str = ""
    # Until when (epoch seconds) it places no replica, backing off after failures (`Endpoint.next_attempt_at`), none
    # of its replicas starting meanwhile; 0: not backing off, or one is starting (see `endpoints.gateway.standing`).
    backing_off_until: float = 0.0
    # Its organisation's replica starts an hour refused it the replica it wants (`quota_room.refused_for_starts`), none
    # of its replicas starting meanwhile: a cold call is refused at once (see `endpoints.gateway.standing`).
    starts_refused: bool = False
    # "generate" or "embed" (`Endpoint.serving_task`); "" while an "auto" endpoint's model is unread.
    task: str = ""
    # The endpoint's target concurrency per replica: how far above the least-loaded replica the gateway
    # may still send a request to the replica preferred for its prompt's prefix (`routing`).
    target_concurrency: int = 8
    # What its model's chat template adds per conversation and per message, as an engine measured it
    # (`Endpoint.chat_template_tokens`; (0, 0) until then): the estimate allows at least this.
    template_tokens: tuple[int, int] = (0, 0)
    # The same with a flag a request may set (`Endpoint.chat_template_measures`); None until measured.
    template_flag_tokens: tuple[int, int] | None = None
    engine_generation: int = 0  # `Endpoint.engine_generation`: calls go to replicas of this one only
    # What its model's tokenizer adds to a prompt's text beyond every model's count (`normalizers.prompt_normalizer`
    # of `Endpoint.tokenizer_normalizer`, read once as the endpoint loads); None: nothing, or not known (an older agent).
    prompt_normalizer: PromptNormalizer | None = None
    # What its calls' prompt bounds are multiplied by, learned from prompts that ran past them (`PromptFactor`, read
    # once as the endpoint loads); None: none did. `model_copy`: the (source, scope) it serves, the factor's key.
    prompt_factor: Decimal | None = None
    model_copy: tuple[str, str] = ("", "")
    # When (monotonic) this process kept `prompt_factor` itself (`keep_prompt_factor`); 0: as loaded.
    prompt_factor_kept_at: float = 0.0


@dataclass(slots=True, frozen=True)
class ReplicaInfo:
    id: str
    address: str
    authorization: str = ""  # "Bearer <the engine's key>", sent with every call to it
    # LoRA adapters its engine holds (as its agent last reported): calls naming one prefer it.
    adapters: frozenset[str] = frozenset()
    generation: int = 0  # its endpoint's `engine_generation` when it was placed

    def __repr__(self) -> str:  # never print the key
        return f"ReplicaInfo(id={self.id!r}, address={self.address!r})"


def _endpoint_info(endpoint, *, for_calls: bool = True) -> EndpointInfo:
    """`for_calls` False: for `/v1/models`, which reserves nothing (no look-up of the template's size)."""
    template_tokens, template_flag_tokens = endpoint.chat_template_measures if for_calls else ((0, 0), None)
    normalizer = prompt_normalizer(endpoint.tokenizer_normalizer) if for_calls else None
    return EndpointInfo(
        id=str(endpoint.pk), name=endpoint.name, organization_id=endpoint.organization_id,
        paused=endpoint.paused_at is not None, max_model_len=endpoint.context_length,
        cold_start_timeout_s=endpoint.cold_start_timeout_s,
        price_input_per_million=endpoint.price_input_per_million,
        price_cached_input_per_million=endpoint.price_cached_input_per_million,
        price_output_per_million=endpoint.price_output_per_million,
        created_at=endpoint.created_at.timestamp(),
        max_held_requests=endpoint.organization.quotas.max_held_requests,
        state=_blocking_state(endpoint), status_message=endpoint.status_message, task=endpoint.serving_task,
        backing_off_until=_backing_off_until(endpoint) if for_calls else 0.0,
        starts_refused=for_calls and _starts_refused(endpoint),
        target_concurrency=endpoint.target_concurrency, template_tokens=template_tokens,
        template_flag_tokens=template_flag_tokens, engine_generation=endpoint.engine_generation,
        prompt_normalizer=normalizer, prompt_factor=endpoint.prompt_factor if for_calls else None,
        model_copy=(endpoint.model_source, endpoint.weights_scope),
    )


def _blocking_state(endpoint) -> str:
    # NOTE: the values of `EndpointState` (this module loads before Django's apps, so not imported).
    if endpoint.failed_at is not None:
        return "FAILED"
    if endpoint.waiting_for_capacity:
        return "WAITING_FOR_CAPACITY"
    return ""


def _backing_off_until(endpoint) -> float:
    """`EndpointInfo.backing_off_until`. NOTE: read as the endpoint loads (one more query, for an endpoint backing
    off only: PostgreSQL's clock comes with the row, `_load_endpoint`), never per call."""
    left_s = endpoint.backoff_left_s()
    if not left_s or endpoint.scale_up_backing_off:
        return 0.0  # or only its scale-ups, beyond the first replica: a call's wake starts one (`reconcile_endpoint`)
    if _replica_starting(endpoint):
        return 0.0  # one placed before the failure may still come up
    # NOTE: on this process's clock, as the gateway reads it (`standing.refuse_unless_startable`): `next_attempt_at` is
    # PostgreSQL's, and a gateway 10 minutes behind refused calls for 10 minutes past a 1 s backoff
    return time.time() + left_s


def _starts_refused(endpoint) -> bool:
    """`EndpointInfo.starts_refused`. NOTE: one more query, for an endpoint so refused only.

    NOTE: a wake that placed a replica (its organisation's last start of the hour) and was refused the next one its load
    asked for says so too: the call that woke it, and each cold call after, is held for the one starting, as a capacity
    refusal with a replica placed holds them. Judged by the message alone, each got the 429 while it loaded."""
    return refused_for_starts(endpoint.status_message) and not _replica_starting(endpoint)


def _replica_starting(endpoint) -> bool:
    """Whether one of the endpoint's replicas is placed or starting (woken from sleep too): calls may be held for it."""
    return Replica.objects.filter(endpoint_id=endpoint.pk, state__in=(ReplicaState.PENDING, ReplicaState.STARTING)).exists()


def _load_endpoint(organization_id: int, name: str) -> EndpointInfo | None:
    # NOTE: PostgreSQL's clock read with the row, which its backoff is judged by (`Endpoint.backoff_left_s`)
    endpoint = Endpoint.objects.live().select_related("organization__plan").filter(
        organization_id=organization_id, name=name).annotate(**{DATABASE_NOW_AT_LOAD: DatabaseClock()}).first()
    return _endpoint_info(endpoint) if endpoint else None


# NOTE: the names are the callers' to choose: an unknown one is remembered apart (`_unknown_endpoints`), never in
# `_endpoints`, which so holds only endpoints that exist; a stream of made-up names (each a first load) holds at most
# `MAX_ENDPOINT_LOOKUPS` worker threads and connections. They kept up to 100,000 entries of up to 8 KB each (a
# name in `/v1/models/{id}` was unbounded): one key could fill the web pod's memory, every tenant's calls with it.
def _keep_learned_factor(cached: EndpointInfo | None, loaded: EndpointInfo | None, started: float) -> EndpointInfo | None:
    """A reload of an endpoint that started before this process kept a higher prompt factor (it may have read the
    database before the factor's row) keeps that factor; one started after takes the database's (a reset's too). A
    factor of its copy the database failed to write (`unwritten_prompt_factors`) is kept over a lower one loaded.

    NOTE: the first reload once PostgreSQL is back read no factor row, and dropped the one this process kept until the
    retry wrote it (up to `call.PROMPT_FACTOR_RETRY_S`): calls past the bound meanwhile lost their reservation again."""
    if loaded is not None and unwritten_prompt_factors:
        unwritten = unwritten_prompt_factors.get((loaded.id, loaded.model_copy))
        if unwritten is not None and (loaded.prompt_factor is None or loaded.prompt_factor < unwritten[1]):
            loaded = dataclasses.replace(loaded, prompt_factor=unwritten[1])
    if (cached is None or loaded is None or cached.prompt_factor_kept_at < started or cached.id != loaded.id
            or cached.model_copy != loaded.model_copy):
        return loaded
    if loaded.prompt_factor is not None and loaded.prompt_factor >= cached.prompt_factor:
        return loaded
    return dataclasses.replace(loaded, prompt_factor=cached.prompt_factor,
                               prompt_factor_kept_at=cached.prompt_factor_kept_at)


# Factors whose write met the database away, per (endpoint, copy of its model), the largest, with the endpoint they were
# learned on: `call` writes them again every `call.PROMPT_FACTOR_RETRY_S` until written, and every reload of the
# endpoint keeps them meanwhile (`_keep_learned_factor`). NOTE: only logged once, and lost with the endpoint's next
# reload once PostgreSQL was back: the next call past the bound lost its reservation again. Bounded: past
# `MAX_UNWRITTEN_PROMPT_FACTORS` the oldest is dropped (logged), as are those of a process stopped in the outage; such a
# factor is learned again by its endpoint's next call past the bound (one more call's reservation lost).
unwritten_prompt_factors: dict[tuple[str, tuple[str, str]], tuple[EndpointInfo, Decimal]] = {}
MAX_UNWRITTEN_PROMPT_FACTORS = 1000  # a few hundred bytes each


def keep_unwritten_prompt_factor(endpoint: EndpointInfo, factor: Decimal) -> None:
    """Keep a factor the database failed to write (the largest per copy), the oldest dropped past
    `MAX_UNWRITTEN_PROMPT_FACTORS`."""
    key = (endpoint.id, endpoint.model_copy)
    kept = unwritten_prompt_factors.pop(key, None)
    unwritten_prompt_factors[key] = (endpoint, max(factor, kept[1]) if kept else factor)
    while len(unwritten_prompt_factors) > MAX_UNWRITTEN_PROMPT_FACTORS:
        oldest = next(iter(unwritten_prompt_factors))
        dropped = unwritten_prompt_factors.pop(oldest)
        logger.error("endpoint %s: its prompt factor %s is not written (past %d unwritten): its next call past the "
                     "bound learns it again", oldest[0], dropped[1], MAX_UNWRITTEN_PROMPT_FACTORS)


def _organization_of_key(key: tuple[int, str]) -> int:
    """Whose lookup an endpoint's is (its key is (organisation, name)): the lookup slots are shared fairly by it."""
    return key[0]


_endpoints = Memo(_load_endpoint, ENDPOINT_CACHE_S, max_entries=KNOWN_ENDPOINTS_MAX,
                  max_concurrent_loads=MAX_ENDPOINT_LOOKUPS, load_wait_s=ENDPOINT_LOOKUP_WAIT_S,
                  merge=_keep_learned_factor, load_owner=_organization_of_key)
# (organisation, name) that named no live endpoint, for as long as a cached endpoint is trusted: a name sent again
# costs no query; a flood of different ones pushes out only each other. An endpoint created since is found once its
# name's entry expires, as a change to a cached one is.
_unknown_endpoints = ExpiringSet(ENDPOINT_CACHE_S, max_entries=UNKNOWN_ENDPOINTS_MAX)


async def find_endpoint(organization_id: int, name: str) -> EndpointInfo | None:
    key = (organization_id, name)
    if key in _unknown_endpoints:
        return None
    try:
        endpoint = await _endpoints.get(key, organization_id, name)
    except LookupsBusy:
        # NOTE: a name never seen (nor cached) waited for a lookup slot for as long as a flood of made-up names held
        # them all: every tenant's first call to an endpoint not yet cached with it. Not remembered as unknown (it was
        # never looked up), and not logged (a flood's each: `memo._note_failure`). A cached endpoint takes no slot.
        raise errors.service_unavailable("Too many model names are being looked up at once; please retry.") from None
    if endpoint is None:
        _endpoints.forget(key)
        _unknown_endpoints.add(key)
    return endpoint


def keep_prompt_factor(endpoint: EndpointInfo, factor: Decimal) -> None:
    """This process's cached endpoint reserves for `factor` from now on, if it still serves the same copy of its model
    and has no larger one (`call.InferenceCall._learn_prompt_factor`); other processes read it with the endpoint's next
    load, within `ENDPOINT_CACHE_S` of the factor's row.

    NOTE: the entry keeps its own load's time: a reload that began before still lands (prices, a pause or a deletion
    it read are served at once), keeping the higher factor (`_keep_learned_factor`). Stamping the entry as loaded now
    dropped that reload and served the stale endpoint ~2 s longer at every rise."""
    key = (endpoint.organization_id, endpoint.name)
    entry = _endpoints.entries.get(key)
    if entry is None or entry[1] is None:
        return
    cached = entry[1]
    if cached.id != endpoint.id or cached.model_copy != endpoint.model_copy:
        return
    # NOTE: the same factor again (its row now written: `call._write_prompt_factor`) is kept as of now all the same, so
    # a reload that read the database before the row landed keeps it too.
    if cached.prompt_factor is not None and cached.prompt_factor > factor:
        return
    _endpoints.entries[key] = (entry[0], dataclasses.replace(cached, prompt_factor=factor,
                                                             prompt_factor_kept_at=time.monotonic()))


def knows_endpoint(organization_id: int, name: str) -> bool:
    """`find_endpoint` answers without a lookup: the name is cached, as an endpoint or as unknown."""
    key = (organization_id, name)
    return _endpoints.answers_at_once(key) or key in _unknown_endpoints


def knows_adapters(endpoint_id: str) -> bool:
    """`endpoint_adapters` answers without a lookup."""
    return _adapters.answers_at_once(endpoint_id)


def _load_models(organization_id: int) -> list[EndpointInfo]:
    endpoints = Endpoint.objects.live().select_related("organization__plan").filter(organization_id=organization_id)
    return [_endpoint_info(e, for_calls=False) for e in endpoints.order_by("name")]


# NOTE: `GET /v1/models` is not rate-limited (the OpenAI clients call it freely): it was a query of the endpoints
# and one of each endpoint's adapters per call, in worker threads; now read as every lookup here is.
_models = Memo(_load_models, ENDPOINT_CACHE_S)


async def list_endpoints(organization_id: int) -> list[EndpointInfo]:
    return await _models.get(organization_id)


@dataclass(slots=True, frozen=True)
class AdapterInfo:
    """A LoRA adapter a call may name as `"<endpoint>:<adapter>"`; prices None: the endpoint's."""

    id: str
    name: str
    price_input_per_million: Decimal | None
    price_output_per_million: Decimal | None
    state: str = ""  # `AdapterState`: FAILED when an engine refused it (`status_message` says why)
    status_message: str = ""
    failure_retried: bool = False  # FAILED for a passing reason its agent tries again: held for, not refused

    def priced(self, endpoint: EndpointInfo) -> EndpointInfo:
        """The endpoint as a call to this adapter is priced (reserved and billed).

        NOTE: `billing.ledger`'s SQL prices the row alike: the adapter's price where it has one,
        cached prompt tokens at the lower of its input price and the endpoint's cached price.
        """
        if self.price_input_per_million is None and self.price_output_per_million is None:
            return endpoint
        input_price = self.price_input_per_million
        return dataclasses.replace(
            endpoint,
            price_input_per_million=endpoint.price_input_per_million if input_price is None else input_price,
            price_cached_input_per_million=endpoint.price_cached_input_per_million if input_price is None
            else min(input_price, endpoint.price_cached_input_per_million),
            price_output_per_million=self.price_output_per_million if self.price_output_per_million is not None
            else endpoint.price_output_per_million,
        )


def _load_adapters(endpoint_id: str) -> dict[str, AdapterInfo]:
    rows = Adapter.objects.filter(endpoint_id=endpoint_id).values_list(
        "pk", "name", "price_input_per_million", "price_output_per_million", "state", "status_message",
        "failure_retried")
    return {name: AdapterInfo(str(pk), name, price_in, price_out, state, message, retried)
            for pk, name, price_in, price_out, state, message, retried in rows}


_adapters = Memo(_load_adapters, ENDPOINT_CACHE_S)


async def endpoint_adapters(endpoint_id: str, *, fresh: bool = False,
                            fresh_since: float | None = None) -> dict[str, AdapterInfo]:
    """The endpoint's adapters by name; `fresh` reads the database now (an adapter created or changed since the
    cached list was read), `fresh_since` as `Memo.get`'s."""
    return await _adapters.get(endpoint_id, endpoint_id, fresh=fresh, fresh_since=fresh_since)


def _load_replicas(endpoint_id: str) -> list[ReplicaInfo]:
    rows = Replica.objects.filter(
        endpoint_id=endpoint_id, state=ReplicaState.READY, node__state__in=[NodeState.READY, NodeState.CORDONED]
    ).exclude(address="").select_related("node").only(
        "pk", "address", "encrypted_engine_key", "adapters", "engine_generation",
        "node__advertise_host", "node__engine_port_min", "node__engine_port_max",
    )
    replicas = []
    for replica in rows:
        # NOTE: checked again here, not only when the agent reported it: the gateway never sends a
        # prompt to an address outside the node's registered host and engine ports.
        problem = replica.node.engine_address_problem(replica.address)
        if problem:
            logger.warning("not routing to replica %s at %r: %s", replica.pk, replica.address[:200], problem)
            continue
        replicas.append(ReplicaInfo(
            id=str(replica.pk), address=replica.address, authorization=f"Bearer {replica.engine_api_key}",
            adapters=frozenset(replica.adapters), generation=replica.engine_generation,
        ))
    return replicas


_replicas = Memo(_load_replicas, REPLICA_CACHE_S, wait_when_empty=True)


async def ready_replicas(endpoint_id: str, *, fresh: bool = False, fresh_since: float | None = None,
                         generation: int | None = None) -> list[ReplicaInfo]:
    """READY replicas of an endpoint; `fresh` reads the database now (a cold start's wait), `fresh_since` as
    `Memo.get`'s (an adapter load's wait). With `generation` (the
    `engine_generation` a call was checked and reserved by), only replicas started with that configuration.

    NOTE: a cached list may still name a replica drained by a change of configuration a moment ago: a call checked
    by the new one went to an engine of the old one (a context length lowered to 16 reserved a 30k-token prompt on
    a 32k engine as 16 tokens). A replica of a newer configuration than the call's means the call's endpoint was
    read before a change: a 503 to retry, rather than a wait for replicas of a configuration that is gone."""
    replicas = await _replicas.get(endpoint_id, fresh=fresh, fresh_since=fresh_since)
    if generation is None:
        return replicas
    current = [r for r in replicas if r.generation == generation]
    if len(current) < len(replicas) and any(r.generation > generation for r in replicas):
        raise errors.service_unavailable("The endpoint's configuration changed while this call was checked; please retry.")
    return current


def held_ready_replicas(endpoint_id: str, *, generation: int) -> list[ReplicaInfo]:
    """The READY replicas of `endpoint_id` started with configuration `generation` that this process
    already holds and still trusts (`Memo.held`); [] when it holds none. Never reads the database."""
    return [r for r in _replicas.held(endpoint_id) or () if r.generation == generation]


# NOTE: a cut Responses stream's prompt is counted by a replica this process holds (`held_ready_replicas`: trusted for
# `REPLICA_CACHE_S` + `memo.STALE_FOR_S`, 5.5 s, after its load) when its own failed: a stream longer than that, on an
# endpoint no other call read meanwhile, found none held, and its prompt was free. So while such a stream reads, its
# endpoint's list is reloaded in the background once older than `REPLICA_CACHE_S`, looked at every
# `REPLICAS_KEPT_EVERY_S` at most (`keep_replicas_held`): held at its cut unless PostgreSQL was away (or slower than
# ~3 s) or the engine wrote nothing for as long, and its count never waits on the database. After such a reload failed
# (PostgreSQL away), the endpoint's next is `REPLICAS_KEPT_AFTER_FAILURE_S` later: with PostgreSQL away, each
# streaming endpoint's reload every 2 s took a worker thread for a connect's timeout, and every other look-up of the
# process (a new key, an endpoint) queued behind them.
REPLICAS_KEPT_EVERY_S = 2.0
REPLICAS_KEPT_AFTER_FAILURE_S = 10.0
_replicas_kept = ExpiringSet(REPLICAS_KEPT_EVERY_S, max_entries=KNOWN_ENDPOINTS_MAX)
_replicas_kept_failed = ExpiringSet(REPLICAS_KEPT_AFTER_FAILURE_S, max_entries=KNOWN_ENDPOINTS_MAX)


def keep_replicas_held(endpoint_id: str) -> None:
    """Keep this process's READY replicas of `endpoint_id` held (`held_ready_replicas`) while a call that may ask them at
    its end runs: a reload in the background at most every `REPLICAS_KEPT_EVERY_S` (`REPLICAS_KEPT_AFTER_FAILURE_S`
    after one failed), never waited for."""
    if endpoint_id in _replicas_kept or endpoint_id in _replicas_kept_failed:
        return
    _replicas_kept.add(endpoint_id)
    reload = _replicas.reload_if_older(endpoint_id, REPLICA_CACHE_S)
    if reload is not None:
        reload.add_done_callback(functools.partial(_note_kept_reload, endpoint_id))


def _note_kept_reload(endpoint_id: str, reload: asyncio.Task) -> None:
    if not reload.cancelled() and reload.exception() is not None:
        _replicas_kept_failed.add(endpoint_id)


def forget_replica(endpoint_id: str, replica_id: str) -> None:
    """A replica failed under us: stop routing to it until the next load."""
    cached = _replicas.entries.get(endpoint_id)
    if cached:
        _replicas.entries[endpoint_id] = (cached[0], [r for r in cached[1] if r.id != replica_id])


def _load_progress(endpoint_id: str) -> str:
    replica = (
        Replica.objects.filter(endpoint_id=endpoint_id, state__in=[ReplicaState.PENDING, ReplicaState.STARTING])
        .order_by("-created_at").values("state", "progress").first()
    )
    if replica is None:
        message = Endpoint.objects.filter(pk=endpoint_id).values_list("status_message", flat=True).first()
        return message or "scheduling"
    if replica["state"] == ReplicaState.PENDING:
        return "scheduling"
    return replica["progress"] or "starting engine"


async def cold_start_progress(endpoint_id: str) -> str:
    return await in_worker_thread(_load_progress)(endpoint_id)


def _engine_generating(endpoint_id: str, replica_id: str, address: str) -> bool:
    return Replica.objects.filter(
        pk=replica_id, endpoint_id=endpoint_id, state__in=(ReplicaState.READY, ReplicaState.DRAINING), address=address,
        tokens_per_s__gt=0,
        # NOTE: a cordoned or draining node still runs its replicas: READY alone cut every long call on one at its
        # first question (a 504, unbilled, the engine's work thrown away and sent again by the client)
        node__state__in=(NodeState.READY, NodeState.CORDONED, NodeState.DRAINING),
        node__last_heartbeat_at__gte=database_time_ago(settings.NODE_HEARTBEAT_GRACE_S),
    ).exists()


async def engine_generating(endpoint_id: str, replica_id: str, address: str) -> bool:
    """Whether the replica is READY (or DRAINING: it finishes what it has, within its drain timeout) at `address` on
    a node heard from lately, and its engine produced tokens in its agent's last report (`Replica.tokens_per_s`):
    working, not wedged. Read from the database now."""
    return await in_worker_thread(_engine_generating)(endpoint_id, replica_id, address)
