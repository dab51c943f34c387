"""One inference call through the gateway, from reservation to usage row.

`InferenceCall.run` admits the parsed request (`endpoints.gateway.request`, `admission`), holds it
through a cold start if no replica is READY (`cold_start`), proxies it to a replica (tried once
elsewhere when the first refused it before its engine could read it), relays the answer (SSE edited by
`sse`) and ends it: one usage row, the real cost settled, the replica released, whatever happened on the way.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal

from django.conf import settings
from django.db import DatabaseError, InterfaceError

from billing import ledger, usage_writer
from billing.models import UsageStatus
from billing.quota.counters import QuotaExceeded
from billing.standing import SPEND_LIMIT_REASONS
from controlplane.hot_settings import hot
from controlplane.worker_threads import in_worker_thread
from endpoints.gateway import (
    adapter_hold,
    admission,
    anatomy,
    cold_start,
    delivery,
    directory,
    drain,
    errors,
    metrics,
    presence,
    rendered_prompt,
    responses,
    routing,
    sse,
    standing,
    traffic,
    upstream,
)
from endpoints.gateway.auth import Caller
from endpoints.gateway.directory import AdapterInfo, EndpointInfo, ReplicaInfo
from endpoints.gateway.ratelimit_headers import RateLimitReport
from endpoints.gateway.request import InferenceRequest
from endpoints.gateway.tally import UsageTally
from endpoints.models import PromptFactor, prompt_factor_for

logger = logging.getLogger("inferplane.requests")
# The request log's line: one a call, at its end (`InferenceCall._observe`).
REQUEST_LINE = ("request_id=%s org=%s key=%s endpoint=%s replica=%s status=%s prompt=%d cached=%d completion=%d "
                "cold_start_s=%.3f duration_s=%.3f")

# A client that leaves is noticed from this long after its call was admitted on (before: its call runs on).
WATCH_DISCONNECT_AFTER_S = 0.05
# The most a stopping process waits for the finishes of calls its server cut at the graceful deadline.
SHUTDOWN_FINISH_WAIT_S = 10.0
# A replica silent past the read timeout before its answer's first byte is asked again this often
# (`InferenceCall._patience`) while its engine is generating.
PATIENCE_RECHECK_S = 30.0
PATIENCE_QUERY_TIMEOUT_S = 5.0

# Finishes (usage row, settlement) still running, so a stopping process waits for them (`finish_pending`).
_finishing: set[asyncio.Task] = set()


async def finish_pending(timeout_s: float = SHUTDOWN_FINISH_WAIT_S) -> int:
    """Wait for the finishes still running, of calls ended or cut short (the server's graceful deadline
    cancels calls still streaming; each still writes its usage row and settles). Returns how many were
    left unfinished after `timeout_s`.

    NOTE: without this wait `asyncio.run` cancelled them as the process ended, with the usage writer's
    batch: a stream cut at the deadline was served and never billed, its reservation left to the sweeper."""
    await asyncio.sleep(0.05)  # calls cancelled just now reach their `finally` and start their finish
    pending = {task for task in _finishing if task.get_loop() is asyncio.get_running_loop()}
    unfinished = (await asyncio.wait(pending, timeout=timeout_s))[1] if pending else set()
    if unfinished:
        logger.error("%d call(s) still finishing after %.0f s of shutdown: their usage may be lost", len(unfinished), timeout_s)
    if directory.unwritten_prompt_factors:
        logger.error("%d prompt factor(s) not written (the database away): each is learned again by its endpoint's "
                     "next call past its bound", len(directory.unwritten_prompt_factors))
    return len(unfinished)


class ClientGone(Exception):
    """The client disconnected; stop working for it."""


class _NoReplicaLeft(Exception):
    """No replica took the call before its first byte, and none is READY now: it waits for one (`_hold_again`)."""


class UpstreamUnavailable(Exception):
    """The replica refused the call before its engine could start on it (no connection, a connection its stopping
    replica closed or reset with the call unread, or the engine's key guard's 401, answered before the body is read):
    safe to retry elsewhere (`engine_cannot_have_started`, `InferenceCall._forward`)."""


class ReservationSpent(errors.OpenAIError):
    """A stream reached the cost reserved for it: the gateway stops it there."""

    def __init__(self):
        super().__init__(402, "This response reached the largest cost reserved for it and was stopped.",
                         type="insufficient_quota", code="reservation_spent")


# The 402s a call's reserved cost causes (`QuotaExceeded.reason`): a learned prompt factor says so after them.
_COST_REFUSALS = frozenset({"credit", "key_cap", *SPEND_LIMIT_REASONS})


@dataclass(slots=True)
class InferenceCall:
    request_id: str
    request: InferenceRequest
    caller: Caller
    endpoint: EndpointInfo
    client: upstream.UpstreamClient
    receive: object
    send: object
    started_at: datetime
    replica: ReplicaInfo | None = None
    served: bool = False  # a replica accepted the request: a usage row is owed
    first_token_at: datetime | None = None
    reserved: Decimal = Decimal(0)  # the worst case held against caps and credit; never billed beyond
    num_prompt_tokens_bound: int | None = None  # the worst case's prompt tokens: more is past the estimate
    # Its worst case's prompt bounds, before its endpoint's learned prompt factor (`WorstCase.scaled`): what the factor
    # a prompt past them teaches is computed from (`prompt_factor_for`).
    unscaled_prompt_bounds: tuple[int, ...] = ()
    usage: UsageTally = field(default_factory=UsageTally)
    status: str = "ok"
    cold_start_s: float = 0.0
    held_at: datetime | None = None  # when a cold start began holding it
    cold_start: anatomy.ColdStart | None = None  # its split, measured at the first token
    response_started: bool = False
    # Sent to a replica: from then on a client leaving a non-streamed call no longer stops it (`_watch_disconnect`).
    forwarded: bool = False
    _cancelled_for_client: bool = False  # the disconnect watcher cancelled the call (not the server stopping)
    _stopped_for_shutdown: bool = False  # still running at the end of its process's drain (`drain`)
    _replica_failed: bool = False  # its replica failed mid-stream: asked nothing more (`_count_cut_prompt`)
    # The `sequence_number` an event the gateway adds to a Responses stream takes: the one after the last it was sent
    # (`responses.error_event`).
    _next_sequence_number: int = 0
    outstanding_replica_id: str | None = None  # the replica whose outstanding count this request holds
    held: presence.Held | None = None  # what this gateway's heartbeat restores if Redis forgets it
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    metrics: metrics.EndpointMetrics | None = None
    ratelimit: RateLimitReport = field(default_factory=RateLimitReport)  # the answer's x-ratelimit-* headers
    _started_monotonic: float = field(default_factory=time.monotonic)
    # A batch line (`endpoints.batches.runner`): its usage row names the batch, priced at this fraction.
    batch_id: str = ""
    price_fraction: Decimal = Decimal(1)
    # `reserved` as a stream checks it on every chunk (set when the stream starts relaying).
    _ceiling: ledger.CostCeiling | None = None
    # A Responses stream's answer until its engine's first output, which `_relay_events` tells it of
    # (`upstream.Response.first_event_came`): its lifecycle events before it do not end the first event's bound.
    _awaits_first_event: upstream.Response | None = None
    # The LoRA adapter the call names (`endpoint` is then priced at its prices): served only by replicas holding it.
    adapter: AdapterInfo | None = None
    # What CORS adds to its answer's headers (`cors.answer_headers`: `Vary: Origin`, and to a page's call the CORS
    # headers); a batch line's answer is no browser's
    cors_headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    # The latest a non-streamed answer is waited for (monotonic), when sooner than `GATEWAY_MAX_ANSWER_WAIT_S` from
    # the start: a batch line's run has a time limit of its own (`endpoints.batches.runner`).
    answer_deadline: float | None = None
    # `_patience`'s state: the engine check still running (one at a time: a query stuck in a worker thread is
    # waited on, never doubled), and how long the call had waited when it gave up at its deadline.
    _engine_check: tuple[asyncio.Future, ReplicaInfo] | None = None
    _waited_out_s: float | None = None
    # When the send to the client now waiting began (`delivery`'s watchdog cuts off a client that reads nothing).
    sending_since: float | None = None
    _task: asyncio.Task | None = None  # the task running the call
    # What counts a whole answer's bytes from its first byte read: its organisation's share of this process
    # (`delivery.Holding`), or a batch line's own (`endpoints.batches.answer_bytes.LineAnswer`, which the line keeps
    # counted after it was sent, until its result is stored).
    answer_holding: delivery.AnswerHolding | None = None
    _holding: delivery.AnswerHolding | None = None  # the one counting this call's answer
    # Its entry's in its gateway's requests hash and its tokens' in its minute: a batch line's request id recurs on every
    # try, this is this try's alone (`traffic.new_call_token`).
    call_token: str = field(default_factory=traffic.new_call_token)

    async def run(self) -> None:
        delivery.refuse_if_over(self.caller.organization_id)
        self._task = asyncio.current_task()
        self.metrics = metrics.of_endpoint(self.endpoint.id, self.endpoint.organization_id)
        worst_case = self.request.worst_case(self.endpoint)
        if self.endpoint.paused:
            raise errors.endpoint_paused(self.endpoint.name)
        self.usage.num_choices_per_prompt = worst_case.num_sequences
        self.usage.num_prompts = max(1, len(worst_case.prompt_bounds))
        self.reserved = worst_case.max_cost(self.endpoint, fraction=self.price_fraction if self.batch_id else None)
        self.num_prompt_tokens_bound = worst_case.num_prompt_tokens
        self.unscaled_prompt_bounds = worst_case.unscaled_prompt_bounds or worst_case.prompt_bounds
        replicas = await directory.ready_replicas(self.endpoint.id, generation=self.endpoint.engine_generation)
        if not replicas:  # a FAILED endpoint, or one waiting for capacity, says so now instead of holding the call
            standing.refuse_unless_startable(self.endpoint, wait_for_capacity=self.request.wait_for_capacity)
        waits_for_adapter = self.adapter is not None and not adapter_hold.held_by(self.adapter, replicas)
        if waits_for_adapter:
            await self._refuse_unless_loadable()
        # NOTE: a cold start's place in line (bounded per process, endpoint and organisation) comes first, and so does
        # an adapter load's (held alike); `cold_start.hold` (`adapter_hold.hold`) gives it up, or the refusal below.
        place = None if replicas and not waits_for_adapter else await cold_start.take_place(
            self.endpoint, self.caller.organization_id, self.request_id, call_token=self.call_token)
        presence.ensure_started()
        try:
            # NOTE: one round trip checks the rate limits, reserves the largest cost, counts the
            # request in flight (or waiting) and picks its replica; `_finish` undoes it in one more.
            admitted = await admission.admit(
                caller=self.caller, endpoint_id=self.endpoint.id, request_id=self.request_id, amount=self.reserved,
                # a call held for its adapter is counted waiting, as for a cold start: no replica is picked yet
                num_tokens=worst_case.num_tokens, candidates=[] if waits_for_adapter else [r.id for r in replicas],
                report=self.ratelimit,
                prefix_key=routing.prefix_key(self.request.kind, self.request.payload),
                margin=self.endpoint.target_concurrency, prefer=self._adapter_preference(replicas),
                call_token=self.call_token, why_so_many=errors.prompt_factor_note(self.endpoint.prompt_factor))
        except QuotaExceeded as exc:
            await cold_start.give_up(place)
            why = errors.prompt_factor_note(self.endpoint.prompt_factor) if exc.reason in _COST_REFUSALS else ""
            raise errors.insufficient_quota(str(exc) + why) from None
        except BaseException:
            # NOTE: every refusal gives its place up (a 429, a request in progress: before, only an outage did, and a
            # refused call's place stayed counted until it lapsed); the call's end, should the script have run before
            # its reply was lost, is `admit`'s to leave.
            await cold_start.give_up(place)
            raise
        if admitted.picked is not None:
            self.outstanding_replica_id = replicas[admitted.picked].id
        self.held = presence.track(self.request_id, self.caller.organization_id, self.endpoint.id,
                                   self.outstanding_replica_id, admitted.reservation,
                                   # a batch line has none (`progress`): no callback to call every beat
                                   progress=None if self.batch_id else functools.partial(self.progress,
                                                                                          admitted.billing_mode),
                                   call_token=self.call_token)
        # NOTE: a client that disconnects cancels this task wherever it waits, unless it is a non-streamed call
        # already sent to a replica (see `_watch_disconnect`); watched from `WATCH_DISCONNECT_AFTER_S` on: most
        # calls end sooner, and a timer costs a fraction of the task that watches (its steps, its cancellation).
        watcher = _Watcher(self)
        drain.running[self.request_id] = self  # stopped there if still running at the end of its process's drain
        try:
            if not replicas:
                replicas = await self._hold(place)
                place = None  # given up by the hold

            if self.adapter is not None:
                replicas = await self._adapter_holders(replicas, place)
            try:
                await self._proxy(replicas, may_hold=not self.batch_id)
            except _NoReplicaLeft:
                replicas = await self._hold_again()
                if self.adapter is not None:
                    replicas = await self._adapter_holders(replicas, None)
                await self._proxy(replicas, may_hold=False)
        except asyncio.CancelledError:
            if self._stopped_for_shutdown and not self._cancelled_for_client:
                asyncio.current_task().uncancel()
                await self._answer_stopped()
            elif not self._cancelled_for_client:
                raise  # the server is stopping, not the client leaving
            else:
                asyncio.current_task().uncancel()
                self.status = "client_aborted"
        except ClientGone:
            self.status = "client_aborted"
        except errors.OpenAIError as exc:
            if self.disconnected.is_set():  # a non-streamed call read on after its client left: nobody to tell
                if self.status == "ok":
                    self.status = "client_aborted"
                return
            if not self.response_started:
                raise
            if self.status == "ok":
                self.status = "upstream_error"
            await self._send_event_error(exc)
        finally:
            watcher.stop()
            drain.running.pop(self.request_id, None)
            delivery.unwatch(self)
            if self._holding is not None:
                self._holding.close()
            finishing = asyncio.ensure_future(self._finish(admitted))
            _finishing.add(finishing)
            finishing.add_done_callback(_finishing.discard)
            try:
                await asyncio.shield(finishing)
            except asyncio.CancelledError:
                if not (self._cancelled_for_client or self._stopped_for_shutdown):
                    raise
                await finishing  # NOTE: the client's (or the drain's) cancellation, delivered late: finish all the same

    async def _hold(self, place: cold_start.Place | None) -> list[ReplicaInfo]:
        """Hold the call as a cold start (`cold_start.hold`, which gives `place` up) until a replica is READY; the
        wait counts from the first hold on, should the call be held again (`_hold_again`), and so does the bound: held
        again, it waits what is left of its endpoint's `cold_start_timeout_s`, not a whole new one."""
        held = await cold_start.hold(self, place, held_before_s=self.cold_start_s)
        if held is None:
            raise ClientGone()
        replicas, waited_s = held
        self.cold_start_s += waited_s
        if self.held_at is None:
            self.held_at = self._now() - timedelta(seconds=waited_s)
        if self.request.stream and self.response_started:  # a stream's headers went out at the hold: the wait comes as a comment
            await self.send_body(f": cold start ready after {round(self.cold_start_s * 1000)} ms\n\n".encode())
        return replicas

    async def _hold_again(self) -> list[ReplicaInfo]:
        """The replicas the call was sent to went away before any took it, and none is READY now (its endpoint scaled
        to zero as it arrived, the replica a cold start was released to failed at once): held as a cold call is, under
        the same bounds, rather than answered 502 "please retry". Nothing reached an engine, so a client leaving now
        is cancelled unbilled as any held call's."""
        self.forwarded = False
        standing.refuse_unless_startable(self.endpoint, wait_for_capacity=self.request.wait_for_capacity)
        place = await cold_start.take_place(self.endpoint, self.caller.organization_id, self.request_id,
                                            call_token=self.call_token)
        try:
            await traffic.demote_request(self.endpoint.organization_id, self.endpoint.id, self.request_id)
        except BaseException:
            await cold_start.give_up(place)
            raise
        return await self._hold(place)

    def stop_for_shutdown(self) -> None:
        """Stop the call: its process is stopping and the drain's bound has come (`drain`)."""
        if self._task is not None and not self._cancelled_for_client and not self._stopped_for_shutdown:
            self._stopped_for_shutdown = True
            self._task.cancel()

    async def _answer_stopped(self) -> None:
        """A call stopped at the drain's bound: a stream ends with an error event (billed for what it sent), a call
        whose answer has not started is answered 503 (nothing was served: billed nothing)."""
        stopped = errors.server_stopping()
        if not self.response_started:
            raise stopped
        await self._send_event_error(stopped)

    def _adapter_preference(self, replicas: list[ReplicaInfo]) -> frozenset[str]:
        """The replicas the pick ranks first: those already holding the call's adapter."""
        if self.adapter is None:
            return frozenset()
        return frozenset(r.id for r in replicas if self.adapter.name in r.adapters)

    async def _refuse_unless_loadable(self) -> None:
        """Before the call is admitted, when no READY replica holds its adapter: the 400 of an adapter an engine
        refused; a batch line's 503, to be tried again later (it is never held through a load, as through a cold
        start: it would hold a reservation meanwhile; its runner checks a replica holds the adapter first)."""
        await adapter_hold.refuse_if_failed(self.endpoint, self.adapter)
        if self.batch_id:
            raise adapter_hold.not_loaded(self.adapter)

    async def _adapter_holders(self, replicas: list[ReplicaInfo], place: cold_start.Place | None) -> list[ReplicaInfo]:
        """The replicas holding the call's adapter, holding the call in `place` until one loads it (a place taken
        now after a cold start: its hold gave its own up); the replica admission picked is given back if it does
        not hold it."""
        holding = adapter_hold.held_by(self.adapter, replicas)
        if not holding:
            if place is None:
                await self._refuse_unless_loadable()
                place = await cold_start.take_place(self.endpoint, self.caller.organization_id, self.request_id,
                                                    call_token=self.call_token)
            holding = await adapter_hold.hold(self, self.adapter, place)
            if holding is None:
                raise ClientGone()
        if self.outstanding_replica_id is not None and self.outstanding_replica_id not in {r.id for r in holding}:
            await traffic.release_replica(self.caller.organization_id, self.outstanding_replica_id,
                                          request_id=self.request_id, endpoint_id=self.endpoint.id,
                                          call_token=self.call_token)
            self.outstanding_replica_id = self.held.replica_id = None
        return holding

    # --- proxying ----------------------------------------------------------------------------
    async def _proxy(self, replicas: list[ReplicaInfo], *, may_hold: bool = False) -> None:
        """Send the call to one of `replicas`, tried again once elsewhere when the first refused it before its engine
        could start on it (`UpstreamUnavailable`); never once an engine read it (`_forward`). With
        `may_hold`, a call that no replica took and that finds none READY any more raises `_NoReplicaLeft` (to be
        held, `_hold_again`) rather than the 502."""
        # NOTE: an address tried, not a replica: a replica whose engine was restarted listens on a new port, and
        # the cached list may still name the old one; the fresh list's new address is a new place to try.
        tried: set[tuple[str, str]] = set()
        for _attempt in range(2):  # a refusal before the engine read it is retried once, elsewhere
            candidates = [r for r in replicas if (r.id, r.address) not in tried]
            if not candidates:
                candidates = [r for r in await directory.ready_replicas(self.endpoint.id, fresh=True,
                                                                        generation=self.endpoint.engine_generation)
                              if (r.id, r.address) not in tried]
            if not candidates:
                break
            picked = [r for r in candidates if r.id == self.outstanding_replica_id]  # picked when it began
            if picked:
                replica = picked[0]
            else:
                replica = candidates[await traffic.pick_replica(self.caller.organization_id, [r.id for r in candidates],
                                                                request_id=self.request_id,
                                                                endpoint_id=self.endpoint.id,
                                                                call_token=self.call_token)]
                self.outstanding_replica_id = self.held.replica_id = replica.id
            tried.add((replica.id, replica.address))
            self.metrics.inflight.inc()
            try:
                await self._forward(replica)
                return
            except UpstreamUnavailable as exc:
                logger.warning("request %s: replica %s unavailable before first byte (its engine never read it): %s",
                               self.request_id, replica.id, exc)
                directory.forget_replica(self.endpoint.id, replica.id)
                await traffic.release_replica(self.caller.organization_id, replica.id, request_id=self.request_id,
                                              endpoint_id=self.endpoint.id, call_token=self.call_token)
                self.outstanding_replica_id = self.held.replica_id = None
            finally:
                self.metrics.inflight.dec()
        if may_hold and tried and not self.disconnected.is_set() and not await directory.ready_replicas(
                self.endpoint.id, fresh=True, generation=self.endpoint.engine_generation):
            raise _NoReplicaLeft()
        raise errors.upstream_failed("No replica could take the request; please retry.")

    async def _forward(self, replica: ReplicaInfo) -> None:
        if self.disconnected.is_set():
            raise ClientGone()  # a non-streamed call whose client left during a first try: no new engine request
        self.forwarded = True  # NOTE: no await since the check: the watcher cancels until this is set
        try:
            response = await self.client.post(
                replica.address, self.request.path, self.request.upstream_body(media_scope=self.caller.limit_subject),
                {"content-type": "application/json", "x-request-id": self.request_id,
                 "authorization": replica.authorization},
                patience=functools.partial(self._patience, replica),
                # NOTE: a stream's headers come at once; its first event is what its engine's silence delays
                first_byte_timeout_s=self._first_event_timeout_s() if self.request.stream else None,
                patience_until_body=self.request.stream,
                # NOTE: vLLM writes a Responses stream's `response.created` and `response.in_progress` at once: they
                # ended the bound, and a hung engine held the stream for the whole read timeout (600 s)
                first_event_told=self.request.stream and self.request.kind == responses.RESPONSES,
            )
        except upstream.UpstreamTimeout as exc:
            # NOTE: never sent again elsewhere: the replica has the request, and an engine that was computing it
            # computed it for nothing (twice, had it been retried). Given up only on an engine that stopped
            # generating, or past the longest wait (`_patience`): billed nothing.
            logger.warning("request %s: replica %s timed out: %s", self.request_id, replica.id, exc)
            if self._waited_out_s is not None:
                raise errors.answer_wait_exceeded(self._waited_out_s) from None
            raise errors.upstream_timeout() from None
        except upstream.UpstreamError as exc:
            if upstream.engine_cannot_have_started(exc):
                raise UpstreamUnavailable(f"{type(exc).__name__}: {exc}") from None
            still_ready = exc.before_first_byte and await self._still_ready(replica)
            if (upstream.idle_close_raced(exc) or upstream.reset_before_answer(exc)) and not still_ready:
                # NOTE: a replica drained or scaled to zero (not READY, read now) whose engine closed the idle pooled
                # connection the call went out on as it stopped, or reset one it had no call on yet: its engine never
                # read it (uvicorn finishes the calls it read before it stops). One still READY is an engine that died
                # on it, or one computing it behind a middlebox that reset the connection (an idle timeout on a
                # non-streamed answer's silence): never sent again, below.
                raise UpstreamUnavailable(f"{type(exc).__name__} as its replica stopped: {exc}") from None
            # NOTE: never sent again elsewhere: the engine read the request (a connection that closed before any answer
            # is an engine that died on it, or was killed, perhaps after most of its work), and a second replica would
            # compute it again, unbilled, as would a third the next time (the review of the gateway's retries).
            logger.warning("request %s: replica %s failed it: %s", self.request_id, replica.id, exc)
            # NOTE: one that died on it, its replica still READY, is `engine_failed` as its 500 is: a batch line that
            # kills its engine each time gives up as one it fails does (`runner.MAX_ENGINE_FAILURES`); as
            # `upstream_failed` it was tried every second until its batch expired, a day, each try killing an engine.
            raise (errors.engine_failed() if still_ready else errors.upstream_failed()) from None
        try:
            if response.status == 401:
                # The engine's key guard refusing our key, before it reads the body: the replica's fault, never the
                # client's, and nothing was computed.
                raise UpstreamUnavailable(f"HTTP {response.status}")
            if response.status >= 500:
                raise await self._engine_failed(replica, response.status)
            if response.status >= 400:
                raise self.request.engine_refusal(response.status, await response.read())
            self.replica = replica
            self.served = True
            if self.request.stream:
                await self._relay_stream(response)
            else:
                await self._relay_whole(response)
        finally:
            # NOTE: a response read to the end returns its connection to the pool; one left
            # unread (a client gone mid-stream) closes it, which aborts the engine's request.
            response.close()

    async def _engine_failed(self, replica: ReplicaInfo, status: int) -> errors.OpenAIError:
        """The refusal of a call whose engine answered it with a 5xx of its own: `engine_failed` for a 500 where its
        replica is still READY (read now: the engine is up and this request fails there, as it may again),
        `upstream_failed` otherwise (a replica going away, its engine failing as it stops). Neither is sent again
        elsewhere.

        NOTE: it was tried again on another replica: a 500 comes once the engine has read the body, perhaps after it
        generated most of an answer (a non-streamed answer's status comes with its end), and the first engine's work was
        never billed: a tenant who could make an engine fail late had two replicas compute each call for no bill (the
        review of the gateway's retries)."""
        logger.warning("request %s: replica %s's engine answered HTTP %d", self.request_id, replica.id, status)
        if status == 500 and await self._still_ready(replica):
            return errors.engine_failed()
        return errors.upstream_failed()

    def _first_event_timeout_s(self) -> float:
        """The silence a stream's first event is waited for before its engine is asked whether it generates
        (`_patience`): `GATEWAY_STREAM_FIRST_EVENT_TIMEOUT_S`, and its prompt's prefill at
        `GATEWAY_STREAM_PREFILL_TOKENS_PER_S` more, up to the read timeout. An engine prefilling one long prompt
        generates nothing until its first token, so its agent's report cannot tell it from a hung one: a long prompt
        on a slow or busy engine was cut at the bound, its prefill thrown away. A hung engine is still cut, once its
        prompt's share has passed. Computed from the prompt's bound alone: no round trip on the warm path."""
        bound_s = hot.GATEWAY_STREAM_FIRST_EVENT_TIMEOUT_S
        prefill_s = (self.num_prompt_tokens_bound or 0) / hot.GATEWAY_STREAM_PREFILL_TOKENS_PER_S
        return max(bound_s, min(bound_s + prefill_s, self.client.read_timeout_s))

    async def _still_ready(self, replica: ReplicaInfo) -> bool:
        """Whether `replica` is READY, read now: its engine up (a replica being drained or scaled to zero is not)."""
        return replica.id in {r.id for r in await directory.ready_replicas(self.endpoint.id, fresh=True)}

    async def _patience(self, replica: ReplicaInfo) -> float | None:
        """How much longer to wait for the first byte of an answer `replica` has been silent on past the read
        timeout (a stream's first event, past `_first_event_timeout_s`: a prompt's prefill, a queue in
        the engine; given up on as a non-streamed answer is, unbilled, ended with an error event):
        a non-streamed answer comes whole when the engine is done, and a long one (a large `max_tokens`,
        `n`, a slow model, a queue) takes longer than any fixed timeout. Giving up closed the connection, which
        aborted the engine's request, and billed nothing for what it had generated: an answer asked to run
        past the timeout was computed free. So the call waits on while the replica's engine generates (its
        agent's last report: `directory.engine_generating`), up to `GATEWAY_MAX_ANSWER_WAIT_S` from its start
        (or its `answer_deadline`), and gives up (nothing billed) on an engine that stopped, a replica that
        left or a node gone silent. Its reservation is held as long (`presence`). A database that does
        not answer in time is not a no: the call waits on, asking again, within the same bounds."""
        deadline = self._started_monotonic + settings.GATEWAY_MAX_ANSWER_WAIT_S
        if self.answer_deadline is not None:
            deadline = min(deadline, self.answer_deadline)
        now = time.monotonic()
        left_s = deadline - now
        if left_s <= 0:
            self._waited_out_s = now - self._started_monotonic
            return None
        check, asked_of = self._engine_check or (None, None)
        if check is None or check.done() or asked_of != replica:
            check = asyncio.ensure_future(directory.engine_generating(self.endpoint.id, replica.id, replica.address))
            check.add_done_callback(_retrieve)
            self._engine_check = (check, replica)
        try:
            async with asyncio.timeout(PATIENCE_QUERY_TIMEOUT_S):
                generating = await asyncio.shield(check)
        except Exception as exc:  # noqa: BLE001 - unknown is not "stopped": the engine may well be generating
            if not errors.is_outage(exc):  # an outage, the query's timeout included
                raise
            logger.warning("request %s: could not read whether replica %s still generates: %r", self.request_id,
                           replica.id, exc)
            generating = True
        return min(PATIENCE_RECHECK_S, left_s) if generating else None

    async def _relay_whole(self, response: upstream.Response) -> None:
        scanner = sse.UsageScanner()
        holding = self.answer_holding
        if holding is None:
            holding = delivery.Holding(self.caller.organization_id)
        self._holding = holding
        try:
            body = await response.read(overflow=scanner.feed, holding=holding)
        except upstream.ResponseTooLarge:
            # NOTE: read to its end and billed for the usage it carries: the engine computed all of it for this
            # request's own `n`, `max_tokens` and logprobs, and dropping it at the limit billed nothing (a way to
            # have up to n × max_tokens generated free). A 400, not a 5xx: the same request would fail again.
            self.usage.take_totals(scanner.usage)
            if not holding.kept_on_disk:
                self.status = "upstream_error"
                if self.batch_id:
                    raise errors.batch_answer_too_large(self.request.kind, holding.max_answer_bytes, as_outside=(
                        holding.max_answer_bytes >= upstream.MAX_WHOLE_BODY_BYTES)) from None
                raise errors.response_too_large(self.request.kind, holding.max_answer_bytes) from None
            # NOTE: a batch line's answer past what its worker keeps in memory, whole in its holding's file
            # (`endpoints.batches.answer_bytes`): the line reads it from there, and is sent no body here.
            body = b""
        except upstream.UpstreamError as exc:
            self.status = "upstream_error"
            raise errors.upstream_failed(f"The replica failed mid-request ({type(exc).__name__}).") from None
        else:
            self.usage.take_totals(self.request.answer_usage(body))
        finally:
            holding.done_reading()
        self.first_token_at = self._now()
        if self.disconnected.is_set():  # read to its end for its usage (`_watch_disconnect`); nobody to answer
            self.status = "client_aborted"
            return
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"x-request-id", self.request_id.encode()), *self.ratelimit.headers(), *self.cors_headers]
        if self.held_at is not None:
            await self._measure_cold_start()
            headers.append(self.cold_start.header())
        # NOTE: watched as every send: on a kept-alive connection whose last answer its client has not read, even the
        # first send of the next waits (the server's buffer is full), and unwatched it waited for as long as the client
        # kept the connection, holding the call's replica and reservation.
        delivery.watch(self)
        # NOTE: a batch line's `send` keeps its answer (`endpoints.batches.runner`): handed whole, the engine's bytes
        # themselves, as pieces copied for it the answer was held twice until the last.
        if len(body) > delivery.PIECE_BYTES and not self.batch_id:
            await self._send_in_pieces(headers, body)
            return
        if self.response_started:  # progress was asked for: the headers went out at the hold
            await self.send_body(body)
            holding.sent(len(body))
            return
        await self._send_watched({"type": "http.response.start", "status": 200, "headers": headers})
        self.response_started = True
        await self._send_watched({"type": "http.response.body", "body": body})
        holding.sent(len(body))

    async def _send_in_pieces(self, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """A large whole answer, handed to the server a piece at a time as its client takes them: what is not
        handed over yet counts against the organisation (`self._holding`, from its first byte read), and a client that
        takes nothing is cut off (`delivery`)."""
        if not self.response_started:
            await self._send_watched({"type": "http.response.start", "status": 200, "headers": headers})
            self.response_started = True
        view = memoryview(body)
        for start in range(0, len(body), delivery.PIECE_BYTES):
            if self.disconnected.is_set():
                raise ClientGone()
            piece = view[start:start + delivery.PIECE_BYTES]
            # NOTE: the last piece ends the answer, unless progress was asked for (`_finish` ends it then).
            more = start + delivery.PIECE_BYTES < len(body) or self.request.progress
            await self._send_watched({"type": "http.response.body", "body": bytes(piece), "more_body": more})
            self._holding.sent(len(piece))

    async def _relay_stream(self, response: upstream.Response) -> None:
        if self.request.kind == responses.RESPONSES:
            self._awaits_first_event = response
        await self.start_stream()
        self._ceiling = ledger.CostCeiling.of(self.endpoint, self.reserved, fraction=self.price_fraction)
        options = self.request.payload.get("stream_options") or {}
        wants_usage = bool(options.get("include_usage"))
        wants_continuous = wants_usage and bool(options.get("continuous_usage_stats"))
        # NOTE: the unfinished event's pieces, joined once it is complete: joining each piece onto it (and searching
        # it again for its end) cost time quadratic in its size, the event loop held for seconds by one large event.
        pending, pending_bytes = [], 0
        chunks = response.chunks()
        try:
            async for chunk in chunks:
                # NOTE: the end may straddle the pieces; tested without joining them (a copy of each piece)
                if pending and b"\n\n" not in chunk and not (chunk[:1] == b"\n" and pending[-1][-1:] == b"\n"):
                    pending.append(chunk)
                    pending_bytes += len(chunk)
                    if pending_bytes > sse.MAX_EVENT_BYTES:
                        pending, pending_bytes = await self._drop_large_event(pending, chunks, wants_usage,
                                                                              wants_continuous)
                    continue
                rest = await self._relay_events(b"".join(pending) + chunk if pending else chunk, wants_usage,
                                                wants_continuous)
                pending, pending_bytes = ([rest], len(rest)) if rest else ([], 0)
                if pending_bytes > sse.MAX_EVENT_BYTES:
                    pending, pending_bytes = await self._drop_large_event(pending, chunks, wants_usage,
                                                                          wants_continuous)
        except upstream.UpstreamError as exc:
            self._replica_failed = True
            # Every event that arrived before the failure still reaches the client, and is billed.
            await self._relay_events(b"".join(pending) + response.arrived_before_failure(), wants_usage, wants_continuous)
            self.status = "upstream_error"
            if isinstance(exc, upstream.UpstreamTimeout):
                # NOTE: given up (its connection closed, which aborts the engine's request) as a non-streamed call's
                # silence is (`_forward`): billed what was relayed, never sent again elsewhere.
                logger.warning("request %s: replica %s timed out mid-stream: %s", self.request_id, self.replica.id, exc)
                raise errors.upstream_timeout() from None
            raise errors.upstream_failed(f"The replica failed mid-stream ({type(exc).__name__}).") from None
        if self.disconnected.is_set():  # read to its end after the client left, no event carrying usage
            self.status = "client_aborted"

    async def _drop_large_event(self, pending: list[bytes], chunks, wants_usage: bool,
                                wants_continuous: bool) -> tuple[list[bytes], int]:
        """An event past `sse.MAX_EVENT_BYTES` (the echo of a long prompt with the logprobs of each of its tokens): read
        to its end for its usage, keeping none of it, and the stream ends there with an error event (the engine's
        request aborted). Held whole, one such event of ~100 MB a call held the gateway's memory and its loop.

        A Responses event other than the stream's last (`response.content_part.done` with every token's logprobs) carries
        no usage: it is dropped, unrelayed, and the stream goes on (the events after it relayed) to its last event,
        whose usage is billed; returned: what came after it, as `_relay_stream`'s unfinished event. Ended there, such
        a stream was billed nothing (its usage comes only in its last event)."""
        # NOTE: where its name and its choice's index are, from the first bytes of every piece: the first piece is what
        # the read before left over, maybe only `event: respo`, which took a stream's last event for another (dropped,
        # unrelayed and its usage unread: billed as a cut stream, its prompt free)
        head = b""
        for piece in pending:
            head += piece[:sse.EVENT_HEAD_BYTES - len(head)]
            if len(head) >= sse.EVENT_HEAD_BYTES:
                break
        responses_event = head.startswith(b"event: ")
        dropped = responses_event and not sse.is_responses_end(head)
        scanner = sse.UsageScanner()
        if not dropped:
            for piece in pending:
                scanner.feed(piece)
        tail = pending[-1][-1:]
        pending.clear()
        after = b""
        async for chunk in chunks:
            end = (tail + chunk).find(b"\n\n")
            if end >= 0:
                if not dropped:
                    scanner.feed(chunk[:max(0, end + 1 - len(tail))])
                after = chunk[end + 2 - len(tail):]
                break
            if not dropped:
                scanner.feed(chunk)
            tail = chunk[-1:]
        if dropped:
            if sse.is_responses_output(head):
                self.usage.prompt_prefilled = True
            logger.warning("request %s: a stream event past %d bytes (%r) dropped unrelayed", self.request_id,
                           sse.MAX_EVENT_BYTES, head[:head.find(b"\n")].decode("ascii", "replace"))
            rest = await self._relay_events(after, wants_usage, wants_continuous) if after else b""
            return ([rest], len(rest)) if rest else ([], 0)
        if responses_event:  # a Responses stream's last event: its totals
            self.usage.take_totals(scanner.usage)
        else:
            self.usage.take_chunk(scanner.usage, head)
        self.status = "upstream_error"
        raise errors.event_too_large(sse.MAX_EVENT_BYTES)

    async def _relay_events(self, buffer: bytes, wants_usage: bool, wants_continuous: bool) -> bytes:
        """Sends the complete SSE events in `buffer` (in one write); returns the incomplete rest.

        Stops at the event whose usage passes the reservation: a read that holds many events (a
        fast engine, a slow gateway) never relays, or counts, past the cut-off. After the client left
        (before every prompt's first event, see `_watch_disconnect`) relays nothing, counts the events
        up to the one that completes the prompts' count, and stops there.
        """
        if b"\n\n" not in buffer:
            return buffer
        gone = self.disconnected.is_set()
        if gone and self.usage.every_prompt_counted:
            raise ClientGone()
        *events, rest = buffer.split(b"\n\n")
        out, spent = [], False
        responses_stream = self.request.kind == responses.RESPONSES
        if responses_stream:
            # NOTE: its cut's prompt may be counted by another replica, only one this process holds: kept held while
            # it runs (`directory.keep_replicas_held`), never read from the database at its end
            directory.keep_replicas_held(self.endpoint.id)
        for event in events:
            if gone and self.usage.every_prompt_counted:
                break
            if self.first_token_at is None and sse.carries_output(event):
                self.first_token_at = self._now()
                self.metrics.time_to_first_token.observe(time.monotonic() - self._started_monotonic)
            if not responses_stream and sse.is_engine_error(event):
                # NOTE: in OpenAI's shape, as the gateway's own error events are (`_send_event_error`)
                out.append(b"data: " + self.request.engine_stream_error(event[6:]).body())
                if self.status == "ok":
                    self.status = "upstream_error"
                continue
            if responses_stream and (sse.is_error_event(event) or sse.is_engine_error(event)):
                # NOTE: in the Responses API's shape, as the gateway's own are (`_send_event_error`): vLLM writes its
                # generation's failure in its chat streams' shape
                normalised = responses.engine_error_event(event, responses.next_sequence_number(
                    out[-1], self._next_sequence_number) if out else self._next_sequence_number)
                out.append(event if normalised is None else normalised.removesuffix(b"\n\n"))
                if self.status == "ok":
                    self.status = "upstream_error"
                continue
            data, event_usage = sse.rewrite_event(event, wants_usage, wants_continuous)
            if data is not None:
                out.append(data)
            if event_usage:
                # NOTE: counted with the write below (no await in between): an aborted stream pays
                # for what it was sent, up to the event that spent the reservation.
                if sse.has_choices(event):
                    self.usage.take_chunk(event_usage, event)
                else:
                    self.usage.take_totals(event_usage)
                if self._ceiling.exceeded(*self.usage.counts()):
                    spent = True
                    break
            elif responses_stream:
                # NOTE: counted as read, as usage is: a Responses stream cut before its last event (a drain, a replica
                # lost, an engine's error) is billed these as its output tokens' floor, and a lost gateway's beat too.
                if sse.is_responses_delta(event):
                    self.usage.num_output_events += 1
                if not self.usage.prompt_prefilled and sse.is_responses_output(event):
                    self.usage.prompt_prefilled = True
        if self._awaits_first_event is not None and self.usage.prompt_prefilled:
            # NOTE: told before the send below, which may wait on a slow client while the engine is silent
            self._awaits_first_event.first_event_came()
            self._awaits_first_event = None
        if gone and not spent:
            if self.usage.every_prompt_counted:
                raise ClientGone()
            return rest
        if out and not gone:
            if responses_stream:
                self._next_sequence_number = responses.next_sequence_number(out[-1], self._next_sequence_number)
            out.append(b"")
            await self.send_body(b"\n\n".join(out))
        if spent:
            # NOTE: raising closes the upstream response unread, which aborts the engine's request.
            self.status = "cut_off"
            raise ReservationSpent()
        return rest

    def _cost(self) -> Decimal:
        """The real cost of the tokens counted so far (before the reservation's cap)."""
        return ledger.cost_of(self.endpoint, *self.usage.counts(), fraction=self.price_fraction)

    # --- the client side ---------------------------------------------------------------------
    async def start_stream(self) -> None:
        if self.response_started:
            return
        kind = sse.SSE_HEADERS if self.request.stream else [(b"content-type", b"application/json")]
        headers = [*kind, (b"x-request-id", self.request_id.encode()), *self.ratelimit.headers(), *self.cors_headers]
        delivery.watch(self)
        await self._send_watched({"type": "http.response.start", "status": 200, "headers": headers})
        self.response_started = True

    async def send_body(self, data: bytes) -> None:
        await self._send_watched({"type": "http.response.body", "body": data, "more_body": True})

    async def _send_watched(self, message: dict) -> None:
        self.sending_since = time.monotonic()
        try:
            await self.send(message)
        finally:
            self.sending_since = None

    @property
    def started_monotonic(self) -> float:
        return self._started_monotonic

    def _now(self) -> datetime:
        """Now, as this call stamps its times (held, first token, finished): its start (`started_at`, Redis's clock as
        its gateway's offset said) plus the time since by the monotonic clock.

        NOTE: each read of Redis's clock anew (`clock.redis_datetime`): its offset, read again by a beat mid-call after
        the machine's clock stepped (NTP, a VM resumed), moved the call's later times against its start: stepped 10
        minutes forward, a call started before the beat and ended after it finished 10 minutes before it started, a
        report the ledger refuses (`UsageReport`), and its usage row was lost."""
        return self.started_at + timedelta(seconds=time.monotonic() - self._started_monotonic)

    def cut_off(self, reason: str) -> None:
        """`delivery`'s watchdog: the client took none of its answer for the send deadline, or the call ran for the
        longest a call may. It is treated as a client that left (billed for what it was answered or its engine
        computed, its replica and reservation released), and its connection dropped with what the server still
        buffers for it."""
        logger.warning("request %s: cut off: %s; connection dropped", self.request_id, reason)
        self.disconnected.set()
        dropped = delivery.drop_connection(self.send)
        if dropped and self.request.stream and self._reads_on_for_usage():
            # NOTE: as a client that left (`_watch_disconnect`): a stream whose usage is not known yet (a Responses
            # stream carries it only in its last event) reads on to it, relaying nothing. Cancelled, it was billed
            # nothing: stop reading, and the prompt and the output sent were free. The send it waits in returns: the
            # server's flag is set (`drop_connection`) and its lost connection resumes writing.
            return
        # NOTE: cancelled too: the dropped connection wakes the send waiting on it before the server hears it is
        # gone, and the send then wrote to the closed connection (a RuntimeError, answered as a 500).
        if self._task is not None and not self._cancelled_for_client:
            self._cancelled_for_client = True
            self._task.cancel()

    async def _send_event_error(self, exc: errors.OpenAIError) -> None:
        if self.disconnected.is_set():
            return
        if not self.request.stream:
            await self.send_body(exc.body())
        elif self.request.kind == responses.RESPONSES:  # the Responses API's own shape, which its clients parse
            await self.send_body(responses.error_event(exc, self._next_sequence_number))
        else:
            await self.send_body(b"data: " + exc.body() + b"\n\n")

    async def _watch_disconnect(self, work: asyncio.Task) -> None:
        """A client that leaves cancels the call, except one already sent to a replica whose usage so far
        the gateway does not know yet: a non-streamed call, and a stream before each prompt's first event.

        NOTE: a non-streamed answer's usage comes only with the whole answer. Cancelling it aborted the engine's
        request, whatever it had computed, and the call was billed nothing: a client could have any prompt
        prefilled and most of an answer generated for free by leaving just before the end. Such a call now
        reads its answer to the end (bounded as any: its `max_tokens`, the read timeout or `_patience`; past the size cap
        through `sse.UsageScanner`), bills its usage and drops the body. A stream is billed for the events it
        sent, so it stops at once, unless none had come yet: its first event of each prompt comes once the
        engine has prefilled it and carries its prompt's tokens, so a stream left before them reads on to
        those events (relaying nothing), is billed for them and stops there (`_relay_events`). Aborted at
        once, it was billed nothing for a prefill the engine had mostly done, and the prefix cache kept
        it: leave before the first token, then send the same prompt again, and its prompt was billed at
        the cached price only. The price of one rule (a request that reached a replica has its prompt
        processed and billed; leaving stops its output): a stream left while it waits in the engine's
        queue is still prefilled when its turn comes, holding its place in the caller's concurrency
        until then (bounded by the read timeout), and its prompt is billed at the input price (vLLM's
        per-chunk usage does not say how much of it the prefix cache held).
        """
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                self.disconnected.set()
                if self._cancelled_for_client:
                    return  # cut off already (`cut_off`)
                if not self._reads_on_for_usage():
                    self._cancelled_for_client = True
                    work.cancel()
                return

    def _reads_on_for_usage(self) -> bool:
        """Whether a call whose client is gone reads on for its usage (`_watch_disconnect`): it was sent to a replica,
        and its usage so far is not known yet (a non-streamed call; a stream before each prompt's counted)."""
        return self.forwarded and not (self.request.stream and self.usage.every_prompt_counted)

    async def _measure_cold_start(self) -> None:
        if self.cold_start is not None:
            return
        try:
            timeline = await anatomy.replica_timeline(self.endpoint.id, self.replica.id if self.replica else None)
        except Exception:  # noqa: BLE001 - the anatomy is a measure: never fail the answer for it
            logger.exception("request %s: could not read its replica's cold start", self.request_id)
            timeline = None
        first_token_at = self.first_token_at or self._now()
        try:
            self.cold_start = anatomy.split(self.held_at, first_token_at, timeline)
        except (ValueError, OverflowError):  # NOTE: a measure: an odd one never fails the answer or loses its usage row
            logger.exception("request %s: its replica's cold start could not be split", self.request_id)
            self.cold_start = anatomy.split(self.held_at, first_token_at, None)
        metrics.observe_cold_start_phases(self.cold_start.phases)

    # --- the end -----------------------------------------------------------------------------
    async def _finish(self, admitted: admission.Admission) -> None:
        finished_at = self._now()
        try:
            if self.held_at is not None and self.served:
                await self._measure_cold_start()
            if self.response_started and (self.request.stream or self.request.progress) and not self.disconnected.is_set():
                try:
                    # NOTE: bounded as every send: a client that stops reading at the end must not keep its usage
                    # unwritten and its reservation held.
                    async with asyncio.timeout(settings.GATEWAY_SEND_TIMEOUT_S):
                        await self.send({"type": "http.response.body", "body": b"", "more_body": False})
                except TimeoutError:
                    delivery.drop_connection(self.send)
                except Exception:  # noqa: BLE001 - the client may be gone already
                    pass
            if self._cut_before_its_usage() and self.usage.prompt_prefilled:
                try:
                    await self._count_cut_prompt()
                except Exception:  # noqa: BLE001 - a measure of the bill: never lose the usage row for it
                    logger.exception("request %s: its cut stream's prompt could not be counted", self.request_id)
        except BaseException:
            # NOTE: cancelled (a loop that ends: a batch run's) before its settlement: a later beat of this process
            # ends it in Redis (`presence.end_later`), and its beat no longer holds its reservation, which the sweeper
            # then releases.
            usage = self.usage
            presence.end_later(self.caller.organization_id, self.request_id, call_token=self.call_token,
                               give_back=admitted.window.give_back_keys_and_args(
                                   usage.prompt_tokens + usage.completion_tokens, self.call_token))
            raise
        # NOTE: a batch line's id is the same on its every try (exactly-once usage): a try that failed after its
        # replica answered, with nothing counted (the body cut off), wrote an empty usage row, and the retry that
        # succeeded was billed nothing (its row conflicted with the empty one; its settlement found the marker).
        usage = self.usage
        if self._cut_before_its_usage() and self.status == "ok":
            # NOTE: a Responses stream whose last event (its usage) never came was cut: billed its deltas as output and
            # its prompt as its engine renders it (`_count_cut_prompt`)
            self.status = "upstream_error"
        prompt_tokens, cached_tokens, completion_tokens = usage.counts()  # final: nothing is counted past here
        recorded = self.served and not (self.batch_id and self.status == "upstream_error"
                                        and not (prompt_tokens or completion_tokens))
        if recorded and self.num_prompt_tokens_bound is not None and prompt_tokens > self.num_prompt_tokens_bound:
            self._learn_prompt_factor(prompt_tokens)
        # NOTE: never more than reserved: the reservation is the most a cap or the credit can lose.
        actual = self._cost() if recorded else Decimal(0)
        if actual > self.reserved:
            # NOTE: a stream stopped at its reservation went past it by its last chunk only, unless its prompt passed
            # the estimate's bound (a template or tokenizer rendering more): that prompt took output the reservation
            # held for it, so the stream was cut off early, and the loss was seen only when the prompt alone passed
            # the whole reservation.
            if self.status != "cut_off" or self._prompt_past_estimate(usage):
                self._note_usage_past_reservation(actual)
            actual = self.reserved
        journaled = False
        num_tokens = prompt_tokens + completion_tokens if recorded else 0
        try:
            # NOTE: the ledger row first, then the settlement: if Redis loses its counters in
            # between, they are rebuilt from the ledger, which already has this request.
            if recorded:
                self.held.writes_row = True
                journaled = usage_writer.Recorded.JOURNALED == await usage_writer.arecord_usage(
                    self.usage_report(finished_at=finished_at, status=self.status, billing_mode=admitted.billing_mode))
        finally:
            presence.untrack(self.request_id)
            try:
                # NOTE: also releases the replica that served it (or was picked when the client left).
                await admission.finish(caller=self.caller, endpoint_id=self.endpoint.id, admission=admitted,
                                       release=self.outstanding_replica_id,
                                       num_tokens=num_tokens,
                                       cost=actual, served_by=self.replica.id if self.replica else None,
                                       cached_tokens=cached_tokens, fresh_id=not self.batch_id, recorded=recorded,
                                       finished_at=finished_at, journaled=journaled, lapsed_at=self.held.lapses_at)
            except asyncio.CancelledError:
                # as below: its loop is ending
                presence.end_later(self.caller.organization_id, self.request_id, call_token=self.call_token,
                                   row_journaled=journaled,
                                   give_back=admitted.window.give_back_keys_and_args(num_tokens, self.call_token))
                raise
            except Exception as exc:
                if not errors.is_outage(exc):
                    raise
                # NOTE: the answer is given and its usage row written; the heartbeat ends it in Redis
                # later, and the reservation expires (`billing.quota.sweeper`).
                logger.warning("request %s: could not end it in Redis now: %r", self.request_id, exc)
                presence.end_later(self.caller.organization_id, self.request_id, call_token=self.call_token,
                                   row_journaled=journaled,
                                   give_back=admitted.window.give_back_keys_and_args(num_tokens, self.call_token))
            finally:
                self._observe(outcome=self.status if self.served else "not_served")

    def _cut_before_its_usage(self) -> bool:
        """A Responses stream that ended before its last event, the only one that says its usage."""
        return (self.served and self.request.stream and not self.usage.has_totals
                and self.request.kind == responses.RESPONSES)

    async def _count_cut_prompt(self) -> None:
        """A Responses stream cut after its engine's first output (its prompt prefilled whole: `sse.is_responses_output`)
        has its prompt counted by an engine of its endpoint (`rendered_prompt`): the replica that served it unless it
        failed, else another of its configuration holding its adapter. Billed its deltas alone, its prompt was free."""
        # NOTE: nothing is awaited before `count_prompt_tokens`, whose bound is so the whole count's: the
        # others are those the directory already holds, never loaded (a load waits on PostgreSQL, 5-10 s in an
        # outage, and a stopping process's finish, `SHUTDOWN_FINISH_WAIT_S`, then gave up on the usage row).
        ready = directory.held_ready_replicas(self.endpoint.id, generation=self.endpoint.engine_generation)
        # NOTE: a failed replica is still READY in the cached list for a while: it is never asked (its connection may
        # take the whole wait to fail)
        others = [r for r in ready if r.id != self.replica.id
                  and (self.adapter is None or self.adapter.name in r.adapters)]
        asked = others if self._replica_failed else [self.replica, *others]
        body = self.request.upstream_body(media_scope=self.caller.limit_subject)
        num_tokens = await rendered_prompt.count_prompt_tokens(
            self.client, asked, body, self.request_id, max_model_len=self.endpoint.max_model_len
        )
        if num_tokens is not None:
            self.usage.take_rendered_prompt(num_tokens)

    def usage_report(self, *, finished_at: datetime, status: str, billing_mode: str) -> ledger.UsageReport:
        """The call's usage row as it stands: at its end (`_finish`), or while it streams, as its progress
        (`progress`)."""
        prompt_tokens, cached_tokens, completion_tokens = self.usage.counts()
        return ledger.UsageReport(
            request_id=self.request_id, organization_id=self.caller.organization_id,
            api_key_id=self.caller.api_key_id, endpoint_id=self.endpoint.id,
            replica_id=self.replica.id if self.replica else None,
            prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
            completion_tokens=completion_tokens, started_at=self.started_at,
            first_token_at=self.first_token_at, finished_at=finished_at, status=status,
            cold_start_s=round(self.cold_start_s, 3), max_cost=self.reserved, batch_id=self.batch_id,
            cold_start_ms=self.cold_start.total_ms if self.cold_start else None,
            cold_start_phases=self.cold_start.phases if self.cold_start else None,
            adapter=self.adapter.name if self.adapter else "",
            price_input_per_million=self.endpoint.price_input_per_million,
            price_cached_input_per_million=self.endpoint.price_cached_input_per_million,
            price_output_per_million=self.endpoint.price_output_per_million, price_fraction=self.price_fraction,
            billing_mode=billing_mode,
        )

    def progress(self, billing_mode: str, recorded: tuple[int, int, int] | None = None) -> ledger.UsageReport | None:
        """What the sweeper bills if this call's gateway is lost now (`presence`'s beat records it): the usage it was
        answered so far, as a row cut by a lost gateway; None while it has none (not served yet, or a non-streamed
        answer, whose usage comes with its end), or while its tokens (prompt, cached, completion) are still those a
        beat `recorded`. A batch line has none: its next try, under its id, bills it whole.

        NOTE: its tokens are compared before any row is built: a beat built and checked a whole row for every stream,
        changed or not, on the event loop (~110 µs each: 0.1 s a second at 1,000 streams; the review of the beat)."""
        counts = self.usage.counts()
        if not self.served or self.batch_id or not (counts[0] or counts[2]):
            return None
        if recorded == counts:
            return None
        return self.usage_report(finished_at=self._now(), status=UsageStatus.GATEWAY_LOST,
                                 billing_mode=billing_mode)

    def _prompt_past_estimate(self, usage: UsageTally) -> bool:
        if self.num_prompt_tokens_bound is None:
            return self._ceiling.exceeded(usage.prompt_tokens, usage.cached_tokens, 0)
        return usage.prompt_tokens > self.num_prompt_tokens_bound

    def _learn_prompt_factor(self, num_prompt_tokens: int) -> None:
        """The engine counted more prompt tokens than the estimate bounded: the endpoint's later calls are reserved
        for the least factor that covers them (`prompt_factor_for`, `PromptFactor`), in this process at once, in the others with their next load of the endpoint
        (`directory.ENDPOINT_CACHE_S`), once its row is written, off the answer's path (its end already sent).

        NOTE: this call is billed at most its reservation still (the loss is one call's); a tenant raising its
        prompts step by step loses the platform at most one reservation a step, and each step raises the factor."""
        endpoint = self.endpoint
        if not endpoint.model_copy[0]:
            return
        factor = prompt_factor_for(num_prompt_tokens, self.unscaled_prompt_bounds, endpoint.max_model_len)
        directory.keep_prompt_factor(endpoint, factor)
        key = (endpoint.id, endpoint.model_copy)
        if _writing_prompt_factors.get(key, 0) >= factor:
            return  # NOTE: many calls past the same bound at once (before the factor landed) write it once
        _writing_prompt_factors[key] = factor
        writing = asyncio.ensure_future(_write_prompt_factor(endpoint, factor))
        _finishing.add(writing)  # a stopping process waits for it as for a usage row (`finish_pending`)
        writing.add_done_callback(_finishing.discard)

    def _note_usage_past_reservation(self, cost: Decimal) -> None:
        """The engine reported more than the estimate bounds (`endpoints.gateway.estimate`): billed the
        reservation, counted and logged so the loss is seen (a stream stopped at its reservation by its output is not
        this; one whose prompt alone passed it is)."""
        metrics.usage_past_reservation.labels(self.endpoint.id, self.endpoint.organization_id).inc()
        logger.warning("request %s on endpoint %s: usage (%d prompt, %d completion tokens) costs %s, past the %s "
                       "reserved; billed the reservation", self.request_id, self.endpoint.id, self.usage.prompt_tokens,
                       self.usage.completion_tokens, cost, self.reserved)

    def _observe(self, outcome: str) -> None:
        """The request's metrics and its line in the request log."""
        duration_s = time.monotonic() - self._started_monotonic
        prompt_tokens, cached_tokens, completion_tokens = self.usage.counts()
        self.metrics.observe_request(outcome, duration_s, prompt_tokens, cached_tokens, completion_tokens)
        if not logger.isEnabledFor(logging.INFO):
            return
        args = (self.request_id, self.caller.organization_id, self.caller.api_key_id, self.endpoint.name,
                self.replica.id if self.replica else "-", outcome, prompt_tokens, cached_tokens,
                completion_tokens, self.cold_start_s, duration_s)
        # NOTE: the record `logger.info` makes, file, line and function included, named here: `Logger.findCaller`
        # walked the stack for them (~2.4 µs of the line's ~13, timed alone). The frame is never held in a local: a
        # frame that holds itself is a cycle, which kept each call until the collector ran.
        logger.handle(logger.makeRecord(logger.name, logging.INFO, _OBSERVED_AT.co_filename, sys._getframe().f_lineno,
                                        REQUEST_LINE, args, None, _OBSERVED_AT.co_name))


# The request line's call site: its file and function (`InferenceCall._observe`).
_OBSERVED_AT = InferenceCall._observe.__code__


# The prompt factor this process is writing now, per (endpoint, copy of its model): a lower or equal one is not
# written as well; each is dropped once its write is done (at most one per call in flight).
# NOTE: not every factor ever written: staff reset a factor in the database alone, and a process that had written it
# never wrote it again (every second call past the bound lost ~86 %: the review of the factor).
_writing_prompt_factors: dict[tuple[str, tuple[str, str]], Decimal] = {}
# A factor past this is worth an operator's look (a template far from the estimate, or an engine over-reporting).
PROMPT_FACTOR_WARNING = 8
# Factors whose write met the database away (`directory.unwritten_prompt_factors`) are written again every
# `PROMPT_FACTOR_RETRY_S` until written (`_write_unwritten_prompt_factors`).
_retrying_prompt_factors: asyncio.Task | None = None
PROMPT_FACTOR_RETRY_S = 2.0


async def _write_prompt_factor(endpoint: EndpointInfo, factor: Decimal) -> bool:
    """`PromptFactor.raise_to` in a worker thread, then kept in this process's cache again (a load that read the
    database before the row may have landed meanwhile). False when the database failed it: the factor is kept to be
    written again once it is back (`directory.unwritten_prompt_factors`)."""
    source, scope = endpoint.model_copy
    key = (endpoint.id, endpoint.model_copy)
    try:
        raised = await in_worker_thread(PromptFactor.raise_to)(endpoint.id, source, scope, factor)
    except (DatabaseError, InterfaceError) as exc:
        logger.warning("endpoint %s: its prompt factor %s could not be written, kept to write again: %r", endpoint.id,
                       factor, exc)
        _keep_unwritten_prompt_factor(endpoint, factor)
        return False
    except Exception as exc:  # noqa: BLE001 - a measure of the loss: never fail the call's end for it
        logger.warning("endpoint %s: its prompt factor %s could not be written: %r", endpoint.id, factor, exc)
        return True
    finally:
        if _writing_prompt_factors.get(key) == factor:  # a larger one's write, started since, is its own
            del _writing_prompt_factors[key]
    directory.keep_prompt_factor(endpoint, factor)
    if raised:
        logger.warning("endpoint %s: a prompt ran past its bound; its prompts are reserved %s× their bound from now on",
                       endpoint.id, factor)
    if raised and factor > PROMPT_FACTOR_WARNING:
        logger.warning("endpoint %s: its prompt factor rose to %s×, past %s×: its calls reserve far more than estimated "
                       "and may be refused for credit, caps or tokens per minute (said in the refusal); staff can "
                       "reset it in the admin", endpoint.id, factor, PROMPT_FACTOR_WARNING)
    return True


def _keep_unwritten_prompt_factor(endpoint: EndpointInfo, factor: Decimal) -> None:
    """Keep a factor the database failed to write (the largest per copy), and write it again from a task of this
    loop that runs while any is kept."""
    global _retrying_prompt_factors
    directory.keep_unwritten_prompt_factor(endpoint, factor)
    loop = asyncio.get_running_loop()
    retrying = _retrying_prompt_factors
    if retrying is None or retrying.done() or retrying.get_loop() is not loop:
        _retrying_prompt_factors = loop.create_task(_write_unwritten_prompt_factors())


async def _write_unwritten_prompt_factors() -> None:
    """Write the factors the database failed to, every `PROMPT_FACTOR_RETRY_S` (one try a round while it is still
    away); ends once none is left (an idle loop keeps no task)."""
    while directory.unwritten_prompt_factors:
        await asyncio.sleep(PROMPT_FACTOR_RETRY_S)
        for key in list(directory.unwritten_prompt_factors):
            endpoint, factor = directory.unwritten_prompt_factors.pop(key, (None, None))
            if endpoint is not None and not await _write_prompt_factor(endpoint, factor):
                break  # kept again: the database is still away


def _retrieve(future: asyncio.Future) -> None:
    """Takes a finished future's exception (one no caller awaited any more is otherwise logged as never retrieved)."""
    if not future.cancelled():
        future.exception()


class _Watcher:
    """`InferenceCall._watch_disconnect` for the current task, started `WATCH_DISCONNECT_AFTER_S` from now."""

    __slots__ = ("_call", "_work", "_timer", "_task")

    def __init__(self, call: InferenceCall):
        self._call, self._work, self._task = call, asyncio.current_task(), None
        self._timer = asyncio.get_running_loop().call_later(WATCH_DISCONNECT_AFTER_S, self._start)

    def _start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._call._watch_disconnect(self._work))

    def stop(self) -> None:
        self._timer.cancel()
        if self._task is not None:
            self._task.cancel()
