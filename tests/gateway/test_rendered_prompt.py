"""How a cut `/v1/responses` stream's prompt is counted (`endpoints.gateway.rendered_prompt`, asked by
`InferenceCall._count_cut_prompt`): which replicas are asked, within one bound, and what their answers may cost the
gateway. Against engines scripted in the test (an asyncio server each); the real engine's count is checked by
`test_responses_stream_cuts_vllm.py`, the whole billed stream by `test_responses_stream_cuts.py`."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from endpoints.gateway import directory, metrics, rendered_prompt, upstream
from endpoints.gateway.call import InferenceCall
from endpoints.gateway.directory import ReplicaInfo
from endpoints.gateway.tally import UsageTally

ENDPOINT_ID = "e-render"
GENERATION = 3
MAX_MODEL_LEN = 4096
BODY = b'{"model":"m","input":"hi","stream":true}'
DISABLED = json.dumps(
    {
        "error": {
            "message": "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them.",
            "type": "PermissionDeniedError",
            "param": None,
            "code": 403,
        }
    }
).encode()
MODEL_NOT_FOUND = json.dumps(
    {
        "error": {
            "message": "The model `m` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
).encode()


@pytest.fixture(autouse=True)
def _no_refusal_remembered():
    rendered_prompt._refusing.clear()
    yield
    rendered_prompt._refusing.clear()


@dataclass
class ScriptedEngine:
    """An engine's `/v1/responses/render`, answering after `delay_s` as vLLM 0.32's does: the prompt's `num_tokens`
    token ids (each `token_id`, else counting up), and its images' processed tensors (`tensor_bytes` of them, in
    base64) unless the body asks `"mm_payload": "none"` (vLLM's default is "tensors"), or the engine `ignores_it`."""

    num_tokens: int = 7
    token_id: int | None = None
    delay_s: float = 0.0
    tensor_bytes: int = 0
    ignores_it: bool = False
    # Another status than 200 answers `refusal` instead: by default vLLM's own answer when started without
    # `--enable-scale-out` (a 403).
    status: int = 200
    refusal: bytes = DISABLED
    bodies: list[bytes] = field(default_factory=list)
    address: str = ""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(
            next(
                line.split(b":")[1]
                for line in head.lower().split(b"\r\n")
                if line.startswith(b"content-length")
            )
        )
        body = await reader.readexactly(length)
        self.bodies.append(body)
        await asyncio.sleep(self.delay_s)
        if self.status != 200:
            writer.write(
                b"HTTP/1.1 %d Refused\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (self.status, len(self.refusal), self.refusal)
            )
            await writer.drain()
            writer.close()
            return
        token_ids = (
            [self.token_id] * self.num_tokens if self.token_id is not None else list(range(self.num_tokens))
        )
        answer = {"request_id": "resp-x", "token_ids": token_ids, "sampling_params": {"max_tokens": 1000}}
        if self.tensor_bytes and (
            self.ignores_it or json.loads(body).get("mm_payload", "tensors") == "tensors"
        ):
            answer["features"] = {"kwargs_data": {"image": ["A" * self.tensor_bytes]}}
        encoded = json.dumps(answer, separators=(",", ":")).encode()
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(encoded)
        )
        writer.write(encoded)
        await writer.drain()
        writer.close()

    def replica(self, replica_id: str) -> ReplicaInfo:
        return ReplicaInfo(replica_id, self.address, generation=GENERATION)


async def _started(*engines: ScriptedEngine) -> list[asyncio.Server]:
    servers = []
    for engine in engines:
        server = await asyncio.start_server(engine.handle, "127.0.0.1", 0)
        engine.address = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        servers.append(server)
    return servers


def _cut_call(
    served: ReplicaInfo, client: upstream.UpstreamClient, *, replica_failed: bool = False
) -> InferenceCall:
    call = object.__new__(InferenceCall)
    call.endpoint = SimpleNamespace(id=ENDPOINT_ID, engine_generation=GENERATION, max_model_len=MAX_MODEL_LEN)
    call.replica, call.adapter, call._replica_failed = served, None, replica_failed
    call.request = SimpleNamespace(upstream_body=lambda media_scope: BODY)
    call.caller = SimpleNamespace(limit_subject="key-1")
    call.client, call.request_id, call.usage = client, "req-render", UsageTally()
    call.usage.num_output_events = 50
    return call


def _count_cut_prompt(
    served: ScriptedEngine,
    *,
    held: list[ScriptedEngine] = (),
    replica_failed: bool = False,
    held_since: float | None = None,
) -> int:
    """The prompt tokens a stream cut on `served` is billed, the directory holding `held` (loaded at `held_since`)."""

    async def main() -> int:
        servers = await _started(served, *held)
        client = upstream.UpstreamClient()
        directory._replicas.forget(ENDPOINT_ID)
        if held:
            directory._replicas.entries[ENDPOINT_ID] = (
                time.monotonic() if held_since is None else held_since,
                [engine.replica(f"r-held-{i}") for i, engine in enumerate(held)],
            )
        try:
            call = _cut_call(served.replica("r-served"), client, replica_failed=replica_failed)
            await call._count_cut_prompt()
            return call.usage.prompt_tokens
        finally:
            directory._replicas.forget(ENDPOINT_ID)
            await client.close()
            for server in servers:
                server.close()

    return asyncio.run(main())


def test_a_cut_streams_prompt_is_counted_by_its_replica_without_reading_the_replica_list_from_the_database(
    monkeypatch,
):
    # Before, the count first loaded the endpoint's READY replicas (none cached: a long stream, no other call), outside
    # its 4 s bound: 5-10 s on a PostgreSQL outage, past a stopping process's wait for its calls' usage rows.
    loads = []

    async def load(endpoint_id):
        loads.append(endpoint_id)
        return []

    monkeypatch.setattr(directory._replicas, "_load", load)
    assert _count_cut_prompt(ScriptedEngine(num_tokens=30)) == 30
    assert loads == []


def test_a_cut_stream_whose_replica_failed_is_counted_by_another_the_directory_holds():
    # Guards the flow kept: the others come from what the directory holds (passes before and after).
    served, survivor = ScriptedEngine(num_tokens=99), ScriptedEngine(num_tokens=30)
    assert _count_cut_prompt(served, held=[survivor], replica_failed=True) == 30
    assert (len(served.bodies), len(survivor.bodies)) == (0, 1)


def test_a_replica_list_held_too_long_to_trust_is_not_asked():
    # A list past the directory's trust (`Memo.held`) may name an engine gone since, its address another's now: with
    # its own replica failed, the stream is billed its deltas alone.
    served, stale = ScriptedEngine(num_tokens=30), ScriptedEngine(num_tokens=99)
    assert _count_cut_prompt(served, held=[stale], replica_failed=True, held_since=time.monotonic() - 60) == 0
    assert stale.bodies == []


def test_a_replica_that_stalls_leaves_the_next_one_its_share_of_the_wait():
    # Before, the served replica (alive, its API stalled) took the whole 4 s and the next was never asked: the stream
    # was billed its deltas alone.
    stalled, good = ScriptedEngine(num_tokens=99, delay_s=3600), ScriptedEngine(num_tokens=30)
    assert _count_cut_prompt(stalled, held=[good]) == 30
    assert (len(stalled.bodies), len(good.bodies)) == (1, 1)


def test_a_replica_that_answers_within_its_share_is_the_only_one_asked():
    # Guards the common case (passes before and after): the served replica's count, no other engine bothered.
    served, other = ScriptedEngine(num_tokens=30), ScriptedEngine(num_tokens=99)
    assert _count_cut_prompt(served, held=[other]) == 30
    assert (len(served.bodies), len(other.bodies)) == (1, 0)


def test_a_render_answer_carries_no_image_tensors():
    # vLLM's render answers each image's processed tensors by default (`mm_payload: "tensors"`): ~55 MiB for one large
    # image, read whole and parsed on the gateway's loop; two passed `upstream.MAX_WHOLE_BODY_BYTES`, and before, the
    # count was dropped: such a prompt cost nothing. Asked for none, the answer is its token ids.
    engine = ScriptedEngine(num_tokens=2400, tensor_bytes=70 * 1024 * 1024)
    assert _count_cut_prompt(engine) == 2400
    assert json.loads(engine.bodies[0]) == json.loads(BODY) | {"mm_payload": "none"}


def test_a_render_answer_larger_than_its_prompts_token_ids_is_not_read():
    # An engine that sends tensors all the same (older, or not vLLM): its answer is read up to what the largest prompt's
    # token ids take, then dropped, the stream billed its deltas alone. Before, ~12 MiB were held and parsed.
    engine = ScriptedEngine(num_tokens=2400, tensor_bytes=12 * 1024 * 1024, ignores_it=True)
    assert _count_cut_prompt(engine) == 0


def test_a_render_answer_of_a_whole_context_of_the_longest_token_ids_is_read():
    # Guards the bound's size (passes before and after): every token of the context, each a 6-digit id.
    assert _count_cut_prompt(ScriptedEngine(num_tokens=MAX_MODEL_LEN, token_id=262_143)) == MAX_MODEL_LEN


def _num_refusals(status: int) -> float:
    return (
        metrics.REGISTRY.get_sample_value("inferplane_prompt_render_refusals_total", {"status": str(status)})
        or 0
    )


def test_replicas_whose_engines_refuse_the_render_leave_the_count_to_another_and_are_asked_last_from_then_on(
    caplog,
):
    # Engines started before `--enable-scale-out` answer the render 403 until they restart. Before, the two asked (the
    # served replica and the next) both refused and the third was never asked: the stream's prompt was free, on every
    # cut stream they served, and nothing said which engines needed a restart.
    served, older, good = (
        ScriptedEngine(status=403),
        ScriptedEngine(status=403),
        ScriptedEngine(num_tokens=30),
    )
    refusals_before = _num_refusals(403)
    with caplog.at_level("WARNING", logger="inferplane.requests"):
        assert _count_cut_prompt(served, held=[older, good]) == 30
    assert (len(served.bodies), len(older.bodies), len(good.bodies)) == (1, 1, 1)
    assert _num_refusals(403) == refusals_before + 2
    assert "replica r-served refuses to render prompts (HTTP 403)" in caplog.text
    assert "replica r-held-0 refuses to render prompts (HTTP 403)" in caplog.text
    # The next cut stream of the same replica asks the one that answers first.
    assert _count_cut_prompt(served, held=[older, good]) == 30
    assert (len(served.bodies), len(older.bodies), len(good.bodies)) == (1, 1, 2)


def test_a_replica_without_the_render_route_is_remembered_as_one_that_refuses_it():
    # A vLLM older than the route answers FastAPI's 404 (passes the first count before, the second failed before).
    served, good = (
        ScriptedEngine(status=404, refusal=b'{"detail":"Not Found"}'),
        ScriptedEngine(num_tokens=30),
    )
    assert _count_cut_prompt(served, held=[good]) == 30
    assert _count_cut_prompt(served, held=[good]) == 30
    assert (len(served.bodies), len(good.bodies)) == (1, 2)


def test_a_404_naming_the_requests_own_model_is_not_remembered_against_the_replica():
    # Guards the per-request refusal (passes before and after): vLLM's own 404 (a model or adapter it does not hold)
    # says nothing of the next request, so the served replica stays the first asked.
    served, good = ScriptedEngine(status=404, refusal=MODEL_NOT_FOUND), ScriptedEngine(num_tokens=30)
    assert _count_cut_prompt(served, held=[good]) == 30
    assert _count_cut_prompt(served, held=[good]) == 30
    assert (len(served.bodies), len(good.bodies)) == (2, 2)


def test_a_fleet_whose_every_engine_refuses_the_render_is_asked_by_each_cut_stream_no_more_than_before(caplog):
    # Before: each refusal put one more replica in its place, those known to refuse among them, so with every engine
    # started before the flag each cut stream sent its whole body to all 10 (30 renders and 30 warnings for 3 cuts).
    served, held = ScriptedEngine(status=403), [ScriptedEngine(status=403) for _ in range(9)]
    with caplog.at_level("WARNING", logger="inferplane.requests"):
        for _ in range(3):
            assert _count_cut_prompt(served, held=held) == 0
    asks = len(served.bodies) + sum(len(engine.bodies) for engine in held)
    # the first cut learns which refuse (each asked once), the next two ask `MAX_REPLICAS_ASKED` each
    assert asks == 10 + 2 * rendered_prompt.MAX_REPLICAS_ASKED
    assert caplog.text.count("refuses to render prompts") == 10


def test_a_404_too_large_to_read_is_not_remembered_as_a_refusal():
    # vLLM's own 404 (a model or adapter it does not hold) past the answer's bound is dropped unread: nothing says it
    # is a route the engine lacks. Before: the served replica was asked last for 10 minutes.
    large = json.dumps({"error": {"message": "x" * (MAX_MODEL_LEN * 8 + 70 * 1024), "code": 404}}).encode()
    served, good = ScriptedEngine(status=404, refusal=large), ScriptedEngine(num_tokens=30)
    assert _count_cut_prompt(served, held=[good]) == 30
    assert "r-served" not in rendered_prompt._refusing


@pytest.mark.django_db(transaction=True)
def test_a_stream_keeping_its_replicas_held_backs_off_while_postgresql_refuses_connections(monkeypatch):
    # Before: each streaming endpoint's reload every 2 s took a worker thread for a connect while PostgreSQL was away,
    # and the process's other look-ups queued behind them.
    from django.db import OperationalError, connections

    from controlplane import worker_threads
    from tests.outages import database_refusing_connections

    endpoint_id = str(uuid.uuid4())
    loads = []
    load = directory._replicas._load

    async def counted(*args):
        loads.append(args)
        return await load(*args)

    monkeypatch.setattr(directory._replicas, "_load", counted)
    directory._replicas.forget(endpoint_id)

    async def keep_held_twice():
        directory.keep_replicas_held(endpoint_id)
        reload = directory._replicas._loading.get(endpoint_id)
        await asyncio.wait([reload])
        assert isinstance(reload.exception(), OperationalError)
        directory._replicas_kept.discard(endpoint_id)  # as 2 s later
        directory.keep_replicas_held(endpoint_id)
        await asyncio.sleep(0)

    try:
        with database_refusing_connections():
            worker_threads.run_briefly(keep_held_twice())
    finally:
        directory._replicas_kept.discard(endpoint_id)
        directory._replicas_kept_failed.discard(endpoint_id)
        directory._replicas.forget(endpoint_id)
        connections.close_all()
    assert len(loads) == 1
