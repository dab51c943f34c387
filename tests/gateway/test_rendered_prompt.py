"""How a cut `/v1/responses` stream's prompt is counted (`endpoints.gateway.rendered_prompt`, asked by
`InferenceCall._count_cut_prompt`): which replicas are asked, within one bound, and what their answers may cost the
gateway. Against engines scripted in the test (an asyncio server each); the real engine's count is checked by
`test_responses_stream_cuts_vllm.py`, the whole billed stream by `test_responses_stream_cuts.py`."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from endpoints.gateway import directory, upstream
from endpoints.gateway.call import InferenceCall
from endpoints.gateway.directory import ReplicaInfo
from endpoints.gateway.tally import UsageTally

ENDPOINT_ID = "e-render"
GENERATION = 3
BODY = b'{"model":"m","input":"hi","stream":true}'


@dataclass
class ScriptedEngine:
    """An engine's `/v1/responses/render`: answers `num_tokens` token ids (and `extra` fields) after `delay_s`."""

    num_tokens: int = 7
    delay_s: float = 0.0
    extra: dict = field(default_factory=dict)
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
        self.bodies.append(await reader.readexactly(length))
        await asyncio.sleep(self.delay_s)
        answer = json.dumps({"token_ids": list(range(self.num_tokens)), **self.extra}).encode()
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(answer)
        )
        writer.write(answer)
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
    call.endpoint = SimpleNamespace(id=ENDPOINT_ID, engine_generation=GENERATION, max_model_len=4096)
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
