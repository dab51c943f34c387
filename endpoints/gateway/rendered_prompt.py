"""The prompt tokens of a `/v1/responses` stream cut before its last event, counted by an engine of its endpoint.

vLLM's Responses stream says its usage only in its last event (`response.completed`), and nothing running before it
(chat's `continuous_usage_stats` has no counterpart). A client that leaves, or stops reading, is read on to that event
(`InferenceCall._reads_on_for_usage`); a stream the gateway cannot read to its end has no figure: its replica failed,
its engine wrote `event: error`, its process's drain reached its bound. Billed its delta events alone, such a stream
had its prompt prefilled free: a 30k-token prompt, cut after its first delta, cost nothing of it.

So the engine is asked: `POST /v1/responses/render` (vLLM's `--enable-scale-out`, which every engine starts with,
`gpu_agent.runtime.engine`) renders the very body the stream was sent (asking for no image tensors: `NO_TENSORS`)
through the same chat template and tokenizer and answers its token ids, without generating. Their number is the
`input_tokens` the stream's last event would have said (`tests/gateway/test_responses_stream_cuts_vllm.py` checks it
against a real engine), asked of the replica that served it (unless that replica failed) or another of the same
configuration holding its adapter, as the gateway already knows them (`directory.held_ready_replicas`: never a
database read). Asked only once the engine wrote an event from its output (a delta, or the announce of a function
call before its arguments' first delta: `sse.is_responses_output`), which means the whole prompt was prefilled; and
only after the stream's end was sent to its client.

NOTE: a stream cut before that (vLLM writes `response.created` and `response.in_progress` as it starts, before the
engine's first step) is billed no prompt: it may have been queued, or prefilled in part (a replica lost mid-prefill, a
drain's bound reached while a long prompt is prefilled), and its client got nothing of it; a chat stream, whose first
chunk with usage comes with the engine's first output, is billed none then either. The render could count it, but
what the engine did of it is not known.

An engine that does not answer within `RENDER_TIMEOUT_S` (none left, an engine older than the flag) leaves the stream
its deltas' floor, no prompt, as before.

An engine started before the flag (it takes effect only at a restart) answers the render 403 (vLLM's "Scale-out
endpoints are disabled"), a vLLM without the route 404: a refusal takes none of the count's wait (another replica is
asked in its place, never one remembered as refusing), the replica is remembered (`_refusing`, for `REFUSALS_KEPT_S`)
and asked after every other one, and each refusal is counted (`metrics.prompt_render_refusals`) and logged, naming the
replica to restart, when the replica was not remembered already. Before, two refusing replicas asked first (of the two
asked) left the prompt free, on every cut stream they served. A fleet whose every engine refuses is asked
`MAX_REPLICAS_ASKED` times a cut stream, as before the refusal memory.

The prompt is billed at the input price: as a chat stream cut mid-way, nothing says what the prefix cache held.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from controlplane.credential_lookups import ExpiringSet
from endpoints.gateway import metrics, upstream
from endpoints.gateway.directory import ReplicaInfo

logger = logging.getLogger("inferplane.requests")

RENDER_PATH = "/v1/responses/render"
# The longest a cut stream's end waits for its prompt's count, all replicas asked together: within a stopping process's
# wait for its calls' finishes (`call.SHUTDOWN_FINISH_WAIT_S`), which its usage row must still make.
RENDER_TIMEOUT_S = 4.0
MAX_REPLICAS_ASKED = 2
# A replica's own share of the wait: the next is asked once one fails, or has not answered within its share (alive,
# its API stalled), while the first may still answer; the first count to come is taken, the other ask dropped.
# NOTE: one after another, a stalled first replica took the whole wait, and the second was never asked.
ASK_NEXT_AFTER_S = RENDER_TIMEOUT_S / MAX_REPLICAS_ASKED
# NOTE: the render is asked for no image tensors (`"mm_payload": "none"`, vLLM's `ResponsesRequest`): by default
# ("tensors") its answer carried each image's processed pixels, ~55 MiB for one large image, read whole and parsed on
# the event loop, and two passed `upstream.MAX_WHOLE_BODY_BYTES`: the count dropped, such a prompt was free.
NO_TENSORS = b'"mm_payload":"none"'
# The answer is read up to what its token ids for a whole context take (a token id and its comma in compact JSON: 8
# bytes covers ids under 10 million; 1 MiB for a 128k context, 8 MiB for 1M), plus the body sent (the parameters it
# echoes are at most that) and its own fields (an image's hash and place, the sampling defaults): a larger answer
# (an engine that sent tensors all the same) is dropped unread, the stream billed its deltas alone.
BYTES_PER_TOKEN_ID = 8
ANSWER_FIELDS_BYTES = 64 * 1024
# Replicas (by id) whose engine refused the render: asked last for this long, then in their turn again (an
# engine restarted since, with the flag, counts again). Bounded as every per-process memory of the gateway.
REFUSALS_KEPT_S = 600.0
MAX_REFUSALS_KEPT = 4096
_refusing = ExpiringSet(REFUSALS_KEPT_S, max_entries=MAX_REFUSALS_KEPT)
_REFUSED = -1  # `_ask`'s answer for a replica that refused the render (`_note_refusal`)


async def count_prompt_tokens(
    client: upstream.UpstreamClient,
    replicas: list[ReplicaInfo],
    body: bytes,
    request_id: str,
    *,
    max_model_len: int,
) -> int | None:
    """The prompt tokens `body` (a `/v1/responses` body as its engine was sent it, of an endpoint whose context is
    `max_model_len` tokens) renders to, by the first of `replicas` that answers (each asked in turn, the next after a
    failure or `ASK_NEXT_AFTER_S`; those that refused the render before, last; `MAX_REPLICAS_ASKED`, and one more for
    each refusal); None when none does within `RENDER_TIMEOUT_S`."""
    max_answer_bytes = max_model_len * BYTES_PER_TOKEN_ID + len(body) + ANSWER_FIELDS_BYTES
    body = _without_tensors(body)
    # NOTE: a stable sort: the served replica stays first unless it refused the render before
    ordered = sorted(replicas, key=_refused_before)
    # NOTE: a replica that refused before is never the one more asked in a refusal's place: with a whole fleet
    # refusing (engines started before the flag), each cut stream would ask every replica, its whole body each time.
    waiting = ordered[:MAX_REPLICAS_ASKED]
    spare = [replica for replica in ordered[MAX_REPLICAS_ASKED:] if not _refused_before(replica)]
    asked: set[asyncio.Task] = set()
    try:
        async with asyncio.timeout(RENDER_TIMEOUT_S):
            while waiting or asked:
                if waiting:
                    replica = waiting.pop(0)
                    asked.add(
                        asyncio.ensure_future(_ask(client, replica, body, request_id, max_answer_bytes))
                    )
                answered, asked = await asyncio.wait(
                    asked,
                    timeout=ASK_NEXT_AFTER_S if waiting else None,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                for task in answered:
                    count = task.result()
                    if count == _REFUSED:
                        # NOTE: a refusal takes none of the wait: one more replica in its place
                        if spare:
                            waiting.append(spare.pop(0))
                    elif count is not None:
                        return count
    except TimeoutError:
        logger.warning(
            "request %s: no engine counted its cut stream's prompt within %.0f s",
            request_id,
            RENDER_TIMEOUT_S,
        )
    finally:
        for task in asked:
            task.cancel()
        if asked:
            await asyncio.wait(asked)  # each closes its connection as it is cancelled
    return None


def _refused_before(replica: ReplicaInfo) -> bool:
    return replica.id in _refusing


def _note_refusal(replica: ReplicaInfo, status: int, answer: bytes | None, request_id: str) -> bool:
    """Whether the replica's answer says its engine serves no render at all (not this request's fault): HTTP 403
    (vLLM started without `--enable-scale-out`), or a 404 that is not vLLM's own error (a route it lacks; vLLM's
    404 names a model or adapter it does not hold, this request's alone). Such a replica is remembered and counted,
    and logged when it was not remembered already (one line a replica, not one a cut stream)."""
    # NOTE: a 404 too large to read (`answer` None) is not taken for a route the engine lacks: it may be vLLM's own.
    if status != 403 and not (status == 404 and answer is not None and not _is_engine_error(answer)):
        return False
    known = replica.id in _refusing
    _refusing.add(replica.id)
    metrics.prompt_render_refusals.labels(str(status)).inc()
    if known:
        return True
    logger.warning(
        "request %s: replica %s refuses to render prompts (HTTP %d): its engine was started without "
        "--enable-scale-out; restart it. Its cut Responses streams' prompts are counted by other replicas, or free.",
        request_id,
        replica.id,
        status,
    )
    return True


def _is_engine_error(answer: bytes | None) -> bool:
    try:
        parsed = json.loads(answer or b"")
    except ValueError:
        return False
    return isinstance(parsed, dict) and "error" in parsed


def _without_tensors(body: bytes) -> bytes:
    """`body` (a JSON object) asking its render for no tensors: the field is added last, so it wins over one the
    body holds (a JSON object's last key does, in vLLM's parse), never re-encoding the body on the event loop."""
    head = body.rstrip()[:-1].rstrip()  # without its closing brace
    return head + (b"" if head == b"{" else b",") + NO_TENSORS + b"}"


async def _ask(
    client: upstream.UpstreamClient, replica: ReplicaInfo, body: bytes, request_id: str, max_answer_bytes: int
) -> int | None:
    try:
        response = await client.post(
            replica.address,
            RENDER_PATH,
            body,
            {
                "content-type": "application/json",
                "x-request-id": request_id,
                "authorization": replica.authorization,
            },
        )
        try:
            answer = await _read_at_most(response, max_answer_bytes)
        finally:
            response.close()  # one not read to its end is dropped with its connection
    except upstream.UpstreamError as exc:
        logger.warning("request %s: replica %s could not count its prompt: %s", request_id, replica.id, exc)
        return None
    if response.status != 200:
        if _note_refusal(replica, response.status, answer, request_id):
            return _REFUSED
        logger.warning(
            "request %s: replica %s answered its prompt's count with HTTP %d",
            request_id,
            replica.id,
            response.status,
        )
        return None
    if answer is None:
        logger.warning(
            "request %s: replica %s answered its prompt's count with more than %d bytes",
            request_id,
            replica.id,
            max_answer_bytes,
        )
        return None
    return _num_token_ids(answer)


async def _read_at_most(response: upstream.Response, max_bytes: int) -> bytes | None:
    """The answer's body, or None once it passes `max_bytes` (the rest unread)."""
    parts, num_bytes = [], 0
    async with contextlib.aclosing(response.chunks()) as chunks:
        async for chunk in chunks:
            num_bytes += len(chunk)
            if num_bytes > max_bytes:
                return None
            parts.append(chunk)
    return b"".join(parts)


def _num_token_ids(answer: bytes) -> int | None:
    try:
        token_ids = json.loads(answer).get("token_ids")
    except (ValueError, AttributeError):
        return None
    if not isinstance(token_ids, list) or not token_ids:
        return None
    return len(token_ids)
