"""One inference call through the gateway, from reservation to usage row."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal

import aiohttp

from controlplane.redis_client import get_async_redis
from endpoints.gateway import directory, errors, limits, metrics, traffic
from endpoints.gateway.auth import Caller
from endpoints.gateway.directory import EndpointInfo, ReplicaInfo
from gpu_agent.notify import endpoint_ready_channel

logger = logging.getLogger("inferplane.requests")

COLD_START_POLL_S = 0.25
REWAKE_EVERY_S = 5.0
MAX_WAITING_PER_ENDPOINT = 256
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]


# What a failing replica raises: refused or dropped connections, truncated bodies, timeouts.
UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)


class ClientGone(Exception):
    """The client disconnected; stop working for it."""


class UpstreamUnavailable(Exception):
    """The replica failed before sending a byte: safe to retry elsewhere."""


def estimate_prompt_tokens(payload: dict, kind: str) -> int:
    """An upper bound on prompt tokens without a tokenizer: a byte-level BPE token is at least one byte."""
    if kind == "chat":
        total = 16
        for message in payload["messages"]:
            content = message.get("content")
            if isinstance(content, list):
                content = " ".join(part.get("text", "") for part in content if isinstance(part, dict))
            total += 8 + len(str(content or "").encode())
        return total
    prompt = payload["prompt"]
    if isinstance(prompt, str):
        return len(prompt.encode()) + 2
    if all(isinstance(item, int) for item in prompt):
        return len(prompt)
    return sum(len(str(item).encode()) + 2 for item in prompt)


@dataclass(slots=True)
class InferenceCall:
    request_id: str
    kind: str
    path: str
    caller: Caller
    endpoint: EndpointInfo
    payload: dict
    client: aiohttp.ClientSession
    receive: object
    send: object
    started_at: datetime
    stream: bool = False
    replica: ReplicaInfo | None = None
    served: bool = False  # a replica accepted the request: a usage row is owed
    first_token_at: datetime | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    status: str = "ok"
    cold_start_s: float = 0.0
    response_started: bool = False
    outstanding_replica_id: str | None = None  # the replica whose outstanding count this request holds
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    _started_monotonic: float = field(default_factory=time.monotonic)

    async def run(self) -> None:
        from billing import quota

        self.stream = bool(self.payload.get("stream", False))
        max_tokens = self.payload.get("max_completion_tokens") or self.payload.get("max_tokens")
        if max_tokens is not None and max_tokens > self.endpoint.max_model_len:
            raise errors.invalid_request(
                f"max_tokens is {max_tokens}, but this model's context is {self.endpoint.max_model_len} tokens.",
                param="max_tokens",
            )
        if self.endpoint.paused:
            raise errors.OpenAIError(503, f"The endpoint '{self.endpoint.name}' is paused.", type="server_error",
                                     code="endpoint_paused", headers={"retry-after": "60"})
        prompt_estimate = estimate_prompt_tokens(self.payload, self.kind)
        if prompt_estimate > self.endpoint.max_model_len * 8:
            raise errors.invalid_request(
                f"Your prompt is far longer than this model's context of {self.endpoint.max_model_len} tokens.",
                param="messages" if self.kind == "chat" else "prompt", code="context_length_exceeded",
            )
        worst_case = quota.max_cost(self.endpoint, prompt_estimate, max_tokens or self.endpoint.max_model_len)
        try:
            reservation = await quota.reserve(
                organization_id=self.caller.organization_id, api_key_id=self.caller.api_key_id,
                amount=worst_case, request_id=self.request_id,
            )
        except quota.QuotaExceeded as exc:
            raise errors.insufficient_quota(str(exc)) from None
        watcher = asyncio.create_task(self._watch_disconnect())
        try:
            replicas = await self._acquire_replicas()
            await self._proxy(replicas)
        except ClientGone:
            self.status = "client_aborted"
        except errors.OpenAIError as exc:
            if not self.response_started:
                raise
            self.status = "upstream_error"
            await self._send_event_error(exc)
        finally:
            watcher.cancel()
            await asyncio.shield(self._finish(reservation))

    # --- replicas and cold starts ---------------------------------------------------------
    async def _acquire_replicas(self) -> list[ReplicaInfo]:
        replicas = await directory.ready_replicas(self.endpoint.id)
        if replicas:
            # NOTE: one round trip counts the request in flight and picks its replica (see `_proxy`).
            index = await traffic.begin_request_and_pick(self.endpoint.id, self.request_id, [r.id for r in replicas])
            self.outstanding_replica_id = replicas[index].id
            return replicas
        if await traffic.num_waiting(self.endpoint.id) >= MAX_WAITING_PER_ENDPOINT:
            raise errors.no_capacity(f"Too many requests are waiting for '{self.endpoint.name}' to start.", 10)
        await traffic.begin_request(self.endpoint.id, self.request_id, waiting=True)
        metrics.waiting.labels(self.endpoint.name).inc()
        try:
            return await self._hold_for_cold_start()
        finally:
            metrics.waiting.labels(self.endpoint.name).dec()

    async def _hold_for_cold_start(self) -> list[ReplicaInfo]:
        from endpoints.gateway.wake import wake_endpoint

        held_from = time.monotonic()
        deadline = held_from + self.endpoint.cold_start_timeout_s
        await wake_endpoint(self.endpoint.id)
        if self.stream:
            await self._start_stream()
        # NOTE: the control plane publishes when a replica turns READY; polling remains the fallback.
        ready_signal = get_async_redis().pubsub(ignore_subscribe_messages=True)
        await ready_signal.subscribe(endpoint_ready_channel(self.endpoint.id))
        try:
            replicas = await self._wait_for_ready(ready_signal, deadline)
        finally:
            await ready_signal.unsubscribe()
            await ready_signal.aclose()
        self.cold_start_s = time.monotonic() - held_from
        metrics.cold_start.labels(self.endpoint.name).observe(self.cold_start_s)
        await traffic.promote_request(self.endpoint.id, self.request_id)
        return replicas

    async def _wait_for_ready(self, ready_signal, deadline: float) -> list[ReplicaInfo]:
        from endpoints.gateway.wake import wake_endpoint

        fresh, last_wake, last_progress = False, time.monotonic(), None
        while True:
            if self.disconnected.is_set():
                raise ClientGone()
            replicas = await directory.ready_replicas(self.endpoint.id, fresh=fresh)
            if replicas:
                return replicas
            now = time.monotonic()
            if now > deadline:
                raise errors.no_capacity(
                    f"No replica of '{self.endpoint.name}' became ready within {self.endpoint.cold_start_timeout_s} s.", 30
                )
            if now - last_wake > REWAKE_EVERY_S:
                await wake_endpoint(self.endpoint.id)
                last_wake = now
            if self.stream:
                progress = await directory.cold_start_progress(self.endpoint.id)
                if progress != last_progress:
                    await self._send_body(f": {progress}\n\n".encode())
                    last_progress = progress
            fresh = await ready_signal.get_message(timeout=COLD_START_POLL_S) is not None

    # --- proxying ----------------------------------------------------------------------------
    async def _proxy(self, replicas: list[ReplicaInfo]) -> None:
        tried: set[str] = set()
        for _attempt in range(2):  # a failure before the first byte is retried once, elsewhere
            candidates = [r for r in replicas if r.id not in tried]
            if not candidates:
                candidates = [r for r in await directory.ready_replicas(self.endpoint.id, fresh=True) if r.id not in tried]
            if not candidates:
                break
            picked = [r for r in candidates if r.id == self.outstanding_replica_id]  # picked when it began
            if picked:
                replica = picked[0]
            else:
                replica = candidates[await traffic.pick_replica([r.id for r in candidates])]
                self.outstanding_replica_id = replica.id
            tried.add(replica.id)
            metrics.inflight.labels(self.endpoint.name).inc()
            try:
                await self._forward(replica)
                return
            except UpstreamUnavailable as exc:
                logger.warning("request %s: replica %s unavailable before first byte: %s", self.request_id, replica.id, exc)
                directory.forget_replica(self.endpoint.id, replica.id)
                await traffic.release_replica(replica.id)
                self.outstanding_replica_id = None
            finally:
                metrics.inflight.labels(self.endpoint.name).dec()
        raise errors.upstream_failed("No replica could take the request; please retry.")

    def _upstream_payload(self) -> dict:
        payload = dict(self.payload)
        payload["model"] = self.endpoint.name
        if self.stream:
            # NOTE: usage on every chunk tells us the tokens delivered if the client leaves mid-stream;
            # what the client asked for is restored in `_transform`.
            payload["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        return payload

    async def _forward(self, replica: ReplicaInfo) -> None:
        request = self.client.post(
            replica.address.rstrip("/") + self.path, data=json.dumps(self._upstream_payload()).encode(),
            headers={"content-type": "application/json", "x-request-id": self.request_id},
        )
        try:
            response = await self._unless_disconnected(request)
        except UPSTREAM_ERRORS as exc:
            raise UpstreamUnavailable(f"{type(exc).__name__}: {exc}") from None
        try:
            if response.status >= 500:
                raise UpstreamUnavailable(f"HTTP {response.status}")
            if response.status >= 400:
                raise _engine_error(response.status, await response.read())
            self.replica = replica
            self.served = True
            if self.stream:
                await self._relay_stream(response)
            else:
                await self._relay_whole(response)
        finally:
            # NOTE: a response read to the end returns its connection to the pool; one left
            # unread (a client gone mid-stream) closes it, which aborts the engine's request.
            if response.content.at_eof():
                response.release()
            else:
                response.close()

    async def _relay_whole(self, response: aiohttp.ClientResponse) -> None:
        try:
            body = await self._unless_disconnected(response.read())
        except UPSTREAM_ERRORS as exc:
            self.status = "upstream_error"
            raise errors.upstream_failed(f"The replica failed mid-request ({type(exc).__name__}).") from None
        self._take_usage(json.loads(body).get("usage"))
        self.first_token_at = datetime.now(UTC)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"x-request-id", self.request_id.encode())]
        await self.send({"type": "http.response.start", "status": 200, "headers": headers})
        await self.send({"type": "http.response.body", "body": body})
        self.response_started = True

    async def _relay_stream(self, response: aiohttp.ClientResponse) -> None:
        await self._start_stream()
        options = self.payload.get("stream_options") or {}
        wants_usage = bool(options.get("include_usage"))
        wants_continuous = wants_usage and bool(options.get("continuous_usage_stats"))
        buffer = b""
        try:
            async for chunk in response.content.iter_any():
                buffer = await self._relay_events(buffer + chunk, wants_usage, wants_continuous)
        except UPSTREAM_ERRORS as exc:
            # Every event that arrived before the failure still reaches the client, and is billed.
            await self._relay_events(buffer + _arrived_before_failure(response), wants_usage, wants_continuous)
            self.status = "upstream_error"
            raise errors.upstream_failed(f"The replica failed mid-stream ({type(exc).__name__}).") from None

    async def _relay_events(self, buffer: bytes, wants_usage: bool, wants_continuous: bool) -> bytes:
        """Sends each complete SSE event in `buffer`; returns the incomplete rest."""
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            out, usage = self._transform(event, wants_usage, wants_continuous)
            if self.disconnected.is_set():
                raise ClientGone()
            if out is not None:
                await self._send_body(out + b"\n\n")
            # NOTE: counted only once sent: an aborted stream pays for what it received.
            self._take_usage(usage)
        return buffer

    def _transform(self, event: bytes, wants_usage: bool, wants_continuous: bool) -> tuple[bytes | None, dict | None]:
        if not event.startswith(b"data: ") or event == b"data: [DONE]":
            return event, None
        try:
            chunk = json.loads(event[6:])
        except json.JSONDecodeError:
            return event, None
        usage = chunk.get("usage")
        if chunk.get("choices") and self.first_token_at is None:
            self.first_token_at = datetime.now(UTC)
            metrics.time_to_first_token.labels(self.endpoint.name).observe(time.monotonic() - self._started_monotonic)
        if not chunk.get("choices") and usage is not None:  # the closing usage-only chunk
            return (event if wants_usage else None), usage
        if wants_continuous or "usage" not in chunk:
            return event, usage
        if wants_usage:
            chunk["usage"] = None
        else:
            del chunk["usage"]
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode(), usage

    def _take_usage(self, usage: dict | None) -> None:
        if not usage:
            return
        self.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        self.completion_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        self.cached_tokens = min(int(details.get("cached_tokens") or 0), self.prompt_tokens)

    # --- the client side ---------------------------------------------------------------------
    async def _start_stream(self) -> None:
        if self.response_started:
            return
        headers = SSE_HEADERS + [(b"x-request-id", self.request_id.encode())]
        await self.send({"type": "http.response.start", "status": 200, "headers": headers})
        self.response_started = True

    async def _send_body(self, data: bytes) -> None:
        await self.send({"type": "http.response.body", "body": data, "more_body": True})

    async def _send_event_error(self, exc: errors.OpenAIError) -> None:
        if self.disconnected.is_set():
            return
        await self._send_body(b"data: " + exc.body() + b"\n\n")

    async def _watch_disconnect(self) -> None:
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                self.disconnected.set()
                return

    async def _unless_disconnected(self, coroutine):
        task = asyncio.ensure_future(coroutine)
        waiter = asyncio.ensure_future(self.disconnected.wait())
        try:
            done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if task in done:
            return task.result()
        task.cancel()
        raise ClientGone()

    # --- the end -----------------------------------------------------------------------------
    async def _finish(self, reservation) -> None:
        from billing import ledger, quota

        finished_at = datetime.now(UTC)
        if self.response_started and self.stream and not self.disconnected.is_set():
            try:
                await self.send({"type": "http.response.body", "body": b"", "more_body": False})
            except Exception:  # noqa: BLE001 - the client may be gone already
                pass
        actual = ledger.cost_of(self.endpoint, self.prompt_tokens, self.cached_tokens, self.completion_tokens) if self.served else Decimal(0)
        try:
            # NOTE: also releases the replica that served it (or was picked when the client left).
            await traffic.end_request(self.endpoint.id, self.request_id, release=self.outstanding_replica_id)
            # NOTE: the ledger row first, then the settlement: if Redis loses its counters in
            # between, they are rebuilt from the ledger, which already has this request.
            try:
                if self.served:
                    await ledger.arecord_usage(ledger.UsageReport(
                        request_id=self.request_id, organization_id=self.caller.organization_id,
                        api_key_id=self.caller.api_key_id, endpoint_id=self.endpoint.id,
                        replica_id=self.replica.id if self.replica else None,
                        prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens,
                        completion_tokens=self.completion_tokens, started_at=self.started_at,
                        first_token_at=self.first_token_at, finished_at=finished_at, status=self.status,
                        cold_start_s=round(self.cold_start_s, 3),
                    ))
                    await limits.add_tokens(self.caller.limit_subject, self.caller.tokens_per_minute,
                                            self.prompt_tokens + self.completion_tokens)
            finally:
                await quota.settle(reservation, actual)
        finally:
            name = self.endpoint.name
            outcome = self.status if self.served else "not_served"
            metrics.requests_total.labels(name, outcome).inc()
            metrics.request_duration.labels(name).observe(time.monotonic() - self._started_monotonic)
            for kind, value in (("prompt", self.prompt_tokens), ("cached", self.cached_tokens), ("completion", self.completion_tokens)):
                if value:
                    metrics.tokens_total.labels(name, kind).inc(value)
            logger.info(
                "request_id=%s org=%s key=%s endpoint=%s replica=%s status=%s prompt=%d cached=%d completion=%d "
                "cold_start_s=%.3f duration_s=%.3f",
                self.request_id, self.caller.organization_id, self.caller.api_key_id, name,
                self.replica.id if self.replica else "-", outcome, self.prompt_tokens, self.cached_tokens,
                self.completion_tokens, self.cold_start_s, time.monotonic() - self._started_monotonic,
            )


def _arrived_before_failure(response: aiohttp.ClientResponse) -> bytes:
    """Bytes the replica sent that were not read yet when its connection failed.

    NOTE: once aiohttp's stream holds an error, its public reads raise at once and hide data already
    received (all of a short stream can arrive with the failure); `_read_nowait` is the one read
    that skips that check.
    """
    try:
        return response.content._read_nowait(-1)
    except Exception:  # noqa: BLE001 - an aiohttp without it: nothing more to relay
        return b""


def _engine_error(status: int, body: bytes) -> errors.OpenAIError:
    """The engine refused the request (a 4xx): relay its message in OpenAI's shape."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        data = {}
    detail = data.get("error") if isinstance(data.get("error"), dict) else data
    message = detail.get("message") or body.decode(errors="replace")[:500] or f"HTTP {status}"
    code = detail.get("code") if isinstance(detail.get("code"), str) else None
    return errors.OpenAIError(status, message, param=detail.get("param"), code=code)
